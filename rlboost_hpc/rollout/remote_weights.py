"""Weight versions for a rollout agent from the run's weight holders: pulls that keep the last version as the
base of the next (a delta, or a buffer reused in place), relay serving of the held version to peers, and sharded
versions pulled from every trainer holder in parallel.

Invariants: a pull's base is the version this process pulled last and no longer reads (the agent's engine copies
what it loads); the relay serves exactly the held, verified version and withdraws it before the base is reused.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.weights.lora_base import NodeBaseCache, fetch_base
from rlboost_hpc.weights.source import BaseWeights, PulledVersion, identity

if TYPE_CHECKING:
    import torch

    from rlboost_hpc.models.arch import ModelArch


class RemoteWeights:
    """Pulls weight versions for one rollout worker, keeping the last one as the base of the next (delta) pull.

    One object per worker process, across reconnects to restarted trainers (a :class:`WeightSource`: each
    :meth:`pull` names the holder's endpoint and the run's keys). With ``keep_base`` the version last pulled stays in host
    memory (one copy of the model in the wire dtype, e.g. 2 bytes per parameter in bf16) and is offered to the
    holder; a holder with a delta against exactly that version ships only the changed chunks, and the base's
    buffer is turned into the new version in place (``WeightPuller.pull(base=...)``). Without it every pull is
    full and nothing is kept after the engine loaded it.

    Relay (:meth:`serve_relay`): the version last pulled is also served to other instances from the same buffer
    (a :class:`~rlboost_hpc.weights.server.WeightServer` that only holds it: no copy, no hashing), withdrawn
    before the next pull starts to change that buffer; pulls take the peers the manager names.

    Precondition (held by :class:`~rlboost_hpc.rollout.agent.RolloutAgent`): a version's tensors are no longer read once the next pull
    starts — engines copy what they load.
    """

    def __init__(self, streams: int, window: int, timeout_s: float, *, keep_base: bool = True,
                 peer_timeout_s: float | None = None,
                 buffer_factory: "Callable[[int], torch.Tensor] | None" = None,
                 base_cache: NodeBaseCache | None = None) -> None:
        self.streams, self.window, self.timeout_s = streams, window, timeout_s
        self.base_cache = base_cache or NodeBaseCache()  # where a LoRA run's pulled base stays on this node
        self.keep_base = keep_base
        self.peer_timeout_s = peer_timeout_s
        self.buffer_factory = buffer_factory  # of WeightPuller: where a pull that reuses no base lands
        self._base = None  # PulledWeights of the last successful pull (keep_base only)
        self._shard_bases: dict | None = None  # ... of a sharded version: position → PulledWeights
        self._relay = None  # WeightServer serving self._base (serve_relay)
        self._relay_keys: RunKeys | None = None

    def serve_relay(self, bind_host: str, advertise_host: str, keys: RunKeys | None = None) -> str:
        """Serve the versions this worker pulls to other instances; returns the endpoint to register with.

        ``keys``: the run's full key set (a relay is a CURVE *server* of the run: pullers prove the run's client
        key, as with the trainer). Called again with other keys (a restarted trainer's run), the relay restarts
        on them. Raises zmq.ZMQError when ``bind_host`` cannot be bound.
        """
        from rlboost_hpc.rundir import advertised
        from rlboost_hpc.weights.server import WeightServer

        if self._relay is not None and self._relay_keys != keys:
            self._relay.close()
            self._relay = None
        if self._relay is None:
            self._relay = WeightServer(bind=f"tcp://{bind_host}:0", keep_versions=1, delta=False, keys=keys).start()
            self._relay_keys = keys
            if self._base is not None and self._base.manifest is not None:
                self._relay.hold(self._base.manifest, self._base.buffer, self._base.delta_payloads)
        return advertised(self._relay.endpoint, advertise_host)

    @property
    def relay_stats(self) -> dict:
        """The relay server's counters (chunks and bytes served to peers); empty without a relay."""
        return self._relay.stats if self._relay is not None else {}

    def close(self) -> None:
        """Stop the relay server (if any)."""
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def base(self, spec: AdapterSpec, arch: "ModelArch", *, keys: RunKeys | None = None,
             label: str = "") -> BaseWeights:
        """The run's base (LoRA): ``model.path`` on this node, else this node's cache, else one pull from the trainer's
        base server kept in the cache (:func:`~rlboost_hpc.weights.lora_base.fetch_base`)."""
        return fetch_base(spec, arch, keys=keys, cache=self.base_cache, streams=self.streams, window=self.window,
                          timeout_s=self.timeout_s, label=label)

    def pull(self, endpoint: str, version: int, *, peers: Sequence[str] = (), keys: RunKeys | None = None,
             shards: str = "", checksum: int = 0, adapter: AdapterSpec | None = None) -> PulledVersion:
        """Pull ``version`` from the holder at ``endpoint`` (CURVE client ``keys`` of its run; through relay
        ``peers``), or — with ``shards``, the assembly manifest of a sharded version (JSON) — from every trainer
        holder in parallel (:func:`rlboost_hpc.weights.sharded.pull_sharded`; the base is kept per holder; no
        relay). The base of the previous pull is consumed whatever the outcome. ``checksum`` (not 0): the identity
        the version must have (the manager's word for it; with ``adapter``, a LoRA run's:
        :func:`~rlboost_hpc.weights.source.identity`).

        Raises WeightTransferError for a failed pull (also a version of another ``checksum``), ValueError for an
        unreadable ``shards`` manifest."""
        if shards:
            return self._pull_sharded(shards, version, keys, checksum, adapter)
        from rlboost_hpc.weights.puller import WeightPuller

        t0 = time.monotonic()
        if self._relay is not None:
            self._relay.withdraw()  # the buffer it serves is about to change
        base, self._base, self._shard_bases = self._base, None, None
        got = WeightPuller(endpoint, streams=self.streams, window=self.window, timeout_s=self.timeout_s,
                           keys=keys, peer_timeout_s=self.peer_timeout_s,
                           buffer_factory=self.buffer_factory).pull(version, base=base, peers=list(peers),
                                                                    checksum=checksum, adapter=adapter)
        if self.keep_base or self._relay is not None:
            self._base = got
        if self._relay is not None:
            self._relay.hold(got.manifest, got.buffer, got.delta_payloads)
        return PulledVersion(got.state_dict, int(got.checksum), int(got.nbytes), time.monotonic() - t0,
                             int(got.phases.get("bytes_received", 0)), got.phases)

    def _pull_sharded(self, shards: str, version: int, keys: RunKeys | None, checksum: int = 0,
                      adapter: AdapterSpec | None = None) -> PulledVersion:
        from rlboost_hpc.weights.puller import WeightTransferError, lineage_mismatch
        from rlboost_hpc.weights.sharded import load_manifest, pull_sharded

        manifest = load_manifest(shards)
        t0 = time.monotonic()
        if self._relay is not None:
            self._relay.withdraw()  # it serves single-buffer versions only
        bases, self._base, self._shard_bases = self._shard_bases, None, None
        sd, st = pull_sharded(manifest, version, streams=self.streams, window=self.window,
                              timeout_s=self.timeout_s, keys=keys, bases=bases)
        got = identity(int(st["checksum"]), adapter)
        if checksum and got != checksum:  # (the bases stay dropped: another lineage's bytes)
            raise WeightTransferError("verify", "sharded holders", version, lineage_mismatch(version, got, checksum))
        if self.keep_base:
            self._shard_bases = st["pulled"]
        return PulledVersion(sd, int(st["checksum"]), int(st["bytes"]), time.monotonic() - t0,
                             int(st["bytes_received"]))
