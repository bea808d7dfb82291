"""GRPO: group-normalised advantages and the clipped policy-gradient loss.

Sources: Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), §4.1 eq. (3) objective and §4.1.2 outcome
supervision (advantage = (r − mean(r_group)) / std(r_group)); PPO's clipped surrogate, Schulman et al. 2017
(arXiv 1707.06347) eq. (7); the KL penalty uses the unbiased "k3" estimator (Schulman 2020, "Approximating
KL divergence"), as GRPO eq. (4) does.

Invariant: pure tensor functions; no model, no optimizer, no I/O.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Outcome-supervised GRPO advantages of one group (DeepSeekMath §4.1.2).

    Args:
        rewards: [G] float32, one scalar reward per response of the group.
        eps: added to the std so a group of equal rewards gets advantage 0 (not NaN).
    Returns:
        [G] float32: (r − mean) / (std + eps), std the population std (unbiased=False).
    """
    r = rewards.to(torch.float32)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sequence GRPO objective terms, summed over a micro-batch (DeepSeekMath eq. 3, negated).

    For response i with tokens t: ratio = exp(logp − old_logp); surrogate = min(ratio·A_i,
    clip(ratio, 1−ε, 1+ε)·A_i); with a reference, minus β·k3 where k3 = exp(ref−logp) − (ref−logp) − 1.
    Each response contributes the mean over its own tokens (1/|o_i| Σ_t), so the caller divides the sum
    by the total number of responses in the RL step to get eq. (3)'s 1/G Σ_i — independent of how the
    step is split into micro-batches (streamed gradient accumulation).

    Args:
        logp: [B, T] float32 log π_θ(o_t | q, o_<t) with grad.
        old_logp: [B, T] float32 log π_θ_old, recomputed by the trainer (no grad).
        advantages: [B] float32.
        mask: [B, T] bool, True on response tokens.
        ref_logp: [B, T] float32 reference-policy logprobs, required when ``kl_coef > 0``.
    Returns:
        (loss_sum scalar to minimise = −Σ_i objective_i, metrics dict of floats: clip_frac, kl, ratio_max).
    """
    m = mask.to(logp.dtype)
    ntok = m.sum(dim=1).clamp_min(1.0)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    per_tok = surr
    kl_val = 0.0
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1.0
        per_tok = per_tok - kl_coef * k3
        kl_val = float(((k3 * m).sum() / m.sum().clamp_min(1.0)).detach())
    per_seq = (per_tok * m).sum(dim=1) / ntok
    loss_sum = -per_seq.sum()
    with torch.no_grad():
        clipped = ((ratio - 1.0).abs() > clip_eps).to(logp.dtype) * m
        metrics = {
            "clip_frac": float(clipped.sum() / m.sum().clamp_min(1.0)),
            "kl": kl_val,
            "ratio_max": float((ratio * m).max()) if m.any() else 1.0,
        }
    return loss_sum, metrics
