"""Where the project finds the files it reads but does not write: input data and the files it ships.

Shipped files — ``configs/*.toml``, ``sbatch/`` (the launch and job scripts, the local test cluster) — live beside
the code in a source checkout and under ``<prefix>/share/rlboost-hpc/`` in an installed wheel (``pyproject.toml``'s
data files); :func:`shipped` is the one resolver of both, preferring a checkout's own copies.

Invariant: every file the project reads from the shared data set is resolved through :func:`data_file`,
so a missing file always produces the same actionable :class:`DataFileMissing` error naming the file,
the data directory searched and the public origin to fetch it from.

The data directory is, in order: the directory set by :func:`using_data_dir` for the duration of a run
(``data.dir`` of the run's config), else the ``RLBOOST_DATA`` environment variable, else ``../shared/data``
relative to the project root (the checkout's parent directory holds ``shared/``). A run never writes
``RLBOOST_DATA`` into the process environment, so nothing it sets outlives it.

The package itself carries the few data files README's first command needs (:data:`PACKAGED_DATA`: stories260K's
checkpoint and tokenizer, MIT, and the Bamboo p3 spot trace, MIT, each with its licence file beside it), so a fresh
machine without ``../shared/data`` — or a wheel install — runs the demo: :func:`data_file` falls back to that copy
when the data directory lacks the file.
"""
from __future__ import annotations

import contextlib
import os
import site
import sysconfig
from pathlib import Path
from typing import Iterator
from rlboost_hpc.errors import BadInput

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: The source checkout the package runs from (``pip install -e .`` or the tree itself), ``None`` when installed.
CHECKOUT: Path | None = PROJECT_ROOT if (PROJECT_ROOT / "pyproject.toml").is_file() else None
#: The shared data set: ``../shared/data`` beside a checkout; an installed package has no such neighbour, so its
#: default is a per-user directory (``RLBOOST_DATA`` or ``data.dir`` point elsewhere).
DEFAULT_DATA_DIR = (CHECKOUT.parent / "shared" / "data" if CHECKOUT is not None
                    else Path("~/.cache/rlboost-hpc/data").expanduser())
#: Data files shipped inside the package (``rlboost_hpc/data/<relative path>``), the fallback of :func:`data_file`.
PACKAGED_DATA = Path(__file__).resolve().parent / "data"
SHARE_NAME = "share/rlboost-hpc"  # where a wheel installs the shipped files, under its install prefix


class ShippedFileMissing(BadInput, FileNotFoundError):
    """A file the project ships (a config, an sbatch script) is not where the installation put it."""


def shipped_dirs() -> list[Path]:
    """Where shipped files are looked for, in order: the checkout, then the install prefixes' ``share/rlboost-hpc``
    (the environment's, then the user's ``pip install --user`` base)."""
    dirs = [CHECKOUT] if CHECKOUT is not None else []
    return dirs + [Path(sysconfig.get_path("data")) / SHARE_NAME, Path(site.getuserbase()) / SHARE_NAME]


def shipped(relative: str) -> Path:
    """The shipped file ``relative`` (e.g. ``"configs/local.toml"``, ``"sbatch/rollout.sbatch"``), absolute.

    Raises:
        ShippedFileMissing: in none of :func:`shipped_dirs` (a broken installation); names every place searched.
    """
    for d in shipped_dirs():
        if (d / relative).exists():
            return (d / relative).resolve()
    raise ShippedFileMissing(f"{relative} is not installed (looked in {', '.join(map(str, shipped_dirs()))}); "
                             "reinstall rlboost-hpc or pass the file's path explicitly")

# Public origin of each shared data set (first path component under the data dir).
ORIGINS: dict[str, str] = {
    "stories260K": "karpathy/llama2.c 'tinyllamas' release on the Hugging Face hub (stories260K.bin, tok512.bin)",
    "gsm8k": "openai/grade-school-math on GitHub (grade_school_math/data/{train,test}.jsonl)",
    "math500": "HuggingFaceH4/MATH-500 (test.jsonl), answers as in Open-Reasoner-Zero",
    "spot_traces": "uclasystem/bamboo on GitHub (project/traces: p3-trace.csv, g4dn-trace.csv) and JF-D/Parcae",
    "slurm_fixtures": "rivosinc/prometheus-slurm-exporter fixtures and facebookincubator/submitit tests",
}


class DataFileMissing(BadInput, FileNotFoundError):
    """A shared data file is absent; the message names the file, where it was looked for and its origin."""


class InputUnreadable(BadInput, PermissionError):
    """An input file or directory exists but cannot be read (permissions, or a file where a directory is expected);
    the message names it and why — never "not found"."""


def unreadable(path: str | os.PathLike[str], *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be read as a file (``directory``: a directory to list), or None when it can: ``"not
    found"``, ``"cannot be reached (permission denied on a directory above it)"``, ``"is a directory, not a file"``,
    ``"is not a directory"``, ``"exists but cannot be read (permission denied)"``, or the system's word for another
    failure. Opens (and closes) a file, lists a directory: nothing is read."""
    p = Path(path)
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        return "not found"
    except PermissionError:
        return "cannot be reached (permission denied on a directory above it)"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    import stat as stat_mod

    is_dir = stat_mod.S_ISDIR(st.st_mode)
    if directory != is_dir:
        return "is not a directory" if directory else "is a directory, not a file"
    try:
        if directory:
            next(os.scandir(p), None)
        else:
            with open(p, "rb"):
                pass
    except PermissionError:
        return "exists but cannot be read (permission denied)"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def readable(path: str | os.PathLike[str], what: str, *, directory: bool = False) -> Path:
    """``path`` when it can be read (:func:`unreadable`), else a :class:`BadInput` naming ``what``, the path and why:
    :class:`DataFileMissing`'s kind when absent, :class:`InputUnreadable` when it exists but cannot be read."""
    why = unreadable(path, directory=directory)
    if why is None:
        return Path(path)
    if why == "not found":
        raise DataFileMissing(f"{what} not found: {path}")
    raise InputUnreadable(f"{what} {path} {why}")


_override: Path | None = None


@contextlib.contextmanager
def using_data_dir(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """Within the ``with`` block, :func:`data_dir` is ``path`` (``None``: unchanged); restored on exit."""
    global _override
    before = _override
    if path is not None:
        _override = Path(path).expanduser().resolve()
    try:
        yield
    finally:
        _override = before


def data_dir() -> Path:
    """The data directory in force (see the module docstring); not checked for existence."""
    if _override is not None:
        return _override
    env = os.environ.get("RLBOOST_DATA")
    return Path(env).expanduser().resolve() if env else DEFAULT_DATA_DIR


def data_file(relative: str | os.PathLike[str]) -> Path:
    """Resolve ``relative`` (e.g. ``"stories260K/stories260K.bin"``) under :func:`data_dir`, else under the package's
    own copy (:data:`PACKAGED_DATA`: the demo's model and spot trace).

    Absolute paths are returned unchanged after the existence check.

    Raises:
        DataFileMissing: the file does not exist; the message says which file, which directory was
            searched, how to point the project elsewhere, and the public origin of the data set.
        InputUnreadable: it exists but cannot be read (permissions; a directory).
    """
    rel = Path(relative)
    path = rel if rel.is_absolute() else data_dir() / rel
    why = unreadable(path, directory=path.is_dir())  # (a data set may be a directory: a trace's segments)
    if why is None:
        return path
    if why != "not found":  # there, but not readable: saying "not found" would send the user looking elsewhere
        raise InputUnreadable(f"data file {path} {why}")
    if not rel.is_absolute() and (PACKAGED_DATA / rel).is_file():
        return PACKAGED_DATA / rel
    top = rel.parts[0] if not rel.is_absolute() and rel.parts else ""
    origin = ORIGINS.get(top, "see ../shared/data/README.md")
    raise DataFileMissing(
        f"data file not found: {path} (data directory {data_dir()}; set RLBOOST_DATA or data.dir to "
        f"the folder that holds it). Public origin: {origin}."
    )
