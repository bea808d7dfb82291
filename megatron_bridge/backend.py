"""``MegatronBackend``: the :class:`~rlboost_hpc.trainer.backends.base.TrainerBackend` on Megatron-core.

Same contract and same numbers as :class:`~rlboost_hpc.trainer.backends.torch_backend.TorchBackend`: token
logprobs at ``temperature``, the GRPO loss of :func:`rlboost_hpc.trainer.algorithms.grpo.grpo_loss` with the same
:class:`~rlboost_hpc.trainer.algorithms.grpo.GRPOOptions` (loss aggregation, clip-higher, KL estimator, behaviour
correction, truncation mask) summed per micro-batch and divided by ``responses_in_step``, the gradients rescaled at the
optimizer step by the same :class:`~rlboost_hpc.trainer.backends.base.StepAccumulator` (so any split of a step gives
the same gradient), the trainer-recomputed ``old_logp = logp.detach()`` (one optimizer step per RL step), a frozen
reference policy for the KL term and for ``token_logprobs(reference=True)``.

Megatron pieces used:
- model: ``GPTModel`` (local layer spec) built from the HF config (:mod:`megatron_bridge.arch`), TP/PP from
  the constructor (or the launcher's ``--tp/--pp``), DP = world / (TP·PP); weights from the HF state dict or an
  HF directory (each rank reads only its shard, :mod:`megatron_bridge.bridge`);
- logprobs: ``tensor_parallel.vocab_parallel_cross_entropy`` on the vocab-parallel logits (never gathered);
- micro-batch streaming: every :meth:`accumulate` call runs ``get_forward_backward_func()`` (1F1B across
  pipeline stages) over ``ceil(n / micro_batch_size)`` Megatron micro-batches of the arriving RL micro-batch;
  gradients accumulate in the DDP buffers until :meth:`optimizer_step`; old/reference logprobs use the same
  schedule with ``forward_only=True``;
- optimizer: ``get_megatron_optimizer`` (Adam with decoupled weight decay = AdamW, grad clipping by
  ``clip_grad``), options ``bf16`` (bf16 params, fp32 main params/grads) and ``distributed_optimizer``;
- ``finalize_model_grads`` (DP all-reduce as a *sum* — ``calculate_per_token_loss`` disables Megatron's 1/DP
  scaling because the loss is already normalised by ``responses_in_step`` — and the tied-embedding all-reduce
  between first and last pipeline stage);
- activation recompute (``recompute="full"|"selective"``); ``dist_checkpointing`` (:meth:`save_checkpoint`).

Data parallelism: every rank receives the whole RL micro-batch; DP replica ``d`` trains samples
``d, d+DP, …`` (responses_in_step is global, so the summed gradient equals the single-replica one).

Weight export: :meth:`export_weights` returns full HF-named tensors on rank 0 (no copy at TP=PP=1; a gather
at TP/PP>1 — a compatibility path, off the critical path); :meth:`publish_shards` is the scalable path —
each holder rank publishes its own bf16 pieces into its own ``WeightServer`` and :attr:`shard_manifest`
tells pullers how to assemble HF tensors (:mod:`megatron_bridge.export`).

Multi-rank execution: see :mod:`megatron_bridge.driver` (leader/follower under
``python -m megatron_bridge.launch``). Every public method is collective.

LoRA (``lora``, ``trainer.lora``): :class:`~megatron_bridge.lora.MegatronLora` adds the adapter to the column- and
row-parallel linears with TP-sharded A/B; the base is frozen, the optimizer and DDP see the adapter only, the
published version (gathered or per holder) is the adapter, the reference policy is the base with the adapter off (no
second model) and a checkpoint holds the adapter and its optimizer state (a checkpoint of the other kind is refused).

Differences from the torch backend (documented, by design): Megatron's optimizer applies no weight decay to
norms and biases (identical when ``weight_decay=0``, the project default); with ``bf16`` the numbers differ by
bf16 rounding.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_bridge import compat, driver, parallel
from rlboost_hpc.config import ConfigError
from megatron_bridge.arch import (ModelArch, arch_from_hf, build_gpt_model, check_layout, load_hf_config,
                                 transformer_config)
from megatron_bridge.bridge import Piece, SafetensorsSource, assemble, hf_to_megatron, megatron_to_pieces
from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions, finish_stats, grpo_loss, merge_stats, stats_to_floats
from rlboost_hpc.trainer.backends.base import (Sample, StepAccumulator, TrainerBackend, behaviour_tensor,
                                              staleness_tensor, truncated_tensor)
from rlboost_hpc.trainer.backends.torch_backend import pack

log = logging.getLogger("rlboost.megatron")

__all__ = ["MegatronBackend"]

class MegatronBackend(TrainerBackend):
    """GRPO trainer backend on Megatron-core.

    Args:
        config: HF config of the policy (dict, ``transformers`` config, a ``ModelArch``, or a path to
            ``config.json`` / an HF directory). Llama, Qwen2 and Qwen3 families.
        weights: HF state dict (name → tensor) or a path (HF directory with ``model.safetensors`` / a sharded
            index, or one ``.safetensors`` file). With several ranks prefer a path: each rank reads its shard.
            None: Megatron's random init (``init_method_std`` 0.02, seeded) — for benchmarks.
        lr, weight_decay, grad_clip, clip_eps, kl_coef, temperature, keep_reference, objective: as
            ``TorchBackend`` (``objective``, when given, replaces ``clip_eps`` and ``kl_coef``).
        tp, pp: tensor/pipeline parallel sizes (default: the layout ``megatron_bridge.launch`` initialised, else
            1). DP is what remains of the world.
        micro_batch_size: sequences per Megatron micro-batch inside one :meth:`accumulate` call (None: the
            whole per-replica batch when pp == 1, else enough micro-batches to fill the pipeline, 2·pp).
        bf16: bf16 parameters and activations (fp32 main params, grads reduced in fp32).
        distributed_optimizer: shard optimizer state across DP (Megatron's ``DistributedOptimizer``).
        recompute: activation recompute: None, ``"full"`` or ``"selective"``.
        seed: Megatron model-parallel RNG seed.
        shard_export: start one ``WeightServer`` per holder rank for :meth:`publish_shards`.
        shard_bind: ZeroMQ bind address of those servers (port 0 = free port). shard_advertise_host: host name
            written into the manifest instead of the bound address (multi-node).
        shard_dtype: dtype of published shards (bf16). shard_replicas: also publish from DP ranks > 0 (more
            holders to pull from in parallel). shard_keys: the run's CURVE ``RunKeys`` (None: plain TCP), so the
            shard servers accept only the run's pullers, like the run's own weight server. shard_sealed: with
            keys, shards travel AES-256-GCM-sealed on a plain port (``weights.sealed``; see ``WeightServer``).
        adam_eps: Adam epsilon (torch default 1e-8).
        lora: train a LoRA adapter (:class:`~rlboost_hpc.trainer.lora.LoraSettings`) instead of every weight.

    Raises:
        UnsupportedArchitecture: the HF config or the TP/PP split is not supported (the message says why).
    """

    def __init__(self, config: Any, weights: Mapping[str, torch.Tensor] | str | os.PathLike | None, *, lr: float,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, clip_eps: float = 0.2, kl_coef: float = 0.0,
                 temperature: float = 1.0, keep_reference: bool = True, tp: int | None = None,
                 pp: int | None = None, micro_batch_size: int | None = None, bf16: bool = False,
                 distributed_optimizer: bool = False, recompute: str | None = None, seed: int = 1234,
                 shard_export: bool = False, shard_bind: str = "tcp://127.0.0.1:0",
                 shard_advertise_host: str | None = None, shard_dtype: torch.dtype = torch.bfloat16,
                 shard_replicas: bool = False, shard_keys: Any = None, shard_sealed: bool = True,
                 adam_eps: float = 1e-8, objective: GRPOOptions | None = None, lora: Any = None,
                 _bid: int | None = None) -> None:
        objective = objective or GRPOOptions(clip_eps=clip_eps, kl_coef=kl_coef)
        clip_eps, kl_coef = objective.clip_eps, objective.kl_coef
        hf_cfg = load_hf_config(config)
        if isinstance(weights, os.PathLike):
            weights = str(weights)
        launched = parallel.layout() if parallel.is_initialized() else None
        tp = int(tp if tp is not None else launched.tp if launched else 1)
        pp = int(pp if pp is not None else launched.pp if launched else 1)
        kwargs = dict(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, clip_eps=clip_eps, kl_coef=kl_coef,
                      temperature=temperature, keep_reference=keep_reference, tp=tp, pp=pp,
                      micro_batch_size=micro_batch_size, bf16=bf16, distributed_optimizer=distributed_optimizer,
                      recompute=recompute, seed=seed, shard_export=shard_export, shard_bind=shard_bind,
                      shard_advertise_host=shard_advertise_host, shard_dtype=shard_dtype,
                      shard_replicas=shard_replicas, shard_keys=shard_keys, shard_sealed=shard_sealed,
                      adam_eps=adam_eps, objective=objective, lora=lora)
        if lora is not None and lora.dropout > 0 and tp > 1:
            raise ConfigError(f"trainer.lora.dropout = {lora.dropout} with trainer.megatron.tp = {tp}: the Megatron "
                              "backend applies LoRA dropout at TP = 1 only (the replicated input's masks would have to "
                              "agree across TP ranks); set trainer.lora.dropout = 0 or tp = 1")
        self.lora_settings = lora
        self.layout = parallel.initialize(tp, pp, seed=seed)
        if _bid is None:
            _bid = driver.new_id()
            driver.announce_new(f"{type(self).__module__}.{type(self).__qualname__}", _bid, (hf_cfg, weights),
                                kwargs)
        self._bid = _bid
        self.hf_config = hf_cfg
        self.arch: ModelArch = arch_from_hf(hf_cfg)
        check_layout(self.arch, tp, pp)
        L = self.layout
        log.info("Megatron backend: world %d = TP %d x PP %d x DP %d (this is rank %d)", L.world, L.tp, L.pp,
                 L.world // (L.tp * L.pp), L.rank)
        self.lr, self.grad_clip, self.objective = lr, grad_clip, objective
        self.step = StepAccumulator(objective)
        self.temperature = temperature if temperature > 0 else 1.0
        self.micro_batch_size = micro_batch_size
        self.bf16 = bf16
        self.shard_dtype = shard_dtype
        self._closed = False
        with compat.scope():
            self._build(weights, weight_decay=weight_decay, keep_reference=keep_reference or kl_coef > 0,
                        distributed_optimizer=distributed_optimizer, recompute=recompute, adam_eps=adam_eps)
        self._server = None
        self._shard_export = shard_export
        self._position = f"tp{self.layout.tp_rank}-pp{self.layout.pp_rank}"
        self.gathered_exports = 0  # export_weights() calls that gathered pieces from other ranks
        self.shard_manifest: dict | None = None
        if shard_export:
            self._start_shard_server(shard_bind, shard_advertise_host, shard_replicas, shard_keys, shard_sealed)

    # ------------------------------------------------------------------ construction
    def _build(self, weights, *, weight_decay: float, keep_reference: bool, distributed_optimizer: bool,
               recompute: str | None, adam_eps: float) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        L = self.layout
        arch = self.arch
        self.tconfig = transformer_config(arch, tp=L.tp, pp=L.pp, bf16=self.bf16, recompute=recompute,
                                          init_weights=weights is None)
        local = None
        if weights is not None:
            source = SafetensorsSource(weights) if isinstance(weights, str) else weights
            local = hf_to_megatron(source, arch, tp=L.tp, tp_rank=L.tp_rank, pp=L.pp, pp_rank=L.pp_rank)

        def make(state: Mapping[str, torch.Tensor] | None) -> torch.nn.Module:
            m = build_gpt_model(arch, self.tconfig, pre_process=L.first_stage, post_process=L.last_stage, tp=L.tp)
            if state is not None:
                missing, unexpected = m.load_state_dict(state, strict=False)
                missing = [k for k in missing if not k.endswith("_extra_state")]
                if missing or unexpected:
                    raise RuntimeError(f"weight bridge mismatch: missing {missing}, unexpected {unexpected}")
            if self.bf16:
                m = Float16Module(self.tconfig, m)
            return m

        policy = make(local)
        if local is None:  # random init: the reference starts as an exact copy of the policy
            local = {k: v for k, v in self._unwrap(policy).state_dict().items() if not k.endswith("_extra_state")}
        self.ref = None
        self.lora = None
        if self.lora_settings is not None:  # the adapter in the policy; the reference is the base, adapter off
            from megatron_bridge.lora import MegatronLora

            gpt, lo = self._unwrap(policy), self.lora_settings
            self.lora = MegatronLora(gpt, arch, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                                     targets=lo.targets, init=lo.init, tp=L.tp, tp_rank=L.tp_rank, pp=L.pp,
                                     pp_rank=L.pp_rank, dtype=next(gpt.parameters()).dtype)
            gpt.lora = self.lora
            keep_reference = False
        if keep_reference:
            self.ref = make(local).eval().requires_grad_(False)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=distributed_optimizer)
        self.ddp = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_cfg, module=policy)
        self.ddp.train()
        self.gpt = self._unwrap(self.ddp)
        ocfg = OptimizerConfig(optimizer="adam", lr=self.lr, min_lr=self.lr, weight_decay=weight_decay,
                               adam_beta1=0.9, adam_beta2=0.999, adam_eps=adam_eps, clip_grad=self.grad_clip,
                               bf16=self.bf16, params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                               use_distributed_optimizer=distributed_optimizer)
        self.opt = get_megatron_optimizer(ocfg, [self.ddp])
        self.tconfig.grad_scale_func = self.opt.scale_loss
        self.tconfig.finalize_model_grads_func = None  # grads are finalised once per RL step, in optimizer_step
        # Pieces are views of the live parameters (updated in place by every step): computed once.
        params = {n: p.data for n, p in self.gpt.named_parameters()}
        self.pieces: list[Piece] = self.lora.pieces() if self.lora is not None else megatron_to_pieces(
            params, arch, tp=L.tp, tp_rank=L.tp_rank, pp=L.pp, pp_rank=L.pp_rank)

    @staticmethod
    def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
        while hasattr(m, "module"):
            m = m.module
        return m

    # ------------------------------------------------------------------ batches
    def _replica_share(self, batch: list[Sample]) -> list[int]:
        L = self.layout
        return list(range(L.dp_rank, len(batch), L.dp))

    def _micro_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        n = len(samples)
        if n == 0:
            return []
        mbs = self.micro_batch_size
        if mbs is None:
            mbs = n if self.layout.pp == 1 else max(1, math.ceil(n / (2 * self.layout.pp)))
        return [samples[i : i + mbs] for i in range(0, n, mbs)]

    @staticmethod
    def _tensors(samples: list[Sample], mode: str, extra: dict | None = None) -> dict[str, Any]:
        ids, _att, rmask, plens = pack(samples)
        B, T = ids.shape
        labels = torch.zeros_like(ids)
        labels[:, :-1] = ids[:, 1:]
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[:, :-1] = rmask
        mb: dict[str, Any] = {"mode": mode, "ids": ids, "labels": labels, "mask": mask, "plens": plens,
                              "ntok": int(rmask.sum()),
                              "rlens": [len(s.response_ids) for s in samples],
                              "pos": torch.arange(T).unsqueeze(0).expand(B, T)}
        if mode == "train":
            mb["adv"] = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
            mb["beh"] = torch.zeros(B, T, dtype=torch.float32)
            mb["beh"][:, :-1] = behaviour_tensor(samples, (B, T - 1))
            mb["trunc"] = truncated_tensor(samples)
            stale = staleness_tensor(samples, (B, T - 1))
            if stale is not None:  # bounded staleness: the mismatch per staleness
                mb["stale"] = torch.zeros(B, T, dtype=torch.int64)
                mb["stale"][:, :-1] = stale
        if extra:
            mb.update(extra)
        return mb

    def _device(self, mb: dict[str, Any]) -> dict[str, Any]:
        dev = compat.cpu_device()
        if dev.type == "cpu":
            return mb
        return {k: (v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}

    # ------------------------------------------------------------------ schedule plumbing
    def _token_logp(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[B, T] fp32 log π(label_t | ·) from vocab-parallel logits [B, T, V/tp] (no vocab gather)."""
        from megatron.core import tensor_parallel

        x = logits.float()
        Vl = x.shape[-1]
        lo = self.layout.tp_rank * Vl
        if lo + Vl > self.arch.vocab_size:  # padded vocabulary rows: never predicted
            pad = torch.arange(lo, lo + Vl, device=x.device) >= self.arch.vocab_size
            x = x.masked_fill(pad, float("-inf"))
        x = x / self.temperature  # a new tensor: vocab_parallel_cross_entropy works in place
        return -tensor_parallel.vocab_parallel_cross_entropy(x, labels)

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        out = model(input_ids=mb["ids"], position_ids=mb["pos"], attention_mask=None)
        return out, partial(self._loss_func, mb)

    def _loss_func(self, mb: dict[str, Any], logits: torch.Tensor):
        mode = mb["mode"]
        if mode == "logits":
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            full = gather_from_tensor_model_parallel_region(logits.float())[..., : self.arch.vocab_size]
            return torch.zeros((), device=logits.device), torch.tensor(0, dtype=torch.int), \
                {"logits": full.detach().cpu()}
        logp = self._token_logp(logits, mb["labels"])
        mask = mb["mask"]
        ntok = mb["ntok"]
        if mode == "logp":
            host = logp.detach().float().cpu()  # one device→host copy, then slices
            rows = [host[i, p - 1 : p - 1 + r].clone() for i, (p, r) in enumerate(zip(mb["plens"], mb["rlens"]))]
            return torch.zeros((), device=logits.device), torch.tensor(ntok, dtype=torch.int), {"logp": rows}
        old = logp.detach()
        loss_sum, st = grpo_loss(logp, old, mb["adv"], mask, self.objective, ref_logp=mb.get("ref"),
                                 behaviour_logp=mb["beh"], truncated=mb["trunc"], staleness=mb.get("stale"))
        loss = loss_sum / mb["responses_in_step"]
        return loss, torch.tensor(ntok, dtype=torch.int), stats_to_floats(st)  # one device→host transfer

    def _run(self, chunks: list[torch.nn.Module], mbs: list[dict[str, Any]], forward_only: bool) -> list[dict]:
        """One schedule call over ``mbs`` (this replica's micro-batches); the loss dicts on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            return []
        fb = get_forward_backward_func()
        T = max(int(mb["ids"].shape[1]) for mb in mbs)
        B = max(int(mb["ids"].shape[0]) for mb in mbs)
        ctx = torch.no_grad() if forward_only else torch.enable_grad()
        with ctx:
            return fb(forward_step_func=self._forward_step, data_iterator=iter([self._device(m) for m in mbs]),
                      model=chunks, num_microbatches=len(mbs), seq_length=T, micro_batch_size=B,
                      forward_only=forward_only)

    def _reporter(self) -> bool:
        """This rank holds results for its DP replica (last stage, TP rank 0)."""
        return self.layout.last_stage and self.layout.tp_rank == 0

    def _gather(self, obj: Any) -> list[Any] | None:
        """All ranks call; rank 0 gets the list of every rank's ``obj`` (by global rank), others None."""
        if self.layout.world == 1:
            return [obj]
        out = [None] * self.layout.world if self.layout.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=parallel.control_group())
        return out

    def _replica_results(self, obj: Any) -> list[Any] | None:
        """Rank 0: the reporters' objects ordered by DP rank."""
        got = self._gather((self.layout.dp_rank, obj) if self._reporter() else None)
        if got is None:
            return None
        by_dp = dict(x for x in got if x is not None)
        return [by_dp[d] for d in range(self.layout.dp)]

    def _forward_logp(self, chunks, samples: list[Sample]) -> list[torch.Tensor]:
        """This replica's per-sample response logprobs (on the last stage; [] elsewhere)."""
        outs = self._run(chunks, [self._tensors(mb, "logp") for mb in self._micro_batches(samples)], True)
        return [row for o in outs for row in o["logp"]]

    # ------------------------------------------------------------------ TrainerBackend
    @driver.collective
    def accumulate(self, batch: list[Sample], responses_in_step: int) -> dict[str, float]:
        """See :meth:`TrainerBackend.accumulate`. Collective; metrics on rank 0 (also on the others where they
        were computed)."""
        with compat.scope():
            idx = self._replica_share(batch)
            mine = [batch[i] for i in idx]
            mbs = self._micro_batches(mine)
            datas = []
            for smb in mbs:
                extra = {"responses_in_step": float(responses_in_step)}
                datas.append(self._tensors(smb, "train", extra))
            if self.objective.kl_coef > 0 and mbs:
                with self._reference() as ref:
                    refs = self._run([ref], [self._tensors(smb, "logp") for smb in mbs], True)
                # rebuild [B, T] ref tensors for the last stage (others ignore them)
                for d, o in zip(datas, refs):
                    ref = torch.zeros_like(d["mask"], dtype=torch.float32)
                    for i, (p, row) in enumerate(zip(d["plens"], o["logp"])):
                        ref[i, p - 1 : p - 1 + len(row)] = row
                    d["ref"] = ref
            outs = self._run([self.ddp], datas, False)
            agg: dict[str, float] = {}
            for o in outs:
                agg = merge_stats(agg, o)
            per = self._replica_results(agg if outs or self._reporter() else None)
        self.step.add_batch(batch, responses_in_step)  # every rank: the whole batch's loss tokens
        if per is None:
            return {}
        tot: dict[str, float] = {}
        for a in per:
            tot = merge_stats(tot, a or {})
        self.step.add_stats(tot)
        return {"loss": tot.get("loss_sum", 0.0) / responses_in_step, "tokens": int(tot.get("tokens", 0)),
                **finish_stats(tot)}

    @driver.collective
    def optimizer_step(self) -> dict[str, float]:
        """Finalise grads (DP sum, tied-embedding sync), scale them to the step's normaliser (``token_mean``), clip,
        step, zero. Collective; the step's loss metrics on rank 0."""
        from megatron.core.distributed import finalize_model_grads

        with compat.scope():
            finalize_model_grads([self.ddp])
            scale = self.step.gradient_scale()
            if scale != 1.0:
                self.ddp.scale_gradients(scale)
            ok, grad_norm, _ = self.opt.step()
            self.ddp.zero_grad_buffer()
            self.opt.zero_grad()
        if not ok:  # pragma: no cover - only with fp16 loss scaling
            raise RuntimeError("optimizer step skipped (inf/nan gradients)")
        return {"grad_norm": float(grad_norm if grad_norm is not None else 0.0), "lr": self.lr,
                **self.step.finish()}

    @driver.collective
    def token_logprobs(self, batch: list[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """See :meth:`TrainerBackend.token_logprobs`. Collective; the list on rank 0 ([] elsewhere)."""
        with compat.scope(), (self._reference() if reference else contextlib.nullcontext(self.ddp)) as model:
            idx = self._replica_share(batch)
            rows = self._forward_logp([model], [batch[i] for i in idx])
            per = self._replica_results(rows)
        if per is None:
            return []
        out: list[torch.Tensor | None] = [None] * len(batch)
        for d, rows_d in enumerate(per):
            for i, row in zip(range(d, len(batch), self.layout.dp), rows_d):
                out[i] = row
        return out  # type: ignore[return-value]

    @contextlib.contextmanager
    def _reference(self):
        """The reference policy for the block: the frozen copy, or — LoRA — the policy with the adapter off.

        Raises:
            ValueError: no reference was kept (``keep_reference=False``, no KL term)."""
        if self.lora is not None:
            with self.lora.disabled():
                yield self.ddp
            return
        if self.ref is None:
            raise ValueError("no reference model kept (keep_reference=False)")
        yield self.ref

    @driver.collective
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits ``[B, T, V]`` of the policy for unpadded ``input_ids`` (DP replica 0
        computes). Collective; result on rank 0 (None elsewhere). A debugging/monitoring path."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        B, T = ids.shape
        with compat.scope():
            outs = []
            if self.layout.dp_rank == 0:
                mb = {"mode": "logits", "ids": ids, "pos": torch.arange(T).unsqueeze(0).expand(B, T)}
                outs = self._run([self.ddp], [mb], True)
            got = self._gather(outs[0]["logits"] if (outs and self._reporter() and self.layout.dp_rank == 0) else None)
        if got is None:
            return None  # type: ignore[return-value]
        return next(x for x in got if x is not None)

    @driver.collective
    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """Full HF-named weights on rank 0 (``{}`` elsewhere), including ``lm_head.weight`` when tied (as the
        torch backend). TP=PP=1: views of the live parameters, except q/k/v (de-interleaved copies).
        Otherwise every model-parallel rank sends its pieces to rank 0 — a gather, so the scalable path is
        :meth:`publish_shards`."""
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} \
            if self.arch.tie_word_embeddings and self.lora is None else None
        self.gathered_exports += self.layout.world > 1
        if self.layout.world == 1:
            return assemble([p.spec() for p in self.pieces], {p.key: p.tensor for p in self.pieces}, aliases=aliases)
        mine = None
        if self.layout.dp_rank == 0:
            mine = [(p.spec(), p.tensor.detach().to("cpu", torch.float32).contiguous()) for p in self.pieces]
        got = self._gather(mine)
        if got is None:
            return {}
        specs, tensors = [], {}
        for lst in got:
            for spec, t in lst or []:
                specs.append(spec)
                tensors[spec["key"]] = t
        return assemble(specs, tensors, aliases=aliases)

    # ------------------------------------------------------------------ sharded export
    def _start_shard_server(self, bind: str, advertise_host: str | None, replicas: bool, keys: Any,
                            sealed: bool = True) -> None:
        from megatron_bridge.export import build_manifest, holder_entry
        from rlboost_hpc.weights.server import WeightServer

        L = self.layout
        holds = bool(self.pieces) and (replicas or L.dp_rank == 0)
        entry = None
        if holds:
            self._server = WeightServer(bind=bind, copy_threads=1, keys=keys, sealed=sealed,
                                        pin_memory=any(p.tensor.is_cuda for p in self.pieces)).start()
            endpoint = self._server.endpoint
            if advertise_host:
                endpoint = endpoint.rsplit(":", 1)
                endpoint = f"tcp://{advertise_host}:{endpoint[1]}"
            entry = holder_entry(L, endpoint, self.pieces, self.shard_dtype)
        got = self._gather(entry)
        if got is not None:
            self.shard_manifest = build_manifest([e for e in got if e is not None], self.arch, self.hf_config,
                                                 self.shard_dtype,
                                                 expected=None if self.lora is None else self.lora.hf_names())

    @driver.collective
    def publish_shards(self, version: int) -> dict[str, Any]:
        """Every holder rank publishes its own pieces (cast to ``shard_dtype``) as ``version`` into its own
        ``WeightServer`` — in parallel, no gather. Collective; on rank 0 returns ``{"publish_s": max over
        holders, "bytes", "update_bytes", "checksum", "per_rank": [{rank, position, seconds, bytes, checksum,
        update_bytes}]}`` (see :meth:`TrainerBackend.publish_shards`).

        Raises:
            RuntimeError: the backend was built without ``shard_export=True``.
        """
        from rlboost_hpc.weights.sharded import version_checksum

        if not self._shard_export:
            raise RuntimeError("publish_shards needs MegatronBackend(..., shard_export=True)")
        stat = None
        if self._server is not None:
            t0 = time.perf_counter()
            with compat.scope():
                man = self._server.publish(version, {p.key: p.tensor for p in self.pieces}, dtype=self.shard_dtype)
            delta = self._server.delta_nbytes(version)
            stat = {"rank": self.layout.rank, "position": self._position, "seconds": time.perf_counter() - t0,
                    "bytes": int(man.total_bytes), "checksum": int(man.checksum),
                    "update_bytes": int(man.total_bytes if delta is None else delta)}
        got = self._gather(stat)
        if got is None:
            return {}
        per = [s for s in got if s is not None]
        first = {s["position"]: s for s in reversed(per)}  # one holder per position (DP replicas are identical)
        return {"publish_s": max((s["seconds"] for s in per), default=0.0), "per_rank": per,
                "bytes": sum(s["bytes"] for s in first.values()),
                "update_bytes": sum(s["update_bytes"] for s in first.values()),
                "checksum": version_checksum({k: s["checksum"] for k, s in first.items()})}

    @driver.collective
    def shard_stats(self) -> list[dict]:
        """Per holder rank: ``{"rank", "position", "bytes_served", "delta_bytes_served", "sealed_bytes_served",
        "chunks_served", "publishes"}`` (rank 0; []
        elsewhere and without shard export). Collective."""
        stat = None
        if self._server is not None:
            st = self._server.stats
            stat = {"rank": self.layout.rank, "position": self._position, "bytes_served": int(st["bytes_served"]),
                    "delta_bytes_served": int(st["delta_bytes_served"]), "chunks_served": int(st["chunks_served"]),
                    "sealed_bytes_served": int(st["sealed_bytes_served"]), "publishes": int(st["publishes"])}
        got = self._gather(stat)
        return [s for s in got if s is not None] if got is not None else []

    # ------------------------------------------------------------------ checkpoints
    @driver.collective
    def save_checkpoint(self, path: str | os.PathLike, extra_state: Mapping[str, Any] | None = None) -> None:
        """Save model, optimizer, RNG states and ``extra_state`` (e.g. the data position) with
        ``dist_checkpointing`` into the directory ``path`` (created). Collective."""
        from megatron_bridge.checkpoint import save

        with compat.scope():
            save(self, Path(path), dict(extra_state or {}))

    @driver.collective
    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote (same TP/PP/DP layout and model); returns ``extra_state``
        (on every rank). The reference policy is not saved: construct the backend with the same initial
        weights before loading. Collective."""
        from megatron_bridge.checkpoint import load

        with compat.scope():
            return load(self, Path(path))

    # ------------------------------------------------------------------ life cycle
    @driver.collective
    def close(self) -> None:
        """Stop the shard server and drop the models. Collective; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
            self._server = None
        self.pieces = []
        self.ddp = self.ref = self.gpt = self.opt = None  # type: ignore[assignment]


def from_run_config(cfg: Any, policy: Any, common: Mapping[str, Any], *, keys: Any = None,
                    advertise_host: str | None = None) -> MegatronBackend:
    """The trainer backend of a run with ``trainer.backend = "megatron"`` (entry point ``megatron`` of the group
    ``rlboost_hpc.trainer_backends``): Megatron-core with ``trainer.megatron``'s layout (the one
    ``megatron_bridge.launch`` initialised; ConfigError when they differ, or when tp × pp > 1 without the launcher)
    and options, initialised from ``policy`` (``hf_config``, ``state_dict``), ``common`` = the algorithm's keyword arguments
    (lr, weight decay, grad clip, clip ε, KL β, temperature). With TP or PP > 1 and ``weights.sharded``, every
    holder rank serves its own weight shards (bound on ``network.bind_host``, advertised as ``advertise_host``,
    CURVE with the run's ``keys``)."""
    t, w, m = cfg.trainer, cfg.weights, cfg.trainer.megatron
    launched = parallel.layout() if parallel.is_initialized() else None
    if launched is not None and (launched.tp, launched.pp) != (m.tp, m.pp):
        raise ConfigError(f"trainer.megatron: tp = {m.tp}, pp = {m.pp}, but the process groups were launched with "
                          f"tp = {launched.tp}, pp = {launched.pp} (python -m megatron_bridge.launch --tp / --pp): "
                          "drop the launcher's flags, or make them agree")
    if launched is None and m.tp * m.pp > 1:
        raise ConfigError(f"trainer.megatron: tp × pp = {m.tp * m.pp} needs as many processes: run under python -m "
                          f"megatron_bridge.launch --nproc-per-node {m.tp * m.pp} -m rlboost_hpc.cli run ...")
    model_parallel = m.tp * m.pp > 1
    shards = dict(shard_export=True, shard_bind=f"tcp://{cfg.network.bind_host}:0", shard_keys=keys,
                  shard_sealed=w.sealed, shard_advertise_host=advertise_host) if w.sharded and model_parallel else {}
    return MegatronBackend(policy.hf_config, policy.state_dict, seed=t.seed, tp=m.tp, pp=m.pp, bf16=m.bf16,
                           distributed_optimizer=m.distributed_optimizer, recompute=m.recompute, **shards, **common)
