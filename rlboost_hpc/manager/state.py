"""The rollout manager's records: instances and their life (:class:`InstanceState` and the transitions it allows),
responses at token level (:class:`Request`, :class:`RequestState`), GRPO groups and a step's per-instance work.

Plain data: :class:`~rlboost_hpc.manager.core.ManagerCore` is the only writer, and changes an instance's state only
through its one transition function (checked against :data:`ALLOWED_TRANSITIONS`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.version import VersionId
from rlboost_hpc.tasks.tools import turn_seed

__all__ = ["ALLOWED_TRANSITIONS", "REQUEST_TRANSITIONS", "ENV_PEER", "Group", "Instance", "InstanceState", "Request", "RequestState",
           "StepWork", "VersionLineage", "step_requests"]

#: The peer id of the environment (tool calls of multi-turn trajectories): a pool in the manager's own process.
#: ZeroMQ never gives a network peer this id (peer-chosen ids cannot start with a zero byte, generated ones are 5
#: bytes long), so only the manager's service can speak as the environment.
ENV_PEER = b"\x00environment"


class InstanceState(StrEnum):
    """Life of a registered rollout instance (invariant 7); changed only by :meth:`Fleet.set_state`
    (manager/fleet.py)."""

    PULLING = "pulling"  # registered, loading the latest version
    READY = "ready"  # holds a verified version (routable when it is the latest)
    FENCED = "fenced"  # a failed or wrong load: never routed until it loads the latest version
    DRAINING = "draining"  # warned (preempted / drained): finishing its hand-off
    SUSPECT = "suspect"  # silent past the heartbeat deadline: out of routing, its work migrated; may return
    GONE = "gone"  # deregistered, or silent past the expiry: never routed again


S = InstanceState  # short names for the transition table


class RequestState(StrEnum):
    """Life of one response at the manager: queued → running (on one instance) → done; running → queued when its
    instance leaves, is fenced or releases it (the tokens so far stay: it resumes from them). A trajectory
    (multi-turn) whose assistant turn ended with a tool call goes running → environment → queued (its next turn)
    once the environment's observation is appended."""

    QUEUED = "queued"
    RUNNING = "running"
    ENVIRONMENT = "environment"
    DONE = "done"


REQUEST_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.RUNNING}),
    RequestState.RUNNING: frozenset({RequestState.QUEUED, RequestState.ENVIRONMENT, RequestState.DONE}),
    RequestState.ENVIRONMENT: frozenset({RequestState.QUEUED, RequestState.DONE}),
    RequestState.DONE: frozenset(),
}


ALLOWED_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    S.PULLING: frozenset({S.READY, S.FENCED, S.DRAINING, S.SUSPECT, S.GONE}),
    S.READY: frozenset({S.FENCED, S.DRAINING, S.SUSPECT, S.GONE}),
    S.FENCED: frozenset({S.READY, S.DRAINING, S.SUSPECT, S.GONE}),
    S.DRAINING: frozenset({S.SUSPECT, S.GONE}),
    S.SUSPECT: frozenset({S.PULLING, S.READY, S.FENCED, S.DRAINING, S.GONE}),
    S.GONE: frozenset(),
}


class VersionLineage:
    """The weight versions of the current trainer lineage: version → whole-version checksum of the last ``window`` + 1
    versions the trainer made current (``SetVersion``), the newest last. A version's identity is (number,
    checksum), never the number alone: a trainer resumed from an older checkpoint makes a version current again
    whose number may be lower than (or equal to) ones live instances still hold, and those — made by weights the
    resumed trainer never had — are of no lineage the manager routes to. A checksum of 0 (the trainer gave none)
    leaves the number alone to name its version.

    ``window``: the versions before the newest a request may still admit (bounded staleness k; 0: only the newest).
    ``latest``: the newest version's identity (number −1: none yet).
    """

    def __init__(self, window: int = 0) -> None:
        self.window = window
        self._checksums: dict[int, int] = {}
        self.latest = VersionId(-1, 0)

    def make_current(self, version: VersionId) -> None:
        """``version`` is the newest of the lineage: every version at or above its number leaves it (versions of an
        abandoned lineage, after a resume), and so do those older than the window."""
        n = version.number
        self._checksums = {v: c for v, c in self._checksums.items() if n - self.window <= v < n}
        self._checksums[n] = version.checksum
        self.latest = version

    def holds(self, version: VersionId) -> bool:
        """Whether ``version`` (as an instance reports it) is a version of the lineage (within the window): its
        number is, with its checksum — or the trainer gave none for that number."""
        known = self._checksums.get(version.number)
        return known is not None and (known == 0 or known == version.checksum)

    def is_latest(self, version: VersionId) -> bool:
        """``version`` is the newest of the lineage (its number, with its checksum)."""
        return version.number == self.latest.number and self.holds(version)


@dataclass
class Instance:
    """One registered rollout instance; ``key`` = ``job_id#attempt``."""

    key: str
    peer: bytes
    kind: str
    max_batch: int
    registered_at: float
    last_seen: float
    engine: str = "torch"
    relay_endpoint: str = ""  # where it serves the versions it holds (relay); "" = it does not serve
    state: InstanceState = InstanceState.PULLING
    version: int = -1
    checksum: int = 0  # whole-version checksum of the version it loaded (with ``version``: the version's identity)
    inflight: set[str] = field(default_factory=set)
    releasing: set[str] = field(default_factory=set)
    tokens_received: int = 0
    tokens_generated: int = 0
    emulated_s: tuple[float, float] = (0.0, 0.0)  # an emulated engine's (modelled, late) wall seconds, as last heard
    ready_at: float | None = None
    gone_reason: str = ""
    suspect_since: float = 0.0
    suspect_from: InstanceState | None = None  # the state it was in when it went silent
    taken_back: set[str] = field(default_factory=set)  # responses migrated off it while it was suspect
    restored: bool = False  # rebuilt from the work log and expected to resend what it holds (manager/restore.py)
    spoke: bool = True  # it has spoken to this manager (False: rebuilt from the work log, not heard from since)

    @property
    def identity(self) -> VersionId:
        """The version it loaded (number and checksum)."""
        return VersionId(self.version, self.checksum)


@dataclass
class Request:
    """Token-level state of one response: ``ids`` (int32) and ``logprobs`` (float32) are packed parallel
    arrays of ``n`` tokens, all produced by weight ``version`` (deltas of any other version are rejected; under
    bounded staleness ``version`` is the oldest version admitted, and deltas up to the latest are accepted);
    ``runs`` records, run-length encoded, the version each accepted delta was stamped with by its engine — what
    the trainer checks independently (it is never re-derived from ``version``).

    A trajectory (``max_turns`` > 1) keeps its assistant turns and observations in the same arrays: the current
    turn starts at ``turn_start``; ``observations`` lists the ``(start, count)`` ranges the environment appended
    (logprob 0, stamped with the request's version). ``max_new_tokens`` is the original budget of one turn,
    ``max_trajectory_tokens`` of everything after the prompt; an instance only ever sees the current turn
    (:meth:`work`).

    A stateful environment's trajectory (``env_row`` set) sends every finished turn to the environment
    (:meth:`env_call`) and keeps each step's reward (``env_rewards``, one per step answered) and, when a step failed,
    why (``env_error``)."""

    rid: str
    step: int
    gid: str
    sample: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_ids: list[int]
    version: int
    ids: bytearray = field(default_factory=bytearray)
    logprobs: bytearray = field(default_factory=bytearray)
    runs: list[int] = field(default_factory=list)  # (version, count) pairs as the engines stamped the tokens
    n: int = 0
    state: RequestState = RequestState.QUEUED
    instance: str | None = None
    attempts: int = 0
    assigned_at: float = 0.0  # when it was last dispatched (manager clock, seconds)
    prefer: str | None = None  # the instance the balancer moved it toward: its next dispatch goes there if it can
    migrations: int = 0
    instances: list[str] = field(default_factory=list)
    finish_reason: str = ""
    max_turns: int = 1
    max_trajectory_tokens: int = 0  # 0: max_new_tokens (one turn)
    tool_stop_ids: frozenset[int] = frozenset()
    turn: int = 0
    turn_start: int = 0
    observations: list[int] = field(default_factory=list)  # (start, count) pairs
    env_row: str = ""  # a stateful environment's trajectory: its row (JSON) and reset's observation
    env_first: str = ""
    env_rewards: list[float] = field(default_factory=list)  # the reward of each step answered, in turn order
    env_error: str = ""  # "<status>: <why>" of the step that failed

    def __post_init__(self) -> None:
        if not self.max_trajectory_tokens:
            self.max_trajectory_tokens = self.max_new_tokens

    def move(self, new: RequestState, instance: str | None = None, finish_reason: str = "") -> None:
        """The one place a response's state changes (transitions in ``REQUEST_TRANSITIONS``). ``instance``: the
        instance that runs it (``RUNNING`` only; every other state is owned by no instance); ``finish_reason``:
        why it is ``DONE``.

        Raises:
            ValueError: a transition the table does not allow (a bug in the caller, never input).
        """
        if new not in REQUEST_TRANSITIONS[self.state]:
            raise ValueError(f"response {self.rid}: {self.state} → {new} is not a transition")
        if (new == RequestState.RUNNING) != (instance is not None):
            raise ValueError(f"response {self.rid}: an instance runs it exactly when it is running")
        self.state, self.instance = new, instance
        if new == RequestState.DONE:
            self.finish_reason = finish_reason

    def append(self, ids: bytes | memoryview, logprobs: bytes | memoryview, count: int, version: int) -> None:
        """Append ``count`` tokens (packed int32 ``ids``, float32 ``logprobs``) produced by weight ``version``."""
        self.ids += ids
        self.logprobs += logprobs
        self.n += count
        runs = self.runs
        if runs and runs[-2] == version:
            runs[-1] += count
        else:
            runs += (version, count)

    def turn_budget(self) -> int:
        """Tokens the current turn may have in all (its original budget, bounded by the trajectory's)."""
        return min(self.max_new_tokens, self.max_trajectory_tokens - self.turn_start)

    def end_reason(self, fin: int) -> str:
        """Why the response ends with the turn that just finished with finish code ``fin`` (``M.FINISH_STOP`` /
        ``M.FINISH_LENGTH``) and is not a tool call the environment will answer: one of ``M.FINISH_REASONS``. A turn
        cut by its budget is ``length`` when the turn's own ``max_new_tokens`` bound it, ``trajectory_budget`` when
        the trajectory's did; a turn ending with a tool call is cut by the turn cap (it was the last turn allowed)
        or by the trajectory budget (no room left)."""
        if fin == M.FINISH_LENGTH:
            return "length" if self.n - self.turn_start >= self.max_new_tokens else "trajectory_budget"
        if self.n > self.turn_start and int.from_bytes(self.ids[-4:], "little", signed=True) in self.tool_stop_ids:
            return "turn_cap" if self.turn + 1 >= self.max_turns else "trajectory_budget"
        return "stop"

    def turn_ids(self) -> bytes:
        """Packed int32 ids of the current turn."""
        return bytes(self.ids[4 * self.turn_start:])

    def calls_tool(self) -> bool:
        """The finished current turn ended with a tool call that the trajectory has turns and room left for."""
        return (self.turn + 1 < self.max_turns and self.n < self.max_trajectory_tokens and self.n > self.turn_start
                and int.from_bytes(self.ids[-4:], "little", signed=True) in self.tool_stop_ids)

    def env_step_done(self, turn: int, reward: float, error: str = "") -> None:
        """A stateful environment answered turn ``turn``'s step with ``reward`` (or failed: ``error``); answering a
        turn again (a step asked twice around a restart) replaces its reward."""
        self.env_error = error
        if not error:
            self.env_rewards[turn:] = [reward]

    def env_call(self) -> M.EnvCall:
        """The environment call of the finished current turn: a tool call's, or a stateful environment's with what
        rebuilds it by replay (the earlier turns, their observations and rewards; ``last``: no turn or no room
        follows)."""
        if not self.env_row:
            return M.EnvCall(rid=self.rid, turn=self.turn, turn_ids=self.turn_ids())
        history, start, obs = [], 0, self.observations
        for k in range(len(obs) // 2):
            s, c = obs[2 * k], obs[2 * k + 1]
            history.append((bytes(self.ids[4 * start: 4 * s]), bytes(self.ids[4 * s: 4 * (s + c)]),
                            self.env_rewards[k]))
            start = s + c
        last = self.turn + 1 >= self.max_turns or self.n >= self.max_trajectory_tokens
        return M.EnvCall(rid=self.rid, turn=self.turn, turn_ids=self.turn_ids(), row=self.env_row,
                         first=self.env_first, history=history, last=last)

    def append_observation(self, obs: bytes) -> None:
        """Append an observation (packed int32 ids) and open the next turn."""
        k = len(obs) // 4
        self.observations += (self.n, k)
        self.append(obs, bytes(4 * k), k, self.version)
        self.turn += 1
        self.turn_start = self.n

    def observation_tokens(self) -> int:
        return sum(self.observations[1::2])

    def work(self, version: int | None = None) -> M.Work:
        """The current turn for an instance holding weight ``version`` (None: the request's own): the prompt is the
        original prompt + every earlier turn and observation, the prefix the current turn's tokens so far, the
        budget what the turn has left. Turn t samples with :func:`~rlboost_hpc.tasks.tools.turn_seed` of the
        response's seed."""
        ids = np.frombuffer(bytes(self.ids), dtype="<i4")
        return M.Work(
            rid=self.rid, prompt_ids=self.prompt_ids + ids[: self.turn_start].tolist(),
            prefix_ids=ids[self.turn_start:].tolist(),
            tokens_left=self.turn_budget() - (self.n - self.turn_start), temperature=self.temperature,
            top_p=self.top_p, seed=turn_seed(self.seed, self.turn),
            stop_ids=self.stop_ids, version=self.version if version is None else version,
        )


def step_requests(step: int, version: int, g: M.GroupSpec) -> list[Request]:
    """The ``g.n`` responses of GRPO group ``g`` of ``step`` (ids ``<gid>/<i>``, sampling seed ``g.seed + i``), all of
    weight ``version``: what a submitted step, and a step rebuilt from the work log, holds."""
    return [Request(rid=f"{g.gid}/{i}", step=step, gid=g.gid, sample=i, prompt_ids=list(g.prompt_ids),
                    max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, seed=g.seed + i,
                    stop_ids=sorted(set(g.stop_ids) | set(g.tool_stop_ids)), version=version, max_turns=g.max_turns,
                    max_trajectory_tokens=g.max_trajectory_tokens, tool_stop_ids=frozenset(g.tool_stop_ids),
                    env_row=g.env_row, env_first=g.env_first)
            for i in range(g.n)]


@dataclass
class StepWork:
    """A preemptible instance's part in the current step: first dispatch and last accepted token (manager clock,
    seconds), tokens accepted, and its last learned peak decode rate (tokens/s) — the observation law's record."""

    first_s: float
    last_s: float
    tokens: int = 0
    peak: float | None = None


@dataclass
class Group:
    step: int
    gid: str
    rids: list[str]
    done: int = 0
    delivered: bool = False
