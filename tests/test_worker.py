"""rlboost_hpc/rollout/worker.py's pure parts: how a warning is classified and what the warning handler decides,
signal by signal, without a process (the integration tests send real signals: tests/test_rollout_integration.py,
tests/test_slurm_run.py)."""
from __future__ import annotations

import signal

import pytest

from rlboost_hpc.protocol.identity import instance_ids
from rlboost_hpc.rollout.worker import WarningHandler, _parse_args


class Agent:
    """Records the drain requests a real RolloutAgent would get (first request wins, a cause refines stopped)."""

    def __init__(self, job_id="7"):
        self.job_id = job_id
        self.requests = []

    def request_stop(self, reason, cause):
        self.requests.append((reason, cause))


def handler(tmp_path, *, in_slurm=True, drained=False, job_end_s=None, ask_slurm=lambda job: False):
    if drained:  # the scavenger's drain marker, as scavenger/daemon.py writes it
        from rlboost_hpc.events import drain_marker_path

        marker = drain_marker_path(tmp_path, "7")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("surplus")
    h = WarningHandler(signal.SIGUSR2, run_dir=str(tmp_path), job_id="7", in_slurm=in_slurm, ask_slurm=ask_slurm)
    h.job_end_s = job_end_s
    return h


def settled(h):
    import time

    deadline = time.monotonic() + 5
    while not h.settled and time.monotonic() < deadline:
        time.sleep(0.005)
    return h.settled


def test_the_warning_signal_is_a_preemption_and_stops_the_attached_agent(tmp_path):
    h, a = handler(tmp_path), Agent()
    h.attach(a)
    assert not h.warned and a.requests == []
    h(signal.SIGUSR2, None)
    assert h.warned and h.cause == "preempted" and h.signal == "SIGUSR2"
    assert a.requests == [("preempted (SIGUSR2)", "preempted")]


def test_a_slurm_sigterm_is_a_cancellation_until_the_warning_follows(tmp_path):
    """Slurm preempts with SIGTERM and the warning signal in either order: SIGTERM alone is scancel (never requeued);
    the warning after it refines it into a preemption; any later signal changes nothing."""
    h, a = handler(tmp_path), Agent()
    h.attach(a)
    h(signal.SIGTERM, None)
    assert h.cause == "stopped" and h.signal == "SIGTERM"
    h(signal.SIGUSR2, None)
    assert h.cause == "preempted" and h.signal == "SIGTERM+SIGUSR2"
    h(signal.SIGTERM, None)
    assert h.cause == "preempted" and h.signal == "SIGTERM+SIGUSR2"
    assert a.requests == [("stopped (SIGTERM)", "stopped"), ("preempted (SIGTERM+SIGUSR2)", "preempted")]


def test_slurm_says_which_sigterm_is_a_preemption():
    """``scontrol show job -o``: PreemptTime is stamped when Slurm selects the job for preemption (the grace time);
    when the grace time ends Slurm kills the job to requeue it and its Restarts is already past the attempt."""
    from rlboost_hpc.rollout.worker import preemption_seen

    grace = ("JobId=5 JobState=RUNNING Reason=None Restarts=0 PreemptEligibleTime=2026-12-05T08:16:25 "
             "PreemptTime=2026-12-05T08:16:27 SuspendTime=None")
    killed = "JobId=5 JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1"
    cancelled = "JobId=5 JobState=COMPLETING Reason=None Restarts=0 PreemptTime=None SuspendTime=None"
    assert preemption_seen(grace, 0) is True and preemption_seen(killed, 0) is True
    assert preemption_seen(cancelled, 0) is False and preemption_seen(killed, 1) is False
    assert preemption_seen("slurm_load_jobs error: Invalid job id specified", 0) is None


def test_a_slurm_sigterm_of_a_job_slurm_is_preempting_is_a_preemption(tmp_path):
    """Issue 30: without preempt_send_user_signal Slurm preempts with SIGTERM alone; the handler asks Slurm, and a
    job whose PreemptTime is set is preempted (requeued, counted as a preemption), not cancelled."""
    asked = []
    h, a = handler(tmp_path, ask_slurm=lambda job: asked.append(job) or True), Agent()
    h.attach(a)
    h(signal.SIGTERM, None)
    assert settled(h) and asked == ["7"]
    assert h.cause == "preempted" and h.signal == "SIGTERM+PreemptTime"
    assert a.requests == [("stopped (SIGTERM)", "stopped"), ("preempted (SIGTERM+PreemptTime)", "preempted")]
    assert a.cause_settled()  # the agent's Deregister waits no longer


def test_a_slurm_sigterm_slurm_does_not_call_a_preemption_stays_a_cancellation(tmp_path):
    """scancel (PreemptTime None): the signal's reading stands, and the cause is settled."""
    h, a = handler(tmp_path, ask_slurm=lambda job: False), Agent()
    h.attach(a)
    h(signal.SIGTERM, None)
    assert settled(h) and h.cause == "stopped" and h.signal == "SIGTERM"
    assert a.requests == [("stopped (SIGTERM)", "stopped")]


def test_when_slurm_does_not_answer_the_warning_may_still_settle_it(tmp_path):
    """Regression (CI): scontrol failing at once settled the cause, so the agent deregistered as cancelled before the
    warning signal that follows a preemption's SIGTERM arrived 50 ms later. No answer settles nothing."""
    import threading

    asked = threading.Event()
    h, a = handler(tmp_path, ask_slurm=lambda job: asked.set() or None), Agent()
    h.attach(a)
    h(signal.SIGTERM, None)
    assert asked.wait(5)
    import time

    time.sleep(0.05)
    assert not h.settled and not a.cause_settled() and h.cause == "stopped"
    h(signal.SIGUSR2, None)
    assert h.settled and h.cause == "preempted" and h.signal == "SIGTERM+SIGUSR2"


def test_a_drained_or_warned_end_is_settled_at_once_without_asking_slurm(tmp_path):
    def never(job):
        raise AssertionError("Slurm must not be asked")

    d = handler(tmp_path, drained=True, ask_slurm=never)
    d(signal.SIGTERM, None)
    assert d.settled and d.cause == "drained"
    (tmp_path / "other").mkdir()
    w = handler(tmp_path / "other", ask_slurm=never)
    w(signal.SIGUSR2, None)
    assert w.settled and w.cause == "preempted"


def test_outside_slurm_sigterm_is_a_warning_and_a_drain_marker_wins(tmp_path):
    h = handler(tmp_path, in_slurm=False)
    h(signal.SIGTERM, None)
    assert h.cause == "preempted"
    d = handler(tmp_path, drained=True)
    d(signal.SIGTERM, None)
    assert d.cause == "drained"  # the scavenger's surplus drain, even by SIGTERM: never requeued


def test_a_warning_near_the_job_end_is_its_time_limit(tmp_path):
    import time

    h = handler(tmp_path, job_end_s=time.time() + 10)
    h(signal.SIGUSR2, None)
    assert h.cause == "time_limit"


def test_a_warning_before_the_agent_exists_stops_it_when_attached(tmp_path):
    """A warning that arrives while the worker still imports torch or builds its engine is not lost."""
    h, a = handler(tmp_path), Agent()
    h(signal.SIGUSR2, None)
    h.attach(a)
    assert a.requests == [("preempted (SIGUSR2)", "preempted")]


def test_a_process_hosting_several_instances_drains_them_all_on_its_warning(tmp_path):
    """One process, K emulated instances (``--instances``): the warning is the process's, so each attached agent
    drains — and a reconnect's new agent for an instance replaces the old one rather than being stopped twice."""
    h = handler(tmp_path)
    first, second, renewed = Agent("7.0"), Agent("7.1"), Agent("7.0")
    for a in (first, second, renewed):
        h.attach(a)
    h(signal.SIGUSR2, None)
    assert second.requests == renewed.requests == [("preempted (SIGUSR2)", "preempted")]
    assert first.requests == []  # replaced by its reconnect's agent
    assert instance_ids("7", 1) == ["7"] and instance_ids("7", 3) == ["7.0", "7.1", "7.2"]


@pytest.mark.parametrize("argv, says", [
    (["--job-id", "j", "--run-dir", "d", "--instances", "0"], "--instances 0: must be ≥ 1"),
    (["--job-id", "j", "--manager", "tcp://h:1", "--signal", "SIGUSR1"], "SIGUSR1 is taken by NCCL"),
    (["--job-id", "j", "--manager", "tcp://h:1", "--signal", "SIGNOPE"], "--signal SIGNOPE: not a signal name"),
    (["--job-id", "j"], "give --manager or --run-dir"),
    (["--job-id", "j", "--run-dir", "d", "--engine", "sglang"], "unrecognized arguments: --engine"),
])
def test_bad_command_lines_exit_2_naming_the_flag(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit) as e:
        _parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
