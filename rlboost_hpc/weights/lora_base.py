"""The base model of a LoRA run — one home for it: its identity, the node's cache of a base it had to pull, and where
an instance gets it (:func:`fetch_base`). The trainer (its base server, its reserved engines) and every rollout
instance call this module; nothing else computes a base's identity.

The base never changes during a run. Its identity is the whole-version checksum a weight holder would give it
(:func:`base_identity`: the tensors laid out and cast as a publish does, xxh3 per chunk, combined), so a node that
reads the base from ``model.path`` computes the same number the trainer's base server states, and any other bytes —
another checkpoint, a different dtype, a corrupt file — give another.

:class:`NodeBaseCache` keeps a pulled base on node-local disk so the node's later instances (a requeued job's next
attempt, the local cluster's next worker) load it instead of pulling it again. Invariants:
- One file per base, named by its checksum, written whole to a temporary name and renamed (a reader never sees a
  torn file); its manifest is written last, so a manifest on disk means a complete file.
- Never trusted: every read recomputes every chunk's checksum and the whole-version checksum against the manifest and
  the checksum asked for; anything else is deleted and reported as absent.
- Bounded: at most ``keep`` bases (the least recently used are deleted first), so what a run's instances leave on a
  node is at most ``keep`` bases, whichever attempt or run wrote them.

Where an instance gets the base (:func:`fetch_base`), in order: the model directory the trainer named
(``AdapterSpec.base_path``) when this node sees it — the shared filesystem every HPC node mounts, no network bytes —,
else the node's cache of a base pulled before (verified chunk by chunk), else one full pull from the trainer's base
server (checksummed and sealed like any version), kept in the node's cache for the node's later instances. Invariants:
- The base an instance serves has exactly the run's checksum (``AdapterSpec.base_checksum``), whatever the source.
- A model directory this node sees whose bytes are another base's is refused with :class:`BaseMismatch` naming the
  directory and both checksums — the instance then refuses to serve, it does not fall back to pulling: the node's
  view of the shared filesystem disagrees with the trainer's, and an operator must know.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Mapping

import torch

from rlboost_hpc.errors import BadInput
from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.protocol.adapter import EMULATED_BASE, AdapterSpec
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.protocol.errors import ProtocolError
from rlboost_hpc.protocol.weight_msgs import (MAX_MANIFEST_BYTES, Manifest, chunk_checksum, combine_checksums,
                                              decode_reply, encode, num_chunks, validate_manifest)
from rlboost_hpc.models import layout
from rlboost_hpc.weights.source import BaseWeights

__all__ = ["BaseMismatch", "NodeBaseCache", "base_identity", "default_cache_dir", "fetch_base", "model_base"]

log = logging.getLogger("rlboost.weights")


def base_identity(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, chunk_bytes: int) -> tuple[int, int]:
    """``(checksum, nbytes)`` of ``state_dict`` as a weight holder publishes it in ``dtype`` with ``chunk_bytes``
    chunks: the whole-version checksum of its flat wire buffer, and that buffer's size in bytes. Costs one cast-copy
    into a transient buffer and one xxh3 pass."""
    table, total = layout.plan(state_dict, dtype)
    buf = layout.host_buffer(total)
    layout.flatten_into(buf, state_dict, table)
    view = memoryview(buf.numpy())
    digests = [chunk_checksum(view[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(num_chunks(total, chunk_bytes))]
    return combine_checksums(digests), total


def model_base(state_dict: Mapping[str, torch.Tensor], arch: ModelArch, dtype: torch.dtype, chunk_bytes: int
               ) -> tuple[dict[str, torch.Tensor], int, int]:
    """A model's weights as the base of a LoRA run: ``(base, checksum, nbytes)`` — its canonical tensors (HF names,
    tied embeddings once: :func:`~rlboost_hpc.models.lora.canonical_base`) and their :func:`base_identity`. What the
    trainer checks an initial adapter against and what an instance that reads ``model.path`` compares with the run's."""
    from rlboost_hpc.models.lora import canonical_base

    base = canonical_base(state_dict, arch)
    checksum, nbytes = base_identity(base, dtype, chunk_bytes)
    return base, checksum, nbytes


def default_cache_dir() -> Path:
    """``$RLBOOST_NODE_CACHE``, else ``<tmp>/rlboost-node-cache-<uid>`` (node-local on a cluster's compute nodes)."""
    env = os.environ.get("RLBOOST_NODE_CACHE")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"rlboost-node-cache-{os.getuid()}"


class NodeBaseCache:
    """Bases pulled on this node, verified on every read (module docstring).

    Args:
        root: the cache directory (created owner-only on first store).
        keep: bases kept at most (≥ 1).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root).expanduser() if root else default_cache_dir()
        self.keep = int(keep)

    def _paths(self, checksum: int) -> tuple[Path, Path]:
        stem = self.root / f"base-{int(checksum):016x}"
        return stem.with_suffix(".bin"), stem.with_suffix(".manifest")

    def load(self, checksum: int) -> tuple[Manifest, torch.Tensor] | None:
        """The cached base of ``checksum`` as ``(manifest, uint8 buffer)``, verified chunk by chunk; None when absent,
        unreadable or not verified (a bad one is deleted)."""
        data, man = self._paths(checksum)
        if not man.is_file() or not data.is_file():
            return None
        try:
            m = decode_reply(man.read_bytes(), MAX_MANIFEST_BYTES)
            if not isinstance(m, Manifest) or m.checksum != int(checksum) or data.stat().st_size != m.total_bytes:
                raise ValueError("the manifest is not this base's")
            validate_manifest(m)
            buf = layout.host_buffer(m.total_bytes)
            with open(data, "rb", buffering=0) as f:
                if f.readinto(memoryview(buf.numpy())) != m.total_bytes:
                    raise ValueError("short read")
            view, cb = memoryview(buf.numpy()), m.chunk_bytes
            got = [chunk_checksum(view[i * cb:(i + 1) * cb]) for i in range(num_chunks(m.total_bytes, cb))]
            if got != list(m.chunk_checksums) or combine_checksums(got) != m.checksum:
                raise ValueError("a chunk does not match its checksum")
        except (OSError, ValueError, ProtocolError) as e:
            log.warning("node cache: base %016x at %s unusable (%s); removed", int(checksum), data, e)
            for p in (man, data):
                p.unlink(missing_ok=True)
            return None
        now = time.time()
        os.utime(man, (now, now))  # recently used: pruned last
        return m, buf

    def store(self, manifest: Manifest, buffer: torch.Tensor) -> Path:
        """Keep a pulled, verified base (``buffer``: its ``total_bytes`` wire bytes); then prune to ``keep``. Returns
        the data file. An error writing (a full disk) is logged and leaves no partial file; the caller goes on."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        data, man = self._paths(manifest.checksum)
        tmp = data.with_name(f".{data.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(buffer[: manifest.total_bytes].numpy()))
            tmp.replace(data)
            tmp_m = man.with_name(f".{man.name}.{os.getpid()}.tmp")
            tmp_m.write_bytes(encode(manifest))
            tmp_m.replace(man)
        except OSError as e:
            log.warning("node cache: could not keep base %016x in %s: %s", manifest.checksum, self.root, e)
            tmp.unlink(missing_ok=True)
            return data
        self.prune()
        return data

    def prune(self) -> list[Path]:
        """Delete all but the ``keep`` most recently used bases (and stray temporary files of dead writers). Returns
        the data files deleted."""
        if not self.root.is_dir():
            return []
        mans = sorted(self.root.glob("base-*.manifest"), key=lambda p: p.stat().st_mtime, reverse=True)
        gone = []
        for m in mans[self.keep:]:
            data = m.with_suffix(".bin")
            m.unlink(missing_ok=True)
            data.unlink(missing_ok=True)
            gone.append(data)
        for t in self.root.glob(".base-*.tmp"):
            pid = t.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not _alive(int(pid)):
                t.unlink(missing_ok=True)
        for data in self.root.glob("base-*.bin"):  # a data file whose manifest never came (its writer died)
            if not data.with_suffix(".manifest").exists() and time.time() - data.stat().st_mtime > 60:
                data.unlink(missing_ok=True)
        return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BaseMismatch(BadInput):
    """The base this instance could load is not the run's (or it can load none); the message says which and why."""


def fetch_base(spec: AdapterSpec, arch: ModelArch, *, keys: RunKeys | None, cache: NodeBaseCache, streams: int,
               window: int, timeout_s: float, label: str = "") -> BaseWeights:
    """The run's base for this node (module docstring for the order).

    Raises:
        BaseMismatch: the model directory this node sees holds another base (or cannot be read), or the base is
            neither there nor served by the trainer, or the trainer's base server sent a base of another checksum.
        WeightTransferError: the pull from the base server failed (the agent retries it).
    """
    from rlboost_hpc.models.hf_dir import read_state_dict

    t0 = time.monotonic()
    dtype = layout.dtype_from_name(spec.base_dtype)
    want = int(spec.base_checksum)
    if spec.base_path.startswith(EMULATED_BASE):  # a load test's base: the emulated engine models its load
        return BaseWeights({}, want, int(spec.base_bytes), "path")
    path = Path(spec.base_path) if spec.base_path else None
    if path is not None and path.is_dir():
        try:
            sd, got, nbytes = model_base(read_state_dict(path, arch, dtype=dtype), arch, dtype, spec.base_chunk_bytes)
        except (BadInput, KeyError, OSError) as e:
            raise BaseMismatch(f"the base model at {path} (model.path) on this node cannot be read: {e}") from None
        if got != want:
            raise BaseMismatch(f"the base model at {path} on this node has checksum {got:016x}; the run's base is "
                               f"{want:016x} ({spec.base_bytes} bytes as {spec.base_dtype}): this node sees another "
                               "model directory than the trainer (another version of the files); refusing to serve")
        return BaseWeights(sd, got, nbytes, "path", time.monotonic() - t0)
    held = cache.load(want)
    if held is not None:
        m, buf = held
        return BaseWeights(layout.state_view(buf, m.tensors), want, m.total_bytes, "cache", time.monotonic() - t0)
    if not spec.base_endpoint:
        raise BaseMismatch(f"the base model is not at {spec.base_path or '(no model.path)'} on this node and the "
                           "trainer serves no base: nothing to load")
    from rlboost_hpc.weights.puller import WeightPuller

    got = WeightPuller(spec.base_endpoint, streams=streams, window=window, timeout_s=timeout_s, keys=keys,
                       label=f"{label} (base)").pull(None)
    if int(got.checksum) != want:
        raise BaseMismatch(f"the trainer's base server {spec.base_endpoint} sent a base of checksum "
                           f"{int(got.checksum):016x}; the run's base is {want:016x}")
    cache.store(got.manifest, got.buffer)
    log.info("base %016x pulled from %s (%.1f MB in %.1fs) and kept in %s", want, spec.base_endpoint,
             got.nbytes / 1e6, time.monotonic() - t0, cache.root)
    return BaseWeights(got.state_dict, want, int(got.nbytes), "pull", time.monotonic() - t0,
                       int(got.phases.get("bytes_received", got.nbytes)))
