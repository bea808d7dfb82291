"""Sharded weight export: every TP/PP rank is a weight holder; a small *assembly manifest* lets pullers build
HF-named tensors from several holders in parallel.

How it plugs into :class:`rlboost_hpc.weights.server.WeightServer` (unchanged):

- one ``WeightServer`` per holder rank (DP rank 0 of each (tp, pp) position; with ``shard_replicas`` every DP
  rank), started by ``MegatronBackend(shard_export=True)``;
- after each optimizer step, :meth:`MegatronBackend.publish_shards` makes each holder call
  ``server.publish(version, {piece.key: piece.tensor}, dtype=bf16)`` *on its own rank, concurrently*. The
  pieces are views of the live Megatron parameters (q/k/v de-interleaving is a strided view), so the only work
  on the critical path is the server's own cast-copy into its host buffer plus checksums, over this rank's
  1/(TP·PP) of the model — no gather, no rank-0 bottleneck;
- the assembly manifest (built once at start-up: shapes never change between versions) lists the holders'
  endpoints and, for every HF tensor, which holder has which slice. The lead puts it where pullers find it
  (e.g. ``endpoints.json`` of the run directory, or the manager's ``TrainerHello``); it is JSON.
- a rollout instance calls :func:`pull_sharded` (one ``WeightPuller`` per holder, all in parallel threads,
  each with its own streams) and gets a full HF state dict — or, with an engine using the same TP split, takes
  the pieces of one holder directly.

Manifest format (``format = "megatron_bridge.shards/1"``)::

    {"format": ..., "dtype": "bfloat16", "arch": {...ModelArch...}, "hf_config": {...},
     "layout": {"tp": 2, "pp": 1, "dp": 1},
     "holders": [{"holder": 0, "rank": 0, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0,
                  "endpoint": "tcp://host:port", "nbytes": 12345, "position": "tp0-pp0"}, ...],
     "pieces": [{"key", "hf_name", "dim", "start", "stop", "slice_shape", "full_shape",
                 "position": "tp0-pp0"}, ...],
     "aliases": {"lm_head.weight": "model.embed_tokens.weight"}}   # tied embeddings

Holders with the same ``position`` publish byte-identical buffers (DP replicas): a puller needs one holder per
position. Invariant: a version is complete only when every position's holder has published it; a puller asks
each holder for the *same* explicit version, so it never mixes versions.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Mapping

import torch

from megatron_bridge.arch import ModelArch, arch_dict
from megatron_bridge.bridge import Piece, assemble, check_tiling

__all__ = ["FORMAT", "holder_entry", "build_manifest", "pull_sharded", "positions", "manifest_nbytes"]

FORMAT = "megatron_bridge.shards/1"


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
                   dtype: torch.dtype) -> dict[str, Any]:
    """The assembly manifest from all holders' :func:`holder_entry` dicts.

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
           "aliases": {"lm_head.weight": "model.embed_tokens.weight"} if arch.tie_word_embeddings else {}}
    names = {p["hf_name"] for p in pieces}
    expected = set(arch.hf_names())
    if names != expected:
        raise ValueError(f"shard manifest does not cover the model: missing {sorted(expected - names)[:5]}, "
                         f"extra {sorted(names - expected)[:5]}")
    try:
        check_tiling(pieces)
    except ValueError as e:
        raise ValueError(f"shard manifest does not cover the model: {e}") from None
    return man


def positions(manifest: Mapping[str, Any]) -> dict[str, list[dict]]:
    """position → the holders publishing it (replicas)."""
    out: dict[str, list[dict]] = {}
    for h in manifest["holders"]:
        out.setdefault(h["position"], []).append(h)
    return out


def manifest_nbytes(manifest: Mapping[str, Any]) -> int:
    """Bytes of one complete version (one holder per position)."""
    return sum(hs[0]["nbytes"] for hs in positions(manifest).values())


def pull_sharded(manifest: Mapping[str, Any], version: int, *, streams: int = 4, window: int = 4,
                 timeout_s: float = 30.0, deadline_s: float | None = None, label: str = "",
                 replica: int = 0, keys: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pull ``version`` from one holder per position, all positions in parallel, and assemble HF tensors.

    Args:
        manifest: the assembly manifest (:func:`build_manifest`).
        version: the weight version to pull (explicit: every holder must serve the same one).
        streams, window, timeout_s, deadline_s, label: per-holder :class:`WeightPuller` settings.
        replica: which DP replica to prefer per position (``replica % len(replicas)``), to spread pullers.
        keys: the run's CURVE ``RunKeys`` when the holders were started with ``shard_keys`` (None: plain TCP).

    Returns:
        ``(state_dict, stats)``: HF name → tensor (dtype as published; single-piece tensors are views of the
        received buffers), and ``{"seconds", "bytes", "per_holder": [{endpoint, seconds, bytes}]}``.

    Raises:
        WeightTransferError: any holder's pull failed (the first failure, naming the holder).
    """
    from rlboost_hpc.weights.puller import WeightPuller

    t0 = time.perf_counter()
    chosen = [hs[replica % len(hs)] for hs in positions(manifest).values()]
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def one(h: dict) -> None:
        try:
            p = WeightPuller(h["endpoint"], streams=streams, window=window, timeout_s=timeout_s,
                             deadline_s=deadline_s, label=label, keys=keys)
            results[h["position"]] = p.pull(version)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(h,), name=f"pull {h['position']}") for h in chosen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    tensors: dict[str, torch.Tensor] = {}
    for pw in results.values():
        tensors.update(pw.state_dict)
    sd = assemble(manifest["pieces"], tensors, aliases=manifest.get("aliases"))
    per = [{"endpoint": h["endpoint"], "seconds": results[h["position"]].seconds,
            "bytes": results[h["position"]].nbytes} for h in chosen]
    return sd, {"seconds": time.perf_counter() - t0, "bytes": sum(x["bytes"] for x in per), "per_holder": per}
