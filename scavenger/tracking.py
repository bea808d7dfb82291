"""The scavenger's preemption and cost statistics in the run's experiment trackers: :class:`ScavengerTracking`.

The trainer makes the tracker runs (``trainer.report_to``) and names them in ``RUN_DIR/trackers.json``; once that
file is there, the daemon joins the same runs (TensorBoard: ``RUN_DIR/tensorboard/scavenger/``) and, after each
reconciliation, sends what its Prometheus endpoint serves plus the ``rlboost-hpc stats`` figures Prometheus lacks,
named by :func:`rlboost_hpc.observe.names.scavenger_figures` (``scavenger/preemptions_total``,
``cost/harvest_dollars_total``, …) at the trainer's step (``target.json``'s ``step``).

Invariants: like the trainer's, the daemon never waits for a tracker (a queue and a thread,
:class:`~rlboost_hpc.observe.tracking.TrackerHub`); a tracker named there but not installed here, or failing, is
logged once and left out; the daemon goes on. A view is sent when a figure other than the reconciliation count
changed, or :data:`RESEND_S` after the last one.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from rlboost_hpc.errors import BadInput
from rlboost_hpc.observe import names
from rlboost_hpc.observe.trackers import Role, read_tracker_runs
from rlboost_hpc.observe.tracking import TrackerHub
from rlboost_hpc.rundir import RunDir
from scavenger.metrics import ScavengerMetrics

log = logging.getLogger("rlboost.scavenger")

#: Seconds after which an unchanged view is sent again (the trackers' curves keep up with the run's steps).
RESEND_S = 60.0
#: The figure that changes at every reconciliation: a change of it alone sends nothing.
_EVERY_CYCLE = names.SCAVENGER_NAMES["reconciliations"]


class ScavengerTracking:
    """Feeds the trackers of run directory ``run_dir`` from the daemon's loop (:meth:`refresh`); prices in dollars
    per GPU-hour as :class:`~scavenger.metrics.ScavengerMetrics` takes them."""

    def __init__(self, run_dir: str | Path, spot_price_per_gpu_hour: float = 0.0,
                 on_demand_price_per_gpu_hour: float = 0.0, run_id: str = "") -> None:
        self.rd = RunDir(Path(run_dir))
        self.run_id = run_id
        self.view = ScavengerMetrics(spot_price_per_gpu_hour, on_demand_price_per_gpu_hour, run_id=run_id)
        self.hub: TrackerHub | None = None
        self._sent: dict[str, float] | None = None
        self._sent_at = float("-inf")
        self._step = 0

    def wanted(self) -> bool:
        """Whether the run logs to trackers (``trackers.json`` is there, or was)."""
        return self.hub is not None or self.rd.trackers.is_file()

    def refresh(self, res: Any, stats: Any, now: float) -> None:
        """Record one reconciliation (:class:`~scavenger.daemon.ReconcileResult`) and the run's statistics
        (:class:`~scavenger.stats.RunStats`) at Unix time ``now``; queue them for the trackers when they changed."""
        if self.hub is None and not self._join():
            return
        self.view.refresh(res, stats)
        figures = names.scavenger_figures(self.view.snapshot(), stats.summary())
        same = self._sent is not None and {k: v for k, v in figures.items() if k != _EVERY_CYCLE} == \
            {k: v for k, v in self._sent.items() if k != _EVERY_CYCLE}
        if same and now - self._sent_at < RESEND_S:
            return
        self.hub.metrics(self._trainer_step(), figures, now)
        self._sent, self._sent_at = figures, now

    def close(self) -> None:
        """Send what is queued and leave the trackers' runs (the trainer ends them)."""
        if self.hub is not None:
            self.hub.close()
            self.hub = None

    def _join(self) -> bool:
        runs = read_tracker_runs(self.rd)
        if not runs:
            return False
        kinds = [k for k in runs if importlib.util.find_spec(k) is not None]
        for k in sorted(set(runs) - set(kinds)):
            log.warning("scavenger: the run logs to %s, which is not installed here (pip install 'rlboost-hpc[%s]'); "
                        "the scavenger's statistics will not reach it", k, k)
        self.hub = TrackerHub(kinds, self.rd, run_name=self.run_id, role=Role.SCAVENGER)
        return True

    def _trainer_step(self) -> int:
        """The trainer's step (``target.json``), else the last one sent with, else 0."""
        try:
            t = self.rd.read_target()
        except BadInput:
            t = None
        if t is not None and t.step is not None and t.step >= 0:
            self._step = t.step
        return self._step
