"""The experiment trackers of ``trainer.report_to`` — TensorBoard, MLflow, Weights & Biases — behind one interface
(:class:`Tracker`), and where a run keeps its tracker runs (``RUN_DIR/trackers.json``).

Each tracker is an optional dependency with its own extra (``pip install 'rlboost-hpc[mlflow]'``);
:func:`check_installed` refuses a configured tracker that is not importable, naming the extra. Where each writes:

- TensorBoard: event files under ``RUN_DIR/tensorboard/`` (the scavenger's under ``tensorboard/scavenger/``). A
  resumed incarnation starts its file with TensorBoard's purge marker at the step it resumes from, so steps the
  crashed incarnation made after its last checkpoint are replaced, not doubled.
- MLflow: ``MLFLOW_TRACKING_URI`` (a server, a database), else a file store under ``RUN_DIR/mlruns`` (which
  recent MLflow releases keep in maintenance mode: it is allowed for this client only, the process environment is
  left as it was); experiment ``MLFLOW_EXPERIMENT_NAME``, else ``rlboost-hpc``. MLflow cannot delete a metric's
  points: a resume that redoes logged steps continues in a fork (a new run with the history before the resume
  step; the old one KILLED, tagged ``rlboost.superseded_by``), so each step is held once.
- Weights & Biases: its own environment (``WANDB_MODE``, ``WANDB_PROJECT`` (default ``rlboost-hpc``),
  ``WANDB_ENTITY``, ``WANDB_API_KEY``); its run files under ``RUN_DIR/wandb/`` — with ``WANDB_MODE=offline``
  nothing goes over the network and ``wandb sync RUN_DIR/wandb/offline-run-*`` sends them later. A trainer resumed
  from a checkpoint rewinds an online run to its resume step (W&B's ``resume_from``), so a redone step is held once
  with the values trained; offline W&B has no rewind (a redone step's row is dropped as one below the run's step).

``trackers.json`` maps each tracker to its run (TensorBoard: the log directory; MLflow: tracking URI, experiment
and run id; W&B: project, entity and run id). A trainer that resumes from a checkpoint continues those runs; one
that starts afresh makes new ones and replaces the entries. The scavenger (:class:`Role` ``SCAVENGER``) only joins
runs the trainer made. A tracker object is used by one thread only (the hub's, ``observe/tracking.py``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
from enum import StrEnum
from pathlib import Path
from typing import Any

from rlboost_hpc.errors import BadInput
from rlboost_hpc.rundir import RunDir, write_json_atomic

__all__ = ["TrackerKind", "Role", "Tracker", "TrackerMissing", "check_installed", "open_tracker",
           "file_store_allowed", "read_tracker_runs", "write_tracker_runs"]


class TrackerKind(StrEnum):
    """A tracker ``trainer.report_to`` may name (the value is the name, the pip extra and the module)."""

    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"


class Role(StrEnum):
    """Who logs: the trainer (rank 0; makes and finishes tracker runs) or the scavenger daemon (joins them)."""

    TRAINER = "trainer"
    SCAVENGER = "scavenger"


class TrackerMissing(BadInput, ImportError):
    """A configured tracker's package is not installed (the message names the extra that installs it)."""


def check_installed(kinds: list[str], key: str = "trainer.report_to") -> None:
    """Refuse trackers whose package is missing, before anything starts.

    Raises:
        TrackerMissing: ``kinds`` names a tracker that cannot be imported here (one line: the key, the tracker and
            ``pip install 'rlboost-hpc[<extra>]'``).
    """
    missing = [k for k in kinds if importlib.util.find_spec(TrackerKind(k).value) is None]
    if missing:
        extras = ",".join(missing)
        raise TrackerMissing(f"{key} names {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                             f"not installed here: pip install 'rlboost-hpc[{extras}]'")


def read_tracker_runs(rd: RunDir) -> dict[str, dict[str, Any]]:
    """``trackers.json``: tracker name → its run (``{}`` when missing or unreadable: no run to continue)."""
    try:
        data = json.loads(rd.trackers.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def write_tracker_runs(rd: RunDir, runs: dict[str, dict[str, Any]]) -> None:
    """Replace ``trackers.json`` atomically."""
    write_json_atomic(rd.trackers, runs)


class Tracker:
    """One tracker's run. ``created``: this process made the run (the trainer's first incarnation, or a tracker
    added at a resume) rather than continuing one; :meth:`identity` is its ``trackers.json`` entry. Every method
    may raise whatever the tracker's library raises (the hub drops the tracker then)."""

    kind: TrackerKind
    created: bool = False
    forked: bool = False  # created as the continuation of a run, holding its steps before the resume (no backfill)

    def identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def log_params(self, config: dict[str, Any], flat: dict[str, str]) -> None:
        """The run's configuration: ``config`` nested (``RunConfig.model_dump(mode="json")``), ``flat`` as
        ``section.key`` → text (:func:`~rlboost_hpc.observe.names.flat_params`)."""
        raise NotImplementedError

    def log_metrics(self, step: int, figures: dict[str, float], ts: float) -> None:
        """Figures (tracker name → value) at trainer step ``step``, Unix time ``ts`` (seconds)."""
        raise NotImplementedError

    def log_summary(self, step: int, figures: dict[str, float], report: dict[str, Any]) -> None:
        """The run's summary: ``report.json`` (``report``) and its numeric leaves (``figures``), after step
        ``step``."""
        raise NotImplementedError

    def log_artifact(self, step: int, path: Path) -> None:
        """A file of the run (``report.json``, ``run.png``)."""
        raise NotImplementedError

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Step ``step``'s sample rows (``trainer.log_samples``: prompt, response, reward, failed, parts) as a
        table, logged before the step's figures."""
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        """Flush and end this process's use of the run; the trainer also marks the run finished (or failed)."""
        raise NotImplementedError


def open_tracker(kind: str, rd: RunDir, role: Role, run_name: str, known: dict[str, Any] | None,
                 resume_step: int | None) -> Tracker:
    """Open ``kind``'s run for ``rd``: continue ``known`` (its ``trackers.json`` entry) when the trainer resumes
    from the checkpoint of ``resume_step`` or when the scavenger joins, else make a new run named ``run_name``.

    Raises:
        LookupError: the scavenger has no run of ``kind`` to join; whatever the tracker's library raises.
    """
    if role is Role.SCAVENGER and not known:
        raise LookupError(f"{rd.trackers} names no {kind} run to join")
    known = known if (role is Role.SCAVENGER or resume_step is not None) else None
    cls = {TrackerKind.TENSORBOARD: TensorBoardTracker, TrackerKind.MLFLOW: MlflowTracker,
           TrackerKind.WANDB: WandbTracker}[TrackerKind(kind)]
    return cls(rd, role, run_name, known, resume_step)


def _code_block(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardTracker(Tracker):
    """Scalars (one tag per figure), the config and the report as text, ``run.png`` as an image."""

    kind = TrackerKind.TENSORBOARD

    def __init__(self, rd: RunDir, role: Role, run_name: str, known: dict | None, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.created = known is None
        self.logdir = rd.tensorboard if role is Role.TRAINER else rd.tensorboard / "scavenger"
        # the trainer's purge marker: events of steps ≥ the resume point (a crashed incarnation's steps after its
        # last checkpoint; a fresh start's: every earlier one) are dropped by TensorBoard's readers
        purge = (resume_step or 0) if role is Role.TRAINER else None
        self.writer = SummaryWriter(str(self.logdir), purge_step=purge, flush_secs=30)

    def identity(self) -> dict[str, Any]:
        return {"logdir": TrackerKind.TENSORBOARD.value}

    def log_params(self, config: dict[str, Any], flat: dict[str, str]) -> None:
        self.writer.add_text("config", _code_block(json.dumps(config, indent=2)), 0)
        self.writer.flush()

    def log_metrics(self, step: int, figures: dict[str, float], ts: float) -> None:
        for name, v in figures.items():
            self.writer.add_scalar(name, v, step, walltime=ts)
        self.writer.flush()

    def log_summary(self, step: int, figures: dict[str, float], report: dict[str, Any]) -> None:
        self.writer.add_text("report", _code_block(json.dumps(report, indent=2)), step)
        for name, v in figures.items():
            self.writer.add_scalar(name, v, step)
        self.writer.flush()

    def log_artifact(self, step: int, path: Path) -> None:
        if path.suffix == ".png":
            import matplotlib.image

            img = matplotlib.image.imread(str(path))[..., :3]  # RGB(A) floats in [0, 1]
            self.writer.add_image(path.stem, img, step, dataformats="HWC")
        else:
            self.writer.add_text(path.name, _code_block(path.read_text()), step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        cols = sample_columns(rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731 - a markdown cell
        table = "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
                          + ["| " + " | ".join(cell(v) for v in r) + " |" for r in sample_table(rows, cols)])
        self.writer.add_text("samples", table, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def file_store_allowed():
    """Let MLflow open its file store (refused by default in recent releases) for the client made inside; the
    process environment is restored on exit (the store, once made, is cached by MLflow per URI)."""
    with _ENV_LOCK:
        before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
            else:
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def sample_columns(rows: list[dict[str, Any]]) -> list[str]:
    """A sample table's columns: prompt, response, reward, failed, then each reward part (``parts/<name>``)."""
    parts = sorted({k for r in rows for k in r.get("parts", {})})
    return ["prompt", "response", "reward", "failed", *(f"parts/{k}" for k in parts)]


def sample_table(rows: list[dict[str, Any]], cols: list[str]) -> list[list[Any]]:
    """``rows`` as lists in the order of ``cols`` (a part a row lacks: None)."""
    return [[r.get("parts", {}).get(c[6:]) if c.startswith("parts/") else r.get(c) for c in cols] for r in rows]


def _chunks(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


class MlflowTracker(Tracker):
    """Metrics (one key per figure, step = trainer step), the config as parameters, the report's figures as
    metrics and ``report.json`` / ``run.png`` as artifacts. Parameters are immutable in MLflow: a value changed at
    a resume (more ``trainer.steps``) is kept as the tag ``rlboost.param_changed.<key>``. A resume that redoes steps
    the run already holds (a crash after its last checkpoint) forks the run (:meth:`_fork`): every step once."""

    kind = TrackerKind.MLFLOW

    def __init__(self, rd: RunDir, role: Role, run_name: str, known: dict | None, resume_step: int | None) -> None:
        from mlflow.tracking import MlflowClient

        self.role = role
        uri = (known or {}).get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or \
            rd.mlruns.resolve().as_uri()
        with file_store_allowed():
            self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        if known:
            self.experiment_id, self.run_id = str(known["experiment_id"]), str(known["run_id"])
            self.client.get_run(self.run_id)  # raises when the run is gone
            if role is Role.TRAINER:
                redone = self._history_from(resume_step) if resume_step is not None else None
                if redone is not None:
                    self._fork(rd, run_name, resume_step, redone)
                else:
                    self.client.update_run(self.run_id, status="RUNNING")
            return
        self.created = True
        exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if not exp_id:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlboost-hpc"
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.experiment_id = str(exp_id)
        run = self.client.create_run(self.experiment_id, run_name=run_name,
                                     tags={"rlboost.run_id": run_name, "rlboost.run_dir": str(rd.root.resolve())})
        self.run_id = run.info.run_id

    def _history_from(self, step: int) -> dict[str, list] | None:
        """Every metric's history when the run holds a step ≥ ``step`` (a crashed incarnation logged steps after
        its last checkpoint, which the resumed one redoes), else None."""
        keys = self.client.get_run(self.run_id).data.metrics
        history = {k: self.client.get_metric_history(self.run_id, k) for k in keys}
        return history if any(m.step >= step for ms in history.values() for m in ms) else None

    def _fork(self, rd: RunDir, run_name: str, step: int, history: dict[str, list]) -> None:
        """Continue in a new run: MLflow cannot delete the redone steps, which would be held twice. The new run gets
        the old one's parameters (and changed-parameter tags) and its history before ``step``; the old one is
        marked KILLED and tagged ``rlboost.superseded_by`` (W&B's fork, by hand)."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

        old = self.client.get_run(self.run_id)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={
            "rlboost.run_id": run_name, "rlboost.run_dir": str(rd.root.resolve()),
            "rlboost.forked_from": self.run_id, "rlboost.forked_at_step": str(step)})
        params = [Param(k, v) for k, v in old.data.params.items()]
        tags = [RunTag(k, v) for k, v in old.data.tags.items() if k.startswith("rlboost.param_changed.")]
        metrics = [Metric(k, m.value, m.timestamp, m.step) for k, ms in history.items() for m in ms if m.step < step]
        for chunk in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run.info.run_id, params=chunk)
        for chunk in _chunks(tags, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run.info.run_id, tags=chunk)
        for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
            self.client.log_batch(run.info.run_id, metrics=chunk)
        self.client.set_tag(self.run_id, "rlboost.superseded_by", run.info.run_id)
        self.client.set_terminated(self.run_id, status="KILLED")
        self.run_id, self.created, self.forked = run.info.run_id, True, True

    def identity(self) -> dict[str, Any]:
        return {"tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def log_params(self, config: dict[str, Any], flat: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        have = self.client.get_run(self.run_id).data.params
        flat = {k: v[:MAX_PARAM_VAL_LENGTH] for k, v in flat.items()}
        new = [Param(k, v) for k, v in flat.items() if k not in have]
        changed = [RunTag(f"rlboost.param_changed.{k}", v) for k, v in flat.items() if k in have and have[k] != v]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)
        for chunk in _chunks(changed, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=chunk)

    def log_metrics(self, step: int, figures: dict[str, float], ts: float) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        ms = int(ts * 1000)
        metrics = [Metric(k, v, ms, step) for k, v in figures.items()]
        for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_summary(self, step: int, figures: dict[str, float], report: dict[str, Any]) -> None:
        import time

        self.log_metrics(step, figures, time.time())
        self.client.log_dict(self.run_id, report, "summary/report.json")

    def log_artifact(self, step: int, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        cols = sample_columns(rows)
        data = sample_table(rows, cols)
        self.client.log_table(self.run_id, data={c: [r[i] for r in data] for i, c in enumerate(cols)},
                              artifact_file=f"samples/step-{step:06d}.json")

    def close(self, failed: bool) -> None:
        if self.role is Role.TRAINER:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """``wandb.init`` with the run's id (``resume="allow"``; a trainer resumed online: ``resume_from`` its resume
    step, W&B's rewind): history rows keyed by trainer step, the config,
    the report as the run's summary and files. The scavenger joins the run as a secondary writer (W&B's shared
    mode when online; offline, its own offline directory of the same run id, sent by ``wandb sync`` alike)."""

    kind = TrackerKind.WANDB

    def __init__(self, rd: RunDir, role: Role, run_name: str, known: dict | None, resume_step: int | None) -> None:
        import wandb

        self.created = known is None
        offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
        primary = role is Role.TRAINER
        settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False,
                                  x_save_requirements=False, x_label=role.value, x_primary=primary,
                                  x_update_finish_state=primary,
                                  # the .wandb file flushed every second, not every 15 s: a run SIGKILLed (a
                                  # preempted or requeued job) keeps its history up to the last second
                                  x_transaction_log_flush_interval=1.0)
        if not primary and not offline:
            settings.mode = "shared"
        known = known or {}
        # wandb.init leaves its service's address in WANDB_SERVICE for child processes; this process keeps its own
        # connection and its children (manager, workers) need none: the environment stays as it was
        service = os.environ.get("WANDB_SERVICE")
        # a trainer resumed from a checkpoint online rewinds its run to the resume step (W&B's resume_from: the steps
        # the crashed incarnation logged after it are archived, the redone ones logged once); offline W&B has no
        # rewind: a redone step's row is dropped by W&B as one below the run's step, the first incarnation's kept
        rewind = resume_step if (primary and not offline and known.get("id") and resume_step is not None) else None
        try:
            self.run = self._init(wandb, known, run_name, rd, settings, rewind)
        finally:
            if service is None:
                os.environ.pop("WANDB_SERVICE", None)

    @staticmethod
    def _init(wandb, known: dict, run_name: str, rd: RunDir, settings, rewind: int | None = None):
        """``wandb.init`` of the run ``known`` names (a new one when it names none); ``rewind``: continue it from that
        step (``resume_from="<id>?_step=<rewind>"``, its later history archived) instead of after its last step."""
        where = ({"resume_from": f"{known['id']}?_step={rewind}"} if rewind is not None
                 else {"id": known.get("id"), "resume": "allow"})
        return wandb.init(
            project=known.get("project") or os.environ.get("WANDB_PROJECT") or "rlboost-hpc",
            entity=known.get("entity") or os.environ.get("WANDB_ENTITY") or None,
            dir=str(rd.root), name=run_name, reinit="create_new", settings=settings, **where)

    def identity(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project, "entity": self.run.entity or None}

    def log_params(self, config: dict[str, Any], flat: dict[str, str]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, figures: dict[str, float], ts: float) -> None:
        self.run.log(figures, step=step, commit=True)

    def log_summary(self, step: int, figures: dict[str, float], report: dict[str, Any]) -> None:
        self.run.summary.update(figures)

    def log_artifact(self, step: int, path: Path) -> None:
        import shutil

        copy = Path(self.run.dir) / path.name  # a copy in the run's files (a link would follow later rewrites)
        shutil.copyfile(path, copy)
        self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        cols = sample_columns(rows)
        self.run.log({"samples": wandb.Table(columns=cols, data=sample_table(rows, cols))}, step=step, commit=False)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
