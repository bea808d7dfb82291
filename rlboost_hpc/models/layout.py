"""Flat-buffer layout of one weight version: tensors ⇄ one contiguous host buffer.

Invariants:
- Deterministic: the layout is a pure function of the names, shapes and (cast) dtypes of the state dict;
  tensors are placed in sorted-name order, each at an offset aligned to :data:`ALIGN` bytes, padding
  bytes are zero. Two holders publishing equal state dicts produce byte-identical buffers.
- Views, not copies: :func:`tensor_views` returns tensors that share memory with the buffer; the buffer
  must not be modified while they are in use (holders never modify a published buffer).
- Cost per byte, not per tensor: a :class:`FlatState` keeps a whole state dict in one 1-D tensor laid out
  element for element like its wire buffer, so publishing it is one cast-copy, loading it one copy, and
  neither touches a tensor individually (the trainer's master weights and the rollout engine's weights live
  in one; a pulled version is one).
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
import threading
from typing import Iterator, Mapping, Protocol

import numpy as np
import torch

from rlboost_hpc.protocol.weight_msgs import DTYPE_ITEMSIZE, MAX_NDIM, TableArrays, TensorTable, table_arrays

#: Byte alignment of every tensor in the flat buffer.
ALIGN = 64
_HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels


def host_buffer(nbytes: int) -> torch.Tensor:
    """A new uint8 host buffer of ``nbytes`` bytes (contents undefined).

    Buffers are anonymous mmaps advised ``MADV_HUGEPAGE`` where the OS offers it: first touch then faults
    2 MiB pages instead of 4 KiB ones (≈5× faster to fill on a VM), which matters because every publish and
    every pull writes a fresh buffer. From 2 MiB up the mapping is rounded up to whole 2 MiB pages (the kernel
    then aligns it to them, and the tail is not left in 4 KiB pages: 2.4× faster to fill at 4.3 MiB); at most
    2 MiB more is mapped. The mapping is released when the last tensor viewing it is freed.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(_map(nbytes), dtype=torch.uint8)[:nbytes]  # holds a reference to the mapping


def _map(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of at least ``nbytes`` (> 0) bytes, as :func:`host_buffer` describes."""
    mapped = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE if nbytes >= _HUGE_PAGE else nbytes
    region = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: 4 KiB pages still work
            pass
    return region


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_retained = 0  # M_TRIM_THRESHOLD this process set (0: not yet); only ever raised
_retained_lock = threading.Lock()


def retain_frame_buffers(frame_bytes: int, frames_in_flight: int) -> bool:
    """Keep the memory of large message frames mapped between transfers (glibc ``mallopt``; no-op elsewhere).

    libzmq receives every frame larger than its batch buffer into a fresh ``malloc`` of the frame's size in an
    I/O thread, and the receiver frees it after copying the payload out (a holder sealing chunks likewise
    allocates each sealed frame and frees it once sent). glibc adapts its thresholds to the
    largest chunk freed so far: after 4 MiB frames it keeps them on the heap but trims any free top above 8 MiB,
    so the ``frames_in_flight`` frames of each pull's window were unmapped when the pull drained and faulted
    back in, page by page, at the next one (4,055 minor faults per 64 MiB pull of 4 MiB chunks, ~20 % of its
    wall time). This pins the thresholds where glibc's own adaptation converges once a 32 MiB chunk has been
    freed — ``M_MMAP_THRESHOLD`` 32 MiB, ``M_TRIM_THRESHOLD`` ≥ 64 MiB and ≥ 2 × ``frame_bytes`` ×
    ``frames_in_flight`` — so frames of up to 32 MiB come from heap memory that stays faulted in. Process-wide:
    at most the peak of frames in flight (plus what other code freed) stays mapped per malloc arena instead of
    going back to the OS. Thresholds are only ever raised. Returns True when they were set now.
    """
    global _retained
    if frame_bytes >= _MMAP_THRESHOLD_MAX or not sys.platform.startswith("linux"):
        return False  # such frames are mmapped whatever the threshold
    trim = max(2 * _MMAP_THRESHOLD_MAX, 2 * frame_bytes * max(1, frames_in_flight))
    with _retained_lock:
        if trim <= _retained:
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc
            _retained = sys.maxsize
            return False
        if not mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) or not mallopt(_M_TRIM_THRESHOLD, trim):
            _retained = sys.maxsize  # refused: do not try on every pull
            return False
        _retained = trim
    return True


class HostPinner(Protocol):
    """Page-locks host memory for device copies: ``pin(address, nbytes)`` → True when the range is now pinned
    (False: it stays pageable); ``unpin(address)`` undoes a successful ``pin`` and must come before the memory is
    unmapped."""

    def pin(self, address: int, nbytes: int) -> bool: ...
    def unpin(self, address: int) -> None: ...


class CudaHostPinner:
    """:class:`HostPinner` through CUDA's ``cudaHostRegister`` / ``cudaHostUnregister`` (torch's ``cudart``
    bindings): an existing mapping becomes pinned memory that device-to-host copies write at the link's rate
    (a pageable destination goes through the driver's staging buffer). Registration is paid once per mapping —
    a pool reuses it for every later version. Unlike ``torch.empty(pin_memory=True)`` (torch's caching host
    allocator, which rounds every block up to a power of two: up to 2× the host memory for a model's version),
    the buffer keeps the pool's size and huge pages."""

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()

    def pin(self, address: int, nbytes: int) -> bool:
        # cudaHostRegisterPortable (1): pinned for every CUDA context of the process, not only the current one
        return int(self._cudart.cudaHostRegister(address, nbytes, 1)) == 0

    def unpin(self, address: int) -> None:
        self._cudart.cudaHostUnregister(address)


@dataclasses.dataclass(eq=False)
class _Region:
    mapping: mmap.mmap
    address: int = 0  # where a pinner pinned it; 0: pageable

    def free(self) -> bool:
        """Nothing but the pool views the mapping (this record's reference and getrefcount's argument)."""
        return sys.getrefcount(self.mapping) == 2


class HostBufferPool:
    """Host buffers (as :func:`host_buffer` makes them) that are used again once nothing views them.

    A fresh buffer costs its page faults on first touch — on a VM 2–6× the copy that fills it, and when the
    kernel must compact memory for huge pages, 10× (measured: 256 MiB publishes of 70 ms with spikes to 700 ms,
    vs 32 ms for the cast into a buffer already touched). The pool remembers the mappings it handed out; a
    mapping is free again when no tensor, array or memoryview made from it is alive — every view keeps the
    tensor's storage, and the storage keeps its reference to the mapping, so "free" is the mapping's reference
    count falling back to the pool's own. Nothing still viewing a buffer is ever handed out again.

    With a ``pinner`` every mapping is pinned once when made, stays pinned while the pool reuses it, and is
    unpinned before the pool lets it go — a mapping forgotten while still viewed waits in the pool until it is
    free, then is unpinned and released. A mapping the pinner refuses stays pageable (counted in
    :attr:`pin_failures`; the buffer works the same, only device copies into it are slower).

    Args:
        keep: mappings remembered at most (≥ 1); beyond it free ones are released first, then the oldest are
            forgotten (released by the last view that goes).
        pin_memory: pin every mapping through CUDA (:class:`CudaHostPinner`; needs CUDA).
        pinner: the :class:`HostPinner` to use instead (implies pinning).
    """

    def __init__(self, keep: int, pin_memory: bool = False, pinner: HostPinner | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = int(keep)
        self._pinner = pinner if pinner is not None else (CudaHostPinner() if pin_memory else None)
        self._regions: list[_Region] = []
        self._retiring: list[_Region] = []  # pinned, forgotten while still viewed: unpinned once free
        self._lock = threading.Lock()
        #: Buffers handed out again (``reused``), mappings made (``mapped``), pinned (``pinned``) and left
        #: pageable because the pinner refused them (``pin_failures``).
        self.reused = 0
        self.mapped = 0
        self.pinned = 0
        self.pin_failures = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` bytes (contents undefined): a free remembered mapping of at least
        ``nbytes`` and at most twice that (plus a huge page), else a new one (pinned when the pool pins)."""
        if nbytes == 0:
            return host_buffer(0)
        with self._lock:
            retiring, self._retiring = self._retiring, []
            for r in retiring:
                self._let_go(r)
            region = None
            for i, r in enumerate(self._regions):
                if r.free() and nbytes <= len(r.mapping) <= 2 * nbytes + _HUGE_PAGE:
                    region = self._regions.pop(i)
                    self.reused += 1
                    break
            if region is None:
                region = self._new_region(nbytes)
            self._regions.append(region)  # most recently used last
            while len(self._regions) > self.keep:
                free = [i for i in range(len(self._regions) - 1) if self._regions[i].free()]
                self._let_go(self._regions.pop(free[0] if free else 0))
            return torch.frombuffer(region.mapping, dtype=torch.uint8)[:nbytes]

    def _new_region(self, nbytes: int) -> _Region:
        region = _Region(_map(nbytes))
        self.mapped += 1
        if self._pinner is not None:
            address = torch.frombuffer(region.mapping, dtype=torch.uint8).data_ptr()
            if self._pinner.pin(address, len(region.mapping)):
                region.address = address
                self.pinned += 1
            else:
                self.pin_failures += 1
        return region

    def _let_go(self, region: _Region) -> None:
        """Drop the pool's reference to ``region``, unpinning it first; a pinned region still viewed is kept
        (in ``_retiring``) until it is free — pinned memory must be unpinned before it is unmapped."""
        if region.address:
            if not region.free():
                self._retiring.append(region)
                return
            self._pinner.unpin(region.address)
            region.address = 0


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

    Per-tensor work is one attribute read each (shape, dtype); sizes and offsets are computed with numpy. A
    :class:`FlatState` packed for this wire dtype returns its own table (no per-tensor work).

    Returns:
        (table, total_bytes): the :class:`TensorTable` of every tensor, in buffer order, and the buffer size
        in bytes (the end of the last tensor; 0 for an empty state dict).

    Raises:
        TypeError: a value is not a tensor. ValueError: a dtype cannot be transferred, or a tensor has more
        than :data:`~rlboost_hpc.protocol.weight_msgs.MAX_NDIM` dimensions.
    """
    if isinstance(state_dict, FlatState) and state_dict.wire_dtype == target_dtype(state_dict.flat, dtype):
        return state_dict.table, state_dict.nbytes  # placed once, when it was packed
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
    """One tensor per row of ``table`` viewing ``buffer`` (uint8, 1-D). Expects a table that fits the buffer
    (``validate_table``)."""
    bases = []
    for name in table.dtypes:
        item = DTYPE_ITEMSIZE[name]
        if buffer.storage_offset() % item:
            raise ValueError(f"a buffer at storage offset {buffer.storage_offset()} cannot hold {name} tensors")
        bases.append(buffer[: buffer.numel() // item * item].view(dtype_from_name(name)))
    return _strided(bases, a)


def _strided(bases: list[torch.Tensor], a: TableArrays) -> list[torch.Tensor]:
    """Row i of ``a`` as a view of ``bases[dtype_index[i]]`` (1-D) at element ``offsets[i] // itemsize[i]``: a
    single ``as_strided`` each, strides and element offsets computed with numpy."""
    rows = a.shapes
    strides = np.ones_like(rows)
    if rows.shape[1] > 1:  # row-major strides; the padding 1s do not change them
        strides[:, :-1] = np.cumprod(rows[:, :0:-1], axis=1)[:, ::-1]
    first = [int(b.storage_offset()) for b in bases]
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

    Tensors as placed by :func:`plan`. A :class:`FlatState` laid out as ``table`` is one cast-copy of its flat
    tensor (its padding is zero already). Otherwise all tensors are copied by one ``torch._foreach_copy_`` (the
    cast fused with the copy; a CUDA tensor is copied device→host) into views made with one ``as_strided`` each,
    and the padding is zeroed by one numpy scatter: per tensor, the Python work is one view, not a copy call.

    Raises:
        ValueError: the table's tensors overlap or exceed the buffer.
    """
    if isinstance(state_dict, FlatState) and state_dict.table == table:
        state_dict.cast_into(buffer)
        return
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


def state_view(buffer: torch.Tensor, table: TensorTable) -> "Mapping[str, torch.Tensor]":
    """The tensors of a wire buffer (uint8, 1-D) laid out as ``table``: a :class:`FlatState` over the buffer
    when the table has one dtype (views made on first use), else :func:`tensor_views`. Shares memory with
    ``buffer``. Expects a table that passed ``validate_table`` for this buffer's size."""
    if len(table.dtypes) != 1:
        return tensor_views(buffer, table)
    a = table_arrays(table)
    total = int((a.offsets + a.nbytes).max())
    return FlatState(table, buffer[:total].view(dtype_from_name(table.dtypes[0])))


class FlatState(Mapping[str, torch.Tensor]):
    """A state dict whose tensors all view one flat 1-D tensor laid out element for element like their wire buffer.

    ``table`` is a single-dtype wire layout (as :func:`plan` places the tensors for the wire dtype
    :attr:`wire_dtype`); ``flat`` has ``nbytes // itemsize(wire_dtype)`` elements of any dtype, on any device,
    element i standing for wire element i. So the wire buffer is ``flat`` cast to the wire dtype — publishing
    is one cast-copy (:meth:`cast_into`), loading a pulled version into a model whose weights live in an equal
    layout is one copy (:meth:`copy_from`) — whatever the number of tensors (an MoE layer list has ~10⁴).

    Invariant: ``flat``'s padding elements (those no tensor covers) are zero, so the cast is the exact wire
    buffer :func:`flatten_into` would write. Views of tensors never reach the padding; nothing else may write
    ``flat``. A tensor view is made on first access (all at once, one ``as_strided`` each).

    Build one with :meth:`pack` (copies a state dict into a new flat tensor; :meth:`adopt` then makes a
    model's parameters live in it) or over a pulled buffer with :func:`state_view`.

    Raises:
        ValueError: (constructor) the table has more than one dtype, or ``flat`` is not a contiguous 1-D tensor
            of the table's length.
    """

    def __init__(self, table: TensorTable, flat: torch.Tensor) -> None:
        if len(table.dtypes) > 1:
            raise ValueError(f"a FlatState holds one wire dtype; the table has {table.dtypes}")
        a = table_arrays(table)
        self.table = table
        self.wire_dtype = dtype_from_name(table.dtypes[0]) if table.dtypes else flat.dtype
        item = self.wire_dtype.itemsize
        self.nbytes = int((a.offsets + a.nbytes).max()) if len(table) else 0
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() * item != self.nbytes:
            raise ValueError(f"flat tensor of shape {list(flat.shape)} for a {self.nbytes}-byte {self.wire_dtype} "
                             f"layout (needs {self.nbytes // item} contiguous elements)")
        self.flat = flat
        self._arrays = a
        self._views: dict[str, torch.Tensor] | None = None
        self._matched = table  # the last table found equal to this one (:meth:`copy_from`)

    @classmethod
    def pack(cls, state_dict: Mapping[str, torch.Tensor], wire_dtype: torch.dtype | None = torch.bfloat16
             ) -> "FlatState":
        """Copy ``state_dict`` (floating-point tensors of one dtype and device) into a new zeroed flat tensor of
        that dtype and device, laid out as :func:`plan` places it for ``wire_dtype`` (None: their own dtype).

        Raises:
            ValueError: the tensors differ in dtype or device, or one is not floating point. TypeError: a value
                is not a tensor.
        """
        kinds = {(t.dtype, t.device) for t in state_dict.values() if isinstance(t, torch.Tensor)}
        if len(kinds) > 1 or any(not t.is_floating_point() for t in state_dict.values()
                                 if isinstance(t, torch.Tensor)):
            raise ValueError("FlatState.pack needs floating-point tensors of one dtype and device, got "
                             f"{sorted(map(str, kinds))}")
        table, total = plan(state_dict, wire_dtype)
        dtype, device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
        item = DTYPE_ITEMSIZE[table.dtypes[0]] if table.dtypes else dtype.itemsize
        out = cls(table, torch.zeros(total // item, dtype=dtype, device=device))
        copy_tensors(list(out.values()), [state_dict[k] for k in table.names])
        return out

    @classmethod
    def of_parameters(cls, module: torch.nn.Module, wire_dtype: torch.dtype | None) -> "FlatState":
        """Move ``module``'s parameters (a shared one — a tied head — once, under its first name) into one new
        flat tensor laid out for ``wire_dtype``: :meth:`pack` then :meth:`adopt`. Returns the state; the
        parameters are its views from now on."""
        params = dict(module.named_parameters())
        out = cls.pack(params, wire_dtype)
        out.adopt(params)
        return out

    def adopt(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make every tensor of ``tensors`` (a model's parameters, same names, shapes and dtype as this state)
        live in :attr:`flat`: its ``.data`` becomes the view (values copied first). Parameters keep their
        identity, so an optimizer or a name → tensor map built before stays valid.

        Raises:
            KeyError: a name is not in the table. ValueError: a shape or dtype differs.
        """
        views = self._tensor_views()
        with torch.no_grad():
            for name, t in tensors.items():
                v = views[name]
                if v.shape != t.shape or v.dtype != t.dtype or v.device != t.device:
                    raise ValueError(f"{name}: {list(t.shape)} {t.dtype} {t.device} cannot live in a "
                                     f"{list(v.shape)} {v.dtype} {v.device} slot")
                if t.data_ptr() != v.data_ptr():
                    v.copy_(t)
                    t.data = v

    def cast_into(self, buffer: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        """Write wire bytes ``[start, end)`` (default: all ``nbytes``) into the same bytes of ``buffer`` (uint8,
        1-D, at least ``end`` long, offset aligned to the wire item size): one cast-copy of that part of
        :attr:`flat` (device → host for a device tensor).

        Raises:
            ValueError: ``start``/``end`` are not multiples of the wire item size within ``[0, nbytes]``.
        """
        end = self.nbytes if end is None else min(end, self.nbytes)
        item = self.wire_dtype.itemsize
        if not 0 <= start <= end or start % item or end % item:
            raise ValueError(f"cannot cast bytes [{start}, {end}) of a {self.nbytes}-byte {self.wire_dtype} layout")
        if end > start:
            with torch.no_grad():
                buffer[start:end].view(self.wire_dtype).copy_(self.flat[start // item: end // item])

    def copy_from(self, other: "FlatState") -> bool:
        """Copy (casting) ``other``'s values into this state when both have the same layout — one copy of the flat
        tensor. Returns False, copying nothing, when the tables differ."""
        if other.table is not self._matched:
            if other.table != self.table:
                return False
            self._matched = other.table  # tables are immutable: the next pull's equal table is compared once
        with torch.no_grad():
            self.flat.copy_(other.flat)
        return True

    def _tensor_views(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = dict(zip(self.table.names, _strided([self.flat], self._arrays)))
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensor_views()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table.names)

    def __len__(self) -> int:
        return len(self.table.names)

    def __contains__(self, name: object) -> bool:  # without making the views
        return name in self.table.names

    def __repr__(self) -> str:
        return (f"FlatState({len(self)} tensors, {self.nbytes} wire bytes as {self.wire_dtype}, flat "
                f"{self.flat.dtype} on {self.flat.device})")
