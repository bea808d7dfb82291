"""The worker spec: every rollout setting a rollout worker needs, written once by the trainer into the run's
``endpoints.json`` (key ``worker``) and read by every worker — local-cluster processes and Slurm rollout jobs
alike — so a setting in the run's config reaches all of them and none is silently ignored.

Invariants:
- One source: :meth:`WorkerSpec.from_config` is the only translation from the run config; a worker builds its
  engine, weight puller and agent from the spec alone (command-line flags exist only to override it by hand and
  are logged when they do).
- Strict: unknown keys, a missing key or a wrong type in ``endpoints.json`` raise :class:`WorkerSpecError`
  naming the file and the key (a worker then exits 2 before it registers).
"""
from __future__ import annotations

from typing import Any, Mapping

import msgspec

from rlboost_hpc import defaults as D
from rlboost_hpc.errors import BadInput


class WorkerSpecError(BadInput, ValueError):
    """``endpoints.json``'s ``worker`` section is malformed; the message names the key."""


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every rollout setting of a worker (units in the names: seconds ``_s``; counts otherwise).

    Attributes:
        engine: the engine spec (``rollout/engines/factory.py``: kind, device, dtype, SGLang options).
        max_batch: engine batch slots (``rollout.max_batch``).
        torch_threads: torch intra-op threads of the worker process (``rollout.torch_threads``).
        weight_streams / weight_window / pull_timeout_s: the weight puller (``weights.streams``, ``weights.window``,
            ``weights.pull_timeout_s``).
        weight_delta: keep the last pulled version as the base of delta pulls (``weights.delta``).
        weight_relay / relay_wait_s / relay_timeout_s: serve the versions it holds to other instances, wait for relay
            capacity at most that long, abandon a silent peer after that long (``weights.relay*``).
        relay_bind_host: the interface the relay server binds (``network.bind_host``; 0.0.0.0 → advertised by host
            name).
        base_cache_dir / base_cache_keep: where a node keeps a LoRA run's pulled base and how many bases at most
            (``trainer.lora.node_cache_dir`` — "" for the default — and ``node_cache_keep``).
    """

    engine: dict[str, Any] = msgspec.field(default_factory=lambda: {"kind": "torch"})
    max_batch: int = D.MAX_BATCH
    torch_threads: int = 1
    weight_streams: int = D.WEIGHT_STREAMS
    weight_window: int = D.WEIGHT_WINDOW
    pull_timeout_s: float = D.PULL_TIMEOUT_S
    weight_delta: bool = True
    weight_relay: bool = False
    relay_wait_s: float = D.RELAY_WAIT_S
    relay_timeout_s: float = D.RELAY_TIMEOUT_S
    relay_bind_host: str = "127.0.0.1"
    base_cache_dir: str = ""
    base_cache_keep: int = 2

    @classmethod
    def from_config(cls, cfg, context_tokens: int | None = None) -> "WorkerSpec":
        """The spec of a run config (:class:`rlboost_hpc.config.RunConfig`); ``context_tokens``: the positions one
        request may need (the run's longest prompt + response budget), what an engine's KV cache is sized for."""
        from rlboost_hpc.rollout.engines.factory import engine_spec

        return cls(engine=engine_spec(cfg.rollout, context_tokens), max_batch=cfg.rollout.max_batch,
                   torch_threads=cfg.rollout.torch_threads, weight_streams=cfg.weights.streams,
                   weight_window=cfg.weights.window, pull_timeout_s=cfg.weights.pull_timeout_s,
                   weight_delta=cfg.weights.delta, weight_relay=cfg.weights.relay,
                   relay_wait_s=cfg.weights.relay_wait_s, relay_timeout_s=cfg.weights.relay_timeout_s,
                   relay_bind_host=cfg.network.bind_host, base_cache_dir=cfg.trainer.lora.node_cache_dir or "",
                   base_cache_keep=cfg.trainer.lora.node_cache_keep)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON for ``endpoints.json``."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, where: str = "endpoints.json") -> "WorkerSpec":
        """Parse the ``worker`` section (``None``: an older trainer wrote none → the defaults).

        Raises:
            WorkerSpecError: unknown or missing key, wrong type, or a count < 1 / a timeout <= 0.
        """
        if data is None:
            return cls()
        try:
            spec = msgspec.convert(dict(data), cls)
        except (msgspec.ValidationError, TypeError) as e:
            raise WorkerSpecError(f"{where}: worker: {e}") from None
        for key in ("max_batch", "torch_threads", "weight_window", "base_cache_keep"):
            if getattr(spec, key) < 1:
                raise WorkerSpecError(f"{where}: worker.{key} must be >= 1, got {getattr(spec, key)}")
        if spec.weight_streams < 0:
            raise WorkerSpecError(f"{where}: worker.weight_streams must be >= 0 (0: automatic), got {spec.weight_streams}")
        if not spec.pull_timeout_s > 0:
            raise WorkerSpecError(f"{where}: worker.pull_timeout_s must be > 0, got {spec.pull_timeout_s}")
        return spec
