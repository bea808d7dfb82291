#!/usr/bin/env python3
"""Write docs/configuration-reference.md: every key of a run's configuration (``rlboost_hpc.config.RunConfig``), one
table per TOML table, with its type, default and the description its field declares — generated, so it cannot
drift from what the loader accepts.

Usage: ``python scripts/config_reference.py`` (writes the page) or ``--check`` (exit 1 when the page is not what
the configuration declares; ``tests/test_docs.py`` runs it).
"""
from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rlboost_hpc.config_errors import table_of

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration-reference.md"

HEAD = """# Configuration reference

Every key of a run's configuration, generated from the field descriptions of `rlboost_hpc/config.py` and
`rlboost_hpc/config_task.py` by `scripts/config_reference.py` (a test fails when this page is not what they declare).
Keys are TOML tables and dotted `--set` names alike: `[trainer.lora]` `rank = 4` is `--set trainer.lora.rank=4`.
How the sections fit together: [Configuration](configuration.md).
"""


def _type_name(annotation) -> str:
    """A short, stable spelling of a field's type (``Literal['a', 'b']`` as ``"a" | "b"``)."""
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = repr(annotation).replace("typing.", "").replace("NoneType", "None")
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "(required)"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    return f"`{value!r}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def tables(model: type[BaseModel], prefix: str) -> list[str]:
    """The Markdown of ``model``'s table (its scalar keys) and, after it, each of its sub-tables, depth first."""
    rows, subs = [], []
    for name, field in model.model_fields.items():
        sub = table_of(field.annotation)
        key = f"{prefix}.{name}" if prefix else name
        if sub is not None:
            subs.append((key, sub))
            continue
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                    f"{_cell(field.description or '')} |")
    out = []
    if rows:
        doc = _cell((model.__doc__ or "").strip().split("\n\n")[0])
        out += [f"## `[{prefix}]`", "", doc, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |",
                *rows, ""]
    for key, sub in subs:
        out += tables(sub, key)
    return out


def render() -> str:
    """The page, from the configuration's declarations."""
    from rlboost_hpc.config import RunConfig

    return HEAD + "\n" + "\n".join(tables(RunConfig, "")).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is not what the configuration declares: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
