"""LoRA adapters in an SGLang server: the adapters of the SGLang engine
(:class:`~rlboost_hpc.rollout.engines.sglang_engine.SGLangEngine`; :class:`SGLangAdapters`, a collaborator it holds),
through SGLang's LoRA adapter API.

A LoRA run's server is launched on the base (``--enable-lora`` with the run's rank and targets, ``--max-loras-per-batch``
and ``--max-loaded-loras`` = ``AdapterSpec.max_adapters``: k + 1 under bounded staleness k; :func:`lora_server_args`).
Each adapter version is written in PEFT's format to a directory of the engine's own (a few MB) and loaded under the
name ``rlboost-v<version>`` (``POST /load_lora_adapter``); every request names the version that serves it
(``lora_path`` of ``/generate``); a version is unloaded (``POST /unload_lora_adapter``) only when no request of this
engine names it.

Invariants (those of adapter engines in :mod:`rlboost_hpc.rollout.engines.base`):
- At most ``max_adapters`` versions are loaded at any time: a load into a full engine is refused before any call
  (the caller unloads an idle version first — never the other way round, so the server's own bound is never hit).
- Neither call waits for requests: a load goes to a free slot while others generate; an unload of a version a request
  in flight names is refused at once (the server would otherwise wait for its references to drain, and SGLang's
  reference counts never drain while generation is paused).
- Every reply is checked (``SGLangControl.call``); a failed load leaves the loaded versions as they were and is an
  :class:`EngineError` with the server's message.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from rlboost_hpc.models.lora import write_peft_dir
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.rollout.engines.base import EngineError

if TYPE_CHECKING:
    from rlboost_hpc.rollout.engines.sglang_server import SGLangControl
    from rlboost_hpc.rollout.engines.sglang_stream import SGLangStreams
    from rlboost_hpc.rollout.engines.sglang_weights import ServedWeights

__all__ = ["SGLangAdapters", "lora_name", "lora_server_args"]

log = logging.getLogger("rlboost.sglang")


def lora_name(version: int) -> str:
    """The name adapter ``version`` is loaded under in the server."""
    return f"rlboost-v{int(version)}"


def lora_server_args(spec: AdapterSpec, device: str) -> list[str]:
    """``launch_server`` arguments of a LoRA run's server: LoRA on, the run's rank and targets, ``max_adapters``
    versions per batch and loaded (on the CPU: SGLang's ``torch_native`` LoRA kernels)."""
    n = str(int(spec.max_adapters))
    args = ["--enable-lora", "--max-lora-rank", str(int(spec.rank)), "--lora-target-modules", *spec.targets,
            "--max-loras-per-batch", n, "--max-loaded-loras", n]
    if device == "cpu":
        args += ["--lora-backend", "torch_native"]
    return args


class SGLangAdapters:
    """The adapter versions of a LoRA run's SGLang server (module docstring).

    Owns ``adapter_spec`` (None: a server of full weights, no adapters), ``max_adapters`` (0 then), the loaded
    versions (version → name in the server, oldest first; version → PEFT directory) and ``last_load_bytes``.

    Args:
        control: the server's checked calls and diagnostics.
        streams: the engine's requests (which adapter each in flight names).
        served: what the server serves (a loaded adapter becomes its version).
        spec: the run's :class:`AdapterSpec` (the server was launched with :func:`lora_server_args` of it), or None.
        work_dir: where adapter files go (a temp dir when None).
    """

    def __init__(self, control: SGLangControl, streams: SGLangStreams, served: ServedWeights,
                 spec: AdapterSpec | None, work_dir: Path | None) -> None:
        import tempfile

        self._control, self._streams, self._served = control, streams, served
        self.adapter_spec = spec
        self._adapters: dict[int, str] = {}  # version → its name in the server, oldest first
        self._adapter_paths: dict[int, Path] = {}  # version → its PEFT directory
        self._adapter_dir: Path | None = None
        self.max_adapters = int(spec.max_adapters) if spec is not None else 0
        self.last_load_bytes = 0
        if spec is not None:
            self._adapter_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="rlboost-sglang-lora-"))
            self._adapter_dir.mkdir(parents=True, exist_ok=True)

    def adapter_versions(self) -> list[int]:
        """Adapter versions loaded in the server, oldest first."""
        return list(self._adapters)

    def adapter_in_use(self, version: int) -> bool:
        """Whether a request of this engine in flight names adapter ``version``."""
        name = self._adapters.get(version)
        return name is not None and self._streams.names(name)

    def lora_of(self, version: int | None) -> str | None:
        """The loaded name a request of adapter ``version`` (None: the newest) runs under; None without adapters.

        Raises:
            EngineError: adapter mode and the version is not loaded."""
        if not self.max_adapters:
            return None
        v = self._served.version if version is None else version
        name = self._adapters.get(v)
        if name is None:
            raise EngineError(f"adapter version {v} is not loaded in the sglang server (loaded: {list(self._adapters)})")
        return name

    def load_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Write adapter ``version`` in PEFT's format and load it into the server under :func:`lora_name`; it becomes
        the newest (:attr:`version`). Returns the bytes written for the server.

        Raises:
            EngineError: not in adapter mode; ``max_adapters`` versions are loaded already; the server refused."""
        spec = self.adapter_spec
        if spec is None:
            raise EngineError("load_adapter: this sglang server serves full weights (launched without LoRA)")
        if version in self._adapters:
            self.unload_adapter(version)
        if len(self._adapters) >= self.max_adapters:
            raise EngineError(f"load_adapter(version={version}): {self.max_adapters} adapter versions "
                              f"{list(self._adapters)} are loaded; unload one no request names first")
        self._control.check(f"load_adapter(version={version})")
        d = self._adapter_dir / f"v{int(version)}-{time.monotonic_ns()}"
        write_peft_dir(d, state_dict, rank=spec.rank, alpha=spec.alpha, dropout=0.0, targets=spec.targets,
                       base_model=spec.base_path, base_checksum=spec.base_checksum)
        name = lora_name(version)
        try:
            self._control.call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(d)},
                               what=f"load_lora_adapter({name})")
        except EngineError:
            shutil.rmtree(d, ignore_errors=True)
            raise
        self._adapters[int(version)] = name
        self._adapter_paths[int(version)] = d
        self._served.loaded(version)
        self.last_load_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        return self.last_load_bytes

    def unload_adapter(self, version: int) -> None:
        """Unload adapter ``version`` from the server (unknown version: no-op).

        Raises:
            EngineError: a request of this engine in flight names it; the server refused."""
        name = self._adapters.get(version)
        if name is None:
            return
        if self.adapter_in_use(version):
            raise EngineError(f"unload_adapter(version={version}) refused: a request in flight names {name}")
        self._control.call("POST", "/unload_lora_adapter", {"lora_name": name}, what=f"unload_lora_adapter({name})")
        del self._adapters[version]
        shutil.rmtree(self._adapter_paths.pop(version, ""), ignore_errors=True)
        if self._served.version == version:
            self._served.version = max(self._adapters, default=-1)

    def replace(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """``load_weights`` of an adapter engine: with nothing in flight, ``version`` replaces every loaded version."""
        active = self._streams.num_active
        if active:
            raise EngineError(f"load_weights(version={version}) refused: {active} request(s) active")
        for v in list(self._adapters):
            self.unload_adapter(v)
        self.load_adapter(state_dict, version)

    def close(self) -> None:
        """Remove the adapter files (the server is going away)."""
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
