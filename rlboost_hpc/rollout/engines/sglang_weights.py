"""Weights into an SGLang server: the weight updates of the SGLang engine
(:class:`~rlboost_hpc.rollout.engines.sglang_engine.SGLangEngine`; :class:`SGLangWeightUpdates`, a collaborator it
holds), what the server serves (:class:`ServedWeights`, shared with the adapters) and what the weight holders send.

Invariants:
- :meth:`load_weights` is refused while requests are active; it validates names/shapes
  (Llama configs), then ``/begin_weight_update`` → ``/update_weights_from_tensor`` (with ``weight_version``,
  ``flush_cache=true``, ``abort_all_requests=false``) → ``/end_weight_update`` → ``/flush_cache`` and checks the
  server's reported weight version. Every reply is checked; any failure raises :class:`EngineError` with the
  server's message and log tail and FENCES the engine (``version = -1``, :meth:`add` refused) until a later
  load succeeds. ``/update_weight_version`` is only ever called with ``abort_all_requests=false``. A server
  started without weights (:func:`~rlboost_hpc.rollout.engines.factory.make_sglang_engine` with
  ``state_dict=None``: ``--load-format dummy``, so it can boot while the first version is pulled) starts fenced.
- A load is one session: ``/begin_weight_update`` … ``/end_weight_update``; a session left open by an earlier
  failed load is closed first; the session is closed on every failure path.
"""
from __future__ import annotations

import base64
import io
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from rlboost_hpc.protocol.weight_msgs import table_arrays
from rlboost_hpc.rollout.engines.base import EngineError
from rlboost_hpc.models.layout import FlatState

if TYPE_CHECKING:
    from rlboost_hpc.rollout.engines.sglang_server import SGLangControl
    from rlboost_hpc.rollout.engines.sglang_stream import SGLangStreams

__all__ = ["SGLangWeightUpdates", "ServedWeights", "as_shared", "flat_bucket", "init_weight_sender_group",
           "serialize_named_tensors", "serialize_object", "shared_host_buffer"]

log = logging.getLogger("rlboost.sglang")


@dataclass
class ServedWeights:
    """What an SGLang engine's server serves: ``version`` (the weight version, or the newest adapter version; -1:
    none) and ``fenced`` (why the engine refuses requests — a failed load, or dummy weights not replaced yet;
    None: it serves). Written by the weight updates and the adapters, read by the engine."""

    version: int
    fenced: str | None = None

    def loaded(self, version: int) -> None:
        """``version`` was loaded completely: it is served, and any fence is lifted."""
        self.version, self.fenced = int(version), None

    def fence(self, why: str) -> None:
        """A load failed (``why``: its error; the first line is kept): nothing is served until a later load."""
        self.fenced = why.splitlines()[0][:300]
        self.version = -1


class SGLangWeightUpdates:
    """The weight updates of an SGLang engine's server (full weights; a LoRA run's adapters are
    :class:`~rlboost_hpc.rollout.engines.sglang_lora.SGLangAdapters`).

    Args:
        control: the server's checked calls and diagnostics.
        streams: the engine's requests (a load is refused while any is active).
        served: what the server serves (set by a load, fenced by a failed one).
        arch: the served model's :class:`~rlboost_hpc.models.arch.ModelArch` (None: not checked here).
        model_config: its HF config (None: unknown).
        server_dtype: the server's dtype (tensors are sent in it; None: as given).
        tp_size: the server's tensor-parallel ranks (one serialized payload each).
    """

    def __init__(self, control: SGLangControl, streams: SGLangStreams, served: ServedWeights, *, arch,
                 model_config: Mapping[str, Any] | None, server_dtype: torch.dtype | None, tp_size: int) -> None:
        self._control, self._streams, self._served = control, streams, served
        self.arch, self.model_config, self.server_dtype, self.tp_size = arch, model_config, server_dtype, tp_size

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a complete version through ``/update_weights_from_tensor`` and label the server with it.

        Sequence: validate → ``/begin_weight_update`` → ``/update_weights_from_tensor`` (shared-memory
        tensors, ``weight_version``, ``flush_cache``, never aborting) → ``/end_weight_update`` →
        ``/flush_cache`` → check the server's weight version. Sets :attr:`version` on success. A
        :class:`~rlboost_hpc.models.layout.FlatState` (a pulled version) goes as one shared-memory segment in
        SGLang's ``flattened_bucket`` format (:func:`flat_bucket`) — per-tensor segments cost a shared-memory
        file each.

        Raises:
            EngineError: requests are active (nothing changes); a tensor is missing/unexpected/misshapen
                (nothing changes); or any server reply is a failure — then the engine is fenced
                (``version = -1``, :meth:`add` refused) until a later load succeeds.
        """
        active = self._streams.num_active
        if active:
            raise EngineError(f"load_weights(version={version}) refused: {active} request(s) active; "
                              f"drain or abort them first")
        self._validate_state_dict(state_dict, version)
        self._control.check(f"load_weights(version={version})")
        t0 = time.monotonic()
        try:
            # shared memory alive until the server answered — a FlatState pulled into shared memory as it is,
            # anything else copied; one pickle per TP rank (each pickle takes its own reference on the shared
            # segments, each rank's unpickling releases one). A FlatState travels as ONE segment (SGLang's
            # flattened bucket), not one per tensor.
            bucket = flat_bucket(state_dict, self.server_dtype) if isinstance(state_dict, FlatState) else None
            if bucket is not None:
                payloads = [serialize_object(bucket) for _ in range(self.tp_size)]
            else:
                shared = [(k, as_shared(v, self.server_dtype)) for k, v in state_dict.items()]
                payloads = [serialize_named_tensors(shared) for _ in range(self.tp_size)]
            body = {"serialized_named_tensors": payloads, "flush_cache": True, "abort_all_requests": False,
                    "weight_version": str(version)}
            if bucket is not None:
                body["load_format"] = "flattened_bucket"
            self._weight_session(
                lambda: self._control.call("POST", "/update_weights_from_tensor", body,
                                           what=f"update_weights_from_tensor(version={version})"),
                version)
        except EngineError as e:
            self._served.fence(str(e))
            raise
        log.info("sglang: loaded version %d (%d tensors) in %.2fs", version, len(state_dict), time.monotonic() - t0)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str = "rlboost_weights", backend: str = "gloo",
                                 join: Callable[[], Any] | None = None) -> None:
        """Make the server join a collective group with the weight holders (``/init_weights_update_group``).

        The server's ranks are ``rank_offset .. rank_offset + tp_size - 1``. The call blocks until every member
        joined: pass ``join`` (the holders' side, e.g. ``lambda: init_weight_sender_group(...)``) to run it
        concurrently. Use ``backend="nccl"`` on GPUs, ``"gloo"`` on CPU.

        Raises:
            EngineError: the server's reply is a failure, or ``join`` raised.
        """
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        self._with_peer(lambda: self._control.call("POST", "/init_weights_update_group", body,
                                                   what="init_weights_update_group"), join)

    def load_weights_from_distributed(self, params: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: int,
                                      send: Callable[[], Any], group_name: str = "rlboost_weights") -> None:
        """Load a version broadcast by the weight holders over the group of :meth:`init_weight_update_group`.

        ``params`` lists (HF name, dtype, shape) in broadcast order; ``send`` runs the holders' broadcasts
        (``torch.distributed.broadcast(t, src=0, group=g)`` for each tensor, in that order) concurrently with
        the server's ``/update_weights_from_distributed`` call. Wrapped in ``/begin_weight_update`` …
        ``/end_weight_update`` + ``/flush_cache`` like :meth:`load_weights`; same refusal and fencing rules.
        """
        active = self._streams.num_active
        if active:
            raise EngineError(f"load_weights_from_distributed(version={version}) refused: {active} "
                              f"request(s) active")
        names = [p[0] for p in params]
        if self.model_config is not None:
            fake = {n: torch.empty(tuple(s), dtype=d, device="meta") for n, d, s in params}
            self._validate_state_dict(fake, version)
        body = {"names": names, "dtypes": [str(p[1]).replace("torch.", "") for p in params],
                "shapes": [list(p[2]) for p in params], "group_name": group_name, "flush_cache": True,
                "abort_all_requests": False, "weight_version": str(version)}
        try:
            self._weight_session(lambda: self._with_peer(
                lambda: self._control.call("POST", "/update_weights_from_distributed", body,
                                           what=f"update_weights_from_distributed(version={version})"), send), version)
        except EngineError as e:
            self._served.fence(str(e))
            raise

    # ------------------------------------------------------------------ weights internals
    def _weight_session(self, load: Callable[[], Any], version: int) -> None:
        begin = {"selector": "all"}
        try:
            self._control.call("POST", "/begin_weight_update", begin, what="begin_weight_update")
        except EngineError as e:
            if "already open" not in str(e):
                raise
            # a session left open by an earlier failed load: close it, then begin afresh
            self._control.call("POST", "/end_weight_update", {}, what="end_weight_update (stale session)")
            self._control.call("POST", "/begin_weight_update", begin, what="begin_weight_update")
        try:
            load()
        except BaseException:
            try:
                self._control.call("POST", "/end_weight_update", {}, what="end_weight_update (after failure)")
            except EngineError as e2:
                log.warning("sglang: closing the weight-update session failed too: %s", e2)
            raise
        self._control.call("POST", "/end_weight_update", {}, what="end_weight_update")
        self._control.call("POST", "/flush_cache", None, what="flush_cache")
        got = self._control.call("GET", "/model_info", None, what="model_info").get("weight_version")
        if str(got) != str(version):
            raise EngineError(f"sglang: server reports weight_version {got!r} after loading version {version}")
        self._served.loaded(version)

    def _validate_state_dict(self, state_dict: Mapping[str, Any], version: int) -> None:
        if self.arch is None:
            return
        from rlboost_hpc.models.arch import ModelFormatError, validate_state_dict

        try:
            validate_state_dict(self.arch, state_dict, source=f"load_weights(version={version})")
        except ModelFormatError as e:
            raise EngineError(str(e)) from None

    def _with_peer(self, call: Callable[[], Any], peer: Callable[[], Any] | None) -> Any:
        if peer is None:
            return call()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = call()
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=run, name="sglang-control", daemon=True)
        t.start()
        try:
            peer()
        except BaseException as e:
            t.join(timeout=1.0)
            raise EngineError(f"weight holders' side failed: {type(e).__name__}: {e}") from e
        t.join(timeout=self._control.timeout_s)
        if t.is_alive():
            raise EngineError(f"sglang control call still running after {self._control.timeout_s:.0f}s")
        if "error" in box:
            raise box["error"]
        return box.get("result")


def flat_bucket(state: FlatState, dtype: torch.dtype | None) -> dict | None:
    """``state`` as SGLang's flattened bucket (``load_format="flattened_bucket"``): ``{"flattened_tensor": one
    shared-memory uint8 tensor — the flat tensor itself when it already lives in shared memory in ``dtype`` (a
    version pulled into :func:`shared_host_buffer`: no copy), else a copy cast to ``dtype`` (None: kept),
    "metadata": one ``FlattenedTensorMetadata`` per tensor (name, shape, dtype, byte range)}``; the layout's
    padding travels along and no tensor is copied on its own. None when this SGLang has no flattened buckets (the
    caller then sends tensor by tensor)."""
    meta_class = _sglang_bucket_metadata()
    if meta_class is None:
        return None
    flat = state.flat
    if flat.device.type == "cpu" and flat.is_shared() and (dtype is None or dtype == flat.dtype):
        shared = flat  # pulled into shared memory (shared_host_buffer): SGLang reads the pulled bytes themselves
    else:
        shared = as_shared(flat, dtype)
    item = shared.element_size()
    a = table_arrays(state.table)
    starts = (a.offsets // a.itemsize * item).tolist()
    numel = a.numel.tolist()
    shapes = [torch.Size(row[:k]) for row, k in zip(a.shapes.tolist(), a.ndim.tolist())]
    metadata = [meta_class(name=name, shape=shape, dtype=shared.dtype, start_idx=start,
                           end_idx=start + n * item, numel=n * item)
                for name, shape, start, n in zip(state.table.names, shapes, starts, numel)]
    return {"flattened_tensor": shared.view(torch.uint8), "metadata": metadata}


def _share_by_file_name() -> None:
    """Set torch's ``file_system`` sharing strategy (process-wide): CPU tensors then pickle as shared-memory file
    names another process can open (the default ``file_descriptor`` strategy pickles fds that cannot cross HTTP
    and crash SGLang's scheduler)."""
    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() != "file_system":
        tmp.set_sharing_strategy("file_system")


def shared_host_buffer(nbytes: int) -> torch.Tensor:
    """A new uint8 host buffer of ``nbytes`` bytes in shared memory that SGLang's server process can map by name
    (torch's ``file_system`` sharing strategy, which this sets process-wide as :func:`serialize_object` does).

    A rollout worker that loads into SGLang pulls versions into one of these (``WeightPuller(buffer_factory=
    shared_host_buffer)``): :func:`flat_bucket` then hands SGLang the pulled bytes themselves instead of copying
    them into a fresh shared-memory segment per load (the copy faulted in the whole model 4 KiB at a time on
    tmpfs: 140 ms for 200 MiB, 12 ms as a warm copy). The buffer is the rollout worker's base version (the next
    pull writes it in place), so it costs no memory beyond the copy a worker keeps anyway."""
    _share_by_file_name()
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def _sglang_bucket_metadata() -> type | None:
    """SGLang's ``FlattenedTensorMetadata`` (what its server unpickles), or None when SGLang is not importable
    here. Importing the ``sglang`` package sets cache-directory variables in ``os.environ``; this process does
    not run SGLang, so the environment is put back as it was (child processes see it unchanged)."""
    before = dict(os.environ)
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError:
        return None
    finally:
        if dict(os.environ) != before:
            os.environ.clear()
            os.environ.update(before)
    return FlattenedTensorMetadata


def serialize_object(obj: Any) -> str:
    """``obj`` pickled as :func:`serialize_named_tensors` pickles its list (base64 of ``ForkingPickler``; CPU
    tensors as shared-memory file names)."""
    from multiprocessing.reduction import ForkingPickler

    _share_by_file_name()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What ``/update_weights_from_tensor`` expects per TP rank: base64 of ``ForkingPickler`` of a list of
    ``(name, tensor)`` (SGLang's ``MultiprocessingSerializer``).

    CPU tensors travel as shared-memory file names: the sharing strategy must be ``file_system`` (the default
    ``file_descriptor`` strategy pickles fds that cannot cross HTTP and crashes the server's scheduler), so
    this sets it for the whole process. Keep the tensors alive until the server has answered.
    """
    return serialize_object(list(named))


def as_shared(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A shared-memory copy of ``t`` (one copy; the caller's tensor is left untouched)."""
    _share_by_file_name()
    t = t.detach()
    if t.is_cuda:  # CUDA tensors travel as CUDA IPC handles
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t.contiguous()
    out = torch.empty(t.shape, dtype=dtype or t.dtype).share_memory_()
    out.copy_(t)
    return out


def init_weight_sender_group(master_address: str, master_port: int, world_size: int, rank: int = 0,
                             group_name: str = "rlboost_weights", backend: str = "gloo",
                             timeout_s: float = 300.0):
    """The weight holders' side of :meth:`SGLangEngine.init_weight_update_group`: a process group that is not
    the default group (same rendezvous as SGLang's ``init_custom_process_group``: TCP store at
    ``master_address:master_port``, keys prefixed by ``group_name``). Returns the group for
    ``torch.distributed.broadcast(t, src=rank, group=g)``.
    """
    from datetime import timedelta

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
