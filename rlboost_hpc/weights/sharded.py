"""Sharded weight versions: one version served by several holders — the trainer's model-parallel ranks, each with
its own :class:`~rlboost_hpc.weights.server.WeightServer` holding its pieces of the HF tensors — and pulled from
all of them in parallel, then assembled into HF-named tensors.

Assembly manifest (JSON; ``format = "megatron_bridge.shards/1"``, written by the trainer backend once at start-up,
since shapes never change between versions)::

    {"format": ..., "dtype": "bfloat16", "arch": {...}, "hf_config": {...}, "layout": {"tp": 2, "pp": 1},
     "holders": [{"holder": 0, "rank": 0, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0,
                  "endpoint": "tcp://host:port", "nbytes": 12345, "position": "tp0-pp0"}, ...],
     "pieces": [{"key", "hf_name", "dim", "start", "stop", "slice_shape", "full_shape", "position"}, ...],
     "aliases": {"lm_head.weight": "model.embed_tokens.weight"}}   # tied embeddings

Invariants:

- Holders with the same ``position`` publish byte-identical buffers (DP replicas): a puller needs one holder per
  position. A version is complete only when every position's holder has published it; a puller asks each holder
  for the *same explicit* version, and each holder's pull is verified on its own (chunk and whole-version
  checksums), so a sharded pull never mixes versions.
- The version checksum of a sharded version is :func:`version_checksum` of every position's whole-version checksum:
  the trainer announces it and every rollout instance reports it after loading, as for an unsharded version.
- The pieces of distinct positions tile every HF tensor exactly once along one dimension (:func:`check_tiling`).
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Iterable, Mapping

import torch

from rlboost_hpc import defaults as D
from rlboost_hpc.protocol.weight_msgs import combine_checksums
from rlboost_hpc.weights.pull_phases import PulledWeights
from rlboost_hpc.weights.puller import WeightPuller

__all__ = ["FORMAT", "assemble", "check_tiling", "manifest_nbytes", "positions", "pull_sharded", "version_checksum",
           "load_manifest"]

#: Format tag of the assembly manifest.
FORMAT = "megatron_bridge.shards/1"


def load_manifest(text: str) -> dict[str, Any]:
    """The assembly manifest from its JSON text. Raises ValueError (not JSON, wrong format, no holders/pieces)."""
    try:
        man = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"weight shard manifest is not JSON: {e}") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or not man.get("holders") or not man.get("pieces"):
        raise ValueError(f"weight shard manifest: expected format {FORMAT!r} with holders and pieces")
    return man


def version_checksum(by_position: Mapping[str, int]) -> int:
    """The checksum of one sharded version: :func:`~rlboost_hpc.protocol.weight_msgs.combine_checksums` of each
    position's whole-version checksum, positions in sorted order."""
    return combine_checksums([int(by_position[p]) for p in sorted(by_position)])


def positions(manifest: Mapping[str, Any]) -> dict[str, list[dict]]:
    """position → the holders publishing it (replicas)."""
    out: dict[str, list[dict]] = {}
    for h in manifest["holders"]:
        out.setdefault(h["position"], []).append(h)
    return out


def manifest_nbytes(manifest: Mapping[str, Any]) -> int:
    """Bytes of one complete version (one holder per position)."""
    return sum(hs[0]["nbytes"] for hs in positions(manifest).values())


def check_tiling(specs: Iterable[Mapping]) -> dict[str, list[Mapping]]:
    """Group piece specs by HF name (sorted along their split dim) and check that each HF tensor's pieces tile
    it exactly once along one dim.

    Raises:
        ValueError: pieces along several dims, a gap, an overlap, or incomplete coverage (named).
    """
    by_name: dict[str, list[Mapping]] = {}
    for s in specs:
        by_name.setdefault(s["hf_name"], []).append(s)
    for name, ps in by_name.items():
        ps.sort(key=lambda s: (s["dim"], s["start"]))
        full = tuple(ps[0]["full_shape"])
        dims = {s["dim"] for s in ps}
        if len(dims) != 1:
            raise ValueError(f"{name}: pieces split along several dims {sorted(dims)}")
        dim = dims.pop()
        pos = 0
        for s in ps:
            if s["start"] != pos:
                raise ValueError(f"{name}: pieces do not tile dim {dim} (gap/overlap at {pos}, next starts at "
                                 f"{s['start']})")
            pos = s["stop"]
        if pos != full[dim]:
            raise ValueError(f"{name}: pieces cover {pos} of {full[dim]} along dim {dim}")
    return by_name


def assemble(specs: Iterable[Mapping], tensors: Mapping[str, torch.Tensor], *,
             aliases: Mapping[str, str] | None = None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named full tensors from pieces.

    Args:
        specs: :meth:`Piece.spec` dicts (from any number of holders) covering every HF tensor exactly once.
        tensors: piece key → received tensor (any shape with the slice's element count).
        aliases: extra HF names that are copies of another (e.g. ``lm_head.weight`` → embedding when tied);
            they share the tensor.
        dtype: cast to this dtype (None keeps the received one).

    A tensor covered by a single piece is returned as a reshaped view of the received tensor (no copy).

    Raises:
        ValueError: a tensor is not covered exactly (gaps or overlaps), or a piece has the wrong size.
    """
    by_name = check_tiling(specs)
    out: dict[str, torch.Tensor] = {}
    for name, ps in by_name.items():
        dim = ps[0]["dim"]
        parts = []
        for s in ps:
            t = tensors[s["key"]]
            if t.numel() != math.prod(s["slice_shape"]):
                raise ValueError(f"{name}: piece {s['key']} has {t.numel()} elements, expected "
                                 f"{math.prod(s['slice_shape'])}")
            parts.append(t.reshape(s["slice_shape"]))
        if len(parts) == 1:
            full_t = parts[0]
        else:
            full_t = torch.cat(parts, dim=dim)
        out[name] = full_t if dtype is None else full_t.to(dtype)
    for alias, target in (aliases or {}).items():
        out[alias] = out[target]
    return out


def pull_sharded(manifest: Mapping[str, Any], version: int, *, streams: int = D.WEIGHT_STREAMS, window: int = D.WEIGHT_WINDOW,
                 timeout_s: float = D.PULL_TIMEOUT_S, deadline_s: float | None = None, label: str = "",
                 replica: int = 0, keys: Any = None,
                 bases: "Mapping[str, PulledWeights] | None" = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pull ``version`` from one holder per position, all positions in parallel, and assemble HF tensors.

    Args:
        manifest: the assembly manifest (see the module docstring).
        version: the weight version to pull (explicit: every holder must serve the same one).
        streams, window, timeout_s, deadline_s, label: per-holder :class:`WeightPuller` settings.
        replica: which DP replica to prefer per position (``replica % len(replicas)``), to spread pullers.
        keys: the run's CURVE ``RunKeys`` when the holders were started with it (None: plain TCP).
        bases: position → the :class:`PulledWeights` of that position this process pulled before (``stats
            ["pulled"]`` of the previous call); each is *consumed* as :meth:`WeightPuller.pull`'s ``base`` (a delta
            against it, or its buffer reused).

    Returns:
        ``(state_dict, stats)``: HF name → tensor (dtype as published; single-piece tensors are views of the
        received buffers), and ``{"seconds", "bytes", "bytes_received", "checksum" (:func:`version_checksum`),
        "pulled" (position → PulledWeights), "per_holder": [{endpoint, position, seconds, bytes}]}``.

    Raises:
        WeightTransferError: any holder's pull failed (the first failure, naming the holder).
    """
    t0 = time.perf_counter()
    chosen = [hs[replica % len(hs)] for hs in positions(manifest).values()]
    results: dict[str, PulledWeights] = {}
    errors: list[BaseException] = []

    def one(h: dict) -> None:
        try:
            p = WeightPuller(h["endpoint"], streams=streams, window=window, timeout_s=timeout_s,
                             deadline_s=deadline_s, label=label, keys=keys)
            results[h["position"]] = p.pull(version, base=(bases or {}).get(h["position"]))
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
    per = [{"endpoint": h["endpoint"], "position": h["position"], "seconds": results[h["position"]].seconds,
            "bytes": results[h["position"]].nbytes} for h in chosen]
    return sd, {"seconds": time.perf_counter() - t0, "bytes": sum(x["bytes"] for x in per),
                "bytes_received": int(sum(pw.phases.get("bytes_received", pw.nbytes) for pw in results.values())),
                "checksum": version_checksum({k: pw.checksum for k, pw in results.items()}),
                "pulled": results, "per_holder": per}
