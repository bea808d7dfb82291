"""The reader's side of weight versions shared through ``/dev/shm`` (:mod:`rlboost_hpc.weights.shared` states the
protocol): a rollout agent on the trainer's node maps the version it is told to load instead of pulling it.

Invariant: a version is mapped only under ``LOCK_SH`` taken before its manifest is read, and held until the next
pull — so its bytes are complete and unchanged while the engine copies them; anything else goes to the fallback
pull, verified as any instance's.
"""
from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import fcntl
import msgspec
import torch

from rlboost_hpc.protocol.weight_msgs import Manifest, decode_reply, validate_table
from rlboost_hpc.weights.source import BaseWeights, PulledVersion, WeightSource, identity
from rlboost_hpc.models.layout import state_view
from rlboost_hpc.weights.shared import BASE_SUBDIR, MANIFEST_SUFFIX, try_lock

if TYPE_CHECKING:
    from rlboost_hpc.protocol.adapter import AdapterSpec
    from rlboost_hpc.protocol.auth import RunKeys

log = logging.getLogger(__name__)


@dataclass
class _Held:
    fd: int
    mapping: mmap.mmap | None


def _drop(held: _Held | None) -> None:
    """Let the writer reuse a mapped version: closing the descriptor drops its ``LOCK_SH`` (the mapping itself goes
    with its last view)."""
    if held is not None:
        os.close(held.fd)


@dataclass
class SharedVersions:
    """The reader's side: a rollout agent's :class:`~rlboost_hpc.weights.source.WeightSource` that maps the
    version it is told to load from the share ``directory`` (the protocol: :mod:`rlboost_hpc.weights.shared`), else asks ``fallback`` — the
    network pull every instance uses, which also serves sharded versions and a LoRA run's base.

    A LoRA run's base is mapped the same way from the subdirectory ``base`` when the trainer shares it.

    Counters: ``shared`` (versions mapped from the directory), ``fallbacks`` (pulled over the network instead).
    Precondition (held by :class:`~rlboost_hpc.rollout.agent.RolloutAgent`): a version's tensors are no longer read
    once the next pull starts."""

    directory: Path
    fallback: WeightSource
    shared: int = 0
    fallbacks: int = 0
    _held: _Held | None = field(default=None, repr=False)
    _base_held: _Held | None = field(default=None, repr=False)

    def pull(self, endpoint: str, version: int, *, peers: Sequence[str] = (), keys: "RunKeys | None" = None,
             shards: str = "", checksum: int = 0, adapter: "AdapterSpec | None" = None) -> PulledVersion:
        """``version`` mapped from the share directory (``checksum``, when not 0, must be its identity:
        :func:`~rlboost_hpc.weights.source.identity`), else pulled by ``fallback`` with the same arguments. Raises
        what the fallback raises."""
        self.release()
        if not shards:
            try:
                got = self._map(version, checksum, adapter)
            except (OSError, ValueError, msgspec.DecodeError) as e:  # the shared path is an optimisation
                log.warning("version %d not mapped from %s (%s: %s); pulling it", version, self.directory,
                            type(e).__name__, e)
                got = None
            if got is not None:
                self.shared += 1
                return got
        self.fallbacks += 1
        return self.fallback.pull(endpoint, version, peers=peers, keys=keys, shards=shards, checksum=checksum,
                                  adapter=adapter)

    def base(self, spec: "AdapterSpec", arch, *, keys: "RunKeys | None" = None, label: str = "") -> BaseWeights:
        """A LoRA run's base: mapped from the base server's share directory (source ``"trainer"``: the trainer's
        own buffer, held for this reader's life), else the fallback's (the node's ``model.path``, its cache, or the
        base server). Raises what the fallback raises."""
        try:
            got = self._map_in(self.directory / BASE_SUBDIR, 0, int(spec.base_checksum))
        except (OSError, ValueError, msgspec.DecodeError) as e:
            log.warning("the base not mapped from %s (%s: %s); loading it as a node does", self.directory,
                        type(e).__name__, e)
            got = None
        if got is None:
            return self.fallback.base(spec, arch, keys=keys, label=label)
        _drop(self._base_held)
        pv, self._base_held = got
        return BaseWeights(pv.state_dict, pv.checksum, pv.nbytes, "trainer", pv.pull_s)

    def _map(self, version: int, checksum: int, adapter: "AdapterSpec | None") -> PulledVersion | None:
        got = self._map_in(self.directory, version, checksum, adapter)
        if got is None:
            return None
        pv, self._held = got
        return pv

    def _map_in(self, directory: Path, version: int, checksum: int, adapter: "AdapterSpec | None" = None
                ) -> tuple[PulledVersion, _Held] | None:
        """``version`` of ``directory`` whose identity is ``checksum`` (0: any) mapped under ``LOCK_SH`` (the caller
        keeps the returned hold), or None when it is not there. Raises OSError / ValueError / msgspec.DecodeError
        for a damaged share."""
        t0 = time.monotonic()
        if not directory.is_dir():
            return None
        for side in sorted(directory.glob("*" + MANIFEST_SUFFIX)):
            data = side.with_name(side.name[:-len(MANIFEST_SUFFIX)])
            try:
                fd = os.open(data, os.O_RDONLY)
            except FileNotFoundError:
                continue
            keep = False
            try:
                if not try_lock(fd, fcntl.LOCK_SH):
                    continue  # being written: not the version a reader may take
                try:
                    raw = side.read_bytes()  # read under the lock: it describes the bytes held
                except FileNotFoundError:
                    continue
                man = decode_reply(raw)
                if not isinstance(man, Manifest) or man.version != version or (
                        checksum and identity(int(man.checksum), adapter) != checksum):
                    continue
                if man.tensors is None:
                    raise ValueError(f"{side} has no tensor table")
                validate_table(man.tensors, man.total_bytes)
                if os.fstat(fd).st_size < man.total_bytes:
                    raise ValueError(f"{data} holds {os.fstat(fd).st_size} bytes, its manifest {man.total_bytes}")
                # copy-on-write: the pages are the writer's until written, and nothing writes them (the tensors
                # must be writable buffers for torch, not writable memory for anyone else)
                mapping = mmap.mmap(fd, man.total_bytes, access=mmap.ACCESS_COPY) if man.total_bytes else None
                keep = True
                view = torch.frombuffer(mapping, dtype=torch.uint8) if mapping is not None else \
                    torch.empty(0, dtype=torch.uint8)
                return PulledVersion(state_view(view, man.tensors), int(man.checksum), int(man.total_bytes),
                                     time.monotonic() - t0, 0, {"shared_memory": 1.0}), _Held(fd, mapping)
            finally:
                if not keep:
                    os.close(fd)  # closing the descriptor drops its lock
        return None

    def release(self) -> None:
        """Let the writer reuse the version last mapped (its tensors must no longer be read)."""
        _drop(self._held)
        self._held = None

    def close(self) -> None:
        self.release()
        _drop(self._base_held)
        self._base_held = None
        close = getattr(self.fallback, "close", None)
        if close is not None:
            close()
