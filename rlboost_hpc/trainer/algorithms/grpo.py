"""GRPO and the variants users of TRL and verl expect: group advantages, the clipped policy-gradient loss with its
loss-aggregation modes, bounded KL estimators, and importance correction of the engine–trainer mismatch.

Sources:
- GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), §4.1 eq. (3) objective and §4.1.2 outcome supervision
  (advantage = (r − mean(r_group)) / std(r_group)); PPO's clipped surrogate, Schulman et al. 2017 (arXiv 1707.06347)
  eq. (7).
- DAPO: Yu et al. 2025 (arXiv 2503.14476): §3.1 clip-higher (a separate upper clip bound ε_high), §3.3 token-level
  policy-gradient loss (one mean over every token of the step: ``token_mean``), §3.4 overlong filtering (truncated
  samples masked out of the loss: ``mask_truncated``).
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv 2503.20783), §3.1
  eq. (3): no division by the response length (a constant normaliser instead: ``seq_mean_token_sum_norm``) and no
  division of the advantage by the group's std (``std_norm=False``).
- KL estimators k1, k2, k3: Schulman 2020, "Approximating KL divergence" (k3 is GRPO eq. (4)'s); bounded as verl's
  ``core_algos.kl_penalty`` does — log-ratio clamped to [−20, 20], the k3 (= verl's ``low_var_kl``) value clamped to
  [−10, 10] — and as OpenRLHF's ``compute_approx_kl`` after OpenRLHF #525, where one token 12 nats below the
  reference was the whole gradient and one at 90 nats made it non-finite.
- Importance correction of the behaviour policy (the rollout engine) against the trainer's policy: truncated
  importance sampling (TIS), Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (verl PR #2953): the PPO term of each token times min(π_trainer/π_engine, C); masked importance sampling
  (MIS), Liu, Yao et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
  Mismatch": units whose ratio exceeds C are dropped (weight 0) instead of capped; token- or sequence-level ratios as
  verl's ``rollout_is_level``, and its ``geometric`` level: the length-normalised sequence ratio (the geometric mean of
  the token ratios, as NeMo-RL's ``seq-mask-tis`` and TRL's GSPO-style sequence ratio), whose spread does not grow with
  the response's length — the product over 1k tokens of a per-token mismatch of a few hundredths of a nat lands past
  any cap for a large share of responses (:func:`behaviour_weights`). Effective sample size of the weights: Kong 1992,
  ESS = (Σw)² / Σw² (reported ÷ units, in [0, 1]).

Invariant: pure tensor functions; no model, no optimizer, no I/O. One implementation for every trainer backend (torch
and Megatron call :func:`grpo_loss` with the same :class:`GRPOOptions`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlboost_hpc import defaults as D

#: ``trainer.loss_aggregation`` values (TRL ``loss_type`` grpo / dapo·bnpo / dr_grpo; verl ``loss_agg_mode``).
LOSS_AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
#: ``trainer.kl_estimator`` values (verl ``kl_loss_type``; ``low_var_kl`` is verl's name for the bounded k3).
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
#: ``trainer.behaviour_correction`` values.
BEHAVIOUR_CORRECTIONS = ("none", "tis", "mis")
#: ``trainer.behaviour_level`` values.
BEHAVIOUR_LEVELS = ("token", "sequence", "geometric")
#: The levels whose unit is a response (one weight for all of its tokens).
SEQUENCE_LEVELS = ("sequence", "geometric")
#: |log π_ref − log π_θ| is clamped to this many nats before any KL estimator (verl's kl_penalty bound).
KL_LOG_RATIO_BOUND = 20.0
#: The k3 / low_var_kl value is clamped to [−10, 10] nats (verl's low_var_kl bound; OpenRLHF's after #525).
KL_VALUE_BOUND = 10.0


@dataclass(frozen=True)
class GRPOOptions:
    """The objective's choices (``trainer.*`` of the run config; defaults in ``rlboost_hpc.defaults``).

    Attributes:
        clip_eps: PPO clip range ε (> 0): the ratio is clipped to [1 − ε, 1 + ε_high].
        clip_eps_high: DAPO's clip-higher ε_high (≥ ε); None: ε.
        kl_coef: β of the KL penalty (≥ 0; 0: no reference policy needed).
        kl_estimator: one of :data:`KL_ESTIMATORS` (:func:`kl_estimate`).
        loss_aggregation: one of :data:`LOSS_AGGREGATIONS` (:func:`aggregate`).
        max_response_tokens: the constant normaliser of ``seq_mean_token_sum_norm`` (the response or trajectory
            budget in tokens, > 0 for that mode).
        behaviour_correction: one of :data:`BEHAVIOUR_CORRECTIONS` (:func:`behaviour_weights`).
        behaviour_cap: the cap C (> 0) of the importance ratio π_trainer/π_engine.
        behaviour_level: one of :data:`BEHAVIOUR_LEVELS`.
        mask_truncated: truncated responses contribute no loss (their advantages still shape their group's).

    Raises:
        ValueError: an unknown mode or an out-of-range number; the message names the field.
    """

    clip_eps: float = D.CLIP_EPS
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = D.KL_ESTIMATOR
    loss_aggregation: str = D.LOSS_AGGREGATION
    max_response_tokens: int = 0
    behaviour_correction: str = D.BEHAVIOUR_CORRECTION
    behaviour_cap: float = D.BEHAVIOUR_CAP
    behaviour_level: str = D.BEHAVIOUR_LEVEL
    mask_truncated: bool = D.MASK_TRUNCATED

    def __post_init__(self) -> None:
        for name, allowed in (("kl_estimator", KL_ESTIMATORS), ("loss_aggregation", LOSS_AGGREGATIONS),
                              ("behaviour_correction", BEHAVIOUR_CORRECTIONS), ("behaviour_level", BEHAVIOUR_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not self.clip_eps > 0:
            raise ValueError(f"clip_eps = {self.clip_eps} must be > 0")
        if self.clip_eps_high is not None and not self.clip_eps_high >= self.clip_eps:
            raise ValueError(f"clip_eps_high = {self.clip_eps_high} must be >= clip_eps = {self.clip_eps}")
        if not self.behaviour_cap > 0:
            raise ValueError(f"behaviour_cap = {self.behaviour_cap} must be > 0")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef = {self.kl_coef} must be >= 0")
        if self.loss_aggregation == "seq_mean_token_sum_norm" and self.max_response_tokens <= 0:
            raise ValueError("loss_aggregation = seq_mean_token_sum_norm needs max_response_tokens > 0")

    @property
    def clip_high(self) -> float:
        """ε_high: ``clip_eps_high``, or ``clip_eps`` when unset."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, *, std_norm: bool = D.ADVANTAGE_STD_NORM
                     ) -> torch.Tensor:
    """Outcome-supervised GRPO advantages of one group (DeepSeekMath §4.1.2; Dr. GRPO §3.1 without the std).

    Args:
        rewards: [G] float, one scalar reward per response of the group.
        eps: added to the std so a group of equal rewards gets advantage 0 (not NaN).
        std_norm: divide by the group's std (GRPO; TRL ``scale_rewards``, verl ``norm_adv_by_std_in_grpo``);
            False: only centre (Dr. GRPO).
    Returns:
        [G] float32: (r − mean) / (std + eps) with std the population std (unbiased=False), or r − mean.
    """
    r = rewards.to(torch.float32)
    centred = r - r.mean()
    return centred / (r.std(unbiased=False) + eps) if std_norm else centred


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = D.KL_ESTIMATOR) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) in nats, for tokens sampled from π_θ (Schulman 2020), bounded.

    With d = clamp(log π_ref − log π_θ, −20, 20) (verl's log-ratio bound):
    ``k1`` = −d (unbiased, can be negative); ``k2`` = d²/2 (biased, low variance); ``k3`` = ``low_var_kl`` =
    clamp(exp(d) − d − 1, −10, 10) (unbiased before the clamp, never negative; verl's ``low_var_kl`` and ``k3``,
    OpenRLHF's ``k3`` after #525). The clamps pass no gradient beyond their bounds: a token far below the
    reference stops pulling instead of becoming the whole update (e.g. d = 12: k3 would be 1.6e5 with gradient
    exp(12) ≈ 1.6e5 per token).

    Args:
        logp, ref_logp: [...] float logprobs of the same tokens under π_θ and π_ref (any equal shapes).
        estimator: one of :data:`KL_ESTIMATORS`.
    Returns:
        [...] the per-token estimate, differentiable in both inputs (within the bounds).
    Raises:
        ValueError: an unknown estimator.
    """
    d = (ref_logp - logp).clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator in ("k3", "low_var_kl"):
        return (torch.exp(d) - d - 1.0).clamp(-KL_VALUE_BOUND, KL_VALUE_BOUND)
    raise ValueError(f"kl_estimator = {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def behaviour_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                      opts: GRPOOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights correcting samples drawn by the engine (π_beh) for the trainer's policy π_old (TIS/MIS).

    The ratio ρ = π_old/π_beh per token (``token``), per sequence (``sequence``: the product over the sequence's
    masked tokens, applied to each of them) or per sequence length-normalised (``geometric``: the geometric mean of
    the token ratios, exp of the mean log ratio over the masked tokens — C then bounds a per-token scale).
    ``tis``: w = min(ρ, C); ``mis``: w = ρ where ρ ≤ C, else 0; ``none``: w = 1. Computed in log space (no
    overflow), without gradient.

    Args:
        old_logp: [B, T] float trainer logprobs (π_old; no grad needed). behaviour_logp: [B, T] float engine logprobs
            of the same tokens. mask: [B, T] bool, the tokens the engine generated.
        opts: ``behaviour_correction``, ``behaviour_cap`` (C), ``behaviour_level``.
    Returns:
        (w [B, T] float32, over [B, T] bool: the tokens whose unit's ratio exceeded C; both 0/False off the mask).
    """
    m = mask.to(torch.float32)
    log_rho = (old_logp.detach().float() - behaviour_logp.float()) * m
    if opts.behaviour_level in SEQUENCE_LEVELS:
        per_seq = log_rho.sum(dim=1, keepdim=True)
        if opts.behaviour_level == "geometric":
            per_seq = per_seq / m.sum(dim=1, keepdim=True).clamp_min(1.0)
        log_rho = per_seq.expand_as(log_rho)
    log_cap = math.log(opts.behaviour_cap)
    over = (log_rho > log_cap) & mask
    if opts.behaviour_correction == "none":
        return m, over
    w = torch.exp(log_rho.clamp(max=log_cap))
    if opts.behaviour_correction == "mis":
        w = torch.where(over, torch.zeros_like(w), w)
    return w * m, over


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, opts: GRPOOptions) -> torch.Tensor:
    """Sum of a micro-batch's per-token objective in the unit of ``opts.loss_aggregation`` (to be divided by
    :func:`step_normaliser`).

    - ``seq_mean_token_mean`` (GRPO eq. 3; TRL ``grpo``, verl ``seq-mean-token-mean``): Σ_i (1/|o_i|) Σ_t x_it;
      normaliser: the responses of the step (1/G Σ_i).
    - ``token_mean`` (DAPO §3.3; TRL ``dapo``/``bnpo``, verl ``token-mean``): Σ_i Σ_t x_it; normaliser: the loss
      tokens of the step (known only once the step's last group arrived: see :func:`gradient_scale`).
    - ``seq_mean_token_sum_norm`` (Dr. GRPO eq. 3; TRL ``dr_grpo``, verl ``seq-mean-token-sum-norm``):
      Σ_i Σ_t x_it / L with L = ``opts.max_response_tokens``; normaliser: the responses of the step.

    Args:
        per_token: [B, T] float. mask: [B, T] float (1 on loss tokens).
    Returns:
        A scalar with ``per_token``'s grad.
    """
    tok_sum = (per_token * mask).sum(dim=1)
    if opts.loss_aggregation == "seq_mean_token_mean":
        return (tok_sum / mask.sum(dim=1).clamp_min(1.0)).sum()
    if opts.loss_aggregation == "seq_mean_token_sum_norm":
        return tok_sum.sum() / float(opts.max_response_tokens)
    return tok_sum.sum()


def step_normaliser(opts: GRPOOptions, responses: int, loss_tokens: int) -> float:
    """What the summed :func:`grpo_loss` of a whole RL step is divided by: ``loss_tokens`` (the tokens of the step
    that carry loss) for ``token_mean``, else ``responses`` (every response of the step, masked ones included, as
    TRL's ``grpo`` / ``dr_grpo`` means do). At least 1."""
    return float(max(1, loss_tokens if opts.loss_aggregation == "token_mean" else responses))


def gradient_scale(opts: GRPOOptions, responses: int, loss_tokens: int) -> float:
    """Factor applied to the accumulated gradients before the optimizer step by a backend that divided each
    micro-batch's loss by ``responses`` (the only normaliser known while groups still stream in): 1 for the
    per-sequence modes, ``responses / loss_tokens`` for ``token_mean`` — so the step's gradient is exactly that of
    Σ loss / :func:`step_normaliser` however the step was split into micro-batches."""
    return max(1, responses) / step_normaliser(opts, responses, loss_tokens)


def loss_mask(mask: torch.Tensor, truncated: torch.Tensor | None, opts: GRPOOptions) -> torch.Tensor:
    """[B, T] float32: 1 on tokens that carry loss — ``mask`` (bool [B, T]), without the rows of truncated
    responses (``truncated``: [B] bool) when ``opts.mask_truncated`` (DAPO §3.4 overlong filtering)."""
    m = mask.to(torch.float32)
    if opts.mask_truncated and truncated is not None:
        m = m * (~truncated.to(torch.bool, copy=False)).to(torch.float32)[:, None]
    return m


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              opts: GRPOOptions | None = None, *, ref_logp: torch.Tensor | None = None,
              behaviour_logp: torch.Tensor | None = None, truncated: torch.Tensor | None = None,
              staleness: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's GRPO objective (DeepSeekMath eq. 3, negated) under ``opts``, summed in the unit of its loss
    aggregation: the RL step's loss is the sum over micro-batches divided by :func:`step_normaliser`, whatever the
    split (streamed gradient accumulation).

    Per token: ratio r = exp(logp − old_logp); surrogate = min(r·A, clip(r, 1 − ε, 1 + ε_high)·A), times the
    behaviour weight w (:func:`behaviour_weights`; 1 without correction); with ``kl_coef`` > 0, minus β·KL
    (:func:`kl_estimate`). Tokens of truncated responses carry no loss under ``mask_truncated``.

    Bounded staleness uses the same function: it is the decoupled PPO objective (AReaL, Fu et al. 2025, eq. 5) with
    the proximal policy π_prox = ``old_logp``, the trainer's policy at the start of the step (one optimizer step per
    RL step, so π_prox = π_θ before the update): the PPO ratio π_θ/π_prox is clipped, and the behaviour weight
    min(π_prox/π_behaviour, C) corrects for the older versions (and the engine) that sampled the tokens.

    Args:
        logp: [B, T] float32 log π_θ(o_t | q, o_<t) with grad.
        old_logp: [B, T] float32 log π_old, recomputed by the trainer (no grad).
        advantages: [B] float32.
        mask: [B, T] bool, True on generated response tokens (observation tokens are False).
        opts: the objective's choices (default :class:`GRPOOptions`).
        ref_logp: [B, T] float32 reference-policy logprobs, required when ``opts.kl_coef > 0``.
        behaviour_logp: [B, T] float32 engine logprobs of the tokens (the mismatch statistics; the correction's
            ratio), required when ``opts.behaviour_correction != "none"``.
        truncated: [B] bool, responses cut by a budget (``Sample.truncated``).
        staleness: [B, T] int, versions between each token's producer and the trained version (bounded staleness);
            with ``behaviour_logp``, the mismatch |log π_old − log π_beh| is also reported per staleness.
    Returns:
        (loss_sum: scalar to minimise, stats: 0-dim tensors to add up over micro-batches with :func:`merge_stats`
        after :func:`stats_to_floats`, then :func:`finish_stats`).
    Raises:
        ValueError: ``kl_coef > 0`` without ``ref_logp``; a correction without ``behaviour_logp``.
    """
    opts = opts or GRPOOptions()
    if opts.kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if opts.behaviour_correction != "none" and behaviour_logp is None:
        raise ValueError(f"behaviour_correction = {opts.behaviour_correction} needs behaviour_logp")
    m = loss_mask(mask, truncated, opts).to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    per_tok = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - opts.clip_eps, 1.0 + opts.clip_high) * adv)
    weights = over = None
    if behaviour_logp is not None:
        weights, over = behaviour_weights(old_logp, behaviour_logp, mask, opts)
        per_tok = per_tok * weights.to(per_tok.dtype)
    kl = None
    if opts.kl_coef > 0:
        kl = kl_estimate(logp, ref_logp, opts.kl_estimator)
        per_tok = per_tok - opts.kl_coef * kl
    loss_sum = -aggregate(per_tok, m, opts)
    with torch.no_grad():
        stats = _loss_stats(ratio, m, kl, opts)
        if behaviour_logp is not None:
            stats.update(_mismatch_stats(old_logp, behaviour_logp, mask, over, opts, weights, staleness))
        stats["loss_sum"] = loss_sum.detach()
    return loss_sum, stats


def _loss_stats(ratio: torch.Tensor, m: torch.Tensor, kl: torch.Tensor | None, opts: GRPOOptions
                ) -> dict[str, torch.Tensor]:
    """Sums over the loss tokens ``m`` [B, T]: tokens, policy-ratio clips, KL; the largest policy ratio."""
    zero = torch.zeros((), dtype=torch.float32, device=ratio.device)
    outside = ((ratio < 1.0 - opts.clip_eps) | (ratio > 1.0 + opts.clip_high)).to(m.dtype)
    return {"loss_tokens": m.sum().float(), "clipped": (outside * m).sum().float(),
            "kl_sum": (kl.detach() * m).sum().float() if kl is not None else zero,
            "ratio_max": (ratio.detach() * m).max().float() if m.numel() else zero + 1.0}


def _mismatch_stats(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, over: torch.Tensor,
                    opts: GRPOOptions, weights: torch.Tensor, staleness: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
    """The engine–trainer mismatch over the generated tokens ``mask`` [B, T] (sums; maxima): |Δ logprob|, the k3
    estimate of KL(π_beh ‖ π_old) on the engine's samples, tokens whose ratio π_old/π_beh leaves the PPO clip band,
    the correction's units (tokens or sequences) whose ratio exceeds the cap, the behaviour ``weights`` [B, T]
    applied (sum), each unit's weight summed and squared (the effective sample size) and the units MIS dropped, and
    the largest ratio; with ``staleness`` [B, T] int, |Δ logprob| and tokens per staleness."""
    m = mask.to(torch.float32)
    old, beh = old_logp.detach().float(), behaviour_logp.float()
    diff = (old - beh).abs() * m
    rho = torch.exp((old - beh).clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND))
    outside = ((rho < 1.0 - opts.clip_eps) | (rho > 1.0 + opts.clip_high)).float() * m
    w = weights.float() * m
    if opts.behaviour_level in SEQUENCE_LEVELS:
        rows = mask.any(dim=1)
        units, capped = rows.sum().float(), (over.any(dim=1) & rows).sum().float()
        unit_w = (w.amax(dim=1) if w.numel() else w.sum(dim=1))[rows]  # one weight per response, shared by its tokens
    else:
        units, capped = m.sum(), over.float().sum()
        unit_w = w[mask]
    out = {"tokens": m.sum(), "diff_sum": diff.sum(), "diff_max": diff.max() if diff.numel() else diff.sum(),
           "mismatch_kl_sum": (kl_estimate(beh, old, "k3") * m).sum(), "outside_clip": outside.sum(),
           "capped": capped, "units": units, "weight_sum": w.sum(), "unit_w_sum": unit_w.sum(),
           "unit_w_sq_sum": (unit_w * unit_w).sum(),
           "dropped": capped if opts.behaviour_correction == "mis" else capped * 0,
           "rho_max": (rho * m).max() if m.numel() else m.sum()}
    if staleness is not None:
        for j in torch.unique(staleness[mask]).tolist():
            at = (staleness == j).float() * m
            out[f"tokens_stale{j}"], out[f"diff_sum_stale{j}"] = at.sum(), (diff * at).sum()
    return out


#: Stats combined by maximum (the others add up).
_MAX_STATS = frozenset({"ratio_max", "diff_max", "rho_max"})


def stats_to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """:func:`grpo_loss`'s stats as floats, fetched in one device→host transfer."""
    keys = sorted(stats)
    vals = torch.stack([stats[k].detach().float().reshape(()) for k in keys]).tolist() if keys else []
    return dict(zip(keys, vals))


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two micro-batches' (or replicas') stats as one: sums add, maxima take the larger."""
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out[k], v) if k in out and k in _MAX_STATS else out.get(k, 0.0) + v
    return out


def finish_stats(s: dict[str, float]) -> dict[str, float]:
    """Metrics of merged stats (a micro-batch's or a whole step's):

    - ``clip_frac``: share of loss tokens whose policy ratio π_θ/π_old left [1 − ε, 1 + ε_high]; ``kl``: mean KL
      estimate to the reference per loss token (nats); ``ratio_max``: the largest policy ratio;
    - engine–trainer mismatch over generated tokens (when behaviour logprobs were given): ``logprob_diff`` /
      ``logprob_diff_max`` (mean / largest |log π_old − log π_beh|, nats), ``mismatch_kl`` (k3 estimate of
      KL(π_beh ‖ π_old) per token, bounded, nats), ``mismatch_outside_clip_share`` (share of tokens whose ratio
      π_old/π_beh leaves the PPO clip band), ``mismatch_capped_share`` (share of the correction's units — tokens or
      sequences — whose ratio exceeds ``behaviour_cap``: capped by TIS, dropped by MIS, counted either way),
      ``behaviour_weight_mean`` (the mean importance weight applied, 1 without correction),
      ``behaviour_ratio_max`` (the largest ratio π_old/π_beh before the cap), ``behaviour_ess`` (the effective sample
      size of the units' weights, (Σw)² / Σw², ÷ units: 1 when every unit weighs the same, → 0 when a few carry the
      step) and ``behaviour_dropped_share`` (share of the units MIS dropped: weight 0; 0 under TIS and none);
    - under bounded staleness, ``logprob_diff_staleness{j}``: the mean |Δ logprob| of the tokens made j versions
      before the trained one.
    """
    lt = max(1.0, s.get("loss_tokens", 0.0))
    out = {"clip_frac": s.get("clipped", 0.0) / lt, "kl": s.get("kl_sum", 0.0) / lt,
           "ratio_max": s.get("ratio_max", 1.0) if s.get("loss_tokens", 0.0) else 1.0}
    if "diff_sum" in s:
        n = max(1.0, s["tokens"])
        out.update(logprob_diff=s["diff_sum"] / n, logprob_diff_max=s["diff_max"],
                   mismatch_kl=s["mismatch_kl_sum"] / n, mismatch_outside_clip_share=s["outside_clip"] / n,
                   mismatch_capped_share=s["capped"] / max(1.0, s["units"]),
                   behaviour_weight_mean=s.get("weight_sum", n) / n, behaviour_ratio_max=s.get("rho_max", 1.0))
        units = max(1.0, s.get("units", 0.0))
        if "unit_w_sum" in s:
            sq = s["unit_w_sq_sum"]
            out.update(behaviour_ess=s["unit_w_sum"] ** 2 / (sq * units) if sq > 0 else 0.0,
                       behaviour_dropped_share=s.get("dropped", 0.0) / units)
        for k, v in s.items():
            if k.startswith("diff_sum_stale"):
                j = k[len("diff_sum_stale"):]
                out[f"logprob_diff_staleness{j}"] = v / max(1.0, s[f"tokens_stale{j}"])
    return out
