"""``rlboost-hpc run``: one RLBoost run on this machine (embedded local default).

The composition root: :class:`~rlboost_hpc.run_setup.RunSetup` checks the inputs and loads model and task,
:class:`~rlboost_hpc.services.RunServices` starts (and stops) the processes and sockets — the rollout manager (its own
process), the weight server (a thread of the trainer process), the reserved engine (a rollout agent in a trainer
thread, the seeding instance), the local preemptible cluster (worker processes replaying a spot trace) or the
scavenger's target —, :func:`_train` runs the step loop, and :func:`~rlboost_hpc.observe.run_report.build_report`
makes the report. Writes ``report.json``, ``metrics.jsonl`` and ``run.png`` into the output directory.

Invariant: the run never reports success it did not have — a rollout failure that no migration could
recover raises :class:`~rlboost_hpc.trainer.loop.RolloutFailed` and the CLI exits non-zero; every process
it started is stopped on every exit path.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from rlboost_hpc.cluster.capacity import reserved_instances
from rlboost_hpc.config import RunConfig
from rlboost_hpc.errors import BadInput
from rlboost_hpc.models.hf_dir import save_model_dir
from rlboost_hpc.observe.report import write_plot
from rlboost_hpc.observe.run_report import FailedReport, FaultTally, RunReport, build_report, write_report
from rlboost_hpc.observe.timeline import Phase, add_phase
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import HeldOutEvaluation
from rlboost_hpc.rundir import RunDir, read_jsonl
from rlboost_hpc.run_setup import RunSetup, check_inputs, check_same_data, check_same_model
from rlboost_hpc.services import RunServices
from rlboost_hpc.trainer.record import StepRecord

log = logging.getLogger("rlboost.run")


def _resume_point(cfg: RunConfig, out_dir: Path) -> Path | None:
    """The checkpoint to resume from (``trainer.resume``), verified against the manager journal.

    Raises:
        CheckpointError: ``require`` without a checkpoint; a dangling ``latest``; a checkpoint whose run the
            journal does not know (missing journal, or a checkpoint ahead of every version it recorded); a journal
            that records progress (versions ≥ ``checkpoint_every``) while no checkpoint is there.
        JournalError: a corrupt journal.
    """
    from rlboost_hpc.manager import journal as journal_mod
    from rlboost_hpc.trainer import checkpoint

    if cfg.trainer.resume == "never":
        return None
    ckpt = checkpoint.newest_verified(out_dir)  # a torn newest one (power loss) falls back to the one before
    records = journal_mod.read(RunDir(out_dir).journal)
    if ckpt is None:
        if cfg.trainer.resume == "require":
            raise checkpoint.CheckpointError(f"trainer.resume = require but {out_dir}/checkpoints has no checkpoint")
        done = journal_mod.last_version(records)
        if cfg.trainer.checkpoint_every and done >= cfg.trainer.checkpoint_every:
            # progress without its resume state: starting at step 0 would silently retrain (and re-publish
            # versions the journal already made current)
            raise checkpoint.CheckpointError(
                f"the manager journal {RunDir(out_dir).journal} records versions up to {done}, but "
                f"{out_dir}/checkpoints has no checkpoint to resume from (checkpoints/latest or the step directories "
                "are missing); restore them, or start over in a new --out")
        return None
    step = checkpoint.step_of(ckpt)
    if not records:
        raise checkpoint.CheckpointError(
            f"{ckpt} exists but the manager journal {RunDir(out_dir).journal} is missing or empty: the checkpoint "
            "does not belong to this run directory's history; restore the journal or use trainer.resume=never")
    if journal_mod.last_version(records) < step:
        raise checkpoint.CheckpointError(
            f"{ckpt} is at version {step} but the manager journal records versions up to "
            f"{journal_mod.last_version(records)} only: journal and checkpoint come from different runs")
    log.info("resuming from %s (manager epoch %d next)", ckpt, 1 + max(int(r.get("epoch", 0)) for r in records))
    return ckpt


MISMATCH_KEYS = ("logprob_diff", "logprob_diff_max", "mismatch_kl", "mismatch_outside_clip_share",
                 "mismatch_capped_share", "behaviour_ess", "behaviour_dropped_share")


#: The ``trainer.*`` keys of the GRPO objective (the report's ``objective``).
OBJECTIVE_KEYS = {"loss_aggregation", "advantage_std_norm", "clip_eps", "clip_eps_high", "kl_coef", "kl_estimator",
                  "behaviour_correction", "behaviour_cap", "behaviour_level", "mask_truncated"}


def run(cfg: RunConfig, out_dir: Path, *, progress: bool = True, run_id: str | None = None) -> dict:
    """Run the configured job; returns the report (:class:`~rlboost_hpc.observe.run_report.RunReport` as a
    dict, also written to ``out_dir/report.json``).

    ``run_id`` names the run in ``endpoints.json`` (rollout jobs tag their events with it); default
    :meth:`RunDir.run_id`. The calling process's environment is left as it was (the data directory of
    ``data.dir`` holds only for the run's duration).

    Raises:
        BadInput: a bad config, model, checkpoint or run directory (exit 2; nothing started, or all stopped).
        RolloutFailed: a step could not be completed (after the services were stopped).
    """
    from rlboost_hpc.paths import using_data_dir

    rd = RunDir(Path(out_dir))
    finished = _finished_report(cfg, rd)
    if finished is not None:
        log.info("%s holds this run finished (%d steps): its report again, nothing started (a new --out or "
                 "trainer.resume=never runs it afresh; more trainer.steps continue it)", rd.root, finished["steps"])
        return finished
    with using_data_dir(cfg.data.dir):
        return _run(cfg, rd, progress=progress, run_id=run_id or rd.run_id()).to_dict()


def _finished_report(cfg: RunConfig, rd: RunDir) -> dict | None:
    """The report of this very run when ``rd`` holds it finished — a successful report of ``trainer.steps`` steps,
    a checkpoint of the last step, and the same model and task in its ``config.json`` — else ``None`` (the run
    starts or resumes). ``trainer.resume = "never"`` always starts afresh."""
    from rlboost_hpc.trainer import checkpoint

    if cfg.trainer.resume == "never" or not rd.report.is_file() or not rd.config.is_file():
        return None
    try:
        report = rd.read_report()
        before = json.loads(rd.config.read_text())
    except (BadInput, OSError, ValueError):
        return None
    now = cfg.model_dump(mode="json")
    same = all(before.get(k) == now.get(k) for k in ("model", "task"))
    done = report.get("steps") == cfg.trainer.steps and "error" not in report
    return report if same and done and checkpoint.latest_step(rd.root) >= cfg.trainer.steps else None


@dataclass
class ResumeState:
    """Where a run starts: step 0, or a checkpoint's step with the trainer loop's state, the held-out evaluation
    before training, how often it was resumed, the fault tally and training seconds of earlier incarnations."""

    start_step: int = 0
    trainer_state: dict | None = None
    before: dict | None = None
    resumes: int = 0
    tally: FaultTally = field(default_factory=FaultTally)
    train_wall_s: float = 0.0
    steps: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, ckpt: Path | None, backend, rd: RunDir) -> "ResumeState":
        """Restore model, optimizer and RNG from ``ckpt`` into ``backend`` (nothing for ``None``) and return the
        run's state at that checkpoint, with the step records it covers."""
        from rlboost_hpc.trainer import checkpoint

        if ckpt is None:
            return cls()
        step, trainer_state, run_state = checkpoint.load(ckpt, backend, verified=True, run_keys=(
            "metrics_lines", "last_step_metrics", "before", "resumes", "counts", "train_wall_s"))
        return cls(start_step=step, trainer_state=trainer_state, before=run_state["before"],
                   resumes=run_state["resumes"] + 1, tally=FaultTally.from_json(run_state["counts"]),
                   train_wall_s=run_state["train_wall_s"],
                   steps=_metrics_before(rd.root, run_state["metrics_lines"]) + [run_state["last_step_metrics"]])


def _run(cfg: RunConfig, rd: RunDir, *, progress: bool, run_id: str) -> RunReport:
    from rlboost_hpc.observe.trackers import check_installed

    check_installed(cfg.trainer.report_to)  # a tracker that cannot be imported: refused before anything starts
    check_inputs(cfg)
    rd.create()
    ckpt = _resume_point(cfg, rd.root)
    t_start = time.monotonic()
    torch.manual_seed(cfg.trainer.seed)
    torch.set_num_threads(cfg.trainer.torch_threads)
    setup = RunSetup.load(cfg)
    try:
        return _run_loaded(cfg, rd, setup, ckpt, t_start, progress=progress, run_id=run_id)
    finally:  # (the services' task runtime closed it, unless the run failed before they started)
        setup.task.close()  # a stateful environment's reset process, started by the context check


def _run_loaded(cfg: RunConfig, rd: RunDir, setup: RunSetup, ckpt: Path | None, t_start: float, *, progress: bool,
                run_id: str) -> RunReport:
    """The run once its task and model are loaded (``setup``): the checks against a checkpoint ``ckpt``, the
    services, the training, the report."""
    if ckpt is not None:
        check_same_model(ckpt, setup, rd)
        check_same_data(ckpt, setup, rd)
    rd.config.write_text(cfg.model_dump_json(indent=2))
    _announce_cost(cfg, setup)
    steps: list[dict] = []  # every step record of the run, also those of earlier incarnations
    failure: BaseException | None = None
    trackers = _trackers(cfg, rd, run_id, ckpt)
    try:
        with RunServices(cfg, rd, run_id, setup.policy, setup.task, resuming=ckpt is not None,
                         train_device=setup.train_device, train_dtype=setup.train_dtype, t_origin=t_start,
                         context_tokens=setup.context_tokens, lora=setup.lora) as svc:
            try:
                report, live_series = _train(cfg, rd, svc, setup, ckpt, steps, progress=progress, t_start=t_start,
                                             trackers=trackers)
            except BaseException as e:  # noqa: BLE001 - re-raised once the services are stopped
                failure = e
    except BaseException:
        trackers.close(failed=True)
        raise
    if failure is not None:
        failed = FailedReport(error=f"{type(failure).__name__}: {failure}", steps=len(steps))
        write_report(rd.report, failed)
        _finish_trackers(trackers, rd, msgspec.structs.asdict(failed), failed=True)
        raise failure
    write_report(rd.report, report)
    write_plot(steps, live_series, rd.plot, before=report.reward_heldout_before, after=report.reward_heldout_after)
    _finish_trackers(trackers, rd, report.to_dict(), failed=False)
    return report


def _trackers(cfg: RunConfig, rd: RunDir, run_id: str, ckpt: Path | None):
    """The run's experiment trackers (``trainer.report_to``; inert without any), given the config as parameters:
    a run resumed from ``ckpt`` continues the tracker runs ``trackers.json`` names."""
    from rlboost_hpc.observe.tracking import TrackerHub
    from rlboost_hpc.trainer import checkpoint

    hub = TrackerHub(cfg.trainer.report_to, rd, run_name=run_id,
                     resume_step=checkpoint.step_of(ckpt) if ckpt is not None else None)
    hub.params(cfg.model_dump(mode="json"))
    return hub


def _finish_trackers(trackers, rd: RunDir, report: dict, *, failed: bool) -> None:
    """``report.json`` as the trackers' summary, it and ``run.png`` as files, then end their runs (waits a bounded
    time for what is still queued)."""
    trackers.summary(report)
    for path in (rd.report, rd.plot):
        trackers.artifact(path)
    trackers.close(failed=failed)


def _train(cfg: RunConfig, rd: RunDir, svc: RunServices, setup: RunSetup, ckpt: Path | None, steps: list[dict], *,
           progress: bool, t_start: float, trackers) -> tuple[RunReport, list[tuple[float, int]]]:
    """The run inside its services: restore or evaluate, the step loop with its checkpoints (each step's record
    also to the ``trackers``), the final evaluation and export. Returns the report and the local cluster's
    live-worker series (for the plot)."""
    from rlboost_hpc.observe.report import ProgressView
    from rlboost_hpc.trainer import checkpoint
    from rlboost_hpc.trainer.eval import kl_to_reference

    resume = ResumeState.load(ckpt, svc.backend, rd)
    steps.extend(resume.steps)
    trackers.backfill(resume.steps)  # to a tracker added at this resume; runs it continues hold them
    metrics_f, samples_f = _open_step_files(rd, steps, resume.start_step, svc)
    held_out = _held_out(cfg, setup, svc)
    version0 = resume.trainer_state["version"] if resume.trainer_state else 0
    svc.hello(version0)
    svc.start_reserved()  # the reserved engines and the preemptible capacity boot (and load the first version)
    svc.start_rollout()  # while the starting policy is evaluated, not during the first step
    before = _tell_heldout(svc, "before", version0, resume.before or held_out.evaluate(version0))
    log.info("held-out reward before training: %.3f (greedy %.3f)", before["reward_sampled"], before["reward_greedy"])
    r = cfg.rollout
    n_resv, n_resv_source = reserved_instances(r.gpus_per_instance, cfg.trainer.gpus)
    log.info("N_resv = %g rollout instances (trainer GPUs from %s, %d GPU(s) per instance)", n_resv, n_resv_source,
             r.gpus_per_instance)
    trainer = _trainer(cfg, svc, setup, n_resv)
    if resume.trainer_state is not None:
        trainer.load_state_dict(resume.trainer_state)
    t_train0 = time.monotonic()
    ckpt_writer = checkpoint.CheckpointWriter(rd.root, background=cfg.trainer.checkpoint_background)
    svc.defer(lambda: _settle(ckpt_writer))  # on a failure too: finish (or report) the one in flight
    with ProgressView(cfg.trainer.steps, enabled=progress) as view:
        for step in range(resume.start_step, cfg.trainer.steps):
            rec = trainer.run_step(step)
            t_after = time.monotonic()  # the step's own bookkeeping and checkpoint: part of its timeline
            st = trainer.last_stats  # taken at the end of the step, after its version change
            _add_fleet(rec, st, svc, t_start, resume.tally)
            rec.n_prem_target, wanted = svc.target_of(trainer.decision)
            m = rec.line()
            svc.set_target(rec.n_prem_target, step=step + 1, wanted=wanted)
            steps.append(m)
            every = cfg.trainer.checkpoint_every
            if every and ((step + 1) % every == 0 or step + 1 == cfg.trainer.steps):
                # the steps before this one are in metrics.jsonl (fsynced before the checkpoint is published):
                # a checkpoint holds one step's record, whatever the run's length
                ckpt_writer.save(step + 1, svc.backend, trainer.state_dict(), {
                    **setup.checkpoint_identity(),
                    "metrics_lines": len(steps) - 1, "last_step_metrics": m, "before": before,
                    "resumes": resume.resumes, "counts": m["faults"],
                    "train_wall_s": resume.train_wall_s + time.monotonic() - t_train0}, durable=[rd.metrics])
            # (the checkpoint keeps the step as it was before its own save: its phases sum to its wall time too)
            add_phase(m, Phase.CHECKPOINT, time.monotonic() - t_after)
            _record_samples(step, rec.samples, samples_f, trackers)  # (before the line: W&B's row of the step)
            _record_step(svc, step, m, metrics_f, trackers, view)
    ckpt_writer.wait()  # the last checkpoint is durable before the run reports
    train_wall = resume.train_wall_s + time.monotonic() - t_train0  # training time of every incarnation
    if svc.cluster:
        svc.cluster.freeze()  # no fault while the run reports: the cluster's counts and the manager's agree
    final = svc.client.stats()
    served = svc.publisher.served()  # what the trainer sent (the rest of weight_pulled_bytes came from relay peers)
    after = held_out.evaluate(trainer.version, keep_samples=True)
    _tell_heldout(svc, "after", trainer.version, after)
    kl = kl_to_reference(svc.backend, after.pop("sampled"), estimator=cfg.trainer.kl_estimator)
    model_out = _export(cfg, rd, svc, setup, trainer.version) \
        if cfg.trainer.export_model and cfg.trainer.backend != "emulated" else None
    cluster = svc.cluster.summary() if svc.cluster else None
    report = build_report(
        steps=steps, stats=final, tally=resume.tally + FaultTally.observe(final, cluster), totals=trainer.totals,
        before=before, after=after, kl=kl, objective=cfg.trainer.model_dump(include=OBJECTIVE_KEYS),
        model=setup.model_info(), model_out=model_out,
        publishes=[p.record() for p in svc.publisher.history], served=served,
        rewards_timed_out=svc.runtime.rewards.timed_out, reward_workers_replaced=svc.runtime.rewards.replaced,
        n_resv=n_resv, n_resv_source=n_resv_source,
        rollout_engine=cfg.rollout.engine,
        prompts_not_trained_once=trainer.prompts_not_trained_once(), multi_turn=cfg.task.turns.max > 1,
        resumes=resume.resumes, resumed_from_step=resume.start_step if ckpt is not None else None,
        train_wall_s=train_wall, wall_s=time.monotonic() - t_start, max_staleness=cfg.rollout.max_staleness,
        trace_window_start_s=cluster["window_start_s"] if cluster else None, gate=cfg.trainer.gate_bounds(),
        faults_scheduled=cluster.get("scheduled") if cluster else None, lora=_lora_info(svc, cfg, model_out))
    report.reward_functions = svc.runtime.rewards.take_tallies() or None  # a user's task: each reward function's counts
    return report, svc.cluster.live_series if svc.cluster else []


def _lora_info(svc: RunServices, cfg: RunConfig, adapter_out: str | None) -> dict | None:
    """The report's ``lora`` entry (None: every weight trained)."""
    a = svc.adapter
    if a is None:
        return None
    merged = str(svc.run_dir.model) if adapter_out and cfg.trainer.lora.export_merged else None
    return {"rank": a.rank, "alpha": a.alpha, "targets": list(a.targets), "base_checksum": f"{a.base_checksum:016x}",
            "base_bytes": a.base_bytes, "adapter_out": adapter_out, "merged_out": merged}


def _tell_heldout(svc: RunServices, when: str, version: int, ev: dict) -> dict:
    """A held-out evaluation ``ev`` (``when``: before or after training, of weight ``version``) to the manager, for
    its gauges (kept across its restarts); a run without a model (``NotEvaluated``: NaN rewards) has none to tell.
    Returns ``ev``."""
    if not math.isnan(ev["reward_sampled"]):
        svc.client.send(M.Evaluation(when=when, result=HeldOutEvaluation(
            version=version, reward_sampled=ev["reward_sampled"], reward_greedy=ev["reward_greedy"],
            pass_at_k=dict(ev.get("pass_at_k", {})))))
    return ev


def _record_step(svc: RunServices, step: int, m: dict, metrics_f, trackers, view) -> None:
    """A finished step's record ``m`` to everyone who follows the run: the manager (its times, mismatch and rewards,
    for the metrics it serves), ``metrics.jsonl`` (flushed), the experiment trackers and the progress view."""
    svc.client.send(M.StepTimes(step=step, wall_s=m["wall_s"], phases=m["phase_s"],
                                fixed_overhead_s=m["fixed_overhead_s"],
                                mismatch={k: float(m[k]) for k in MISMATCH_KEYS if k in m},
                                rewards=m.get("reward_functions", {})))
    metrics_f.write(json.dumps(m) + "\n")
    metrics_f.flush()
    trackers.step(m)
    view.update(m)


def _open_step_files(rd: RunDir, steps: list[dict], start_step: int, svc: RunServices):
    """``metrics.jsonl`` and ``samples.jsonl`` open to append (closed with ``svc``), holding what the checkpoint
    covers: the records ``steps`` and the sample rows of the steps before ``start_step`` (a resume redoes the steps
    after its checkpoint: their lines are written again, never twice)."""
    kept = []
    if start_step and rd.samples.exists():
        kept = [ln for ln in rd.samples.read_text().splitlines(keepends=True)
                if ln.strip() and json.loads(ln).get("step", 0) < start_step]
    files = open(rd.metrics, "w"), open(rd.samples, "w")
    for f, lines in zip(files, ([json.dumps(m) + "\n" for m in steps], kept)):
        svc.defer(f.close)
        f.writelines(lines)
        f.flush()
    return files


def _record_samples(step: int, rows: list[dict], samples_f, trackers) -> None:
    """A step's sample rows (``trainer.log_samples``) to ``samples.jsonl`` (flushed) and the trackers' tables."""
    if not rows:
        return
    samples_f.writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)
    samples_f.flush()
    trackers.samples(step, rows)


def _add_fleet(rec: StepRecord, st, svc: RunServices, t_start: float, before: FaultTally) -> None:
    """Add to the step record the fleet at the step's end (``st``: the manager's stats then): live and routable
    preemptible instances, the cluster's live workers, how the version the step sampled from reached the fleet
    (``version_serving``: :class:`~rlboost_hpc.protocol.stats.VersionServing`), and the run's fault tally so far
    (``faults``: ``before`` — earlier incarnations' — plus this one's)."""
    rec.t_s, rec.ts = time.monotonic() - t_start, round(time.time(), 3)
    rec.live_preemptible, rec.routable_preemptible = st.live_preemptible, st.routable_preemptible
    rec.cluster_live = svc.cluster.live() if svc.cluster else st.live_preemptible
    rec.version_serving = msgspec.structs.asdict(st.last_version_serving)
    rec.faults = (before + FaultTally.observe(st, svc.cluster.summary() if svc.cluster else None)).to_json()


def _announce_cost(cfg: RunConfig, setup: RunSetup) -> None:
    """Say what a step and an evaluation will cost on this machine before either starts
    (:mod:`rlboost_hpc.trainer.cost`): logged, and a WARNING when a step may take over
    :data:`~rlboost_hpc.trainer.cost.SLOW_STEP_S` (a GPU-sized config on a CPU)."""
    from rlboost_hpc.trainer.cost import SLOW_STEP_S, estimate, probe_rates

    if cfg.trainer.backend == "emulated":  # a load test: its time is the profile's, not this machine's
        return
    r, tok = cfg.rollout, setup.policy.tokenizer
    prompts = [setup.task.prompt_ids(p, tok) for p in setup.task.train_prompts()[:r.max_batch]]
    step_n = r.prompts_per_step * r.group_size
    eval_n = cfg.task.heldout_prompts * (cfg.trainer.eval_samples + 1)  # sampled + one greedy per prompt
    rates = probe_rates(setup.policy.arch, setup.policy.state_dict, prompts, batch=min(r.max_batch, step_n),
                        device=setup.rollout_device, dtype=setup.rollout_dtype)
    cost = estimate(rates, step_responses=step_n, eval_responses=eval_n, tokens_per_response=cfg.trajectory_tokens(),
                    mean_prompt_tokens=sum(map(len, prompts)) / len(prompts))
    line = cost.describe(rates, f"{setup.rollout_device}/{str(setup.rollout_dtype).removeprefix('torch.')}")
    if cost.step_s > SLOW_STEP_S or cost.eval_s > SLOW_STEP_S:
        log.warning("%s. This config is sized for more compute than this machine has: fewer prompts_per_step, "
                    "group_size, max_new_tokens or heldout_prompts (configs/gsm8k-qwen3-cpu.toml tries a model on "
                    "a CPU) or a GPU", line)
    else:
        log.info("%s", line)


def _held_out(cfg: RunConfig, setup: RunSetup, svc: RunServices):
    """Held-out evaluation as the run's rollouts sample (same budgets, the run's reward pool, multi-turn with its
    own tool workers), of versions read back from the publisher, on the rollout device."""
    from rlboost_hpc.trainer.eval import HeldOut, TurnSettings

    if cfg.trainer.backend == "emulated":
        log.info("trainer.backend = emulated: no model, so no held-out evaluation and no exported model")
        return NotEvaluated()
    r = cfg.rollout
    turns = None
    if svc.runtime.eval_turns is not None:
        turns = TurnSettings(cfg.task.turns.max, cfg.trajectory_tokens(), setup.tool_stops, svc.runtime.eval_turns)
    return HeldOut(setup.policy.arch, setup.policy.tokenizer, setup.task,
                   weights=lambda v: svc.publisher.read(v).state_dict, samples=cfg.trainer.eval_samples,
                   max_new_tokens=r.max_new_tokens, top_p=r.top_p,
                   temperature=r.temperature if cfg.trainer.eval_temperature is None else cfg.trainer.eval_temperature,
                   pass_k=tuple(cfg.trainer.eval_pass_k), correct_at=cfg.trainer.eval_correct_at,
                   device=setup.rollout_device, dtype=setup.rollout_dtype, score=svc.runtime.rewards.score, turns=turns,
                   adapter=None if svc.adapter is None else (svc.adapter, svc.base_state))


class NotEvaluated:
    """The held-out evaluation of a run without a model (``trainer.backend = "emulated"``): rewards and the
    repetition rate are NaN (``null`` in ``report.json``), no responses, no examples."""

    def evaluate(self, version: int, keep_samples: bool = False) -> dict:
        out = {"reward_sampled": math.nan, "reward_greedy": math.nan, "repetition_rate": math.nan, "responses": 0,
               "pass_at_k": {}, "examples": []}
        return {**out, "sampled": []} if keep_samples else out


def _trainer(cfg: RunConfig, svc: RunServices, setup: RunSetup, n_resv: float):
    """The RL step loop over the run's services, with its controller (T_seed and N_prem, from ``policy.*``)."""
    from rlboost_hpc.policy.controller import RolloutController
    from rlboost_hpc.policy.seeding import SeedingWindow
    from rlboost_hpc.trainer.loop import RLTrainer, StepSettings

    r, t, pol = cfg.rollout, cfg.trainer, cfg.policy
    settings = StepSettings(prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            micro_batch=t.micro_batch, micro_batch_max=t.micro_batch_max or 0,
                            seed_until_trainable=pol.seed_until_trainable,
                            step_timeout_s=t.step_timeout_s, seed=t.seed, max_turns=cfg.task.turns.max,
                            max_trajectory_tokens=cfg.trajectory_tokens(), tool_stop_ids=setup.tool_stops,
                            advantage_std_norm=t.advantage_std_norm, max_staleness=r.max_staleness,
                            steps=t.steps, behaviour_dropped_warn=t.behaviour_dropped_warn,
                            log_samples=t.log_samples)
    controller = RolloutController(
        n_resv=n_resv, use_cap=pol.cap, overlap=r.max_staleness > 0,
        seeding=SeedingWindow(initial_s=pol.t_seed_initial_s, eta=pol.eta, floor_s=pol.t_seed_floor_s,
                              adapt=pol.adaptive_seeding, memory=pol.t_seed_memory, ceil_s=pol.t_seed_ceil_s))
    return RLTrainer(client=svc.client, backend=svc.backend, task=setup.task, tokenizer=setup.policy.tokenizer,
                     settings=settings, score=svc.runtime.rewards.score, publish=svc.publisher.publish,
                     controller=controller, available=svc.available)


def _export(cfg: RunConfig, rd: RunDir, svc: RunServices, setup: RunSetup, version: int) -> str:
    """Write the trained policy as rollout instances receive it: the model directory ``RUN_DIR/model``, or — LoRA —
    the adapter in PEFT's format (``RUN_DIR/adapter``) and, with ``trainer.lora.export_merged``, the merged model in
    ``RUN_DIR/model``. Returns the path the report names (the adapter's in a LoRA run)."""
    if svc.adapter is None:
        return str(save_model_dir(rd.model, setup.policy, _exported(cfg, svc, version)))
    from rlboost_hpc.trainer.lora import export

    lo = cfg.trainer.lora
    out = export(rd.adapter, rd.model, setup.policy, _exported(cfg, svc, version), svc.adapter, dropout=lo.dropout,
                 merged=lo.export_merged)
    return out["adapter"]


def _exported(cfg: RunConfig, svc: RunServices, version: int):
    """The trained policy as rollout instances receive it: pulled over the wire (gathered) or assembled from
    the ranks' shards."""
    from rlboost_hpc.weights.puller import WeightPuller

    if svc.publisher.shards:
        return svc.publisher.read(version).state_dict
    w = cfg.weights
    return WeightPuller(svc.weights_endpoint, streams=w.streams, window=w.window, timeout_s=w.pull_timeout_s,
                        keys=svc.keys.client_view() if svc.keys else None,
                        label="final export").pull(version).state_dict


def _metrics_before(out_dir: Path, n: int) -> list[dict]:
    """The step records a checkpoint covers besides its own last one: the first ``n`` lines of ``metrics.jsonl``
    (fsynced before the checkpoint was published). Fewer (the file was lost or truncated by hand) is logged and the
    run goes on with what is there: step records are observability, not training state."""
    out = read_jsonl(RunDir(out_dir).metrics)[:n]
    if len(out) < n:
        log.warning("%s holds %d of the %d step records before the checkpoint; the report and plot cover those",
                    RunDir(out_dir).metrics, len(out), n)
    return out


def _settle(writer) -> None:
    """Wait for a checkpoint still in flight when the run stops early; its failure is logged (the run's own
    error is the one raised)."""
    try:
        writer.wait()
    except Exception as e:  # noqa: BLE001 - the run is already failing
        log.error("the checkpoint in flight failed: %s", e)
