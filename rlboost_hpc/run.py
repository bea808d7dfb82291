"""``rlboost-hpc run``: one RLBoost run on this machine (embedded local default).

Starts, as real processes and sockets: the rollout manager (its own process), the weight server (a thread
of the trainer process, serving the host buffer), the reserved engine (a rollout agent in a trainer thread,
the seeding instance), the local preemptible cluster (worker processes replaying a spot trace), and the
trainer loop. Writes ``report.json``, ``metrics.jsonl`` and ``run.png`` into the output directory.

Invariant: the run never reports success it did not have — a rollout failure that no migration could
recover raises :class:`~rlboost_hpc.trainer.loop.RolloutFailed` and the CLI exits non-zero; every process
it started is stopped on every exit path.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import torch

from rlboost_hpc.config import ConfigError, RunConfig
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.protocol.stats import ManagerStats
from rlboost_hpc.rollout.spec import WorkerSpec
from rlboost_hpc.tasks.reward_pool import RewardPool
from rlboost_hpc.observe.timeline import Phase, add_phase, summarize
from rlboost_hpc.cluster.capacity import available_from_scavenger, reserved_instances
from rlboost_hpc.procutil import reclaim_leftovers
from rlboost_hpc.rundir import RunDir, advertised, read_jsonl, write_endpoints, write_file_sd, write_target

log = logging.getLogger("rlboost.run")


def load_model(cfg: RunConfig):
    """The configured policy as a :class:`~rlboost_hpc.models.hf_dir.PolicyModel`: ``model.path`` (a Hugging Face
    model directory), else stories260K converted once into ``model.cache_dir``.

    Raises:
        ModelFormatError: the directory lacks or has inconsistent files (named); DataFileMissing: stories260K's
            source files are absent.
    """
    from rlboost_hpc.models.hf_dir import load_model_dir
    from rlboost_hpc.models.llama2c import ensure_converted

    path = Path(cfg.model.path).expanduser() if cfg.model.path else ensure_converted(
        Path(cfg.model.cache_dir).expanduser())
    return load_model_dir(path, chat=cfg.task.chat_template)


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


def tool_stop_ids(cfg: RunConfig, tok) -> tuple[int, ...]:
    """The token id that ends a tool call (``task.tool_call_close``), as a one-element tuple; () for single-turn
    tasks.

    Raises:
        ConfigError: ``task.tool_call_close`` is not exactly one token of the policy's tokenizer.
    """
    if cfg.task.max_turns == 1:
        return ()
    close = cfg.task.tool_call_close
    tid = tok.hf.convert_tokens_to_ids(close)  # a token of the vocabulary as it is (e.g. Qwen's </tool_call>)
    if not isinstance(tid, int) or tid == tok.hf.unk_token_id:
        ids = tok.hf(close, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ConfigError(f"task.tool_call_close = {close!r} is {len(ids)} tokens of the policy's tokenizer "
                              f"({ids}); it must be exactly one (it ends the turn as a stop id)")
        tid = ids[0]
    return (int(tid),)


def _environment(cfg: RunConfig, policy) -> dict | None:
    """The manager's tool-call pool (multi-turn tasks): :func:`~rlboost_hpc.manager.service.run_manager_process`'s
    ``environment``; None for single-turn tasks."""
    from rlboost_hpc.tasks.tools import ToolEnvironment, ToolSyntax

    t = cfg.task
    if t.max_turns == 1:
        return None
    env = ToolEnvironment(tokenizer_dir=str(policy.path), use_chat=policy.tokenizer.use_chat,
                          syntax=ToolSyntax(t.tool_call_open, t.tool_call_close), tool=t.tool,
                          plain_format=t.tool_plain_format, max_observation_tokens=t.max_observation_tokens)
    return dict(env=env, workers=t.tool_workers, timeout_s=t.tool_timeout_s)


def _start_manager(cfg: RunConfig, keys_dir: str | None, journal_path: str | None = None, run_id: str | None = None,
                   environment: dict | None = None):
    from rlboost_hpc.manager.service import spawn_manager
    from rlboost_hpc.policy.dispatch import Balancer

    metrics_host = None if cfg.manager.metrics is False else cfg.network.bind_host
    return spawn_manager(bind=f"tcp://{cfg.network.bind_host}:0", keys_dir=keys_dir, metrics_host=metrics_host,
                         journal_path=journal_path, run_id=run_id, environment=environment, params=dict(
        pending_limit=cfg.manager.pending_limit, heartbeat_s=cfg.manager.heartbeat_s,
        heartbeat_timeout_s=cfg.manager.heartbeat_timeout_s, max_attempts=cfg.manager.max_attempts,
        instance_expiry_s=cfg.manager.instance_expiry_s,
        stream_every_tokens=cfg.rollout.stream_every_tokens, stream_every_s=cfg.rollout.stream_every_s,
        dispatch_policy=cfg.policy.dispatch, balance_every_s=cfg.policy.balance_every_s,
        balancer=Balancer() if cfg.policy.balance else None,
        relay_fanout=cfg.weights.relay_fanout if cfg.weights.relay else 0,
        relay_trainer_fanout=cfg.weights.relay_trainer_fanout))


def run(cfg: RunConfig, out_dir: Path, *, progress: bool = True, run_id: str | None = None) -> dict:
    """Run the configured job; returns the report (also written to ``out_dir/report.json``).

    ``run_id`` names the run in ``endpoints.json`` (rollout jobs tag their events with it); default
    ``$RLBOOST_RUN_ID`` (set by the Slurm launcher), else the output directory's name. The calling process's
    environment is left as it was (the data directory of ``data.dir`` holds only for the run's duration).

    Raises:
        RolloutFailed: a step could not be completed (after the services were stopped).
    """
    from rlboost_hpc.paths import using_data_dir

    with using_data_dir(cfg.data.dir):
        return _run(cfg, Path(out_dir), progress=progress,
                    run_id=run_id or os.environ.get("RLBOOST_RUN_ID") or Path(out_dir).name)


def _run(cfg: RunConfig, out_dir: Path, *, progress: bool, run_id: str) -> dict:
    from rlboost_hpc.cluster.local import LocalCluster
    from rlboost_hpc.models.device import resolve_device, resolve_dtype
    from rlboost_hpc.models.hf_dir import save_model_dir
    from rlboost_hpc.observe.report import ProgressView, write_plot
    from rlboost_hpc.policy.controller import RolloutController
    from rlboost_hpc.policy.seeding import SeedingWindow
    from rlboost_hpc.rollout.agent import RolloutAgent
    from rlboost_hpc.rollout.engines.factory import torch_engine_factory
    from rlboost_hpc.tasks.base import get_task
    from rlboost_hpc.trainer import checkpoint
    from rlboost_hpc.trainer.backends.torch_backend import TorchBackend
    from rlboost_hpc.trainer.client import ManagerClient
    from rlboost_hpc.trainer.eval import evaluate, kl_to_reference
    from rlboost_hpc.trainer.loop import RLTrainer, StepSettings
    from rlboost_hpc.trainer.publisher import WeightPublisher
    from rlboost_hpc.weights.puller import WeightPuller
    from rlboost_hpc.weights.server import WeightServer
    from rlboost_hpc.weights.sharded import manifest_nbytes

    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = _resume_point(cfg, out_dir)
    t_start = time.monotonic()
    torch.manual_seed(cfg.trainer.seed)
    torch.set_num_threads(cfg.trainer.torch_threads)
    (out_dir / "config.json").write_text(cfg.model_dump_json(indent=2))

    policy = load_model(cfg)
    arch, tok = policy.arch, policy.tokenizer
    task = get_task(cfg.task.name, n_train=cfg.task.train_prompts, n_heldout=cfg.task.heldout_prompts)
    if hasattr(task, "tool_syntax"):  # a tool task tells the policy how to call its tool: the run's syntax
        from rlboost_hpc.tasks.tools import ToolSyntax

        task.tool_syntax = ToolSyntax(cfg.task.tool_call_open, cfg.task.tool_call_close)
    longest = max(len(task.prompt_ids(p, tok)) for p in task.train_prompts() + task.heldout_prompts())
    if longest + cfg.trajectory_tokens() > arch.max_position_embeddings:
        key = ("rollout.max_new_tokens" if cfg.task.max_turns == 1 else
               "task.max_trajectory_tokens (0: task.max_turns × rollout.max_new_tokens)")
        raise ConfigError(f"{key} = {cfg.trajectory_tokens()} plus the longest prompt ({longest} tokens) exceeds the "
                          f"model's context of {arch.max_position_embeddings} tokens")
    tool_stops = tool_stop_ids(cfg, tok)
    wdtype = getattr(torch, cfg.weights.dtype)
    r = cfg.rollout
    train_device = resolve_device(cfg.trainer.device, "trainer.device")
    train_dtype = resolve_dtype(cfg.trainer.dtype, train_device, "trainer.dtype")
    rollout_device = resolve_device(r.device, "rollout.device")
    rollout_dtype = resolve_dtype(r.dtype, rollout_device, "rollout.dtype")
    eval_kw = dict(samples=cfg.trainer.eval_samples, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                   top_p=r.top_p, device=rollout_device, dtype=rollout_dtype)
    log.info("model %s (%s, %.1f M parameters, chat template %s); trainer on %s/%s, rollout on %s/%s",
             policy.path, arch.architecture, arch.num_params() / 1e6, "on" if tok.use_chat else "off",
             train_device, str(train_dtype).removeprefix("torch."), rollout_device,
             str(rollout_dtype).removeprefix("torch."))

    keys = None
    if cfg.security.curve:  # per-run keys, owner-only, in the run directory (protocol/auth.py); a resumed run
        try:                # keeps them, so rollout jobs that outlived the crash can reconnect
            keys = RunKeys.load(out_dir) if ckpt is not None else None
        except Exception:  # noqa: BLE001 - unreadable or absent: new keys (old rollout jobs then cannot rejoin)
            keys = None
        if keys is None:
            keys = RunKeys.generate()
            keys.save(out_dir)
    server = WeightServer(bind=f"tcp://{cfg.network.bind_host}:0", chunk_bytes=cfg.weights.chunk_bytes,
                          keys=keys, delta=cfg.weights.delta, delta_max_ratio=cfg.weights.delta_max_ratio).start()
    environment = _environment(cfg, policy)
    mproc, bound, metrics_url = _start_manager(cfg, str(out_dir) if keys else None,
                                               str(RunDir(out_dir).journal), run_id, environment)
    host = cfg.network.advertise_host or (socket.gethostname() if cfg.network.bind_host in ("0.0.0.0", "*")
                                          else cfg.network.bind_host)
    endpoint, weights_endpoint = advertised(bound, host), advertised(server.endpoint, host)
    client = ManagerClient(endpoint, keys=keys, alive=mproc.is_alive)
    write_endpoints(out_dir, endpoint, weights_endpoint, run_id=run_id, curve=keys is not None,
                    metrics=metrics_url.replace("0.0.0.0", host), worker=WorkerSpec.from_config(cfg).to_json())
    if metrics_url:
        write_file_sd(out_dir, "rlboost-manager", metrics_url.replace("0.0.0.0", host), run_id)
        log.info("manager metrics: %s (file_sd: %s/prometheus/)", metrics_url.replace("0.0.0.0", host), out_dir)
    slurm = cfg.cluster.kind == "slurm"
    cluster = reserved = reserved_thread = None
    t = cfg.trainer
    common = dict(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, clip_eps=t.clip_eps,
                  kl_coef=t.kl_coef, temperature=r.temperature)
    if t.backend != "torch":  # e.g. megatron: provided by megatron_bridge through an entry point
        from rlboost_hpc.trainer.backends import plugin_backend

        backend = plugin_backend(t.backend)(cfg, policy, common, keys=keys, advertise_host=host)
    else:
        backend = TorchBackend(arch, policy.state_dict, device=train_device, dtype=train_dtype, **common)
    w = cfg.weights
    publisher = WeightPublisher(server, backend, wdtype, client_keys=keys.client_view() if keys else None,
                                streams=w.streams, window=w.window, timeout_s=w.pull_timeout_s)
    publishes, publish = publisher.history, publisher.publish
    if publisher.shards:
        log.info("weights: every model-parallel rank serves its own shards (%d holders, %.1f MB per version)",
                 len(publisher.shards["holders"]), manifest_nbytes(publisher.shards) / 1e6)

    step_metrics: list[dict] = []
    closers: list = []  # called after the cluster has stopped
    metrics_f = None
    failure: BaseException | None = None
    report: dict = {}
    try:
        start_step, trainer_state, resumes, prior_counts, prior_wall = 0, None, 0, {}, 0.0
        if ckpt is not None:  # model, optimizer, RNG now; the loop's state once the trainer exists
            start_step, trainer_state, run_state = checkpoint.load(ckpt, backend, verified=True, run_keys=(
                "metrics_lines", "last_step_metrics", "before", "resumes", "counts", "train_wall_s"))
            step_metrics = _metrics_before(out_dir, run_state["metrics_lines"]) + [run_state["last_step_metrics"]]
            before, resumes = run_state["before"], run_state["resumes"] + 1
            prior_counts, prior_wall = run_state["counts"], run_state["train_wall_s"]
        rewards = RewardPool(task, workers=cfg.task.reward_workers, timeout_s=cfg.task.reward_timeout_s)
        closers.append(rewards.close)
        eval_kw["score"] = rewards.score
        if environment is not None:  # held-out trajectories call the tool too (their own workers, same deadline)
            from rlboost_hpc.tasks.tools import ToolCalls
            from rlboost_hpc.trainer.eval import TurnSettings

            eval_tools = ToolCalls(**environment)
            closers.append(eval_tools.close)
            eval_kw["turns"] = TurnSettings(cfg.task.max_turns, cfg.trajectory_tokens(), tool_stops, eval_tools)
        metrics_f = open(RunDir(out_dir).metrics, "w")  # what the checkpoint covers, then the new steps
        metrics_f.writelines(json.dumps(m) + "\n" for m in step_metrics)
        metrics_f.flush()
        version0 = trainer_state["version"] if trainer_state else 0
        client.call(M.TrainerHello(weights_endpoint=weights_endpoint, model_config=policy.hf_config,
                                   model_arch=arch.to_json(), weights_shards=publisher.shards_json))
        man0 = publish(version0)
        client.call(M.SetVersion(version=version0, checksum=man0["weight_checksum"]))
        if ckpt is None:
            before = evaluate(arch, publisher.state_dict(version0)[0], tok, task, **eval_kw)
            before.pop("sampled")
        log.info("held-out reward before training: %.3f (greedy %.3f)", before["reward_sampled"], before["reward_greedy"])

        def local_source(_endpoint: str, _shards: str = ""):
            def pull(version: int):
                t0 = time.monotonic()
                sd, info = publisher.state_dict(version, follow=True)  # the engine copies what it loads
                return sd, {**info, "pull_s": time.monotonic() - t0}
            return pull

        reserved = RolloutAgent(endpoint, "reserved", 0, kind="reserved", max_batch=r.max_batch,
                                weight_source_factory=local_source, keys=keys,
                                engine_factory=torch_engine_factory(r.max_batch, r.device, r.dtype))
        reserved_thread = threading.Thread(target=reserved.run, name="reserved-engine", daemon=True)
        reserved_thread.start()
        if slurm:  # rollout jobs come from the scavenger; tell it how many we want
            write_target(out_dir, cfg.cluster.max_workers, active=True, step=0, gpus_per_instance=r.gpus_per_instance)
        else:
            partial = None
            if cfg.cluster.preempt_when_busy:  # the cluster's thread asks the manager on a socket of its own
                probe = ManagerClient(endpoint, keys=keys, alive=mproc.is_alive, timeout_s=2.0)
                closers.append(probe.close)

                def partial() -> dict[str, int]:
                    return {k: i.partial for k, i in probe.stats().instances.items()}
            cluster = LocalCluster(cfg.cluster, endpoint, out_dir, t_origin=t_start, partial_by_instance=partial)
            cluster.start()
        settings = StepSettings(prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                                max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                micro_batch=cfg.trainer.micro_batch, seed_window_s=cfg.trainer.seed_window_s,
                                step_timeout_s=cfg.trainer.step_timeout_s,
                                seed=cfg.trainer.seed, max_turns=cfg.task.max_turns,
                                max_trajectory_tokens=cfg.trajectory_tokens(), tool_stop_ids=tool_stops)
        pol = cfg.policy
        n_resv, n_resv_source = reserved_instances(r.gpus_per_instance, cfg.trainer.gpus)
        log.info("N_resv = %g rollout instances (trainer GPUs from %s, %d GPU(s) per instance)", n_resv, n_resv_source,
                 r.gpus_per_instance)
        controller = RolloutController(
            n_resv=n_resv, use_cap=pol.cap,
            seeding=SeedingWindow(initial_s=cfg.trainer.seed_window_s, eta=pol.eta, floor_s=pol.seed_floor_s,
                                  adapt=pol.adaptive_seeding, memory=pol.seed_memory, ceil_s=pol.seed_ceil_s))
        trainer = RLTrainer(client=client, backend=backend, task=task, tokenizer=tok, settings=settings,
                            score=rewards.score,
                            publish=publish, controller=controller,
                            available=lambda: _available(cfg, out_dir, cluster))
        if trainer_state is not None:
            trainer.load_state_dict(trainer_state)
        t_train0 = time.monotonic()
        ckpt_writer = checkpoint.CheckpointWriter(out_dir, background=cfg.trainer.checkpoint_background)
        closers.append(lambda: _settle(ckpt_writer))  # on a failure too: finish (or report) the one in flight
        with ProgressView(cfg.trainer.steps, enabled=progress) as view:
            for step in range(start_step, cfg.trainer.steps):
                m = trainer.run_step(step)
                t_after = time.monotonic()  # the step's own bookkeeping and checkpoint: part of its timeline
                st = trainer.last_stats  # taken at the end of the step, after its version change
                m.update(t_s=time.monotonic() - t_start, ts=round(time.time(), 3),
                         live_preemptible=st.live_preemptible, routable_preemptible=st.routable_preemptible,
                         cluster_live=cluster.live() if cluster else st.live_preemptible)
                cap = trainer.decision.n_prem_cap if trainer.decision else None
                n_prem = cfg.cluster.max_workers if cap is None else min(cap, cfg.cluster.max_workers)
                m["n_prem_target"] = n_prem
                if slurm:
                    write_target(out_dir, n_prem, active=True, step=step + 1, gpus_per_instance=r.gpus_per_instance)
                elif cluster is not None:
                    cluster.set_cap(n_prem)
                step_metrics.append(m)
                every = cfg.trainer.checkpoint_every
                if every and ((step + 1) % every == 0 or step + 1 == cfg.trainer.steps):
                    # the steps before this one are in metrics.jsonl (fsynced before the checkpoint is published):
                    # a checkpoint holds one step's record, whatever the run's length
                    ckpt_writer.save(step + 1, backend, trainer.state_dict(), {
                        "metrics_lines": len(step_metrics) - 1, "last_step_metrics": m, "before": before,
                        "resumes": resumes, "counts": _add_counts(prior_counts, _counts(cluster, st)),
                        "train_wall_s": prior_wall + time.monotonic() - t_train0}, durable=[RunDir(out_dir).metrics])
                # (the checkpoint keeps the step as it was before its own save: its phases sum to its wall time too)
                add_phase(m, Phase.CHECKPOINT, time.monotonic() - t_after)
                client.send(M.StepTimes(step=step, wall_s=m["wall_s"], phases=m["phase_s"],
                                        fixed_overhead_s=m["fixed_overhead_s"]))
                metrics_f.write(json.dumps(m) + "\n")
                metrics_f.flush()
                view.update(m)
        ckpt_writer.wait()  # the last checkpoint is durable before the run reports
        train_wall = prior_wall + time.monotonic() - t_train0  # training time of every incarnation
        final_stats = client.stats()
        served = publisher.served()  # what the trainer sent (the rest of weight_pulled_bytes came from relay peers)
        after = evaluate(arch, publisher.state_dict(trainer.version)[0], tok, task, **eval_kw)
        kl = kl_to_reference(backend, after.pop("sampled"))
        model_out = None
        if cfg.trainer.export_model:  # the trained policy as rollout instances receive it: pulled, then written
            if publisher.shards:
                exported = publisher.state_dict(trainer.version)[0]
            else:
                exported = WeightPuller(weights_endpoint, streams=w.streams, window=w.window,
                                        timeout_s=w.pull_timeout_s, keys=keys.client_view() if keys else None,
                                        label="final export").pull(trainer.version).state_dict
            model_out = str(save_model_dir(out_dir / "model", policy, exported))
        tot = trainer.totals
        window_start = cluster.summary()["window_start_s"] if cluster is not None else None
        tally = _add_counts(prior_counts, _counts(cluster, final_stats))  # all incarnations of the run
        report = {
            "steps": len(step_metrics),
            "resumes": resumes,
            "resumed_from_step": start_step if ckpt is not None else None,
            "reward_heldout_before": before["reward_sampled"],
            "reward_heldout_after": after["reward_sampled"],
            "reward_heldout_greedy_before": before["reward_greedy"],
            "reward_heldout_greedy_after": after["reward_greedy"],
            "repetition_rate_before": before["repetition_rate"],
            "repetition_rate_after": after["repetition_rate"],
            "kl_to_reference_nats_per_token": kl,
            "model_out": model_out,
            "model": {"path": str(policy.path), "architecture": arch.architecture, "parameters": arch.num_params(),
                      "chat_template": tok.use_chat, "trainer_device": str(train_device),
                      "rollout_device": str(rollout_device)},
            "responses_trained": tot.responses_trained,
            "responses_lost": tot.responses_expected - tot.responses_trained,
            "responses_duplicated": tot.responses_duplicated,
            "preemptions": tally["preemptions_warned"] + tally["kills"],
            "preemptions_with_warning": tally["preemptions_warned"],
            "kills_without_warning": tally["kills"],
            "worker_starts": tally["starts"],
            "responses_migrated": tally["responses_migrated"],
            "balancer_moves": final_stats.balancer_moves,
            "rollout_engine": r.engine,
            "migrations_by_engine": final_stats.migrations_by_engine,
            "migrated_responses_trained": tot.migrated_responses_trained,
            "tokens_migrated": tally["tokens_migrated"],
            "tokens_regenerated": tally["tokens_regenerated"],
            "tokens_regenerated_after_warning": final_stats.tokens_regenerated_after_warning,
            "tokens_trained_off_version": tot.tokens_trained_off_version,
            "off_version_tokens_rejected": final_stats.off_version_tokens_rejected,
            "late_tokens_dropped": final_stats.late_tokens,
            "weight_pulls": final_stats.weight_loads,
            "weight_pull_failures": final_stats.weight_load_failures,
            "weight_pull_seconds_mean": final_stats.pull_seconds_mean,
            "weight_bytes": publishes[-1]["weight_bytes"] if publishes else 0,
            "weight_update_bytes_mean": (sum(p["weight_update_bytes"] for p in publishes[1:]) / (len(publishes) - 1)
                                         if len(publishes) > 1 else 0.0),
            "weight_pulled_bytes": final_stats.weight_pulled_bytes,
            "weight_checksum_mismatches": final_stats.weight_checksum_mismatches,
            "weight_trainer_bytes_served": served["bytes_served"] + served["delta_bytes_served"],
            "weight_shards": served["shards"],
            "instances_lost_without_warning": final_stats.instances_lost,
            "instances_suspected": tally["instances_suspected"],
            "instances_recovered": tally["instances_recovered"],
            "stalls": tally["stalls"],
            "link_resets": tally["link_resets"],
            "slow_weight_loads": tally["slow_weight_loads"],
            "deltas_out_of_order": tally["deltas_out_of_order"],
            "instances_lost_while_pulling": tally["instances_lost_while_pulling"],
            "prompts_not_trained_exactly_once": trainer.prompts_not_trained_once(),
            "instances_preempted_with_warning": final_stats.instances_preempted_with_warning,
            "instances_time_limit": final_stats.instances_time_limit,
            "rewards_timed_out": rewards.timed_out, "reward_workers_replaced": rewards.replaced,
            "n_resv": n_resv, "n_resv_source": n_resv_source,
            "decode_tokens_per_s_by_batch": final_stats.decode_tokens_per_s_by_batch,
            "instances_drained": final_stats.instances_drained,
            "protocol_rejects": final_stats.protocol_rejects,
            **_trajectory_report(cfg, final_stats, step_metrics, train_wall),
            "tokens_trained": tot.tokens_trained,
            "throughput_tokens_per_s": tot.tokens_trained / train_wall if train_wall > 0 else 0.0,
            "train_wall_s": train_wall,
            **summarize(step_metrics),
            "wall_s": time.monotonic() - t_start,
            "trace_window_start_s": window_start,
            "examples_after": after["examples"],
        }
    except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
        failure = e
    finally:
        if metrics_f is not None:
            metrics_f.close()
        if slurm:
            write_target(out_dir, 0, active=False, step=len(step_metrics), gpus_per_instance=r.gpus_per_instance)
        if cluster is not None:
            cluster.stop()
            reclaim_leftovers()  # what SIGKILLed local workers left on this node (shared memory, temp dirs)
        for close in closers:
            close()
        if reserved is not None:
            reserved.request_stop("run finished")
            reserved_thread.join(timeout=10)
        try:
            client.call(M.Shutdown(reason="run finished"), timeout_s=5)
        except Exception:  # noqa: BLE001 - the manager may already be gone
            pass
        client.close()
        mproc.join(timeout=10)
        if mproc.is_alive():
            mproc.kill()
        server.close()
        backend.close()  # the Megatron backend holds process groups / shard servers
    if failure is not None:
        RunDir(out_dir).report.write_text(json.dumps(
            {"failed": True, "error": f"{type(failure).__name__}: {failure}", "steps": len(step_metrics)}, indent=2))
        raise failure
    RunDir(out_dir).report.write_text(json.dumps(report, indent=2))
    write_plot(step_metrics, cluster.live_series if cluster else [], RunDir(out_dir).plot,
               before=report["reward_heldout_before"], after=report["reward_heldout_after"])
    return report


_COUNTS = ("preemptions_warned", "kills", "starts", "stalls", "link_resets", "instances_lost_while_pulling",
           "responses_migrated", "tokens_migrated", "tokens_regenerated", "instances_suspected", "instances_recovered",
           "slow_weight_loads", "deltas_out_of_order")
_CLUSTER_COUNTS = 5  # the first ones come from the local cluster (under Slurm: from what the manager saw)


def _counts(cluster, stats: ManagerStats) -> dict:
    """Fault and migration counters of this incarnation: the local cluster's (or, under Slurm, what the manager
    saw: warned preemptions, losses without warning, registrations other than the reserved engine's)."""
    if cluster is not None:
        c = cluster.summary()
        out = {"preemptions_warned": c["preemptions_warned"], "kills": c["kills"], "starts": c["starts"],
               "stalls": c["stalls"], "link_resets": c["link_resets"]}
    else:
        out = {"preemptions_warned": stats.instances_preempted_with_warning, "kills": stats.instances_lost,
               "starts": max(0, stats.registrations - 1), "stalls": 0, "link_resets": 0}
    return {**out, **{k: getattr(stats, k) for k in _COUNTS[_CLUSTER_COUNTS:]}}


def _trajectory_report(cfg: RunConfig, stats: ManagerStats, step_metrics: list[dict], train_wall: float) -> dict:
    """Multi-turn keys of the report (empty for single-turn tasks): turns per trajectory, tool calls and their
    share of the training wall time, migrations by turn index, and what restarting instead of resuming at the token
    would have regenerated (tokens of the interrupted turns; assistant tokens of the interrupted trajectories)."""
    if cfg.task.max_turns == 1:
        return {}
    turns = [m["turns_mean"] for m in step_metrics if "turns_mean" in m]
    return {
        "turns_per_trajectory_mean": sum(turns) / len(turns) if turns else 0.0,
        "environment_calls": stats.environment_calls, "environment_errors": stats.environment_errors,
        "environment_timeouts": stats.environment_timeouts, "environment_seconds": stats.environment_seconds,
        "tool_time_share": stats.environment_seconds / train_wall if train_wall > 0 else 0.0,
        "observation_tokens": stats.observation_tokens, "migrations_by_turn": stats.migrations_by_turn,
        "tokens_in_interrupted_turns": stats.tokens_in_interrupted_turns,
        "assistant_tokens_in_interrupted_trajectories": stats.assistant_tokens_in_interrupted_trajectories,
    }


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


def _available(cfg, out_dir: Path, cluster) -> int:
    """Preemptible instances the run could hold now (the N_prem cap's upper clamp), at most
    ``cluster.max_workers``: the scavenger's capacity view under Slurm (unknown → ``max_workers``), the replayed
    trace's offered slots with the local cluster."""
    if cluster is not None:
        return min(cfg.cluster.max_workers, cluster.offered())
    seen = available_from_scavenger(out_dir) if cfg.cluster.kind == "slurm" else None
    return cfg.cluster.max_workers if seen is None else min(cfg.cluster.max_workers, seen)


def _add_counts(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in _COUNTS}
