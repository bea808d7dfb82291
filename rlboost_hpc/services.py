"""The services of one run in the trainer's allocation, started and stopped as one unit.

:class:`RunServices` is a context manager. Entering starts, in order: the run's CURVE keys, the weight server, the
rollout manager (its own process), the trainer's client to it, ``endpoints.json`` and the Prometheus ``file_sd``
target, (LoRA) the base server — the base published once, as one version, for rollout nodes that do not see
``model.path`` —, the trainer backend, the weight publisher and the task's processes (the reward pool, the
evaluation's tool workers of a multi-turn task, the task's own: :class:`~rlboost_hpc.tasks.runtime.TaskRuntime`) — the
weight server keeping its versions in a shared-memory directory of this node. After the first version is published,
:meth:`RunServices.start_reserved` starts the reserved engines (processes of their own that map those versions) and
:meth:`RunServices.start_rollout` the preemptible capacity (the local cluster, or the scavenger's target under Slurm).

Invariant: whatever was started is stopped on every exit path, in the reverse order of starting — also when
start-up itself fails half-way (a backend that cannot start stops the manager and the weight server it came
after); the manager is asked to shut down by the trainer it knows, or terminated when no trainer ever said hello.
"""
from __future__ import annotations

import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Any, Callable

import torch

from rlboost_hpc.config import RunConfig
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.auth import RunKeys
from rlboost_hpc.rundir import RunDir, advertised

if TYPE_CHECKING:
    from rlboost_hpc.policy.controller import StepDecision
    from rlboost_hpc.tasks.environment import TurnSpec
    from rlboost_hpc.trainer.publisher import Published

log = logging.getLogger("rlboost.run")


def grpo_options(cfg: RunConfig):
    """The run's GRPO objective (:class:`~rlboost_hpc.trainer.algorithms.grpo.GRPOOptions`) from ``trainer.*``; the
    ``seq_mean_token_sum_norm`` constant is the response (or trajectory) budget, ``cfg.trajectory_tokens()``."""
    from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions

    t = cfg.trainer
    return GRPOOptions(clip_eps=t.clip_eps, clip_eps_high=t.clip_eps_high, kl_coef=t.kl_coef,
                       kl_estimator=t.kl_estimator, loss_aggregation=t.loss_aggregation,
                       max_response_tokens=cfg.trajectory_tokens(), behaviour_correction=t.behaviour_correction,
                       behaviour_cap=t.behaviour_cap, behaviour_level=t.behaviour_level,
                       mask_truncated=t.mask_truncated)


class RunServices:
    """The run's processes, threads and sockets (see the module docstring). Attributes once entered: ``keys``
    (``RunKeys`` or None without CURVE), ``server``, ``client``, ``manager`` (its supervisor), ``endpoint`` / ``weights_endpoint``
    (what peers dial), ``backend``, ``publisher``, ``runtime`` (the task's processes: its rewards, the held-out
    evaluation's turns: :class:`~rlboost_hpc.tasks.runtime.TaskRuntime`), ``cluster``
    (the local cluster; None under Slurm or before :meth:`start_rollout`).

    Args:
        cfg: the run's configuration. ``run_dir``: its directory. ``run_id``: tags endpoints and metrics.
        policy: the loaded :class:`~rlboost_hpc.models.hf_dir.PolicyModel`. ``task``: the run's task (its rewards).
        resuming: a checkpoint will be loaded: keep the run's keys, so rollout jobs that outlived a crash rejoin.
        train_device, train_dtype: where the torch backend trains.
        t_origin: the run's start (``time.monotonic()`` seconds) — the local cluster's trace clock.
        lora: ``trainer.lora``'s settings (:class:`~rlboost_hpc.trainer.lora.LoraSettings`; None: every weight trains).
    """

    def __init__(self, cfg: RunConfig, run_dir: RunDir, run_id: str, policy, task, *, resuming: bool,
                 train_device: torch.device, train_dtype: torch.dtype, t_origin: float,
                 context_tokens: int | None = None, lora=None) -> None:
        self.cfg, self.run_dir, self.run_id, self.policy, self.task = cfg, run_dir, run_id, policy, task
        self.lora = lora
        self.adapter: M.AdapterSpec | None = None  # a LoRA run's adapter spec (once the base server runs)
        self.base_state = None
        self.context_tokens = context_tokens
        self._resuming, self._device, self._dtype, self._t_origin = resuming, train_device, train_dtype, t_origin
        self._stack = contextlib.ExitStack()
        self._hello = False
        self._target_step = 0  # the step the scavenger's target was last written for
        self.cluster = self.reserved = None

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "RunServices":
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def defer(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` at teardown, before everything started so far is stopped."""
        self._stack.callback(fn)

    def _start(self) -> None:
        from rlboost_hpc.rollout.spec import WorkerSpec
        from rlboost_hpc.tasks.runtime import TaskRuntime
        from rlboost_hpc.trainer.client import ManagerClient
        from rlboost_hpc.trainer.publisher import WeightPublisher
        from rlboost_hpc.weights.server import WeightServer
        from rlboost_hpc.weights.shared import new_share_dir, remove_share_dir
        from rlboost_hpc.weights.sharded import manifest_nbytes

        cfg, rd, w = self.cfg, self.run_dir, self.cfg.weights
        self.keys = self._keys()
        # versions live in shared memory the reserved engines map (weights/shared.py); removed after the server
        self.share_dir = new_share_dir()
        self.defer(lambda: remove_share_dir(self.share_dir))
        self.server = WeightServer(bind=f"tcp://{cfg.network.bind_host}:0", chunk_bytes=w.chunk_bytes,
                                   keys=self.keys, delta=w.delta, delta_max_ratio=w.delta_max_ratio,
                                   sealed=w.sealed, pin_memory=self._device.type == "cuda",
                                   share_dir=self.share_dir).start()
        self.defer(self.server.close)
        turns = self.turn_spec()
        self.manager = self._spawn_manager(turns)
        bound, metrics_url = self.manager.bound, self.manager.metrics_url
        self.client = None
        self.defer(self._stop_manager)  # and its client
        net = cfg.network
        self.host = net.advertise_host or (socket.gethostname() if net.bind_host in ("0.0.0.0", "*")
                                           else net.bind_host)
        self.endpoint, self.weights_endpoint = advertised(bound, self.host), advertised(self.server.endpoint,
                                                                                         self.host)
        self.client = ManagerClient(self.endpoint, keys=self.keys, alive=self.manager.alive,
                                    restarts=lambda: self.manager.restarted)
        metrics_url = metrics_url.replace("0.0.0.0", self.host)
        if self.lora is not None:
            self.adapter = self._start_base_server()
        rd.write_endpoints(self.endpoint, self.weights_endpoint, run_id=self.run_id, curve=self.keys is not None,
                           metrics=metrics_url, worker=WorkerSpec.from_config(cfg, self.context_tokens).to_json())
        if metrics_url:
            rd.write_file_sd("rlboost-manager", metrics_url, self.run_id)
            log.info("manager metrics: %s (file_sd: %s/prometheus/)", metrics_url, rd.root)
        self.backend = self._backend()
        self.defer(self.backend.close)  # the Megatron backend holds process groups / shard servers
        self.publisher = WeightPublisher(self.server, self.backend, getattr(torch, w.dtype),
                                         client_keys=self.keys.client_view() if self.keys else None,
                                         streams=w.streams, window=w.window, timeout_s=w.pull_timeout_s,
                                         adapter=self.adapter, base_state=self.base_state)
        if self.publisher.shards:
            log.info("weights: every model-parallel rank serves its own shards (%d holders, %.1f MB per version)",
                     len(self.publisher.shards["holders"]), manifest_nbytes(self.publisher.shards) / 1e6)
        self.runtime = self._stack.enter_context(TaskRuntime(self.task, cfg.task.rewards, turns))

    def _start_base_server(self) -> M.AdapterSpec:
        """LoRA: publish the base once, as version 0 of a server of its own (sealed and checksummed as any version),
        for rollout nodes that do not see ``model.path``; returns the run's :class:`AdapterSpec`."""
        from rlboost_hpc.models.lora import canonical_base
        from rlboost_hpc.weights.server import WeightServer
        from rlboost_hpc.weights.shared import base_share_dir

        cfg, w, lo, lo_cfg = self.cfg, self.cfg.weights, self.lora, self.cfg.trainer.lora
        if cfg.trainer.backend == "emulated":  # a load test: the profile's base, emulated (no tensors, no server)
            return self._emulated_adapter_spec()
        self.base_state = canonical_base(self.policy.state_dict, self.policy.arch)
        # the reserved engines map it from shared memory (weights/shared.py), as they map every version
        srv = WeightServer(bind=f"tcp://{cfg.network.bind_host}:0", chunk_bytes=w.chunk_bytes, keep_versions=1,
                           keys=self.keys, delta=False, sealed=w.sealed,
                           share_dir=base_share_dir(self.share_dir)).start()
        self.defer(srv.close)
        man = srv.publish(0, self.base_state, dtype=getattr(torch, w.dtype))
        # this process's engines (reserved, evaluation) serve the very bytes instances load: the published base
        self.base_state = srv.local_state_dict(0)
        log.info("LoRA r=%d on %s: base %016x (%.1f MB as %s) served by %s for nodes without %s", lo.rank,
                 ",".join(lo.targets), man.checksum, man.total_bytes / 1e6, w.dtype, srv.endpoint, self.policy.path)
        self.base_server = srv
        return M.AdapterSpec(rank=lo.rank, alpha=lo.alpha, targets=list(lo.targets), base_checksum=man.checksum,
                             base_bytes=man.total_bytes, base_dtype=w.dtype, base_chunk_bytes=w.chunk_bytes,
                             base_path=str(self.policy.path) if lo_cfg.base_source == "auto" else "",
                             base_endpoint=advertised(srv.endpoint, self.host),
                             max_adapters=cfg.rollout.max_staleness + 1)

    def _emulated_adapter_spec(self) -> M.AdapterSpec:
        """The AdapterSpec of a LoRA load test: the emulated profile's base (its bytes; a checksum of its name)."""
        import xxhash

        from rlboost_hpc.sim.profiles import profile

        cfg, lo = self.cfg, self.lora
        name = cfg.rollout.emulated.profile
        return M.AdapterSpec(rank=lo.rank, alpha=lo.alpha, targets=list(lo.targets),
                             base_checksum=xxhash.xxh3_64_intdigest(f"emulated-base:{name}:{cfg.trainer.seed}".encode()),
                             base_bytes=int(profile(name).model.weight_bytes), base_dtype=cfg.weights.dtype,
                             base_chunk_bytes=cfg.weights.chunk_bytes, base_path=M.EMULATED_BASE + name,
                             max_adapters=cfg.rollout.max_staleness + 1)

    def _keys(self) -> RunKeys | None:
        """Per-run CURVE keys, owner-only, in the run directory; a resumed run keeps them."""
        if not self.cfg.security.curve:
            return None
        keys = None
        if self._resuming:
            try:
                keys = RunKeys.load(self.run_dir.root)
            except Exception:  # noqa: BLE001 - unreadable or absent: new keys (old rollout jobs then cannot rejoin)
                keys = None
        if keys is None:
            keys = RunKeys.generate()
            keys.save(self.run_dir.root)
        return keys

    def turn_spec(self) -> TurnSpec | None:
        """What answers the turns of a multi-turn task (None for single-turn):
        :func:`~rlboost_hpc.manager.service.run_manager_process`'s ``environment`` — a stateful environment
        (``task.environment``) or the tools."""
        from rlboost_hpc.tasks.environment import EnvironmentRunner, TurnSpec
        from rlboost_hpc.tasks.tools import BUILTIN_TOOLS, ToolEnvironment, ToolSyntax

        t, tok, environment = self.cfg.task.turns, self.policy.tokenizer, self.cfg.task.environment
        if t.max == 1:
            return None
        if environment is not None:
            env = EnvironmentRunner.of(environment, timeout_s=t.timeout_s, tokenizer_dir=str(self.policy.path),
                                       use_chat=tok.use_chat, stop_ids=tuple(tok.stop_ids),
                                       plain_format=t.plain_format, max_observation_tokens=t.max_observation_tokens)
            return TurnSpec(env, t.workers, t.timeout_s)
        env = ToolEnvironment(tokenizer_dir=str(self.policy.path), use_chat=self.policy.tokenizer.use_chat,
                              syntax=ToolSyntax(t.tool_call_open, t.tool_call_close),
                              tools=tuple(t.tools) or (BUILTIN_TOOLS[t.tool],),
                              plain_format=t.plain_format, max_observation_tokens=t.max_observation_tokens)
        return TurnSpec(env, t.workers, t.timeout_s)

    def _spawn_manager(self, turns: TurnSpec | None):
        """The manager process with the run's settings (``manager.*``, ``policy.*``, streaming and relay), kept
        running by a :class:`~rlboost_hpc.manager.supervisor.ManagerSupervisor` (``manager.restarts``); a resumed
        run's first manager continues what the work log holds."""
        import functools

        from rlboost_hpc.manager.service import spawn_manager
        from rlboost_hpc.manager.settings import ManagerSettings
        from rlboost_hpc.manager.supervisor import ManagerSupervisor

        cfg = self.cfg
        metrics_host = None if cfg.manager.metrics is False else cfg.network.bind_host
        spawn = functools.partial(
            spawn_manager, keys_dir=str(self.run_dir.root) if self.keys else None, metrics_host=metrics_host,
            journal_path=str(self.run_dir.journal), run_id=self.run_id, environment=turns,
            settings=ManagerSettings.from_config(cfg), work_log=str(self.run_dir.work_log))
        return ManagerSupervisor(spawn, restore=self._resuming, restarts=cfg.manager.restarts,
                                 window_s=cfg.manager.restart_window_s, bind=f"tcp://{cfg.network.bind_host}:0")

    def _stop_manager(self) -> None:
        self.manager.stopping = True  # no restart from here on
        if self._hello:  # the manager takes Shutdown from the trainer it knows only
            try:
                self.client.call(M.Shutdown(reason="run finished"), timeout_s=5)
            except Exception:  # noqa: BLE001 - the manager may already be gone
                pass
        if self.client is not None:
            self.client.close()
        proc = self.manager.proc
        if not self._hello:
            proc.terminate()  # no trainer yet: SIGTERM stops its loop and closes its tool workers
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)

    def _backend(self):
        cfg, t = self.cfg, self.cfg.trainer
        common = dict(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, objective=grpo_options(cfg),
                      temperature=cfg.rollout.temperature)
        if self.lora is not None:
            common["lora"] = self.lora
        if t.backend == "emulated":  # the trainer half of a load test: the rollout instances' profile and clock
            from rlboost_hpc.sim.profiles import profile
            from rlboost_hpc.trainer.backends.emulated import EmulatedBackend

            em, e = cfg.rollout.emulated, t.emulated
            lora = None if self.lora is None else (self.lora.rank, self.lora.targets, profile(em.profile).model.arch())
            return EmulatedBackend(weight_bytes=e.weight_bytes, tensor_bytes=e.tensor_bytes,
                                   delta_density=e.delta_density, train_time=profile(em.profile).train_time,
                                   time_scale=em.time_scale, seed=t.seed, objective=common["objective"], lora=lora)
        if t.backend != "torch":  # e.g. megatron: provided by megatron_bridge through an entry point
            from rlboost_hpc.trainer.backends import plugin_backend

            return plugin_backend(t.backend)(cfg, self.policy, common, keys=self.keys, advertise_host=self.host)
        from rlboost_hpc.trainer.backends.torch_backend import TorchBackend

        return TorchBackend(self.policy.arch, self.policy.state_dict, device=self._device, dtype=self._dtype,
                            wire_dtype=getattr(torch, cfg.weights.dtype), **common)

    # ------------------------------------------------------------------ the first version, then rollout
    def hello(self, version: int) -> Published:
        """Introduce the trainer to the manager (weight server, model config and architecture, shard layout),
        publish ``version`` and make it current. Returns what was published."""
        policy = self.policy
        self.client.call(M.TrainerHello(weights_endpoint=self.weights_endpoint, model_config=policy.hf_config,
                                        model_arch=policy.arch.to_json(), weights_shards=self.publisher.shards_json,
                                        adapter=self.adapter))
        self._hello = True
        pub = self.publisher.publish(version)
        self.client.call(M.SetVersion(version=pub.version.number, checksum=pub.version.checksum))
        return pub

    def start_reserved(self) -> None:
        """Start the reserved engines (``rollout.reserved_engines`` processes beside this one, each mapping the
        published versions from the share directory; :mod:`rlboost_hpc.rollout.reserved`). Called once the first
        version is published, so they boot while the run evaluates its starting policy."""
        from rlboost_hpc.rollout.engines.factory import engine_spec
        from rlboost_hpc.rollout.reserved import ReservedEngines

        cfg, r, w = self.cfg, self.cfg.rollout, self.cfg.weights
        spec = engine_spec(r, self.context_tokens)
        if cfg.trainer.backend != "emulated":  # the reserved engines run torch (emulated with an emulated trainer)
            spec = {k: v for k, v in spec.items() if k in ("device", "dtype", "max_len")} | {"kind": "torch"}
        self.reserved = ReservedEngines(r.reserved_engines, manager=self.endpoint, run_dir=self.run_dir.root,
                                        curve=self.keys is not None, share_dir=self.share_dir,
                                        threads=r.reserved_threads, max_batch=r.max_batch, engine_spec=spec,
                                        weights={"streams": w.streams, "window": w.window,
                                                 "timeout_s": w.pull_timeout_s})
        self.reserved.start()
        self.defer(self.reserved.stop)

    def start_rollout(self) -> None:
        """Start the preemptible capacity: the scavenger's target under Slurm, else the local cluster."""
        from rlboost_hpc.procutil import reclaim_leftovers

        cfg, r = self.cfg, self.cfg.rollout
        if cfg.cluster.kind == "slurm":  # rollout jobs come from the scavenger; tell it how many we want
            self.set_target(cfg.cluster.max_workers, step=0)
            self.defer(lambda: self.run_dir.write_target(0, active=False, step=self._target_step,
                                                         gpus_per_instance=r.gpus_per_instance))
            return
        from rlboost_hpc.cluster.local import LocalCluster

        partial: Callable[[], dict[str, int]] | None = None
        states: Callable[[], dict[str, str]] | None = None
        f = cfg.cluster.faults
        if cfg.cluster.preempt_when_busy or (f.every_steps and "stall" in f.kinds):
            from rlboost_hpc.trainer.client import ManagerClient

            # the cluster's thread asks the manager on a socket of its own
            probe = ManagerClient(self.endpoint, keys=self.keys, alive=self.manager.alive, timeout_s=2.0,
                                  restarts=lambda: self.manager.restarted)
            self.defer(probe.close)
            if cfg.cluster.preempt_when_busy:
                partial = lambda: {k: i.partial for k, i in probe.stats().instances.items()}  # noqa: E731
            states = lambda: {k: i.state for k, i in probe.stats().instances.items()}  # noqa: E731
        self.cluster = LocalCluster(cfg.cluster, self.endpoint, self.run_dir.root, t_origin=self._t_origin,
                                    partial_by_instance=partial, instance_states=states)
        self.cluster.start()

        def stop_cluster() -> None:
            self.cluster.stop()
            reclaim_leftovers()  # what SIGKILLed local workers left on this node (shared memory, temp dirs)
        self.defer(stop_cluster)

    def target_of(self, decision: "StepDecision | None") -> tuple[int, int]:
        """``(n_prem, wanted)`` for the next step from the controller's decision, both within
        ``cluster.max_workers``: ``n_prem`` the instances to keep (the cap, clamped to the capacity seen), ``wanted``
        how many the run could use (the law before that clamp; no decision or no bound: ``max_workers``)."""
        most = self.cfg.cluster.max_workers
        cap = decision.n_prem_cap if decision is not None else None
        wanted = decision.n_prem_wanted if decision is not None else None
        return min(most, most if cap is None else cap), min(most, most if wanted is None else wanted)

    def set_target(self, n_prem: int, step: int, wanted: int | None = None) -> None:
        """The preemptible instances the run wants now: the scavenger's ``target.json`` under Slurm (``n_prem`` to
        keep live, ``wanted`` — default ``n_prem`` — to ask a shared pool for), the local cluster's cap otherwise
        (``step``: the next step, recorded in the target)."""
        if self.cfg.cluster.kind == "slurm":
            self._target_step = step
            self.run_dir.write_target(n_prem, active=True, step=step, wanted=n_prem if wanted is None else wanted,
                                      gpus_per_instance=self.cfg.rollout.gpus_per_instance)
        elif self.cluster is not None:
            self.cluster.set_cap(n_prem)
            self.cluster.at_step(step)  # faults a chaos run schedules by progress

    def available(self) -> int:
        """Preemptible instances the run could hold now (the N_prem cap's upper clamp), at most
        ``cluster.max_workers``: the replayed trace's offered slots with the local cluster, the scavenger's
        capacity view under Slurm (unknown → ``max_workers``)."""
        from rlboost_hpc.cluster.capacity import available_from_scavenger

        most = self.cfg.cluster.max_workers
        if self.cluster is not None:
            return min(most, self.cluster.offered())
        seen = available_from_scavenger(self.run_dir.root) if self.cfg.cluster.kind == "slurm" else None
        return most if seen is None else min(most, seen)

