"""Weight versions handed to the engine processes of the trainer's own node through shared memory, without a copy.

The trainer's :class:`~rlboost_hpc.weights.store.VersionStore` writes every published version into a host buffer
once (the cast-copy of the publish). With a share directory those buffers are files of a private directory in
``/dev/shm`` (:class:`SharedBufferPool`) mapped shared, and each finished version's manifest lies beside its buffer.
An engine process on the same node — the reserved engines, as an SGLang server runs beside Megatron on a GPU node —
maps the buffer of the version it is told to load (:class:`~rlboost_hpc.rollout.shared_weights.SharedVersions`) and its engine copies from it into its
own weights: the version crosses the process boundary with no byte copied and no socket.

Protocol (``flock(2)`` on each buffer file; a lock belongs to its open file and the kernel drops it when its holder
dies, so a killed reader or writer never leaves one behind):

- the writer takes a buffer only with ``LOCK_EX``, without waiting: a buffer a reader holds is never rewritten — the
  pool maps another one instead, so the trainer never waits on an engine. Taking a buffer removes its old manifest
  first; the new one is written (replaced atomically) once the version is complete and checksummed, then the lock is
  released;
- a reader takes ``LOCK_SH``, without waiting, and only then reads the manifest: a version found so is complete and
  stays unchanged until the reader releases it, at its next pull (the agent's engine copies what it loads and never
  reads a version again once it asks for the next).

So a reader never sees a torn or half-written version. A version that is no longer in the directory (evicted, or
being rewritten), a sharded version (Megatron with TP/PP > 1 serves shards from its ranks) or any failure of the
shared path is pulled from the weight server over the network instead (the reader's ``fallback``), verified like
any instance's pull. A LoRA run's base is shared the same way, as version 0 in the subdirectory ``base``
(:func:`base_share_dir`), held by a reader for its life (the base server never rewrites it). The directory is named
``rlboost-weights-<pid>-<random>`` after the trainer process, so :func:`rlboost_hpc.procutil.reclaim_leftovers`
removes it when that process died without cleaning up. Manifests in the directory carry no key: a sealed version's
access (``Manifest.sealed``) is stripped before it is written.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import msgspec
import torch

from rlboost_hpc.protocol.weight_msgs import Manifest, encode
from rlboost_hpc.models.layout import CudaHostPinner

log = logging.getLogger(__name__)

#: Name prefix of a share directory in ``/dev/shm``: ``<prefix><trainer pid>-<random>``.
SHARE_PREFIX = "rlboost-weights-"
MANIFEST_SUFFIX = ".manifest"
#: Subdirectory of a share directory where a LoRA run's base server keeps the base (its version 0).
BASE_SUBDIR = "base"


def base_share_dir(share_dir: str | os.PathLike[str]) -> Path:
    """The directory of ``share_dir`` holding a LoRA run's base: created (0700) when missing. Raises OSError."""
    path = Path(share_dir) / BASE_SUBDIR
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def new_share_dir(root: str | os.PathLike[str] = "/dev/shm") -> Path:
    """Create a private (0700) share directory for this process under ``root`` (``/dev/shm``, else the temp dir
    when there is no such directory). Raises OSError when it cannot be created."""
    base = Path(root)
    if not base.is_dir():
        import tempfile

        base = Path(tempfile.gettempdir())
    path = base / f"{SHARE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def remove_share_dir(path: str | os.PathLike[str]) -> None:
    """Remove a share directory and its buffers (mappings still open in readers stay valid until unmapped)."""
    shutil.rmtree(path, ignore_errors=True)


def try_lock(fd: int, kind: int) -> bool:
    """``flock(fd, kind)`` without waiting: True when taken, False when another open file holds a conflicting
    lock. Raises OSError for any other failure."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


@dataclass(eq=False)
class _SharedRegion:
    path: Path
    fd: int
    mapping: mmap.mmap
    pinned_at: int = 0  # where a pinner pinned it (0: pageable)
    unpin: "Callable[[int], None] | None" = None

    def unreferenced(self) -> bool:
        """Nothing in this process views the mapping but the pool (this record and getrefcount's argument)."""
        return sys.getrefcount(self.mapping) == 2

    def close(self) -> None:
        if self.pinned_at and self.unpin is not None:  # pinned memory is unpinned before anything unmaps it
            self.unpin(self.pinned_at)
            self.pinned_at = 0
        for p in (self.path, self.path.with_name(self.path.name + MANIFEST_SUFFIX)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        os.close(self.fd)  # the mapping outlives the descriptor; it goes with its last view


class SharedBufferPool:
    """The writer's side: host buffers that are files of a share directory, reused once nothing in this process
    views them and no reader holds them (module docstring). The interface of
    :class:`~rlboost_hpc.models.layout.HostBufferPool` that :class:`~rlboost_hpc.weights.store.VersionStore`
    uses (:meth:`take`, the counters), plus :meth:`finished`, which publishes a written buffer's manifest.

    Args:
        directory: the share directory (:func:`new_share_dir`).
        keep: buffers remembered at most (≥ 1); beyond it free ones are removed first, then the oldest (a reader
            still mapping it keeps its pages until it unmaps).
        pin_memory: pin each buffer through CUDA once when made (device-to-host exports at the link's rate), as
            :class:`~rlboost_hpc.models.layout.HostBufferPool` does; one the driver refuses stays pageable.

    Raises:
        ValueError: ``keep`` < 1.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int, *, pin_memory: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._pinner = CudaHostPinner() if pin_memory else None
        self.directory = Path(directory)
        self.keep = int(keep)
        self._regions: list[_SharedRegion] = []
        self._by_address: dict[int, _SharedRegion] = {}
        self._lock = threading.Lock()
        self._seq = 0
        #: Buffers handed out again (``reused``), files made (``mapped``), buffers skipped because a reader held them
        #: (``held_by_readers``); ``pinned`` / ``pin_failures`` are 0 (shared buffers are not pinned).
        self.reused = self.mapped = self.held_by_readers = 0
        self.pinned = self.pin_failures = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` bytes (contents undefined), locked for writing until :meth:`finished`: a
        remembered file of at least ``nbytes`` and at most twice that that nobody views, else a new one."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            region = None
            for i, r in enumerate(self._regions):
                if not (nbytes <= len(r.mapping) <= 2 * nbytes + (2 << 20)) or not r.unreferenced():
                    continue
                if not try_lock(r.fd, fcntl.LOCK_EX):
                    self.held_by_readers += 1
                    continue
                region = self._regions.pop(i)
                self.reused += 1
                try:  # no reader may take the old version's manifest for what is written now
                    region.path.with_name(region.path.name + MANIFEST_SUFFIX).unlink()
                except FileNotFoundError:
                    pass
                break
            if region is None:
                region = self._new(nbytes)
            self._regions.append(region)
            while len(self._regions) > self.keep:
                free = [i for i in range(len(self._regions) - 1) if self._regions[i].unreferenced()]
                gone = self._regions.pop(free[0] if free else 0)
                self._by_address = {a: r for a, r in self._by_address.items() if r is not gone}
                gone.close()
            buf = torch.frombuffer(region.mapping, dtype=torch.uint8)[:nbytes]
            self._by_address[buf.data_ptr()] = region
            return buf

    def _new(self, nbytes: int) -> _SharedRegion:
        self._seq += 1
        path = self.directory / f"buffer-{self._seq}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else holds it
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self.mapped += 1
        region = _SharedRegion(path, fd, mapping)
        if self._pinner is not None:
            address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
            if self._pinner.pin(address, nbytes):
                region.pinned_at, region.unpin = address, self._pinner.unpin
                self.pinned += 1
            else:
                self.pin_failures += 1
        return region

    def finished(self, buffer: torch.Tensor, manifest: Manifest) -> None:
        """``buffer`` (from :meth:`take`) now holds ``manifest``'s complete version: write the manifest beside it
        (without its sealed access) and let readers take it. A buffer of no region (empty) is ignored."""
        with self._lock:
            region = self._by_address.get(buffer.data_ptr()) if buffer.numel() else None
            if region is None:
                return
            side = region.path.with_name(region.path.name + MANIFEST_SUFFIX)
            tmp = side.with_name(side.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(encode(msgspec.structs.replace(manifest, sealed=None, delta=None)))
            os.replace(tmp, side)
            fcntl.flock(region.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Remove every buffer file (the directory itself belongs to whoever made it)."""
        with self._lock:
            for r in self._regions:
                r.close()
            self._regions.clear()
            self._by_address.clear()
