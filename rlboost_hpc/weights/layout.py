"""Flat-buffer layout of one weight version: tensors ⇄ one contiguous host buffer.

Invariants:
- Deterministic: the layout is a pure function of the names, shapes and (cast) dtypes of the state dict;
  tensors are placed in sorted-name order, each at an offset aligned to :data:`ALIGN` bytes, padding
  bytes are zero. Two holders publishing equal state dicts produce byte-identical buffers.
- Views, not copies: :func:`tensor_views` returns tensors that share memory with the buffer; the buffer
  must not be modified while they are in use (holders never modify a published buffer).
"""
from __future__ import annotations

import mmap
from typing import Mapping

import numpy as np
import torch

from rlboost_hpc.protocol.weight_msgs import DTYPE_ITEMSIZE, MAX_NDIM, TableArrays, TensorTable, table_arrays

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


def plan(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[TensorTable, int]:
    """Place every tensor of ``state_dict`` (sorted by name) in a flat buffer.

    Per-tensor work is one attribute read each (shape, dtype); sizes and offsets are computed with numpy.

    Returns:
        (table, total_bytes): the :class:`TensorTable` of every tensor, in buffer order, and the buffer size
        in bytes (the end of the last tensor; 0 for an empty state dict).

    Raises:
        TypeError: a value is not a tensor. ValueError: a dtype cannot be transferred, or a tensor has more
        than :data:`~rlboost_hpc.protocol.weight_msgs.MAX_NDIM` dimensions.
    """
    names = sorted(state_dict)
    tensors = [state_dict[k] for k in names]
    for k, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{k!r}] is a {type(t).__name__}, not a torch.Tensor")
    codes: dict[torch.dtype, int] = {}
    index = bytes([codes.setdefault(target_dtype(t, dtype), len(codes)) for t in tensors])
    dtypes = [dtype_name(d) for d in codes]
    shapes = [tuple(t.shape) for t in tensors]
    ndim = [len(s) for s in shapes]
    width = max(ndim, default=0)
    if width > MAX_NDIM:
        raise ValueError(f"a tensor has more than {MAX_NDIM} dimensions")
    rows = np.ones((len(names), width), dtype="<i8")
    for k in set(ndim) - {0}:
        sel = [i for i, d in enumerate(ndim) if d == k]
        rows[sel, :k] = np.array([shapes[i] for i in sel], dtype=np.int64)
    itemsize = np.array([DTYPE_ITEMSIZE[d] for d in dtypes], dtype=np.int64)[np.frombuffer(index, np.uint8)] \
        if names else np.zeros(0, dtype=np.int64)
    nbytes = rows.prod(axis=1) * itemsize
    padded = -(-nbytes // ALIGN) * ALIGN
    offsets = np.zeros(len(names), dtype="<i8")
    np.cumsum(padded[:-1], out=offsets[1:])
    total = int(offsets[-1] + nbytes[-1]) if names else 0
    table = TensorTable(names=names, dtypes=dtypes, dtype_index=index, ndim=bytes(ndim), shapes=rows.tobytes(),
                        offsets=offsets.tobytes())
    return table, total


def _views(buffer: torch.Tensor, table: TensorTable, a: TableArrays) -> list[torch.Tensor]:
    """One tensor per row of ``table`` viewing ``buffer`` (uint8, 1-D): a single ``as_strided`` each, strides and
    element offsets computed with numpy. Expects a table that fits the buffer (``validate_table``)."""
    bases = []
    for name in table.dtypes:
        item = DTYPE_ITEMSIZE[name]
        if buffer.storage_offset() % item:
            raise ValueError(f"a buffer at storage offset {buffer.storage_offset()} cannot hold {name} tensors")
        bases.append(buffer[: buffer.numel() // item * item].view(dtype_from_name(name)))
    rows = a.shapes
    strides = np.ones_like(rows)
    if rows.shape[1] > 1:  # row-major strides; the padding 1s do not change them
        strides[:, :-1] = np.cumprod(rows[:, :0:-1], axis=1)[:, ::-1]
    first = [int(bases[g].storage_offset()) for g in range(len(bases))]
    elem = (a.offsets // np.maximum(a.itemsize, 1)).tolist()
    return [torch.as_strided(bases[g], row[:k], srow[:k], first[g] + off)
            for g, k, row, srow, off in zip(a.dtype_index.tolist(), a.ndim.tolist(), rows.tolist(), strides.tolist(),
                                            elem)]


def _padding(a: TableArrays, total_bytes: int) -> np.ndarray:
    """Byte indices of a ``total_bytes`` buffer that no tensor of ``a`` covers (tensors in ascending,
    non-overlapping order, as :func:`plan` places them)."""
    starts = np.concatenate(([0], a.offsets + a.nbytes))
    lengths = np.concatenate((a.offsets, [total_bytes])) - starts
    if np.any(lengths < 0):
        raise ValueError("tensors overlap or exceed the buffer")
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    return np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(lengths.sum())


def flatten_into(buffer: torch.Tensor, state_dict: Mapping[str, torch.Tensor], table: TensorTable) -> None:
    """Copy (and cast) every tensor into its place in ``buffer`` (uint8, 1-D, ≥ total_bytes); zero the padding.

    Tensors as placed by :func:`plan`. All tensors are copied by one ``torch._foreach_copy_`` (the cast fused
    with the copy; a CUDA tensor is copied device→host) into views made with one ``as_strided`` each, and the
    padding is zeroed by one numpy scatter: per tensor, the Python work is one view, not a copy call.

    Raises:
        ValueError: the table's tensors overlap or exceed the buffer.
    """
    a = table_arrays(table)
    total = int((a.offsets + a.nbytes).max()) if len(table) else 0
    if total > buffer.numel():
        raise ValueError(f"a buffer of {buffer.numel()} bytes cannot hold the table's {total} bytes")
    pad = _padding(a, buffer.numel())
    if len(pad):
        buffer.numpy()[pad] = 0
    copy_tensors(_views(buffer, table, a), [state_dict[k] for k in table.names])


def tensor_views(buffer: torch.Tensor, table: TensorTable) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` (uint8, 1-D) according to ``table``, keyed by name, in buffer order.

    Shapes and dtypes are those of the table; no data is copied. Expects a table that passed
    :func:`~rlboost_hpc.protocol.weight_msgs.validate_table` for this buffer's size.
    """
    return dict(zip(table.names, _views(buffer, table, table_arrays(table))))


def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i (casting; shapes must match), in as few calls as the devices allow:
    one ``torch._foreach_copy_`` — per-tensor cost is C++ dispatch, not Python. Under ``no_grad``, so
    parameters that require grad can be either side.

    Raises:
        ValueError: the lists differ in length. RuntimeError: a shape mismatch (from torch).
    """
    if len(dst) != len(src):
        raise ValueError(f"copy_tensors: {len(dst)} destinations for {len(src)} sources")
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
