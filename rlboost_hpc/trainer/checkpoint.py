"""Trainer checkpoints for crash-resume (issue 7 §2, case C1).

Layout under the run directory::

    checkpoints/step-000012/backend/...      the backend's own files (torch: torch_backend.pt; Megatron:
                                             dist_checkpointing shards) — model, optimizer, backend RNG
    checkpoints/step-000012/trainer.pt       loop state (version, data frontier, totals, exactly-once ledgers,
                                             scheduling-policy state), Python/NumPy RNG, run bookkeeping
    checkpoints/step-000012/manifest.json    step + SHA-256 of every file above
    checkpoints/latest                       name of the newest complete checkpoint

Invariants:
- Atomic: a checkpoint is written into ``step-N.tmp`` and renamed; ``latest`` is replaced atomically after the
  rename. A crash at any point leaves the previous checkpoint intact and ``latest`` naming a complete one.
- Consistent with the data: it is taken after the optimizer step of step N-1 and the publication of version N,
  so its frontier holds exactly the prompts trained (no prompt skipped, none trained twice on resume).
- Never a silent restart from zero: a ``latest`` that names a missing directory, a manifest that does not
  match the files (corruption, truncation), or an unreadable file raises :class:`CheckpointError` naming the
  path and what to do.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
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


def save(run_dir: str | os.PathLike, step: int, backend, trainer_state: dict[str, Any], run_state: dict[str, Any],
         keep: int = 2) -> Path:
    """Write the checkpoint taken after ``step`` completed steps; keep the newest ``keep``. Returns its path."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = root / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    backend.save_checkpoint(tmp / "backend")
    torch.save({"trainer": trainer_state, "run": run_state,
                "rng": {"python": random.getstate(), "numpy": np.random.get_state()}}, tmp / "trainer.pt")
    (tmp / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "files": _files(tmp)}, indent=1))
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    ptr = root / f"{LATEST}.tmp"
    ptr.write_text(name + "\n")
    os.replace(ptr, root / LATEST)
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, ``None`` when the run has none.

    Raises:
        CheckpointError: ``latest`` names a checkpoint that is missing.
    """
    root = Path(run_dir) / "checkpoints"
    ptr = root / LATEST
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = root / name
    if not name.startswith("step-") or not path.is_dir():
        raise CheckpointError(f"{ptr} names {name!r}, which is not a checkpoint directory under {root}; the run "
                              "cannot resume from it (restore the directory, or start a new run in a new --out)")
    return path


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


def load(path: Path, backend, run_keys: tuple[str, ...] = ()) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Verify ``path`` against its manifest and restore the backend; returns (step, trainer_state, run_state).

    Raises:
        CheckpointError: missing/extra/changed file, unreadable manifest or state, or a ``run_state`` without
            one of ``run_keys`` (a checkpoint written by another version of rlboost-hpc).
    """
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
    try:
        backend.load_checkpoint(path / "backend")
        st = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure here means the run cannot resume
        raise CheckpointError(f"checkpoint {path}: cannot restore ({type(e).__name__}: {e})") from None
    missing = [k for k in run_keys if k not in st.get("run", {})]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing} (written by another version of rlboost-hpc); "
                              "resume it with that version, or start a fresh run (trainer.resume=never / new --out)")
    random.setstate(st["rng"]["python"])
    np.random.set_state(st["rng"]["numpy"])
    return step, st["trainer"], st["run"]
