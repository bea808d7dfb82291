"""Which engine a rollout worker builds: the run's engine spec (``endpoints.json`` → ``engine``) → an EngineFactory.

Invariant: the spec is plain JSON written by the trainer from ``rollout.engine`` / ``rollout.sglang`` (config.py),
so local workers and Slurm rollout jobs build the same engine without any per-job flag; an unknown engine kind or
option is an :class:`EngineError` naming it, raised before the worker registers.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from rlboost_hpc import defaults as D
from rlboost_hpc.rollout.engines.base import Engine, EngineError

if TYPE_CHECKING:
    import torch

    from rlboost_hpc.rollout.engines.sglang_engine import SGLangEngine

#: Whether an engine kind (``rollout.engine``) returns the behaviour logprob of every token it samples (what
#: ``trainer.behaviour_correction`` needs): the torch engine computes log_softmax(logits / T) of each sampled token;
#: the SGLang engine asks its server for ``return_logprob`` and refuses a stream without them; the emulated engine's
#: logprobs are a function of (seed, position), not of any policy.
BEHAVIOUR_LOGPROBS = {"torch": True, "sglang": True, "emulated": False}


def returns_behaviour_logprobs(kind: str) -> bool:
    """:data:`BEHAVIOUR_LOGPROBS` of ``kind`` (False for a kind it does not list)."""
    return BEHAVIOUR_LOGPROBS.get(kind, False)


# (the model's config.json, the first pulled state dict — a LoRA run's base —, arch=the trainer's parsed ModelArch or
# None, adapter=a LoRA run's AdapterSpec or None) -> Engine
EngineFactory = Callable[..., Engine]
_SGLANG_KEYS = {"python", "stream_interval", "startup_timeout_s", "env", "extra_args"}


def torch_engine_factory(max_batch: int, device: str = "auto", dtype: str = "auto",
                         max_len: int | None = None) -> EngineFactory:
    """Build a :class:`TorchEngine` from the run's model (the architecture the trainer parsed, else its
    ``config.json`` read here) and the first pulled weights, on ``device`` / ``dtype``
    (``rlboost_hpc.models.device``; resolved when the engine is built, in the process that runs it), with KV-cache
    room for ``max_len`` positions per request (the run's longest prompt + response budget; ``None``: the model's
    whole context — 40,960 positions for Qwen3, hundreds of GB of cache at batch 64).

    The engine raises :class:`EngineError` for a model the project does not support or an unavailable device. With
    ``adapter`` (a LoRA run) the state dict is the base and the engine serves adapter versions on it.
    """

    def make(model_config: dict, state_dict: Mapping, arch=None, adapter=None) -> Engine:
        from rlboost_hpc.models.arch import ModelFormatError, arch_from_hf
        from rlboost_hpc.models.device import DeviceError, resolve_device, resolve_dtype
        from rlboost_hpc.rollout.engines.torch_engine import TorchEngine

        try:
            arch = arch or arch_from_hf(model_config, name="the run's model config")
            dev = resolve_device(device, "rollout.device")
            dt = resolve_dtype(dtype, dev, "rollout.dtype")
        except (ModelFormatError, DeviceError) as e:
            raise EngineError(str(e)) from None
        ctx = arch.max_position_embeddings if max_len is None else min(max_len, arch.max_position_embeddings)
        return TorchEngine(arch, state_dict, max_batch=max_batch, max_len=ctx, device=dev, dtype=dt, adapter=adapter)

    return make


def engine_spec(cfg, max_len: int | None = None) -> dict[str, Any]:
    """The JSON spec of ``cfg.rollout`` (a :class:`rlboost_hpc.config.RolloutCfg`) for ``endpoints.json``:
    the engine kind, its device and dtype, the positions one request may need (``max_len``: the run's longest
    prompt + response budget; absent: the model's context), and the SGLang server options."""
    spec: dict[str, Any] = {"kind": cfg.engine, "device": cfg.device, "dtype": cfg.dtype}
    if max_len is not None:
        spec["max_len"] = int(max_len)
    if cfg.engine == "sglang":
        spec["sglang"] = cfg.sglang.model_dump()
    elif cfg.engine == "emulated":
        spec["emulated"] = cfg.emulated.model_dump()
    return spec


def receive_buffer_factory(spec: Mapping[str, Any] | None) -> "Callable[[int], torch.Tensor] | None":
    """Where a rollout worker running ``spec``'s engine pulls weight versions (``WeightPuller(buffer_factory=)``):
    shared memory for SGLang, whose server process then loads the pulled bytes without a copy
    (:func:`~rlboost_hpc.rollout.engines.sglang_weights.shared_host_buffer`); for the in-process torch engine on a
    GPU, pinned host buffers (a :class:`~rlboost_hpc.models.layout.HostBufferPool` that registers its mappings
    with CUDA once: the engine's host-to-device load then runs at the link's rate, not through the driver's
    staging copy); None — the puller's default private host buffer — for the torch engine on the CPU (or a
    device the spec names but this host lacks: the engine's build reports that) and for the emulated engine."""
    if (spec or {}).get("kind") == "emulated":
        return None
    if (spec or {}).get("kind", "torch") != "sglang":
        from rlboost_hpc.models.device import DeviceError, resolve_device
        from rlboost_hpc.models.layout import HostBufferPool

        try:
            on_gpu = resolve_device(str((spec or {}).get("device", "auto"))).type == "cuda"
        except DeviceError:
            return None
        return HostBufferPool(2, pin_memory=True).take if on_gpu else None
    from rlboost_hpc.rollout.engines.sglang_weights import shared_host_buffer

    return shared_host_buffer


def factory_from_spec(spec: Mapping[str, Any] | None, max_batch: int, *,
                      log_path: str | Path | None = None, instance_id: str = "") -> EngineFactory:
    """An EngineFactory for ``spec`` (``None`` or ``{"kind": "torch"}``: the torch engine).

    ``{"kind": "emulated", "emulated": {...}}`` builds emulated engines
    (:class:`~rlboost_hpc.rollout.engines.emulated.EmulatedEngine`) at the GPU speed ``instance_id`` is given.
    ``{"kind": "sglang", "sglang": {...}}`` starts one SGLang server per engine (its log at ``log_path``),
    with the weights the agent pulled first; the server's start-up (seconds to a minute) runs on the agent's
    build thread, never on its heartbeat loop.

    Raises:
        EngineError: unknown kind or unknown sglang / emulated option.
    """
    kind = (spec or {}).get("kind", "torch")
    device, dtype = (spec or {}).get("device", "auto"), (spec or {}).get("dtype", "auto")
    if kind == "torch":
        return torch_engine_factory(max_batch, device, dtype, (spec or {}).get("max_len"))
    if kind == "emulated":
        from rlboost_hpc.rollout.engines.emulated import emulated_engine_factory

        opts = dict((spec or {}).get("emulated") or {})
        return emulated_engine_factory(max_batch, (spec or {}).get("max_len"), instance_id=instance_id, **opts)
    if kind != "sglang":
        raise EngineError(f"unknown rollout engine {kind!r} in the run's engine spec "
                          "(expected 'torch', 'sglang' or 'emulated')")
    opts = dict((spec or {}).get("sglang") or {})
    unknown = set(opts) - _SGLANG_KEYS
    if unknown:
        raise EngineError(f"unknown sglang engine option(s) {sorted(unknown)}; known: {sorted(_SGLANG_KEYS)}")
    launch = {k: v for k, v in opts.items() if v is not None}
    launch.update(device=device, dtype=dtype)
    if log_path is not None:
        launch["log_path"] = str(log_path)
    return sglang_engine_factory(max_batch, **launch)


def make_sglang_engine(model_config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor] | None,
                       max_batch: int = D.MAX_BATCH, *, work_dir: str | os.PathLike[str] | None = None, version: int = 0,
                       adapter=None, **launch_kw) -> "SGLangEngine":
    """Build an :class:`SGLangEngine` the way the rollout agent builds engines: write the manager's HF config and
    the first pulled weights to ``work_dir`` (default: a temp dir), launch a supervised server on them.

    ``state_dict=None`` starts the server on random weights (``--load-format dummy``, no weight file) so it
    can boot while the first version is still being pulled; the engine is then FENCED (``version == -1``,
    :meth:`SGLangEngine.add` refused) until :meth:`SGLangEngine.load_weights` succeeds.

    ``launch_kw`` go to :meth:`SGLangEngine.launch` / :class:`SGLangServer` (``device``, ``dtype``,
    ``stream_interval``, ``deterministic``, ``startup_timeout_s``, ``log_path``, ``env``, ``python``, …).

    ``adapter`` (a LoRA run's :class:`~rlboost_hpc.protocol.adapter.AdapterSpec`): ``state_dict`` is the base, the
    server is launched with LoRA on (:func:`~rlboost_hpc.rollout.engines.sglang_lora.lora_server_args`) — on the
    model directory ``adapter.base_path`` itself when this node sees it (the agent verified its checksum before; no
    copy), else on the base written to ``work_dir`` — and the engine serves adapter versions.
    """
    from rlboost_hpc.rollout.engines.sglang_engine import SGLangEngine
    from rlboost_hpc.rollout.engines.sglang_lora import lora_server_args
    from rlboost_hpc.rollout.engines.sglang_server import write_hf_dir

    # the pid in the name lets the next attempt on this node reclaim it after a SIGKILL (procutil.reclaim_leftovers)
    d = Path(work_dir) if work_dir is not None else Path(
        tempfile.mkdtemp(prefix=f"rlboost-sglang-model-{os.getpid()}-"))
    model_dir = d
    if adapter is not None and adapter.base_path and Path(adapter.base_path).is_dir():
        model_dir = Path(adapter.base_path)
        d.mkdir(parents=True, exist_ok=True)
    else:
        write_hf_dir(model_config, state_dict, d)
    launch_kw.setdefault("log_path", d / "server.log")
    if adapter is not None:
        device = launch_kw.get("device", "auto")
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        launch_kw["extra_args"] = [*launch_kw.get("extra_args", ()), *lora_server_args(adapter, device)]
        launch_kw.update(adapter=adapter, adapter_dir=d / "adapters")
    if state_dict is None:
        launch_kw["extra_args"] = [*launch_kw.get("extra_args", ()), "--load-format", "dummy"]
        launch_kw.setdefault("weight_version", "none")
    eng = SGLangEngine.launch(model_dir, max_batch=max_batch, version=version if state_dict is not None else -1,
                              model_config=model_config, **launch_kw)
    if state_dict is None:
        eng.served.fence("no weights loaded yet (started with dummy weights)")
    if work_dir is None:
        eng._cleanup_dir = d  # a temp dir of ours: removed (weights; the log is kept) by close()
    return eng


def sglang_engine_factory(max_batch: int, **launch_kw) -> Callable[[dict, Mapping], Engine]:
    """An ``EngineFactory`` for :class:`rlboost_hpc.rollout.agent.RolloutAgent` (``engine_factory=``)."""

    def make(model_config: dict, state_dict: Mapping, arch=None, adapter=None) -> Engine:  # it reads config.json
        return make_sglang_engine(model_config, state_dict, max_batch, adapter=adapter, **launch_kw)

    return make
