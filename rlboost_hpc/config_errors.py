"""How a configuration error reads: one line per problem — the dotted key, the problem, where its value came from
(the ``--set`` overrides that touched it, else the config file) and, for a key the configuration does not have, the
keys of the same table it most resembles ("did you mean …").

Pure functions of pydantic's error records; the configuration's model comes in as an argument (no import of
``rlboost_hpc.config``, which uses this module).
"""
from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

__all__ = ["config_problem", "similar_keys", "table_of"]


def table_of(annotation: Any) -> type[BaseModel] | None:
    """The configuration table an annotation holds (``X`` or ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        tables = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return tables[0] if len(tables) == 1 else None
    return None


def similar_keys(loc: tuple, model: type[BaseModel]) -> list[str]:
    """The dotted keys of the table holding ``loc`` (a key path, e.g. ``("trainer", "lora", "rnak")``) whose last
    name is most like ``loc``'s, best first (at most 3; none when the table is not one of ``model``'s)."""
    table: type[BaseModel] | None = model
    for part in loc[:-1]:
        field = table.model_fields.get(str(part)) if table is not None else None
        table = table_of(field.annotation) if field is not None else None
        if table is None:
            return []
    prefix = "".join(f"{p}." for p in loc[:-1])
    return [prefix + k for k in difflib.get_close_matches(str(loc[-1]), list(table.model_fields), n=3, cutoff=0.6)]


def config_problem(err: dict, path: str | Path | None, overrides: list[str], model: type[BaseModel]) -> str:
    """One line of a configuration error: the dotted key, the problem (with the keys it most resembles, for an
    unknown key) and where the value came from — the ``--set`` overrides that touched the key (or its table, for a
    check across keys), else the config file ``path``."""
    loc = ".".join(str(x) for x in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    keys = [(o.split("=", 1)[0].strip(), o) for o in overrides if "=" in o]
    touched = [o for k, o in keys  # (matched against pydantic's message: a suggested key is no source)
               if (loc and (k == loc or k.startswith(loc + ".") or loc.startswith(k + "."))) or k in msg]
    if err.get("type") == "extra_forbidden":
        near = similar_keys(tuple(err["loc"]), model)
        msg = "not a configuration key" + (f" (did you mean {' or '.join(near)}?)" if near else "")
    source = ("from " + ", ".join(f"--set {o}" for o in touched) if touched
              else f"in {path}" if path is not None else "")
    line = f"{loc}: {msg}" if loc else msg
    return f"{line} ({source})" if source else line
