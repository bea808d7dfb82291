"""The rollout :class:`Engine` over an SGLang server (``sglang.launch_server``, tested with SGLang 0.5.23).

The engine starts and supervises one server process (or attaches to one given by URL), streams ``/generate``
with token ids in and token ids + per-token logprobs out, and loads weights through SGLang's RL endpoints.
Nothing here imports ``sglang``: the adapter speaks HTTP only (stdlib ``http.client``), so the rollout agent's
process stays light and the server's Python environment may differ from the agent's.

Invariants (the base contract of :mod:`rlboost_hpc.rollout.engines.base`, and how they hold here):
- Ids are ids: the server runs with ``--skip-tokenizer-init``; requests carry ``input_ids``; every token
  comes from a chunk's ``output_ids`` together with ``meta_info.output_token_logprobs`` (whose entries repeat
  the id) and ``meta_info.completion_tokens``. A chunk whose ids, logprob ids and counts disagree is an error,
  never repaired. Chunks may be cumulative (SGLang's default) or incremental
  (``--incremental-streaming-output``); the count tells which, anything else is an error.
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
- Weights: :meth:`load_weights` is refused while requests are active; it validates names/shapes
  (Llama configs), then ``/begin_weight_update`` → ``/update_weights_from_tensor`` (with ``weight_version``,
  ``flush_cache=true``, ``abort_all_requests=false``) → ``/end_weight_update`` → ``/flush_cache`` and checks the
  server's reported weight version. Every reply is checked; any failure raises :class:`EngineError` with the
  server's message and log tail and FENCES the engine (``version = -1``, :meth:`add` refused) until a later
  load succeeds. ``/update_weight_version`` is only ever called with ``abort_all_requests=false``. A server
  started without weights (:func:`make_sglang_engine` with ``state_dict=None``: ``--load-format dummy``, so it
  can boot while the first version is pulled) starts fenced.
- Supervision: the server runs in its own session (killed as a group by :meth:`close`, at interpreter exit
  and, on Linux, when this process dies: ``PR_SET_PDEATHSIG``); its output goes to a log file; start-up has
  a deadline; a dead server or a stalled stream raises :class:`EngineError` carrying the log tail.
- Batching: requests added between two :meth:`step` calls are submitted together as ONE streaming
  ``/generate`` call (lists of ``input_ids`` / ``sampling_params`` / ``rid``; SGLang multiplexes their chunks on
  one SSE stream, told apart by ``meta_info.id``), read by one thread; abort stays per request.
- Not thread-safe (one agent thread drives it).
"""
from __future__ import annotations

import atexit
import base64
import http.client
import io
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from rlboost_hpc.procutil import die_with_parent
from rlboost_hpc.rollout.engines.base import Engine, EngineError, FinishReason, GenRequest, TokenEvent, validate_request

__all__ = [
    "SGLangServer",
    "SGLangEngine",
    "make_sglang_engine",
    "sglang_engine_factory",
    "write_hf_dir",
    "free_port",
    "init_weight_sender_group",
]

log = logging.getLogger("rlboost.sglang")

_INT64_MAX = (1 << 63) - 1
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16}


# ====================================================================================== process supervision
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path | None, n_lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    if path is None:
        return "(no log file)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    lines = data.splitlines()[-n_lines:]
    return "\n".join(lines) if lines else "(log empty)"


_LIVE_SERVERS: "weakref.WeakSet[SGLangServer]" = weakref.WeakSet()


@atexit.register
def _stop_all_servers() -> None:  # never leave a server behind when the interpreter exits
    for s in list(_LIVE_SERVERS):
        try:
            s.stop(timeout_s=5.0)
        except Exception:
            pass


class SGLangServer:
    """One supervised ``python -m sglang.launch_server`` process.

    Args:
        model_path: HF model directory (config.json + safetensors).
        host / port: where the HTTP server listens (port ``None``: a free port is chosen).
        log_path: file receiving the server's stdout+stderr (default: a new temp file).
        startup_timeout_s: deadline for ``/health`` to answer 200.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when torch sees a GPU, else cpu). On cpu the launch
            adds ``--device cpu --attention-backend torch_native --sampling-backend pytorch`` and
            ``SGLANG_USE_CPU_ENGINE=1``.
        dtype: ``--dtype``; ``"auto"`` is bf16 on cuda and fp32 on cpu (logprob parity with the fp32 trainer and
            torch engine there).
        max_running_requests: ``--max-running-requests`` (the engine's ``max_batch``).
        max_total_tokens: KV-cache size in tokens (``None``: SGLang's memory-fraction default; on CPU we pass
            ``max_running_requests * context_length`` because the CPU default takes a fraction of host RAM).
        context_length: ``--context-length`` (``None``: the model's ``max_position_embeddings``).
        stream_interval: ``--stream-interval``: tokens per streamed chunk (≥ 1). Default 16: per-token chunks
            cost ~20 % throughput on CPU, 16 costs ≈ 0–3 % (benchmarks/bench_sglang.py). A finish or an abort is
            always sent at once with the complete output, so nothing waits for or loses a partial interval;
            only an unwarned kill of the whole instance loses < ``stream_interval`` tokens per response.
        deterministic: ``--enable-deterministic-inference`` (per-request seeded sampling, see module doc).
        weight_version: ``--weight-version`` at start.
        sleep_on_idle: ``--sleep-on-idle`` (default on): an idle scheduler blocks in ``zmq.Poller`` instead of
            spinning a core (it wakes at once on a request). Rollout servers idle while the trainer trains.
        python: interpreter that has sglang installed (default: this one).
        env: extra environment variables for the server (merged over ``os.environ``).
        extra_args: more ``launch_server`` arguments, appended last.
    """

    def __init__(self, model_path: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int | None = None,
                 log_path: str | os.PathLike[str] | None = None, startup_timeout_s: float = 300.0,
                 device: str = "auto", dtype: str = "auto", max_running_requests: int = 32,
                 max_total_tokens: int | None = None, context_length: int | None = None,
                 stream_interval: int = 16, deterministic: bool = False, weight_version: str | int = 0,
                 sleep_on_idle: bool = True,
                 random_seed: int = 0, python: str | None = None, env: Mapping[str, str] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        if stream_interval < 1:
            raise EngineError(f"stream_interval must be ≥ 1, got {stream_interval}")
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.device = device
        self.startup_timeout_s = startup_timeout_s
        self.python = python or sys.executable
        if log_path is None:
            fd, p = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
            log_path = p
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        args = ["--model-path", self.model_path, "--skip-tokenizer-init", "--dtype", dtype,
                "--max-running-requests", str(max_running_requests), "--stream-interval", str(stream_interval),
                "--random-seed", str(random_seed), "--weight-version", str(weight_version),
                "--log-level-http", "warning"]
        if context_length is not None:
            args += ["--context-length", str(context_length)]
        if device == "cpu":
            args += ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch"]
            self.env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            if max_total_tokens is None:
                ctx = context_length or _model_context_length(self.model_path) or 4096
                max_total_tokens = max(max_running_requests * ctx, 2048)
        if max_total_tokens is not None:
            args += ["--max-total-tokens", str(max_total_tokens)]
        if deterministic:
            args += ["--enable-deterministic-inference"]
        if sleep_on_idle:  # otherwise an idle scheduler spins a whole core (measured: 100 % on CPU)
            args += ["--sleep-on-idle"]
        self.deterministic = deterministic
        self.base_args = args
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", *self.base_args, "--host", self.host,
                "--port", str(self.port), *self.extra_args]

    def start(self) -> "SGLangServer":
        """Launch and wait until ``/health`` answers 200.

        Raises:
            EngineError: the process exited during start-up, or the deadline passed (the process group is
                killed); the message holds the command, the exit code and the log tail. A port clash is
                retried once on a fresh port.
        """
        for attempt in range(2):
            if self.port is None or attempt:
                self.port = free_port(self.host)
            self._spawn()
            try:
                self._wait_ready()
                return self
            except EngineError as e:
                clash = "address already in use" in _tail(self.log_path, 200).lower()
                self.stop()
                if attempt == 0 and clash:
                    log.warning("sglang port %d clashed; retrying on another port", self.port)
                    continue
                raise e
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(f"=== rlboost: launching {' '.join(self.command())}\n".encode())
        self.proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
            preexec_fn=die_with_parent)
        _LIVE_SERVERS.add(self)
        log.info("sglang server pid %d on %s (log %s)", self.proc.pid, self.url, self.log_path)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            rc = self.proc.poll() if self.proc is not None else -1
            if rc is not None:
                raise EngineError(f"sglang server exited with code {rc} during start-up "
                                  f"(command: {' '.join(self.command())}); log {self.log_path} tail:\n"
                                  f"{_tail(self.log_path)}")
            try:
                status, _ = _http(self.host, self.port, "GET", "/health", None, timeout=5.0)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"sglang server not healthy within {self.startup_timeout_s:.0f}s "
                                  f"(pid {self.proc.pid}, {self.url}); log {self.log_path} tail:\n"
                                  f"{_tail(self.log_path)}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, n_lines: int = 40) -> str:
        return _tail(self.log_path, n_lines)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server's main process (it tears its children down), SIGKILL the whole process group
        after ``timeout_s``. Idempotent."""
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if p is not None:
            try:  # children (scheduler, detokenizer) too, even if the main process is gone
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _LIVE_SERVERS.discard(self)


def _model_context_length(model_path: str) -> int | None:
    from rlboost_hpc.models.arch import ModelFormatError, arch_from_hf

    try:
        return arch_from_hf(model_path).max_position_embeddings
    except ModelFormatError:
        return None


# ====================================================================================== HTTP helpers
try:  # SGLang depends on orjson, so it is normally there; the stdlib is the fallback
    import orjson as _orjson

    def _loads(b: bytes) -> Any:
        return _orjson.loads(b)

    def _dumps(o: Any) -> bytes:
        return _orjson.dumps(o)
except ImportError:  # pragma: no cover
    def _loads(b: bytes) -> Any:
        return json.loads(b)

    def _dumps(o: Any) -> bytes:
        return json.dumps(o).encode()


def _http(host: str, port: int, method: str, path: str, body: Any, timeout: float) -> tuple[int, Any]:
    """One request; returns ``(status, parsed JSON or text)``. Raises OSError / HTTPException on I/O errors."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return resp.status, parsed
    finally:
        conn.close()


# ====================================================================================== per-request state
@dataclass(eq=False)
class _Req:
    rid: str
    srid: str  # the id the server knows (unique per engine instance and submission)
    input_ids: list[int]
    sampling: dict
    stop: frozenset[int]
    max_new: int
    enforce_stop: bool  # the server cannot express our stop set exactly; we cut the stream ourselves
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    delivered: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    done: bool = False  # no more chunks will be used (final chunk seen, stream ended, or given up)
    error: str | None = None
    aborting: bool = False
    server_aborted: bool = False  # the server ended the request with finish type "abort"
    batch: "_Batch | None" = None


@dataclass(eq=False)
class _Batch:
    """One streaming ``/generate`` call carrying every request added since the previous submission (SGLang
    multiplexes their chunks on one SSE stream, told apart by ``meta_info.id``)."""

    reqs: dict[str, _Req]  # by srid
    thread: threading.Thread | None = None
    conn: http.client.HTTPConnection | None = None


# ====================================================================================== the engine
class SGLangEngine(Engine):
    """:class:`Engine` over an SGLang HTTP server.

    Build with :meth:`launch` (starts and owns a supervised server), :func:`make_sglang_engine` (from the
    manager's HF config + a state dict, for the rollout agent), or the constructor (attach to a running
    server at ``base_url``; ``server`` may be given to supervise it).

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
    """

    def __init__(self, base_url: str, *, max_batch: int = 32, version: int = 0, server: SGLangServer | None = None,
                 owns_server: bool = False, model_config: Mapping[str, Any] | None = None,
                 stall_timeout_s: float = 120.0, abort_timeout_s: float = 30.0, control_timeout_s: float = 600.0,
                 tp_size: int = 1) -> None:
        if max_batch < 1:
            raise EngineError(f"max_batch must be ≥ 1, got {max_batch}")
        u = base_url.rstrip("/")
        if u.startswith("http://"):
            u = u[len("http://"):]
        host, _, port = u.partition(":")
        self.host, self.port = host, int(port or 80)
        self.base_url = f"http://{self.host}:{self.port}"
        self.max_batch = max_batch
        self.server = server
        self.owns_server = owns_server
        self.stall_timeout_s = stall_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.control_timeout_s = control_timeout_s
        self.tp_size = tp_size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._reqs: dict[str, _Req] = {}
        self._order: deque[str] = deque()
        self._unsent: list[_Req] = []  # added, submitted at the next step()/abort()
        self._batches: set[_Batch] = set()
        self._seq = itertools.count()
        self._tag = f"{os.getpid():x}{id(self) & 0xFFFFFF:06x}"
        self._fenced: str | None = None
        self._closed = False
        self.chunks_received = 0  # stream chunks that carried tokens, over the engine's life
        info = self._control("GET", "/model_info", None, what="model_info")
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
        self._version = version
        sinfo = self._server_info()
        self.server_dtype = _DTYPES.get(str(sinfo.get("dtype", "")))
        if isinstance(sinfo.get("context_length"), int):  # --context-length overrides the model's
            self.max_len = min(self.max_len or sinfo["context_length"], sinfo["context_length"])

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def launch(cls, model_path: str | os.PathLike[str], *, max_batch: int = 32, version: int = 0,
               model_config: Mapping[str, Any] | None = None, stall_timeout_s: float = 120.0,
               abort_timeout_s: float = 30.0, control_timeout_s: float = 600.0, **server_kw) -> "SGLangEngine":
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
                       abort_timeout_s=abort_timeout_s, control_timeout_s=control_timeout_s)
        except BaseException:
            server.stop()
            raise

    def close(self) -> None:
        """Abort everything still running (best effort) and stop the server if this engine owns it."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for r in self._reqs.values():
                r.aborting = True
            self._unsent.clear()
            self._reqs.clear()
            self._order.clear()
            batches = list(self._batches)
        for b in batches:
            self._close_batch(b)
        if self.owns_server and self.server is not None:
            self.server.stop()
        d = getattr(self, "_cleanup_dir", None)
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
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        """Record ``v`` and label the server's weights with it (``/update_weight_version`` WITHOUT aborting)."""
        v = int(v)
        if self._fenced is not None and v != self._version:
            raise EngineError(f"cannot label the weights as version {v}: engine fenced ({self._fenced}); "
                              f"load_weights() a complete version instead")
        if v != self._version and v >= 0:
            self._control("POST", "/update_weight_version", {"new_version": str(v), "abort_all_requests": False},
                          what=f"update_weight_version({v})")
        self._version = v

    @property
    def fenced(self) -> str | None:
        """Why the engine refuses requests (a failed weight load), or ``None``."""
        return self._fenced

    # ------------------------------------------------------------------ Engine API
    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._reqs)

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
        if self._fenced is not None:
            raise EngineError(f"request {rid!r}: engine fenced ({self._fenced}); load a complete version first")
        with self._lock:
            if rid in self._reqs:
                raise EngineError(f"request {rid!r}: duplicate rid (already queued or running)")
        checked = validate_request(req, vocab_size=self.vocab_size, max_len=self.max_len)
        sp = checked.sampling
        self._check_server(f"add({rid!r})")
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
        srid = f"{rid}@{self._tag}.{next(self._seq)}"
        r = _Req(rid=rid, srid=srid, input_ids=checked.prompt_ids + checked.prefix_ids, sampling=sampling,
                 stop=stop, max_new=req.max_new_tokens, enforce_stop=enforce)
        with self._lock:
            self._reqs[rid] = r
            self._order.append(rid)
            self._unsent.append(r)

    def step(self) -> list[TokenEvent]:
        """Return every token streamed since the previous call, one event per request.

        Blocks until at least one request has something to report (or none is active), so each call makes
        progress like one iteration of a local engine. Returns ``[]`` only when idle.

        Raises:
            EngineError: the server died (log tail included), a stream broke or returned inconsistent data
                (after the tokens received before the failure were returned by an earlier call), or no
                request received anything for ``stall_timeout_s``.
        """
        self._submit()
        deadline = time.monotonic() + self.stall_timeout_s
        failed: _Req | None = None
        with self._cond:
            while True:
                if not self._reqs:
                    return []
                events, failed = self._collect_locked()
                if events:
                    return events
                if failed is not None:
                    self._reqs.pop(failed.rid, None)
                    self._remove_order(failed.rid)
                    break
                if self.server is not None and not self.server.alive():
                    break
                now = time.monotonic()
                if now > deadline:
                    n = len(self._reqs)
                    break
                self._cond.wait(timeout=min(0.5, deadline - now))
        if failed is not None:
            raise EngineError(self._failure_message(failed))
        if self.server is not None and not self.server.alive():
            raise EngineError(self._crash_message("step()"))
        raise EngineError(f"sglang engine: no token from {self.base_url} for {self.stall_timeout_s:.0f}s with "
                          f"{n} request(s) active; " + self._log_hint())

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
        with self._lock:
            rids = list(self._order)
        evs = self.abort_many(rids)
        return [evs[r] for r in rids if r in evs]

    def abort_many(self, rids: Sequence[str]) -> dict[str, TokenEvent]:
        """:meth:`abort` for several requests at once (one wait for all final chunks): ``{rid: event}`` for
        those with undelivered tokens."""
        with self._lock:
            reqs = [self._reqs[r] for r in rids if r in self._reqs]
            for r in reqs:
                r.aborting = True
                if r in self._unsent:  # never reached the server: nothing was produced
                    self._unsent.remove(r)
                    r.done = True
        deadline = time.monotonic() + self.abort_timeout_s
        next_send = 0.0
        while True:
            with self._lock:
                pending = [r for r in reqs if not r.done]
            if not pending:
                break
            now = time.monotonic()
            dead = self.server is not None and not self.server.alive()
            if now > deadline or dead:
                if not dead:
                    log.warning("abort: no final chunk for %s within %.0fs; returning what was received",
                                [r.rid for r in pending], self.abort_timeout_s)
                with self._lock:
                    for r in pending:
                        r.done = True  # later chunks of these are ignored
                break
            if now >= next_send:
                for r in pending:  # re-sent while the server has not registered the request yet
                    try:
                        _http(self.host, self.port, "POST", "/abort_request", {"rid": r.srid}, timeout=10.0)
                    except (OSError, http.client.HTTPException) as e:
                        log.warning("abort(%s): /abort_request failed: %s", r.rid, e)
                next_send = now + 0.25
            with self._cond:
                if any(not r.done for r in pending):
                    self._cond.wait(timeout=0.02)
        out: dict[str, TokenEvent] = {}
        with self._lock:
            for r in reqs:
                self._reqs.pop(r.rid, None)
                self._remove_order(r.rid)
                ids, lps = r.ids[r.delivered:], r.lps[r.delivered:]
                r.delivered = len(r.ids)
                if ids or r.finished:
                    out[r.rid] = TokenEvent(rid=r.rid, token_ids=list(ids), logprobs=list(lps), finished=r.finished,
                                            finish_reason=r.finish_reason if r.finished else None)
        return out

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a complete version through ``/update_weights_from_tensor`` and label the server with it.

        Sequence: validate → ``/begin_weight_update`` → ``/update_weights_from_tensor`` (shared-memory
        tensors, ``weight_version``, ``flush_cache``, never aborting) → ``/end_weight_update`` →
        ``/flush_cache`` → check the server's weight version. Sets :attr:`version` on success.

        Raises:
            EngineError: requests are active (nothing changes); a tensor is missing/unexpected/misshapen
                (nothing changes); or any server reply is a failure — then the engine is fenced
                (``version = -1``, :meth:`add` refused) until a later load succeeds.
        """
        if self.num_active:
            raise EngineError(f"load_weights(version={version}) refused: {self.num_active} request(s) active; "
                              f"drain or abort them first")
        self._validate_state_dict(state_dict, version)
        self._check_server(f"load_weights(version={version})")
        t0 = time.monotonic()
        try:
            # one shared-memory copy, alive until the server answered; one pickle per TP rank (each pickle
            # takes its own reference on the shared segments, each rank's unpickling releases one)
            shared = [(k, _as_shared(v, self.server_dtype)) for k, v in state_dict.items()]
            payloads = [serialize_named_tensors(shared) for _ in range(self.tp_size)]
            self._weight_session(
                lambda: self._control("POST", "/update_weights_from_tensor", {
                    "serialized_named_tensors": payloads,
                    "flush_cache": True, "abort_all_requests": False, "weight_version": str(version)},
                    what=f"update_weights_from_tensor(version={version})"),
                version)
            del shared, payloads
        except EngineError as e:
            self._fence(str(e))
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
        self._with_peer(lambda: self._control("POST", "/init_weights_update_group", body,
                                              what="init_weights_update_group"), join)

    def load_weights_from_distributed(self, params: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: int,
                                      send: Callable[[], Any], group_name: str = "rlboost_weights") -> None:
        """Load a version broadcast by the weight holders over the group of :meth:`init_weight_update_group`.

        ``params`` lists (HF name, dtype, shape) in broadcast order; ``send`` runs the holders' broadcasts
        (``torch.distributed.broadcast(t, src=0, group=g)`` for each tensor, in that order) concurrently with
        the server's ``/update_weights_from_distributed`` call. Wrapped in ``/begin_weight_update`` …
        ``/end_weight_update`` + ``/flush_cache`` like :meth:`load_weights`; same refusal and fencing rules.
        """
        if self.num_active:
            raise EngineError(f"load_weights_from_distributed(version={version}) refused: {self.num_active} "
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
                lambda: self._control("POST", "/update_weights_from_distributed", body,
                                      what=f"update_weights_from_distributed(version={version})"), send), version)
        except EngineError as e:
            self._fence(str(e))
            raise

    # ------------------------------------------------------------------ weights internals
    def _weight_session(self, load: Callable[[], Any], version: int) -> None:
        begin = {"selector": "all"}
        try:
            self._control("POST", "/begin_weight_update", begin, what="begin_weight_update")
        except EngineError as e:
            if "already open" not in str(e):
                raise
            # a session left open by an earlier failed load: close it, then begin afresh
            self._control("POST", "/end_weight_update", {}, what="end_weight_update (stale session)")
            self._control("POST", "/begin_weight_update", begin, what="begin_weight_update")
        try:
            load()
        except BaseException:
            try:
                self._control("POST", "/end_weight_update", {}, what="end_weight_update (after failure)")
            except EngineError as e2:
                log.warning("sglang: closing the weight-update session failed too: %s", e2)
            raise
        self._control("POST", "/end_weight_update", {}, what="end_weight_update")
        self._control("POST", "/flush_cache", None, what="flush_cache")
        got = self._control("GET", "/model_info", None, what="model_info").get("weight_version")
        if str(got) != str(version):
            raise EngineError(f"sglang: server reports weight_version {got!r} after loading version {version}")
        self._version = int(version)
        self._fenced = None

    def _fence(self, why: str) -> None:
        self._fenced = why.splitlines()[0][:300]
        self._version = -1

    def _validate_state_dict(self, state_dict: Mapping[str, Any], version: int) -> None:
        if self.arch is None:
            return
        from rlboost_hpc.models.arch import ModelFormatError, validate_state_dict

        try:
            validate_state_dict(self.arch, state_dict, source=f"load_weights(version={version})")
        except ModelFormatError as e:
            raise EngineError(str(e)) from None

    def _server_info(self) -> dict:
        try:
            info = self._control("GET", "/server_info", None, what="server_info", timeout=30.0)
        except EngineError:
            return {}
        return info if isinstance(info, dict) else {}

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
        t.join(timeout=self.control_timeout_s)
        if t.is_alive():
            raise EngineError(f"sglang control call still running after {self.control_timeout_s:.0f}s")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    # ------------------------------------------------------------------ control calls
    def _control(self, method: str, path: str, body: Any, what: str, timeout: float | None = None) -> Any:
        """A control call whose reply is always checked."""
        try:
            status, reply = _http(self.host, self.port, method, path, body, timeout or self.control_timeout_s)
        except (OSError, http.client.HTTPException) as e:
            raise EngineError(f"sglang {what}: {self.base_url}{path} unreachable: {type(e).__name__}: {e}; "
                              + self._log_hint()) from None
        ok = 200 <= status < 300
        if ok and isinstance(reply, dict) and reply.get("success") is False:
            ok = False
        if not ok:
            msg = reply.get("message", reply) if isinstance(reply, dict) else reply
            raise EngineError(f"sglang {what} failed (HTTP {status}): {msg}; " + self._log_hint())
        return reply

    def _dies_within(self, grace_s: float) -> bool:
        deadline = time.monotonic() + grace_s
        while self.server.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _check_server(self, what: str) -> None:
        if self.server is not None and not self.server.alive():
            raise EngineError(self._crash_message(what))

    def _crash_message(self, what: str) -> str:
        s = self.server
        assert s is not None
        return (f"sglang server died (exit code {s.returncode()}, {s.url}) — {what}; log {s.log_path} tail:\n"
                f"{s.log_tail()}")

    def _log_hint(self) -> str:
        if self.server is None:
            return "server not supervised by this engine (see its own log)"
        state = "alive" if self.server.alive() else f"DEAD (exit code {self.server.returncode()})"
        return f"server {state}; log {self.server.log_path} tail:\n{self.server.log_tail()}"

    # ------------------------------------------------------------------ streaming internals
    def _remove_order(self, rid: str) -> None:
        try:
            self._order.remove(rid)
        except ValueError:
            pass

    def _collect_locked(self) -> tuple[list[TokenEvent], _Req | None]:
        events: list[TokenEvent] = []
        failed: _Req | None = None
        for rid in list(self._order):
            r = self._reqs[rid]
            new = len(r.ids) - r.delivered
            if new > 0 or r.finished:  # a finished request's tokens are final (later chunks are ignored)
                ev = TokenEvent(rid=rid, token_ids=r.ids[r.delivered:], logprobs=r.lps[r.delivered:])
                r.delivered = len(r.ids)
                if r.finished:
                    ev.finished, ev.finish_reason = True, r.finish_reason
                    del self._reqs[rid]
                    self._order.remove(rid)
                events.append(ev)
            elif r.done and not r.finished and failed is None:
                failed = r
        return events, failed

    def _failure_message(self, r: _Req) -> str:
        # a broken stream is usually the server dying: its sockets close before the exit status is visible
        if self.server is not None and self._dies_within(2.0):
            return self._crash_message(f"request {r.rid!r} after {len(r.ids)} token(s)")
        why = r.error or ("aborted by the server" if r.server_aborted else "stream ended without a finish")
        return f"sglang request {r.rid!r} failed after {len(r.ids)} token(s): {why}; " + self._log_hint()

    def _close_batch(self, b: _Batch) -> None:
        c = b.conn
        if c is not None:
            try:
                if c.sock is not None:
                    c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _submit(self) -> None:
        """Send every queued request as one streaming ``/generate`` call, read by one thread."""
        with self._lock:
            reqs, self._unsent = self._unsent, []
        if not reqs:
            return
        if len(reqs) == 1:
            r = reqs[0]
            body = {"input_ids": r.input_ids, "sampling_params": r.sampling, "rid": r.srid}
        else:
            body = {"input_ids": [r.input_ids for r in reqs], "sampling_params": [r.sampling for r in reqs],
                    "rid": [r.srid for r in reqs]}
        body.update(return_logprob=True, logprob_start_len=-1, stream=True)
        b = _Batch(reqs={r.srid: r for r in reqs})
        for r in reqs:
            r.batch = b
        b.thread = threading.Thread(target=self._stream, args=(b, body), name=f"sglang-{reqs[0].rid}+{len(reqs) - 1}",
                                    daemon=True)
        with self._lock:
            self._batches.add(b)
        b.thread.start()

    def _stream(self, b: _Batch, body: dict) -> None:
        """Reader thread: POST /generate (stream) and fold every chunk into its request."""
        err: str | None = None
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.stall_timeout_s)
            b.conn = conn
            conn.request("POST", "/generate", body=_dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                err = f"HTTP {resp.status}: {resp.read()[:2000].decode('utf-8', 'replace')}"
            else:
                for line in resp:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    self._dispatch(b, _loads(data))
        except (OSError, http.client.HTTPException, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
        finally:
            try:
                if b.conn is not None:
                    b.conn.close()
            except Exception:
                pass
            with self._cond:
                for r in b.reqs.values():
                    if not r.done:
                        if not r.finished and not r.aborting and r.error is None:
                            r.error = err or "stream ended without a finish"
                        r.done = True
                self._batches.discard(b)
                self._cond.notify_all()

    def _dispatch(self, b: _Batch, chunk: dict) -> None:
        meta = chunk.get("meta_info") or {}
        r = b.reqs.get(meta.get("id"))
        if r is None:
            if "error" in chunk or "object" in chunk:
                raise ValueError(f"server error on the stream: {str(chunk)[:2000]}")
            raise ValueError(f"chunk for unknown request id {meta.get('id')!r}")
        if r.done:
            return
        try:
            cut = self._fold(r, chunk, meta)
        except EngineError as e:
            with self._cond:
                r.error, r.done = str(e), True
                self._cond.notify_all()
            cut = not r.aborting
        if cut:  # we ended it before the server did (our stop set) or it broke: stop it server-side
            threading.Thread(target=self._abort_quietly, args=(r.srid,), daemon=True).start()

    def _fold(self, r: _Req, chunk: dict, meta: dict) -> bool:
        """Merge one chunk into ``r``; True when the server-side request must be aborted."""
        out_ids = chunk.get("output_ids") or []
        lp_entries = meta.get("output_token_logprobs") or []
        total = meta.get("completion_tokens")
        with self._cond:
            have = len(r.ids)
            total = len(out_ids) if total is None else int(total)  # no count: a cumulative chunk
            need = total - have
            if need < 0:
                raise EngineError(f"chunk reports {total} tokens, {have} already received")
            # cumulative chunk: full lists; incremental chunk: the last `need` entries
            if len(out_ids) == total and len(lp_entries) == total:
                new_ids, new_lp = out_ids[have:], lp_entries[have:]
            elif len(out_ids) == need and len(lp_entries) == need:
                new_ids, new_lp = out_ids, lp_entries
            elif need == 0 and not out_ids:
                new_ids, new_lp = [], []
            else:
                raise EngineError(f"inconsistent chunk: completion_tokens={total}, {have} received, "
                                  f"{len(out_ids)} output_ids, {len(lp_entries)} logprobs")
            ids = [int(t) for t in new_ids]
            if ids:
                self.chunks_received += 1  # streamed pieces (whatever a consumer's step() merges)
            lps = []
            for t, e in zip(ids, new_lp):
                if int(e[1]) != t:
                    raise EngineError(f"logprob entry for token {e[1]} where output_ids has {t}")
                lps.append(float(e[0]))
            fr = meta.get("finish_reason")
            ftype = fr.get("type") if isinstance(fr, dict) else fr
            # our stop set / budget, enforced on every token (exact semantics whatever the server does)
            for i, t in enumerate(ids):
                if r.finished:
                    break
                r.ids.append(t)
                r.lps.append(lps[i])
                if t in r.stop:
                    r.finished, r.finish_reason = True, "stop"
                elif len(r.ids) >= r.max_new:
                    r.finished, r.finish_reason = True, "length"
            cut = False
            if r.finished:
                cut = ftype is None  # the server would go on: abort it there
                r.done = True
            elif ftype in ("stop", "length"):
                # the server ended on its own rule; must agree with ours (stop token or budget)
                last = r.ids[-1] if r.ids else None
                if ftype == "stop" and last in r.stop:
                    r.finished, r.finish_reason = True, "stop"
                elif ftype == "length" and len(r.ids) >= r.max_new:
                    r.finished, r.finish_reason = True, "length"
                else:
                    raise EngineError(f"server finished with {fr!r} after {len(r.ids)} token(s) (last {last}), "
                                      f"which our stop set {sorted(r.stop)} / budget {r.max_new} does not explain")
                r.done = True
            elif ftype is not None:  # "abort" (ours or someone else's) or anything new
                r.server_aborted = not r.aborting
                if r.server_aborted:
                    r.error = f"ended by the server: {fr!r}"
                r.done = True
            self._cond.notify_all()
        return cut

    def _abort_quietly(self, srid: str) -> None:
        try:
            _http(self.host, self.port, "POST", "/abort_request", {"rid": srid}, timeout=10.0)
        except (OSError, http.client.HTTPException):
            pass


# ====================================================================================== weights: serialization
def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What ``/update_weights_from_tensor`` expects per TP rank: base64 of ``ForkingPickler`` of a list of
    ``(name, tensor)`` (SGLang's ``MultiprocessingSerializer``).

    CPU tensors travel as shared-memory file names: the sharing strategy must be ``file_system`` (the default
    ``file_descriptor`` strategy pickles fds that cannot cross HTTP and crashes the server's scheduler), so
    this sets it for the whole process. Keep the tensors alive until the server has answered.
    """
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler

    if tmp.get_sharing_strategy() != "file_system":
        tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _as_shared(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A shared-memory copy of ``t`` (one copy; the caller's tensor is left untouched)."""
    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() != "file_system":
        tmp.set_sharing_strategy("file_system")
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


# ====================================================================================== factory for the agent
def write_hf_dir(model_config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor] | None,
                 out_dir: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (what ``--model-path`` needs; no tokenizer: the server
    runs with ``--skip-tokenizer-init``). Tied copies (``lm_head.weight`` equal to the embedding) are kept.
    ``state_dict=None`` writes the config only (for ``--load-format dummy``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:
        from safetensors.torch import save_file

        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(model_config)  # the model's own config.json (architectures, model_type: what SGLang dispatches on)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def make_sglang_engine(model_config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor] | None,
                       max_batch: int = 32, *, work_dir: str | os.PathLike[str] | None = None, version: int = 0,
                       **launch_kw) -> SGLangEngine:
    """Build an :class:`SGLangEngine` the way the rollout agent builds engines: write the manager's HF config and
    the first pulled weights to ``work_dir`` (default: a temp dir), launch a supervised server on them.

    ``state_dict=None`` starts the server on random weights (``--load-format dummy``, no weight file) so it
    can boot while the first version is still being pulled; the engine is then FENCED (``version == -1``,
    :meth:`SGLangEngine.add` refused) until :meth:`SGLangEngine.load_weights` succeeds.

    ``launch_kw`` go to :meth:`SGLangEngine.launch` / :class:`SGLangServer` (``device``, ``dtype``,
    ``stream_interval``, ``deterministic``, ``startup_timeout_s``, ``log_path``, ``env``, ``python``, …).
    """
    # the pid in the name lets the next attempt on this node reclaim it after a SIGKILL (procutil.reclaim_leftovers)
    d = Path(work_dir) if work_dir is not None else Path(
        tempfile.mkdtemp(prefix=f"rlboost-sglang-model-{os.getpid()}-"))
    write_hf_dir(model_config, state_dict, d)
    launch_kw.setdefault("log_path", d / "server.log")
    if state_dict is None:
        launch_kw["extra_args"] = [*launch_kw.get("extra_args", ()), "--load-format", "dummy"]
        launch_kw.setdefault("weight_version", "none")
    eng = SGLangEngine.launch(d, max_batch=max_batch, version=version if state_dict is not None else -1,
                              model_config=model_config, **launch_kw)
    if state_dict is None:
        eng._fence("no weights loaded yet (started with dummy weights)")
    if work_dir is None:
        eng._cleanup_dir = d  # a temp dir of ours: removed (weights; the log is kept) by close()
    return eng


def sglang_engine_factory(max_batch: int, **launch_kw) -> Callable[[dict, Mapping], Engine]:
    """An ``EngineFactory`` for :class:`rlboost_hpc.rollout.agent.RolloutAgent` (``engine_factory=``)."""

    def make(model_config: dict, state_dict: Mapping, arch=None) -> Engine:  # the server reads config.json itself
        return make_sglang_engine(model_config, state_dict, max_batch, **launch_kw)

    return make
