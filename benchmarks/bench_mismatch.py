"""Engine–trainer mismatch on a Qwen3-shaped random model: what bf16 rollout does to "on-policy" GRPO, and what
importance correction (TIS / MIS, ``trainer.behaviour_correction``) gives back — measured in one run.

A random Qwen3-shaped model (hidden 512, 4 layers, 8 heads / 4 KV heads of 64, q/k norm, tied embeddings, Qwen's
151,936-token vocabulary) generates ``--batch`` responses of ``--new`` tokens (no stop token) from random prompts
with the project's torch engine in three arithmetics — fp32 (the trainer's), bf16 weights with fp32 compute (what
the demo's bf16 weight transfer gives a CPU engine), and bf16 weights and compute (a GPU engine) — with the same
sampling seeds. The fp32 trainer (:class:`TorchBackend`) scores every response; its step metrics give the mismatch
figures (mean / largest |Δ logprob|, k3 KL(engine ‖ trainer), share of ratios outside the PPO clip band, share past
the cap).

Gradient: for the policy-gradient term of each generated position t, the expected update over the next token a is
``Σ_a q_t(a) · w_t(a) · A(a) · ∇θ log π_θ(a | prefix_t)`` with q the distribution the token was drawn from, w the
behaviour weight and A a fixed random advantage per vocabulary entry. It is computed exactly over the vocabulary
(no sampling noise) at every prefix the bf16 engine produced, back-propagated to every parameter. The target is the
fp32 engine's (q = π_θ, w = 1: on-policy); "uncorrected" draws from the bf16 engine with w = 1; "TIS" and "MIS" use
w = :func:`~rlboost_hpc.trainer.algorithms.grpo.behaviour_weights` (token level, each cap of ``--caps``). Printed: each
gradient's relative L2 distance to the target and its cosine similarity.

Run: ``.venv/bin/python benchmarks/bench_mismatch.py [--batch 4] [--new 256] [--init-std 0.1] [--caps 2 1.02]``
(≈ 10 GB of memory at the defaults: the gradient holds fp32 [positions × vocabulary] tensors; 7–15 min on 2 cores).
"""
from __future__ import annotations

import argparse
import time

import torch

from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.models.llama import LlamaModel
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions, behaviour_weights
from rlboost_hpc.trainer.backends.base import Sample
from rlboost_hpc.trainer.backends.torch_backend import TorchBackend, pack

QWEN3_SHAPE = dict(family="qwen3", vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
                   rope_theta=1e6, tie_word_embeddings=True, qk_norm=True)
ENGINES = {  # name: (weights dtype on the wire, compute dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16 weights, fp32 compute": (torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
}


def random_weights(arch: ModelArch, std: float, seed: int) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights: matrices N(0, std²), norm weights 1 (a freshly initialised checkpoint)."""
    torch.manual_seed(seed)
    m = LlamaModel(arch)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
            else:
                p.fill_(1.0)
    return {k: v.detach().clone() for k, v in m.state_dict().items() if k != "lm_head.weight"}


def sample(arch, weights, engine: str, prompts: list[list[int]], new: int) -> list[Sample]:
    """Responses of ``engine`` (same seeds for every engine) as Samples with its behaviour logprobs."""
    wire, compute = ENGINES[engine]
    sd = {k: v.to(wire) for k, v in weights.items()}
    eng = TorchEngine(arch, sd, max_batch=len(prompts), max_len=len(prompts[0]) + new, dtype=compute)
    reqs = [GenRequest(rid=str(i), prompt_ids=p, max_new_tokens=new,
                       sampling=SamplingParams(temperature=1.0, seed=1000 + i, stop_token_ids=()))
            for i, p in enumerate(prompts)]
    out = generate_all(eng, reqs)
    return [Sample(prompt_ids=p, response_ids=out[str(i)][0], behaviour_logprobs=out[str(i)][1], advantage=1.0,
                   finish_reason=out[str(i)][2]) for i, p in enumerate(prompts)]


def mismatch(trainer: TorchBackend, samples: list[Sample]) -> dict[str, float]:
    """The trainer's mismatch metrics of one micro-batch (its accumulate path; no optimizer step)."""
    m = trainer.accumulate(samples, len(samples))
    trainer.model.zero_grad(set_to_none=True)
    trainer.step.finish()
    return m


def _grad(model: LlamaModel) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def gradients(arch, weights, samples: list[Sample], caps: list[float], seed: int, chunk: int = 128
              ) -> dict[str, torch.Tensor]:
    """The expected policy-gradient of each variant (module docstring) over every generated position, as one fp64
    vector over all parameters."""
    policy = LlamaModel.from_state_dict(arch, weights)
    ids, att, rmask, _ = pack(samples)
    z = policy(ids, attention_mask=att)[:, :-1][rmask]  # [N, V] fp32 trainer logits at generated positions
    with torch.no_grad():
        logp = torch.log_softmax(z.detach(), -1)
        engine = LlamaModel.from_state_dict(arch, weights, dtype=torch.bfloat16)
        beh = torch.log_softmax(engine(ids, attention_mask=att)[:, :-1][rmask].float(), -1)
        del engine
    adv = torch.randn(arch.vocab_size, generator=torch.Generator().manual_seed(seed))
    variants = {"target: fp32 engine": None, "uncorrected (bf16 engine)": "none"}
    variants.update({f"{m.upper()} (bf16 engine, cap {cap:g})": (m, cap) for cap in caps for m in ("tis", "mis")})
    out, g = {}, torch.empty_like(logp)
    for name, variant in variants.items():
        mode, cap = variant if isinstance(variant, tuple) else (variant, None)
        with torch.no_grad():  # ∂/∂z Σ_a c_a log π_a = c − π · Σ_a c_a, with c = q · w · A
            for i in range(0, len(logp), chunk):
                lp, bh = logp[i:i + chunk], beh[i:i + chunk]
                c = lp.exp() * adv if mode is None else bh.exp() * adv
                if mode in ("tis", "mis"):
                    w, _ = behaviour_weights(lp, bh, torch.ones_like(lp, dtype=torch.bool),
                                             GRPOOptions(behaviour_correction=mode, behaviour_cap=cap))
                    c = c * w
                g[i:i + chunk] = c - lp.exp() * c.sum(-1, keepdim=True)
        policy.zero_grad(set_to_none=True)
        z.backward(-g, retain_graph=True)
        out[name] = _grad(policy).double()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="responses")
    ap.add_argument("--new", type=int, default=256, help="tokens per response")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (random ids)")
    ap.add_argument("--init-std", type=float, default=0.1, help="std of the random matrices (0.1: sampled tokens' "
                    "logprobs around −6 to −10, logits spread like a trained model's; 0.02: a near-uniform softmax)")
    ap.add_argument("--caps", type=float, nargs="+", default=[2.0, 1.02],
                    help="behaviour_cap C of TIS / MIS (the first also for the 'over cap' column)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    arch = ModelArch(**QWEN3_SHAPE)
    weights = random_weights(arch, a.init_std, a.seed)
    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(0, arch.vocab_size, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    print(f"Qwen3-shaped random model: {arch.num_params() / 1e6:.1f} M parameters, init std {a.init_std}; "
          f"{a.batch} responses × {a.new} tokens, temperature 1; trainer fp32 (TorchBackend)")
    trainer = TorchBackend(arch, weights, lr=1e-5, keep_reference=False,
                           objective=GRPOOptions(behaviour_correction="tis", behaviour_cap=a.caps[0]))
    rows, bf16 = [], None
    for name in ENGINES:
        t0 = time.perf_counter()
        smp = sample(arch, weights, name, prompts, a.new)
        m = mismatch(trainer, smp)
        rows.append((name, m, time.perf_counter() - t0))
        bf16 = smp if name == "bf16" else bf16
    print(f"\n{'engine':28} {'mean |Δ|':>9} {'max |Δ|':>8} {'k3 KL':>9} {'outside clip':>12} "
          f"{'over cap':>9} {'s':>6}")
    for name, m, s in rows:
        print(f"{name:28} {m['logprob_diff']:9.4f} {m['logprob_diff_max']:8.3f} {m['mismatch_kl']:9.5f} "
              f"{100 * m['mismatch_outside_clip_share']:11.2f}% {100 * m['mismatch_capped_share']:8.3f}% {s:6.1f}")
    t0 = time.perf_counter()
    grads = gradients(arch, weights, bf16, a.caps, a.seed)
    target = grads.pop("target: fp32 engine")
    print(f"\nexpected policy gradient at the bf16 engine's {a.batch * a.new} prefixes vs the fp32 engine's "
          f"(|target| = {float(target.norm()):.4g}; {time.perf_counter() - t0:.0f} s)")
    print(f"{'objective':34} {'rel. L2 distance':>16} {'cosine':>10}")
    for name, gv in grads.items():
        rel = float((gv - target).norm() / target.norm())
        cos = float(gv @ target / (gv.norm() * target.norm()))
        print(f"{name:34} {rel:16.3e} {cos:10.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
