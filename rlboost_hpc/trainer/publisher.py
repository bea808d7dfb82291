"""The run's side of weight versions: one owner for how a version leaves the trainer and how the trainer process
reads a version back.

Two ways a version is served, chosen once from the backend:

- **gathered** (every single-process backend, and a model-parallel one with ``weights.sharded = false``): the run's
  own :class:`~rlboost_hpc.weights.server.WeightServer` publishes ``backend.export_weights()`` — on a model-parallel
  backend that export is a gather of every rank's pieces on rank 0;
- **sharded** (``backend.shard_manifest`` is set: Megatron with TP or PP > 1): every holder rank publishes its own
  pieces into its own server (``backend.publish_shards``), instances pull from all holders in parallel
  (:func:`rlboost_hpc.weights.sharded.pull_sharded`) — no gather; the run's server stays idle.

Invariant: the checksum :meth:`WeightPublisher.publish` returns for a version is the one every rollout instance
reports after loading it (the whole-version checksum, or :func:`~rlboost_hpc.weights.sharded.version_checksum` of a
sharded version — in a LoRA run either one combined with the base's,
:func:`~rlboost_hpc.protocol.adapter.adapter_version_checksum`), so the manager's check is the same either way.

LoRA (``adapter``): a version is the backend's adapter; the base is published once by the run's base server and, for
this process's own reserved engine, handed over as it is in memory (:meth:`WeightPublisher.base`).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.adapter import EMULATED_BASE, AdapterSpec
from rlboost_hpc.protocol.version import VersionId
from rlboost_hpc.weights.source import BaseWeights, PulledVersion, identity
from rlboost_hpc.trainer.backends.base import TrainerBackend
from rlboost_hpc.weights import sharded
from rlboost_hpc.weights.puller import WeightTransferError, lineage_mismatch
from rlboost_hpc.weights.server import WeightServer

__all__ = ["Published", "WeightPublisher"]


@dataclass(frozen=True)
class Published:
    """One published version: its identity (the checksum every instance that loads it reports), the seconds it took
    (``export_s``: the gather or view of the weights, 0 when sharded; ``publish_s``: all of it), and its size in bytes
    (``weight_update_bytes``: what an instance holding the previous version moves, a delta's payload)."""

    version: VersionId
    publish_s: float
    export_s: float
    weight_bytes: int
    weight_update_bytes: int

    def record(self) -> dict[str, Any]:
        """The step record's and the report's entry (``weight_checksum`` for the identity's checksum)."""
        return {"publish_s": self.publish_s, "export_s": self.export_s, "weight_bytes": self.weight_bytes,
                "weight_checksum": self.version.checksum, "weight_update_bytes": self.weight_update_bytes}


class WeightPublisher:
    """Publishes the trainer's weight versions and reads them back for the trainer's own process.

    Args:
        server: the run's weight server (serves gathered versions; idle when the backend serves shards).
        backend: the trainer backend (``export_weights``; ``shard_manifest``/``publish_shards``/``shard_stats``).
        dtype: wire dtype of floating-point tensors (gathered path; the backend's shards carry their own).
        client_keys: the run's CURVE client keys, to pull sharded versions back (None: plain TCP).
        streams, window, timeout_s: per-holder puller settings for those pulls.
        adapter / base_state: a LoRA run's adapter spec and its base (HF-named tensors, the trainer's own).
    """

    def __init__(self, server: WeightServer, backend: TrainerBackend, dtype: torch.dtype, *,
                 client_keys: Any = None, streams: int = D.WEIGHT_STREAMS, window: int = D.WEIGHT_WINDOW,
                 timeout_s: float = D.PULL_TIMEOUT_S, adapter: AdapterSpec | None = None,
                 base_state: Any = None) -> None:
        self.adapter, self.base_state = adapter, base_state
        self.server = server
        self.backend = backend
        self.dtype = dtype
        self.shards: dict | None = backend.shard_manifest
        self._pull_kw = dict(streams=streams, window=window, timeout_s=timeout_s, keys=client_keys)
        self.history: list[Published] = []
        self._lock = threading.Lock()
        self._bases: dict | None = None  # the followed sharded version, per holder position

    @property
    def shards_json(self) -> str:
        """The assembly manifest as JSON for the manager's ``TrainerHello`` ("" when versions are gathered)."""
        return json.dumps(self.shards) if self.shards else ""

    def publish(self, version: int) -> Published:
        """Publish ``version``; returns (and appends to :attr:`history`) what was published. Raises what the backend
        or the server raise (ValueError for a non-increasing version)."""
        t0 = time.monotonic()
        if self.shards:
            res = self.backend.publish_shards(version)
            t_export, checksum = 0.0, int(res["checksum"])
            nbytes, update = int(res["bytes"]), int(res["update_bytes"])
        else:
            exported = self.backend.export_weights()
            t_export = time.monotonic() - t0
            man = self.server.publish(version, exported, dtype=self.dtype)
            delta = self.server.delta_nbytes(version)
            checksum, nbytes = int(man.checksum), int(man.total_bytes)
            update = nbytes if delta is None else int(delta)
        p = Published(VersionId(version, identity(checksum, self.adapter)),  # a LoRA version: the adapter on this base
                      time.monotonic() - t0, t_export, nbytes, update)
        self.history.append(p)
        return p

    def read(self, version: int, *, follow: bool = False) -> PulledVersion:
        """A published ``version`` for this process (the reserved engine, evaluation, the exported model): HF-named
        tensors that are views of the server's buffer, or — sharded — a parallel pull from every holder over
        loopback (verified like any instance's pull), with its checksum, size and seconds taken.

        ``follow``: the caller reads each version only until it asks for the next (an engine that copies what it
        loads): the sharded pull then starts from the previous one (a delta per holder, buffers reused) instead
        of moving the whole model each time. One caller may follow; calls are serialised.

        Raises:
            KeyError: (gathered) the version is not held. WeightTransferError: (sharded) a holder's pull failed.
        """
        t0 = time.monotonic()
        if not self.shards:
            m = self.server.manifest(version)
            return PulledVersion(self.server.local_state_dict(version), int(m.checksum), int(m.total_bytes),
                                 time.monotonic() - t0)
        with self._lock:
            bases, self._bases = (self._bases, None) if follow else (None, self._bases)
            sd, st = sharded.pull_sharded(self.shards, version, label="trainer", bases=bases, **self._pull_kw)
            if follow:
                self._bases = st["pulled"]
        return PulledVersion(sd, int(st["checksum"]), int(st["bytes"]), time.monotonic() - t0,
                             int(st["bytes_received"]))

    def base(self, spec: AdapterSpec, arch: Any, *, keys: Any = None, label: str = "") -> BaseWeights:
        """The reserved engine's base in a LoRA run: the trainer's own tensors (no copy, no bytes moved).

        Raises:
            RuntimeError: this publisher has no base (not a LoRA run)."""
        if self.adapter is None or (self.base_state is None and not self.adapter.base_path.startswith(EMULATED_BASE)):
            raise RuntimeError("no base model: not a LoRA run")
        return BaseWeights(self.base_state or {}, self.adapter.base_checksum, self.adapter.base_bytes, "trainer")

    def pull(self, endpoint: str, version: int, *, peers: Sequence[str] = (), keys: Any = None,
             shards: str = "", checksum: int = 0, adapter: AdapterSpec | None = None) -> PulledVersion:
        """The reserved engine's weight source (a rollout ``WeightSource``): :meth:`read` with ``follow`` — the
        trainer's own versions, whatever holder, peers, keys or manifest the manager names.

        Raises:
            WeightTransferError: ``checksum`` (not 0) is not the published version's (the manager announced another
                lineage's version of that number); as :meth:`read`.
        """
        got = self.read(version, follow=True)
        held = identity(got.checksum, adapter)
        if checksum and held != checksum:
            raise WeightTransferError("manifest", "trainer", version, lineage_mismatch(version, held, checksum))
        return got

    def served(self) -> dict:
        """What the trainer side sent: ``{"bytes_served", "delta_bytes_served", "sealed_bytes_served"}`` (the
        last: of both, what went sealed instead of over CURVE) of the run's server plus, when
        sharded, every holder's ``bytes_served`` and ``shards = {"holders": the backend's shard_stats() (a
        collective), "gathered_exports": export_weights() calls that gathered on rank 0}`` (``shards`` None
        otherwise)."""
        st = self.server.stats
        out = {"bytes_served": int(st["bytes_served"]), "delta_bytes_served": int(st["delta_bytes_served"]),
               "sealed_bytes_served": int(st["sealed_bytes_served"]), "shards": None}
        if self.shards:
            holders = self.backend.shard_stats()
            out["shards"] = {"holders": holders, "gathered_exports": int(self.backend.gathered_exports)}
            out["bytes_served"] += sum(h["bytes_served"] for h in holders)
            out["delta_bytes_served"] += sum(h.get("delta_bytes_served", 0) for h in holders)
            out["sealed_bytes_served"] += sum(h.get("sealed_bytes_served", 0) for h in holders)
        return out
