"""megatron_bridge — Hugging Face ⇄ Megatron-core models and weights, and the Megatron trainer backend.

Modules (importing the package imports nothing heavy; Megatron-core is imported on first use):

- :mod:`~megatron_bridge.arch` — HF config (Llama / Qwen2 / Qwen3) → :class:`~rlboost_hpc.models.arch.ModelArch` →
  Megatron ``TransformerConfig`` and ``GPTModel`` (local layer spec), TP/PP split rules.
- :mod:`~megatron_bridge.bridge` — weights both ways for any TP × PP: ``hf_to_megatron`` (one rank's shard,
  lazily from safetensors) and ``megatron_to_pieces`` (this rank's share of the HF tensors as zero-copy views) +
  ``assemble``.
- :mod:`~megatron_bridge.backend` — :class:`~megatron_bridge.backend.MegatronBackend`, the
  ``TrainerBackend`` (GRPO, vocab-parallel logprobs, 1F1B schedule, Megatron optimizer, recompute, sharded
  export, checkpoints).
- :mod:`~megatron_bridge.export` — the sharded-export assembly manifest and ``pull_sharded`` (one
  ``WeightServer`` per holder rank, pulled in parallel).
- :mod:`~megatron_bridge.checkpoint` — ``dist_checkpointing`` save/resume (model, optimizer, RNG, data
  position), atomic.
- :mod:`~megatron_bridge.parallel` / :mod:`~megatron_bridge.driver` / :mod:`~megatron_bridge.launch` —
  process groups, leader/follower execution, the ``torchrun`` launcher (``python -m megatron_bridge.launch``).
- :mod:`~megatron_bridge.compat` — the CPU compatibility layer (a test aid; installed only without CUDA).

Quick use (one process, CPU or one GPU)::

    from megatron_bridge.backend import MegatronBackend
    backend = MegatronBackend(hf_config_or_dir, hf_state_dict_or_dir, lr=3e-5, kl_coef=0.0, temperature=1.0)
    backend.accumulate(samples, responses_in_step); backend.optimizer_step()
    server.publish(version, backend.export_weights(), dtype=torch.bfloat16)

Several processes: ``python -m megatron_bridge.launch --nproc-per-node 8 -m rlboost_hpc.cli run --set trainer.megatron.tp=8 ...``.
"""

__all__ = ["arch", "bridge", "backend", "export", "checkpoint", "parallel", "driver", "launch", "compat"]
