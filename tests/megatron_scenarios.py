"""Verification scenarios for ``megatron_bridge`` (used by ``tests/test_megatron*.py`` and by hand).

Run one scenario (results as JSON)::

    python tests/megatron_scenarios.py single --models DIR --out r.json            # world of one
    python -m megatron_bridge.launch --nproc-per-node 2 --tp 2 tests/megatron_scenarios.py parallel \\
        --models DIR --out r.json                                                 # TP=2 (or --pp 2, or DP=2)

Each scenario compares the Megatron backend with an independent reference on the same batches:
``TorchBackend`` (the project's reference implementation) for the Llama checkpoint stories260K, and
:class:`HFReference` (the same GRPO step on a ``transformers`` model) for the tiny random Qwen2/Qwen3 configs.
It records logits differences against ``transformers``, bridge round trips, sharded export + pull through real
``WeightServer`` s, per-step RL losses/metrics, reference logprobs, and an exact checkpoint-resume check.
Test support (it lives under ``tests/``): nothing in the product imports it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions, finish_stats, grpo_loss, merge_stats, stats_to_floats
from rlboost_hpc.trainer.backends.base import Sample, behaviour_tensor
from rlboost_hpc.trainer.backends.torch_backend import pack

__all__ = ["make_samples", "tiny_hf", "hf_model", "HFReference", "run_single", "run_parallel"]


# ---------------------------------------------------------------------------------------------- fixtures
def make_samples(n: int, vocab: int, seed: int, max_prompt: int = 9, max_resp: int = 12) -> list[Sample]:
    """``n`` random GRPO samples (prompt 2..max_prompt tokens, response 1..max_resp tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        P = int(torch.randint(2, max_prompt + 1, (1,), generator=g))
        R = int(torch.randint(1, max_resp + 1, (1,), generator=g))
        out.append(Sample(prompt_ids=torch.randint(0, vocab, (P,), generator=g).tolist(),
                          response_ids=torch.randint(0, vocab, (R,), generator=g).tolist(),
                          behaviour_logprobs=(-3 * torch.rand(R, generator=g)).tolist(),
                          advantage=float(torch.randn(1, generator=g)),
                          finish_reason="length" if len(out) % 3 == 2 else "stop"))
    return out


def tiny_hf(family: str, *, seed: int = 0, vocab: int = 301, tie: bool = False, layers: int = 2,
            hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
            intermediate: int = 96) -> tuple[dict, dict[str, torch.Tensor]]:
    """A small random HF model of ``family`` (``"qwen3"``, ``"qwen2"``, ``"llama"``): (config dict, fp32 state
    dict). Qwen3 gets an explicit ``head_dim`` (32 ≠ hidden/heads) to exercise Megatron's ``kv_channels``."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.1)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim or 32, rope_theta=1e6)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6)
    elif family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=1e4)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # make norms and biases non-trivial so the bridge is really tested
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight", None)
    d = cfg.to_dict()
    d["architectures"] = [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "llama": "LlamaForCausalLM"}[family]]
    return d, sd


def hf_model(cfg: Mapping[str, Any], sd: Mapping[str, torch.Tensor]):
    """A ``transformers`` causal LM (fp32, eager attention) with ``sd`` loaded."""
    import transformers

    d = dict(cfg)
    mt = d.pop("model_type")
    c = transformers.AutoConfig.for_model(mt, **{k: v for k, v in d.items() if k not in ("transformers_version",)})
    c._attn_implementation = "eager"
    m = transformers.AutoModelForCausalLM.from_config(c).float()
    missing, unexpected = m.load_state_dict(dict(sd), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and c.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if c.tie_word_embeddings:
        m.tie_weights()
    return m.eval()


class HFReference:
    """The GRPO step of ``TorchBackend`` on a ``transformers`` model (any family): AdamW, clip, k3 KL."""

    def __init__(self, cfg, sd, *, lr, weight_decay=0.0, grad_clip=1.0, clip_eps=0.2, kl_coef=0.0,
                 temperature=1.0) -> None:
        self.model = hf_model(cfg, sd).train()
        self.ref = hf_model(cfg, sd).requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.grad_clip, self.clip_eps, self.kl_coef = grad_clip, clip_eps, kl_coef
        self.temperature = temperature if temperature > 0 else 1.0
        self.lr = lr
        self.step_stats: dict[str, float] = {}

    def _logp(self, model, ids, att):
        logits = model(input_ids=ids, attention_mask=att.long()).logits[:, :-1].float() / self.temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def accumulate(self, batch, responses_in_step):
        ids, att, rmask, _ = pack(batch)
        logp = self._logp(self.model, ids, att)
        old = logp.detach()
        ref = None
        if self.kl_coef > 0:
            with torch.no_grad():
                ref = self._logp(self.ref, ids, att)
        adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
        loss_sum, st = grpo_loss(logp, old, adv, rmask, GRPOOptions(clip_eps=self.clip_eps, kl_coef=self.kl_coef),
                                 ref_logp=ref, behaviour_logp=behaviour_tensor(batch, tuple(old.shape)))
        (loss_sum / responses_in_step).backward()
        m = stats_to_floats(st)
        self.step_stats = merge_stats(self.step_stats, m)
        return {"loss": m["loss_sum"] / responses_in_step, "tokens": int(rmask.sum()), **finish_stats(m)}

    def optimizer_step(self):
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        out, self.step_stats = {"grad_norm": float(gn), "lr": self.lr, **finish_stats(self.step_stats)}, {}
        return out

    @torch.no_grad()
    def token_logprobs(self, batch, *, reference=False):
        ids, att, _, plens = pack(batch)
        logp = self._logp(self.ref if reference else self.model, ids, att)
        return [logp[i, p - 1 : p - 1 + len(s.response_ids)].clone() for i, (s, p) in enumerate(zip(batch, plens))]

    def export_weights(self):
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def logits(self, ids):
        with torch.no_grad():
            return self.ref(input_ids=ids).logits.float()


# ---------------------------------------------------------------------------------------------- checks
def _maxdiff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b) if b else 0.0


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


def _load(model: str, models_dir: Path):
    """(hf config dict, weights for MegatronBackend, fp32 HF state dict, vocab, project ModelArch or None)."""
    if model == "stories":
        from rlboost_hpc.models.arch import arch_from_hf, read_config_json
        from rlboost_hpc.models.hf_dir import read_state_dict
        from rlboost_hpc.models.llama2c import ensure_converted

        d = ensure_converted(models_dir)
        arch = arch_from_hf(d)
        return read_config_json(d), str(d), read_state_dict(d, arch), arch.vocab_size, arch
    fam, _, rest = model.partition("-")
    cfg, sd = tiny_hf(fam, tie=rest == "tied", vocab=301 if fam != "llama" else 256)
    return cfg, sd, sd, cfg["vocab_size"], None


def parity(model: str, models_dir: Path, ckpt_root: Path, *, steps: int = 3, mb_kw: dict | None = None,
           check_ckpt: bool = True, check_shards: bool = True, lr: float = 1e-4, kl_coef: float = 0.05,
           temperature: float = 0.9, seed: int = 0, objective: Any = None) -> dict[str, Any]:
    """Megatron backend vs the reference on ``model``: logits, round trip, shards, RL steps, resume. ``objective``:
    GRPO options for both backends (stories260K only: the reference is then the torch backend)."""
    from megatron_bridge.backend import MegatronBackend
    from megatron_bridge.export import manifest_nbytes, pull_sharded
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

    mb_kw = dict(mb_kw or {})
    r: dict[str, Any] = {"model": model, "options": {k: str(v) for k, v in mb_kw.items()}}
    cfg_d, weights, sd, vocab, lcfg = _load(model, models_dir)
    kw = dict(lr=lr, grad_clip=1.0, clip_eps=0.2, kl_coef=kl_coef, temperature=temperature)
    if objective is not None:
        kw["objective"] = objective
    ref = TorchBackend(lcfg, sd, **kw) if lcfg is not None else HFReference(cfg_d, sd, **kw)
    t0 = time.perf_counter()
    mb = MegatronBackend(cfg_d, weights, shard_export=check_shards, **kw, **mb_kw)
    r["build_s"] = time.perf_counter() - t0
    L = mb.layout
    r["layout"] = {"tp": L.tp, "pp": L.pp, "dp": L.dp, "world": L.world}
    # 1. logits vs transformers
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, vocab, (2, 19), generator=g)
    hf = hf_model(cfg_d, sd)
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
    got = mb.logits(ids)
    r["logits_shape_ok"] = list(got.shape) == list(want.shape)
    r["logits_maxabs"] = float((got - want).abs().max())
    r["logits_scale"] = float(want.abs().max())
    r["logits_close"] = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))
    # 2. bridge round trip (gathered export) — bit-exact before any step
    exp = mb.export_weights()
    want_names = set(sd) | ({"lm_head.weight"} if mb.arch.tie_word_embeddings else set())
    r["export_names_ok"] = set(exp) == want_names
    r["export_maxabs"] = _maxdiff(exp, {k: v for k, v in sd.items() if k in exp})
    # 3. sharded export through real WeightServers, pulled and assembled
    if check_shards:
        pub = mb.publish_shards(0)
        man = json.loads(json.dumps(mb.shard_manifest))  # it must survive JSON
        pulled, st = pull_sharded(man, 0, streams=2, label="test")
        want_bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        if mb.arch.tie_word_embeddings:
            want_bf16["lm_head.weight"] = want_bf16["model.embed_tokens.weight"]
        r["shards"] = {"holders": len(man["holders"]), "publish_s": pub["publish_s"], "per_rank": pub["per_rank"],
                       "bytes_total": manifest_nbytes(man), "bytes_full_bf16": 2 * mb.arch.num_params(),
                       "names_ok": set(pulled) == set(want_bf16), "maxabs": _maxdiff(pulled, want_bf16),
                       "dtype_ok": all(v.dtype == torch.bfloat16 for v in pulled.values()), "pull_s": st["seconds"]}
    # 4. RL steps (two streamed micro-batches per step), same batches to both backends
    r["steps"] = []
    ckpt = ckpt_root / f"ckpt-{model}-{L.tp}-{L.pp}-{L.dp}-{'-'.join(sorted(mb_kw)) or 'plain'}"
    k_save = steps - 1
    last_losses = None
    for s in range(steps):
        if check_ckpt and s == k_save:
            mb.save_checkpoint(ckpt, {"step": s, "data_seed": 1000 + s})
        batch = make_samples(8, vocab, seed=1000 + s)
        if objective is not None:  # behaviour logprobs near the policy's (ratios around 1, some past the cap)
            g = torch.Generator().manual_seed(s)
            for smp, lp in zip(batch, ref.token_logprobs(batch)):
                smp.behaviour_logprobs = (lp + 0.3 * torch.randn(lp.shape, generator=g)).tolist()
                # bounded staleness: tokens of the trained version and of the one before (mismatch per staleness)
                smp.staleness = torch.randint(0, 2, lp.shape, generator=g).tolist()
        row: dict[str, Any] = {"ref": [], "meg": []}
        ts = time.perf_counter()
        for part in (batch[:5], batch[5:]):
            row["ref"].append(ref.accumulate(part, len(batch)))
            row["meg"].append(mb.accumulate(part, len(batch)))
        row["ref_step"] = ref.optimizer_step()
        row["meg_step"] = mb.optimizer_step()
        row["meg_s"] = time.perf_counter() - ts
        row["loss_rel"] = max(_rel(a["loss"], b["loss"]) for a, b in zip(row["meg"], row["ref"]))
        row["grad_norm_rel"] = _rel(row["meg_step"]["grad_norm"], row["ref_step"]["grad_norm"])
        row["metrics_rel"] = max(_rel(a[k], b[k]) for a, b in zip(row["meg"] + [row["meg_step"]],
                                                                   row["ref"] + [row["ref_step"]])
                                 for k in (*STEP_METRICS, *(x for x in b if x.startswith("logprob_diff_staleness")))
                                 if k in b)
        row["staleness_metrics"] = sorted(x for x in row["meg_step"] if x.startswith("logprob_diff_staleness"))
        row["step_metrics_ok"] = set(STEP_METRICS) <= set(row["meg_step"]) and set(STEP_METRICS) <= set(row["ref_step"])
        row["tokens_ok"] = all(a["tokens"] == b["tokens"] for a, b in zip(row["meg"], row["ref"]))
        r["steps"].append(row)
        last_losses = [m["loss"] for m in row["meg"]] + [row["meg_step"]["grad_norm"]]
    # 5. logprobs and weights after training
    probe = make_samples(6, vocab, seed=77)
    for name, kw2 in (("policy", {}), ("reference", {"reference": True})):
        a, b = mb.token_logprobs(probe, **kw2), ref.token_logprobs(probe, **kw2)
        r[f"logprobs_{name}_maxabs"] = max(float((x - y).abs().max()) for x, y in zip(a, b))
        r[f"logprobs_{name}_lens_ok"] = all(x.shape == y.shape for x, y in zip(a, b))
    after = mb.export_weights()
    refw = ref.export_weights()
    r["weights_after_maxabs"] = _maxdiff(after, {k: v for k, v in refw.items() if k in after})
    # 6. checkpoint resume: a fresh backend, perturbed, then loaded, must redo the last step exactly
    if check_ckpt:
        mb2 = MegatronBackend(cfg_d, weights, **kw, **mb_kw)
        mb2.accumulate(make_samples(4, vocab, seed=5), 4)  # perturb weights and optimizer state
        mb2.optimizer_step()
        extra = mb2.load_checkpoint(ckpt)
        batch = make_samples(8, vocab, seed=1000 + k_save)
        losses = [mb2.accumulate(part, len(batch))["loss"] for part in (batch[:5], batch[5:])]
        losses.append(mb2.optimizer_step()["grad_norm"])
        wd = _maxdiff(mb2.export_weights(), after)
        r["resume"] = {"extra": extra, "losses": losses, "uninterrupted": last_losses, "weights_maxabs": wd,
                       "exact": losses == last_losses and wd == 0.0}
        mb2.close()
    mb.close()
    return r


def lora_parity(models_dir: Path, ckpt_root: Path, *, steps: int = 2, mb_kw: dict | None = None) -> dict[str, Any]:
    """``trainer.lora`` (issue 49): the Megatron backend's TP-sharded LoRA vs PEFT on the torch backend, from the same
    adapter (B nonzero, so the adapter matters from the start): the published adapter (per holder, pulled and
    assembled), policy and reference (= base, adapter off) logprobs, GRPO steps, the adapter after them, and an exact
    resume from a checkpoint that holds the adapter only."""
    from megatron_bridge.backend import MegatronBackend
    from megatron_bridge.export import manifest_nbytes, pull_sharded
    from rlboost_hpc.models.lora import init_adapter
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend
    from rlboost_hpc.trainer.lora import LoraSettings

    mb_kw = dict(mb_kw or {})
    cfg_d, weights, sd, vocab, arch = _load("stories", models_dir)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    g = torch.Generator().manual_seed(3)
    init = {k: (torch.randn(v.shape, generator=g) * 0.2 if "lora_B" in k else v)
            for k, v in init_adapter(arch, targets, 4, 0).items()}
    lo = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=targets, init=init)
    kw = dict(lr=1e-3, grad_clip=1.0, clip_eps=0.2, kl_coef=0.05, temperature=0.9, lora=lo)
    ref = TorchBackend(arch, sd, **kw)
    mb = MegatronBackend(cfg_d, weights, shard_export=True, **kw, **mb_kw)
    L = mb.layout
    r: dict[str, Any] = {"layout": {"tp": L.tp, "pp": L.pp, "dp": L.dp, "world": L.world}, "steps": []}
    pub = mb.publish_shards(0)
    pulled, _ = pull_sharded(json.loads(json.dumps(mb.shard_manifest)), 0, streams=2, label="test")
    want = {k: v.to(torch.bfloat16) for k, v in ref.export_weights().items()}
    r["shards"] = {"names_ok": set(pulled) == set(init), "maxabs": _maxdiff(pulled, want), "holders": len(
        mb.shard_manifest["holders"]), "bytes_total": manifest_nbytes(mb.shard_manifest),
        "adapter_bf16_bytes": 2 * sum(v.numel() for v in init.values()), "per_rank": pub["per_rank"]}
    probe = make_samples(6, vocab, seed=77)
    ckpt = ckpt_root / f"lora-{L.tp}-{L.pp}-{L.dp}"
    last = None
    for s in range(steps):
        if s == steps - 1:
            mb.save_checkpoint(ckpt, {"step": s})
        batch = make_samples(8, vocab, seed=1000 + s)
        a = [ref.accumulate(part, 8) for part in (batch[:5], batch[5:])]
        b = [mb.accumulate(part, 8) for part in (batch[:5], batch[5:])]
        ga, gb = ref.optimizer_step()["grad_norm"], mb.optimizer_step()["grad_norm"]
        r["steps"].append({"loss_rel": max(_rel(x["loss"], y["loss"]) for x, y in zip(b, a)),
                           "grad_norm_rel": _rel(gb, ga)})
        last = [x["loss"] for x in b] + [gb]
    for name, k2 in (("policy", {}), ("reference", {"reference": True})):
        x, y = mb.token_logprobs(probe, **k2), ref.token_logprobs(probe, **k2)
        r[f"logprobs_{name}_maxabs"] = max(float((u - v).abs().max()) for u, v in zip(x, y))
    after = mb.export_weights()
    r["export_names_ok"] = set(after) == set(init)
    r["weights_after_maxabs"] = _maxdiff(after, ref.export_weights())
    mb2 = MegatronBackend(cfg_d, weights, **kw, **mb_kw)
    mb2.accumulate(make_samples(4, vocab, seed=5), 4)  # perturb adapter and optimizer state (as parity() does)
    mb2.optimizer_step()
    extra = mb2.load_checkpoint(ckpt)
    batch = make_samples(8, vocab, seed=1000 + steps - 1)
    losses = [mb2.accumulate(part, 8)["loss"] for part in (batch[:5], batch[5:])] + [mb2.optimizer_step()["grad_norm"]]
    wd = _maxdiff(mb2.export_weights(), after)
    r["resume"] = {"extra": extra, "exact": losses == last and wd == 0.0, "weights_maxabs": wd}
    mb2.close()
    mb.close()
    return r


#: The loss and engine–trainer mismatch metrics both backends report, per micro-batch and per step.
STEP_METRICS = ("clip_frac", "kl", "ratio_max", "logprob_diff", "logprob_diff_max", "mismatch_kl",
                "mismatch_outside_clip_share", "mismatch_capped_share", "behaviour_weight_mean", "behaviour_ratio_max")


def run_single(models_dir: Path, out: Path) -> dict[str, Any]:
    """World of one: every family, options (recompute, bf16, distributed optimizer) and the compat layer."""
    from megatron_bridge import compat
    from megatron_bridge.backend import MegatronBackend

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        res["stories"] = parity("stories", models_dir, tmp)
        res["qwen3"] = parity("qwen3", models_dir, tmp, check_ckpt=False)
        # every option of the objective at once: the same loss, gradient and metrics as the torch backend
        res["stories-objective"] = parity("stories", models_dir, tmp, check_ckpt=False, check_shards=False, objective=(
            GRPOOptions(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="low_var_kl",
                        loss_aggregation="token_mean", behaviour_correction="tis", behaviour_cap=1.5,
                        behaviour_level="sequence", mask_truncated=True)))
        res["qwen2-tied"] = parity("qwen2-tied", models_dir, tmp, steps=1, check_ckpt=False, check_shards=False)
        res["lora"] = lora_parity(models_dir, tmp)
        res["llama-untied"] = parity("llama", models_dir, tmp, steps=1, check_ckpt=False, check_shards=False)
        # bf16 + distributed optimizer: numbers within bf16 rounding, resume still exact
        res["stories-bf16-distopt"] = parity("stories", models_dir, tmp, check_shards=False,
                                             mb_kw={"bf16": True, "distributed_optimizer": True})
        # options: same first-step numbers (recompute exactly; bf16 within bf16 rounding)
        cfg_d, weights, sd, vocab, lcfg = _load("stories", models_dir)
        kw = dict(lr=1e-4, kl_coef=0.05, temperature=0.9)
        batch = make_samples(8, vocab, seed=1000)
        opts: dict[str, Any] = {}
        base = None
        for name, o in (("plain", {}), ("recompute_full", {"recompute": "full"}),
                        ("recompute_selective", {"recompute": "selective"}),
                        ("distributed_optimizer", {"distributed_optimizer": True}),
                        ("bf16", {"bf16": True}), ("bf16_distopt", {"bf16": True, "distributed_optimizer": True}),
                        ("micro_batch_2", {"micro_batch_size": 2})):
            b = MegatronBackend(cfg_d, weights, **kw, **o)
            t = time.perf_counter()
            losses = [b.accumulate(part, 8)["loss"] for part in (batch[:5], batch[5:])]
            gn = b.optimizer_step()["grad_norm"]
            losses2 = [b.accumulate(part, 8)["loss"] for part in (batch[:5], batch[5:])]
            opts[name] = {"losses": losses, "grad_norm": gn, "losses_after_step": losses2,
                          "s": time.perf_counter() - t}
            if base is None:
                base = opts[name]
            opts[name]["rel_to_plain"] = max(_rel(x, y) for x, y in zip(losses + [gn] + losses2,
                                                                          base["losses"] + [base["grad_norm"]] +
                                                                          base["losses_after_step"]))
            b.close()
        res["options"] = opts
        # CURVE: shard holders started with the run's keys serve only pullers holding them
        from megatron_bridge.export import pull_sharded
        from rlboost_hpc.protocol.auth import RunKeys
        from rlboost_hpc.weights.puller import WeightTransferError

        keys = RunKeys.generate()
        b = MegatronBackend(cfg_d, weights, shard_export=True, shard_keys=keys, **kw)
        b.publish_shards(1)
        sd_k, _ = pull_sharded(b.shard_manifest, 1, keys=keys, timeout_s=5)
        try:
            pull_sharded(b.shard_manifest, 1, timeout_s=1.0)
            refused = False
        except WeightTransferError:
            refused = True
        res["curve"] = {"pulled_with_keys": set(sd_k) == set(sd) | {"lm_head.weight"}, "refused_without": refused}
        b.close()
    # the compatibility layer is scoped and CPU-only
    c: dict[str, Any] = {"active": compat.is_active(), "cuda_available": torch.cuda.is_available()}
    with compat.scope():
        c["in_scope_device"] = torch.zeros(1, device="cuda").device.type
        c["in_scope_type_from_project"] = torch.zeros(1).type()
    try:
        torch.zeros(1, device="cuda")
        c["out_of_scope_cuda_fails"] = False
    except Exception:  # noqa: BLE001 - expected on a CPU build
        c["out_of_scope_cuda_fails"] = True
    res["compat"] = c
    out.write_text(json.dumps(res, indent=1, default=str))
    return res


def run_parallel(models_dir: Path, out: Path, *, distributed_optimizer: bool = False) -> dict[str, Any]:
    """Rank 0 of a launcher job (leader mode): stories260K and a Qwen3-shaped model at this job's layout."""
    import torch.distributed as dist

    res: dict[str, Any] = {"world": dist.get_world_size()}
    mb_kw = {"distributed_optimizer": True} if distributed_optimizer else {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        res["stories"] = parity("stories", models_dir, tmp, mb_kw=mb_kw)
        res["qwen3"] = parity("qwen3", models_dir, tmp, mb_kw=mb_kw, check_ckpt=False)
        res["lora"] = lora_parity(models_dir, tmp, mb_kw=mb_kw)
    out.write_text(json.dumps(res, indent=1, default=str))
    return res


def run_demo(config: Path, out_dir: Path, overrides: list[str]) -> int:
    """The ordinary ``rlboost-hpc run`` with ``trainer.backend = "megatron"`` at the layout the launcher started
    (``trainer.megatron.tp`` / ``pp``: this script is not ``rlboost_hpc.cli run``, so the launcher took ``--tp``).
    Under the launcher this is rank 0's program (the other ranks follow its backend calls)."""
    from megatron_bridge import parallel
    from rlboost_hpc.cli import main as cli_main

    lay = parallel.layout() if parallel.is_initialized() else None
    args = ["run", "--config", str(config), "--out", str(out_dir), "--no-progress", "--set", "trainer.backend=megatron",
            "--set", f"trainer.megatron.tp={lay.tp if lay else 1}", "--set", f"trainer.megatron.pp={lay.pp if lay else 1}"]
    for o in overrides:
        args += ["--set", o]
    return cli_main(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/megatron_scenarios.py")
    p.add_argument("scenario", choices=["single", "parallel", "demo"])
    p.add_argument("--models", type=Path, help="directory for the converted stories260K")
    p.add_argument("--out", type=Path, help="results JSON (single/parallel) or run directory (demo)")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--config", type=Path, default=Path("configs/local.toml"), help="demo: run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="demo: config override")
    a = p.parse_args(argv)
    if a.out is None or (a.scenario != "demo" and a.models is None):
        p.error("--out (and --models for single/parallel) are required")
    if a.scenario == "demo":
        return run_demo(a.config, a.out, a.overrides)
    torch.set_num_threads(1)
    if a.scenario == "single":
        run_single(a.models, a.out)
    else:
        run_parallel(a.models, a.out, distributed_optimizer=a.distributed_optimizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
