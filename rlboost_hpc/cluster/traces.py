"""Parsers for real spot/preemptible-instance availability traces.

Two on-disk formats are read (both described in ``../shared/data/README.md``, section ``spot_traces``):

* Bamboo CSV (``spot_traces/bamboo/{p3,g4dn}-trace.csv``): one event per line, ``<ms>,add|remove,<name>``.
  Both real files have CRLF line endings (the README mentions it only for p3).
* Parcae segments (``spot_traces/parcae/segments_gpt-1.5b/*.txt``): one JSON list per line,
  ``[<ms>, "add"|"remove"|"no-op", {"nodes": [<name>, ...], ...}]``; each line is expanded into one event per
  node (in list order) and ``no-op`` lines are skipped. Other keys of the object (``duration``, the
  ``*_strategy`` pairs) are ignored.

Invariants of every parser result (:class:`ParsedTrace`, a ``list`` of :class:`TraceEvent`):

* sorted by ``t_s`` (seconds since the trace origin, ``>= 0``) with a *stable* sort, so events that share a
  time keep their file order;
* consistent: replayed in order, an ``add`` names an instance that is not live and a ``remove`` names one that
  is. Inconsistent events (removing an instance that is not live, adding one that already is) are dropped,
  counted in ``ParsedTrace.skipped`` and logged as a warning; they never raise. (The shipped p3, g4dn and
  Parcae traces contain none; the check exists for other traces.)
* never empty: a trace with no event raises :class:`TraceFormatError`.

A malformed line always raises :class:`TraceFormatError` naming the file, the 1-based line number and the
offending text. Blank lines are ignored. Times out of order in the file are accepted (they are sorted);
negative, NaN or infinite times are errors.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from rlboost_hpc.paths import data_file
from rlboost_hpc.errors import BadInput

log = logging.getLogger(__name__)

EventKind = Literal["add", "remove"]
EVENT_KINDS: tuple[str, ...] = ("add", "remove")

#: Data-relative paths of the shipped traces (resolved through :func:`rlboost_hpc.paths.data_file`).
P3_TRACE = "spot_traces/bamboo/p3-trace.csv"
G4DN_TRACE = "spot_traces/bamboo/g4dn-trace.csv"
PARCAE_SEGMENTS_DIR = "spot_traces/parcae/segments_gpt-1.5b"

#: Short names accepted by :func:`load_trace` (e.g. from a config file).
NAMED_TRACES: dict[str, str] = {
    "p3": P3_TRACE,
    "g4dn": G4DN_TRACE,
    "parcae-hh": f"{PARCAE_SEGMENTS_DIR}/trace_hh_55_65.txt",
    "parcae-hl": f"{PARCAE_SEGMENTS_DIR}/trace_hl_15_25.txt",
    "parcae-lh": f"{PARCAE_SEGMENTS_DIR}/trace_lh_80_90.txt",
    "parcae-ll": f"{PARCAE_SEGMENTS_DIR}/trace_ll_10_11.txt",
}

_SNIPPET = 120  # characters of an offending line quoted in an error message


class TraceFormatError(BadInput, ValueError):
    """A trace file is malformed or empty; the message names the file, the line number and the text."""


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One availability change: at ``t_s`` seconds since the trace origin, ``instance`` was added or removed."""

    t_s: float
    kind: EventKind
    instance: str


@dataclass(frozen=True, slots=True)
class SkippedEvent:
    """An inconsistent event dropped by a parser: where it was and why."""

    line: int
    event: TraceEvent
    reason: str


class ParsedTrace(list):
    """A ``list[TraceEvent]`` (sorted, consistent, non-empty) plus where it came from and what was dropped.

    Attributes:
        source: the file the events were read from.
        skipped: the inconsistent events that were dropped (see the module docstring), in file order.
    """

    def __init__(self, events: Iterable[TraceEvent], *, source: str, skipped: Iterable[SkippedEvent] = ()):
        super().__init__(events)
        self.source = source
        self.skipped: tuple[SkippedEvent, ...] = tuple(skipped)

    @property
    def n_skipped(self) -> int:
        """Number of inconsistent events dropped while parsing."""
        return len(self.skipped)


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Summary of a trace. Times in seconds since the trace origin (the origin is t = 0, not the first event).

    Attributes:
        n_events / n_add / n_remove: event counts.
        n_instances: distinct instance names.
        n_change_times: distinct event times (simultaneous events collapse into one change of the count).
        first_t_s / last_t_s: time of the first and last event.
        duration_s: ``last_t_s`` (the trace is replayed from t = 0).
        peak: maximum number of live instances; ``peak_t_s``: first time it is reached.
        final_live: live instances after the last event.
    """

    n_events: int
    n_add: int
    n_remove: int
    n_instances: int
    n_change_times: int
    first_t_s: float
    last_t_s: float
    duration_s: float
    peak: int
    peak_t_s: float
    final_live: int


# --------------------------------------------------------------------------------------------- paths


def resolve_trace_path(path: str | os.PathLike[str] | None = None) -> Path:
    """Find a trace file.

    ``None`` means the p3 trace; a key of :data:`NAMED_TRACES` (``"p3"``, ``"g4dn"``, ``"parcae-hh"``, ...) means
    that trace; a relative path that exists from the current directory is used as is; anything else is
    resolved through :func:`rlboost_hpc.paths.data_file` (so ``"spot_traces/bamboo/g4dn-trace.csv"`` works).

    Raises:
        rlboost_hpc.paths.DataFileMissing: the file does not exist.
    """
    if path is None:
        return data_file(P3_TRACE)
    if isinstance(path, str) and path in NAMED_TRACES:
        return data_file(NAMED_TRACES[path])
    p = Path(path)
    if not p.is_absolute() and p.exists():
        return p
    return data_file(p)


# --------------------------------------------------------------------------------------------- parsing


def _error(source: str, lineno: int, text: str, why: str) -> TraceFormatError:
    snippet = text if len(text) <= _SNIPPET else text[:_SNIPPET] + "..."
    return TraceFormatError(f"{source}:{lineno}: {why}: {snippet!r}")


def _parse_ms(raw: object, source: str, lineno: int, text: str) -> float:
    """Milliseconds (int, float or numeric string) -> seconds; rejects bools, non-numbers, NaN/inf, negatives."""
    if isinstance(raw, bool):
        raise _error(source, lineno, text, "time must be a number of milliseconds")
    if isinstance(raw, (int, float)):
        ms = float(raw)
    elif isinstance(raw, str):
        try:
            ms = float(raw.strip())
        except ValueError:
            raise _error(source, lineno, text, f"time {raw.strip()!r} is not a number of milliseconds") from None
    else:
        raise _error(source, lineno, text, "time must be a number of milliseconds")
    if not math.isfinite(ms):
        raise _error(source, lineno, text, "time is not finite")
    if ms < 0:
        raise _error(source, lineno, text, f"negative time {ms:g} ms")
    return ms / 1000.0


def _finish(raw: list[tuple[int, TraceEvent]], source: str) -> ParsedTrace:
    """Stable-sort by time, drop inconsistent events (counted, logged), refuse an empty trace."""
    if not raw:
        raise TraceFormatError(f"{source}: empty trace (no add/remove event)")
    raw.sort(key=lambda item: item[1].t_s)  # list.sort is stable: ties keep file order
    live: set[str] = set()
    kept: list[TraceEvent] = []
    skipped: list[SkippedEvent] = []
    for lineno, ev in raw:
        if ev.kind == "add":
            if ev.instance in live:
                skipped.append(SkippedEvent(lineno, ev, "add of an instance that is already live"))
                continue
            live.add(ev.instance)
        else:
            if ev.instance not in live:
                skipped.append(SkippedEvent(lineno, ev, "remove of an instance that is not live"))
                continue
            live.discard(ev.instance)
        kept.append(ev)
    for s in skipped:
        log.warning("%s:%d: skipped %s %r at %.3f s: %s", source, s.line, s.event.kind, s.event.instance,
                    s.event.t_s, s.reason)
    if skipped:
        log.warning("%s: %d inconsistent event(s) skipped", source, len(skipped))
    if not kept:
        raise TraceFormatError(f"{source}: empty trace (every event was inconsistent and skipped)")
    return ParsedTrace(kept, source=source, skipped=skipped)


def _read_lines(path: Path) -> list[str]:
    # newline="" keeps "\r" so we can strip CRLF and CR-only endings ourselves; splitlines handles all.
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read().splitlines()


def parse_bamboo_csv(path: str | os.PathLike[str] | None = None) -> ParsedTrace:
    """Read a Bamboo trace (``<ms>,add|remove,<instance>`` per line; LF or CRLF endings).

    Args:
        path: the file (see :func:`resolve_trace_path`); default the p3 trace.

    Returns:
        The events, times in seconds, sorted and consistent (see the module docstring).

    Raises:
        TraceFormatError: a line has not exactly three fields, a non-numeric/negative/non-finite time, an
            unknown event kind or an empty instance name (message: ``file:line: why: 'text'``); or the trace is
            empty.
        rlboost_hpc.paths.DataFileMissing: the file does not exist.
    """
    p = resolve_trace_path(path)
    source = str(p)
    raw: list[tuple[int, TraceEvent]] = []
    for lineno, text in enumerate(_read_lines(p), start=1):
        if not text.strip():
            continue
        fields = [f.strip() for f in text.split(",")]
        if len(fields) != 3:
            raise _error(source, lineno, text, f"expected 3 comma-separated fields <ms>,add|remove,<instance>, "
                                               f"got {len(fields)}")
        t_raw, kind, name = fields
        t_s = _parse_ms(t_raw, source, lineno, text)
        if kind not in EVENT_KINDS:
            raise _error(source, lineno, text, f"unknown event kind {kind!r} (expected 'add' or 'remove')")
        if not name:
            raise _error(source, lineno, text, "missing instance name")
        raw.append((lineno, TraceEvent(t_s, kind, name)))  # type: ignore[arg-type]
    return _finish(raw, source)


def parse_parcae_segment(path: str | os.PathLike[str]) -> ParsedTrace:
    """Read a Parcae segment (``[<ms>, "add"|"remove"|"no-op", {"nodes": [...], ...}]`` per line).

    Each ``add``/``remove`` line becomes one event per node, in list order; ``no-op`` lines are skipped (a no-op
    that lists nodes is an error: its meaning would be ambiguous).

    Args:
        path: the file (see :func:`resolve_trace_path`), e.g. ``"parcae-hh"``.

    Raises:
        TraceFormatError: invalid JSON, not a 3-element list, bad time, unknown kind, no ``nodes`` list, a
            non-string or empty node name, an add/remove with no node; or the trace is empty.
        rlboost_hpc.paths.DataFileMissing: the file does not exist.
    """
    p = resolve_trace_path(path)
    source = str(p)
    raw: list[tuple[int, TraceEvent]] = []
    for lineno, text in enumerate(_read_lines(p), start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _error(source, lineno, text, f"invalid JSON ({exc.msg})") from None
        if not isinstance(obj, list) or len(obj) != 3:
            raise _error(source, lineno, text, 'expected a JSON list [ms, "add"|"remove"|"no-op", {"nodes": [...]}]')
        t_raw, kind, info = obj
        t_s = _parse_ms(t_raw, source, lineno, text)
        if kind not in ("add", "remove", "no-op"):
            raise _error(source, lineno, text, f"unknown event kind {kind!r} (expected 'add', 'remove' or 'no-op')")
        if not isinstance(info, dict) or not isinstance(info.get("nodes"), list):
            raise _error(source, lineno, text, "missing 'nodes' list")
        nodes = info["nodes"]
        if any(not isinstance(n, str) or not n for n in nodes):
            raise _error(source, lineno, text, "node names must be non-empty strings")
        if kind == "no-op":
            if nodes:
                raise _error(source, lineno, text, "'no-op' event lists nodes")
            continue
        if not nodes:
            raise _error(source, lineno, text, f"{kind!r} event lists no node")
        raw.extend((lineno, TraceEvent(t_s, kind, n)) for n in nodes)
    return _finish(raw, source)


def parse_parcae_segments(directory: str | os.PathLike[str] = PARCAE_SEGMENTS_DIR) -> dict[str, ParsedTrace]:
    """Read every ``*.txt`` segment of a Parcae directory: ``{file stem: events}``, sorted by name.

    Raises:
        TraceFormatError: as :func:`parse_parcae_segment`, or the directory holds no ``*.txt`` file.
        rlboost_hpc.paths.DataFileMissing: the directory does not exist.
    """
    d = resolve_trace_path(directory)
    files = sorted(d.glob("*.txt"))
    if not files:
        raise TraceFormatError(f"{d}: no Parcae segment (*.txt) found")
    return {f.stem: parse_parcae_segment(f) for f in files}


def load_trace(path: str | os.PathLike[str] | None = None) -> ParsedTrace:
    """Read a trace of either format, chosen by content (a first non-blank line starting with ``[`` is Parcae).

    Args:
        path: as :func:`resolve_trace_path` (default p3; names such as ``"g4dn"`` or ``"parcae-lh"`` work).

    Raises:
        TraceFormatError, rlboost_hpc.paths.DataFileMissing: as the format's parser.
    """
    p = resolve_trace_path(path)
    for text in _read_lines(p):
        if text.strip():
            return parse_parcae_segment(p) if text.lstrip().startswith("[") else parse_bamboo_csv(p)
    raise TraceFormatError(f"{p}: empty trace (no add/remove event)")


# --------------------------------------------------------------------------------------------- analysis


def live_counts(events: Iterable[TraceEvent]) -> list[tuple[float, int]]:
    """Number of live instances after each distinct event time: ``[(t_s, count), ...]``, times increasing.

    Simultaneous events collapse into one point (the count after all of them). Events are replayed in the
    given order after a stable sort by time, with set semantics (a redundant add or remove changes nothing),
    so any event list gives a non-negative count. Before the first point the count is 0.
    """
    evs = sorted(events, key=lambda e: e.t_s)
    live: set[str] = set()
    out: list[tuple[float, int]] = []
    for ev in evs:
        if ev.kind == "add":
            live.add(ev.instance)
        elif ev.kind == "remove":
            live.discard(ev.instance)
        else:
            raise ValueError(f"unknown event kind {ev.kind!r}")
        if out and out[-1][0] == ev.t_s:
            out[-1] = (ev.t_s, len(live))
        else:
            out.append((ev.t_s, len(live)))
    return out


def count_at(counts: list[tuple[float, int]], t_s: float) -> int:
    """Live count at time ``t_s`` (after all events at ``t_s``) from :func:`live_counts` output; 0 before."""
    n = 0
    for t, c in counts:
        if t > t_s:
            break
        n = c
    return n


def trace_stats(events: Iterable[TraceEvent]) -> TraceStats:
    """Summary statistics of a trace (see :class:`TraceStats`).

    Raises:
        ValueError: no event.
    """
    evs = sorted(events, key=lambda e: e.t_s)
    if not evs:
        raise ValueError("trace_stats: empty trace")
    counts = live_counts(evs)
    peak_t, peak = max(counts, key=lambda tc: (tc[1], -tc[0]))
    n_add = sum(1 for e in evs if e.kind == "add")
    return TraceStats(
        n_events=len(evs),
        n_add=n_add,
        n_remove=len(evs) - n_add,
        n_instances=len({e.instance for e in evs}),
        n_change_times=len(counts),
        first_t_s=evs[0].t_s,
        last_t_s=evs[-1].t_s,
        duration_s=evs[-1].t_s,
        peak=peak,
        peak_t_s=peak_t,
        final_live=counts[-1][1],
    )
