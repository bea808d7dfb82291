"""The run's configuration: one validated pydantic model, loaded from TOML with dotted CLI overrides.

Invariants: unknown keys are errors (``extra="forbid"``) at every level, so a typo never silently falls
back to a default; every number carries its unit in its name or docstring; ``load_config`` is the only
way a config is built from files and overrides.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from rlboost_hpc import defaults as D
from pydantic import Field, ValidationError, field_validator, model_validator
from rlboost_hpc.config_task import (  # noqa: F401 - the task's tables are part of the run's config
    RewardModelCfg, TaskCfg, _Strict, anchor_task_paths, moved_task_overrides, read_moved_task_keys)
from rlboost_hpc.config_errors import config_problem
from rlboost_hpc.errors import BadInput
from rlboost_hpc.paths import ShippedFileMissing, shipped, unreadable


class ModelCfg(_Strict):
    """Which policy model to load: a Hugging Face model directory (``path``: Llama, Qwen2 or Qwen3 —
    ``config.json``, safetensors shards, tokenizer, generation config), or the embedded default ``name =
    "stories260K"`` (the llama2.c checkpoint of the data dir, converted once into such a directory)."""

    name: Literal["stories260K"] = Field("stories260K", description="the embedded default model (used when "
                                                                     "path is not set)")
    path: str | None = Field(None, description="a Hugging Face model directory (Llama, Qwen2, Qwen3); on a "
                                               "cluster, on a filesystem the trainer job sees")
    cache_dir: str = Field("~/.cache/rlboost-hpc/models", description="where the converted stories260K is kept")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "hf_dir" in data:
            raise ValueError("model.hf_dir was renamed: use model.path (a Hugging Face model directory)")
        return data


class SGLangCfg(_Strict):
    """How a preemptible worker starts its SGLang server (``rollout.engine = "sglang"``; docs/sglang.md).

    Every key goes to :class:`rlboost_hpc.rollout.engines.sglang_server.SGLangServer` (its device and dtype
    are ``rollout.device`` / ``rollout.dtype``).
    """

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k in ("device", "dtype"):
                if k in data:
                    raise ValueError(f"rollout.sglang.{k} moved: use rollout.{k} (every rollout engine's)")
        return data

    python: str | None = Field(None, description="interpreter with sglang installed (None: the worker's own)")
    stream_interval: int = Field(16, ge=1, description="tokens per streamed chunk (--stream-interval)")
    startup_timeout_s: float = Field(300.0, gt=0, description="deadline for the server's /health")
    env: dict[str, str] = Field(default_factory=dict, description=(
        "extra environment of the server process. CPU test route only: tests put the import-time stand-ins "
        "there (PYTHONPATH=tests/sglang_cpu/stubs, SGLANG_USE_CPU_ENGINE=1); never needed on GPU machines"))
    extra_args: list[str] = Field(default_factory=list, description="more sglang.launch_server arguments")


class EmulatedCfg(_Strict):
    """The emulated rollout engine (``rollout.engine = "emulated"``): a load-testing engine with a real model's
    timing (the simulator's profile of a Qwen3 on H100s) and no model compute; tokens are a pure function of
    (response seed, position), weights are pulled, verified and held like a real engine's."""

    profile: Literal["8b", "14b", "32b"] = Field(D.EMULATED_PROFILE, description=(
        "the modelled Qwen3 (the simulator's profile of that name: decode and prefill law, bf16 weight bytes)"))
    instance_tp: int = Field(D.EMULATED_INSTANCE_TP, ge=1, description="GPUs of one modelled instance (its TP size)")
    time_scale: float = Field(D.EMULATED_TIME_SCALE, gt=0, description=(
        "model seconds per wall second: 10 runs every iteration and weight load ten times faster than the GPU"))
    load_bytes_per_s: float = Field(D.EMULATED_LOAD_BYTES_PER_S, gt=0, description=(
        "bytes/s of a weight load into the modelled engine: one load takes the model's bf16 bytes ÷ this"))
    response_median: float = Field(D.EMULATED_RESPONSE_MEDIAN, ge=1, description=(
        "median response length in tokens (log-normal, drawn per response seed; clipped to the budget)"))
    response_sigma: float = Field(D.EMULATED_RESPONSE_SIGMA, ge=0, description="σ of the log of response lengths")
    gpu_speeds: list[float] = Field(default_factory=lambda: list(D.EMULATED_GPU_SPEEDS), min_length=1, description=(
        "relative speeds of the GPU kinds the emulated instances run on (each > 0; 1 = the profile's H100): the "
        "instance whose identity ends in the number j (local slot, hosted index <job>.<j>, Slurm job id) runs at "
        "gpu_speeds[j mod len] — e.g. [1.0, 0.5, 0.333] mixes three kinds, 3:2:1"))

    @field_validator("gpu_speeds")
    @classmethod
    def _positive_speeds(cls, v: list[float]) -> list[float]:
        if any(not (x > 0) for x in v):
            raise ValueError(f"every speed must be > 0 (got {v})")
        return v


class RolloutCfg(_Strict):
    """Sampling and engine settings of every rollout instance (reserved and preemptible)."""

    engine: Literal["torch", "sglang", "emulated"] = Field("torch", description=(
        "engine of the preemptible workers: torch (CPU/GPU, built in), sglang (an SGLang server per worker; "
        "pip install '.[sglang]') or emulated (load testing: a real model's timing, no compute; rollout.emulated). "
        "The reserved seeding engine is always torch."))
    sglang: SGLangCfg = Field(default_factory=SGLangCfg, description="the SGLang server of rollout.engine = sglang")
    emulated: EmulatedCfg = Field(default_factory=EmulatedCfg, description=(
        "the timing profile of rollout.engine = emulated"))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "device of the rollout engines (reserved engine, workers, evaluation): auto = the GPU a job is given "
        "(CUDA_VISIBLE_DEVICES) when there is one, else the CPU; the reserved engine shares the trainer's GPU"))
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="weights and KV cache of the engines: "
                                                                              "auto = bf16 on GPU, fp32 on CPU")
    group_size: int = Field(8, ge=2, description="G: responses per prompt (one GRPO group)")
    prompts_per_step: int = Field(8, ge=1, description="GRPO groups per RL step (a step trains "
                                                       "prompts_per_step × group_size responses)")
    max_new_tokens: int = Field(48, ge=1, description="tokens one response (one turn of a trajectory) may generate")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature; the trainer scores tokens at it")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description=(
        "nucleus sampling mass; only 1.0 is accepted: the trainer scores each token under the full softmax at the "
        "sampling temperature, so a token drawn from a truncated, renormalised nucleus would be trained with "
        "another probability than it was drawn with"))
    max_batch: int = Field(D.MAX_BATCH, ge=1, description="engine batch slots per instance")
    stream_every_tokens: int = Field(D.STREAM_EVERY_TOKENS, ge=1, description="flush token chunks to the manager every k tokens")
    stream_every_s: float = Field(D.STREAM_EVERY_S, gt=0, description="... or after this many seconds, whichever first")
    torch_threads: int = Field(1, ge=1, description="intra-op threads of a torch rollout engine's process")
    reserved_engines: int = Field(1, ge=1, description=(
        "reserved engines: rollout engines of the trainer's own allocation, each a process of its own beside the "
        "trainer (as an SGLang server runs beside Megatron on a GPU node); they seed every step and generate alone "
        "when no preemptible instance serves. On a CPU node, one per core the trainer's phase leaves idle"))
    reserved_threads: int = Field(1, ge=1, description=(
        "intra-op threads of each reserved engine's process (independent of trainer.torch_threads: a decode step "
        "of a small model runs fastest on one)"))
    gpus_per_instance: int = Field(1, ge=1, description=(
        "GPUs of one rollout instance: Slurm rollout jobs ask --gres=gpu:N with it, and N_resv = the trainer "
        "allocation's GPUs / N"))
    max_staleness: int = Field(D.MAX_STALENESS, ge=0, le=8, description=(
        "k, bounded staleness: 0 = strict on-policy (a step's responses are generated only by the version that "
        "trains them; instances wait while the trainer trains). k >= 1 = the manager admits the prompts of steps "
        "s+1 .. s+k while step s trains; every token is stamped with the version that produced it and none older "
        "than k versions is ever trained (the loss is the decoupled PPO objective: needs "
        "trainer.behaviour_correction = tis or mis and an engine that returns behaviour logprobs)"))
    on_new_version: Literal["continue", "finish"] = Field(D.ON_NEW_VERSION, description=(
        "max_staleness >= 1: what a response in flight does when its instance receives a newer version: finish = "
        "the instance loads it once its batch is done (the response ends under the version that began it); "
        "continue = the instance loads it between two decode iterations and the response goes on under the new "
        "weights (its tokens then span versions)"))


    @field_validator("top_p")
    @classmethod
    def _sampling_the_trainer_can_score(cls, top_p: float) -> float:
        if top_p != 1.0:
            raise ValueError(
                f"{top_p} is refused: the trainer scores every token under the full softmax at the "
                "sampling temperature, so tokens drawn from the truncated, renormalised nucleus would be trained "
                "off-policy (e.g. probabilities [0.45, 0.30, 0.15, 0.10] with top_p 0.5 are drawn at "
                "[0.6, 0.4] and trained as [0.45, 0.30]); use top_p = 1.0")
        return top_p


class ManagerCfg(_Strict):
    """Rollout manager: dispatch and failure detection."""

    pending_limit: int = Field(D.PENDING_LIMIT, ge=1, description="Θ: max requests in flight per instance (JSQ threshold)")
    arrival_hold_s: float = Field(D.ARRIVAL_HOLD_S, ge=0, description=(
        "while instances that were live at a version change load it (and loaded the last one quickly: within half "
        "the time since), an instance takes at most an equal share of the step's work; the rest waits for them at "
        "most this long (s), instead of piling onto whoever loaded first (0: never wait)"))
    heartbeat_s: float = Field(D.HEARTBEAT_S, gt=0, description="seconds between an instance's heartbeats")
    heartbeat_timeout_s: float = Field(D.HEARTBEAT_TIMEOUT_S, gt=0, description=(
        "silence after which an instance is suspect: out of routing, its work migrates; it returns when it speaks "
        "again (instances heartbeat from a thread that does no engine or weight work)"))
    dispatch_silence_s: float = Field(D.DISPATCH_SILENCE_S, gt=0, description=(
        "silence after which an instance gets no new work while it keeps what it runs until heartbeat_timeout_s "
        "(a node that vanished without closing its connections takes no more work with it); at least two "
        "heartbeat intervals"))
    instance_expiry_s: float = Field(D.INSTANCE_EXPIRY_S, ge=60.0, description="silence after which a suspect instance is gone "
                                                                "for good (told to register anew if it returns)")
    max_attempts: int = Field(D.MAX_ATTEMPTS, ge=1, description="dispatch attempts of one response before the step fails")
    metrics: bool = Field(True, description="serve Prometheus metrics (URL in endpoints.json)")
    commit_every_s: float = Field(D.WORK_COMMIT_S, gt=0, le=5.0, description=(
        "group commit of the work log (the step in flight, fsynced): a manager kill loses at most the tokens "
        "accepted in this many seconds"))
    restarts: int = Field(D.MANAGER_RESTARTS, ge=0, description=(
        "manager restarts the trainer makes (the step in flight continues from the work log) within "
        "restart_window_s before the run fails (exit 1); 0: a manager death fails the run"))
    restart_window_s: float = Field(D.MANAGER_RESTART_WINDOW_S, gt=0, description="the window restarts counts in (s)")


class PolicyCfg(_Strict):
    """RLBoost's scheduling decisions (``rlboost_hpc/policy``): the seeding window T_seed (``t_seed_*``), the cap
    N_prem, dispatch with Θ and continuous balancing."""

    t_seed_initial_s: float = Field(3.0, ge=0, description="T_seed of the first step: seconds the reserved engine "
                                                           "generates at step start before it hands over")
    adaptive_seeding: bool = Field(True, description="T_seed += (t_wait_train − t_wait_remote)/η after each step")
    t_seed_memory: bool = Field(True, description="remember T_seed per instance count M[n]")
    eta: float = Field(3.0, gt=0, description="η of the seeding update")
    t_seed_floor_s: float = Field(0.05, ge=0, description="smallest T_seed (the paper uses 5 s at its scale)")
    t_seed_ceil_s: float | None = Field(None, description="largest T_seed (None: unbounded)")
    seed_until_trainable: bool = Field(True, description=(
        "the seeding window lasts T_seed, or longer while no micro-batch is ready to train: a trainer that switched "
        "to training then would only wait, so the reserved engines go on generating beside the instances until "
        "training can start (false: close at T_seed, as the paper's reference code does)"))
    cap: bool = Field(True, description="obey N_prem = (t_remote·n_prem + T_seed·N_resv)/t_train")
    dispatch: Literal["jsq", "round_robin"] = Field("jsq", description="JSQ with Θ (RLBoost) or round robin (ablation)")
    balance: bool = Field(True, description="continuous balancing: move running requests beyond an instance's "
                                            "learned throughput plateau to instances with headroom")
    balance_every_s: float = Field(D.BALANCE_EVERY_S, gt=0, description="balancer period (also the throughput sampling interval)")


class WeightsCfg(_Strict):
    """Pull-based weight transfer."""

    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description=(
        "dtype of a published weight version on the wire (and of the exported model)"))
    streams: int = Field(D.WEIGHT_STREAMS, ge=0, description="parallel streams of one pull; 0: one per two usable "
                                                             "CPU cores of the puller, at most 4")
    window: int = Field(D.WEIGHT_WINDOW, ge=1, le=16, description="chunk requests outstanding per pull stream (a "
                        "sealed port queues at most 32 chunks per connection)")
    chunk_bytes: int = Field(D.WEIGHT_CHUNK_BYTES, ge=4096, description="bytes of one chunk of a pull (one request)")
    pull_timeout_s: float = Field(D.PULL_TIMEOUT_S, gt=0, description=(
        "stall deadline of a weight pull: one that receives nothing for this many seconds fails"))
    delta: bool = Field(True, description=(
        "ship version v as a delta against v-1 to instances holding v-1 (they keep one host copy of the model as "
        "the base); checksums always cover the full version"))
    delta_max_ratio: float = Field(0.5, gt=0, le=1, description=(
        "a version's delta is offered only when its bytes are below this fraction of the full version"))
    relay: bool = Field(True, description=(
        "peer relay: instances holding the latest version serve it to others (bytes only; manifests and checksums "
        "come from the trainer), so the trainer's egress does not grow with N_prem"))
    relay_fanout: int = Field(D.RELAY_FANOUT, ge=1, description="pullers one instance serves at once")
    relay_trainer_fanout: int = Field(D.RELAY_TRAINER_FANOUT, ge=1, description="pullers the trainer serves at once while relay is on")
    relay_wait_s: float = Field(D.RELAY_WAIT_S, ge=0, description=(
        "longest an instance waits for relay capacity before pulling from the trainer anyway"))
    relay_timeout_s: float = Field(D.RELAY_TIMEOUT_S, gt=0, description=(
        "a relay peer silent this long is abandoned; the pull resumes from the next source at the chunk it reached"))
    sealed: bool = Field(True, description=(
        "with CURVE on, weight chunks travel AES-256-GCM-sealed under a per-version key over a plain TCP port of "
        "each holder (key and ticket only in the CURVE-protected manifest) instead of CURVE-encrypted: ~7x the "
        "encryption rate per core; false: everything over CURVE"))
    sharded: bool = Field(True, description=(
        "with a model-parallel trainer (Megatron TP or PP > 1), every holder rank serves its own pieces and instances "
        "pull from all of them in parallel (no gather on rank 0); peer relay does not apply to sharded versions"))


class EmulatedTrainerCfg(_Strict):
    """The emulated trainer (``trainer.backend = "emulated"``): a model-sized bf16 weight set whose versions change
    as an RL step's do, and the modelled trainer's time per token (``rollout.emulated``'s profile and time_scale);
    no model compute, so no evaluation and no exported model."""

    weight_bytes: int = Field(D.EMULATED_WEIGHT_BYTES, ge=2, description=(
        "S: bytes of one weight version (bf16; an 8B model is 16.4e9, 70B 141e9); held by the trainer, its weight "
        "server (trainer.weights' kept versions) and every rollout instance"))
    tensor_bytes: int = Field(D.EMULATED_TENSOR_BYTES, ge=2, description="the largest tensor of a version (bytes)")
    delta_density: float = Field(D.EMULATED_DELTA_DENSITY, gt=0, le=1, description=(
        "share of the elements one optimizer step changes by one ulp (1–5 % at RL learning rates)"))


class MegatronCfg(_Strict):
    """``trainer.backend = "megatron"``: Megatron-core's layout and options. ``python -m megatron_bridge.launch``
    initialises the process groups with this ``tp`` and ``pp`` when its program is ``rlboost_hpc.cli run`` (its
    ``--tp`` / ``--pp``, when given, must agree); data parallelism is what remains of the launcher's world."""

    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size")
    bf16: bool = Field(False, description="bf16 parameters/activations (fp32 main params, grads reduced in fp32)")
    distributed_optimizer: bool = Field(False, description="shard optimizer state across data-parallel ranks")
    recompute: Literal["full", "selective"] | None = Field(None, description="activation recompute (unset: none)")


#: The linear layers of a decoder layer a LoRA adapter may target (HF module names; ``all-linear`` = every one).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraCfg(_Strict):
    """``trainer.lora``: train a LoRA adapter instead of every weight (off while ``rank`` is 0). A weight version is
    then the adapter (megabytes), the base model is loaded once per rollout node (from ``model.path`` when the node
    sees it, else pulled once and kept on the node), and the reference policy is the base with the adapter disabled."""

    rank: int = Field(0, ge=0, description="r, the adapter rank; 0: off (every weight is trained and published)")
    alpha: float = Field(16.0, gt=0, description="PEFT's lora_alpha: the adapter's update B·A·x is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training (PEFT "
                                                        "lora_dropout; engines never drop)")
    target_modules: list[str] = Field(["all-linear"], min_length=1, description=(
        "the linear layers adapted in every decoder layer: names among " + ", ".join(LORA_TARGETS) +
        ", or all-linear (PEFT's shorthand for all of them)"))
    adapter_path: str | None = Field(None, description=(
        "start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors, e.g. RUN_DIR/adapter "
        "of an earlier run on the same base) instead of PEFT's initialisation (A random, B zero)"))
    export_merged: bool = Field(False, description=(
        "at the end, also write the base with the adapter merged in (W + alpha/r · B·A) to RUN_DIR/model as a "
        "Hugging Face model directory (trainer.export_model on); the adapter always goes to RUN_DIR/adapter"))
    node_cache_dir: str | None = Field(None, description=(
        "where a rollout node keeps a base it had to pull (one file per base, verified by its checksum before use; "
        "reused across versions, the node's later instances and runs on the same base); default: $RLBOOST_NODE_CACHE, "
        "else <tmp>/rlboost-node-cache-<uid>"))
    node_cache_keep: int = Field(2, ge=1, description="bases a node's cache keeps (the least recently used go first)")
    base_source: Literal["auto", "pull"] = Field("auto", description=(
        "where rollout nodes get the base: auto = model.path when the node sees it, else the node's cache, else one "
        "pull from the trainer; pull = never model.path (a shared filesystem slower than the network): the node's "
        "cache, else one pull"))

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in LORA_TARGETS + ("all-linear",)]
        if bad:
            raise ValueError(f"unknown target module(s) {bad} for the Llama/Qwen2/Qwen3 decoder: use names among "
                             f"{list(LORA_TARGETS)} or all-linear")
        return v

    @property
    def enabled(self) -> bool:
        """Whether the run trains an adapter."""
        return self.rank > 0

    def targets(self) -> tuple[str, ...]:
        """The adapted modules in model order (``all-linear`` expanded)."""
        want = set(LORA_TARGETS) if "all-linear" in self.target_modules else set(self.target_modules)
        return tuple(m for m in LORA_TARGETS if m in want)


class TrainerCfg(_Strict):
    """GRPO trainer (CPU torch backend)."""

    backend: Literal["torch", "megatron", "emulated"] = Field("torch", description=(
        "torch (CPU/GPU plain PyTorch), megatron (megatron_bridge; pip install '.[megatron]') or emulated (load "
        "testing with rollout.engine = emulated: trainer.emulated)"))
    emulated: EmulatedTrainerCfg = Field(default_factory=EmulatedTrainerCfg, description=(
        "the weight set and timing of trainer.backend = emulated"))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="torch backend: where the policy trains "
                                                                       "(auto = the GPU when there is one)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "torch backend: compute dtype (auto = bf16 autocast with fp32 master weights on GPU, fp32 on CPU)"))
    megatron: MegatronCfg = Field(default_factory=MegatronCfg, description=(
        "the Megatron-core layout (tp, pp) and options of trainer.backend = megatron"))
    lora: LoraCfg = Field(default_factory=LoraCfg, description=(
        "train a LoRA adapter (rank, alpha, dropout, target_modules; off by default): versions are adapters"))
    steps: int = Field(40, ge=1, description="RL steps of the run (one optimizer step and one weight version each)")
    lr: float = Field(3e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="largest global gradient norm (clipped above it)")
    clip_eps: float = Field(D.CLIP_EPS, gt=0, description=(
        "PPO clip range ε of the GRPO loss. Inactive under this project's strict on-policy step (one optimizer step "
        "per RL step, every token drawn by the version being trained: the ratio π_θ/π_old is exactly 1, so nothing "
        "is clipped and clip_frac is 0); it acts only if a step ever takes several optimizer steps. Also the band "
        "of mismatch_outside_clip_share (engine vs trainer ratios)"))
    clip_eps_high: float | None = Field(None, gt=0, description=(
        "DAPO clip-higher (arXiv 2503.14476 §3.1): the ratio's upper bound is 1 + clip_eps_high (>= clip_eps; "
        "unset: clip_eps). TRL epsilon_high, verl clip_ratio_high"))
    loss_aggregation: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"] = Field(
        D.LOSS_AGGREGATION, description=(
            "how token losses make the step's loss: seq_mean_token_mean = mean over responses of each response's "
            "token mean (GRPO; TRL loss_type grpo); token_mean = one mean over every token of the step (DAPO; TRL "
            "dapo/bnpo); seq_mean_token_sum_norm = each response's token sum / the response budget, mean over "
            "responses (Dr. GRPO; TRL dr_grpo). verl loss_agg_mode with - for _"))
    advantage_std_norm: bool = Field(D.ADVANTAGE_STD_NORM, description=(
        "divide each group's centred rewards by the group's std (GRPO); false: centre only (Dr. GRPO). TRL "
        "scale_rewards, verl norm_adv_by_std_in_grpo"))
    kl_coef: float = Field(0.0, ge=0, description=(
        "β of the KL penalty to the reference policy (estimator: trainer.kl_estimator); 0 skips the reference"))
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(D.KL_ESTIMATOR, description=(
        "estimator of KL(policy ‖ reference) in the penalty and in the report's kl_to_reference: k1 = log ratio, "
        "k2 = half its square, k3 = low_var_kl = exp(r) − r − 1 (Schulman 2020); the log ratio clamped to ±20 "
        "nats and k3 to ±10 (verl's bounds), so one token far below the reference cannot dominate a step. verl "
        "kl_loss_type"))
    behaviour_correction: Literal["none", "tis", "mis"] = Field(D.BEHAVIOUR_CORRECTION, description=(
        "importance correction of the engine–trainer mismatch with the engine's behaviour logprobs: tis = weight "
        "each token's loss by min(π_trainer/π_engine, behaviour_cap) (truncated IS, verl PR #2953); mis = drop the "
        "units whose ratio exceeds the cap (masked IS); none = measure only"))
    gate_max_kl: float = Field(D.GATE_MAX_KL_NATS_PER_TOKEN, gt=0, description=(
        "quality gate: the largest KL to the reference policy (nats/token, held-out samples of the final policy) a "
        "run passes with; report.json quality_gate_passed / quality_gate_failures"))
    gate_max_repetition: float = Field(D.GATE_MAX_REPETITION, gt=0, le=1, description=(
        "quality gate: the largest share of repeated 3-grams in the final policy's held-out samples"))
    behaviour_cap: float = Field(D.BEHAVIOUR_CAP, gt=0, description=(
        "C: the cap of the importance ratio π_trainer/π_engine (verl rollout_is_threshold)"))
    behaviour_level: Literal["token", "sequence", "geometric"] = Field(D.BEHAVIOUR_LEVEL, description=(
        "the importance ratio per token, per response (the product over its generated tokens: on long responses a "
        "small per-token mismatch drives most of them to 0 or past the cap), or per response length-normalised "
        "(geometric: the geometric mean of its tokens' ratios; behaviour_cap then bounds a per-token scale). verl "
        "rollout_is_level; geometric as NeMo-RL's and TRL's length-normalised sequence ratio"))
    behaviour_dropped_warn: float = Field(D.BEHAVIOUR_DROPPED_WARN, ge=0, le=1, description=(
        "warn when a step's share of importance-correction units (tokens or responses) that MIS dropped passes "
        "this bound (metrics.jsonl behaviour_dropped_share; the report counts the steps)"))
    mask_truncated: bool = Field(D.MASK_TRUNCATED, description=(
        "responses cut by a budget (rollout.max_new_tokens, task.turns.max, task.turns.max_tokens) carry no "
        "loss; they still count in their group's advantages (DAPO overlong filtering; TRL "
        "mask_truncated_completions)"))
    micro_batch: int = Field(16, ge=1, description=(
        "m_b: the responses a micro-batch waits for — a forward/backward pass starts once this many are ready (or "
        "the step's rollout is complete)"))
    micro_batch_max: int | None = Field(None, ge=1, description=(
        "the most responses one pass takes: a pass takes every ready response up to this many, so responses that "
        "arrive together train as one batch (throughput) and a trickle streams in passes of m_b (None: "
        "micro_batch). Bounded by the trainer's memory; Megatron splits a pass into its own micro-batches"))
    step_timeout_s: float = Field(300.0, gt=0, description="deadline for collecting one step's responses")
    gpus: int | None = Field(None, ge=0, description=(
        "GPUs of the trainer allocation, used only when Slurm's environment does not say (SLURM_GPUS_ON_NODE x "
        "SLURM_JOB_NUM_NODES, else SLURM_JOB_GPUS); unset outside Slurm: the reserved side counts as one rollout "
        "instance (N_resv = 1)"))
    torch_threads: int = Field(1, ge=1, description="intra-op threads of the trainer process (torch backend)")
    eval_samples: int = Field(4, ge=1, description="sampled responses per held-out prompt in evaluation (n)")
    eval_temperature: float | None = Field(None, ge=0, description="sampling temperature of the held-out "
                                                                   "evaluation (None: rollout.temperature)")
    eval_pass_k: list[int] = Field(default_factory=lambda: [1], description=(
        "k of the held-out pass@k (unbiased estimator over eval_samples = n samples; each 1 ≤ k ≤ n)"))
    eval_correct_at: float = Field(1.0, description="a held-out sample passes when its reward is ≥ this")
    log_samples: int = Field(4, ge=0, description="sample rows per step (prompt, response, reward and its parts) in "
                                                   "RUN_DIR/samples.jsonl and the trackers' tables (0: none)")
    seed: int = Field(0, description="seed of the model's initial RNG, the prompt order and every group's sampling")
    checkpoint_every: int = Field(1, ge=0, description="checkpoint every k steps into <out>/checkpoints (0: never)")
    checkpoint_background: bool = Field(True, description=(
        "write each checkpoint in a background thread while the next step runs (its state is captured at the end "
        "of its step; at most one in flight); false: write it before the next step starts"))
    export_model: bool = Field(True, description=(
        "at the end, pull the trained policy from the weight server (weights.dtype) and write it to <out>/model "
        "as a Hugging Face model directory (safetensors + the model's config, tokenizer and generation config)"))
    resume: Literal["auto", "require", "never"] = Field("auto", description=(
        "auto: resume from <out>/checkpoints/latest when there is one (a Slurm requeue of the trainer job); "
        "require: fail unless there is one; never: start from step 0 (overwriting)"))
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list, description=(
        "experiment trackers that receive every step's figures, the config, the report and run.png (rank 0, in a "
        "background thread; one that fails is dropped, the run goes on); each needs its extra: "
        "pip install 'rlboost-hpc[tensorboard]' / '[mlflow]' / '[wandb]'"))

    @model_validator(mode="after")
    def _pass_k_within_samples(self) -> "TrainerCfg":
        if any(not 1 <= k <= self.eval_samples for k in self.eval_pass_k):
            raise ValueError(f"eval_pass_k = {self.eval_pass_k}: each k must be within 1..eval_samples "
                             f"({self.eval_samples})")
        return self

    def gate_bounds(self) -> tuple[float, float]:
        """The quality gate's bounds: (KL to the reference, nats/token; share of repeated 3-grams)."""
        return self.gate_max_kl, self.gate_max_repetition


class FaultsCfg(_Strict):
    """``cluster.faults``: faults the embedded local cluster injects on purpose (chaos runs and tests; all off by
    default; ``rlboost_hpc/cluster/faults.py`` draws them from ``cluster.seed``)."""

    stall_every_s: float = Field(0.0, ge=0, description="mean seconds between stalls: one random live worker "
                                                        "SIGSTOPped for stall_s, then SIGCONTed (0: none)")
    stall_s: float = Field(6.0, gt=0, description="length of a stall (longer than manager.heartbeat_timeout_s: "
                                                  "the worker looks dead and must come back)")
    link_reset_every_s: float = Field(0.0, ge=0, description="mean seconds between resets of every worker's TCP "
                                                             "connection to the manager (through a forwarder; 0: none)")
    slow_load_s: float = Field(0.0, ge=0, description="extra seconds every weight load takes on a share "
                                                      "slow_load_fraction of worker attempts (0: none)")
    slow_load_fraction: float = Field(0.5, ge=0, le=1, description="share of worker attempts slowed by slow_load_s")
    every_steps: int = Field(0, ge=0, description=(
        "at every k-th step boundary inject one fault of each of `kinds` — by progress, not by chance or wall "
        "time: a fault that finds no target (no live worker, no connection) stays due until it does, so a run of "
        "n steps sees at least floor((n - 1) / k) of each (0: none)"))
    kinds: list[Literal["preempt", "kill", "stall", "link_reset", "slow_load"]] = Field(
        default_factory=lambda: ["preempt", "kill"], description=(
            "what every_steps injects: preempt (the warning signal to a live worker), kill (SIGKILL, no warning), "
            "stall (SIGSTOP for stall_s), link_reset (every worker's TCP connection reset), slow_load (one live "
            "worker's next weight load takes slow_load_s longer)"))

    @model_validator(mode="after")
    def _slow_load_has_a_length(self) -> "FaultsCfg":
        if self.every_steps and "slow_load" in self.kinds and self.slow_load_s <= 0:
            raise ValueError("cluster.faults.kinds has slow_load: set cluster.faults.slow_load_s > 0 (its length)")
        return self


class ClusterCfg(_Strict):
    """Where preemptible rollout instances come from.

    ``kind = "local"``: the embedded local cluster — rollout-worker processes replaying a spot trace.
    ``kind = "slurm"``: rollout jobs submitted by the scavenger daemon find the run through ``endpoints.json``
    in the run directory; ``max_workers`` is then the N_prem target written to ``target.json``.
    """

    kind: Literal["local", "slurm"] = Field("local", description=(
        "local: the embedded cluster replays a spot trace on this machine; slurm: the scavenger's rollout jobs"))
    trace: str = Field("spot_traces/bamboo/p3-trace.csv", description=(
        "local: the spot trace replayed (a name such as p3 or g4dn, a path, or a path under the data directory)"))
    max_workers: int = Field(2, ge=0, description=(
        "most preemptible instances at once (local: worker processes; slurm: the largest N_prem target)"))
    worker_cpus: list[int] | None = Field(None, description=(
        "local: the CPU cores the workers run on (their affinity), emulating preemptible nodes apart from the "
        "trainer's — start the run itself on the other cores (taskset) for a faithful split; None: wherever the OS "
        "puts them"))
    instances_per_worker: int = Field(1, ge=1, description=(
        "local: rollout instances one worker process hosts (threads, each its own identity <job>.<i>, sockets, "
        "heartbeat and weights); > 1 needs rollout.engine = emulated (load tests of hundreds of instances on one "
        "machine). max_workers still counts instances: ceil(max_workers / this) processes replay the trace, each "
        "trace event starting or preempting all instances of one process, and N_prem caps whole processes"))
    time_scale: float = Field(80.0, gt=0, description="trace seconds per wall-clock second")
    replay_s: float = Field(32.0, gt=0, description="wall seconds of trace replayed (window = replay_s × time_scale)")
    window_start_s: float | None = Field(None, description="trace second to start at; None picks the earliest "
                                                           "window with min_changes/min_removals")
    min_changes: int = Field(5, ge=0, description="scaled live-count changes the chosen window must have")
    min_removals: int = Field(3, ge=0, description="removals (preemptions) the chosen window must have")
    min_starts: int = Field(2, ge=0, description="worker (re)starts after t=0 the chosen window must have")
    kill_fraction: float = Field(0.0, ge=0, le=1, description="share of removals delivered as SIGKILL (no warning)")
    preempt_signal: Literal["SIGTERM", "SIGUSR2"] = Field("SIGTERM", description=(
        "local: the warning signal a preempted worker gets (Slurm sends its own: --signal of the rollout job)"))
    seed: int = Field(0, description="local: seed of the trace window's kill choices and of injected faults")
    preempt_when_busy: bool = Field(False, description=(
        "hold each due removal until its worker holds ≥ 1 partial response at the manager (tokens to hand over), "
        "at most busy_wait_max_s — and a warned preemption scheduled by faults.every_steps until some worker does "
        "(it stays due); for tests and chaos runs that must exercise the hand-off, not hope for it"))
    busy_wait_max_s: float = Field(30.0, ge=0, description="longest a removal is held by preempt_when_busy (s)")
    faults: FaultsCfg = Field(default_factory=FaultsCfg, description=(
        "local: faults injected on purpose (chaos): stalls, link resets, slow weight loads"))


class NetworkCfg(_Strict):
    """Sockets of the manager and the weight server."""

    bind_host: str = Field("127.0.0.1", description="interface to bind; 0.0.0.0 on a real cluster")
    advertise_host: str | None = Field(None, description="host rollout jobs dial; default: bind_host, or this "
                                                         "node's hostname when binding 0.0.0.0")


class SecurityCfg(_Strict):
    """Authentication of every socket (docs/security.md)."""

    curve: bool = Field(True, description="ZeroMQ CURVE on manager and weight-server sockets with per-run keys")


class DataCfg(_Strict):
    """Where the shared data (model checkpoints, prompt sets, spot traces) are read from."""

    dir: str | None = Field(None, description="shared data directory; default RLBOOST_DATA or ../shared/data")


class RunConfig(_Strict):
    """Everything one run needs."""

    model: ModelCfg = Field(ModelCfg(), description="the policy model")
    task: TaskCfg = Field(TaskCfg(), description="prompts, verifiable reward and tools")
    rollout: RolloutCfg = Field(RolloutCfg(), description="sampling and the rollout engines")
    manager: ManagerCfg = Field(ManagerCfg(), description="the rollout manager: dispatch, failure detection")
    policy: PolicyCfg = Field(PolicyCfg(), description="RLBoost's scheduling: T_seed, N_prem, dispatch, balancing")
    weights: WeightsCfg = Field(WeightsCfg(), description="weight versions from the trainer to the instances")
    trainer: TrainerCfg = Field(TrainerCfg(), description="the GRPO trainer")
    cluster: ClusterCfg = Field(ClusterCfg(), description="where preemptible instances come from")
    network: NetworkCfg = Field(NetworkCfg(), description="the sockets' interfaces")
    security: SecurityCfg = Field(SecurityCfg(), description="authentication and encryption of every socket")
    data: DataCfg = Field(DataCfg(), description="the shared data directory")

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.manager.heartbeat_timeout_s <= 2 * self.manager.heartbeat_s:
            raise ValueError("manager.heartbeat_timeout_s must exceed 2 × manager.heartbeat_s")
        if self.manager.dispatch_silence_s < 2 * self.manager.heartbeat_s:
            raise ValueError(f"manager.dispatch_silence_s ({self.manager.dispatch_silence_s}) must be at least 2 × "
                             f"manager.heartbeat_s ({self.manager.heartbeat_s}): a healthy instance would leave "
                             "dispatch between two heartbeats")
        p = self.policy
        if p.t_seed_ceil_s is not None and p.t_seed_ceil_s < p.t_seed_floor_s:
            raise ValueError(f"policy.t_seed_ceil_s ({p.t_seed_ceil_s}) must be >= policy.t_seed_floor_s "
                             f"({p.t_seed_floor_s})")
        tr = self.trainer
        if tr.micro_batch_max is not None and tr.micro_batch_max < tr.micro_batch:
            raise ValueError(f"trainer.micro_batch_max ({tr.micro_batch_max}) must be >= trainer.micro_batch "
                             f"({tr.micro_batch})")
        if tr.clip_eps_high is not None and tr.clip_eps_high < tr.clip_eps:
            raise ValueError(f"trainer.clip_eps_high ({tr.clip_eps_high}) must be >= trainer.clip_eps "
                             f"({tr.clip_eps})")
        cpus = self.cluster.worker_cpus
        if cpus is not None and (not cpus or min(cpus) < 0 or max(cpus) >= (os.cpu_count() or 1)):
            raise ValueError(f"cluster.worker_cpus {cpus}: CPU ids of this machine (0 .. {(os.cpu_count() or 1) - 1})")
        k = self.cluster.instances_per_worker
        if k > 1 and (self.rollout.engine != "emulated" or self.cluster.kind != "local"):
            raise ValueError(f"cluster.instances_per_worker = {k} needs rollout.engine = emulated and cluster.kind = "
                             f"local (got {self.rollout.engine} / {self.cluster.kind}): only emulated instances "
                             "share a process")
        if tr.lora.enabled and tr.export_model is False and tr.lora.export_merged:
            raise ValueError("trainer.lora.export_merged = true needs trainer.export_model = true")
        if tr.backend == "emulated" and self.rollout.engine != "emulated":
            raise ValueError(f"trainer.backend = emulated needs rollout.engine = emulated (got {self.rollout.engine}): "
                             "its weights are no model an engine could run")
        t = self.task.turns
        if t.max == 1 and t.max_tokens not in (0, self.rollout.max_new_tokens):
            raise ValueError("task.turns.max_tokens applies to multi-turn tasks only (task.turns.max > 1)")
        if t.max > 1 and 0 < t.max_tokens < self.rollout.max_new_tokens:
            raise ValueError(f"task.turns.max_tokens ({t.max_tokens}) must be >= "
                             f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) or 0")
        return self

    def trajectory_tokens(self) -> int:
        """Tokens after the prompt of one response: ``task.turns.max_tokens``, or ``task.turns.max ×
        rollout.max_new_tokens`` when 0 (= ``rollout.max_new_tokens`` for single-turn tasks)."""
        return self.task.turns.max_tokens or self.task.turns.max * self.rollout.max_new_tokens


class ConfigError(BadInput, ValueError):
    """A config file or override is malformed; the message names the key and the problem."""


#: Keys that were renamed: old dotted key → new one (a config or override using the old name is refused, naming
#: the new one, rather than reported as merely unknown).
RENAMED = {
    "trainer.seed_window_s": "policy.t_seed_initial_s",
    "policy.seed_floor_s": "policy.t_seed_floor_s",
    "policy.seed_ceil_s": "policy.t_seed_ceil_s",
    "policy.seed_memory": "policy.t_seed_memory",
}


def _check_renamed(data: dict[str, Any], where: str) -> None:
    """Raise ConfigError for every key of ``data`` that :data:`RENAMED` lists."""
    def present(key: str) -> bool:
        table, name = key.split(".")
        return isinstance(data.get(table), dict) and name in data[table]

    old = [k for k in RENAMED if present(k)]
    if old:
        raise ConfigError(f"renamed configuration keys{where}: " + "; ".join(f"{k} is now {RENAMED[k]}" for k in old))


def _parse_value(raw: str) -> Any:
    """Parse an override's value as a TOML value (numbers, booleans, quoted strings, lists); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (in place) and return it.

    Raises:
        ConfigError: an override without ``=`` or one that descends into a non-table.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a table")
        node[parts[-1]] = _parse_value(raw.strip())
    return data


def resolve_config_file(p: Path) -> Path:
    """``p``, or — a relative path that is not a file here, e.g. README's ``configs/local.toml`` typed outside the
    checkout — the config of that name the project ships (``rlboost_hpc.paths.shipped``).

    Raises:
        ConfigError: neither exists.
    """
    why = unreadable(p)
    if why is None:
        return p
    if why != "not found":  # there, but not readable (permissions, a directory): never "not found"
        raise ConfigError(f"config file {p} {why}")
    if not p.is_absolute():
        try:
            return shipped(str(p))
        except ShippedFileMissing:
            pass
    raise ConfigError(f"config file not found: {p}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from an optional TOML file plus dotted overrides.

    Raises:
        ConfigError: missing file, TOML syntax error, unknown key, or invalid value (pydantic's
            message, with the dotted location of each problem).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_file(Path(path))
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except (OSError, UnicodeDecodeError) as e:  # (it changed since it was checked, or is not text)
            raise ConfigError(f"config file {p} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    read_moved_task_keys(data, str(path))  # (the file's; then an override of the new name overrides them)
    apply_overrides(data, overrides := moved_task_overrides(overrides or []))
    _check_renamed(data, f" in {path} or --set" if path else "")
    anchor_task_paths(data, resolve_config_file(Path(path)).parent if path is not None else None)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {config_problem(err, path, overrides, RunConfig)}" for err in e.errors()]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None
