"""Which engine a rollout worker builds: the run's engine spec (``endpoints.json`` → ``engine``) → an EngineFactory.

Invariant: the spec is plain JSON written by the trainer from ``rollout.engine`` / ``rollout.sglang`` (config.py),
so local workers and Slurm rollout jobs build the same engine without any per-job flag; an unknown engine kind or
option is an :class:`EngineError` naming it, raised before the worker registers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from rlboost_hpc.rollout.engines.base import Engine, EngineError

# (the model's config.json, the first pulled state dict, arch=the trainer's parsed ModelArch or None) -> Engine
EngineFactory = Callable[..., Engine]
_SGLANG_KEYS = {"python", "stream_interval", "startup_timeout_s", "env", "extra_args"}


def torch_engine_factory(max_batch: int, device: str = "auto", dtype: str = "auto") -> EngineFactory:
    """Build a :class:`TorchEngine` from the run's model (the architecture the trainer parsed, else its
    ``config.json`` read here) and the first pulled weights, on ``device`` / ``dtype``
    (``rlboost_hpc.models.device``; resolved when the engine is built, in the process that runs it).

    The engine raises :class:`EngineError` for a model the project does not support or an unavailable device.
    """

    def make(model_config: dict, state_dict: Mapping, arch=None) -> Engine:
        from rlboost_hpc.models.arch import ModelFormatError, arch_from_hf
        from rlboost_hpc.models.device import DeviceError, resolve_device, resolve_dtype
        from rlboost_hpc.rollout.engines.torch_engine import TorchEngine

        try:
            arch = arch or arch_from_hf(model_config, name="the run's model config")
            dev = resolve_device(device, "rollout.device")
            dt = resolve_dtype(dtype, dev, "rollout.dtype")
        except (ModelFormatError, DeviceError) as e:
            raise EngineError(str(e)) from None
        return TorchEngine(arch, state_dict, max_batch=max_batch, device=dev, dtype=dt)

    return make


def engine_spec(cfg) -> dict[str, Any]:
    """The JSON spec of ``cfg.rollout`` (a :class:`rlboost_hpc.config.RolloutCfg`) for ``endpoints.json``:
    the engine kind, its device and dtype, and the SGLang server options."""
    spec: dict[str, Any] = {"kind": cfg.engine, "device": cfg.device, "dtype": cfg.dtype}
    if cfg.engine == "sglang":
        spec["sglang"] = cfg.sglang.model_dump()
    return spec


def factory_from_spec(spec: Mapping[str, Any] | None, max_batch: int, *,
                      log_path: str | Path | None = None) -> EngineFactory:
    """An EngineFactory for ``spec`` (``None`` or ``{"kind": "torch"}``: the torch engine).

    ``{"kind": "sglang", "sglang": {...}}`` starts one SGLang server per engine (its log at ``log_path``),
    with the weights the agent pulled first; the server's start-up (seconds to a minute) runs on the agent's
    build thread, never on its heartbeat loop.

    Raises:
        EngineError: unknown kind or unknown sglang option.
    """
    kind = (spec or {}).get("kind", "torch")
    device, dtype = (spec or {}).get("device", "auto"), (spec or {}).get("dtype", "auto")
    if kind == "torch":
        return torch_engine_factory(max_batch, device, dtype)
    if kind != "sglang":
        raise EngineError(f"unknown rollout engine {kind!r} in the run's engine spec (expected 'torch' or 'sglang')")
    opts = dict((spec or {}).get("sglang") or {})
    unknown = set(opts) - _SGLANG_KEYS
    if unknown:
        raise EngineError(f"unknown sglang engine option(s) {sorted(unknown)}; known: {sorted(_SGLANG_KEYS)}")
    from rlboost_hpc.rollout.engines.sglang_engine import sglang_engine_factory

    launch = {k: v for k, v in opts.items() if v is not None}
    launch.update(device=device, dtype=dtype)
    if log_path is not None:
        launch["log_path"] = str(log_path)
    return sglang_engine_factory(max_batch, **launch)
