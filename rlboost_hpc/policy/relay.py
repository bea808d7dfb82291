"""Peer relay of weight versions: which holder serves the latest version to which puller (pure logic).

Every rollout instance pulls every version. Pulling all of them from the trainer makes the trainer's egress grow
linearly with N_prem; instead, an instance that holds the latest verified version serves it to others (it only
serves bytes — the manifest and its checksums always come from the trainer, so a peer cannot alter what a
puller accepts). :class:`RelayTree` decides who serves whom:

- a puller gets the least-loaded *holder* serving fewer than ``fanout`` pullers (plus, as a backup, another
  holder), else the trainer if it has served fewer than ``trainer_fanout`` pullers of this version, else it
  *waits*;
- the trainer seeds the tree: it sends each version to at most ``trainer_fanout`` pullers (a puller that leaves
  before it finished gives its share back), except when nothing else can make progress — no holder and no pull
  in flight — so that its egress per version does not grow with N_prem;
- when a puller finishes it frees its source and becomes a holder itself, and waiting pullers are handed the
  free capacity (FIFO) — the tree widens geometrically: with trainer fan-out 2 and fan-out 4, 16 pullers are
  served in three rounds while the trainer sends the version twice;
- an instance that leaves (or stops serving) frees its source and stops being a holder; pullers it was serving
  fail over by themselves (the puller resumes from its backup, then from the trainer, at the chunk where it
  stopped).

``fanout = 0`` turns relay off: everyone pulls from the trainer at once (the behaviour without relay). The
manager (``manager/core.py``, in its parts ``instance_registry.py`` and ``trainer_calls.py``) applies the tree;
the benchmark drives the same class.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: Source key of the trainer's weight server.
TRAINER = ""


@dataclass(frozen=True)
class Source:
    """Where a puller fetches the latest version's chunks: ``peers`` (relay endpoints, tried in order), then the
    trainer. ``wait``: no capacity now — wait for a later assignment (or a deadline, then use the trainer)."""

    peers: tuple[str, ...] = ()
    wait: bool = False


@dataclass
class RelayTree:
    """Assignment of pullers to holders for one weight version (reset when the version changes).

    Args:
        fanout: pullers one instance serves at once (0: relay off).
        trainer_fanout: pullers the trainer serves at once while relay is on (≥ 1).
    """

    fanout: int = 4
    trainer_fanout: int = 2
    holders: dict[str, str] = field(default_factory=dict)  # instance key → relay endpoint
    serving: dict[str, set[str]] = field(default_factory=dict)  # source key (TRAINER or instance) → pullers
    source_of: dict[str, str] = field(default_factory=dict)  # puller → its source key
    waiting: list[str] = field(default_factory=list)  # pullers without a source yet, FIFO
    trainer_used: int = 0  # pullers of this version the trainer served or serves (its egress, in versions)

    def __post_init__(self) -> None:
        if self.fanout < 0 or self.trainer_fanout < 1:
            raise ValueError(f"fanout must be >= 0 and trainer_fanout >= 1, got {self.fanout}, {self.trainer_fanout}")

    @property
    def enabled(self) -> bool:
        return self.fanout > 0

    def reset(self) -> None:
        """A new version: nobody holds it, nobody is being served."""
        self.holders.clear()
        self.serving.clear()
        self.source_of.clear()
        self.waiting.clear()
        self.trainer_used = 0

    def load(self, source: str) -> int:
        """Pullers ``source`` serves now."""
        return len(self.serving.get(source, ()))

    def want(self, puller: str) -> Source:
        """``puller`` needs the latest version: its source (an existing assignment is kept)."""
        if not self.enabled:
            return Source()
        if puller in self.source_of:
            return self._source(puller, self.source_of[puller])
        if puller in self.holders:  # it held the version and wants it again (restarted): it holds nothing now
            self._forget_holder(puller)
        free = sorted((self.load(h), h) for h in self.holders if h != puller and self.load(h) < self.fanout)
        if free:
            return self._assign(puller, free[0][1])
        in_flight = any(self.serving.values())
        if self.trainer_used < self.trainer_fanout or not (self.holders or in_flight):
            self.trainer_used += 1
            return self._assign(puller, TRAINER)
        if puller not in self.waiting:
            self.waiting.append(puller)
        return Source(wait=True)

    def done(self, puller: str, relay_endpoint: str = "") -> list[tuple[str, Source]]:
        """``puller`` loaded the latest version: it frees its source and, with a ``relay_endpoint``, serves from
        now on. Returns the waiting pullers handed capacity, with their sources."""
        self._drop(puller, finished=True)
        if relay_endpoint and self.enabled:
            self.holders[puller] = relay_endpoint
        return self._hand_out()

    def gone(self, key: str) -> list[tuple[str, Source]]:
        """``key`` left or stopped serving (gone, suspect, fenced, draining): it is no longer a holder and its
        source is free. Returns the waiting pullers handed capacity."""
        self._drop(key)
        self._forget_holder(key)
        return self._hand_out()

    # ------------------------------------------------------------------ internals
    def _forget_holder(self, key: str) -> None:
        self.holders.pop(key, None)
        self.serving.pop(key, None)
        for p in [p for p, s in self.source_of.items() if s == key]:
            del self.source_of[p]  # its pullers fail over by themselves; they are not counted anywhere now

    def _drop(self, puller: str, finished: bool = False) -> None:
        src = self.source_of.pop(puller, None)
        if src is not None:
            self.serving.get(src, set()).discard(puller)
            if src == TRAINER and not finished:
                self.trainer_used -= 1  # it left unfinished: its share of the trainer's egress is free again
        if puller in self.waiting:
            self.waiting.remove(puller)

    def _assign(self, puller: str, source: str) -> Source:
        if puller in self.waiting:
            self.waiting.remove(puller)
        self.source_of[puller] = source
        self.serving.setdefault(source, set()).add(puller)
        return self._source(puller, source)

    def _source(self, puller: str, source: str) -> Source:
        if source == TRAINER:
            return Source()
        backups = sorted((self.load(h), h) for h in self.holders if h not in (puller, source))
        return Source(peers=(self.holders[source], *(self.holders[h] for _, h in backups[:1])))

    def _hand_out(self) -> list[tuple[str, Source]]:
        out = []
        for p in list(self.waiting):
            s = self.want(p)
            if s.wait:
                break
            out.append((p, s))
        return out
