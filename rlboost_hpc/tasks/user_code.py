"""Loading a user's Python code named in the config: ``"package.module:name"`` or ``"path/to/file.py:name"``.

Invariants: a reference that cannot be used — a module that fails to import, a file that does not exist, a name the
module lacks, something that is not callable — is a :class:`UserCodeError` (exit 2) naming the config key, the
reference and the cause in one line; the user's traceback is never shown. A file is imported under a module name
derived from its absolute path (two files of the same name never collide), with its directory on ``sys.path`` (so
it imports its neighbours), once per process; a module not found on ``sys.path`` is looked for in the working
directory too (where a user's package sits beside the command; processes started later inherit the path).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from rlboost_hpc.errors import BadInput

__all__ = ["UserCodeError", "load_object", "split_ref"]


class UserCodeError(BadInput, ValueError):
    """User code named in the config cannot be used; the message names the key, the reference and why."""


def split_ref(ref: str, key: str) -> tuple[str, str]:
    """``(module or file, name)`` of ``ref``.

    Raises:
        UserCodeError: ``ref`` is not ``module:name`` / ``file.py:name``.
    """
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UserCodeError(f"{key} = {ref!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    return where, name


def _is_file_ref(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _import(where: str, key: str, ref: str) -> Any:
    if _is_file_ref(where):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UserCodeError(f"{key} = {ref!r}: no such file {path}")
        mod_name = f"rlboost_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:
            sys.modules.pop(mod_name, None)
            raise UserCodeError(f"{key} = {ref!r}: importing {path} failed: {_cause(e)}") from None
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        cwd = str(Path.cwd())
        if e.name != where.split(".")[0] or cwd in sys.path:
            raise UserCodeError(f"{key} = {ref!r}: importing {where} failed: {_cause(e)}") from None
        sys.path.insert(0, cwd)  # a package beside the command (the console script's path does not hold it)
        return _import(where, key, ref)
    except BaseException as e:  # noqa: BLE001 - the user's import error, reported in one line
        raise UserCodeError(f"{key} = {ref!r}: importing {where} failed: {_cause(e)}") from None


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def load_object(ref: str, key: str, *, callable_: bool = True) -> Callable[..., Any] | Any:
    """The object ``ref`` names (imported in this process).

    Raises:
        UserCodeError: bad reference, import error, missing name, or (``callable_``) not callable.
    """
    where, name = split_ref(ref, key)
    module = _import(where, key, ref)
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))[:12]
        raise UserCodeError(f"{key} = {ref!r}: {where} has no {name!r} (it has: {', '.join(public) or 'nothing'})")
    obj = getattr(module, name)
    if callable_ and not callable(obj):
        raise UserCodeError(f"{key} = {ref!r}: {name} is a {type(obj).__name__}, not a function")
    return obj
