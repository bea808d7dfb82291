"""The GRPO objective and its options (``rlboost_hpc/trainer/algorithms/grpo.py``): every mode against values
computed by hand, the failing inputs of issue 31 as regression tests (one token far below the reference; a
behaviour ratio past the cap), and the torch backend's streamed gradient for each loss aggregation."""
from __future__ import annotations

import math

import pytest
import torch

from rlboost_hpc.trainer.algorithms.grpo import (GRPOOptions, behaviour_weights, finish_stats, gradient_scale,
                                                 group_advantages, grpo_loss, kl_estimate, stats_to_floats,
                                                 merge_stats, step_normaliser)

LN2, LN3 = math.log(2.0), math.log(3.0)


# ------------------------------------------------------------------------------------------------ advantages
def test_group_advantages_with_and_without_the_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # mean 0.25, population std sqrt(0.25 · 0.75) = 0.4330127
    assert group_advantages(r).tolist() == pytest.approx([1.7320508, -0.5773503, -0.5773503, -0.5773503], abs=1e-5)
    assert group_advantages(r, std_norm=False).tolist() == [0.75, -0.25, -0.25, -0.25]  # Dr. GRPO: centred only
    assert group_advantages(torch.ones(4)).tolist() == [0.0] * 4  # equal rewards: 0, never NaN


# ------------------------------------------------------------------------------------------------ aggregation
def _batch():
    """B = 2, T = 3, on-policy (ratio 1): response 0 has 2 loss tokens, response 1 has 3; advantages 1 and −2."""
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return logp, mask, torch.tensor([1.0, -2.0])


@pytest.mark.parametrize("mode, loss_sum, grads, normaliser", [
    # GRPO: −Σ_i (1/|o_i|) Σ_t A_i = −(2/2 − 6/3) = 1; ∂/∂logp = −A_i/|o_i|; normaliser: 2 responses
    ("seq_mean_token_mean", 1.0, [[-0.5, -0.5, 0.0], [2 / 3, 2 / 3, 2 / 3]], 2.0),
    # DAPO: −Σ_i Σ_t A_i = −(2 − 6) = 4; ∂/∂logp = −A_i; normaliser: 5 loss tokens
    ("token_mean", 4.0, [[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0]], 5.0),
    # Dr. GRPO with L = 10: −Σ_i Σ_t A_i / 10 = 0.4; ∂/∂logp = −A_i/10; normaliser: 2 responses
    ("seq_mean_token_sum_norm", 0.4, [[-0.1, -0.1, 0.0], [0.2, 0.2, 0.2]], 2.0),
])
def test_each_loss_aggregation_by_hand(mode, loss_sum, grads, normaliser):
    logp, mask, adv = _batch()
    opts = GRPOOptions(loss_aggregation=mode, max_response_tokens=10)
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, opts)
    loss.backward()
    assert loss.item() == pytest.approx(loss_sum)
    assert logp.grad.tolist() == [pytest.approx(g) for g in grads]
    assert step_normaliser(opts, responses=2, loss_tokens=5) == normaliser
    assert stats_to_floats(stats)["loss_tokens"] == 5.0


def test_token_mean_rescales_streamed_gradients_to_the_steps_token_count():
    """Micro-batches are divided by the step's responses as they stream in; at the optimizer step token_mean's
    gradients are scaled by responses/tokens, which makes the sum exactly Σ loss / tokens of the step."""
    assert gradient_scale(GRPOOptions(loss_aggregation="token_mean"), 8, 200) == pytest.approx(8 / 200)
    assert gradient_scale(GRPOOptions(), 8, 200) == 1.0
    assert gradient_scale(GRPOOptions(loss_aggregation="seq_mean_token_sum_norm", max_response_tokens=48), 8, 200) == 1.0


def test_clip_higher_raises_only_the_upper_bound():
    """DAPO clip-higher: ratio 1.25 with A > 0 is clipped to 1.2 by ε = 0.2, kept by ε_high = 0.28; ratio 0.75 with
    A < 0 is clipped at 0.8 either way (min(0.75·(−1), 0.8·(−1)) = −0.8)."""
    old = torch.full((2, 1), -1.0)
    logp = old + torch.log(torch.tensor([[1.25], [0.75]]))
    mask = torch.ones(2, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    sym, s_sym = grpo_loss(logp, old, adv, mask, GRPOOptions(clip_eps=0.2))
    high, s_high = grpo_loss(logp, old, adv, mask, GRPOOptions(clip_eps=0.2, clip_eps_high=0.28))
    assert sym.item() == pytest.approx(-(1.2 - 0.8)) and high.item() == pytest.approx(-(1.25 - 0.8))
    assert finish_stats(stats_to_floats(s_sym))["clip_frac"] == 1.0  # both ratios outside [0.8, 1.2]
    assert finish_stats(stats_to_floats(s_high))["clip_frac"] == 0.5  # 1.25 is inside [0.8, 1.28]


# ------------------------------------------------------------------------------------------------ KL
@pytest.mark.parametrize("estimator, below, above", [
    # logp = −1, ref = −2 (d = ref − logp = −1) | logp = −2, ref = −1 (d = 1)
    ("k1", 1.0, -1.0),
    ("k2", 0.5, 0.5),
    ("k3", math.exp(-1.0), math.e - 2.0),
    ("low_var_kl", math.exp(-1.0), math.e - 2.0),
])
def test_kl_estimators_by_hand(estimator, below, above):
    got = kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), estimator)
    assert got.tolist() == pytest.approx([below, above], rel=1e-6)


def test_kl_estimators_are_bounded_as_verl_bounds_them():
    logp, ref = torch.tensor([-31.0, -1.0]), torch.tensor([-1.0, -31.0])  # log ratio d = +30 and −30: clamped to ±20
    assert kl_estimate(logp, ref, "k1").tolist() == [-20.0, 20.0]
    assert kl_estimate(logp, ref, "k2").tolist() == [200.0, 200.0]
    assert kl_estimate(logp, ref, "k3").tolist() == [10.0, 10.0]  # e^20 − 21 and e^−20 + 19, clamped to 10
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def _kl_step(gap: float, estimator: str | None):
    """Issue 31's failing input: B = 4, T = 50, logp = ref = −1 except one token at −1 − gap, β = 0.04, advantages
    ±1. Returns the token's share of the gradient norm w.r.t. logp and whether the gradient is finite. ``estimator``
    None: the unclamped k3 the trainer used before."""
    logp = torch.full((4, 50), -1.0)
    logp[2, 17] -= gap
    logp.requires_grad_(True)
    ref = torch.full((4, 50), -1.0)
    mask = torch.ones(4, 50, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    if estimator is None:
        d = ref - logp
        loss = -((-0.04 * (torch.exp(d) - d - 1.0) + torch.exp(logp - logp.detach()) * adv[:, None]).mean(1)).sum()
    else:
        loss, _ = grpo_loss(logp, logp.detach(), adv, mask, GRPOOptions(kl_coef=0.04, kl_estimator=estimator),
                            ref_logp=ref)
    loss.backward()
    g = logp.grad
    return float(g[2, 17].abs() / g.norm()), bool(torch.isfinite(g).all())


def test_one_token_far_below_the_reference_no_longer_is_the_whole_gradient():
    """OpenRLHF #525: with the unclamped k3 one token 12 nats below the reference was ~100 % of the gradient norm and
    at 90 nats the gradient was not finite. Every estimator now bounds it (k3's value clamp stops that token's pull;
    k1 and k2 pull with at most β and 20·β)."""
    share, finite = _kl_step(12.0, None)
    assert share > 0.99 and finite  # the defect, as the trainer had it
    assert not _kl_step(90.0, None)[1]
    for estimator, most in (("k3", 0.1), ("low_var_kl", 0.1), ("k1", 0.1), ("k2", 0.9)):
        for gap in (12.0, 90.0):
            share, finite = _kl_step(gap, estimator)
            assert finite and share < most, (estimator, gap, share)


def test_the_reports_kl_is_bounded_by_the_same_estimator():
    """The quality gate's KL (``kl_to_reference``): one token 90 nats below the reference among 200 moves it by at most
    10/200 nats with k3 (before: exp(90) — the gate failed on one token)."""
    from types import SimpleNamespace

    from rlboost_hpc.trainer.backends.base import Sample
    from rlboost_hpc.trainer.eval import kl_to_reference

    pol = [torch.full((50,), -1.0) for _ in range(4)]
    pol[1][7] = -91.0
    backend = SimpleNamespace(token_logprobs=lambda part, reference=False: (
        [torch.full((50,), -1.0)] * len(part) if reference else pol[:len(part)]))
    samples = [Sample([1], [5] * 50, [-1.0] * 50, 0.0) for _ in range(4)]
    assert kl_to_reference(backend, samples, estimator="k3") == pytest.approx(10.0 / 200)
    assert kl_to_reference(backend, samples, estimator="k1") == pytest.approx(-20.0 / 200)  # log π_θ − log π_ref
    assert kl_to_reference(backend, samples, estimator="k2") == pytest.approx(200.0 / 200)


# ------------------------------------------------------------------------------------------------ behaviour correction
def _mismatch():
    """One response of 3 tokens: trainer logprob −1 everywhere; engine logprobs −1 − ln 3, −1, −1 + ln 2, so the
    ratios π_trainer/π_engine are 3, 1 and 0.5."""
    old = torch.full((1, 3), -1.0)
    beh = torch.tensor([[-1.0 - LN3, -1.0, -1.0 + LN2]])
    return old, beh, torch.ones(1, 3, dtype=torch.bool)


@pytest.mark.parametrize("mode, level, cap, weights, over", [
    ("none", "token", 2.0, [1.0, 1.0, 1.0], [True, False, False]),
    ("tis", "token", 2.0, [2.0, 1.0, 0.5], [True, False, False]),  # min(ρ, 2)
    ("mis", "token", 2.0, [0.0, 1.0, 0.5], [True, False, False]),  # ρ past the cap: dropped
    ("tis", "sequence", 2.0, [1.5, 1.5, 1.5], [False] * 3),  # ρ_seq = 3 · 1 · 0.5 = 1.5 ≤ 2
    ("tis", "sequence", 1.2, [1.2, 1.2, 1.2], [True] * 3),
    ("mis", "sequence", 1.2, [0.0, 0.0, 0.0], [True] * 3),
    ("tis", "geometric", 2.0, [1.5 ** (1 / 3)] * 3, [False] * 3),  # (3 · 1 · 0.5)^(1/3) = 1.145: per-token scale
    ("mis", "geometric", 1.1, [0.0, 0.0, 0.0], [True] * 3),
])
def test_behaviour_weights_by_hand(mode, level, cap, weights, over):
    old, beh, mask = _mismatch()
    w, o = behaviour_weights(old, beh, mask, GRPOOptions(behaviour_correction=mode, behaviour_level=level,
                                                         behaviour_cap=cap))
    assert w[0].tolist() == pytest.approx(weights) and o[0].tolist() == over


def test_truncated_importance_sampling_weights_the_loss_and_the_mismatch_is_measured():
    old, beh, mask = _mismatch()
    logp = old.clone().requires_grad_(True)
    loss, st = grpo_loss(logp, old, torch.tensor([1.0]), mask, GRPOOptions(behaviour_correction="tis"),
                         behaviour_logp=beh)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 1.0 + 0.5) / 3)  # the token mean of w · ratio · A
    assert logp.grad[0].tolist() == pytest.approx([-2 / 3, -1 / 3, -0.5 / 3])
    m = finish_stats(stats_to_floats(st))
    assert m["logprob_diff"] == pytest.approx((LN3 + LN2) / 3) and m["logprob_diff_max"] == pytest.approx(LN3)
    # k3 of KL(engine ‖ trainer) on the engine's samples: ρ − ln ρ − 1 per token = 3 − ln 3 − 1, 0, 0.5 + ln 2 − 1
    assert m["mismatch_kl"] == pytest.approx((2 - LN3 + 0.5 + LN2 - 1) / 3)
    assert m["mismatch_outside_clip_share"] == pytest.approx(2 / 3)  # 3 and 0.5 are outside [0.8, 1.2]
    assert m["mismatch_capped_share"] == pytest.approx(1 / 3)
    plain, _ = grpo_loss(old.clone(), old, torch.tensor([1.0]), mask, GRPOOptions(), behaviour_logp=beh)
    assert plain.item() == pytest.approx(-1.0)  # without correction the engine's numbers only feed the metrics


def _long_responses(n=64, length=1024, seed=0):
    """``n`` responses of ``length`` generated tokens whose engine logprobs differ from the trainer's by N(0, σ²) per
    token, σ = 0.0511: a mean |Δ| of 0.0408 nats, what bench_mismatch.py measured for a bf16 engine against the fp32
    trainer (benchmarks/RESULTS.md)."""
    g = torch.Generator().manual_seed(seed)
    old = -3.0 + torch.randn(n, length, generator=g)
    beh = old - 0.0408 * (torch.pi / 2) ** 0.5 * torch.randn(n, length, generator=g)
    return old, beh, torch.ones(n, length, dtype=torch.bool)


def test_sequence_level_weights_vanish_on_long_responses_and_the_geometric_mean_keeps_them():
    """Issue 50 item 2 (the failing input: 64 responses of 1k tokens at the mismatch a bf16 engine really has): with
    the product of the token ratios MIS drops about a third of them (27 of 64 were measured on a real run) and the
    effective sample size of TIS's weights collapses; the length-normalised (geometric) ratio drops none and keeps
    an effective sample size near 1. Both figures are per step metrics (``behaviour_ess``,
    ``behaviour_dropped_share``)."""
    old, beh, mask = _long_responses()
    adv = torch.zeros(old.shape[0])

    def step(mode, level):
        _, st = grpo_loss(old, old, adv, mask, GRPOOptions(behaviour_correction=mode, behaviour_level=level),
                          behaviour_logp=beh)
        return finish_stats(stats_to_floats(st))

    seq_mis, seq_tis = step("mis", "sequence"), step("tis", "sequence")
    geo_mis, geo_tis = step("mis", "geometric"), step("tis", "geometric")
    assert seq_mis["behaviour_dropped_share"] > 0.25  # ≥ 17 of 64 responses lost
    assert seq_tis["behaviour_dropped_share"] == 0 and seq_tis["behaviour_ess"] < 0.8
    assert geo_mis["behaviour_dropped_share"] == 0 and geo_mis["behaviour_ess"] > 0.99
    assert geo_tis["behaviour_ess"] > 0.99 and step("none", "geometric")["behaviour_ess"] == pytest.approx(1.0)
    tok = step("mis", "token")  # per token: about one in 10^20 of N(0, 0.05²) passes ln 2
    assert tok["behaviour_dropped_share"] == 0 and tok["behaviour_ess"] > 0.99


def test_the_effective_sample_size_adds_up_over_micro_batches():
    old, beh, mask = _long_responses(n=8, length=64, seed=3)
    opts = GRPOOptions(behaviour_correction="tis", behaviour_level="sequence", behaviour_cap=1.05)
    adv = torch.zeros(8)
    whole = finish_stats(stats_to_floats(grpo_loss(old, old, adv, mask, opts, behaviour_logp=beh)[1]))
    parts = [stats_to_floats(grpo_loss(old[i:i + 3], old[i:i + 3], adv[i:i + 3], mask[i:i + 3], opts,
                                       behaviour_logp=beh[i:i + 3])[1]) for i in (0, 3, 6)]
    merged = finish_stats(merge_stats(merge_stats(parts[0], parts[1]), parts[2]))
    w = torch.exp((old - beh).sum(dim=1)).clamp(max=1.05)  # by hand: (Σw)² / (n Σw²)
    assert whole["behaviour_ess"] == pytest.approx(merged["behaviour_ess"], rel=1e-5)
    assert whole["behaviour_ess"] == pytest.approx((w.sum() ** 2 / (8 * (w * w).sum())).item(), rel=1e-5)


def test_a_step_that_drops_more_than_the_bound_is_warned_about_and_counted_one_side(caplog):
    from types import SimpleNamespace

    from rlboost_hpc.trainer.loop import RLTrainer, StepSettings, Totals

    t = SimpleNamespace(s=StepSettings(prompts_per_step=1, group_size=1, max_new_tokens=1, temperature=1.0,
                                       top_p=1.0, micro_batch=1, behaviour_dropped_warn=0.1), totals=Totals())
    RLTrainer._warn_dropped(t, 3, {"behaviour_dropped_share": 0.05, "behaviour_ess": 0.9})
    assert t.totals.steps_over_dropped_warn == 0 and not caplog.records
    with caplog.at_level("WARNING", logger="rlboost.trainer"):
        RLTrainer._warn_dropped(t, 4, {"behaviour_dropped_share": 27 / 64, "behaviour_ess": 0.4})
    assert t.totals.steps_over_dropped_warn == 1
    assert "step 4" in caplog.text and "42 %" in caplog.text and "geometric" in caplog.text


@pytest.mark.integration
def test_a_run_with_sequence_level_mis_shows_its_effective_sample_size_and_warns_of_what_it_dropped(repo_root,
                                                                                                  tmp_path):
    """Issue 57 (the second list): sequence-level IS was proven on a private method with a stand-in. Through
    ``rlboost-hpc run``: ``behaviour_level = "sequence"``, MIS at a cap of 1.0 (every response whose product of
    ratios passes 1 is dropped) — each step's record has ``behaviour_ess`` and ``behaviour_dropped_share``, each
    step over ``behaviour_dropped_warn`` is warned about in the trainer's log and counted in the report."""
    import json

    from test_demo_run import diagnose, run_cli

    out = tmp_path / "run"
    p = run_cli(repo_root, out, "trainer.steps=2", "trainer.export_model=false", "task.heldout_prompts=4",
                "trainer.eval_samples=1", 'trainer.behaviour_correction="mis"', 'trainer.behaviour_level="sequence"',
                "trainer.behaviour_cap=1.0", "trainer.behaviour_dropped_warn=0.0")
    assert p.returncode == 0, diagnose(p, out)
    ms = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(ms) == 2 and all(0.0 < m["behaviour_ess"] <= 1.0 and 0.0 < m["behaviour_dropped_share"] < 1.0
                                for m in ms), ms
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps_over_dropped_warn"] == 2
    warned = [json.loads(x)["msg"] for x in (out / "logs/trainer.jsonl").read_text().splitlines()
              if "importance correction dropped" in x]
    assert len(warned) == 2 and "effective sample size" in warned[0], warned


def test_a_correction_without_behaviour_logprobs_or_a_penalty_without_a_reference_is_refused():
    logp, mask, adv = _batch()
    with pytest.raises(ValueError, match="behaviour_logp"):
        grpo_loss(logp, logp.detach(), adv, mask, GRPOOptions(behaviour_correction="mis"))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp.detach(), adv, mask, GRPOOptions(kl_coef=0.1))


# ------------------------------------------------------------------------------------------------ truncation
def test_mask_truncated_takes_truncated_responses_out_of_the_loss():
    """DAPO overlong filtering: response 1 (truncated) carries no loss; per-sequence modes still divide by every
    response of the step (TRL's semantics), token_mean by the loss tokens left."""
    logp, mask, adv = _batch()
    trunc = torch.tensor([False, True])
    loss, st = grpo_loss(logp, logp.detach(), adv, mask, GRPOOptions(mask_truncated=True), truncated=trunc)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and logp.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert stats_to_floats(st)["loss_tokens"] == 2.0
    kept, _ = grpo_loss(logp, logp.detach(), adv, mask, GRPOOptions(), truncated=trunc)  # the default: trained
    assert kept.item() == pytest.approx(1.0)


@pytest.mark.parametrize("field, value, needle", [
    ("loss_aggregation", "sum", "loss_aggregation"), ("kl_estimator", "k4", "kl_estimator"),
    ("behaviour_correction", "is", "behaviour_correction"), ("behaviour_level", "batch", "behaviour_level"),
    ("behaviour_cap", 0.0, "behaviour_cap"), ("clip_eps_high", 0.1, "clip_eps_high"),
])
def test_options_refuse_unknown_modes_and_bad_numbers_naming_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        GRPOOptions(**{field: value})
    with pytest.raises(ValueError, match="max_response_tokens"):
        GRPOOptions(loss_aggregation="seq_mean_token_sum_norm")


# ------------------------------------------------------------------------------------------------ torch backend
@pytest.fixture(scope="module")
def tiny():
    from megatron_scenarios import tiny_hf

    from rlboost_hpc.models.arch import arch_from_hf

    cfg, sd = tiny_hf("qwen3", vocab=64, layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48)
    return arch_from_hf(cfg), sd


def _grad(tiny, opts, splits, samples):
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

    arch, sd = tiny
    b = TorchBackend(arch, sd, lr=1e-3, objective=opts, keep_reference=opts.kl_coef > 0, grad_clip=1e9)
    i = 0
    for n in splits:
        b.accumulate(samples[i:i + n], len(samples))
        i += n
    scale = b.step.gradient_scale()
    g = torch.cat([p.grad.flatten() * scale for p in b.model.parameters() if p.grad is not None])
    return g, b.optimizer_step()


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_the_streamed_gradient_does_not_depend_on_the_micro_batch_split(tiny, mode):
    from megatron_scenarios import make_samples

    samples = make_samples(7, 64, seed=3)
    opts = GRPOOptions(loss_aggregation=mode, max_response_tokens=12, mask_truncated=True)
    whole, m = _grad(tiny, opts, [7], samples)
    parts, _ = _grad(tiny, opts, [2, 4, 1], samples)
    assert torch.allclose(whole, parts, rtol=1e-5, atol=1e-6) and float(whole.norm()) > 0
    assert {"logprob_diff", "mismatch_kl", "mismatch_capped_share", "clip_frac"} <= set(m)  # the step's figures


def test_the_backend_trains_what_the_options_say(tiny):
    """token_mean's step gradient equals the hand-normalised one (Σ over tokens / tokens of the step), and TIS changes
    the gradient when the engine's logprobs differ from the trainer's."""
    from megatron_scenarios import make_samples

    samples = make_samples(6, 64, seed=4)
    tokens = sum(len(s.response_ids) for s in samples)
    seq, _ = _grad(tiny, GRPOOptions(loss_aggregation="seq_mean_token_sum_norm", max_response_tokens=tokens), [6],
                   samples)
    tok, _ = _grad(tiny, GRPOOptions(loss_aggregation="token_mean"), [3, 3], samples)
    # Σ_i Σ_t / tokens = (Σ_i Σ_t / L) / responses · (responses · L / tokens) with L = tokens: × responses
    assert torch.allclose(tok, seq * len(samples), rtol=1e-5, atol=1e-6)
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

    g = torch.Generator().manual_seed(0)  # engine logprobs = the trainer's ± noise: ratios around 1, some past 2
    for smp, lp in zip(samples, TorchBackend(*tiny, lr=1e-3).token_logprobs(samples)):
        smp.behaviour_logprobs = (lp + 0.5 * torch.randn(lp.shape, generator=g)).tolist()
    plain, m0 = _grad(tiny, GRPOOptions(), [6], samples)
    tis, m = _grad(tiny, GRPOOptions(behaviour_correction="tis"), [6], samples)
    assert not torch.allclose(plain, tis) and m["mismatch_capped_share"] > 0
    assert m0["logprob_diff"] == pytest.approx(m["logprob_diff"]) and 0.2 < m["logprob_diff"] < 0.6
