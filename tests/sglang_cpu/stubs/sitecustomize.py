"""TEST AID — import-time stand-ins for ``torchvision`` and ``sgl_kernel`` in a CPU-only SGLang server.

Loaded automatically (``sitecustomize``) by every Python process whose ``PYTHONPATH`` starts with this
directory; the rlboost tests put it there for the SGLang server they launch, and nothing else does.
It must never be on a production path: a GPU install has the real packages.

Why: SGLang 0.5.23 imports ``torchvision`` (multimodal processors, imported unconditionally by its config
package) and ``sgl_kernel`` (its custom-kernel package) at import time. On a CPU box PyPI's torchvision is a
CUDA build that fails to import next to CPU torch, and sgl_kernel's CPU build is not on PyPI. A dense
Llama/Qwen2 served with ``--device cpu --attention-backend torch_native --sampling-backend pytorch`` on a CPU
without Intel AMX never *calls* either package, so empty stand-ins suffice:

- Any ``torchvision[.x.y]`` / ``sgl_kernel[.x.y]`` import succeeds with a synthetic package; any attribute
  is a placeholder class; calling or instantiating one raises ``RuntimeError`` naming the symbol, so an
  accidental use fails loudly instead of computing garbage.
- Both names stay invisible to ``importlib.util.find_spec`` probes (transformers decides
  ``is_torchvision_available()`` that way and would otherwise route image processing through the stand-in),
  and they have no distribution metadata.

Pinned host memory (issue 49, LoRA): SGLang 0.5.23's LoRA layers and its ``torch_native`` LoRA backend ask for pinned
host memory unconditionally (``torch.tensor(..., pin_memory=True)``, ``tensor.pin_memory()``), which a CPU-only torch
refuses ("no pinned memory allocator"). Pinning only speeds up host-to-device copies — there is no device here — so
once ``torch`` is imported, on a machine without CUDA, these calls return ordinary (pageable) CPU tensors. Everything
else of SGLang's LoRA path (adapter loading, its memory pool, the per-request adapter, the kernels) runs as shipped.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_ROOTS = ("torchvision", "sgl_kernel")
_TAG = "rlboost test stand-in"


def _covered(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in _ROOTS)


class _PlaceholderMeta(type):
    def __getattr__(cls, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{_TAG}: {cls.__qualname__} is not available (CPU test route without the real "
                           f"package; see tests/sglang_cpu)")


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": _TAG})


class _StandinModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = _placeholder(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _StandinModule(spec.name)
        m.__path__ = []  # a package: submodules are served by the finder too
        m.__version__ = "0.0.0+rlboost.standin"
        m.__rlboost_standin__ = True
        return m

    def exec_module(self, module) -> None:
        return None


class _StandinFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not _covered(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)


_PINNING = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like")


def _pageable_on_cpu_only(torch) -> None:
    """On a torch without CUDA: ``pin_memory=True`` is ignored and ``Tensor.pin_memory()`` returns the tensor."""
    import functools

    if torch.cuda.is_available():
        return

    def unpinned(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)
        return call

    for name in _PINNING:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


class _TorchHook(importlib.abc.MetaPathFinder):
    """Runs :func:`_pageable_on_cpu_only` right after ``torch`` is imported (never importing it earlier)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _pageable_on_cpu_only(module)

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    if any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _StandinFinder())
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, _TorchHook())
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):  # availability probes see nothing
        full = importlib.util.resolve_name(name, package) if name.startswith(".") else name
        if _covered(full):
            return None
        return real_find_spec(name, package)

    find_spec.__wrapped__ = real_find_spec
    importlib.util.find_spec = find_spec


_install()
