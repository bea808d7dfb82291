"""CPU compatibility layer for Megatron-core 0.16.1 — a TEST AID, never active on a GPU machine.

Megatron-core assumes CUDA everywhere: ~160 call sites allocate with ``device="cuda"`` or
``torch.cuda.current_device()``, the RNG tracker saves/restores CUDA generator states, and the optimizer checks
``param.type() == "torch.cuda.FloatTensor"``. On a machine without CUDA every path fails with "Torch not
compiled with CUDA enabled". :func:`install` makes the *same* Megatron code run on CPU with gloo, so the
bridge, the backend, the schedules, the optimizer and ``dist_checkpointing`` are exercised in CI.

What it does (only when ``torch.cuda.is_available()`` is False; on a CUDA machine :func:`install` returns False
and changes nothing):

- Devices: a :class:`torch.overrides.TorchFunctionMode`, entered by :func:`scope` around Megatron work (modes
  are thread-local; the project's own torch code outside the scope is untouched), rewrites every CUDA device argument
  (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``, a bare int) of any torch call — factory keyword
  ``device=``, ``Tensor.to(...)`` positionals — to ``cpu``. ``torch.cuda.current_device()`` returns 0 (then
  rewritten), ``Tensor.cuda()`` / ``Module.cuda()`` are identities.
- ``Tensor.type()`` called *from Megatron code* reports ``torch.cuda.<T>Tensor`` for CPU floating tensors so
  the optimizer's dtype checks pass (project code sees the real answer).
- RNG: the CUDA default generator is the CPU generator here. ``torch.cuda.{get,set}_rng_state``,
  ``manual_seed(_all)`` and Megatron's ``_get/_set_cuda_rng_state`` act on the CPU generator, so
  ``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()`` and activation recompute keep their
  semantics (fork = save CPU state, switch to the tracked state, restore).
- Python ``autograd.Function`` backwards run inside the scope too (activation recompute re-runs the forward
  there).
- Streams, events, ``synchronize``, ``empty_cache``, NVTX, memory statistics: no-op stand-ins.

Known not to work on CPU even with the layer (TransformerEngine/Apex kernels): ``apply_rope_fusion``,
``gradient_accumulation_fusion``, ``persist_layer_norm``, ``masked_softmax_fusion`` kernels. The bridge
keeps them off. Cost: one Python call per torch op (the mode); measured in ``benchmarks/bench_megatron.py``.

Invariant: the layer is installed at most once per process, only when CUDA is absent, and
:func:`is_active` tells whether it is. Nothing in ``megatron_bridge`` depends on it except through
:func:`install` (called by :func:`megatron_bridge.parallel.initialize`).
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = ["install", "is_active", "cpu_device", "scope", "scoped"]

_LOCK = threading.Lock()
_ACTIVE = False
_CPU = torch.device("cpu")


def cpu_device() -> torch.device:
    """The device Megatron modules live on: ``cuda:<current>`` with CUDA, ``cpu`` under the layer."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def is_active() -> bool:
    """True when :func:`install` has patched this process (i.e. CUDA is absent and the layer is on)."""
    return _ACTIVE


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return isinstance(d, int) and not isinstance(d, bool)


_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor", "torch.DoubleTensor": "torch.cuda.DoubleTensor"}
_TENSOR_TO = torch.Tensor.to
_TENSOR_TYPE = torch.Tensor.type


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            d = kwargs.get("device")
            if d is not None and _is_cuda_device(d):
                kwargs = dict(kwargs)
                kwargs["device"] = _CPU
        else:
            kwargs = {}
        if func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        elif func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            out = func(*args)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron."):
                return _TYPE_NAMES.get(out, out)
            return out
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: every method is a no-op (CPU work is synchronous)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self.device = _CPU

    def wait_stream(self, *a: Any, **k: Any) -> None: ...
    def wait_event(self, *a: Any, **k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: return True

    def record_event(self, event: Any = None) -> "_Event":
        return event if event is not None else _Event()

    def __enter__(self) -> "_Stream": return self
    def __exit__(self, *exc: Any) -> None: ...


class _Event:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, *a: Any, **k: Any) -> None: ...
    def record(self, *a: Any, **k: Any) -> None: ...
    def wait(self, *a: Any, **k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: return True
    def elapsed_time(self, other: Any) -> float: return 0.0


_STREAM = _Stream()


def _patch_torch_cuda() -> None:
    c = torch.cuda
    c.current_device = lambda: 0
    c.set_device = lambda *a, **k: None
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda: None
    c.current_stream = lambda *a, **k: _STREAM
    c.default_stream = lambda *a, **k: _STREAM
    c.Stream = _Stream
    c.ExternalStream = _Stream
    c.Event = _Event
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.set_stream = lambda *a, **k: None
    c.memory_allocated = lambda *a, **k: 0
    c.max_memory_allocated = lambda *a, **k: 0
    c.memory_reserved = lambda *a, **k: 0
    c.max_memory_reserved = lambda *a, **k: 0
    c.reset_peak_memory_stats = lambda *a, **k: None
    c.memory_stats = lambda *a, **k: {}
    # The CUDA default generator *is* the CPU generator under this layer.
    c.get_rng_state = lambda device="cuda": torch.get_rng_state()
    c.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    c.get_rng_state_all = lambda: [torch.get_rng_state()]
    c.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    c.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    c.manual_seed_all = lambda seed: None  # torch.manual_seed calls this after seeding the CPU generator
    nvtx = c.nvtx
    nvtx.range_push = lambda *a, **k: 0
    nvtx.range_pop = lambda *a, **k: 0
    nvtx.range = lambda *a, **k: contextlib.nullcontext()
    nvtx.mark = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state


def _patch_autograd_functions() -> None:
    """Run every Python ``autograd.Function.backward`` inside :func:`scope`.

    The mode is popped while it handles ``torch.autograd.backward`` itself, so Python backward code — notably
    activation recompute, which re-runs the layer forward inside ``CheckpointFunction.backward`` — would run
    without it. The autograd engine looks up ``_get_user_fn`` dynamically for each custom-Function node.
    """
    from torch.autograd.function import BackwardCFunction

    orig = BackwardCFunction._get_user_fn

    def _get_user_fn(self):
        fn = orig(self)

        def run(*a, **k):
            with scope():
                return fn(*a, **k)

        return run

    BackwardCFunction._get_user_fn = _get_user_fn


def install() -> bool:
    """Install the layer if CUDA is absent. Idempotent, thread-safe.

    Returns:
        True when the layer is (now) active, False on a CUDA machine (nothing changed).
    """
    global _ACTIVE
    with _LOCK:
        if _ACTIVE:
            return True
        if torch.cuda.is_available():
            return False
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_autograd_functions()
        _ACTIVE = True
        return True


@contextlib.contextmanager
def scope():
    """Run the body with the device-rewriting mode on this thread's torch-function mode stack.

    Torch-function modes are thread-local, and the mode costs one Python call per torch op, so it is only
    active inside Megatron work: every public entry point of ``megatron_bridge`` wraps itself in this scope.
    Nesting is free (the mode is entered once per thread); without the layer (CUDA present) it does nothing.
    """
    if not _ACTIVE or any(isinstance(m, _CpuDeviceMode) for m in _get_current_function_mode_stack()):
        yield
        return
    with _CpuDeviceMode():
        yield


def scoped(fn):
    """Decorator form of :func:`scope`."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **k):
        with scope():
            return fn(*a, **k)

    return wrapper
