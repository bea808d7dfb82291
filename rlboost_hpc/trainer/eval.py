"""Held-out evaluation of a policy version with a local torch engine, and the quality gate's KL estimate.

Invariants:
- Evaluation is reproducible: sample j of held-out prompt i uses seed ``base_seed + 1000·i + j``, so "before"
  and "after" see the same random draws and differ only by the weights. Prompts are encoded exactly as the
  trainer encodes them (:meth:`rlboost_hpc.tasks.base.Task.prompt_ids`: the chat template when the tokenizer
  is in chat mode), and responses stop at the model's stop tokens.
- :func:`kl_to_reference` estimates KL(π_θ ‖ π_ref) per token on responses sampled from π_θ with the trainer's own
  estimator (``trainer.kl_estimator``, default k3: mean over tokens of ``exp(r) − r − 1`` with ``r = log π_ref(t) −
  log π_θ(t)``; Schulman, "Approximating KL divergence", 2020) and its bounds (``r`` clamped to ±20 nats, k3 to ±10:
  :func:`~rlboost_hpc.trainer.algorithms.grpo.kl_estimate`), both logprobs at the sampling temperature — so one
  token far below the reference moves the quality gate by at most 10 nats ÷ the tokens evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.rollout.engines.base import GenRequest, SamplingParams
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine, generate_all
from rlboost_hpc.tasks.base import Scored, Task, strip_stop
from rlboost_hpc.tasks.stories import repetition_rate
from rlboost_hpc.tasks.environment import TurnCall
from rlboost_hpc.tasks.tools import TurnCalls, turn_seed
from rlboost_hpc.trainer.algorithms.grpo import kl_estimate
from rlboost_hpc.trainer.backends.base import Sample, TrainerBackend


@dataclass(frozen=True)
class TurnSettings:
    """How evaluation plays multi-turn trajectories — as the run's rollouts do: at most ``max_turns`` assistant turns
    of at most ``max_new_tokens`` each (evaluate's argument) and ``max_trajectory_tokens`` after the prompt; a turn
    ending with one of ``tool_stop_ids`` is a tool call answered by ``tools`` (under its deadline). A task with a
    stateful environment (:meth:`~rlboost_hpc.tasks.base.Task.environment_of`) sends every turn to ``tools`` (an
    :class:`~rlboost_hpc.tasks.environment.EnvironmentCalls`: one instance per trajectory), whose ``done`` ends it and
    whose rewards add up to the trajectory's environment term."""

    max_turns: int
    max_trajectory_tokens: int
    tool_stop_ids: tuple[int, ...]
    tools: TurnCalls  # ToolCalls, or a stateful environment's EnvironmentCalls


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    turn: int = 0
    turn_start: int = 0
    env: tuple[str, str] | None = None  # a stateful environment's (row, first observation)
    history: list[tuple[bytes, bytes, float]] = field(default_factory=list)  # its earlier turns (ids, observation, reward)
    rewards: list[float] = field(default_factory=list)  # its steps' rewards
    env_error: str = ""

    def turn_call(self, rid: str, last: bool) -> TurnCall:
        """The environment step of the turn that just finished."""
        return TurnCall(rid, self.turn, _pack(self.ids[self.turn_start:]), self.env[0], self.env[1],
                        tuple(self.history), last)


def _pack(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def _engine(arch: ModelArch, weights: Mapping[str, torch.Tensor], max_len: int, device, dtype,
            adapter: tuple[Any, Mapping[str, torch.Tensor]] | None) -> TorchEngine:
    """The evaluation's engine: on ``weights``, or on a LoRA run's base serving ``weights`` as its adapter."""
    if adapter is None:
        return TorchEngine(arch, weights, max_batch=64, max_len=max_len, device=device, dtype=dtype)
    spec, base = adapter
    eng = TorchEngine(arch, base, max_batch=64, max_len=max_len, device=device, dtype=dtype, adapter=spec)
    eng.load_adapter(weights, 0)
    return eng


def _score(trajs: dict[str, "_Trajectory"], meta: dict, tokenizer, task: Task,
           score: Callable[..., Scored] | None) -> tuple[dict[str, str], dict[str, float], dict[str, list]]:
    """The text each trajectory's reward reads (its final assistant turn, stop token left out), its reward:
    ``score(items, token_ids, environment)`` (the run's reward pool; ``environment``: each trajectory's ``(return,
    error)`` with a stateful environment, else None) or ``task.reward`` inline, and each reward component's values
    in the order of ``trajs`` (a user's task; ``{}`` otherwise).

    Raises:
        ValueError: a stateful environment's task without ``score`` (its term is the reward pool's to add).
    """
    final = {rid: strip_stop(t.ids[t.turn_start:], tokenizer.stop_ids) for rid, t in trajs.items()}
    texts = {rid: tokenizer.decode(ids) for rid, ids in final.items()}
    items = [(meta[rid][0], texts[rid]) for rid in trajs]
    env = [(sum(t.rewards), t.env_error) for t in trajs.values()] if any(t.env for t in trajs.values()) else None
    if env is not None and score is None:
        raise ValueError("held-out evaluation of a task with an environment scores through the reward pool")
    if score is None:
        scored, parts = [task.reward(p, t) for p, t in items], {}
    else:
        ids = [final[rid] for rid in trajs]
        scored, parts = score(items, ids, env)[:2]
    return texts, dict(zip(trajs, scored)), parts


def _play(eng: TorchEngine, trajs: dict[str, _Trajectory], meta: dict, stop_ids: tuple[int, ...], *,
          max_new_tokens: int, total: int, temperature: float, top_p: float, turns: TurnSettings | None) -> None:
    """Generate every trajectory to its end: one round per turn — every active trajectory's current turn, then its
    tool calls (environment steps), whose observations open the next turn."""
    tool_stops = turns.tool_stop_ids if turns else ()
    active = dict(trajs)
    while active:
        reqs = []
        for rid, t in active.items():
            greedy = meta[rid][1]
            sp = SamplingParams(temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                seed=turn_seed(t.seed, t.turn), stop_token_ids=tuple(stop_ids) + tuple(tool_stops))
            reqs.append(GenRequest(rid=rid, prompt_ids=t.prompt_ids + t.ids,
                                   max_new_tokens=min(max_new_tokens, total - len(t.ids)), sampling=sp))
        calls = {}
        for rid, (ids, lps, fin) in generate_all(eng, reqs).items():
            t = active[rid]
            t.ids += ids
            t.logprobs += lps
            t.generated += [True] * len(ids)
            if t.env is not None:  # a stateful environment: every turn is a step
                calls[rid] = t.turn_call(rid, last=t.turn + 1 >= turns.max_turns or len(t.ids) >= total)
            elif (turns and fin == "stop" and ids and ids[-1] in tool_stops and t.turn + 1 < turns.max_turns
                    and len(t.ids) < total):
                calls[rid] = ids
        active = {}
        for rid, o in (turns.tools.observe_all(calls) if calls else {}).items():
            t = trajs[rid]
            if t.env is not None:
                if o.status != "ok":
                    t.env_error = f"{o.status}: {o.error}"
                    continue
                t.rewards.append(o.reward)
                if o.done:
                    continue
            if o.obs_ids and len(t.ids) + len(o.obs_ids) < total:
                if t.env is not None:
                    t.history.append((_pack(t.ids[t.turn_start:]), _pack(o.obs_ids), o.reward))
                t.ids += o.obs_ids
                t.logprobs += [0.0] * len(o.obs_ids)
                t.generated += [False] * len(o.obs_ids)
                t.turn += 1
                t.turn_start = len(t.ids)
                active[rid] = t


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` passed (Chen et al., "Evaluating Large
    Language Models Trained on Code", 2021, eq. 1): 1 − C(n−c, k) / C(n, k), as the product 1 − Π_{i=n−c+1..n}
    (1 − k/i) (no large binomials). Raises ValueError unless 0 ≤ c ≤ n and 1 ≤ k ≤ n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def evaluate(arch: ModelArch, weights: Mapping[str, torch.Tensor], tokenizer, task: Task, *,
             samples: int, max_new_tokens: int, temperature: float, top_p: float, base_seed: int = 12345,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             score: Callable[..., Scored] | None = None,
             turns: TurnSettings | None = None, adapter: tuple[Any, Mapping[str, torch.Tensor]] | None = None,
             pass_k: tuple[int, ...] = (), correct_at: float = 1.0) -> dict:
    """Mean reward over held-out prompts (``samples`` sampled responses each, plus one greedy), and pass@k.

    Args:
        tokenizer: a :class:`~rlboost_hpc.models.hf_dir.PolicyTokenizer` (prompt ids, stop ids, decoding).
        score: the rewards (:class:`~rlboost_hpc.tasks.base.Scored`) of ``(prompt, text)`` pairs given also their
            token ids (the run's ``RewardPool.score``; inline ``task.reward`` when ``None``).
        turns: multi-turn trajectories with tool calls or a stateful environment (:class:`TurnSettings`); None:
            single-turn responses. The reward reads a trajectory's final assistant turn.
        adapter: a LoRA run's ``(AdapterSpec, base)``: ``weights`` is an adapter, served on the base as instances do.
        pass_k: the k of pass@k (each ≤ ``samples``); a sampled response passes when its reward ≥ ``correct_at``.

    Returns:
        A dict: reward_sampled, reward_greedy, repetition_rate (mean over sampled responses), responses (int),
        pass_at_k (each k, as text → the mean over prompts of :func:`pass_at_k` of their sampled responses),
        reward_functions (a user's task: each reward component's mean over the sampled responses it scored — a
        weight-0 function is a task metric apart from the reward),
        examples (first few greedy texts), sampled (the sampled responses as :class:`Sample` s, advantage 0,
        observation tokens masked, for :func:`kl_to_reference`).
    """
    total = turns.max_trajectory_tokens if turns else max_new_tokens
    prompts = [(p, task.prompt_ids(p, tokenizer), task.environment_of(p) if turns else None)
               for p in task.heldout_prompts()]
    longest = max(len(ids) for _, ids, _ in prompts)
    eng = _engine(arch, weights, min(longest + total, arch.max_position_embeddings), device, dtype, adapter)
    trajs: dict[str, _Trajectory] = {}
    meta, prompt_of = {}, {}
    for i, (p, ids, env) in enumerate(prompts):
        for j in range(samples + 1):
            rid = f"eval/{i}/{j}"
            trajs[rid] = _Trajectory(ids, base_seed + 1000 * i + j, env=env)
            meta[rid] = (p, j == samples)
            prompt_of[rid] = i
    try:
        _play(eng, trajs, meta, tokenizer.stop_ids, max_new_tokens=max_new_tokens, total=total,
              temperature=temperature, top_p=top_p, turns=turns)
    finally:
        if turns:  # a trajectory that ended with no room for its observation leaves its environment's instance live
            turns.tools.release(list(trajs))
            while turns.tools.pending:
                turns.tools.poll(1.0)
    texts, reward_of, parts = _score(trajs, meta, tokenizer, task, score)
    sampled_at = [k for k, rid in enumerate(trajs) if not meta[rid][1]]
    by_function = {name: [vals[k] for k in sampled_at if vals[k] is not None] for name, vals in parts.items()}
    sampled, greedy_r, rep, examples, drawn = [], [], [], [], []
    passed = [0] * len(prompts)  # per held-out prompt: its sampled responses that passed
    for rid, t in trajs.items():
        p, greedy = meta[rid]
        text, r = texts[rid], reward_of[rid]
        if not greedy and r >= correct_at:
            passed[prompt_of[rid]] += 1
        if greedy:
            greedy_r.append(r)
            if len(examples) < 4:
                examples.append(tokenizer.render_prompt(t.prompt_ids) + (tokenizer.decode(t.ids) if t.turn else text))
        else:
            sampled.append(r)
            rep.append(repetition_rate(text))
            drawn.append(Sample(prompt_ids=list(t.prompt_ids), response_ids=list(t.ids),
                                behaviour_logprobs=list(t.logprobs), advantage=0.0,
                                loss_mask=None if all(t.generated) else list(t.generated)))
    return {
        "reward_sampled": sum(sampled) / len(sampled),
        "reward_greedy": sum(greedy_r) / len(greedy_r),
        "repetition_rate": sum(rep) / len(rep),
        "responses": len(sampled) + len(greedy_r),
        "pass_at_k": {str(k): sum(pass_at_k(samples, c, k) for c in passed) / len(passed) for k in pass_k},
        "reward_functions": {name: sum(v) / len(v) for name, v in by_function.items() if v},
        "examples": examples,
        "sampled": drawn,
    }


def kl_to_reference(backend: TrainerBackend, samples: list[Sample], batch: int = 16,
                    estimator: str = D.KL_ESTIMATOR) -> float:
    """Estimate of KL(π_θ ‖ π_ref) in nats per token over ``samples`` drawn from π_θ with ``estimator`` (one of
    ``grpo.KL_ESTIMATORS``, bounded as in the loss; module docstring); the tokens of ``Sample.loss_mask`` only, when
    given (a trajectory's observations were not drawn from π_θ).

    Raises:
        ValueError: the backend keeps no reference policy; an unknown estimator.
    """
    num, den = 0.0, 0
    for i in range(0, len(samples), batch):
        part = [s for s in samples[i:i + batch] if s.response_ids]
        if not part:
            continue
        pol = backend.token_logprobs(part)
        ref = backend.token_logprobs(part, reference=True)
        for smp, a, b in zip(part, pol, ref):
            kl = kl_estimate(a.double(), b.double(), estimator)
            if smp.loss_mask is not None:  # observation tokens were not drawn from π_θ
                kl = kl[torch.tensor(smp.loss_mask, dtype=torch.bool)]
            num += float(kl.sum())
            den += kl.numel()
    return num / max(1, den)


class HeldOut:
    """The run's held-out evaluation, bound to how it samples: :func:`evaluate` of a
    version's weights (``weights(version)``: the state dict rollout instances receive) with fixed ``evaluate``
    keyword arguments (samples, budgets, temperature, device, reward ``score``, multi-turn ``turns``)."""

    def __init__(self, arch: ModelArch, tokenizer, task: Task, *,
                 weights: Callable[[int], Mapping[str, torch.Tensor]], **evaluate_kw: Any) -> None:
        self.arch, self.tokenizer, self.task, self.weights, self.kw = arch, tokenizer, task, weights, evaluate_kw

    def evaluate(self, version: int, keep_samples: bool = False) -> dict:
        """:func:`evaluate` of ``version``; its ``sampled`` responses (for :func:`kl_to_reference`) only with
        ``keep_samples``."""
        out = evaluate(self.arch, self.weights(version), self.tokenizer, self.task, **self.kw)
        if not keep_samples:
            out.pop("sampled")
        return out
