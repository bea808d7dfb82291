"""The rollout :class:`Engine` over an SGLang server (``sglang.launch_server``, tested with SGLang 0.5.23).

The engine starts and supervises one server process (or attaches to one given by URL), streams ``/generate``
with token ids in and token ids + per-token logprobs out, and loads weights through SGLang's RL endpoints.
Nothing here imports ``sglang``: the adapter speaks HTTP only (stdlib ``http.client``), so the rollout agent's
process stays light and the server's Python environment may differ from the agent's.

Invariants (the base contract of :mod:`rlboost_hpc.rollout.engines.base`, and how they hold here):
- Ids are ids: the server runs with ``--skip-tokenizer-init``; requests carry ``input_ids``; every token
  comes from a chunk's ``output_ids`` together with ``meta_info.output_token_logprobs`` (whose entries repeat
  the id) and ``meta_info.completion_tokens``. A chunk whose ids, logprob ids and counts disagree is an error,
  never repaired. Chunks may be cumulative (SGLang's default, how this engine launches its servers: the full
  lists from the first token — which may run ahead of ``completion_tokens``, because SGLang streams an
  intermediate cumulative chunk as a reference to its growing lists and serialises it later) or incremental
  (``--incremental-streaming-output``: exactly the ``completion_tokens − received`` new entries); the lengths
  tell which, anything else is an error.
- Resumable: a request is sent as ``input_ids = prompt_ids + prefix_ids`` with
  ``max_new_tokens`` = the remaining budget the caller gives; the engine never returns more than that.
  Greedy (temperature 0) continuations are exactly the uninterrupted ones (SGLang's greedy is argmax over the
  same logits). Sampled decoding is NOT keyed by our (seed, position) rule: SGLang samples with its own RNG.
  With ``deterministic=True`` (``--enable-deterministic-inference``) SGLang samples with the per-request
  ``sampling_seed`` (we pass ``SamplingParams.seed``) and Gumbel noise hashed from (seed, sequence position),
  so a response resumed on an SGLang server equals the uninterrupted one on an SGLang server; a response
  migrated between SGLang and the torch engine keeps every token already produced but continues with a
  different random stream (valid on-policy samples, not bit-identical ones). SGLang 0.5.23 refuses
  deterministic inference with the CPU attention backend (``torch_native``), so on CPU sampled decoding is not
  reproducible at all; tests assert exactness for greedy only.
- Behaviour logprobs: SGLang returns ``log(softmax(logits / T))`` of the sampled token before top-p
  truncation (raw logits for greedy) — the same quantity as the torch engine, equal up to float rounding.
- Stop semantics: a token in ``stop_token_ids`` ends the request (included, ``"stop"``); reaching
  ``max_new_tokens`` ends it with ``"length"``. The server stops on ``stop_token_ids`` ∪ the model's EOS
  ids unless ``ignore_eos``; when the request's stop set does not contain the model's EOS ids the engine sends
  ``ignore_eos`` and enforces the stop set itself (truncating after the first stop token and aborting the
  server request), so the semantics equal the torch engine's in every case.
- Nothing hidden: :meth:`step` returns every token received since the previous call. :meth:`abort`
  tells the server to abort, waits (bounded) for the stream's final chunk — SGLang sends the complete
  ``output_ids`` of an aborted request — and RETURNS the tokens not yet returned by :meth:`step` as a
  :class:`TokenEvent` (``finished=False``), or ``None``. Callers that hand off partial responses must use that
  return value (the torch engine always returns ``None``: it has nothing pending).
- Weights: see :mod:`rlboost_hpc.rollout.engines.sglang_weights`; LoRA adapters (a LoRA run's server, launched
  on the base): see :mod:`rlboost_hpc.rollout.engines.sglang_lora`; the server process: see
  :mod:`rlboost_hpc.rollout.engines.sglang_server`; the ``/generate`` streams: see
  :mod:`rlboost_hpc.rollout.engines.sglang_stream`.
- Batching: requests added between two :meth:`step` calls are submitted together as ONE streaming
  ``/generate`` call (lists of ``input_ids`` / ``sampling_params`` / ``rid``; SGLang multiplexes their chunks on
  one SSE stream, told apart by ``meta_info.id``), read by one thread; abort stays per request.
- Not thread-safe (one agent thread drives it).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.rollout.engines.base import Engine, EngineError, GenRequest, TokenEvent, validate_request
from rlboost_hpc.rollout.engines.sglang_server import SGLangControl, SGLangServer
from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.rollout.engines.sglang_lora import SGLangAdapters
from rlboost_hpc.rollout.engines.sglang_stream import SGLangStreams
from rlboost_hpc.rollout.engines.sglang_weights import SGLangWeightUpdates, ServedWeights

__all__ = ["SGLangEngine"]

log = logging.getLogger("rlboost.sglang")

_INT64_MAX = (1 << 63) - 1
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16}


class SGLangEngine(Engine):
    """:class:`Engine` over an SGLang HTTP server.

    Build with :meth:`launch` (starts and owns a supervised server),
    :func:`~rlboost_hpc.rollout.engines.factory.make_sglang_engine` (from the manager's HF config + a state dict,
    for the rollout agent), or the constructor (attach to a running server at ``base_url``; ``server`` may be
    given to supervise it).

    This class holds the construction, the lifecycle, the version label and the :class:`Engine` calls; each
    server-side capability is a collaborator that owns its state, in its own module: :attr:`control`
    (:class:`SGLangControl`: the checked control calls and the server's diagnostics, ``sglang_server.py``),
    :attr:`streams` (:class:`SGLangStreams`: the requests and their ``/generate`` streams, ``sglang_stream.py``),
    :attr:`weights` (:class:`SGLangWeightUpdates`: weight loads, ``sglang_weights.py``) and :attr:`adapters`
    (:class:`SGLangAdapters`: LoRA adapter versions, ``sglang_lora.py``); what the server serves
    (:class:`ServedWeights`) is shared by the last two.

    Args:
        base_url: ``http://host:port`` of the server.
        max_batch: most requests the caller runs at once (the server's ``--max-running-requests``).
        version: the weight version the server holds now.
        server: the :class:`SGLangServer` behind ``base_url`` (enables crash detection with log tails).
        owns_server: :meth:`close` stops ``server``.
        model_config: HF config dict of the served model (vocab/context/EOS checks and state-dict validation);
            default: read from the server's model dir when it is local.
        stall_timeout_s: a stream that delivers nothing for this long (server alive) is an error.
        abort_timeout_s: how long :meth:`abort` waits for the final chunk of an aborted request.
        control_timeout_s: deadline of each control call (weights, cache, version).
        tp_size: tensor-parallel ranks of the server (one serialized payload each).
        adapter: a LoRA run's spec (the server was launched on the base with ``sglang_lora.lora_server_args``): the
            engine then serves adapter versions; ``adapter_dir``: where their PEFT files go (default: a temp dir).
    """

    def __init__(self, base_url: str, *, max_batch: int = D.MAX_BATCH, version: int = 0, server: SGLangServer | None = None,
                 owns_server: bool = False, model_config: Mapping[str, Any] | None = None,
                 stall_timeout_s: float = 120.0, abort_timeout_s: float = 30.0, control_timeout_s: float = 600.0,
                 tp_size: int = 1, adapter: AdapterSpec | None = None, adapter_dir: str | os.PathLike | None = None
                 ) -> None:
        if max_batch < 1:
            raise EngineError(f"max_batch must be ≥ 1, got {max_batch}")
        u = base_url.rstrip("/")
        if u.startswith("http://"):
            u = u[len("http://"):]
        host, _, port = u.partition(":")
        self.max_batch = max_batch
        self.server = server  # (its lifetime is the engine's when owns_server; the control reads its diagnostics)
        self.owns_server = owns_server
        self.control = SGLangControl(host, int(port or 80), server, control_timeout_s)
        self.streams = SGLangStreams(self.control, stall_timeout_s=stall_timeout_s, abort_timeout_s=abort_timeout_s,
                                     tag=f"{os.getpid():x}{id(self) & 0xFFFFFF:06x}")
        self._closed = False
        self._cleanup_dir: Path | None = None  # a temp model dir of ours (make_sglang_engine): close() removes it
        info = self.control.call("GET", "/model_info", None, what="model_info")
        if model_config is None:
            from rlboost_hpc.models.arch import ModelFormatError, read_config_json

            try:
                model_config = read_config_json(Path(info["model_path"]))
            except (ModelFormatError, KeyError, TypeError):
                model_config = None
        self.model_config = dict(model_config) if model_config is not None else None
        self.arch = None  # a model the project does not describe: the server's replies are the only check
        if self.model_config is not None:
            from rlboost_hpc.models.arch import ModelFormatError, arch_from_hf

            try:
                self.arch = arch_from_hf(self.model_config, name="the served model's config")
            except ModelFormatError:
                pass
        self.vocab_size: int | None = self.arch.vocab_size if self.arch else None
        self.max_len: int | None = self.arch.max_position_embeddings if self.arch else None
        self.eos_ids: frozenset[int] = frozenset(self.arch.eos_token_ids if self.arch else ())
        self.served = ServedWeights(version if adapter is None else -1)
        self.adapters = SGLangAdapters(self.control, self.streams, self.served, adapter,
                                       Path(adapter_dir) if adapter_dir else None)
        sinfo = self._server_info()
        self.server_dtype = _DTYPES.get(str(sinfo.get("dtype", "")))
        if isinstance(sinfo.get("context_length"), int):  # --context-length overrides the model's
            self.max_len = min(self.max_len or sinfo["context_length"], sinfo["context_length"])
        self.weights = SGLangWeightUpdates(self.control, self.streams, self.served, arch=self.arch,
                                           model_config=self.model_config, server_dtype=self.server_dtype,
                                           tp_size=tp_size)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def launch(cls, model_path: str | os.PathLike[str], *, max_batch: int = D.MAX_BATCH, version: int = 0,
               model_config: Mapping[str, Any] | None = None, stall_timeout_s: float = 120.0,
               abort_timeout_s: float = 30.0, control_timeout_s: float = 600.0, adapter: AdapterSpec | None = None,
               adapter_dir: str | os.PathLike | None = None, **server_kw) -> "SGLangEngine":
        """Start a supervised server for ``model_path`` (see :class:`SGLangServer` for ``server_kw``) and attach.

        Raises:
            EngineError: the server did not come up (log tail included).
        """
        server_kw.setdefault("max_running_requests", max_batch)
        server_kw.setdefault("weight_version", version if version >= 0 else "none")
        server = SGLangServer(model_path, **server_kw).start()
        try:
            return cls(server.url, max_batch=max_batch, version=version, server=server, owns_server=True,
                       model_config=model_config, stall_timeout_s=stall_timeout_s,
                       abort_timeout_s=abort_timeout_s, control_timeout_s=control_timeout_s, adapter=adapter,
                       adapter_dir=adapter_dir)
        except BaseException:
            server.stop()
            raise

    def close(self) -> None:
        """Abort everything still running (best effort) and stop the server if this engine owns it."""
        if self._closed:
            return
        self._closed = True
        self.streams.close()
        if self.owns_server and self.server is not None:
            self.server.stop()
        self.adapters.close()
        d = self._cleanup_dir
        if d is not None:
            for name in ("model.safetensors", "config.json"):
                try:
                    (d / name).unlink()
                except OSError:
                    pass

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ version (agent sets it after the factory)
    @property
    def version(self) -> int:  # type: ignore[override]
        return self.served.version

    @version.setter
    def version(self, v: int) -> None:
        """Record ``v`` and label the server's weights with it (``/update_weight_version`` WITHOUT aborting)."""
        v = int(v)
        served = self.served
        if self.max_adapters:  # the newest adapter version names itself (each request names its own)
            served.version = v
            return
        if served.fenced is not None and v != served.version:
            raise EngineError(f"cannot label the weights as version {v}: engine fenced ({served.fenced}); "
                              f"load_weights() a complete version instead")
        if v != served.version and v >= 0:
            self.control.call("POST", "/update_weight_version", {"new_version": str(v), "abort_all_requests": False},
                              what=f"update_weight_version({v})")
        served.version = v

    @property
    def fenced(self) -> str | None:
        """Why the engine refuses requests (a failed weight load), or ``None``."""
        return self.served.fenced

    @property
    def chunks_received(self) -> int:
        """Stream chunks that carried tokens, over the engine's life."""
        return self.streams.chunks_received

    # ------------------------------------------------------------------ weights and adapters
    @property
    def max_adapters(self) -> int:  # type: ignore[override]
        return self.adapters.max_adapters

    @property
    def last_load_bytes(self) -> int:  # type: ignore[override]
        return self.adapters.last_load_bytes

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a complete version (:meth:`SGLangWeightUpdates.load_weights`) — in a LoRA run's server, an adapter
        version that replaces every loaded one (:meth:`SGLangAdapters.replace`).

        Raises:
            EngineError: see those two; a failed full load fences the engine.
        """
        if self.max_adapters:
            return self.adapters.replace(state_dict, version)
        return self.weights.load_weights(state_dict, version)

    def adapter_versions(self) -> list[int]:
        return self.adapters.adapter_versions()

    def adapter_in_use(self, version: int) -> bool:
        return self.adapters.adapter_in_use(version)

    def load_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        return self.adapters.load_adapter(state_dict, version)

    def unload_adapter(self, version: int) -> None:
        self.adapters.unload_adapter(version)

    # ------------------------------------------------------------------ Engine API
    @property
    def num_active(self) -> int:
        return self.streams.num_active

    def add(self, req: GenRequest) -> None:
        """Validate ``req`` and queue it; the next :meth:`step` submits every queued request in ONE streaming
        ``/generate`` call (the server prefills them together, like its own batched ``/generate``).

        Raises:
            EngineError: the engine is fenced or closed; duplicate rid; empty prompt; ``max_new_tokens < 1``;
                ids outside the vocabulary; temperature < 0 or top_p outside (0, 1]; prompt + prefix +
                max_new_tokens beyond the context length; a dead server.
        """
        rid = req.rid
        if self._closed:
            raise EngineError(f"request {rid!r}: engine closed")
        if self.served.fenced is not None:
            raise EngineError(f"request {rid!r}: engine fenced ({self.served.fenced}); load a complete version first")
        if self.streams.holds(rid):
            raise EngineError(f"request {rid!r}: duplicate rid (already queued or running)")
        checked = validate_request(req, vocab_size=self.vocab_size, max_len=self.max_len)
        lora = self.adapters.lora_of(checked.adapter_version)
        sp = checked.sampling
        self.control.check(f"add({rid!r})")
        stop = frozenset(int(t) for t in sp.stop_token_ids)
        # The server always stops on the model's EOS unless ignore_eos (which also disables stop_token_ids):
        # when our stop set lacks an EOS id, let the server run free and cut the stream ourselves.
        enforce = not self.eos_ids <= stop
        sampling: dict[str, Any] = {
            "max_new_tokens": req.max_new_tokens,
            "temperature": float(sp.temperature),
            "top_p": float(sp.top_p),
            "top_k": -1,
            "min_p": 0.0,
            "sampling_seed": int(sp.seed) & _INT64_MAX,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if enforce:
            sampling["ignore_eos"] = True
        elif stop:
            sampling["stop_token_ids"] = sorted(stop)
        self.streams.add(rid, input_ids=checked.prompt_ids + checked.prefix_ids, sampling=sampling, stop=stop,
                         max_new=req.max_new_tokens, enforce_stop=enforce, lora=lora)

    def step(self) -> list[TokenEvent]:
        """Return every token streamed since the previous call, one event per request.

        Blocks until at least one request has something to report (or none is active), so each call makes
        progress like one iteration of a local engine. Returns ``[]`` only when idle.

        Raises:
            RequestError: one request's stream broke or returned inconsistent data while the server lives (the
                tokens received before the failure were returned by an earlier call; the request is dropped,
                the others go on).
            EngineError: the server died (log tail included), or no request received anything for
                ``stall_timeout_s``.
        """
        return self.streams.step()

    def abort(self, rid: str) -> TokenEvent | None:
        """Abort ``rid`` on the server and return its tokens that :meth:`step` has not returned yet.

        Waits up to ``abort_timeout_s`` for the stream's final chunk (the server's complete output of the
        aborted request, so nothing it produced is lost), re-sending the abort while the server has not
        registered the request yet. Unknown rid: ``None``.

        Returns:
            A :class:`TokenEvent` with the undelivered tokens (``finished`` True only if the request had
            already finished on its own), or ``None`` when nothing was pending.
        """
        return self.abort_many([rid]).get(rid)

    def abort_all(self) -> list[TokenEvent]:
        """Abort every active request of this engine (other clients of the server are untouched); return
        their undelivered tokens (see :meth:`abort`)."""
        rids = self.streams.active()
        evs = self.abort_many(rids)
        return [evs[r] for r in rids if r in evs]

    def abort_many(self, rids: Sequence[str]) -> dict[str, TokenEvent]:
        """:meth:`abort` for several requests at once (one wait for all final chunks): ``{rid: event}`` for
        those with undelivered tokens."""
        return self.streams.abort_many(rids)

    def _server_info(self) -> dict:
        try:
            info = self.control.call("GET", "/server_info", None, what="server_info", timeout=30.0)
        except EngineError:
            return {}
        return info if isinstance(info, dict) else {}
