"""Sharded weight export, the trainer's side: every TP/PP rank is a weight holder; :func:`build_manifest` writes
the *assembly manifest* that lets pullers build HF-named tensors from all holders in parallel (the format, the
version checksum and :func:`~rlboost_hpc.weights.sharded.pull_sharded` live in :mod:`rlboost_hpc.weights.sharded`,
since rollout instances pull without Megatron).

- one ``WeightServer`` per holder rank (DP rank 0 of each (tp, pp) position; with ``shard_replicas`` every DP
  rank), started by ``MegatronBackend(shard_export=True)``;
- after each optimizer step, :meth:`MegatronBackend.publish_shards` makes each holder call
  ``server.publish(version, {piece.key: piece.tensor}, dtype=bf16)`` *on its own rank, concurrently*. The
  pieces are views of the live Megatron parameters (q/k/v de-interleaving is a strided view), so the only work
  on the critical path is the server's own cast-copy into its host buffer plus checksums, over this rank's
  1/(TP·PP) of the model — no gather, no rank-0 bottleneck;
- the assembly manifest (built once at start-up: shapes never change between versions) lists the holders'
  endpoints and, for every HF tensor, which holder has which slice; the run hands it to the manager
  (``TrainerHello.weights_shards``), which hands it to every rollout instance.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from megatron_bridge.arch import ModelArch, arch_dict
from megatron_bridge.bridge import Piece
from rlboost_hpc.weights.sharded import FORMAT, check_tiling, manifest_nbytes, positions, pull_sharded  # noqa: F401

__all__ = ["FORMAT", "holder_entry", "build_manifest", "pull_sharded", "positions", "manifest_nbytes"]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def holder_entry(layout, endpoint: str, pieces: list[Piece], dtype: torch.dtype) -> dict[str, Any]:
    """What one holder rank contributes to the manifest (gathered once at start-up)."""
    pos = f"tp{layout.tp_rank}-pp{layout.pp_rank}"
    return {"rank": layout.rank, "tp_rank": layout.tp_rank, "pp_rank": layout.pp_rank, "dp_rank": layout.dp_rank,
            "endpoint": endpoint, "position": pos,
            "nbytes": sum(p.tensor.numel() for p in pieces) * _itemsize(dtype),
            "pieces": [dict(p.spec(), position=pos) for p in pieces]}


def build_manifest(entries: Iterable[Mapping[str, Any]], arch: ModelArch, hf_config: Mapping[str, Any],
                   dtype: torch.dtype, expected: Iterable[str] | None = None) -> dict[str, Any]:
    """The assembly manifest from all holders' :func:`holder_entry` dicts; ``expected``: the HF names a version holds
    (default: every tensor of ``arch``; a LoRA run's adapter names — then no tied-head alias).

    Raises:
        ValueError: the pieces of distinct positions do not tile every HF tensor exactly once.
    """
    entries = sorted(entries, key=lambda e: (e["pp_rank"], e["tp_rank"], e["dp_rank"]))
    holders, pieces, seen = [], [], set()
    tp = max((e["tp_rank"] for e in entries), default=0) + 1
    pp = max((e["pp_rank"] for e in entries), default=0) + 1
    for i, e in enumerate(entries):
        holders.append({k: e[k] for k in ("rank", "tp_rank", "pp_rank", "dp_rank", "endpoint", "position", "nbytes")}
                       | {"holder": i})
        if e["position"] not in seen:
            seen.add(e["position"])
            pieces.extend(e["pieces"])
    man = {"format": FORMAT, "dtype": str(dtype).removeprefix("torch."), "arch": arch_dict(arch),
           "hf_config": dict(hf_config), "layout": {"tp": tp, "pp": pp},
           "holders": holders, "pieces": pieces,
           "aliases": {"lm_head.weight": "model.embed_tokens.weight"}
           if arch.tie_word_embeddings and expected is None else {}}
    names = {p["hf_name"] for p in pieces}
    expected = set(arch.hf_names() if expected is None else expected)
    if names != expected:
        raise ValueError(f"shard manifest does not cover the model: missing {sorted(expected - names)[:5]}, "
                         f"extra {sorted(names - expected)[:5]}")
    try:
        check_tiling(pieces)
    except ValueError as e:
        raise ValueError(f"shard manifest does not cover the model: {e}") from None
    return man


