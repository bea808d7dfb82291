"""The pull's phases that touch no socket, and their result: plan, verify, assemble, and :class:`PulledWeights`.

Owns what a pull does with a version's bytes around the transfer: the plan (:func:`plan`: which buffer the
bytes land in, and whether the holder's delta against the version this process holds applies), the verification
(:func:`verify`: every chunk arrived verified and the whole-version checksum matches the manifest's), the assembly
(:func:`assemble`: the tensors as views of the buffer, or the base's own views when the bytes landed in its
buffer with its layout) and the counters a pull reports (:func:`transfer_phases`). Another kind of weight version
(one that is not a full bf16 state — an adapter applied to a base) changes these steps, not the sockets of
:mod:`rlboost_hpc.weights.pull_streams` nor the order of the phases in
:class:`~rlboost_hpc.weights.puller.WeightPuller`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from rlboost_hpc.protocol.weight_msgs import DeltaInfo, Manifest, combine_checksums
from rlboost_hpc.models import layout
from rlboost_hpc.weights.transfer import Failed as _Failed
from rlboost_hpc.weights.transfer import Transfer as _Transfer


@dataclass
class PulledWeights:
    """One complete, verified weight version.

    version: the version pulled. state_dict: name → tensor (dtypes/shapes as published), all views of one uint8
    buffer of ``nbytes`` bytes — a :class:`~rlboost_hpc.models.layout.FlatState` when every tensor has one dtype
    (views made on first use; an engine whose weights share the layout loads it with one copy). seconds: wall time
    of the whole pull. phases: wall seconds per phase (``manifest_s``, ``transfer_s`` — includes per-chunk
    verification overlapped with receiving, ``verify_s``, ``assemble_s``) plus ``chunk_hash_s`` (summed CPU seconds
    of per-chunk xxh3 over all streams), ``chunk_retries``, ``bytes_received`` (payload bytes over the wire), and
    for a delta pull ``delta_chunks`` / ``unchanged_chunks`` / ``full_chunks``, ``delta_fallbacks`` (delta chunks
    fetched again in full) and ``base_mismatches`` (unchanged chunks whose base bytes no longer matched: fetched in
    full). checksum: the whole-version checksum (equal to the manifest's). buffer: the uint8 buffer
    every tensor views (``nbytes`` long). manifest: the holder's manifest of this version (the layout and chunk
    checksums a later delta pull compares against). delta_payloads: the delta payloads this pull applied and
    verified, by chunk index (what a relay holder serves to pullers holding the same base). With peers, ``phases``
    also has ``peer_bytes`` (payload bytes from peers) and ``peer_failovers``.
    """

    version: int
    state_dict: Mapping[str, torch.Tensor]
    nbytes: int
    seconds: float
    phases: dict[str, float]
    checksum: int
    buffer: torch.Tensor = field(repr=False, default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    manifest: Manifest | None = field(repr=False, default=None)
    delta_payloads: dict[int, bytes] = field(repr=False, default_factory=dict)


def plan(manifest: Manifest, into: torch.Tensor | None, base: PulledWeights | None,
         buffer_factory: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, DeltaInfo | None]:
    """Where the version's bytes go, and the delta that applies: the base's buffer when a delta against it
    applies (turned into the new version in place), else ``into``, else the base's buffer when large enough,
    else a fresh one (``buffer_factory(n)``: n bytes). Raises ValueError when ``into`` is unsuitable (nothing
    transferred yet)."""
    delta = manifest.delta if base is not None and _applies(manifest, base) else None
    if delta is not None:
        return base.buffer[: manifest.total_bytes], delta
    if into is None and base is not None and base.buffer.numel() >= manifest.total_bytes:
        return base.buffer[: manifest.total_bytes], None
    if into is None:
        return buffer_factory(manifest.total_bytes), None
    if (into.dtype != torch.uint8 or into.dim() != 1 or not into.is_contiguous()
            or into.device.type != "cpu" or into.numel() < manifest.total_bytes):
        raise ValueError(f"into must be a contiguous 1-D CPU uint8 tensor of >= {manifest.total_bytes} bytes, "
                         f"got {into.dtype} {tuple(into.shape)} on {into.device}")
    return into[: manifest.total_bytes], None


def _applies(manifest: Manifest, base: PulledWeights) -> bool:
    """True when ``manifest``'s delta was encoded against exactly ``base``: same base version and whole-version
    checksum, same layout and chunking, and a buffer large enough."""
    d, bm = manifest.delta, base.manifest
    return (d is not None and bm is not None and d.base_version == base.version
            and d.base_checksum == base.checksum == bm.checksum and bm.tensors == manifest.tensors
            and bm.chunk_bytes == manifest.chunk_bytes and bm.total_bytes == manifest.total_bytes
            and base.buffer.numel() >= manifest.total_bytes)


def transfer_phases(tr: _Transfer, peers: bool, delta: bool) -> dict[str, float]:
    """The transfer's counters as :attr:`PulledWeights.phases` entries (see its docstring)."""
    out = {"chunk_hash_s": tr.hash_s, "chunk_retries": float(tr.retries), "bytes_received": float(tr.bytes_received),
           "sealed_bytes": float(tr.sealed_bytes)}
    if peers:
        out.update(peer_bytes=float(tr.peer_bytes), peer_failovers=float(tr.failovers))
    if delta:
        unchanged = sum(tr.local)  # verified in place (a spoilt one was fetched in full)
        out.update(unchanged_chunks=float(unchanged), delta_chunks=float(sum(tr.use_delta)),
                   delta_fallbacks=float(tr.delta_fallbacks), base_mismatches=float(tr.base_mismatches),
                   full_chunks=float(tr.n - unchanged - sum(tr.use_delta)))
    return out


def verify(tr: _Transfer, manifest: Manifest) -> None:
    """Every chunk arrived verified and the whole-version checksum matches the manifest's. Raises _Failed."""
    digests = [d for d in tr.digests if d is not None]
    if len(digests) != tr.n:
        raise _Failed(f"{tr.n - len(digests)} chunks missing after transfer")
    if combine_checksums(digests) != manifest.checksum:
        raise _Failed("whole-version checksum mismatch")


def assemble(manifest: Manifest, buffer: torch.Tensor, base: PulledWeights | None) -> Mapping[str, torch.Tensor]:
    """The version's tensors: views of ``buffer`` — the base's own views when the bytes landed in its buffer with
    its layout (made or not yet, they see the new bytes)."""
    if (base is not None and base.manifest is not None and base.manifest.tensors == manifest.tensors
            and base.buffer.data_ptr() == buffer.data_ptr() and len(base.state_dict) == len(manifest.tensors)):
        return base.state_dict if isinstance(base.state_dict, layout.FlatState) else dict(base.state_dict)
    return layout.state_view(buffer, manifest.tensors)
