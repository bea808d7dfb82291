"""Hardware, model, workload and price profiles of the simulator.

Every number here is documented in ``docs/simulator.md`` with its source: the RLBoost paper's text, a public
specification (H100 data sheet, Qwen3 ``config.json``), the reference artifact's README (Terra-Flux/PolyRL
``REPRODUCE.md``), or marked as an *estimate*. The few *fitted* numbers (efficiencies) were chosen so that the
co-located baseline reproduces the reference artifact's verl figure (~10k tokens/s for Qwen3-8B on one
8×H100 node); nothing is fitted to the RLBoost ratios themselves.

Decode model of one engine with ``tp`` GPUs (a time per decode iteration, i.e. one token for each of the
``B`` running requests whose contexts sum to ``S`` tokens)::

    t_iter(B, S) = a + b·B + γ·S
    a = overhead + tp_allreduce·layers·[tp > 1] + weight_bytes / (tp · HBM_bw · e_weights)
    b = 2·params / (tp · peak_flops · e_decode_flops)              # matmul work per sequence
    γ = kv_bytes_per_token / (tp · HBM_bw · e_kv)                 # reading the KV cache

Prefill of a context of ``L`` tokens: ``pf0 + L·2·params/(tp·peak·e_prefill) + 2·layers·d_attn·L²/(tp·peak·e_prefill)``.
KV capacity of an engine: ``(tp·mem·mem_frac − weight_bytes − tp·act_reserve) / kv_bytes_per_token`` tokens.

Training time of a response of ``L`` tokens (prompt + response) on ``n`` GPUs::

    flops = L·(train_flops_factor·params + attn_factor·2·layers·d_attn·L/2·2)
    time  = flops / (n · peak_flops · mfu)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class GPU:
    """One accelerator. H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA data sheet)."""

    name: str = "H100-SXM-80GB"
    mem_bytes: float = 80 * 2**30
    hbm_bw: float = 3.35e12
    peak_flops: float = 989e12


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers from the model's Hugging Face ``config.json``."""

    name: str
    params: float
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int = 0  # MLP width (the shapes of a LoRA adapter on it)
    vocab: int = 151936

    def arch(self):
        """The model's shapes as a :class:`~rlboost_hpc.models.arch.ModelArch` (Qwen3: untied, q/k norm)."""
        from rlboost_hpc.models.arch import ModelArch

        return ModelArch(family="qwen3", vocab_size=self.vocab, hidden_size=self.hidden,
                         intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                         num_attention_heads=self.q_heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                         max_position_embeddings=40960, qk_norm=True)

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def d_attn(self) -> int:
        return self.q_heads * self.head_dim


QWEN3_8B = ModelSpec("Qwen3-8B", params=8.19e9, layers=36, hidden=4096, q_heads=32, kv_heads=8, head_dim=128,
                     intermediate=12288)
QWEN3_14B = ModelSpec("Qwen3-14B", params=14.77e9, layers=40, hidden=5120, q_heads=40, kv_heads=8, head_dim=128,
                      intermediate=17408)
QWEN3_32B = ModelSpec("Qwen3-32B", params=32.76e9, layers=64, hidden=5120, q_heads=64, kv_heads=8, head_dim=128,
                      intermediate=25600)


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak (estimates; ``mfu`` fitted, see docs/simulator.md)."""

    e_weights: float = 0.75        # weight streaming during decode (estimate)
    e_kv: float = 0.65             # paged-attention KV reads (fitted, with mfu, to verl ~10k tok/s)
    e_decode_flops: float = 0.5    # decode GEMMs (estimate)
    e_prefill: float = 0.55        # prefill (estimate)
    overhead_s: float = 2.0e-3     # scheduler + kernel launch per iteration with CUDA graphs (estimate)
    tp_allreduce_s: float = 2 * 8e-6  # two all-reduces per layer over NVLink, ~8 µs each (estimate)
    prefill_fixed_s: float = 0.02  # per admission batch (estimate)
    mfu: float = 0.42              # training model-FLOPs utilisation, FSDP (fitted, with e_kv)
    train_flops_factor: float = 10.0   # 6P fwd+bwd + 2P recompute (grad ckpt) + 2P old-logprob pass (no ref/KL)
    attn_factor: float = 5.0       # same passes for the attention term (fwd 1 + bwd 2 + recompute 1 + logprob 1)


@dataclass(frozen=True)
class EnginePerf:
    """Derived decode/prefill constants of one engine (see the module docstring)."""

    a: float
    b: float
    gamma: float
    pf_per_token: float
    pf_quad: float
    pf_fixed: float
    kv_capacity: float
    max_running: int
    reserve_tokens: float

    def iter_time(self, batch: int, ctx_sum: float) -> float:
        return self.a + self.b * batch + self.gamma * ctx_sum

    def prefill_time(self, ctx: float) -> float:
        return self.pf_per_token * ctx + self.pf_quad * ctx * ctx


def engine_perf(model: ModelSpec, gpu: GPU, eff: Efficiency, tp: int, mem_frac: float, *,
                act_reserve_bytes: float = 4 * 2**30, max_running: int = 256,
                reserve_tokens: float = 2048.0) -> EnginePerf:
    """Constants of a ``tp``-GPU engine holding ``model`` with ``mem_frac`` of GPU memory for weights + KV."""
    bw = tp * gpu.hbm_bw
    fl = tp * gpu.peak_flops
    a = eff.overhead_s + (eff.tp_allreduce_s * model.layers if tp > 1 else 0.0) + model.weight_bytes / (bw * eff.e_weights)
    b = 2.0 * model.params / (fl * eff.e_decode_flops)
    gamma = model.kv_bytes_per_token / (bw * eff.e_kv)
    pf_tok = 2.0 * model.params / (fl * eff.e_prefill)
    pf_quad = 2.0 * model.layers * model.d_attn / (fl * eff.e_prefill)
    kv_bytes = tp * gpu.mem_bytes * mem_frac - model.weight_bytes - tp * act_reserve_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit on {tp}× {gpu.name} at mem_frac {mem_frac}")
    return EnginePerf(a=a, b=b, gamma=gamma, pf_per_token=pf_tok, pf_quad=pf_quad, pf_fixed=eff.prefill_fixed_s,
                      kv_capacity=kv_bytes / model.kv_bytes_per_token, max_running=max_running,
                      reserve_tokens=reserve_tokens)


@dataclass(frozen=True)
class Workload:
    """RL step shape (the paper's: 128 prompts × 8 responses, max response 14K) and length distribution.

    Response lengths (estimate, see docs/simulator.md): each prompt draws a median ``exp(N(ln median, σ_p))``
    and each of its ``group`` responses ``median·exp(N(0, σ_r))``, clipped to ``[min_response, max_response]``.
    Prompt lengths: ``exp(N(ln prompt_median, 0.4))`` clipped to ``[min_prompt, 2048]``.
    """

    prompts: int = 128
    group: int = 8
    max_response: int = 14336
    min_response: int = 64
    response_median: float = 4300.0
    sigma_prompt: float = 0.6
    sigma_response: float = 0.45
    prompt_median: float = 220.0
    micro_batch: int = 16
    min_prompt: int = 32


@dataclass(frozen=True)
class Prices:
    """Dollars per hour (the paper's prices): on-demand 8×H100 node $83.79; spot 2×H100 instance $5.32."""

    on_demand_node: float = 83.79
    spot_instance: float = 5.32

    @property
    def on_demand_instance(self) -> float:
        """A 2×H100 slice at the on-demand rate (for the disaggregated baseline): 83.79 / 4."""
        return self.on_demand_node / 4.0


@dataclass(frozen=True)
class Network:
    """Weight transfer (estimates except the egress figure, from PolyRL REPRODUCE.md: "200+ Gbps")."""

    trainer_egress_Bps: float = 200e9 / 8   # bytes/s out of each reserved node
    instance_ingress_Bps: float = 100e9 / 8  # per preemptible instance NIC (estimate)
    efficiency: float = 0.8                  # achieved fraction with parallel TCP streams (estimate)
    publish_s: float = 1.0                   # GPU → host buffer copy after the optimizer step (estimate)


@dataclass(frozen=True)
class Profile:
    """Everything one simulated configuration needs."""

    model: ModelSpec
    reserved_nodes: int
    gpus_per_node: int = 8
    reserved_tp: int = 2
    instance_tp: int = 2
    reserved_mem_frac: float = 0.6    # verl gpu_memory_utilization while co-located (estimate)
    instance_mem_frac: float = 0.88   # SGLang mem_fraction_static on a dedicated instance (estimate)
    switch_to_rollout_s: float = 10.0  # co-located resharding/wake-up (estimate)
    switch_to_train_s: float = 5.0     # co-located KV release/onload (estimate)
    optimizer_s: float = 3.0           # optimizer step + grad sync (estimate)
    boot_s: float = 90.0               # spot instance: container + engine start before it can pull (estimate)
    train_scale_eff: float = 0.9       # data-parallel efficiency when the trainer doubles (verl 2×, estimate)
    train_eff_mult: float = 1.0        # multiplies ``mfu`` (set to ``train_scale_eff`` by :meth:`doubled`)
    gpu: GPU = field(default_factory=GPU)
    eff: Efficiency = field(default_factory=Efficiency)
    workload: Workload = field(default_factory=Workload)
    prices: Prices = field(default_factory=Prices)
    net: Network = field(default_factory=Network)

    @property
    def reserved_gpus(self) -> int:
        return self.reserved_nodes * self.gpus_per_node

    @property
    def n_resv_engines(self) -> int:
        return self.reserved_gpus // self.reserved_tp

    @property
    def n_resv_equiv(self) -> float:
        """Reserved rollout capacity in preemptible-instance equivalents (GPUs / instance GPUs)."""
        return self.reserved_gpus / self.instance_tp

    def reserved_perf(self) -> EnginePerf:
        return engine_perf(self.model, self.gpu, self.eff, self.reserved_tp, self.reserved_mem_frac)

    def instance_perf(self) -> EnginePerf:
        return engine_perf(self.model, self.gpu, self.eff, self.instance_tp, self.instance_mem_frac)

    def train_time(self, tokens: float, sq_tokens: float, n_gpus: int | None = None) -> float:
        """Seconds to train responses totalling ``tokens`` tokens whose squared lengths sum to ``sq_tokens``."""
        n = n_gpus or self.reserved_gpus
        m = self.model
        flops = self.eff.train_flops_factor * m.params * tokens + self.eff.attn_factor * 2 * m.layers * m.d_attn * sq_tokens / 2
        return flops / (n * self.gpu.peak_flops * self.eff.mfu * self.train_eff_mult)

    def doubled(self) -> "Profile":
        """verl on twice the reserved GPUs."""
        return replace(self, reserved_nodes=2 * self.reserved_nodes, train_eff_mult=self.train_scale_eff)


def profile(name: str, **overrides) -> Profile:
    """``"8b"``, ``"14b"`` or ``"32b"`` (case-insensitive), with optional field overrides."""
    key = name.lower().replace("qwen3-", "")
    if key == "8b":
        p = Profile(QWEN3_8B, reserved_nodes=1, reserved_tp=2, switch_to_rollout_s=10.0, switch_to_train_s=5.0,
                    optimizer_s=3.0)
    elif key == "14b":
        p = Profile(QWEN3_14B, reserved_nodes=1, reserved_tp=2, switch_to_rollout_s=14.0, switch_to_train_s=7.0,
                    optimizer_s=5.0)
    elif key == "32b":
        p = Profile(QWEN3_32B, reserved_nodes=2, reserved_tp=4, switch_to_rollout_s=24.0, switch_to_train_s=10.0,
                    optimizer_s=8.0)
    else:
        raise ValueError(f"unknown model profile {name!r} (expected 8b, 14b or 32b)")
    return replace(p, **overrides) if overrides else p


MODELS = ("8b", "14b", "32b")
