"""Flat-buffer layout of one weight version: tensors ⇄ one contiguous host buffer.

Invariants:
- Deterministic: the layout is a pure function of the names, shapes and (cast) dtypes of the state dict;
  tensors are placed in sorted-name order, each at an offset aligned to :data:`ALIGN` bytes, padding
  bytes are zero. Two holders publishing equal state dicts produce byte-identical buffers.
- Views, not copies: :func:`tensor_views` returns tensors that share memory with the buffer; the buffer
  must not be modified while they are in use (holders never modify a published buffer).
"""
from __future__ import annotations

import math
import mmap
from typing import Mapping

import torch

from rlboost_hpc.protocol.weight_msgs import DTYPE_ITEMSIZE, TensorSpec

#: Byte alignment of every tensor in the flat buffer.
ALIGN = 64


def host_buffer(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A new uint8 host buffer of ``nbytes`` bytes (contents undefined).

    Unpinned buffers are anonymous mmaps advised ``MADV_HUGEPAGE`` where the OS offers it: first touch
    then faults 2 MiB pages instead of 4 KiB ones (≈5× faster to fill on a VM), which matters because
    every publish and every pull writes a fresh buffer. The mapping is released when the last tensor
    viewing it is freed. ``pin_memory`` uses torch's pinned allocator instead (needs CUDA).
    """
    if pin_memory or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: 4 KiB pages still work
            pass
    return torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``. Raises ValueError for dtypes the wire format does not carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype {dtype} cannot be transferred (supported: {sorted(DTYPE_ITEMSIZE)})")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``. Raises ValueError for names outside :data:`DTYPE_ITEMSIZE`."""
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unsupported dtype name {name!r}")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dt


def target_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """Dtype a tensor is published in: floating-point tensors are cast to ``dtype`` (when given);
    integer and bool tensors (e.g. buffers of position ids) keep their dtype."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def plan(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[list[TensorSpec], int]:
    """Place every tensor of ``state_dict`` (sorted by name) in a flat buffer.

    Returns:
        (specs, total_bytes): one :class:`TensorSpec` per tensor, in buffer order, and the buffer size
        in bytes (the end of the last tensor; 0 for an empty state dict).

    Raises:
        TypeError: a value is not a tensor. ValueError: a dtype cannot be transferred.
    """
    specs: list[TensorSpec] = []
    offset = 0
    for name in sorted(state_dict):
        t = state_dict[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        dt = target_dtype(t, dtype)
        dname = dtype_name(dt)
        nbytes = math.prod(t.shape) * DTYPE_ITEMSIZE[dname]
        offset = -(-offset // ALIGN) * ALIGN
        specs.append(TensorSpec(name, dname, tuple(int(s) for s in t.shape), offset, nbytes))
        offset += nbytes
    return specs, offset


def flatten_into(
    buffer: torch.Tensor, state_dict: Mapping[str, torch.Tensor], specs: list[TensorSpec]
) -> None:
    """Copy (and cast) every tensor into its place in ``buffer`` (uint8, 1-D, ≥ total_bytes).

    One pass per tensor (cast fused with the copy; a CUDA tensor is copied device→host here).
    Padding bytes are zeroed.
    """
    end = 0
    for s in specs:
        if s.offset > end:
            buffer[end : s.offset].zero_()
        if s.nbytes:
            view = buffer[s.offset : s.offset + s.nbytes].view(dtype_from_name(s.dtype)).view(s.shape)
            view.copy_(state_dict[s.name].detach())
        end = s.offset + s.nbytes
    if buffer.numel() > end:
        buffer[end:].zero_()


def tensor_views(buffer: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` (uint8, 1-D) according to ``specs``, keyed by name, in buffer order.

    Shapes and dtypes are those of the specs; no data is copied.
    """
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        dt = dtype_from_name(s.dtype)
        out[s.name] = buffer[s.offset : s.offset + s.nbytes].view(dt).view(s.shape)
    return out
