"""The run directory: the one place where a trainer job and its rollout jobs meet on a shared filesystem.

Layout (owner in parentheses):
- ``endpoints.json`` (trainer): ``{"manager": "tcp://host:port", "weights": "tcp://host:port", "run_id": str,
  "worker": {...}, "written_at": unix s}`` — where rollout jobs register and pull weights, and every rollout
  setting they run with (``rollout/spec.py``).
- ``target.json`` (trainer; read by the scavenger): :class:`TargetFile` — how many preemptible rollout jobs the
  run wants now, of which size; ``active: false`` ends the run's harvesting.
- ``capacity.json`` (scavenger; read by the trainer at step boundaries): :class:`CapacityView`.
- ``events.jsonl`` (scavenger and rollout jobs, append-only): job life-cycle events for statistics.
- ``report.json``, ``metrics.jsonl``, ``run.png`` (trainer): results.
- ``prometheus/<job>.json`` (trainer: ``rlboost-manager``; scavenger: ``rlboost-scavenger``): file_sd targets.
- ``trackers.json`` (trainer; read by the scavenger and a resumed trainer): the experiment-tracker runs the run logs
  to (``trainer.report_to``, ``observe/trackers.py``); ``tensorboard/`` (TensorBoard event files; the scavenger's
  under ``tensorboard/scavenger/``), ``mlruns/`` (MLflow's file store when ``MLFLOW_TRACKING_URI`` is unset),
  ``wandb/`` (Weights & Biases' run files).

- ``manager-journal.jsonl`` (manager): epochs and weight versions for crash-resume; ``manager-work.log`` (manager):
  the step in flight, for a restarted manager (binary, ``manager/worklog.py``); ``checkpoints/`` (trainer);
  ``workers/`` (rollout workers' and engines' logs); ``keys/`` (CURVE keys, owner-only); ``logs/<role>.jsonl``
  (trainer, manager: their JSON log lines, appended by every incarnation).

Every name above is spelled once, here (:class:`RunDir`); other modules ask it for paths.

Invariant: JSON files are replaced atomically (write to a temporary file in the same directory, fsync, rename),
so a reader never sees a half-written file.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import msgspec

from rlboost_hpc.errors import BadInput


class RunDirError(BadInput, RuntimeError):
    """The run directory does not (yet) hold what a job needs; the message says which file and why."""


ENDPOINTS_FILE = "endpoints.json"
TARGET_FILE = "target.json"
CAPACITY_FILE = "capacity.json"
EVENTS_FILE = "events.jsonl"
REPORT_FILE = "report.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # trainer.log_samples rows of each step (prompt, response, reward and its parts)
PLOT_FILE = "run.png"
JOURNAL_FILE = "manager-journal.jsonl"
WORK_LOG_FILE = "manager-work.log"  # the step in flight (manager/worklog.py)
CHECKPOINTS_DIR = "checkpoints"
WORKERS_DIR = "workers"
PROMETHEUS_DIR = "prometheus"
LOGS_DIR = "logs"
CONFIG_FILE = "config.json"  # the run's resolved configuration
MODEL_DIR = "model"  # the trained policy (trainer.export_model); LoRA: the merged model (trainer.lora.export_merged)
ADAPTER_DIR = "adapter"  # LoRA: the trained adapter in PEFT's format (trainer.export_model)
TRACKERS_FILE = "trackers.json"  # the experiment-tracker runs of trainer.report_to (observe/trackers.py)
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (``root``): the only place the layout's names are spelled."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def endpoints(self) -> Path:
        return self.root / ENDPOINTS_FILE

    @property
    def target(self) -> Path:
        return self.root / TARGET_FILE

    @property
    def capacity(self) -> Path:
        return self.root / CAPACITY_FILE

    @property
    def events(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def report(self) -> Path:
        return self.root / REPORT_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES_FILE

    @property
    def plot(self) -> Path:
        return self.root / PLOT_FILE

    @property
    def journal(self) -> Path:
        return self.root / JOURNAL_FILE

    @property
    def work_log(self) -> Path:
        return self.root / WORK_LOG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def workers(self) -> Path:
        return self.root / WORKERS_DIR

    @property
    def prometheus(self) -> Path:
        return self.root / PROMETHEUS_DIR

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def scavenger_log(self) -> Path:
        """The scavenger's output when a launcher starts it in the background (``sbatch/launch --detach`` spells it
        too)."""
        return self.root / LOGS_DIR / "scavenger.log"

    @property
    def scavenger_pid(self) -> Path:
        """The pid of a scavenger started in the background (``sbatch/launch --detach`` spells it too)."""
        return self.root / "scavenger.pid"

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def model(self) -> Path:
        return self.root / MODEL_DIR

    @property
    def trackers(self) -> Path:
        return self.root / TRACKERS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def mlruns(self) -> Path:
        return self.root / MLFLOW_DIR

    @property
    def adapter(self) -> Path:
        return self.root / ADAPTER_DIR

    def create(self) -> "RunDir":
        """Make the run directory (and its parents) if it does not exist; returns ``self``.

        Raises:
            RunDirError: the path (or a parent) is a file, or it cannot be created (permissions, read-only
                filesystem); the message names the path and the reason.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            what = "is a file, not a directory" if self.root.is_file() else (e.strerror or str(e)).lower()
            raise RunDirError(f"{self.root}: cannot be used as a run directory ({what})") from None
        return self

    def require(self, what: str) -> "RunDir":
        """``self`` when the run directory exists; ``what`` names the command that needs it (in the message).

        Raises:
            RunDirError: no such directory (a mistyped path must not become an empty run).
        """
        if not self.root.is_dir():
            raise RunDirError(f"no such run directory: {self.root} ({what} needs an existing run directory)")
        return self

    def run_id(self) -> str:
        """The run's id: ``$RLBOOST_RUN_ID`` when a launcher set it (the Slurm launcher and the scavenger's rollout
        jobs carry it), else the directory's name. The one reader of that variable."""
        return os.environ.get("RLBOOST_RUN_ID") or self.root.resolve().name

    def read_report(self) -> dict:
        """``report.json`` as a dict.

        Raises:
            RunDirError: it is missing or not a JSON object (names the file).
        """
        try:
            data = json.loads(self.report.read_text())
        except (OSError, ValueError) as e:
            raise RunDirError(f"{self.report}: cannot read the run's report ({e})") from None
        if not isinstance(data, dict):
            raise RunDirError(f"{self.report}: not a JSON object")
        return data

    # ---------------------------------------------------------------- the files it holds (one reader, one writer)
    def write_endpoints(self, manager: str, weights: str, run_id: str, curve: bool = False, metrics: str = "",
                        worker: dict | None = None) -> None:
        """Replace ``endpoints.json`` atomically. ``curve``: the servers require the run's CURVE keys
        (``keys/keys.json``, protocol/auth.py); ``metrics``: the manager's Prometheus URL; ``worker``: every rollout
        setting workers build from (``rollout/spec.py`` ``WorkerSpec.to_json()``; absent: the spec's defaults)."""
        write_json_atomic(self.endpoints, {"manager": manager, "weights": weights, "run_id": run_id, "curve": curve,
                                           "metrics": metrics, "worker": worker, "written_at": time.time()})

    def read_endpoints(self, wait_s: float = 0.0, poll_s: float = 0.5,
                       stop: Callable[[], bool] | None = None) -> dict | None:
        """``endpoints.json``, waiting up to ``wait_s`` seconds for the trainer to write it; ``None`` as soon as
        ``stop()`` is true while waiting (e.g. the waiting worker was preempted) — only then.

        Raises:
            RunDirError: not there after ``wait_s``, or unreadable/missing keys.
        """
        path = self.endpoints
        deadline = time.monotonic() + wait_s
        while not path.exists():
            if stop is not None and stop():
                return None
            if time.monotonic() >= deadline:
                raise RunDirError(f"{path} does not exist after {wait_s:.0f} s: is the trainer job running and is "
                                  f"{self.root} on a filesystem both jobs share?")
            time.sleep(poll_s)
        try:
            data = json.loads(path.read_text())
            _ = data["manager"], data["weights"]
        except (ValueError, KeyError, TypeError) as e:
            raise RunDirError(f"{path} is malformed ({e}); expected keys manager, weights") from None
        return data

    def write_file_sd(self, job: str, url: str, run_id: str) -> Path:
        """Prometheus file-based service discovery for one of the run's endpoints: ``prometheus/<job>.json`` =
        ``[{"targets": ["host:port"], "labels": {"job", "run", "__metrics_path__"}}]`` (point ``file_sd_configs``
        at ``RUN_DIR/prometheus/*.json``). Written atomically; returns its path."""
        from urllib.parse import urlsplit

        u = urlsplit(url)
        path = self.prometheus / f"{job}.json"
        write_json_atomic(path, [{"targets": [u.netloc], "labels": {"job": job, "run": run_id,
                                                                      "__metrics_path__": u.path or "/metrics"}}])
        return path

    def write_target(self, n_prem: int, active: bool, step: int, gpus_per_instance: int | None = None,
                     wanted: int | None = None) -> None:
        """Replace ``target.json`` (:class:`TargetFile`) atomically; ``gpus_per_instance`` and ``wanted`` are left
        out when ``None``."""
        data = msgspec.structs.asdict(TargetFile(n_prem=int(n_prem), active=bool(active), step=step,
                                                 gpus_per_instance=gpus_per_instance, wanted=wanted))
        for key in ("gpus_per_instance", "wanted"):
            if data[key] is None:
                del data[key]
        write_json_atomic(self.target, data)

    def read_target(self) -> "TargetFile | None":
        """``target.json`` (``None`` when the trainer has written none). Raises RunDirError when malformed."""
        return _read_struct(self.target, TargetFile)

    def write_capacity(self, view: "CapacityView") -> None:
        """Replace ``capacity.json`` atomically (the scavenger, at every reconciliation)."""
        write_json_atomic(self.capacity, msgspec.structs.asdict(view))

    def read_capacity(self) -> "CapacityView | None":
        """``capacity.json`` (``None`` when the scavenger has written none). Raises RunDirError when malformed."""
        return _read_struct(self.capacity, CapacityView)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (same-directory temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_jsonl(path: str | os.PathLike[str]) -> list[dict]:
    """The JSON-object lines of ``path`` in order (``metrics.jsonl``, the scavenger's reconcile log): ``[]`` when
    the file is missing; a torn or malformed line (a crash mid-write) is skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class TargetFile(msgspec.Struct, kw_only=True):
    """``target.json``, written by the trainer and read by the scavenger: ``n_prem`` live rollout jobs to keep while
    ``active`` (``false`` ends the run's harvesting) — the N_prem cap, clamped to the capacity the run was last
    offered; ``wanted`` how many the run could use — the same law before that clamp, what the scavenger asks a
    shared pool (the harvest service) for (absent: ``n_prem``); ``step`` the RL step that set it (−1: the run ended
    before its first); ``gpus_per_instance`` (when set) the GPUs each rollout job must ask for (``--gres=gpu:N``)."""

    n_prem: Annotated[int, msgspec.Meta(ge=0)]
    active: bool = True
    step: int | None = None
    gpus_per_instance: Annotated[int, msgspec.Meta(ge=0)] | None = None
    wanted: Annotated[int, msgspec.Meta(ge=0)] | None = None


class CapacityView(msgspec.Struct, kw_only=True, frozen=True):
    """``capacity.json``, the scavenger's view of capacity at one reconciliation (read by the trainer at step
    boundaries): ``live_jobs`` rollout jobs of the run live and not leaving, ``idle_slots`` more that its partition
    could start now (free GPUs ÷ GPUs per job, summed over nodes), ``gpus_per_instance`` the job size it counted
    with, ``ts`` epoch seconds."""

    live_jobs: Annotated[int, msgspec.Meta(ge=0)]
    idle_slots: Annotated[int, msgspec.Meta(ge=0)]
    gpus_per_instance: int
    ts: float


def _read_struct(path: Path, kind: type):
    """``path`` decoded as ``kind`` (``None`` when the file does not exist).

    Raises:
        RunDirError: unreadable, not JSON, or not of ``kind``'s shape (the message names the file and the field).
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RunDirError(f"{path}: unreadable ({e})") from None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise RunDirError(f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise RunDirError(f"{path}: not JSON ({e})") from None


def advertised(endpoint: str, host: str) -> str:
    """Replace a wildcard bind address in ``tcp://0.0.0.0:port`` by ``host`` (what peers should dial)."""
    proto, rest = endpoint.split("://", 1)
    bound_host, port = rest.rsplit(":", 1)
    if bound_host in ("0.0.0.0", "*", "[::]", "::"):
        bound_host = host
    return f"{proto}://{bound_host}:{port}"
