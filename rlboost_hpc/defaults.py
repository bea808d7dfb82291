"""The one home of every default shared by the run config and the components it configures.

The config (``rlboost_hpc/config.py``) and the components' own keyword defaults (the manager core, the weight
server and puller, the rollout worker's spec and command line) read these names, so a component built without a
config behaves as a run with the built-in config does. Units are in the names (seconds ``_S``, bytes ``_BYTES``).
No imports: any layer may use it.
"""
from __future__ import annotations

#: Θ: requests in flight per rollout instance before JSQ looks elsewhere (``manager.pending_limit``).
PENDING_LIMIT = 64
#: manager.arrival_hold_s: the longest an instance loading the latest version keeps its share of the work waiting (s)
ARRIVAL_HOLD_S = 1.0
#: Engine batch slots per rollout instance (``rollout.max_batch``).
MAX_BATCH = 32
#: Seconds between heartbeats (``manager.heartbeat_s``).
HEARTBEAT_S = 0.25
#: Silence after which an instance is suspect (``manager.heartbeat_timeout_s``).
HEARTBEAT_TIMEOUT_S = 4.0
#: Silence after which an instance gets no new work, though it stays routable (keeps what it runs) until
#: ``HEARTBEAT_TIMEOUT_S`` suspects it (``manager.dispatch_silence_s``): four missed heartbeats.
DISPATCH_SILENCE_S = 1.0
#: Silence after which a suspect instance is gone for good (``manager.instance_expiry_s``).
INSTANCE_EXPIRY_S = 60.0
#: The rollout manager's work-log group commit (``manager.commit_every_s``, seconds): a manager kill loses at most the
#: tokens accepted in this window (its instances regenerate them). 50 ms keeps the fsyncs to ≤ 20 per second.
WORK_COMMIT_S = 0.05
#: Manager restarts the trainer allows within ``MANAGER_RESTART_WINDOW_S`` seconds before it gives up (exit 1).
MANAGER_RESTARTS = 3
MANAGER_RESTART_WINDOW_S = 600.0
#: Dispatch attempts of one response before its step fails (``manager.max_attempts``).
MAX_ATTEMPTS = 5

#: Chunk size of a weight version on the wire (``weights.chunk_bytes``); also the delta granularity.
WEIGHT_CHUNK_BYTES = 1 << 20
#: Parallel streams of one weight pull (``weights.streams``); 0: automatic, one per two usable CPU cores, at most
#: 4 (each stream keeps its receiving thread and a libzmq I/O thread busy; more streams than that only contend).
WEIGHT_STREAMS = 0
#: Most streams the automatic choice takes.
WEIGHT_STREAMS_MAX = 4
#: Outstanding chunk requests per stream (``weights.window``).
WEIGHT_WINDOW = 4
#: Stall deadline of a weight pull from the trainer (``weights.pull_timeout_s``).
PULL_TIMEOUT_S = 30.0

#: Tokens per streamed delta: an engine flushes every k tokens (``rollout.stream_every_tokens``) ...
STREAM_EVERY_TOKENS = 4
#: ... or after this many seconds, whichever first (``rollout.stream_every_s``).
STREAM_EVERY_S = 0.05
#: Continuous balancer period, also the throughput sampling interval (``policy.balance_every_s``).
BALANCE_EVERY_S = 0.5
#: Pullers one relay holder serves at once (``weights.relay_fanout``).
RELAY_FANOUT = 4
#: Pullers the trainer serves at once while relay is on (``weights.relay_trainer_fanout``).
RELAY_TRAINER_FANOUT = 2
#: Longest wait for relay capacity before pulling from the trainer anyway, seconds (``weights.relay_wait_s``).
RELAY_WAIT_S = 10.0
#: Longest wait of a warned instance's drain for the manager's ``Farewell``, seconds: long enough for a manager that
#: died meanwhile to be restarted (its death noticed, a new process, the work log restored); Slurm's kill at the end
#: of the grace time ends it sooner.
DRAIN_CONFIRM_S = 30.0
#: A relay peer silent this long is abandoned, seconds (``weights.relay_timeout_s``).
RELAY_TIMEOUT_S = 5.0

# GRPO objective (``trainer.*``; rlboost_hpc/trainer/algorithms/grpo.py ``GRPOOptions`` reads the same names).
#: PPO clip range ε (``trainer.clip_eps``); the upper bound is 1 + ``trainer.clip_eps_high`` (None: ε).
CLIP_EPS = 0.2
#: How token losses become the step loss (``trainer.loss_aggregation``): GRPO's per-sequence token mean.
LOSS_AGGREGATION = "seq_mean_token_mean"
#: Divide group-centred rewards by the group's std (``trainer.advantage_std_norm``; Dr. GRPO turns it off).
ADVANTAGE_STD_NORM = True
#: The KL penalty's estimator (``trainer.kl_estimator``) — also the report's ``kl_to_reference`` estimator.
KL_ESTIMATOR = "k3"
#: Importance correction of the engine–trainer mismatch (``trainer.behaviour_correction``): none by default.
BEHAVIOUR_CORRECTION = "none"
#: The quality gate of a finished run (``trainer.gate_max_kl``, ``trainer.gate_max_repetition``): KL to the reference
#: policy per token (nats) and the share of repeated 3-grams in held-out samples, each below its bound. A collapsed,
#: reward-hacked policy of the demo reads about 7–8 nats and 0.6; a healthy one 0.03–0.5 and under 0.07.
GATE_MAX_KL_NATS_PER_TOKEN = 1.0
GATE_MAX_REPETITION = 0.2
#: Cap C of the importance ratio π_trainer/π_engine (``trainer.behaviour_cap``; Yao et al. use 2).
BEHAVIOUR_CAP = 2.0
#: Whether the ratio is per token or per sequence (``trainer.behaviour_level``).
BEHAVIOUR_LEVEL = "token"
#: ``trainer.behaviour_dropped_warn``: a step whose MIS-dropped share of units passes this is warned about (a share).
BEHAVIOUR_DROPPED_WARN = 0.1
#: Leave truncated responses out of the loss (``trainer.mask_truncated``; DAPO's overlong filtering): off.
MASK_TRUNCATED = False

#: The emulated rollout engine (``rollout.emulated``): the modelled Qwen3 (``"8b"``/``"14b"``/``"32b"``) ...
EMULATED_PROFILE = "8b"
#: ... on this many H100s per instance (the simulator's instance size) ...
EMULATED_INSTANCE_TP = 2
#: ... run this many model seconds per wall second ...
EMULATED_TIME_SCALE = 1.0
#: ... loading a weight version at this rate (bytes/s; the model's bf16 bytes ÷ it is one load; an estimate) ...
EMULATED_LOAD_BYTES_PER_S = 5e9
#: ... with response lengths log-normal around this median (tokens; the simulator's workload) and σ.
EMULATED_RESPONSE_MEDIAN = 4300.0
EMULATED_RESPONSE_SIGMA = 0.45
#: ... on GPUs of these relative speeds (1 = the profile's H100; heterogeneous harvested capacity mixes kinds).
EMULATED_GPU_SPEEDS = (1.0,)
#: The emulated trainer (``trainer.emulated``): bytes of one weight version (bf16; 256 MiB fits any machine,
#: an 8B model is 16.4 GB) ...
EMULATED_WEIGHT_BYTES = 256 * 2**20
#: ... in tensors of at most this many bytes (a 7B model's largest, its embedding, is ~1 GB) ...
EMULATED_TENSOR_BYTES = 64 * 2**20
#: ... of which one optimizer step changes this share of the elements (1–5 % of bf16 elements at RL rates).
EMULATED_DELTA_DENSITY = 0.03

#: Bounded staleness (``rollout.max_staleness``): 0 = strict on-policy, RLBoost's and this project's default.
MAX_STALENESS = 0
#: What a response in flight does when its instance gets a newer version (``rollout.on_new_version``).
ON_NEW_VERSION = "finish"
