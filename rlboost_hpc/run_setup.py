"""What a run is built from, checked before anything heavy starts: its input files (:func:`check_inputs`), the
model, task and LoRA settings loaded and checked against the config (:class:`RunSetup`), and — on resume — a
checkpoint's record of them against this config's (:func:`check_same_model`, :func:`check_same_data`).

Invariant: every refusal here is bad input (:class:`~rlboost_hpc.errors.BadInput`: exit 2, one line naming the key or
file) raised before a service, process or socket of the run exists.
"""
from __future__ import annotations

import contextlib

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlboost_hpc.config import ConfigError, RunConfig
from rlboost_hpc.errors import BadInput
from rlboost_hpc.rundir import RunDir
from rlboost_hpc.tasks.base import Task

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


def check_inputs(cfg: RunConfig) -> None:
    """Every input file the run will read, checked before anything heavy starts (a model load and the held-out
    evaluation take seconds to minutes; a trace is read only when the cluster starts, after them): ``model.path``
    (the directory and its config.json), the task's data files (``Task.data_files`` under the data directory) and,
    for the local cluster, ``cluster.trace`` and the replay window its settings ask of it (the trace is read: a
    few MB at most).

    Raises:
        BadInput: one line naming the key, the file and why — not found, or there but unreadable (permissions, a
            directory): :class:`~rlboost_hpc.paths.DataFileMissing`, :class:`~rlboost_hpc.paths.InputUnreadable`,
            :class:`ConfigError` (an unknown task, a replay window the trace does not have).
    """
    from rlboost_hpc.paths import data_file, readable
    from rlboost_hpc.tasks.base import task_data_files

    if cfg.model.path:
        d = readable(Path(cfg.model.path).expanduser(), "model.path: the model directory", directory=True)
        readable(d / "config.json", f"model.path: {d}'s config.json")
    else:  # the demo model, converted once from the shared stories260K
        from rlboost_hpc.models.llama2c import check_sources

        check_sources(Path(cfg.model.cache_dir).expanduser())
    files: tuple[str, ...] = ()  # a built-in task's shared data files (a reasoning-gym task's are generated)
    if cfg.task.kind == "own":  # your own task: its prompt files (a hub id is fetched later, by datasets)
        from rlboost_hpc.tasks.dataset import resolve_source

        d = cfg.task.data
        for key, spec in (("task.data.path", d.path), ("task.data.heldout_path", d.heldout_path)):
            if spec:
                resolve_source(spec, key=key)
    elif cfg.task.kind == "builtin":
        try:
            files = task_data_files(cfg.task.name)
        except ValueError as e:
            raise ConfigError(f"task.name: {e}") from None
    for rel in files:
        try:
            data_file(rel)
        except BadInput as e:
            raise type(e)(f"task.name = {cfg.task.name}: {e}") from None
    if cfg.cluster.kind == "local" and cfg.cluster.max_workers > 0:
        from rlboost_hpc.cluster.traces import resolve_trace_path

        try:
            resolve_trace_path(cfg.cluster.trace)
        except BadInput as e:
            raise type(e)(f"cluster.trace = {cfg.cluster.trace}: {e}") from None
        from rlboost_hpc.cluster.local import replay_plan

        replay_plan(cfg.cluster)  # a window the trace does not have: ConfigError now, not once the cluster starts


def tool_stop_ids(cfg: RunConfig, tok) -> tuple[int, ...]:
    """The token id that ends a tool call (``task.turns.tool_call_close``), as a one-element tuple; () for single-turn
    tasks and for a stateful environment's (every turn goes to it, ended by the model's own stop tokens).

    Raises:
        ConfigError: ``task.turns.tool_call_close`` is not exactly one token of the policy's tokenizer.
    """
    if cfg.task.turns.max == 1 or cfg.task.environment is not None:
        return ()
    close = cfg.task.turns.tool_call_close
    tid = tok.hf.convert_tokens_to_ids(close)  # a token of the vocabulary as it is (e.g. Qwen's </tool_call>)
    if not isinstance(tid, int) or tid == tok.hf.unk_token_id:
        ids = tok.hf(close, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ConfigError(f"task.turns.tool_call_close = {close!r} is {len(ids)} tokens of the policy's tokenizer "
                              f"({ids}); it must be exactly one (it ends the turn as a stop id)")
        tid = ids[0]
    return (int(tid),)


#: The step metrics (``metrics.jsonl``) of the engine–trainer mismatch that the manager's gauges show.


def check_behaviour_logprobs(cfg: RunConfig) -> None:
    """Importance correction needs the engine's behaviour logprobs of every token.

    Raises:
        ConfigError: ``trainer.behaviour_correction`` is on, or ``rollout.max_staleness`` ≥ 1, and ``rollout.engine``
            returns no logprobs (named); ``rollout.max_staleness`` ≥ 1 with ``trainer.behaviour_correction = none``.
    """
    from rlboost_hpc.rollout.engines.factory import returns_behaviour_logprobs

    k = cfg.rollout.max_staleness
    if k >= 1 and not returns_behaviour_logprobs(cfg.rollout.engine):
        raise ConfigError(f"rollout.max_staleness = {k} trains tokens of older versions with the decoupled PPO "
                          f"objective, which needs the behaviour logprob of every token, and rollout.engine = "
                          f"{cfg.rollout.engine} returns none; use an engine that returns logprobs (torch, sglang) "
                          "or rollout.max_staleness = 0")
    if k >= 1 and cfg.trainer.behaviour_correction == "none":
        raise ConfigError(f"rollout.max_staleness = {k} needs trainer.behaviour_correction = tis or mis (the "
                          "decoupled PPO objective weights each token by π_prox/π_behaviour, capped by "
                          "trainer.behaviour_cap); it is none")
    if cfg.trainer.behaviour_correction != "none" and not returns_behaviour_logprobs(cfg.rollout.engine):
        raise ConfigError(f"trainer.behaviour_correction = {cfg.trainer.behaviour_correction} needs the behaviour "
                          f"logprob of every token, and rollout.engine = {cfg.rollout.engine} returns none; use "
                          "trainer.behaviour_correction = none or an engine that returns logprobs")


def check_same_data(ckpt: Path, setup: "RunSetup", rd: RunDir) -> None:
    """Refuse to resume ``ckpt`` against changed prompt files, in one line and before any service starts.

    Raises:
        CheckpointError: a data set's fingerprint differs from the one the checkpoint recorded (the key and file
            named).
    """
    from rlboost_hpc.config_task import current_task_key
    from rlboost_hpc.trainer import checkpoint

    saved = {current_task_key(k): v for k, v in (checkpoint.run_state_of(ckpt).get("datasets") or {}).items()}
    now = setup.checkpoint_identity()["datasets"]  # (a checkpoint of an earlier release names its keys' old names)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            where = setup.task.data_source(key)
            raise checkpoint.CheckpointError(
                f"{key} = {where}: the data set changed since {ckpt} was written (fingerprint {saved.get(key)} then, "
                f"{now.get(key)} now); resuming would take other prompts — restore the file, or start over with a "
                "new --out or --set trainer.resume=never")


def check_same_model(ckpt: Path, setup: "RunSetup", rd: RunDir) -> None:
    """Refuse to resume ``ckpt`` (of ``rd``) into another model, in one line and before any service starts.

    Raises:
        CheckpointError: the checkpoint's parameter shapes are not the configured model's.
    """
    from rlboost_hpc.models.arch import ModelArch
    from rlboost_hpc.trainer import checkpoint

    saved = checkpoint.run_state_of(ckpt).get("model")  # absent in checkpoints of older versions
    if not isinstance(saved, dict) or "arch" not in saved:
        return
    theirs, ours = saved.get("lora"), setup.lora_record()
    if theirs != ours:  # a LoRA checkpoint into a full run, the reverse, or another adapter shape
        def what(rec):
            return "every weight" if not rec else f"a LoRA adapter (rank {rec['rank']}, {','.join(rec['targets'])})"
        raise checkpoint.CheckpointError(
            f"{ckpt}/trainer.json: a checkpoint of a run that trained {what(theirs)}; this config trains "
            f"{what(ours)} (trainer.lora): use a new --out or --set trainer.resume=never")
    arch = setup.policy.arch
    if ModelArch.from_json(saved["arch"]).expected_shapes() != arch.expected_shapes():
        raise checkpoint.CheckpointError(
            f"{rd.root} holds a run of another model ({saved.get('path')}, {saved['arch'].get('family')}, "
            f"{ModelArch.from_json(saved['arch']).num_params() / 1e6:.1f} M parameters) than this config's "
            f"({setup.policy.path}, {arch.family}, {arch.num_params() / 1e6:.1f} M parameters): use a new --out or "
            "--set trainer.resume=never")


@dataclass
class RunSetup:
    """What the run is made of before any service starts: the policy (``PolicyModel``), the task (told the run's
    tool-call syntax), the tool call's stop id, and the trainer's and rollout's devices and dtypes."""

    policy: Any
    task: Task
    tool_stops: tuple[int, ...]
    context_tokens: int  # the positions one request may need: the longest prompt + the response (trajectory) budget
    train_device: torch.device
    train_dtype: torch.dtype
    rollout_device: torch.device
    rollout_dtype: torch.dtype
    lora: Any = None  # trainer.lora's LoraSettings (None: every weight trains)

    def lora_record(self) -> dict | None:
        """What a checkpoint records of the adapter (None: every weight trains): rank, alpha, targets."""
        lo = self.lora
        return None if lo is None else {"rank": lo.rank, "alpha": lo.alpha, "targets": list(lo.targets)}

    @classmethod
    def load(cls, cfg: RunConfig) -> "RunSetup":
        """Load the task, then the model, and check them against the config (the task first: its data and reward
        endpoint are bad input found before the model loads).

        Raises:
            ConfigError: behaviour correction with an engine that returns no logprobs; the response (or
                trajectory) budget plus the longest prompt exceeds the model's context;
                ``task.turns.tool_call_close`` is not one token; a device or dtype the machine lacks.
        """
        from rlboost_hpc.models.device import resolve_device, resolve_dtype
        from rlboost_hpc.tasks.user_task import make_task

        check_behaviour_logprobs(cfg)
        # the task before the model: its data (a hub id is fetched here), its reward code imported and checked, its
        # reward model reached — bad input there exits 2 before a model load of tens of seconds
        task = make_task(cfg.task)
        with contextlib.ExitStack() as undo:  # a check that fails stops what the task started (its reset process)
            undo.callback(task.close)
            task.check_endpoint()
            policy = load_model(cfg)
            arch, tok = policy.arch, policy.tokenizer
            longest, worst = task.longest_prompt(tok)
            if longest + cfg.trajectory_tokens() > arch.max_position_embeddings:
                key = ("rollout.max_new_tokens" if cfg.task.turns.max == 1 else
                       "task.turns.max_tokens (0: task.turns.max × rollout.max_new_tokens)")
                raise ConfigError(f"{key} = {cfg.trajectory_tokens()} plus the longest prompt ({longest} tokens: "
                                  f"{worst.pid}, {worst.text[:60]!r}) exceeds the model's context of "
                                  f"{arch.max_position_embeddings} tokens")
            lora = lora_settings(cfg, policy)
            train_device = resolve_device(cfg.trainer.device, "trainer.device")
            rollout_device = resolve_device(cfg.rollout.device, "rollout.device")
            setup = cls(policy=policy, task=task, tool_stops=tool_stop_ids(cfg, tok),
                        context_tokens=longest + cfg.trajectory_tokens(), train_device=train_device,
                        train_dtype=resolve_dtype(cfg.trainer.dtype, train_device, "trainer.dtype"),
                        rollout_device=rollout_device,
                        rollout_dtype=resolve_dtype(cfg.rollout.dtype, rollout_device, "rollout.dtype"), lora=lora)
            undo.pop_all()  # the task goes on in the setup
        log.info("model %s (%s, %.1f M parameters, chat template %s); trainer on %s/%s, rollout on %s/%s",
                 policy.path, arch.architecture, arch.num_params() / 1e6, "on" if tok.use_chat else "off",
                 train_device, str(setup.train_dtype).removeprefix("torch."), rollout_device,
                 str(setup.rollout_dtype).removeprefix("torch."))
        return setup

    def checkpoint_identity(self) -> dict:
        """What a checkpoint records of the run's inputs, checked on resume (:func:`check_same_data`): the model
        (path, architecture) and, for a user's task, each data set's fingerprint."""
        return {"model": {"path": str(self.policy.path), "arch": self.policy.arch.to_json(), "lora": self.lora_record()},
                "datasets": self.task.fingerprints()}

    def model_info(self) -> dict:
        """The report's ``model`` entry."""
        return {"path": str(self.policy.path), "architecture": self.policy.arch.architecture,
                "parameters": self.policy.arch.num_params(), "chat_template": self.policy.tokenizer.use_chat,
                "trainer_device": str(self.train_device), "rollout_device": str(self.rollout_device)}


def lora_settings(cfg: RunConfig, policy):
    """``trainer.lora``'s settings for the backend (None when off), with the initial adapter checked against the base.

    Raises:
        ConfigError: PEFT missing for the torch backend. ModelFormatError: ``trainer.lora.adapter_path`` is not a PEFT
            adapter of this base (named)."""
    if not cfg.trainer.lora.enabled:
        return None
    from rlboost_hpc.trainer.lora import LoraSettings, require_peft, settings_from_config
    from rlboost_hpc.weights.lora_base import model_base

    if cfg.trainer.backend == "emulated":  # a load test: the adapter's shapes are the emulated profile's
        lo = cfg.trainer.lora
        return LoraSettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=lo.targets(), init={})
    require_peft(cfg.trainer.backend)
    checksum = 0
    if cfg.trainer.lora.adapter_path:  # its recorded base must be ours: one hash pass over the base
        _, checksum, _ = model_base(policy.state_dict, policy.arch, getattr(torch, cfg.weights.dtype),
                                    cfg.weights.chunk_bytes)
    return settings_from_config(cfg, policy.arch, checksum if cfg.trainer.lora.adapter_path else None)
