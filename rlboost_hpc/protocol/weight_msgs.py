"""Wire messages of the pull-based weight transfer (``rlboost_hpc.weights``).

One request/reply exchange per message; every message is one msgpack map with a tag field ``"t"``
(a msgspec tagged union), and a :class:`Chunk` header is followed by exactly one raw payload frame
(sent zero-copy from the holder's host buffer, never msgpack-encoded).

Exchanges (puller = ZeroMQ DEALER, holder = ROUTER)::

    [GetManifest(version|None, base, layout)] -> [Manifest] | [Error]
    [GetChunk(version, index, base)]       -> [Chunk(version, index, nbytes, base), <nbytes raw bytes>] | [Error]

Delta versions: a puller that holds version ``base`` says so in ``GetManifest.base``; when the holder has
version ``version`` encoded as a delta against exactly that base, the manifest carries a :class:`DeltaInfo`
(payload size per chunk, see :mod:`rlboost_hpc.weights.delta`), and ``GetChunk(..., base=base)`` returns a
chunk's delta payload instead of its bytes. The manifest's checksums are always those of the full version.

Layouts: a puller that holds a version says which tensor table it holds (``GetManifest.layout``, a
:func:`layout_checksum`); when the requested version has the same layout the manifest comes without its table
(``tensors`` None) and the puller uses its own copy — a 10,000-tensor table is ~330 KB to send, decode and
check on every pull, while layouts change only when the model does.

Invariants:
- Decoding is total: :func:`decode_request` and :func:`decode_reply` either return a valid message of
  their direction or raise :class:`~rlboost_hpc.protocol.errors.ProtocolError` — for oversized frames
  (checked before parsing), malformed msgpack, truncated input, huge declared lengths, unknown tags,
  messages of the other direction, wrong field types and out-of-range values.
- A :class:`Manifest` that passes :func:`validate_manifest` describes a buffer that can be allocated
  and viewed without any out-of-bounds access: every tensor (``prod(shape) * itemsize(dtype)`` bytes,
  derived from its shape, never carried) lies inside ``total_bytes``, its offset is aligned to its item size,
  names are unique, and there is one checksum per chunk of ``chunk_bytes`` (the last one possibly shorter).
- Checksums are xxh3_64 (seed 0). ``Manifest.checksum`` is xxh3_64 of the concatenated per-chunk digests,
  each as 8 little-endian bytes (:func:`combine_checksums`); a puller recomputes it from the digests of
  the bytes it actually received, so it vouches for the whole version without a second pass.
"""
from __future__ import annotations

import collections
import struct
import threading
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Final, Union

import msgspec
import numpy as np
import xxhash
from msgspec import Meta, Struct

from rlboost_hpc.protocol.errors import ProtocolError

__all__ = [
    "Chunk",
    "DeltaInfo",
    "Error",
    "ErrorCode",
    "GetChunk",
    "GetManifest",
    "Manifest",
    "TensorSpec",
    "TensorTable",
    "Sealed",
    "TableArrays",
    "table_arrays",
    "validate_table",
    "layout_checksum",
    "MAX_NDIM",
    "MAX_TENSOR_BYTES",
    "DTYPE_ITEMSIZE",
    "MAX_REQUEST_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_BYTES",
    "chunk_checksum",
    "combine_checksums",
    "decode_reply",
    "decode_request",
    "encode",
    "num_chunks",
    "validate_manifest",
]

#: Largest request frame a holder parses (bytes). Real requests are < 64 bytes.
MAX_REQUEST_BYTES: Final = 4096
#: Largest Chunk/Error header frame a puller parses (bytes).
MAX_HEADER_BYTES: Final = 8192
#: Largest Manifest frame a puller parses (bytes); ~1M tensors or ~6M chunks.
MAX_MANIFEST_BYTES: Final = 64 << 20

_U63 = 2**63 - 1
Version = Annotated[int, Meta(ge=0, le=_U63)]
NonNeg = Annotated[int, Meta(ge=0, le=_U63)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack carries at most uint64

#: Item size in bytes of every dtype a manifest may name (torch dtype names without ``torch.``).
DTYPE_ITEMSIZE: Final[dict[str, int]] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


class ErrorCode:
    """Values of :attr:`Error.code`."""

    NO_VERSION: Final = "no_version"  #: nothing has been published yet
    VERSION_GONE: Final = "version_gone"  #: the version was published but has been evicted
    UNKNOWN_VERSION: Final = "unknown_version"  #: the version is newer than anything published
    BAD_INDEX: Final = "bad_index"  #: chunk index outside the version's chunk range
    BAD_REQUEST: Final = "bad_request"  #: the request frame was rejected (see message)
    INTERNAL: Final = "internal"  #: the holder failed while serving a valid request (see message)
    NO_DELTA: Final = "no_delta"  #: no delta payload of that chunk against that base (fetch it in full)
    UNAUTHORIZED: Final = "unauthorized"  #: a request on the sealed port without the version's ticket


class _Msg(Struct, tag_field="t", frozen=True, forbid_unknown_fields=True):
    """Base of all weight-transfer messages (msgpack map, tag in field ``"t"``)."""


class TensorSpec(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Placement of one tensor in a version's flat buffer (one row of a :class:`TensorTable`).

    name: state-dict key. dtype: torch dtype name without ``torch.`` (a key of :data:`DTYPE_ITEMSIZE`).
    shape: tensor shape. offset: byte offset in the buffer. nbytes: ``prod(shape) * itemsize`` bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


#: Most dimensions a tensor of a manifest may have.
MAX_NDIM: Final = 16
#: Largest tensor a manifest may describe (bytes); keeps every size computation exact in int64 and float64.
MAX_TENSOR_BYTES: Final = 1 << 52


class TensorTable(Struct, frozen=True, forbid_unknown_fields=True):
    """Placement of every tensor of a version in its flat buffer, one column per field.

    Columnar so that encoding, decoding, validating and comparing a manifest cost per byte, not per tensor
    (a 10,000-tensor MoE layer list is one msgpack string list plus five binary blobs).

    names: state-dict keys, in buffer order (≤ 4096 characters each). dtypes: the distinct dtype names
    (keys of :data:`DTYPE_ITEMSIZE`). dtype_index: one uint8 per tensor, an index into ``dtypes``. ndim: one
    uint8 per tensor (≤ :data:`MAX_NDIM`). shapes: little-endian int64, ``len(names) × width`` row-major
    (``width = max(ndim)``); row i is tensor i's shape padded with 1s. offsets: little-endian int64 per
    tensor, the byte offset in the buffer (aligned to the dtype's item size). A tensor's byte size is derived,
    never carried: ``prod(shape) * itemsize``. Build one with :meth:`from_specs` or
    :func:`rlboost_hpc.models.layout.plan`; :func:`table_arrays` reads the columns as numpy arrays.
    """

    names: list[Annotated[str, Meta(max_length=4096)]]
    dtypes: list[Annotated[str, Meta(max_length=32)]]
    dtype_index: bytes
    ndim: bytes
    shapes: bytes
    offsets: bytes

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def from_specs(cls, specs: "list[TensorSpec] | tuple[TensorSpec, ...]") -> "TensorTable":
        """The table of ``specs`` (in that order; each spec's ``nbytes`` is not stored, it follows from its
        shape and dtype). Raises ValueError for a shape of more than :data:`MAX_NDIM` dimensions."""
        dtypes: list[str] = []
        index: dict[str, int] = {}
        for s in specs:
            if s.dtype not in index:
                index[s.dtype] = len(dtypes)
                dtypes.append(s.dtype)
        if any(len(s.shape) > MAX_NDIM for s in specs):
            raise ValueError(f"a tensor has more than {MAX_NDIM} dimensions")
        width = max((len(s.shape) for s in specs), default=0)
        shapes = np.ones((len(specs), width), dtype="<i8")
        for i, s in enumerate(specs):
            shapes[i, : len(s.shape)] = s.shape
        return cls(
            names=[s.name for s in specs],
            dtypes=dtypes,
            dtype_index=bytes(index[s.dtype] for s in specs),
            ndim=bytes(len(s.shape) for s in specs),
            shapes=shapes.tobytes(),
            offsets=np.array([s.offset for s in specs], dtype="<i8").tobytes(),
        )

    def specs(self) -> list[TensorSpec]:
        """One :class:`TensorSpec` per tensor, in buffer order (per-tensor Python objects: for tests and
        diagnostics, not for the transfer path). Assumes a table that passed :func:`validate_table`."""
        a = table_arrays(self)
        return [TensorSpec(name, self.dtypes[a.dtype_index[i]], tuple(int(d) for d in a.shapes[i, : a.ndim[i]]),
                           int(a.offsets[i]), int(a.nbytes[i])) for i, name in enumerate(self.names)]


@dataclass(frozen=True)
class TableArrays:
    """The columns of a :class:`TensorTable` as numpy arrays (each of length n = number of tensors):
    ``dtype_index`` (uint8), ``ndim`` (uint8), ``shapes`` (int64, n × width), ``offsets`` (int64, bytes),
    ``itemsize`` (int64, bytes per element), ``numel`` (int64) and ``nbytes`` (int64, bytes)."""

    dtype_index: np.ndarray
    ndim: np.ndarray
    shapes: np.ndarray
    offsets: np.ndarray
    itemsize: np.ndarray
    numel: np.ndarray
    nbytes: np.ndarray


_MEMO: "collections.OrderedDict[tuple[int, str], tuple[TensorTable, Any]]" = collections.OrderedDict()
_MEMO_SIZE = 16
_MEMO_LOCK = threading.Lock()


def _memo(t: TensorTable, what: str, compute: "Callable[[TensorTable], Any]") -> Any:
    """``compute(t)``, remembered for the last few tables by identity (a table is immutable; the memo holds it,
    so its id is not reused while remembered)."""
    key = (id(t), what)
    with _MEMO_LOCK:
        hit = _MEMO.get(key)
        if hit is not None and hit[0] is t:
            _MEMO.move_to_end(key)
            return hit[1]
    value = compute(t)
    with _MEMO_LOCK:
        _MEMO[key] = (t, value)
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return value


def layout_checksum(t: TensorTable) -> int:
    """xxh3_64 (seed 0) of ``t``'s msgpack encoding: equal for equal tables, so a puller holding a table can say
    which one in 8 bytes (:attr:`GetManifest.layout`). Remembered per table (:func:`table_arrays`)."""
    return _memo(t, "layout", lambda x: xxhash.xxh3_64_intdigest(_encoder.encode(x)))


def table_arrays(t: TensorTable) -> TableArrays:
    """Read ``t``'s columns (no per-tensor Python work).

    The columns of the last few tables read are remembered by identity (a table is immutable): a pull's
    validation, its views and a load read the columns once.

    Raises:
        ProtocolError: a column's length does not match the number of names, a dtype index is out of range,
            a dtype is not in :data:`DTYPE_ITEMSIZE`, a dimension is negative or more than :data:`MAX_NDIM`, a
            padding entry is not 1, or a tensor exceeds :data:`MAX_TENSOR_BYTES`.
    """
    return _memo(t, "arrays", _read_columns)


def _read_columns(t: TensorTable) -> TableArrays:
    n = len(t.names)
    if len(t.dtype_index) != n or len(t.ndim) != n or len(t.offsets) != 8 * n:
        raise ProtocolError(f"tensor table of {n} names has columns of {len(t.dtype_index)} dtype indices, "
                            f"{len(t.ndim)} ndims and {len(t.offsets)} offset bytes", "invalid")
    for name in t.dtypes:
        if name not in DTYPE_ITEMSIZE:
            raise ProtocolError(f"tensor table: unsupported dtype {name!r}", "invalid")
    dtype_index = np.frombuffer(t.dtype_index, dtype=np.uint8)
    ndim = np.frombuffer(t.ndim, dtype=np.uint8)
    offsets = np.frombuffer(t.offsets, dtype="<i8")
    width = int(ndim.max()) if n else 0
    if width > MAX_NDIM or len(t.shapes) != 8 * n * width:
        raise ProtocolError(f"tensor table: {len(t.shapes)} shape bytes for {n} tensors of at most {width} "
                            f"dimensions (limit {MAX_NDIM})", "invalid")
    shapes = np.frombuffer(t.shapes, dtype="<i8").reshape(n, width)

    def first(bad: np.ndarray, what: str) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ProtocolError(f"manifest tensor {t.names[i]!r}: {what}", "invalid")

    first(dtype_index >= len(t.dtypes), f"dtype index out of range ({len(t.dtypes)} dtypes)")
    first((shapes < 0).any(axis=1), "negative dimension")
    first(((shapes != 1) & (np.arange(width) >= ndim[:, None])).any(axis=1), "shape padding is not 1")
    first(offsets < 0, "negative offset")
    itemsize = np.array([DTYPE_ITEMSIZE[d] for d in t.dtypes], dtype=np.int64)[dtype_index] if n else \
        np.zeros(0, dtype=np.int64)
    approx = shapes.astype(np.float64).prod(axis=1) * itemsize  # exact below 2**53; no int64 overflow
    first(approx > MAX_TENSOR_BYTES, f"larger than {MAX_TENSOR_BYTES} bytes")
    numel = shapes.prod(axis=1) if width else np.ones(n, dtype=np.int64)
    nbytes = numel * itemsize
    for arr in (itemsize, numel, nbytes):  # shared through the memo: nobody may change them
        arr.flags.writeable = False
    return TableArrays(dtype_index, ndim, shapes, offsets, itemsize, numel, nbytes)


def validate_table(t: TensorTable, total_bytes: int) -> TableArrays:
    """Check that every tensor of ``t`` can be viewed inside a ``total_bytes`` buffer: valid columns
    (:func:`table_arrays`), offsets aligned to the item size, ``offset + nbytes <= total_bytes``, names unique.
    Returns the columns. Raises ProtocolError naming the first offending tensor."""
    a = table_arrays(t)

    def first(bad: np.ndarray, what: str) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ProtocolError(f"manifest tensor {t.names[i]!r}: bytes [{a.offsets[i]}, {a.offsets[i] + a.nbytes[i]}) "
                                f"{what}", "invalid")

    first(a.offsets % np.maximum(a.itemsize, 1) != 0, "misaligned")
    first(a.offsets + a.nbytes > total_bytes, f"outside the {total_bytes}-byte buffer")
    if len(set(t.names)) != len(t.names):
        seen: set[str] = set()
        dup = next(name for name in t.names if name in seen or seen.add(name))  # type: ignore[func-returns-value]
        raise ProtocolError(f"manifest tensor {dup!r} appears twice", "invalid")
    return a


class GetManifest(_Msg, tag="get_manifest"):
    """Ask for the manifest of ``version`` (``None``: the latest published version). ``base``: the version the
    puller holds (a delta against it is offered when the holder has one). ``layout``: the
    :func:`layout_checksum` of the tensor table the puller holds; a holder whose version has that layout
    leaves the table out of the reply (``Manifest.tensors`` None) — the puller uses its own copy."""

    version: Version | None = None
    base: Version | None = None
    layout: U64 | None = None


class GetChunk(_Msg, tag="get_chunk"):
    """Ask for chunk ``index`` (bytes ``[index*chunk_bytes, min(total, (index+1)*chunk_bytes))``) of ``version``;
    with ``base``, for its delta payload against version ``base`` instead. ``ticket``: the version's
    ``Sealed.ticket`` (on the sealed port)."""

    version: Version
    index: NonNeg
    base: Version | None = None
    ticket: Annotated[bytes, Meta(max_length=64)] | None = None  #: required on the sealed port


class DeltaInfo(Struct, frozen=True, forbid_unknown_fields=True):
    """How version ``Manifest.version`` is encoded against ``base_version`` (whose whole-version checksum is
    ``base_checksum``). ``sizes``: per chunk, the delta payload in bytes — 0: the chunk equals the base's;
    smaller than the chunk: a payload to fetch with ``GetChunk(base=base_version)``; otherwise: fetch the
    chunk in full. ``nbytes``: what a puller receives in all (payloads plus chunks fetched in full)."""

    base_version: Version
    base_checksum: U64
    sizes: list[NonNeg]
    nbytes: NonNeg


class Sealed(Struct, frozen=True, forbid_unknown_fields=True):
    """Access to the sealed chunks of one version (:mod:`rlboost_hpc.weights.sealed`), stated in its manifest,
    which travels only over CURVE. port: the holder's plain TCP port for ``GetChunk`` (same host as the holder's
    endpoint). key: the version's AES-256-GCM key. ticket: what every request on that port must carry."""

    port: Annotated[int, Meta(ge=1, le=65535)]
    key: Annotated[bytes, Meta(min_length=32, max_length=32)]
    ticket: Annotated[bytes, Meta(min_length=16, max_length=16)]

    def __repr__(self) -> str:  # never print the key or the ticket
        return f"Sealed(port={self.port}, key=<{len(self.key)} bytes>, ticket=<{len(self.ticket)} bytes>)"


class Manifest(_Msg, tag="manifest"):
    """Everything a puller needs before bytes move: layout, sizes and checksums of one version.

    total_bytes: size of the flat buffer (bytes). chunk_bytes: chunk size (bytes, > 0); the last chunk
    holds the remainder. tensors: placement of every tensor, in buffer order — None only in a reply to a
    :class:`GetManifest` whose ``layout`` equals this manifest's (the puller holds the table already).
    chunk_checksums: xxh3_64 of each chunk, ``num_chunks(total_bytes, chunk_bytes)`` of them. checksum:
    :func:`combine_checksums` of ``chunk_checksums``. layout: :func:`layout_checksum` of ``tensors`` (None:
    not stated; such a manifest is always sent whole). sealed: where and how to fetch the chunks sealed instead
    of over CURVE (None: over the holder's endpoint only).
    """

    version: Version
    total_bytes: NonNeg
    chunk_bytes: Annotated[int, Meta(gt=0, le=_U63)]
    tensors: TensorTable | None
    chunk_checksums: list[U64]
    checksum: U64
    delta: DeltaInfo | None = None
    layout: U64 | None = None
    sealed: Sealed | None = None


class Chunk(_Msg, tag="chunk"):
    """Header of one chunk; the next frame of the same message holds exactly ``nbytes`` raw bytes (with
    ``base``: the chunk's delta payload against version ``base``). With ``nonce`` (replies on the sealed port)
    the frame is the payload sealed under the version's key: ciphertext plus a 16-byte tag."""

    version: Version
    index: NonNeg
    nbytes: NonNeg
    base: Version | None = None
    nonce: Annotated[bytes, Meta(min_length=12, max_length=12)] | None = None


class Error(_Msg, tag="error"):
    """A request could not be served. ``code`` is an :class:`ErrorCode` value (unknown codes are kept
    as-is for forward compatibility); ``version``/``index`` echo the request when known."""

    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=4096)]
    version: Version | None = None
    index: NonNeg | None = None


Request = Union[GetManifest, GetChunk]
Reply = Union[Manifest, Chunk, Error]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: _Msg) -> bytes:
    """Encode one message to a msgpack frame."""
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: object, max_bytes: int, what: str):
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError as e:
        raise ProtocolError(f"{what} frame is not a byte buffer ({type(data).__name__})", "malformed") from e
    if view.nbytes > max_bytes:
        raise ProtocolError(f"{what} frame of {view.nbytes} bytes exceeds the limit of {max_bytes} bytes", "oversized")
    if view.nbytes == 0:
        raise ProtocolError(f"empty {what} frame", "empty")
    try:
        return decoder.decode(view)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid {what}: {e}", "invalid") from e
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"malformed {what} frame: {e}", "malformed") from e


def decode_request(data: object, max_bytes: int = MAX_REQUEST_BYTES) -> GetManifest | GetChunk:
    """Decode a request frame (buffer-protocol object) received by a weight holder.

    Raises:
        ProtocolError: oversized (> ``max_bytes``), empty, malformed or truncated msgpack, unknown tag,
            a reply-type message, wrong field types or out-of-range values.
    """
    return _decode(_request_decoder, data, max_bytes, "request")


def decode_reply(data: object, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest | Chunk | Error:
    """Decode a reply header frame received by a puller (the chunk payload frame is *not* passed here).

    Raises:
        ProtocolError: as :func:`decode_request`, for the reply direction.
    """
    return _decode(_reply_decoder, data, max_bytes, "reply")


def num_chunks(total_bytes: int, chunk_bytes: int) -> int:
    """Number of chunks of a ``total_bytes`` buffer cut in ``chunk_bytes`` pieces (0 for an empty buffer)."""
    return -(-total_bytes // chunk_bytes)


def chunk_checksum(data: object) -> int:
    """xxh3_64 (seed 0) of a buffer-protocol object, as an unsigned 64-bit int. Releases the GIL."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


def combine_checksums(digests: list[int]) -> int:
    """Whole-version checksum: xxh3_64 of the digests packed as little-endian uint64, in chunk order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def validate_manifest(m: Manifest) -> None:
    """Check that ``m`` describes a buffer that can be safely allocated and viewed (see module invariants).

    Raises:
        ProtocolError: naming the first inconsistency (chunk count, checksum of checksums, unknown dtype,
            size or alignment mismatch, tensor outside the buffer, duplicate name).
    """
    n = num_chunks(m.total_bytes, m.chunk_bytes)
    if len(m.chunk_checksums) != n:
        raise ProtocolError(
            f"manifest of version {m.version} lists {len(m.chunk_checksums)} chunk checksums, "
            f"expected {n} for {m.total_bytes} bytes in chunks of {m.chunk_bytes}",
            "invalid",
        )
    if combine_checksums(m.chunk_checksums) != m.checksum:
        raise ProtocolError(f"manifest of version {m.version}: checksum does not match its chunk checksums", "invalid")
    if m.delta is not None:
        if len(m.delta.sizes) != n:
            raise ProtocolError(f"manifest of version {m.version}: delta lists {len(m.delta.sizes)} chunk sizes, "
                                f"expected {n}", "invalid")
        if m.delta.base_version >= m.version:
            raise ProtocolError(f"manifest of version {m.version}: delta against version {m.delta.base_version}, "
                                "which is not older", "invalid")
    if m.tensors is None:
        raise ProtocolError(f"manifest of version {m.version} has no tensor table", "invalid")
    validate_table(m.tensors, m.total_bytes)
    if m.layout is not None and layout_checksum(m.tensors) != m.layout:
        raise ProtocolError(f"manifest of version {m.version}: layout checksum does not match its tensor table",
                            "invalid")
