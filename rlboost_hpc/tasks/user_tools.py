"""A user's tools (``task.turns.tools``): plain Python functions whose type hints and docstring are their JSON schema.

Invariants:
- A tool's schema is transformers' ``get_json_schema`` of the function (the convention chat templates' ``tools=``
  argument renders): a function without a type hint on every argument or without a docstring (an ``Args:`` line per
  argument) is a :class:`~rlboost_hpc.tasks.user_code.UserCodeError` (exit 2) naming it, before anything starts;
  two tools of one name are one too.
- A call (:func:`~rlboost_hpc.tasks.tools.call_tool`) runs in the tool processes of the manager, in the trainer's allocation, under
  ``task.turns.timeout_s``: the model's arguments are passed by name; wrong arguments or anything the tool raises
  become an error observation (:class:`~rlboost_hpc.tasks.tools.ToolError`), never an exception; an ``async def``
  tool is awaited; a result that is not a string is written as JSON.
- Without a chat template, :func:`tool_preamble` tells the model the tools and the call syntax in plain text.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from rlboost_hpc.tasks.tools import ToolSyntax, call_tool
from rlboost_hpc.tasks.user_code import UserCodeError, load_object

__all__ = ["call_tool", "load_tools", "tool_preamble", "tool_schema"]


def tool_schema(fn: Callable[..., Any], ref: str, key: str) -> dict:
    """The JSON schema of tool ``fn`` (``{"type": "function", "function": {name, description, parameters}}``).

    Raises:
        UserCodeError: a missing type hint or docstring (transformers' message, with the key and reference).
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - TypeHintParsingException, DocstringParsingException, ...
        raise UserCodeError(f"{key} = {ref!r}: cannot make its JSON schema: {e} (a tool needs a type hint on every "
                            "argument and a docstring with an Args: line for each)") from None


def load_tools(refs: Sequence[str], key: str = "task.turns.tools") -> list[tuple[str, Callable[..., Any], dict]]:
    """``(name, function, schema)`` of each tool reference.

    Raises:
        UserCodeError: a reference that cannot be imported, a tool without type hints or docstring, a repeated name.
    """
    out, seen = [], set()
    for i, ref in enumerate(refs):
        k = f"{key}[{i}]"
        fn = load_object(ref, k)
        schema = tool_schema(fn, ref, k)
        name = schema["function"]["name"]
        if name in seen:
            raise UserCodeError(f"{k} = {ref!r}: a second tool named {name!r}")
        seen.add(name)
        out.append((name, fn, schema))
    return out


def tool_preamble(schemas: Sequence[dict], syntax: ToolSyntax) -> str:
    """The plain-text instruction naming the tools and the call syntax (prompts without a chat template): one line
    per tool, ``name(arg: type, ...): description``, then how to call one."""
    lines = ["Tools:"]
    for s in schemas:
        f = s["function"]
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in f.get("parameters", {}).get("properties", {}).items())
        lines.append(f"{f['name']}({args}): {f.get('description', '')}")
    lines.append(f'To call one, write {syntax.call_open}{{"name": ..., "arguments": {{...}}}}{syntax.call_close}')
    return "\n".join(lines)
