"""Where a rollout instance of a LoRA run gets the base model: once per instance, before its first adapter.

Order (:func:`fetch_base`): the model directory the trainer named (``AdapterSpec.base_path``) when this node sees it
— the shared filesystem every HPC node mounts, no network bytes —, else the node's cache of a base pulled before
(:class:`~rlboost_hpc.weights.base.NodeBaseCache`, verified chunk by chunk), else one full pull from the trainer's base
server (checksummed and sealed like any version), kept in the node's cache for the node's later instances.

Invariants:
- The base an instance serves has exactly the run's checksum (``AdapterSpec.base_checksum``), whatever the source.
- A model directory this node sees whose bytes are another base's is refused with :class:`BaseMismatch` naming the
  directory and both checksums — the instance then refuses to serve, it does not fall back to pulling: the node's
  view of the shared filesystem disagrees with the trainer's, and an operator must know.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from rlboost_hpc.errors import BadInput
from rlboost_hpc.models.arch import ModelArch
from rlboost_hpc.protocol.adapter import EMULATED_BASE, AdapterSpec
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.weights import layout
from rlboost_hpc.weights.base import NodeBaseCache, base_identity

__all__ = ["BaseMismatch", "BaseWeights", "fetch_base"]

log = logging.getLogger("rlboost.agent")


class BaseMismatch(BadInput):
    """The base this instance could load is not the run's (or it can load none); the message says which and why."""


@dataclass(frozen=True)
class BaseWeights:
    """The base an instance loaded: its HF-named tensors (views of one buffer, or the trainer's own tensors), its
    checksum and wire bytes, where it came from (``"path"``, ``"cache"``, ``"pull"`` or ``"trainer"``), the seconds
    it took and the bytes received over the network for it (0 unless pulled)."""

    state_dict: Mapping[str, torch.Tensor]
    checksum: int
    nbytes: int
    source: str
    seconds: float = 0.0
    wire_bytes: int = 0


def fetch_base(spec: AdapterSpec, arch: ModelArch, *, keys: RunKeys | None, cache: NodeBaseCache, streams: int,
               window: int, timeout_s: float, label: str = "") -> BaseWeights:
    """The run's base for this node (module docstring for the order).

    Raises:
        BaseMismatch: the model directory this node sees holds another base (or cannot be read), or the base is
            neither there nor served by the trainer, or the trainer's base server sent a base of another checksum.
        WeightTransferError: the pull from the base server failed (the agent retries it).
    """
    from rlboost_hpc.models.hf_dir import read_state_dict
    from rlboost_hpc.models.lora import canonical_base

    t0 = time.monotonic()
    dtype = layout.dtype_from_name(spec.base_dtype)
    want = int(spec.base_checksum)
    if spec.base_path.startswith(EMULATED_BASE):  # a load test's base: the emulated engine models its load
        return BaseWeights({}, want, int(spec.base_bytes), "path")
    path = Path(spec.base_path) if spec.base_path else None
    if path is not None and path.is_dir():
        try:
            sd = canonical_base(read_state_dict(path, arch, dtype=dtype), arch)
        except (BadInput, KeyError, OSError) as e:
            raise BaseMismatch(f"the base model at {path} (model.path) on this node cannot be read: {e}") from None
        got, nbytes = base_identity(sd, dtype, spec.base_chunk_bytes)
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
