"""The rollout manager's work log: the step in flight, journaled so that a restarted manager continues it.

``RUN_DIR/manager-work.log`` holds what a manager needs to pick up where a killed one stopped: the trainer it serves
(its routing id, weight server, model), the current weight version and its checksum, the step's GRPO groups, every
token accepted (ids, logprobs, the version that produced them), the turn structure of trajectories (observations and
a stateful environment's step rewards, tool calls waiting for the environment), migrations, finished responses and
acknowledged groups, the manager's running totals, and the instances registered (their routing ids, so that frames
they queued while the manager was away are recognised when they reconnect).

Format: a sequence of frames, each ``u32 length · u32 crc32 · msgpack record`` (little-endian; the CRC covers the
record). A frame torn at any byte — a crash mid-write — ends the log: everything before it is recovered, the torn
tail is cut when the log is opened for writing. Every manager start writes :class:`Begin` (the run id and the
epoch); a log of another run, or one whose epochs go backwards, is a :class:`WorkLogError` naming the file.

Durability (group commit): records are buffered and written, flushed and fsynced at most ``commit_every_s``
seconds after the first of them — and at once, before it is sent, when a message for the trainer is waiting (a
reply, a finished group): nothing reaches the trainer that the log does not hold. A manager killed at any moment
therefore loses at most the records of one commit window, none of which the trainer has seen: tokens accepted in
the last ``commit_every_s`` seconds (the instances that survive resend them, ``manager/restore.py``), an ended
response's end (it is finished again), an acknowledgement (the group is delivered again and skipped).

Compaction: a new step begins only when every response of the last one finished (strict on-policy), so at each
:class:`Submit` the log is rewritten as a snapshot (begin, trainer, version, live instances, counters) plus the
new step, and replaces the old file atomically. The log stays bounded by one step's tokens over a week-long run.
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Union

import msgspec

from rlboost_hpc.errors import BadInput
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.protocol.stats import HeldOutEvaluation, ManagerCounters
from rlboost_hpc.protocol.version import VersionId


class WorkLogError(BadInput, RuntimeError):
    """The work log belongs to another run, or its epochs go backwards; the message names the file."""


class _Rec(msgspec.Struct, tag_field="r", array_like=True):
    pass


class Begin(_Rec, tag="begin"):
    """A manager started: the run it serves and its epoch (incarnation)."""

    run_id: str
    epoch: int


class Hello(_Rec, tag="hello"):
    """The trainer introduced itself (``TrainerHello``) from routing id ``peer``."""

    peer: bytes
    weights_endpoint: str
    weights_shards: str
    model_config: dict
    model_arch: dict
    adapter: AdapterSpec | None = None  # a LoRA run's adapter spec (TrainerHello.adapter)


class Version(_Rec, tag="version"):
    """Weight version ``version`` (whole-version checksum ``checksum``) became current."""

    version: int
    checksum: int

    @property
    def identity(self) -> VersionId:
        return VersionId(self.version, self.checksum)


class Submit(_Rec, tag="submit"):
    """Step ``step`` of version ``version`` was submitted with these GRPO groups."""

    step: int
    version: int
    groups: list[M.GroupSpec]


class Seeding(_Rec, tag="seeding"):
    """The seeding window opened or closed; a close names the step the trainer trains from then on (-1: unknown)."""

    open: bool
    step: int = -1


class Joined(_Rec, tag="joined"):
    """An instance registered: its key (``job#attempt``), routing id and what it is."""

    key: str
    peer: bytes
    kind: str
    max_batch: int
    engine: str
    relay_endpoint: str


class Silent(_Rec, tag="silent"):
    """An instance became suspect (silent past the heartbeat deadline, or its connection closed), or spoke again."""

    key: str
    suspect: bool


class Left(_Rec, tag="left"):
    """An instance is gone for good."""

    key: str


class Frame(_Rec, tag="frame"):
    """A ``Tokens`` frame as it arrived from routing id ``peer`` (journaled whole, before the manager applied it:
    one record per frame, not per delta), and the responses whose delta the manager did not apply (``dropped``: late,
    refused, or the whole frame of a peer it did not know — filled in once the frame was applied, before the commit).
    Replayed, each other delta applies to a response that is not done when it continues the response at its length
    (a delta that overlaps the length applies past it when the overlap equals the tokens held, as an adopted resend
    did), within the response's window of versions and its budget."""

    peer: bytes
    data: bytes
    dropped: list[str] = []


class Observation(_Rec, tag="obs"):
    """The environment's observation (packed int32 ids) appended to trajectory ``rid``; its next turn opens. A
    stateful environment's step also records its ``reward`` and, when it failed, ``error``; ``ids`` are empty when
    the step ended the trajectory (its :class:`Finished` follows)."""

    rid: str
    ids: bytes
    reward: float = 0.0
    error: str = ""


class ToolCall(_Rec, tag="tool"):
    """Trajectory ``rid``'s turn ended with a tool call: it waits for the environment."""

    rid: str


class Finished(_Rec, tag="finished"):
    """Response ``rid`` is done for ``reason`` (one of ``messages.FINISH_REASONS``)."""

    rid: str
    reason: str


class Acked(_Rec, tag="acked"):
    """The trainer acknowledged group ``gid``."""

    gid: str


class Migrated(_Rec, tag="migrated"):
    """Response ``rid`` was taken back from its instance and queued for another (a migration: its count survives a
    restart, as the trainer reads it on the finished response)."""

    rid: str


class Counters(_Rec, tag="counters"):
    """The manager's running totals (:class:`ManagerCounters`, its tallies by key included) at a compaction, and
    at every commit after which they changed: a restarted manager continues from the last ones the log holds."""

    counters: ManagerCounters


class Evaluated(_Rec, tag="evaluated"):
    """The trainer told a held-out evaluation (``Evaluation``): ``when`` it ran and what it found."""

    when: str
    result: HeldOutEvaluation


class Compact(_Rec, tag="compact"):
    """Not written: tells the writer that the records after it replace the whole log (a new step began)."""


Record = Union[Begin, Hello, Version, Submit, Seeding, Joined, Silent, Left, Frame, Observation, ToolCall, Finished, Acked,
               Migrated, Counters, Evaluated, Compact]

_HEAD = struct.Struct("<II")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def frame(rec: Record) -> bytes:
    """One record as a frame (``u32 length · u32 crc32 · msgpack``)."""
    body = _encoder.encode(rec)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def read(path: str | os.PathLike) -> tuple[list[Record], int]:
    """The complete records of the log at ``path`` and the byte length they span (a torn or corrupt frame ends
    the log there). Missing file: ``([], 0)``."""
    p = Path(path)
    if not p.exists():
        return [], 0
    data = p.read_bytes()
    out, pos = [], 0
    while pos + _HEAD.size <= len(data):
        n, crc = _HEAD.unpack_from(data, pos)
        body = data[pos + _HEAD.size: pos + _HEAD.size + n]
        if len(body) < n or zlib.crc32(body) != crc:
            break
        try:
            out.append(_decoder.decode(body))
        except msgspec.DecodeError:
            break
        pos += _HEAD.size + n
    return out, pos


def check(path: str | os.PathLike, records: list[Record], run_id: str, epoch: int) -> None:
    """Raise :class:`WorkLogError` when ``records`` are not this run's (another ``run_id``), their epochs go
    backwards, or one is not older than ``epoch`` (the epoch about to start)."""
    last = 0
    for r in records:
        if isinstance(r, Begin):
            if r.run_id != run_id:
                raise WorkLogError(f"{path}: the work log belongs to run {r.run_id!r}, not {run_id!r} (a run's id is "
                                   "its directory's name unless RLBOOST_RUN_ID is set); a copied or renamed run "
                                   f"directory resumes under its old id: RLBOOST_RUN_ID={r.run_id} and the same "
                                   "command; otherwise restore the run's own directory or start a new run in a new "
                                   "--out")
            if r.epoch < last or r.epoch >= epoch:
                raise WorkLogError(f"{path}: manager epochs go backwards ({last} then {r.epoch}, starting {epoch}); "
                                   "the file was copied from elsewhere or edited")
            last = r.epoch


class WorkLog:
    """The writer of one manager's work log (see the module docstring).

    Args:
        path: ``RUN_DIR/manager-work.log``.
        run_id: the run's id; ``epoch``: this manager's epoch (the journal's, ``manager/journal.py``).
        keep: keep what the log holds (a restart) — else it starts empty (a new run, or a trainer that starts over).
        commit_every_s: the group-commit window (seconds).

    Attributes: ``restored``: the records read at open (``keep`` only), for
    :func:`~rlboost_hpc.manager.restore.restore`. ``commits`` / ``bytes_written``: totals.

    Raises:
        WorkLogError: (``keep``) the log belongs to another run or its epochs go backwards.
    """

    def __init__(self, path: str | os.PathLike, run_id: str, epoch: int, *, keep: bool,
                 commit_every_s: float = 0.05) -> None:
        self.path = Path(path)
        self.run_id, self.epoch, self.commit_every_s = run_id, epoch, commit_every_s
        self.restored: list[Record] = []
        if keep:
            self.restored, end = read(self.path)
            check(self.path, self.restored, run_id, epoch)
            if self.path.exists() and self.path.stat().st_size > end:
                with open(self.path, "r+b") as f:  # cut the torn tail so appends stay readable
                    f.truncate(end)
            self._f = open(self.path, "ab")
        else:
            self._f = open(self.path, "wb")
        self._buf: list[bytes] = []
        self._first: float | None = None
        self._compact = False
        self._counters = b""  # the frame of the last running totals written (commit only writes changed ones)
        self.commits = self.bytes_written = 0
        self.write([Begin(run_id, epoch)], now=0.0)
        self.commit()

    def write(self, records: list[Record], now: float) -> None:
        """Buffer ``records`` (``now``: monotonic seconds, the commit window's clock); a :class:`Compact` among
        them drops everything buffered or on disk before it (the records after it are the whole log)."""
        for rec in records:
            if isinstance(rec, Compact):
                self._buf, self._compact = [], True
                continue
            self._buf.append(frame(rec))
            if isinstance(rec, Counters):
                self._counters = self._buf[-1]
            if self._first is None:
                self._first = now

    @property
    def pending(self) -> bool:
        """Records wait to be committed."""
        return bool(self._buf) or self._compact

    def due(self, now: float) -> bool:
        """The oldest buffered record is ``commit_every_s`` old: a commit is owed now."""
        return bool(self._buf) and now - self._first >= self.commit_every_s

    def commit(self, counters: ManagerCounters | None = None) -> None:
        """Write, flush and fsync what is buffered (after a :class:`Compact`: into a new file that atomically
        replaces the log, beginning with this manager's :class:`Begin`). ``counters``: the manager's running totals
        now, journaled with a commit that has records when they differ from the last ones written (so a restarted
        manager's totals lose at most those of one commit window, like its tokens)."""
        if counters is not None and self.pending:
            rec = frame(Counters(counters))
            if rec != self._counters:
                self._buf.append(rec)
                self._counters = rec
        if self._compact:
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(frame(Begin(self.run_id, self.epoch)) + b"".join(self._buf))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._f.close()
            self._f = open(self.path, "ab")
        elif self._buf:
            self._f.write(b"".join(self._buf))
            self._f.flush()
            os.fsync(self._f.fileno())
        self.bytes_written += sum(map(len, self._buf))
        self.commits += 1
        self._buf, self._first, self._compact = [], None, False

    def close(self, counters: ManagerCounters | None = None) -> None:
        """Commit what is buffered (with ``counters``, as :meth:`commit`) and close the file."""
        if self.pending:
            self.commit(counters)
        self._f.close()
