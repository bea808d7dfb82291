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


def _install() -> None:
    if any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _StandinFinder())
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):  # availability probes see nothing
        full = importlib.util.resolve_name(name, package) if name.startswith(".") else name
        if _covered(full):
            return None
        return real_find_spec(name, package)

    find_spec.__wrapped__ = real_find_spec
    importlib.util.find_spec = find_spec


_install()
