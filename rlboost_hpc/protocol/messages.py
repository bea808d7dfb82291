"""Typed wire messages between rollout agents, the rollout manager and the trainer (msgpack via msgspec).

The only module (with ``weight_msgs``) that knows bytes. Invariants:
- Every frame is decoded against the tagged union :data:`Message` with a size limit before it touches
  state; anything else raises :class:`ProtocolError` (the caller logs one line and drops the frame).
- Ids are ids: tokens travel as packed little-endian int32 ids and float32 logprobs,
  parallel arrays whose lengths are checked on decode (:meth:`Tokens.validate`).
- Completion and failure are different messages: ``Tokens`` with a finish code vs ``RequestFailed``.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from rlboost_hpc.protocol.adapter import EMULATED_BASE, AdapterSpec  # noqa: F401 (re-exported)
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.stats import HeldOutEvaluation, ManagerStats
from rlboost_hpc.protocol.version import VersionId

MAX_FRAME_BYTES = 64 << 20
MAX_PAYLOAD_TOKENS = 1 << 20

# Finish codes carried per delta in ``Tokens.finish``.
FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
FINISH_CODES = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
#: Why a delivered response (a single-turn response or a whole trajectory) ended, its ``Response.finish_reason``:
#: ``stop`` (a stop token of the model) or a truncation, by cause — ``length``: an assistant turn reached
#: ``rollout.max_new_tokens``; ``turn_cap``: the last turn ``task.turns.max`` allows ended with a tool call that is
#: never answered; ``trajectory_budget``: ``task.turns.max_tokens`` left no room (a turn cut short, a tool call
#: or an observation that did not fit); ``environment_error``: the environment could not answer a tool call at all
#: (not even with an error observation).
TRUNCATION_CAUSES = ("length", "turn_cap", "trajectory_budget", "environment_error")
FINISH_REASONS = ("stop",) + TRUNCATION_CAUSES


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------- agent → manager
class Register(_Msg, tag="register"):
    """A rollout instance announces itself. (job_id, attempt) is its identity: a new attempt
    of a requeued job is a new instance and never merges with the old one."""

    job_id: str
    attempt: int
    kind: Literal["reserved", "preemptible"]
    max_batch: int
    host: str = ""
    pid: int = 0
    node: str = ""
    engine: Annotated[str, msgspec.Meta(max_length=32)] = "torch"  # "torch" | "sglang": per-engine statistics
    relay_endpoint: Annotated[str, msgspec.Meta(max_length=512)] = ""  # where it serves the versions it holds


class Heartbeat(_Msg, tag="hb"):
    """Liveness + progress: ``tokens_generated`` counts every token the engine produced (sent or not). An emulated
    engine's timing, since it was built: ``modelled_s`` (wall seconds its profile asked for) and ``late_s`` (wall
    seconds it ran behind that while busy); 0 for real engines."""

    version: int
    active: int
    tokens_generated: int
    modelled_s: float = 0.0
    late_s: float = 0.0


class WeightsLoaded(_Msg, tag="wloaded"):
    """The instance loaded a complete, checksum-verified version (phases in seconds). ``checksum``: the
    whole-version checksum of the bytes it loaded; ``wire_bytes``: bytes it received for this version (less
    than ``nbytes`` for a delta pull; 0 when nothing moved, e.g. a re-registration)."""

    version: int
    checksum: int
    nbytes: int
    pull_s: float
    load_s: float
    wire_bytes: int = 0

    @property
    def identity(self) -> VersionId:
        """The version's identity (number and checksum)."""
        return VersionId(self.version, self.checksum)
    # a LoRA instance's first version: where its base came from ("path", "cache", "pull", "trainer"), the bytes it
    # received over the network for it (0 unless pulled; not in wire_bytes) and its seconds (in pull_s)
    base_source: Annotated[str, msgspec.Meta(max_length=16)] = ""
    base_wire_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0


class WeightsFailed(_Msg, tag="wfailed"):
    """A pull or load failed; the instance stays fenced. ``error`` carries the cause."""

    version: int
    error: str


class Tokens(_Msg, tag="tok"):
    """A batch of token deltas, columnar. Delta i covers ``counts[i]`` tokens of request ``rids[i]`` starting
    at response position ``offsets[i]``, produced by weight version ``versions[i]``; ``finish[i]`` is a
    FINISH_* code. ``ids`` (int32) and ``logprobs`` (float32) are the concatenated payloads (little-endian).
    ``resent``: the instance's answer to ``Welcome.resend`` — every response it holds, whole (possibly none) — with
    ``generated``, the tokens it generated in its life (all of them sent by now)."""

    rids: list[str]
    offsets: list[Annotated[int, msgspec.Meta(ge=0)]]
    counts: list[Annotated[int, msgspec.Meta(ge=0)]]
    versions: list[int]
    finish: list[Literal[0, 1, 2]]
    ids: bytes
    logprobs: bytes
    resent: bool = False
    generated: Annotated[int, msgspec.Meta(ge=0)] = 0

    def validate(self) -> None:
        """Raise ProtocolError unless the columns are parallel and the payload sizes match (value ranges are
        checked by the schema during decoding)."""
        n = len(self.rids)
        if not (len(self.offsets) == len(self.counts) == len(self.versions) == len(self.finish) == n):
            raise ProtocolError("tok: column lengths differ")
        total = sum(self.counts)
        if total > MAX_PAYLOAD_TOKENS:
            raise ProtocolError(f"tok: {total} tokens in one frame exceeds {MAX_PAYLOAD_TOKENS}")
        if len(self.ids) != 4 * total or len(self.logprobs) != 4 * total:
            raise ProtocolError(f"tok: payload sizes {len(self.ids)}/{len(self.logprobs)} != 4×{total} tokens")


class RequestFailed(_Msg, tag="rfail"):
    """The engine failed on ``rid`` (its tokens so far were sent); the manager re-dispatches it."""

    rid: str
    error: str


class Draining(_Msg, tag="draining"):
    """The instance stopped taking work (preemption warning, cap, shutdown)."""

    reason: str


class Released(_Msg, tag="released"):
    """Every token of ``rids`` was sent before this frame; the manager may resume them elsewhere."""

    rids: list[str]
    tokens_generated: int


#: Why an instance leaves (``Deregister.cause``), one word per kind of end that is counted separately:
#: ``preempted`` (Slurm preempted its job, or the local cluster's trace removed it, with a warning),
#: ``time_limit`` (its job reached its own ``--time``: the warning came at the job's end time),
#: ``drained`` (the scavenger or the cap retired a surplus instance), ``stopped`` (the run ended / told to stop).
LeaveCause = Literal["preempted", "time_limit", "drained", "stopped"]


class Deregister(_Msg, tag="dereg"):
    """The instance leaves for good (after Released). ``tokens_generated`` as in Heartbeat; ``cause`` is the
    counted kind of end (:data:`LeaveCause`), ``reason`` the human-readable detail."""

    reason: str
    tokens_generated: int
    cause: LeaveCause = "stopped"


# ---------------------------------------------------------------- manager → agent
class Welcome(_Msg, tag="welcome"):
    """Registration accepted: where to pull weights, which version is latest, the model's HF config
    (``config.json`` as the trainer read it) and its architecture as the trainer's config reader parsed it
    (``ModelArch.to_json()``; instances never re-derive it)."""

    instance: str
    latest_version: int
    weights_endpoint: str
    model_config: dict
    heartbeat_s: float
    stream_every_tokens: int
    stream_every_s: float
    epoch: int = 0  # the manager's incarnation (journal): weight versions are (epoch, version)
    model_arch: dict = {}
    peers: list[str] = []  # relay: holders to fetch the latest version's chunks from (then the trainer)
    wait: bool = False  # relay: no holder free yet — wait for PullFrom (at most the agent's relay deadline)
    weights_shards: str = ""  # sharded versions: the assembly manifest (JSON, weights/sharded.py); "" = one server
    # the latest version's whole-version checksum (0: unknown): an instance that re-registers with a restarted manager
    # keeps its weights when it holds this version with this checksum
    latest_checksum: int = 0
    # a manager restarted from its work log knew this instance: send every response's tokens again, whole
    resend: bool = False
    # bounded staleness (rollout.on_new_version): "continue" = load a newer version between decode iterations while
    # responses run (their tokens then span versions); "finish" = load it once the engine is idle
    on_new_version: str = "finish"
    # a LoRA run (trainer.lora): versions are adapters on this base (protocol/adapter.py); None = full versions
    adapter: AdapterSpec | None = None

    @property
    def latest(self) -> VersionId:
        """The manager's latest version's identity (number and checksum)."""
        return VersionId(self.latest_version, self.latest_checksum)


class Alive(_Msg, tag="alive"):
    """Sent by the manager to every registered instance about once a second, so an idle instance can tell a
    quiet manager from a dead one (and reconnect to a restarted run, rollout/worker.py)."""

    epoch: int = 0


class Farewell(_Msg, tag="farewell"):
    """The answer to a ``Deregister``, sent once the manager's work log holds it: every frame the instance sent
    before it was applied (its unfinished responses resume elsewhere from every token that arrived), so the instance
    may exit. An instance that drains while the manager restarts waits for this (``RolloutAgent._await_farewell``)."""


class Reject(_Msg, tag="reject"):
    """Registration refused (e.g. the identity is already registered); the agent exits with this reason."""

    reason: str


class Work(msgspec.Struct, forbid_unknown_fields=True):
    """One response (or a trajectory's current turn) to (continue to) generate after ``prefix_ids``.
    ``tokens_left``: the budget that remains — the original ``max_new_tokens`` of its group minus what was
    generated (and, for a trajectory, bounded by what the trajectory has left); the engine generates at most that
    many more tokens."""

    rid: str
    prompt_ids: list[int]
    prefix_ids: list[int]
    tokens_left: int
    temperature: float
    top_p: float
    seed: int
    stop_ids: list[int]
    version: int


class Assign(_Msg, tag="assign"):
    works: list[Work]


class Release(_Msg, tag="release"):
    """The manager takes these requests back (balancing, end of seeding); answer with ``Released``."""

    rids: list[str]


class NewVersion(_Msg, tag="newver"):
    """The manager's latest weight version changed; pull it when idle — chunks from ``peers`` (relay holders, in
    order), then from the trainer; with ``wait``, only after a ``PullFrom`` (or the agent's relay deadline).
    ``checksum``: its whole-version checksum (0: not known) — with ``version``, the version's identity: a trainer
    resumed from an older checkpoint announces a version whose number may be lower than (or equal to) the one an
    instance holds, and the instance takes it all the same. ``weights_endpoint`` / ``weights_shards``: where the
    trainer serves it (as in ``Welcome``; "" endpoint: where ``Welcome`` said) — a resumed trainer serves its versions
    elsewhere than the one an instance registered under."""

    version: int
    peers: list[str] = []
    wait: bool = False
    checksum: int = 0
    weights_endpoint: str = ""
    weights_shards: str = ""

    @property
    def identity(self) -> VersionId:
        """The version's identity (number and checksum)."""
        return VersionId(self.version, self.checksum)


class PullFrom(_Msg, tag="pullfrom"):
    """Relay capacity for a waiting puller: fetch ``version`` (whole-version ``checksum``; 0: not known) from
    ``peers`` (then the trainer) now."""

    version: int
    peers: list[str] = []
    checksum: int = 0

    @property
    def identity(self) -> VersionId:
        """The version's identity (number and checksum)."""
        return VersionId(self.version, self.checksum)


class Drain(_Msg, tag="drain"):
    """Stop: release everything, deregister, exit."""

    reason: str


# ---------------------------------------------------------------- trainer ↔ manager
class GroupSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One GRPO group: ``n`` responses to ``prompt_ids``; sample i is seeded with ``seed + i``.

    Multi-turn (``max_turns`` > 1): each response is a trajectory of assistant turns, each of at most
    ``max_new_tokens`` tokens, and observations; a turn that ends with one of ``tool_stop_ids`` is a tool call
    (the environment answers with an observation and the next turn starts), any other end finishes the trajectory.
    ``max_trajectory_tokens`` bounds everything after the prompt (turns and observations; 0 = ``max_new_tokens``).

    A stateful environment's group (``env_row`` set: the prompt's row as JSON; ``env_first``: the observation its
    ``reset(row)`` gave, which the prompt holds) sends *every* finished assistant turn to the environment, whose
    ``done`` ends the trajectory; ``tool_stop_ids`` is then empty."""

    gid: str
    prompt_ids: list[int]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_ids: list[int]
    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_trajectory_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    tool_stop_ids: list[int] = []
    env_row: str = ""
    env_first: str = ""


# Trainer calls carry a call id ``cid`` that the reply (Ok / Error / Stats) echoes, so a client that resends a
# call after a lost reply (a TCP reset) never takes a late reply for the answer to a later call; the manager
# answers a resent call idempotently.


class TrainerHello(_Msg, tag="thello"):
    """The trainer's first message: the weight server, the model's ``config.json`` and its parsed architecture;
    ``weights_shards``: when every model-parallel trainer rank serves its own pieces, their assembly manifest
    (JSON, :mod:`rlboost_hpc.weights.sharded`) — instances pull from those holders, and peer relay is off."""

    weights_endpoint: str
    model_config: dict
    model_arch: dict = {}
    cid: int = 0
    weights_shards: str = ""
    adapter: AdapterSpec | None = None  # a LoRA run: versions are adapters on this base (protocol/adapter.py)


class SetVersion(_Msg, tag="setver"):
    """The weight server holds ``version`` (whole-version ``checksum`` of its manifest; 0: not given); from now
    on only its holders are routable, and an instance reporting another checksum for it is not."""

    version: int
    cid: int = 0
    checksum: int = 0

    @property
    def identity(self) -> VersionId:
        """The version's identity (number and checksum)."""
        return VersionId(self.version, self.checksum)


class SubmitStep(_Msg, tag="submit"):
    step: int
    version: int
    groups: list[GroupSpec]
    cid: int = 0


class CloseSeeding(_Msg, tag="closeseed"):
    """End of the seeding window T_seed of ``step``: reserved instances hand their work back."""

    step: int
    cid: int = 0


class PolicyState(_Msg, tag="policy"):
    """The trainer's scheduling decisions in force (for metrics): T_seed and the N_prem cap (None: no cap)."""

    t_seed_s: float
    n_prem_cap: int | None = None


class StepTimes(_Msg, tag="steptimes"):
    """Where a finished step's wall time went (for metrics): seconds per phase (they sum to ``wall_s``) and the
    fixed overhead (seconds in which no engine generated and the trainer did not compute)."""

    step: int
    wall_s: float
    phases: Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], float], msgspec.Meta(max_length=64)]
    fixed_overhead_s: float
    #: the step's engine–trainer mismatch (``logprob_diff``, ``logprob_diff_max``, ``mismatch_kl``,
    #: ``mismatch_outside_clip_share``, ``mismatch_capped_share``, ``behaviour_ess``, ``behaviour_dropped_share``;
    #: :func:`~rlboost_hpc.trainer.algorithms.grpo.finish_stats`), for the manager's gauges
    mismatch: Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], float], msgspec.Meta(max_length=16)] = {}
    #: a user's task: each reward function's mean value over the step's responses (name → value), for the gauges
    rewards: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], float], msgspec.Meta(max_length=32)] = {}


class Evaluation(_Msg, tag="evaluation"):
    """A held-out evaluation of the run (for the manager's gauges, kept across its restarts): ``when`` ``"before"``
    (the starting policy, evaluated before the first step or restored by a resume) or ``"after"`` (the trained
    one)."""

    when: Literal["before", "after"]
    result: HeldOutEvaluation


class AckGroup(_Msg, tag="ack"):
    gid: str


class GetStats(_Msg, tag="getstats"):
    cid: int = 0


class Redeliver(_Msg, tag="redeliver"):
    """The trainer has waited without news: send again every finished group it has not acknowledged (a
    ``GroupDone`` lost with a connection; the trainer skips groups it already took)."""


class Shutdown(_Msg, tag="shutdown"):
    reason: str
    cid: int = 0


class Response(msgspec.Struct, forbid_unknown_fields=True):
    """A finished response. ``ids`` int32 and ``logprobs`` float32: parallel packed arrays (one entry per token).
    ``version_runs``: the producing weight version of every token, run-length encoded as packed int32
    ``(version, count)`` pairs in token order (:func:`expand_version_runs`); one pair when, as the manager
    guarantees, every token has the step's version — 8 bytes instead of 4 per token on the wire.

    A trajectory (multi-turn) also carries ``observation_runs``: packed int32 ``(start, count)`` pairs, the
    token ranges that are environment observations (their logprobs are 0 and never trained; every other token
    was generated by the policy); ``turns``: its assistant turns. Empty / 1 for a single-turn response.
    A stateful environment's trajectory carries ``env_return``, the sum of the rewards its steps gave, and
    ``env_error`` (``"<status>: <why>"``, status ``error`` or ``timeout``) when a step failed (it then ended as
    ``environment_error``)."""

    rid: str
    sample: int
    ids: bytes
    logprobs: bytes
    version_runs: bytes
    finish_reason: str  # one of FINISH_REASONS
    migrations: int
    instances: list[str]
    observation_runs: bytes = b""
    turns: int = 1
    env_return: float = 0.0
    env_error: str = ""


class GroupDone(_Msg, tag="gdone"):
    step: int
    gid: str
    responses: list[Response]


class StepFailed(_Msg, tag="stepfail"):
    step: int
    error: str


class Ok(_Msg, tag="ok"):
    what: str
    cid: int = 0


class Error(_Msg, tag="err"):
    what: str
    error: str
    cid: int = 0


class Stats(_Msg, tag="stats"):
    stats: ManagerStats
    cid: int = 0


# ---------------------------------------------------------------- manager ↔ environment (in the manager's process)
class EnvCall(msgspec.Struct, forbid_unknown_fields=True):
    """An assistant turn of trajectory ``rid`` ended with a tool call: ``turn_ids`` (packed int32) are that turn's
    tokens; the environment answers with :class:`EnvResult` for the same ``(rid, turn)``.

    A stateful environment's turn (``row`` set: ``GroupSpec.env_row``; ``first``: ``GroupSpec.env_first``) also
    carries what rebuilds the environment by replay where it is not live: ``history``, the earlier turns as
    ``(turn ids, observation ids, reward)`` (packed int32 ids), and ``last``: the trajectory ends after this step
    whatever ``done`` says (its last turn, or no room left)."""

    rid: str
    turn: int
    turn_ids: bytes
    row: str = ""
    first: str = ""
    history: list[tuple[bytes, bytes, float]] = []
    last: bool = False


class EnvResult(msgspec.Struct, forbid_unknown_fields=True):
    """The observation of turn ``turn`` of ``rid``: ``obs_ids`` (packed int32, ≥ 1 token); ``status``: ``ok``,
    ``error`` (a malformed call or a failing tool: the ids render the error) or ``timeout`` (the call ran past its
    deadline: the ids render that); ``tool_s``: seconds the call took.

    A stateful environment's step also gives ``reward`` and ``done`` (``obs_ids`` empty when the trajectory ends),
    ``error`` (why it failed: status ``error`` / ``timeout``, or ``diverged`` — rebuilt by replay, the environment
    answered otherwise than the trajectory holds) and ``replayed``: earlier steps it ran to rebuild the environment
    (reset included; 0 when it was live)."""

    rid: str
    turn: int
    obs_ids: bytes
    status: Literal["ok", "error", "timeout", "diverged"] = "ok"
    tool_s: float = 0.0
    reward: float = 0.0
    done: bool = False
    error: str = ""
    replayed: int = 0


class EnvRelease(msgspec.Struct, forbid_unknown_fields=True):
    """Trajectories ``rids`` of a stateful environment ended or were dropped: the instances their environment still
    holds are closed (one that ended by ``done``, its last turn or a failed step is closed already)."""

    rids: list[str]


Message = (
    Register | Heartbeat | WeightsLoaded | WeightsFailed | Tokens | RequestFailed | Draining | Released
    | Deregister | Welcome | Alive | Farewell | Reject | Assign | Release | NewVersion | PullFrom | Drain | TrainerHello | SetVersion
    | SubmitStep | CloseSeeding | PolicyState | StepTimes | Evaluation | AckGroup | GetStats | Redeliver | Shutdown
    | GroupDone | StepFailed | Ok | Error | Stats
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    """Serialize one message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> _Msg:
    """Decode and validate one frame.

    Raises:
        ProtocolError: oversized frame, undecodable bytes, unknown tag, schema violation, or (for
            ``Tokens``) non-parallel columns.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"undecodable frame: {e}") from None
    if isinstance(msg, Tokens):
        msg.validate()
    return msg


def pack_i32(values) -> bytes:
    """Pack ints as little-endian int32 bytes."""
    return np.asarray(values, dtype="<i4").tobytes()


def pack_f32(values) -> bytes:
    """Pack floats as little-endian float32 bytes."""
    return np.asarray(values, dtype="<f4").tobytes()


def version_runs(versions) -> bytes:
    """Run-length encode per-token versions (any int sequence) as packed int32 (version, count) pairs."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        return b""
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    counts = np.diff(np.r_[starts, v.size])
    return np.stack([v[starts], counts], axis=1).astype("<i4").tobytes()


def observation_mask(runs: bytes, n: int) -> np.ndarray:
    """Per-token bool array of length ``n``: True where a token is an environment observation (from a
    ``Response.observation_runs``), False where the policy generated it.

    Raises:
        ProtocolError: the buffer is not whole (start, count) pairs, or a range falls outside ``[0, n)``.
    """
    pairs = unpack_i32(runs)
    if pairs.size % 2:
        raise ProtocolError(f"observation runs: {len(runs)} bytes is not a whole number of (start, count) pairs")
    mask = np.zeros(n, dtype=bool)
    for start, count in pairs.reshape(-1, 2).tolist():
        if start < 0 or count < 1 or start + count > n:
            raise ProtocolError(f"observation runs: range ({start}, {count}) outside a response of {n} tokens")
        mask[start:start + count] = True
    return mask


def expand_version_runs(buf: bytes) -> np.ndarray:
    """Per-token versions (int32 array) from :func:`version_runs` bytes.

    Raises:
        ProtocolError: the buffer is not whole (version, count) pairs or a count is negative.
    """
    pairs = unpack_i32(buf)
    if pairs.size % 2:
        raise ProtocolError(f"version runs: {len(buf)} bytes is not a whole number of (version, count) pairs")
    pairs = pairs.reshape(-1, 2)
    if (pairs[:, 1] < 0).any():
        raise ProtocolError("version runs: negative count")
    return np.repeat(pairs[:, 0], pairs[:, 1])


def unpack_i32(buf: bytes) -> np.ndarray:
    """View packed int32 bytes as an array (shape [n], dtype int32)."""
    return np.frombuffer(buf, dtype="<i4")


def unpack_f32(buf: bytes) -> np.ndarray:
    """View packed float32 bytes as an array (shape [n], dtype float32)."""
    return np.frombuffer(buf, dtype="<f4")
