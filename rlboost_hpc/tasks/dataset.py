"""A user's prompt data set: read once, prepared into one memory-mapped Arrow file with content-hash prompt ids.

Sources (:func:`resolve_source`): a JSON-lines file (``.jsonl``, ``.ndjson``), a Parquet file, a JSON or CSV file,
a directory written by ``datasets.save_to_disk`` (a ``Dataset`` or a ``DatasetDict``, whose ``split`` is taken),
or anything else given to ``datasets.load_dataset`` (a hub id, a local directory of data files) with its ``split``.

Invariants:
- Read once, in the trainer's allocation, never copied into every process: :func:`prepare` runs in a child process
  (its memory is returned when it exits) that streams the source batch by batch into ``<cache>/<fingerprint>.arrow``
  (Arrow IPC, written to a temporary name and renamed); the trainer memory-maps that file (:class:`PromptTable`)
  and touches only the rows it takes. A prepared file is reused as long as the source's fingerprint is the same.
- A prompt's id is a hash of its row's content (:func:`row_ids`: every column, by name, order-independent —
  xxh3-128 of a canonical encoding built column-wise by Arrow kernels), so an appended or reshuffled file keeps
  every id. Rows whose content repeats an earlier row (equal 64-bit content hashes: a chance collision is ~1e-8 at
  a million rows) are dropped (the first one stays) and counted (:attr:`PromptTable.duplicates`): ids are unique.
- The fingerprint (:func:`fingerprint`) is the xxh3-128 of the source's bytes (a directory: of its files' names
  and bytes; a ``load_dataset`` source: the ``datasets`` library's own fingerprint). A checkpoint records it, so a
  resume against a changed file is refused.
- Every problem with a source — missing, unreadable, an unknown format, a malformed line, no rows — is a
  :class:`DatasetError` (exit 2) naming the config key and the file; never a traceback.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from rlboost_hpc.errors import BadInput

log = logging.getLogger("rlboost.tasks")

__all__ = ["DatasetError", "DatasetSource", "PromptTable", "fingerprint", "prepare", "resolve_source", "row_ids",
           "open_prepared", "PID_COLUMN", "HASH_COLUMN", "ColumnStats"]

#: Columns :func:`prepare` adds: the prompt id (24 hex digits of the row's content hash) and its first 8 bytes as
#: an unsigned integer (the held-out split draws from it).
PID_COLUMN = "__rlboost_pid"
HASH_COLUMN = "__rlboost_h"
#: Bumped when the prepared file's layout or the id's definition changes (old prepared files are then not reused).
PREPARED_VERSION = "1"
BATCH_ROWS = 65_536
_READ_CHUNK = 8 << 20


class DatasetError(BadInput, ValueError):
    """A prompt data set cannot be used; the message names the config key and the file or column."""


@dataclass(frozen=True)
class DatasetSource:
    """Where prompts come from: ``kind`` is ``jsonl``, ``parquet``, ``json``, ``csv`` (a file at ``path``), ``disk``
    (a ``save_to_disk`` directory) or ``load_dataset`` (``spec`` handed to ``datasets.load_dataset``); ``split``
    picks a split of a ``DatasetDict`` or a ``load_dataset`` source; ``key`` is the config key that named it."""

    spec: str
    kind: str
    path: Path | None
    split: str
    key: str


_SUFFIX_KIND = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".json": "json",
                ".csv": "csv"}


def resolve_source(spec: str, split: str = "train", key: str = "task.data.path") -> DatasetSource:
    """The :class:`DatasetSource` ``spec`` names.

    Raises:
        DatasetError: a file or directory that does not exist, a file of an unknown format, a directory that is
            neither a ``save_to_disk`` directory nor loadable by ``datasets``.
    """
    p = Path(spec).expanduser()
    if p.is_file():
        kind = _SUFFIX_KIND.get(p.suffix.lower())
        if kind is None:
            raise DatasetError(f"{key} = {spec}: unknown format {p.suffix or '(no suffix)'!r}; accepted: JSON lines "
                               "(.jsonl), Parquet (.parquet), JSON, CSV, a datasets.save_to_disk directory or a hub id")
        if not os.access(p, os.R_OK):
            raise DatasetError(f"{key} = {spec}: the file is not readable")
        return DatasetSource(spec, kind, p.resolve(), split, key)
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            return DatasetSource(spec, "disk", p.resolve(), split, key)
        return DatasetSource(str(p.resolve()), "load_dataset", p.resolve(), split, key)
    looks_like_path = spec.startswith((".", "/", "~")) or Path(spec).suffix.lower() in _SUFFIX_KIND
    if looks_like_path or spec.count("/") > 1:
        raise DatasetError(f"{key} = {spec}: no such file or directory (relative paths are taken from the working "
                           "directory, then from the config file's directory)")
    return DatasetSource(spec, "load_dataset", None, split, key)


def fingerprint(src: DatasetSource) -> str | None:
    """xxh3-128 (hex) of the source's bytes — a directory: of its files' relative names and bytes, in name order;
    ``None`` for a ``load_dataset`` source of the hub (its fingerprint comes from the ``datasets`` library)."""
    import xxhash

    if src.path is None:
        return None
    h = xxhash.xxh3_128()
    files = [src.path] if src.path.is_file() else sorted(f for f in src.path.rglob("*") if f.is_file())
    for f in files:
        if src.path.is_dir():
            h.update(str(f.relative_to(src.path)).encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(_READ_CHUNK):
                    h.update(chunk)
        except OSError as e:
            raise DatasetError(f"{src.key} = {src.spec}: cannot read {f}: {e.strerror or e}") from None
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- content ids


def _lit(text: str) -> Any:
    import pyarrow as pa

    return pa.scalar(text, pa.large_string())


def _join(*parts: Any, sep: str = "") -> Any:
    """Arrow's element-wise string join of arrays and literals (all ``large_string``)."""
    import pyarrow.compute as pc

    return pc.binary_join_element_wise(*[_lit(p) if isinstance(p, str) else p for p in parts], _lit(sep))


def _canonical(arr) -> Any:
    """One string per element of the Arrow array ``arr``, equal for equal values (nulls included), built by
    Arrow kernels: strings quoted, numbers and booleans as Arrow prints them, structs as their fields in name
    order, lists as their items; anything else through its string cast, else Python's ``repr``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_dictionary(t):
        return _canonical(arr.dictionary_decode())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        out = _join('"', arr.cast(pa.large_string()))
    elif pa.types.is_struct(t):
        names = sorted(t.field(i).name for i in range(t.num_fields))
        parts = [_join(f"{n}=", _canonical(pc.struct_field(arr, n))) for n in names]
        out = _join("{", _join(*parts, sep="\x1f"), "}") if parts else pa.array(["{}"] * len(arr), pa.large_string())
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        arr = arr.cast(pa.large_list(t.value_type))
        items = pa.LargeListArray.from_arrays(arr.offsets, _canonical(arr.values))
        out = _join("[", pc.binary_join(items, _lit("\x1e")), "]")
    elif pa.types.is_null(t):
        out = pa.nulls(len(arr), pa.large_string())
    else:
        try:
            out = pc.cast(arr, pa.large_string())
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            out = pa.array([None if v is None else repr(v) for v in arr.to_pylist()], pa.large_string())
    return pc.if_else(pc.is_null(arr), _lit("\x00"), out.cast(pa.large_string()))


def row_ids(batch) -> tuple[Any, np.ndarray]:
    """``(pids, hashes)`` of a record batch's rows: pids a string array of 24 hex digits (96 bits of the row's
    xxh3-128), hashes a ``uint64`` array (its first 8 bytes). Column order does not matter; column names do."""
    import pyarrow as pa
    import xxhash

    n = batch.num_rows
    names = sorted(batch.schema.names)
    cols = [_join(f"{nm}=", _canonical(batch.column(nm))) for nm in names]
    joined = _join(*cols, sep="\x1d") if cols else pa.array([""] * n, pa.large_string())
    offs = np.frombuffer(joined.buffers()[1], dtype=np.int64)[joined.offset: joined.offset + n + 1].tolist()
    data = memoryview(joined.buffers()[2]) if joined.buffers()[2] is not None else memoryview(b"")
    digest = xxhash.xxh3_128_digest
    raw = b"".join([digest(data[a:b]) for a, b in zip(offs, offs[1:])])
    d = np.frombuffer(raw, dtype=np.uint8).reshape(n, 16)
    hexd = np.frombuffer(raw.hex().encode(), dtype=np.uint8).reshape(n, 32)[:, :24].copy()
    pids = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(np.arange(0, 24 * n + 1, 24, dtype=np.int32)),
                                                  pa.py_buffer(hexd.tobytes())])
    return pids, d[:, :8].copy().view(">u8").ravel().astype(np.uint64)


# ------------------------------------------------------------------------------------------- reading


def _batches(src: DatasetSource) -> Iterator[Any]:
    """The source's record batches, streamed (a ``datasets`` source: its memory-mapped Arrow table's batches)."""
    if src.kind == "jsonl":
        import pyarrow.json as pj

        reader = pj.open_json(str(src.path), read_options=pj.ReadOptions(block_size=16 << 20))
        for b in reader:
            yield b
        return
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(str(src.path)).iter_batches(batch_size=BATCH_ROWS)
        return
    ds = _hf_dataset(src)
    yield from ds.data.table.to_batches(max_chunksize=BATCH_ROWS)


def _hf_dataset(src: DatasetSource):
    """The ``datasets.Dataset`` of a ``json``, ``csv``, ``disk`` or ``load_dataset`` source (its ``split``)."""
    import datasets

    datasets.disable_progress_bars()
    if src.kind == "disk":
        ds = datasets.load_from_disk(str(src.path))
    elif src.kind in ("json", "csv"):
        ds = datasets.load_dataset(src.kind, data_files=str(src.path), split="train")
    else:
        ds = datasets.load_dataset(src.spec, split=src.split)
    if isinstance(ds, datasets.DatasetDict):
        if src.split not in ds:
            raise DatasetError(f"{src.key} = {src.spec}: no split {src.split!r} (splits: {', '.join(ds)}); set the "
                               "split key")
        ds = ds[src.split]
    if not isinstance(ds, datasets.Dataset):
        raise DatasetError(f"{src.key} = {src.spec}: not a map-style dataset ({type(ds).__name__})")
    return ds.flatten_indices() if ds._indices is not None else ds


#: Rows per column whose prompt text is longest, kept in the sidecar (the run tokenises these to check the context).
LONGEST_KEPT = 64


class ColumnStats:
    """What the trainer checks about each column without reading the data: its Arrow type, how many values are
    null or empty (an empty string or list), the source row (1-based) of the first such value, and the rows (indices
    in the prepared file) of the :data:`LONGEST_KEPT` longest values by characters (strings; message lists: the
    sum of their messages' ``content``)."""

    def __init__(self) -> None:
        self.cols: dict[str, dict[str, Any]] = {}

    @staticmethod
    def _lengths(col) -> np.ndarray | None:
        import pyarrow as pa
        import pyarrow.compute as pc

        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return pc.fill_null(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False)
        if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type) \
                and t.value_type.get_field_index("content") >= 0:
            content = pc.struct_field(col.values, "content")
            if not (pa.types.is_string(content.type) or pa.types.is_large_string(content.type)):
                return None
            per = pc.fill_null(pc.utf8_length(content), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            offs = np.asarray(col.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
            csum = np.concatenate([[0], np.cumsum(per)])
            return csum[offs[1:]] - csum[offs[:-1]]
        return None

    def add(self, batch, source_rows: np.ndarray, first_row: int) -> None:
        """Account ``batch`` (kept rows; ``source_rows``: their 0-based rows in the source; ``first_row``: the
        prepared file's index of its first row)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        for name in batch.schema.names:
            if name.startswith("__rlboost"):
                continue
            col = batch.column(name)
            st = self.cols.setdefault(name, {"type": str(col.type), "nulls": 0, "empty": 0, "first_bad_row": None,
                                             "longest": []})
            bad = pc.is_null(col).to_numpy(zero_copy_only=False)
            st["nulls"] += int(bad.sum())
            is_text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
            if is_text or pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                length = pc.fill_null(pc.utf8_length(col) if is_text else pc.list_value_length(col),
                                      1).to_numpy(zero_copy_only=False)
                empty = length == 0
                st["empty"] += int(empty.sum())
                bad = bad | empty
            if st["first_bad_row"] is None and bad.any():
                st["first_bad_row"] = int(source_rows[int(np.flatnonzero(bad)[0])]) + 1
            lengths = self._lengths(col)
            if lengths is not None:
                top = (np.argpartition(-lengths, LONGEST_KEPT)[:LONGEST_KEPT] if len(lengths) > LONGEST_KEPT
                       else np.arange(len(lengths)))
                merged = st["longest"] + [(int(lengths[i]), first_row + int(i)) for i in top]
                st["longest"] = sorted(merged, key=lambda x: -x[0])[:LONGEST_KEPT]


def _first_occurrences(hashes: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Which of ``hashes`` (``uint64``) occur neither earlier in the array nor in ``seen`` (sorted): sort-based."""
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    first = np.ones(len(hashes), dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    keep = np.zeros(len(hashes), dtype=bool)
    keep[order[first]] = True
    if len(seen):
        at = np.minimum(np.searchsorted(seen, hashes), len(seen) - 1)
        keep &= seen[at] != hashes
    return keep


def _prepare_here(src: DatasetSource, fp: str | None, cache_dir: Path) -> tuple[str, int, int]:
    """Write the prepared file (the child's work); returns ``(path, rows, duplicates)``."""
    import json

    import pyarrow as pa

    if fp is None:  # a load_dataset source: the datasets library's fingerprint
        fp = "hf-" + _hf_dataset(src)._fingerprint
    out = cache_dir / f"{fp}-v{PREPARED_VERSION}.arrow"
    if out.is_file() and _meta_path(out).is_file():
        meta = json.loads(_meta_path(out).read_text())
        return str(out), int(meta["rows"]), int(meta["duplicates"])
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{out.name}.{os.getpid()}.tmp"
    seen = np.zeros(0, dtype=np.uint64)  # the 64-bit content hashes kept so far, sorted
    rows = dups = kept = 0
    writer = schema = None
    stats = ColumnStats()
    try:
        for b in _batches(src):
            if b.num_rows == 0:
                continue
            if any(n.startswith("__rlboost") for n in b.schema.names):
                raise DatasetError(f"{src.key} = {src.spec}: column names starting with __rlboost are reserved")
            pids, hashes = row_ids(b)
            keep = _first_occurrences(hashes, seen)
            seen = np.sort(np.concatenate([seen, np.sort(hashes[keep])]), kind="stable")  # two sorted runs: a merge
            source_rows = rows + np.flatnonzero(keep)
            rows += b.num_rows
            dups += int((~keep).sum())
            b = b.append_column(PID_COLUMN, pids).append_column(HASH_COLUMN, pa.array(hashes, pa.uint64()))
            if not keep.all():
                b = b.filter(pa.array(keep))
            stats.add(b, source_rows, kept)
            kept += b.num_rows
            if writer is None:
                schema = b.schema
                writer = pa.ipc.new_file(str(tmp), schema)
            elif b.schema != schema:
                raise DatasetError(f"{src.key} = {src.spec}: the columns change part-way through the file "
                                   f"(first {schema.remove_metadata()}, then {b.schema})")
            writer.write_batch(b)
        if writer is None:
            raise DatasetError(f"{src.key} = {src.spec}: no rows")
        writer.close()
        writer = None
        meta = {"fingerprint": fp, "source": src.spec, "rows": rows, "duplicates": dups, "columns": stats.cols}
        _meta_path(out).write_text(json.dumps(meta))
        os.replace(tmp, out)  # the sidecar first: a prepared file is never there without it
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return str(out), rows, dups


def _meta_path(prepared: Path) -> Path:
    """The JSON sidecar of a prepared file: its fingerprint, source, rows read and duplicates dropped."""
    return prepared.with_suffix(".json")


def _main() -> None:  # pragma: no cover - the child process of prepare()
    """``python -c 'from rlboost_hpc.tasks.dataset import _main; _main()' JSON``: prepare the source the JSON
    argument describes; print one JSON line ``{"ok": path}`` or ``{"bad": message}``."""
    import json
    import sys

    a = json.loads(sys.argv[1])
    src = DatasetSource(a["spec"], a["kind"], Path(a["path"]) if a["path"] else None, a["split"], a["key"])
    try:
        out = {"ok": _prepare_here(src, a["fp"], Path(a["cache"]))[0]}
    except DatasetError as e:
        out = {"bad": str(e)}
    except Exception as e:  # noqa: BLE001 - a reader's error on user data: one line naming the source
        first = (str(e).splitlines() or [""])[0][:400]
        out = {"bad": f"{src.key} = {src.spec}: cannot be read: {type(e).__name__}" + (f": {first}" if first else "")}
    print(json.dumps(out), flush=True)


def prepare(src: DatasetSource, cache_dir: str | os.PathLike[str], *, in_child: bool = True) -> Path:
    """The prepared, memory-mappable Arrow file of ``src`` in ``cache_dir`` (written once per fingerprint, in a
    child process when ``in_child``, so the caller's memory never holds the data set).

    Raises:
        DatasetError: the source cannot be read (named), has no rows, or its columns change part-way.
    """
    import json
    import subprocess
    import sys

    cache = Path(cache_dir).expanduser()
    fp = fingerprint(src)
    if fp is not None:
        done = cache / f"{fp}-v{PREPARED_VERSION}.arrow"
        if done.is_file() and _meta_path(done).is_file():
            return done
    if not in_child:
        return Path(_prepare_here(src, fp, cache)[0])
    arg = json.dumps({"spec": src.spec, "kind": src.kind, "path": str(src.path) if src.path else None,
                      "split": src.split, "key": src.key, "fp": fp, "cache": str(cache)})
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # where this rlboost_hpc is imported from
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", "from rlboost_hpc.tasks.dataset import _main; _main()", arg],
                       capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:400]
        raise DatasetError(f"{src.key} = {src.spec}: the process reading it failed (exit {p.returncode}): {tail}")
    out = json.loads(lines[-1])
    if "bad" in out:
        raise DatasetError(out["bad"])
    return Path(out["ok"])


# ------------------------------------------------------------------------------------------- the table


class PromptTable:
    """A prepared data set, memory-mapped: rows are read on demand (``row(i)``), ids from their column.

    Attributes: ``path`` (the prepared file), ``fingerprint``, ``source``, ``rows_read`` (rows in the source),
    ``duplicates`` (rows dropped as repeats), ``columns`` (the user's column names, in file order), ``stats``
    (column → :class:`ColumnStats`' figures: ``type``, ``nulls``, ``empty``, ``first_bad_row``, ``longest``).
    """

    def __init__(self, path: Path) -> None:
        import json

        import pyarrow as pa

        self.path = Path(path)
        self._table = pa.ipc.open_file(pa.memory_map(str(self.path))).read_all()
        meta = json.loads(_meta_path(self.path).read_text())
        self.fingerprint, self.source = meta.get("fingerprint", ""), meta.get("source", "")
        self.rows_read, self.duplicates = int(meta.get("rows", 0)), int(meta.get("duplicates", 0))
        self.stats: dict[str, dict[str, Any]] = meta.get("columns", {})
        self.columns = [n for n in self._table.schema.names if not n.startswith("__rlboost")]
        self._pids = self._table.column(PID_COLUMN)

    def __len__(self) -> int:
        return self._table.num_rows

    def column_type(self, name: str) -> Any:
        """The Arrow type of the user's column ``name``."""
        return self._table.schema.field(name).type

    def hashes(self) -> np.ndarray:
        """Every row's 64-bit content hash (``uint64``, one per row, file order)."""
        chunks = self._table.column(HASH_COLUMN).chunks  # per chunk: ChunkedArray.to_numpy would import pandas
        return np.concatenate([c.to_numpy(zero_copy_only=False) for c in chunks]) if chunks else np.zeros(0, np.uint64)

    def pid(self, i: int) -> str:
        """The id of row ``i``."""
        return self._pids[int(i)].as_py()

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as plain Python values (the user's columns only)."""
        return {k: v for k, v in self._table.slice(int(i), 1).to_pylist()[0].items() if not k.startswith("__rlboost")}

    def pid_in(self, other: "PromptTable") -> np.ndarray:
        """Whether each row's id is one of ``other``'s (``bool``, one per row)."""
        import pyarrow.compute as pc

        return pc.is_in(self._pids, value_set=other._pids.combine_chunks()).to_numpy(zero_copy_only=False)

    def column_values(self, name: str, rows: np.ndarray) -> list[Any]:
        """Column ``name`` at ``rows`` (indices), as Python values."""
        return self._table.column(name).take(rows).to_pylist()


def open_prepared(spec: str, *, split: str, key: str, cache_dir: str) -> PromptTable:
    """:func:`resolve_source` → :func:`prepare` → :class:`PromptTable` of ``spec``.

    Raises:
        DatasetError: see :func:`resolve_source` and :func:`prepare`.
    """
    src = resolve_source(spec, split, key)
    table = PromptTable(prepare(src, cache_dir))
    log.info("%s = %s: %d rows (%d duplicates dropped), prepared %s", key, spec, len(table), table.duplicates,
             table.path)
    return table
