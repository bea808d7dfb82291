"""Trainer checkpoints for crash-resume (issue 7 §2).

Layout under the run directory::

    checkpoints/step-000012/backend/...      the backend's own files (torch: torch_backend.pt; Megatron:
                                             dist_checkpointing shards) — model, optimizer, backend RNG
    checkpoints/step-000012/trainer.json     loop state (version, data frontier, totals, exactly-once ledgers,
                                             scheduling-policy state), Python/NumPy RNG, run bookkeeping — JSON
    checkpoints/step-000012/manifest.json    step + SHA-256 of every file above
    checkpoints/latest                       name of the newest complete checkpoint

Invariants:
- Atomic: a checkpoint is written into ``step-N.tmp`` and renamed; ``latest`` is replaced atomically after the
  rename. A crash at any point leaves the previous checkpoint intact and ``latest`` naming a complete one.
- Consistent with the data: it is taken after the optimizer step of step N-1 and the publication of version N,
  so its frontier holds exactly the prompts trained (no prompt skipped, none trained twice on resume).
- Durable: every file, then each directory, is fsynced before the rename that publishes it, so after a power
  loss a checkpoint named by ``latest`` is complete.
- Loads without executing code: the loop state is JSON, tensors load with ``torch.load(weights_only=True)``.
- Never a silent restart from zero: a ``latest`` that names a missing directory or an unreadable file raises
  :class:`CheckpointError` naming the path and what to do. A newest checkpoint whose files do not match its
  manifest (torn by a crash) is skipped for the newest older one that verifies (:func:`newest_verified`), with a
  log line naming both.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rlboost_hpc.rundir import RunDir
from rlboost_hpc.errors import BadInput

LATEST = "latest"


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file and the remedy."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory bottom-up (names durable too)."""
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in sorted(dirs, key=lambda x: len(x.parts), reverse=True):
        _fsync_dir(d)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    v, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [v, list(internal), gauss], "numpy": [name, keys.tolist(), int(pos), int(has_gauss),
                                                            float(cached)]}


def _set_rng_state(st: dict[str, Any]) -> None:
    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | os.PathLike, step: int, backend, trainer_state: dict[str, Any], run_state: dict[str, Any],
         keep: int = 2) -> Path:
    """Write the checkpoint taken after ``step`` completed steps; keep the newest ``keep``. Returns its path."""
    w = CheckpointWriter(run_dir, keep=keep, background=False)
    w.save(step, backend, trainer_state, run_state)
    return w.wait()


class CheckpointWriter:
    """Checkpoints of one run directory, written in the background: :meth:`save` captures the state (the
    backend's :meth:`~rlboost_hpc.trainer.backends.base.TrainerBackend.checkpoint_writer`, the loop state as JSON,
    the RNGs) and returns; a thread writes, fsyncs and publishes it while the next step runs. At most one is in
    flight: :meth:`save` and :meth:`wait` first wait for the previous one and re-raise its error.

    A crash while one is in flight leaves the previous checkpoint named by ``latest`` (the same as a crash during
    a synchronous save); a resume then repeats the steps after it, which the journal allows.
    ``background=False``: write in the caller's thread (same files)."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2, background: bool = True) -> None:
        self.root = RunDir(run_dir).checkpoints
        self.keep, self.background = keep, background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last: Path | None = None

    def save(self, step: int, backend, trainer_state: dict[str, Any], run_state: dict[str, Any],
             durable: Sequence[Path] = ()) -> None:
        """Capture the checkpoint of ``step`` completed steps now; it is written before the next :meth:`save`
        returns or :meth:`wait` returns. ``durable``: files (e.g. ``metrics.jsonl``) fsynced, as far as they were
        flushed now, before the checkpoint is published — the checkpoint may then refer to their contents.

        Raises:
            CheckpointError: the loop state is not JSON; the previous checkpoint failed (its error).
        """
        self.wait()
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:06d}"
        tmp = self.root / f"{name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        write_backend = backend.checkpoint_writer(tmp / "backend")
        try:
            text = json.dumps({"trainer": trainer_state, "run": run_state, "rng": _rng_state()}, allow_nan=True)
        except TypeError as e:
            raise CheckpointError(f"the loop state is not JSON ({e}): a checkpoint holds data, never pickled "
                                  "objects") from None

        def write() -> None:
            try:
                for path in durable:
                    _fsync_file(path)
                write_backend()
                self._last = self._publish(step, name, tmp, text)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e

        if self.background:
            self._thread = threading.Thread(target=write, name=f"checkpoint-{name}", daemon=True)
            self._thread.start()
        else:
            write()

    def wait(self) -> Path | None:
        """Wait for the checkpoint in flight; returns the newest one written by this writer (None: none yet).

        Raises:
            CheckpointError, OSError: writing the checkpoint in flight failed.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._last

    def _publish(self, step: int, name: str, tmp: Path, text: str) -> Path:
        root = self.root
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "trainer.json").write_text(text)
        (tmp / "manifest.json").write_text(json.dumps({"format": 2, "step": step, "files": _files(tmp)}, indent=1))
        _fsync_tree(tmp)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        ptr = root / f"{LATEST}.tmp"
        ptr.write_text(name + "\n")
        _fsync_file(ptr)
        os.replace(ptr, root / LATEST)
        _fsync_dir(root)
        done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, ``None`` when the run has none.

    Raises:
        CheckpointError: ``latest`` names a checkpoint that is missing.
    """
    root = RunDir(run_dir).checkpoints
    ptr = root / LATEST
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = root / name
    if not name.startswith("step-") or not path.is_dir():
        raise CheckpointError(f"{ptr} names {name!r}, which is not a checkpoint directory under {root}; the run "
                              "cannot resume from it (restore the directory, or start a new run in a new --out)")
    return path


def verify(path: Path) -> int:
    """Check ``path`` against its manifest; returns its step. Raises :class:`CheckpointError` (unreadable
    manifest, missing/extra/changed file)."""
    man_path = path / "manifest.json"
    try:
        man = json.loads(man_path.read_text())
        want, step = man["files"], int(man["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: manifest unreadable ({e}); it is incomplete or corrupt") from None
    have = _files(path)
    bad = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    if bad:
        raise CheckpointError(f"checkpoint {path} is corrupt: {len(bad)} file(s) missing or changed since it was "
                              f"written ({', '.join(bad[:5])}); restore it or resume from an older checkpoint by "
                              f"pointing {path.parent / LATEST} at it")
    return step


def newest_verified(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: :func:`latest` if it verifies, else the newest older complete one that
    does (logged, naming both); ``None`` when the run has none. Raises :class:`CheckpointError` when ``latest``
    dangles, or when no checkpoint verifies (each is named)."""
    import logging

    newest = latest(run_dir)
    if newest is None:
        return None
    errors = []
    older = sorted((p for p in newest.parent.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                    and p.name < newest.name), reverse=True)
    for cand in [newest, *older]:
        try:
            verify(cand)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        if cand != newest:
            logging.getLogger("rlboost.checkpoint").warning(
                "the newest checkpoint %s does not verify (%s); resuming from %s instead", newest, errors[0], cand)
        return cand
    raise CheckpointError("no checkpoint of this run verifies: " + "; ".join(errors))


def step_of(path: Path) -> int:
    """The step a checkpoint directory ``step-000012`` was taken after (12)."""
    return int(Path(path).name.split("-")[1])


def latest_step(run_dir: str | os.PathLike) -> int:
    """Step of the newest complete checkpoint of ``run_dir`` (0 when it has none, or ``latest`` dangles)."""
    try:
        ckpt = latest(run_dir)
    except CheckpointError:
        return 0
    return 0 if ckpt is None else step_of(ckpt)


def run_state_of(path: Path) -> dict[str, Any]:
    """The run's state saved with the checkpoint at ``path`` (``trainer.json``'s ``run``), without restoring
    anything — cheap to read before a run starts its services; ``{}`` when unreadable (:func:`load` then names
    the problem)."""
    try:
        st = json.loads((path / "trainer.json").read_text()).get("run", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return st if isinstance(st, dict) else {}


def load(path: Path, backend, run_keys: tuple[str, ...] = (), *,
         verified: bool = False) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Verify ``path`` against its manifest (skipped when ``verified``: the caller just did, e.g. with
    :func:`newest_verified`) and restore the backend; returns (step, trainer_state, run_state).

    Raises:
        CheckpointError: missing/extra/changed file, unreadable manifest or state, or a ``run_state`` without
            one of ``run_keys`` (a checkpoint written by another version of rlboost-hpc).
    """
    step = int(json.loads((path / "manifest.json").read_text())["step"]) if verified else verify(path)
    if not (path / "trainer.json").is_file():
        raise CheckpointError(f"checkpoint {path} has no trainer.json (written by an older rlboost-hpc, whose "
                              "pickled trainer.pt is not loaded); resume it with that version, or start a fresh run")
    try:
        backend.load_checkpoint(path / "backend")
        st = json.loads((path / "trainer.json").read_text())
    except Exception as e:  # noqa: BLE001 - any failure here means the run cannot resume
        first = (str(e).strip().splitlines() or [""])[0]  # torch's state-dict errors list every tensor: one line
        raise CheckpointError(f"checkpoint {path}: cannot restore ({type(e).__name__}: {first})") from None
    missing = [k for k in run_keys if k not in st.get("run", {})]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing} (written by another version of rlboost-hpc); "
                              "resume it with that version, or start a fresh run (trainer.resume=never / new --out)")
    _set_rng_state(st["rng"])
    return step, st["trainer"], st["run"]
