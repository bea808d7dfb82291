"""The synchronous on-policy RL loop (trainer side of RLBoost).

One step: submit the step's GRPO groups to the manager → the reserved engine seeds for ``T_seed`` seconds
→ close seeding (the manager migrates the reserved engine's unfinished responses to preemptible instances,
or keeps the reserved engine generating when none is routable: co-located fallback) → consume completed
groups as a stream of micro-batches with gradient accumulation → one optimizer step → publish version v+1
→ the manager routes only to v+1 holders.

Invariants checked here, on what the trainer actually receives (counted in the report, never assumed):
- exactly once: a response id seen twice is counted in ``responses_duplicated`` and not trained again;
- strict on-policy: tokens whose producing version ≠ the step's version are counted in
  ``tokens_trained_off_version`` (the manager already rejects them; this is the end-to-end check);
- bounded staleness (``max_staleness`` = k ≥ 1): the prompts of steps s+1 … s+k are submitted before step s trains
  (their groups wait, unacknowledged, until their step's turn); a token may come from the k versions before the one
  that trains it — its staleness is counted per step (``staleness_tokens``); a token outside that window is never
  trained (loss-masked) and is counted in ``tokens_masked_too_stale`` (the manager already refuses them);
- ids are ids: ids, logprobs and versions of a response must have equal length, else the step fails;
- truncation is known per response: every response carries why it ended (``finish_reason``: ``stop`` or a truncation
  cause, ``messages.FINISH_REASONS``); an unknown reason fails the step; the step's truncated share by cause is in
  its metrics (``truncated_share``, ``truncated_share_by_cause``) and the run's totals;
- infrastructure failures are never trained on: a step that cannot complete raises :class:`RolloutFailed`.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from rlboost_hpc import interrupts
from rlboost_hpc.observe.timeline import TAIL_FRACTION, Phase, StepTimeline, fixed_overhead_s
from rlboost_hpc.policy.controller import RolloutController, StepDecision, StepObservation
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.identity import is_reserved_key
from rlboost_hpc.protocol.stats import ManagerStats
from rlboost_hpc.tasks.base import Prompt, Scored, Task, strip_stop
from rlboost_hpc.tasks.user_rewards import RunProgress
from rlboost_hpc.trainer.algorithms.grpo import group_advantages
from rlboost_hpc.trainer.backends.base import Sample, TrainerBackend
from rlboost_hpc.trainer.client import ManagerClient
from rlboost_hpc.trainer.record import StepRecord
from rlboost_hpc.errors import RunFailed

if TYPE_CHECKING:
    from rlboost_hpc.trainer.publisher import Published

log = logging.getLogger("rlboost.trainer")

#: Characters of a sample row's prompt (its end) and response (its start) kept (trainer.log_samples).
SAMPLE_CHARS = 2000


class RolloutFailed(RunFailed, RuntimeError):
    """A step could not collect its responses (manager error, timeout, unrecoverable rollout failure)."""


@dataclass
class StepSettings:
    """What one RL step generates and how it trains, from the run's config (``rollout.*``, ``trainer.*``,
    ``task.*``): ``prompts_per_step`` GRPO groups of ``group_size`` responses each, at most ``max_new_tokens``
    tokens per response, sampled at ``temperature``/``top_p``; a forward/backward pass starts once ``micro_batch``
    responses are ready (or the step's rollout is complete) and takes every ready one up to ``micro_batch_max`` (0:
    ``micro_batch``); the seeding window lasts ``T_seed``, or — ``seed_until_trainable`` — longer while no pass could
    start; a step that has not got all its groups after ``step_timeout_s`` seconds fails
    (:class:`RolloutFailed`). ``seed`` seeds the prompt order and every group's sampling seed."""

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    micro_batch: int
    micro_batch_max: int = 0
    seed_until_trainable: bool = False
    step_timeout_s: float = 300.0
    seed: int = 0
    max_turns: int = 1  # > 1: multi-turn trajectories (tool calls answered by the manager's environment)
    max_trajectory_tokens: int = 0  # turns and observations after the prompt (0: max_new_tokens)
    tool_stop_ids: tuple[int, ...] = ()  # a turn ending with one of these is a tool call
    advantage_std_norm: bool = True  # divide group-centred rewards by the group's std (trainer.advantage_std_norm)
    max_staleness: int = 0  # k: steps submitted ahead, versions a token may lag (rollout.max_staleness)
    steps: int = 0  # the run's steps (trainer.steps): none is submitted ahead past the last; 0 = no end
    behaviour_dropped_warn: float = 1.0  # warn past this share of correction units MIS dropped (1: never)
    log_samples: int = 0  # sample rows kept per step (trainer.log_samples): StepRecord.samples


@dataclass
class Totals:
    """Run-wide counters the trainer keeps across steps (and checkpoints), reported in ``report.json``: responses
    and tokens trained, responses the manager delivered twice (skipped, never trained twice), tokens trained from a
    weight version other than the step's (must stay 0), responses that were migrated before they were trained,
    and trained responses that did not end on a stop, by cause (``messages.TRUNCATION_CAUSES``)."""

    responses_trained: int = 0
    responses_duplicated: int = 0
    responses_expected: int = 0
    tokens_trained: int = 0
    tokens_trained_off_version: int = 0
    tokens_masked_too_stale: int = 0  # bounded staleness: tokens outside the window, loss-masked (must stay 0)
    migrated_responses_trained: int = 0
    groups_redelivered: int = 0  # GroupDone copies skipped (the manager sent a group again: never trained twice)
    responses_left_out: int = 0  # responses of groups a reward component failed on (task.rewards.errors = skip)
    responses_truncated_by_cause: dict[str, int] = field(default_factory=dict)  # trained responses cut by a budget
    tokens_by_staleness: dict[str, int] = field(default_factory=dict)  # generated tokens trained, by staleness
    steps_over_dropped_warn: int = 0  # steps whose MIS-dropped share passed trainer.behaviour_dropped_warn


def truncation_shares(reasons: list[str]) -> dict:
    """``truncated_share`` (responses cut by a budget ÷ responses) and ``truncated_share_by_cause`` (cause →
    share, every cause of ``messages.TRUNCATION_CAUSES``) of a step's finish reasons."""
    n = max(1, len(reasons))
    by = {c: sum(1 for r in reasons if r == c) / n for c in M.TRUNCATION_CAUSES}
    return {"truncated_share": sum(1 for r in reasons if r != "stop") / n, "truncated_share_by_cause": by}


def rollout_by_kind(activity) -> dict[str, dict[str, float]]:
    """A step's rollout by kind of instance — ``{"reserved" | "preemptible": {"tokens", "busy_s", "idle_s",
    "pulling_s"}}`` — from the manager's :class:`~rlboost_hpc.protocol.stats.StepActivity` (tokens accepted, and
    instance-seconds per activity summed over the instances of the kind)."""
    out = {k: {"tokens": float(activity.tokens_by_kind.get(k, 0)), "busy_s": 0.0, "idle_s": 0.0, "pulling_s": 0.0}
           for k in ("reserved", "preemptible")}
    for key, acts in activity.by_instance_s.items():
        kind = out["reserved" if is_reserved_key(key) else "preemptible"]
        for act, sec in acts.items():
            kind[f"{act}_s"] = kind.get(f"{act}_s", 0.0) + sec
    return out


class DataFrontier:
    """Epoch-wise shuffled prompt order; ``take(n)`` returns the next n prompts and advances the frontier.

    Invariant: within an epoch every prompt is taken exactly once; the frontier (epoch, position) is the
    only state, so a checkpoint of it resumes with no prompt skipped or repeated.
    """

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        self.prompts, self.seed = prompts, seed
        self.epoch, self.pos = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def state(self) -> tuple[int, int]:
        """(epoch, position): all the frontier's state (the order is derived from the epoch)."""
        return self.epoch, self.pos

    def restore(self, epoch: int, pos: int) -> None:
        """Continue from a :meth:`state` taken earlier (same prompts and seed)."""
        self.epoch, self.pos = int(epoch), int(pos)
        self._order = self._perm(self.epoch)

    def take(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm(self.epoch)
            out.append(self.prompts[self._order[self.pos]])
            self.pos += 1
        return out


class StepCollector:
    """One step's groups as the manager delivers them, checked once each: a group delivered again (its ack or its
    first copy was lost) is acknowledged and skipped (``groups_redelivered``); a response id already seen is
    counted in ``responses_duplicated`` and not trained; every other response becomes a :class:`Sample` (its ids,
    logprobs and versions checked, its off-version tokens and truncation counted), each group is scored and gets
    its GRPO advantages, and its samples join the ready queue the trainer takes micro-batches from.

    Keeps the step's per-response records for its metrics: ``rewards``, ``lens`` (response tokens), ``turns``,
    ``reasons`` (finish reasons), ``served`` (instances that generated), ``n_mig`` (responses migrated at least
    once). Writes to the trainer's exactly-once ledgers (``seen``, ``trained_groups``, ``totals``)."""

    def __init__(self, trainer: "RLTrainer", step: int, by_gid: dict[str, tuple[Prompt, list[int]]],
                 timeline: StepTimeline | None) -> None:
        self.t, self.step, self.by_gid, self.tl = trainer, step, by_gid, timeline
        self.n_responses = len(by_gid) * trainer.s.group_size
        self.budget = trainer.s.max_trajectory_tokens or trainer.s.max_new_tokens
        self.took: set[str] = set()
        self.ready: list[Sample] = []
        self.rewards: list[float] = []
        self.lens: list[int] = []
        self.turns: list[int] = []
        self.reasons: list[str] = []
        self.served: set[str] = set()
        self.n_groups = self.n_mig = 0
        self.staleness: dict[str, int] = {}  # generated tokens trained, by staleness (bounded staleness)
        self.early: list[M.GroupDone] = []  # groups delivered before the step's turn (kept unacknowledged)
        self.by_function: dict[str, list[float]] = {}  # a user's task: each reward function's values this step
        self.left_out = 0  # responses of groups a reward component failed on (not trained)
        self.samples: list[dict] = []  # the step's first responses as rows (trainer.log_samples): prompt, response,
        # reward and its parts

    @property
    def complete(self) -> bool:
        """Every group of the step has arrived."""
        return self.n_groups == len(self.by_gid)

    def trainable(self, micro_batch: int) -> bool:
        """A pass could start: ``micro_batch`` samples are ready, or every group arrived and some are."""
        return len(self.ready) >= micro_batch or (self.complete and bool(self.ready))

    def next_batch(self, micro_batch: int, most: int = 0) -> list[Sample]:
        """The next micro-batch once :meth:`trainable`: every ready sample, at most ``most`` (0: ``micro_batch``) —
        responses that arrived together train as one batch; ``[]`` while not trainable."""
        if not self.trainable(micro_batch):
            return []
        n = max(most, micro_batch)
        batch, self.ready = self.ready[:n], self.ready[n:]
        return batch

    def take_many(self, evs: list[M.GroupDone | M.StepFailed]) -> None:
        """Take delivered groups (see the class docstring), together: their rewards are scored in one call to the
        reward processes (built-in tasks; a user's task scores each group in its own call, its functions' contract),
        then each group gets its advantages, joins the ready queue and is acknowledged. Raises RolloutFailed for
        ``StepFailed`` or a response that fails its checks."""
        t = self.t
        taken = []  # (gid, prompt, samples, texts, their token ids, environment returns)
        for ev in evs:
            if isinstance(ev, M.StepFailed):
                raise RolloutFailed(f"step {ev.step}: {ev.error}")
            if ev.gid not in self.by_gid or ev.gid in self.took:
                t.totals.groups_redelivered += 1
                t.client.send(M.AckGroup(gid=ev.gid))
                continue
            self.took.add(ev.gid)
            p, pids = self.by_gid[ev.gid]
            samples, texts, ids_of, env = [], [], [], []
            for resp in ev.responses:
                if resp.rid in t.seen:
                    t.totals.responses_duplicated += 1
                    continue
                t.seen.add(resp.rid)
                smp, text, text_ids = t._sample(self.step, resp, pids, self.budget, self.staleness)
                self.n_mig += int(resp.migrations > 0)
                self.served.update(resp.instances)
                texts.append(text)
                ids_of.append(text_ids)
                env.append((resp.env_return, resp.env_error))
                self.lens.append(len(smp.response_ids))
                self.turns.append(resp.turns)
                self.reasons.append(smp.finish_reason)
                samples.append(smp)
            taken.append((ev.gid, p, samples, texts, ids_of, env))
        if not taken:
            return
        with self.tl.phase(Phase.REWARD):
            for (gid, p, samples, _, _, _), (r, failed) in zip(taken, self._score(taken)):
                if samples and failed:  # a failed component's rewards are no rewards: the group is left out
                    t.left_out_groups[p.pid] = t.left_out_groups.get(p.pid, 0) + len(samples)
                    t.totals.responses_left_out += len(samples)
                    self.left_out += len(samples)
                elif samples:
                    t.trained_groups[p.pid] = t.trained_groups.get(p.pid, 0) + len(samples)
                    adv = group_advantages(torch.tensor(r, dtype=torch.float32), std_norm=t.s.advantage_std_norm)
                    for smp, a in zip(samples, adv.tolist()):
                        smp.advantage = a
                    self.ready.extend(samples)
                    self.rewards.extend(r)
        for gid, *_ in taken:
            self.n_groups += 1
            t.client.send(M.AckGroup(gid=gid))

    def _score(self, taken: list[tuple]) -> list[tuple[list[float], bool]]:
        """Each taken group's rewards and whether a reward component failed on it, in order (``([], False)`` for a
        group with no new response): one call of the run's scorer for every group, each group's components called
        on its own; each component's successful values go to the step's ``reward_functions`` means."""
        items = [(p, x) for _, p, _, texts, _, _ in taken for x in texts]
        if not items:
            return [([], False) for _ in taken]
        ids = [i for *_, ids_of, _ in taken for i in ids_of]
        env = [e for *_, env in taken for e in env]
        t = self.t
        progress = RunProgress(global_step=self.step, max_steps=t.s.steps,
                               epoch=t.frontier.epoch + t.frontier.pos / max(1, len(t.frontier.prompts)))
        sc = t.score(items, ids, env, [gid for gid, _, _, texts, _, _ in taken for _ in texts], progress=progress)
        for name, vals in sc.parts.items():
            self.by_function.setdefault(name, []).extend(v for v in vals if v is not None)
        for i in range(min(len(items), t.s.log_samples - len(self.samples))):
            self.samples.append({"prompt": items[i][0].text[-SAMPLE_CHARS:], "response": items[i][1][:SAMPLE_CHARS],
                                 "reward": sc.rewards[i], "failed": bool(sc.failed and sc.failed[i]),
                                 "parts": {name: vals[i] for name, vals in sc.parts.items()}})
        out, i = [], 0
        for _, _, _, texts, _, _ in taken:
            out.append((sc.rewards[i:i + len(texts)], any(sc.failed[i:i + len(texts)])))
            i += len(texts)
        return out


class RLTrainer:
    """Drives steps against a live manager. ``tokenizer``: a :class:`~rlboost_hpc.models.hf_dir.PolicyTokenizer`
    (prompt ids via ``task.prompt_ids``, stop ids, response text for rewards). ``publish(version)`` publishes the
    backend's weights into the weight server and returns what it published (``trainer/publisher.py``
    :class:`Published`: the version's identity, seconds and bytes). ``score(items, token_ids, environment, groups,
    progress=)`` gives the rewards of ``(prompt, text)`` pairs and each reward component's values, whose step means
    are the record's ``reward_functions`` (``tasks/reward_pool.py`` ``RewardPool.score``: each call under a
    deadline; inline ``task.reward`` when None)."""

    def __init__(self, *, client: ManagerClient, backend: TrainerBackend, task: Task, tokenizer,
                 settings: StepSettings, publish: Callable[[int], "Published"],
                 controller: RolloutController, available: Callable[[], int | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 score: Callable[..., Scored] | None = None) -> None:
        self.client, self.backend, self.task, self.tok = client, backend, task, tokenizer
        # rewards and their components' values of (prompt, text) pairs: the run's RewardPool (a deadline per call)
        self.score = score or (lambda items, *_, **__: Scored([task.reward(p, t) for p, t in items], {}))
        self.s = settings
        self.stop_ids = tuple(tokenizer.stop_ids)
        self.publish = publish
        self.clock = clock
        # T_seed and N_prem decisions (policy/controller.py; a fixed T_seed is a SeedingWindow with adapt=False)
        self.controller = controller
        self.available = available
        self.decision: StepDecision | None = None
        self.version = 0
        self.frontier = DataFrontier(task.train_prompts(), settings.seed)
        self.totals = Totals()
        self.seen: set[str] = set()
        self.trained_groups: dict[str, int] = {}  # prompt id -> responses trained (the data-frontier check)
        self.left_out_groups: dict[str, int] = {}  # prompt id -> responses left out (a reward component failed)
        self.taken: list[str] = []
        self.last_stats: ManagerStats | None = None  # the manager's stats taken at the end of the last step
        self._prompt_ids: dict[str, list[int]] = {}
        # bounded staleness: the submitted steps not trained yet, and the ledgers as they were before each one's
        # prompts were taken (a checkpoint holds those of the oldest: a resume takes and submits the same prompts)
        self.submitted: dict[int, StepCollector] = {}
        self._before: dict[int, tuple[tuple[int, int], int, int]] = {}

    def state_dict(self) -> dict:
        """Everything of the loop a resume needs, consistent with the last optimizer step: version,
        data frontier, totals, the exactly-once ledgers and the scheduling policy's state (T_seed, M[n], the
        cap) — plain JSON data, no pickled objects."""
        frontier, taken, totals = self.frontier.state(), self.taken, dict(vars(self.totals))
        if self.submitted:  # steps submitted ahead are not trained: they are taken and submitted again on resume
            frontier, n_taken, totals["responses_expected"] = self._before[min(self.submitted)]
            taken = taken[:n_taken]
        return {"version": self.version, "frontier": frontier,
                "totals": totals, "seen": sorted(self.seen),
                "trained_groups": dict(self.trained_groups), "left_out_groups": dict(self.left_out_groups),
                "taken": list(taken),
                "controller": self.controller.state_dict(),
                "decision": None if self.decision is None else asdict(self.decision)}

    def load_state_dict(self, st: dict) -> None:
        """Restore :meth:`state_dict` (same task and settings)."""
        self.version = int(st["version"])
        self.frontier.restore(*st["frontier"])
        self.totals = Totals(**st["totals"])
        self.seen = set(st["seen"])
        self.trained_groups = dict(st["trained_groups"])
        self.left_out_groups = dict(st.get("left_out_groups") or {})  # (absent in checkpoints of older versions)
        self.taken = list(st["taken"])
        if st.get("controller") is not None:  # the policy's state; its settings come from config
            self.controller.load_state_dict(st["controller"])
        self.decision = StepDecision(**st["decision"]) if st.get("decision") else None

    def prompts_not_trained_once(self) -> int:
        """Prompts taken from the data frontier whose group was not handled exactly once (all G responses trained —
        or left out because a reward component failed on them —, once per time the frontier handed the prompt out).
        0 is the exactly-once property over the data."""
        want: dict[str, int] = {}
        for pid in self.taken:
            want[pid] = want.get(pid, 0) + self.s.group_size
        return sum(1 for pid, n in want.items()
                   if self.trained_groups.get(pid, 0) + self.left_out_groups.get(pid, 0) != n)

    def _sample(self, step: int, resp: M.Response, prompt_ids: list[int], budget: int,
                staleness: dict[str, int]) -> tuple[Sample, str, list[int]]:
        """A delivered response as a :class:`Sample` (advantage 0 until its group is scored), the text its reward
        reads (the final assistant turn, after the last observation) and that text's token ids. Counts its off-version tokens, its truncation
        and (bounded staleness) its generated tokens by staleness into ``staleness``; a token older than
        ``max_staleness`` versions (or newer than the trained one) is loss-masked.

        Raises:
            RolloutFailed: ids, logprobs and versions of different lengths, an empty or over-budget response, malformed
                runs, or an unknown finish reason.
        """
        ids = M.unpack_i32(resp.ids)
        lps = M.unpack_f32(resp.logprobs)
        try:
            vers = M.expand_version_runs(resp.version_runs)
            obs = M.observation_mask(resp.observation_runs, len(ids))
        except ProtocolError as e:
            raise RolloutFailed(f"step {step}: response {resp.rid}: {e}") from None
        if not (len(ids) == len(lps) == len(vers)) or len(ids) == 0 or len(ids) > budget:
            raise RolloutFailed(f"step {step}: response {resp.rid} has ids/logprobs/versions of lengths "
                                f"{len(ids)}/{len(lps)}/{len(vers)} (budget {budget})")
        if resp.finish_reason not in M.FINISH_REASONS:
            raise RolloutFailed(f"step {step}: response {resp.rid} ended for an unknown reason "
                                f"{resp.finish_reason!r} (known: {', '.join(M.FINISH_REASONS)})")
        k = self.s.max_staleness
        lag = self.version - vers
        outside = (lag < 0) | (lag > k)
        if k:  # masked below: never trained
            self.totals.tokens_masked_too_stale += int(np.count_nonzero(outside))
        else:
            self.totals.tokens_trained_off_version += int(np.count_nonzero(outside))
        mask = None if not obs.any() else ~obs
        gen = ~obs
        for j, n in enumerate(np.bincount(lag[gen & ~outside], minlength=1).tolist()):  # k = 0: {"0": all}
            if n:
                staleness[str(j)] = staleness.get(str(j), 0) + n
                self.totals.tokens_by_staleness[str(j)] = self.totals.tokens_by_staleness.get(str(j), 0) + n
        if k and outside.any():  # never trained (the manager refuses them: this is the end-to-end guard)
            mask = gen & ~outside
        if resp.finish_reason != "stop":
            by = self.totals.responses_truncated_by_cause
            by[resp.finish_reason] = by.get(resp.finish_reason, 0) + 1
        last = int(np.flatnonzero(obs)[-1]) + 1 if obs.any() else 0
        text_ids = strip_stop(ids[last:].tolist(), self.stop_ids)
        text = self.tok.decode(text_ids)
        return Sample(prompt_ids=prompt_ids, response_ids=ids.tolist(), behaviour_logprobs=lps.tolist(), advantage=0.0,
                      loss_mask=None if mask is None else mask.tolist(), finish_reason=resp.finish_reason,
                      staleness=np.clip(lag, 0, None).tolist() if k else None), text, text_ids

    def _group_seed(self, step: int, g: int) -> int:
        return (self.s.seed * 7_919 + step * 104_729 + g * 1_299_709) % (2**31)

    def run_step(self, step: int) -> StepRecord:
        """Run one RL step; returns its record (:class:`~rlboost_hpc.trainer.record.StepRecord`). Raises RolloutFailed, or KeyboardInterrupt when a Ctrl-C came
        before the step (:func:`rlboost_hpc.interrupts.check`).

        The step's phases, in order: submit its groups → seed (the reserved engine, ``T_seed`` seconds) → close
        seeding → collect groups and train them in micro-batches as they come → optimizer step → publish version
        v+1 → set the manager's version → observe the step for the controller (``T_seed``, ``N_prem``).

        The record includes the step's timeline: ``phase_s`` (seconds per :class:`Phase`, summing to ``wall_s``),
        ``fixed_overhead_s`` (seconds in which no engine generated and the trainer did not compute) and
        ``instance_s`` / ``instance_activity_s`` (instance-seconds busy, idle, pulling: all instances, and by
        instance) as the manager counted them since the previous step's version change."""
        interrupts.check()  # no step starts after a Ctrl-C, even one Python swallowed in a finalizer
        tl = StepTimeline(self.clock)
        col, n_start, t_seed = self._submit(step, tl)
        col.take_many(col.early)  # groups that came while earlier steps trained
        col.early = []
        # a step generated ahead (bounded staleness) has no seeding window: it trains at once
        t_seed_actual = self._seed(col, tl, t_seed) if not col.complete else 0.0
        tl.enter(Phase.HANDOFF)
        close = self.client.call(M.CloseSeeding(step=step))
        t_wait, n_trained, m_acc = self._collect_and_train(col, tl)
        del self.submitted[step], self._before[step]
        tl.enter(Phase.OPTIMIZER)
        om = self.backend.optimizer_step()
        self.version += 1
        tl.enter(Phase.PUBLISH)
        pub = self.publish(self.version)
        tl.enter(Phase.SET_VERSION)
        tl.split_last(Phase.PUBLISH, Phase.EXPORT, pub.export_s)  # the export came first
        self.client.call(M.SetVersion(version=pub.version.number, checksum=pub.version.checksum))
        tl.enter(Phase.POLICY)
        prev_env_s = self.last_stats.environment_seconds if self.last_stats else 0.0
        t_train, policy = self._observe(tl, t_seed_actual, t_wait, n_start)
        self.totals.responses_trained += n_trained
        self.totals.migrated_responses_trained += col.n_mig
        wall = tl.finish()
        st, s = self.last_stats, self.s
        activity = st.last_step_activity
        generating = [(a, b) for a, b in activity.generating]  # manager's clock: CLOCK_MONOTONIC, same host
        tokens = sum(col.lens) + sum(len(ids) for _, ids in col.by_gid.values()) * s.group_size
        backend = {**om, **pub.record()}
        for k, v in m_acc.items():  # micro-batch means, where the backend gave no whole-step figure
            if k not in om:
                backend[k] = v / max(1, n_trained) if k != "tokens" else v
        self._warn_dropped(step, backend)
        return StepRecord(
            step=step, version=self.version, wall_s=wall, t_seed_s=t_seed_actual, seeding_close=close.what,
            train_s=t_train, reward_mean=sum(col.rewards) / max(1, len(col.rewards)),
            response_len_mean=sum(col.lens) / max(1, len(col.lens)), responses=n_trained,
            responses_migrated=col.n_mig, tokens=tokens, turns_mean=sum(col.turns) / max(1, len(col.turns)),
            environment_s=st.environment_seconds - prev_env_s,  # tool calls' seconds (summed over calls)
            preemptible_instances_served=sum(1 for k in col.served if not is_reserved_key(k)),
            throughput_tokens_per_s=tokens / wall if wall > 0 else 0.0, phase_s=tl.seconds(),
            fixed_overhead_s=fixed_overhead_s(tl.start, tl.end, tl.compute_intervals() + generating),
            fixed_overhead_s_by_phase=tl.overhead_by_phase(generating), instance_s=dict(activity.instance_s),
            instance_activity_s=dict(activity.by_instance_s), rollout_by_kind=rollout_by_kind(activity),
            response_tail_s=activity.response_tail_s,
            **policy, **truncation_shares(col.reasons), staleness_tokens=dict(col.staleness), backend=backend,
            reward_functions={k: sum(v) / len(v) for k, v in col.by_function.items() if v},
            responses_left_out=col.left_out, samples=col.samples)

    def _warn_dropped(self, step: int, backend: dict) -> None:
        """Warn (and count in ``steps_over_dropped_warn``) when the step's importance correction dropped a larger share
        of its units than ``behaviour_dropped_warn`` (MIS: weight 0 past the cap) — long responses under the
        sequence-level ratio lose most of their weight to a small per-token mismatch."""
        drop = backend.get("behaviour_dropped_share")
        if drop is None or drop <= self.s.behaviour_dropped_warn:
            return
        self.totals.steps_over_dropped_warn += 1
        log.warning("step %d: the importance correction dropped %.0f %% of its units (behaviour_dropped_share > "
                    "trainer.behaviour_dropped_warn = %g; effective sample size %.2f of them): with long responses "
                    "use trainer.behaviour_level = \"geometric\" or a larger trainer.behaviour_cap", step, 100 * drop,
                    self.s.behaviour_dropped_warn, backend.get("behaviour_ess", 0.0))

    def _submit(self, step: int, tl: StepTimeline) -> tuple["StepCollector", int, float]:
        """Submit the step's GRPO groups, and under bounded staleness those of the ``max_staleness`` steps after it
        (each trained by the version one higher than the step before it), unless submitted already; returns the
        step's collector, the preemptible instances held at the step's start and the step's seeding window (s)."""
        # the manager's view at the step boundary: the previous step's closing stats (one round trip less)
        n_start = (self.last_stats or self.client.stats()).live_preemptible
        t_seed = self.controller.begin_step(n_start)
        end = step + self.s.max_staleness + 1
        for ahead in range(step, min(end, self.s.steps) if self.s.steps > step else step + 1):
            if ahead not in self.submitted:
                self.submitted[ahead] = self._submit_one(ahead, self.version + ahead - step)
        col = self.submitted[step]
        col.tl = tl
        return col, n_start, t_seed

    def _submit_one(self, step: int, version: int) -> "StepCollector":
        """Take ``step``'s prompts from the data frontier and submit its GRPO groups, to be trained by ``version``;
        returns its collector."""
        s = self.s
        self._before[step] = (self.frontier.state(), len(self.taken), self.totals.responses_expected)
        prompts = self.frontier.take(s.prompts_per_step)
        self.taken.extend(p.pid for p in prompts)
        specs, by_gid = [], {}
        for g, p in enumerate(prompts):
            ids = self._prompt_ids.get(p.pid)
            if ids is None:  # tokenised once per prompt (epochs revisit it)
                ids = self._prompt_ids[p.pid] = self.task.prompt_ids(p, self.tok)
            gid = f"s{step}g{g}"
            by_gid[gid] = (p, ids)
            row, first = self.task.environment_of(p) or ("", "")  # a stateful environment's row and first observation
            specs.append(M.GroupSpec(gid=gid, prompt_ids=ids, n=s.group_size, max_new_tokens=s.max_new_tokens,
                                     temperature=s.temperature, top_p=s.top_p, seed=self._group_seed(step, g),
                                     stop_ids=list(self.stop_ids), max_turns=s.max_turns,
                                     max_trajectory_tokens=s.max_trajectory_tokens,
                                     tool_stop_ids=list(s.tool_stop_ids), env_row=row, env_first=first))
        self.totals.responses_expected += len(specs) * s.group_size
        self.client.call(M.SubmitStep(step=step, version=version, groups=specs))
        return StepCollector(self, step, by_gid, None)

    def _take(self, col: "StepCollector", ev: M.GroupDone | M.StepFailed) -> None:
        """A delivered event for the step ``col`` collects, with every other one that has arrived meanwhile (taken
        together: one reward call, and the next pass trains them all): a group of a step submitted ahead waits for
        its step's turn (unacknowledged: a crash before it is trained leaves it to be delivered again)."""
        now = []
        for e in [ev, *self.client.arrived_events()]:
            if isinstance(e, M.GroupDone) and e.gid not in col.by_gid:
                later = next((c for c in self.submitted.values() if e.gid in c.by_gid), None)
                if later is not None:
                    later.early.append(e)
                    continue
            now.append(e)
        col.take_many(now)

    def _seed(self, col: "StepCollector", tl: StepTimeline, t_seed: float) -> float:
        """The seeding window: the reserved engine generates; completed groups are buffered. It closes at
        ``T_seed`` — or, with ``seed_until_trainable``, once a micro-batch is ready after it (the step's deadline
        bounds the wait). Returns the window's actual length (s)."""
        tl.enter(Phase.SEEDING)
        seed_end = tl.start + t_seed
        until_trainable = self.s.seed_until_trainable
        while not col.complete:
            left = seed_end - self.clock()
            if left <= 0 and (not until_trainable or col.trainable(self.s.micro_batch)):
                break
            # past T_seed with nothing to train: wait for the next group (bounded by the step's own deadline)
            ev = self.client.next_event(left if left > 0 else min(5.0, tl.start + self.s.step_timeout_s - self.clock()))
            if ev is not None:
                self._take(col, ev)
            elif left <= 0 and self.clock() >= tl.start + self.s.step_timeout_s:
                break  # _collect_and_train names what is missing
        return self.clock() - tl.start

    def _collect_and_train(self, col: "StepCollector", tl: StepTimeline) -> tuple[float, int, dict[str, float]]:
        """Train micro-batches as groups complete until every group is trained; returns the trainer's wait for
        groups (s: the controller's ``t_wait_train``, the waits themselves, not the groups' decoding), the responses
        trained and the backend's micro-batch figures summed (weighted by responses, ``tokens`` summed).
        Raises RolloutFailed when the step's groups do not all come within ``step_timeout_s``."""
        s = self.s
        deadline = tl.start + s.step_timeout_s
        t_wait, n_trained, m_acc = 0.0, 0, {}
        tl.enter(Phase.REMOTE)
        while True:
            batch = col.next_batch(s.micro_batch, s.micro_batch_max)
            if batch:
                with tl.phase(Phase.TRAIN):
                    m = self.backend.accumulate(batch, col.n_responses)
                for k, v in m.items():
                    m_acc[k] = m_acc.get(k, 0.0) + v * (len(batch) if k != "tokens" else 1)
                n_trained += len(batch)
                self.totals.tokens_trained += sum(len(b.prompt_ids) + len(b.response_ids) for b in batch)
                continue
            if col.complete:
                return t_wait, n_trained, m_acc
            tl.enter(Phase.TAIL if col.n_groups >= TAIL_FRACTION * len(col.by_gid) else Phase.REMOTE)
            tw = self.clock()
            left = deadline - tw
            ev = self.client.next_event(min(left, 5.0)) if left > 0 else None
            t_wait += self.clock() - tw
            if ev is not None:
                self._take(col, ev)
            elif self.clock() >= deadline:
                st = self.client.stats()
                raise RolloutFailed(f"step {col.step}: only {col.n_groups}/{len(col.by_gid)} groups within "
                                    f"{s.step_timeout_s:.0f}s (queued {st.queued}, running {st.running}, "
                                    f"instances {st.instances_by_state})")

    def _observe(self, tl: StepTimeline, t_seed_s: float, t_wait_s: float, n_start: int) -> tuple[float, dict]:
        """Feed the finished step to the controller and tell the manager its decision (the next step's ``T_seed``
        and ``N_prem``); keeps the manager's closing stats in ``last_stats``. Returns the step's ``t_train`` (s of trainer
        compute: micro-batches + optimizer step, waits excluded) and its policy figures."""
        phase_s = tl.seconds()
        t_train = phase_s.get(Phase.TRAIN, 0.0) + phase_s.get(Phase.OPTIMIZER, 0.0)
        st = self.last_stats = self.client.stats()
        rem = st.last_step_remote
        avail = self.available()
        t_wait_s = max(0.0, t_wait_s - rem.fallback_s)  # the reserved engine generated then: not a wait for data
        self.decision = self.controller.end_step(StepObservation(
            t_seed_s=t_seed_s, t_wait_train_s=t_wait_s, t_wait_remote_s=rem.t_wait_remote_s,
            t_remote_s=rem.t_remote_s, n_remote=rem.n_remote, t_train_s=t_train,
            n_instances_start=n_start, n_instances_end=st.live_preemptible, n_available=avail,
            step_s=self.clock() - tl.start))
        self.client.send(M.PolicyState(t_seed_s=self.decision.t_seed_s, n_prem_cap=self.decision.n_prem_cap))
        return t_train, {"t_seed_next_s": self.decision.t_seed_s, "n_prem_cap": self.decision.n_prem_cap,
                         "n_prem_wanted": self.decision.n_prem_wanted,
                         "t_wait_train_s": t_wait_s, "fallback_s": rem.fallback_s,
                         "t_remote_s": rem.t_remote_s, "t_wait_remote_s": rem.t_wait_remote_s,
                         "n_remote": rem.n_remote, "n_available": avail}
