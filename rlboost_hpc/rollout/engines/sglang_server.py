"""The SGLang server process behind :class:`~rlboost_hpc.rollout.engines.sglang_engine.SGLangEngine`: start,
supervise and stop one ``python -m sglang.launch_server``; the model directory it serves; plain HTTP/JSON calls.

Invariants:
- the server runs in its own session (killed as a group by :meth:`close`, at interpreter exit
  and, on Linux, when this process dies: ``PR_SET_PDEATHSIG``); its output goes to a log file; start-up has
  a deadline; a dead server or a stalled stream raises :class:`EngineError` carrying the log tail.
- Nothing here imports ``sglang``: the server may run in another Python environment than this process.
"""
from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.procutil import die_with_parent
from rlboost_hpc.rollout.engines.base import EngineError

__all__ = ["SGLangControl", "SGLangServer", "fast_dumps", "fast_loads", "free_port", "http_json", "write_hf_dir"]

log = logging.getLogger("rlboost.sglang")


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
        incremental_streaming: ``--incremental-streaming-output`` (default off). On, each chunk carries only its
            new tokens — O(n) ids and logprobs per response of n tokens instead of the cumulative chunks'
            O(n² / stream_interval) — but SGLang 0.5.23 then answers an abort of a request it holds queued (one it
            retracted for memory, with tokens already generated) with only the last output id: the tokens since
            the previous chunk would be lost at a preemption's hand-off. Off: cumulative chunks, whose lists may
            run ahead of their count (the engine reads both forms; benchmarks/bench_sglang.py compares them).
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
                 device: str = "auto", dtype: str = "auto", max_running_requests: int = D.MAX_BATCH,
                 max_total_tokens: int | None = None, context_length: int | None = None,
                 stream_interval: int = 16, deterministic: bool = False, weight_version: str | int = 0,
                 sleep_on_idle: bool = True, incremental_streaming: bool = False,
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
        if incremental_streaming:
            args.append("--incremental-streaming-output")
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
                status, _ = http_json(self.host, self.port, "GET", "/health", None, timeout=5.0)
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

    def fast_loads(b: bytes) -> Any:
        """JSON bytes → object (orjson when installed, else the stdlib)."""
        return _orjson.loads(b)

    def fast_dumps(o: Any) -> bytes:
        """Object → JSON bytes (orjson when installed, else the stdlib)."""
        return _orjson.dumps(o)
except ImportError:  # pragma: no cover
    def fast_loads(b: bytes) -> Any:
        return json.loads(b)

    def fast_dumps(o: Any) -> bytes:
        return json.dumps(o).encode()


def http_json(host: str, port: int, method: str, path: str, body: Any, timeout: float) -> tuple[int, Any]:
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


class SGLangControl:
    """Checked calls to one SGLang server, and what to say when it fails: the server's ``host`` and ``port``, the
    supervised ``server`` behind them (None: attached to a server this process does not run; it is then taken as
    alive) and the deadline of each call (``timeout_s``, seconds). Shared by the engine and its collaborators
    (streams, weight updates, adapters); it holds nothing else.
    """

    def __init__(self, host: str, port: int, server: SGLangServer | None, timeout_s: float) -> None:
        self.host, self.port, self.server, self.timeout_s = host, port, server, timeout_s

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, method: str, path: str, body: Any, what: str, timeout: float | None = None) -> Any:
        """A control call whose reply is always checked; returns the parsed reply.

        Raises:
            EngineError: the server is unreachable, answers a non-2xx status or ``"success": false`` (its message
                and the log tail included).
        """
        try:
            status, reply = http_json(self.host, self.port, method, path, body, timeout or self.timeout_s)
        except (OSError, http.client.HTTPException) as e:
            raise EngineError(f"sglang {what}: {self.base_url}{path} unreachable: {type(e).__name__}: {e}; "
                              + self.log_hint()) from None
        ok = 200 <= status < 300
        if ok and isinstance(reply, dict) and reply.get("success") is False:
            ok = False
        if not ok:
            msg = reply.get("message", reply) if isinstance(reply, dict) else reply
            raise EngineError(f"sglang {what} failed (HTTP {status}): {msg}; " + self.log_hint())
        return reply

    def alive(self) -> bool:
        """The supervised server runs (an unsupervised one: True)."""
        return self.server is None or self.server.alive()

    def check(self, what: str) -> None:
        """Raise :class:`EngineError` with the crash message when the supervised server died."""
        if not self.alive():
            raise EngineError(self.crash_message(what))

    def dies_within(self, grace_s: float) -> bool:
        """The supervised server exits within ``grace_s`` seconds (an unsupervised one: False at once)."""
        if self.server is None:
            return False
        deadline = time.monotonic() + grace_s
        while self.server.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def crash_message(self, what: str) -> str:
        """The supervised server's exit status and log tail, for an error of ``what``."""
        s = self.server
        assert s is not None
        return (f"sglang server died (exit code {s.returncode()}, {s.url}) — {what}; log {s.log_path} tail:\n"
                f"{s.log_tail()}")

    def log_hint(self) -> str:
        """Where to look: the supervised server's state and log tail."""
        if self.server is None:
            return "server not supervised by this engine (see its own log)"
        state = "alive" if self.server.alive() else f"DEAD (exit code {self.server.returncode()})"
        return f"server {state}; log {self.server.log_path} tail:\n{self.server.log_tail()}"


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
