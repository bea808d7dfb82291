"""Verifiable math tasks for real models: GSM8K and MATH-500.

stories260K (the 260K-parameter demo model) cannot solve any of these; the tasks exist for real models
(and for the reward-path, throughput and migration experiments that need realistic answers).

Invariants:
- Data is read only through :func:`rlboost_hpc.paths.data_file` (a missing file is a
  :class:`~rlboost_hpc.paths.DataFileMissing` naming the file and its public origin), lazily on the first
  call that needs it, and cached per task object. Computing a reward never touches a file: the gold answer
  travels in ``prompt.meta["answer"]``.
- A malformed data line (bad JSON, not an object, missing field, GSM8K answer without a final
  ``#### <number>`` line) is a ``ValueError`` naming the file and the 1-based line number.
- Gold answers: GSM8K, the number on the last line ``#### <int>`` with thousands commas removed;
  MATH-500, the ``answer`` field verbatim (LaTeX).
- Answer extraction from a response (:func:`extract_answer`): the content of the last complete
  ``\\boxed{...}`` (balanced braces; ``\\fbox`` too) if any; else, for GSM8K, the number stated after the
  last ``####``, else after the last "The answer is" (within that sentence: the first number after its
  last ``=``, else its first number); else the last number in the text.
- Verification (:func:`answers_match`) is conservative and bounded: normalised string equality; then, when
  both sides are plain numbers (``-1,234.5``, ``3/4``), exact rational comparison decides; otherwise
  ``math_verify.parse`` + ``math_verify.verify`` (gold first). math_verify's timeouts use
  ``signal.alarm`` (main thread only, and they cancel any alarm the host process set, e.g.
  pytest-timeout's), so they are always disabled here (``parsing_timeout=None``, ``timeout_seconds=None``);
  instead answers that could make SymPy run away (overlong text, exponent towers, huge exponents or
  factorials) are never handed to SymPy and score 0 — a heuristic, not a hard time bound (measured: every
  MATH-500 gold verifies in ~2 ms on average). The reward is therefore safe in any thread.
- Rewards are 1.0 (match) or 0.0 (no match, no answer, or any error while verifying).
"""
from __future__ import annotations

import functools
import json
import logging
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Literal

from rlboost_hpc.paths import data_file
from rlboost_hpc.tasks.base import Prompt, Task

__all__ = [
    "GSM8KTask",
    "Math500Task",
    "answers_match",
    "extract_answer",
    "gsm8k_gold",
    "last_boxed",
    "read_jsonl",
]

log = logging.getLogger(__name__)

#: The instruction appended to a math question in chat mode (the usual RLVR prompt for Qwen-style instruct models).
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


# --------------------------------------------------------------------------------------------- data files


def read_jsonl(path: Path, required: tuple[str, ...] = ()) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line of the JSON-lines file ``path``.

    Raises:
        ValueError: a line is not valid JSON, not an object, or lacks one of the ``required`` keys;
            the message names the file and the 1-based line number.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in required if k not in obj]
            if missing:
                raise ValueError(f"{path}: line {lineno}: missing field(s) {missing}")
            yield lineno, obj


_GSM8K_FINAL = re.compile(r"^####\s*(-?[\d,]*\d(?:\.\d+)?)\s*$")


def gsm8k_gold(answer_field: str) -> str:
    """The gold answer of a GSM8K ``answer`` field: the number on its last line ``#### <int>``, commas removed.

    Raises:
        ValueError: the last non-blank line is not ``#### <number>``.
    """
    lines = [ln.strip() for ln in answer_field.strip().splitlines() if ln.strip()]
    m = _GSM8K_FINAL.match(lines[-1]) if lines else None
    if m is None:
        raise ValueError(f"GSM8K answer does not end with a '#### <number>' line: {answer_field[-60:]!r}")
    return m.group(1).replace(",", "")


# ------------------------------------------------------------------------------------ answer extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_BOX_ARG = re.compile(r"[^\s$]+")  # the argument of "\boxed 5"
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape (skipped whole) or a brace

#: a number: optional sign (not when it is a binary minus such as ``5-3``), digits with optional
#: thousands commas, optional decimals, optional ``/denominator``.
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``; ``None`` if none.

    Braces are matched with nesting; escaped braces ``\\{``, ``\\}`` do not count. A truncated (unclosed)
    box is skipped in favour of an earlier complete one; of nested boxes the inner one (it starts last)
    wins. ``\\boxed 5`` (no braces) yields ``"5"``. One pass: linear in ``len(text)``.
    """
    box_braces: set[int] = set()  # positions of "{" that open a box
    best_start, best = -1, None
    for m in _BOXED.finditer(text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            box_braces.add(i)
        elif i > m.end() and (run := _BARE_BOX_ARG.match(text, i)):  # "\boxed 5"
            best_start, best = i, run.group()
    if not box_braces:
        return best
    stack: list[int] = []
    for tok in _BRACE_TOKEN.finditer(text):
        c = tok.group()
        if c == "{":
            stack.append(tok.start())
        elif c == "}" and stack:
            opened = stack.pop()
            if opened in box_braces and opened > best_start:
                best_start, best = opened, text[opened + 1 : tok.start()].strip()
    return best


def _first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return m.group() if m else None


_SENTENCE_END = re.compile(r"\n|\.(?=\s|$)")


def _number_after_mark(text: str) -> str | None:
    """The number a "#### ..." / "The answer is ..." statement gives: within its sentence, the first number
    after the last ``=`` (``5-3=2`` gives 2), else the first number (``18 apples for 3 kids`` gives 18)."""
    text = text.lstrip()
    end = _SENTENCE_END.search(text)
    sentence = text[: end.start()] if end else text
    return _first_number(sentence.rpartition("=")[2]) or _first_number(sentence)


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group() if last else None


def extract_answer(text: str, style: Literal["gsm8k", "math"] = "math") -> str | None:
    """The final answer in a model response, or ``None`` when it has none.

    The last complete ``\\boxed{...}`` if present; else (``style="gsm8k"``) the number stated after the last
    ``####``, else after the last "The answer is" (within that sentence, the first number after its last
    ``=``, else its first number); else the last number in the text.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if style == "gsm8k":
        idx = text.rfind("####")
        if idx >= 0 and (n := _number_after_mark(text[idx + 4 :])) is not None:
            return n
        marks = list(_ANSWER_IS.finditer(text))
        if marks and (n := _number_after_mark(text[marks[-1].end() :])) is not None:
            return n
    return _last_number(text)


# ------------------------------------------------------------------------------------------ verification

#: longest extracted answer handed to SymPy (the longest MATH-500 gold is 53 characters).
MAX_VERIFY_CHARS = 300

_EXPENSIVE = [
    re.compile(r"\^\s*\{[^{}]*\^"),  # exponent tower a^{b^c}
    re.compile(r"\^\s*\(?-?\d+\)?\s*\^"),  # a^b^c
    re.compile(r"(?:\^|\*\*)\s*[{(]?\s*-?\d{5,}"),  # exponent >= 10^4
    re.compile(r"\d{4,}\s*!"),  # factorial of a number >= 1000
    re.compile(r"[)}\]]\s*!"),  # factorial of an expression, e.g. (10!)!
]


def _too_expensive(s: str) -> bool:
    return len(s) > MAX_VERIFY_CHARS or any(p.search(s) for p in _EXPENSIVE)


_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?(?:/\d+)?|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _strip_wrappers(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$" and s.count("$") == 2:
        s = s[1:-1]
    s = s.replace("\\!", "").replace("\\,", "").replace("\\$", "").replace("\\ ", "")
    s = re.sub(r"\\(?:text|textbf|mathrm)\{\s*\}", "", s)
    return "".join(s.split()).rstrip(".")


def _plain_number(s: str) -> Fraction | None:
    """``s`` as an exact rational if it is a plain number (``-1,234.5``, ``3/4``, ``$18``), else ``None``."""
    t = _strip_wrappers(s).lstrip("$")
    if _THOUSANDS.fullmatch(t):
        t = t.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


class _DropTimeoutWarning(logging.Filter):
    """math_verify warns once that its timeouts are off; here that is deliberate (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


@functools.lru_cache(maxsize=8192)
def _mv_parse(latex: str) -> tuple:
    from math_verify import parse

    return tuple(parse(f"\\boxed{{{latex}}}", parsing_timeout=None))


def _mv_verify(gold: str, answer: str) -> bool:
    from math_verify import verify

    g = _mv_parse(gold)
    a = _mv_parse(answer)
    if not g or not a:
        return False
    return bool(verify(list(g), list(a), timeout_seconds=None))


def answers_match(gold: str, answer: str | None) -> bool:
    """Whether the extracted ``answer`` equals the ``gold`` answer (both LaTeX or plain numbers).

    Order: normalised string equality; exact rational comparison when both are plain numbers (decisive);
    else math_verify (timeouts disabled, see the module docstring). Answers that could make SymPy run away
    (:data:`MAX_VERIFY_CHARS`, exponent towers, huge exponents/factorials) only get the string check.
    Never raises: any error while verifying counts as no match.
    """
    if answer is None:
        return False
    answer = answer.strip()
    if not answer:
        return False
    if _strip_wrappers(answer) == _strip_wrappers(gold):
        return True
    g_num, a_num = _plain_number(gold), _plain_number(answer)
    if g_num is not None and a_num is not None:
        return g_num == a_num
    if _too_expensive(answer):
        return False
    try:
        return _mv_verify(gold, answer)
    except Exception:  # noqa: BLE001 - model output must never crash the reward path
        log.debug("math_verify failed on gold=%r answer=%r", gold, answer, exc_info=True)
        return False


# ---------------------------------------------------------------------------------------------- tasks


def _gold_of(prompt: Prompt) -> str:
    gold = prompt.meta.get("answer")
    if not isinstance(gold, str):
        raise ValueError(f"prompt {prompt.pid!r} has no gold answer (meta['answer'])")
    return gold


def _take(rows: list[Prompt], n: int | None) -> list[Prompt]:
    return list(rows) if n is None else list(rows[:n])


def _check_size(label: str, n: int | None) -> None:
    if n is not None and n < 1:
        raise ValueError(f"{label} must be >= 1 or None (got {n})")


class GSM8KTask(Task):
    """GSM8K grade-school word problems; reward 1.0 when the final number equals the gold answer.

    Prompts: ``train.jsonl`` is the training split, ``test.jsonl`` the held-out split (file order;
    ``pid`` ``gsm8k/<split>/<row index>``). ``meta``: ``answer`` (gold, e.g. ``"18"``) and ``solution``
    (the full reference ``answer`` field). Prompt text given to the tokenizer: ``"Question: …\\nAnswer:"``.

    Args:
        n_train: use only the first ``n_train`` training problems (``None``: all 7,473).
        n_heldout: use only the first ``n_heldout`` test problems (``None``: all 1,319).

    Raises:
        ValueError: a size below 1; on first use, a malformed line (file and line number named).
        DataFileMissing: on first use, ``gsm8k/train.jsonl`` or ``gsm8k/test.jsonl`` is absent.

    Source: openai/grade-school-math (``../shared/data/gsm8k``). stories260K cannot solve it.
    """

    name = "gsm8k"
    stop_strings: tuple[str, ...] = ("\nQuestion:",)
    data_files = ("gsm8k/train.jsonl", "gsm8k/test.jsonl")

    def __init__(self, n_train: int | None = None, n_heldout: int | None = None) -> None:
        _check_size("n_train", n_train)
        _check_size("n_heldout", n_heldout)
        self.n_train = n_train
        self.n_heldout = n_heldout
        self._cache: dict[str, list[Prompt]] = {}

    def _load(self, split: str) -> list[Prompt]:
        if split not in self._cache:
            path = data_file(f"gsm8k/{split}.jsonl")
            prompts = []
            for lineno, obj in read_jsonl(path, ("question", "answer")):
                try:
                    gold = gsm8k_gold(str(obj["answer"]))
                except ValueError as e:
                    raise ValueError(f"{path}: line {lineno}: {e}") from None
                prompts.append(
                    Prompt(
                        pid=f"gsm8k/{split}/{len(prompts)}",
                        text=str(obj["question"]),
                        meta={"answer": gold, "solution": str(obj["answer"])},
                    )
                )
            self._cache[split] = prompts
        return self._cache[split]

    def train_prompts(self) -> list[Prompt]:
        return _take(self._load("train"), self.n_train)

    def heldout_prompts(self) -> list[Prompt]:
        return _take(self._load("test"), self.n_heldout)

    def format_prompt(self, prompt: Prompt) -> str:
        return f"Question: {prompt.text.strip()}\nAnswer:"

    def chat_content(self, prompt: Prompt) -> str:
        return f"{prompt.text.strip()}\n{BOXED_INSTRUCTION}"

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """1.0 iff :func:`extract_answer` (GSM8K style) of the response matches the gold number."""
        gold = _gold_of(prompt)
        try:
            return 1.0 if answers_match(gold, extract_answer(response_text, "gsm8k")) else 0.0
        except Exception:  # noqa: BLE001
            log.debug("reward failed for %s", prompt.pid, exc_info=True)
            return 0.0


class GSM8KToolTask(GSM8KTask):
    """GSM8K with a calculator (multi-turn: ``task.turns.max`` > 1): the prompt tells the policy how to call the
    calculator — ``<open>{"name": "calculator", "arguments": {"expression": "..."}}<close>`` with the run's
    ``task.turns.tool_call_open`` / ``task.turns.tool_call_close`` (``tool_syntax``, which the run builds it with;
    None: the default syntax) — and to give the final answer in ``\\boxed{}``. Prompts, splits and reward are
    :class:`GSM8KTask`'s; the reward reads the trajectory's final assistant turn."""

    name = "gsm8k_tools"
    takes_tool_syntax = True

    def __init__(self, n_train: int | None = None, n_heldout: int | None = None, tool_syntax: Any = None) -> None:
        super().__init__(n_train, n_heldout)
        from rlboost_hpc.tasks.tools import ToolSyntax

        self.tool_syntax = tool_syntax if tool_syntax is not None else ToolSyntax()

    def tool_instruction(self) -> str:
        s = self.tool_syntax
        return (f"You have a calculator. To use it, write {s.call_open}{{\"name\": \"calculator\", \"arguments\": "
                f"{{\"expression\": \"<arithmetic>\"}}}}{s.call_close} and stop; its result comes back to you.")

    def format_prompt(self, prompt: Prompt) -> str:
        return f"Question: {prompt.text.strip()}\n{self.tool_instruction()}\nAnswer:"

    def chat_content(self, prompt: Prompt) -> str:
        return f"{prompt.text.strip()}\n{self.tool_instruction()}\n{BOXED_INSTRUCTION}"


class Math500Task(Task):
    """MATH-500 competition problems; reward 1.0 when the last ``\\boxed{}`` answer is equivalent to the gold.

    One file holds all 500 problems: the first ``n_heldout`` (file order) are held out, the rest
    (or their first ``n_train``) train. ``pid`` ``math500/<math_test_idx>``; ``meta``: ``answer`` (gold
    LaTeX), ``subject``, ``level``. Prompt text: ``"Question: …\\nGive the final answer in \\boxed{}.\\nAnswer:"``.

    Args:
        n_heldout: number of held-out problems (default 100; 500 leaves no training split).
        n_train: use only the first ``n_train`` of the remaining problems (``None``: all of them).

    Raises:
        ValueError: ``n_heldout`` outside ``[1, 500]`` or ``n_train`` below 1 (checked on first use
            against the file's size); a malformed line (file and line number named).
        DataFileMissing: on first use, ``math500/math500.jsonl`` is absent.

    Source: HuggingFaceH4/MATH-500 with answers as in Open-Reasoner-Zero (``../shared/data/math500``).
    stories260K cannot solve it.
    """

    name = "math500"
    data_files = ("math500/math500.jsonl",)
    stop_strings: tuple[str, ...] = ("\nQuestion:",)

    def __init__(self, n_heldout: int = 100, n_train: int | None = None) -> None:
        _check_size("n_heldout", n_heldout)
        _check_size("n_train", n_train)
        self.n_heldout = n_heldout
        self.n_train = n_train
        self._rows: list[Prompt] | None = None

    def _load(self) -> list[Prompt]:
        if self._rows is None:
            path = data_file("math500/math500.jsonl")
            rows = []
            seen: set[str] = set()
            for lineno, obj in read_jsonl(path, ("problem", "answer")):
                pid = f"math500/{obj.get('math_test_idx', len(rows))}"
                if pid in seen:
                    raise ValueError(f"{path}: line {lineno}: duplicate problem id {pid!r}")
                seen.add(pid)
                rows.append(
                    Prompt(
                        pid=pid,
                        text=str(obj["problem"]),
                        meta={
                            "answer": str(obj["answer"]),
                            "subject": obj.get("subject"),
                            "level": obj.get("level"),
                        },
                    )
                )
            if self.n_heldout > len(rows):
                raise ValueError(f"n_heldout={self.n_heldout} exceeds the {len(rows)} problems in {path}")
            self._rows = rows
        return self._rows

    def train_prompts(self) -> list[Prompt]:
        return _take(self._load()[self.n_heldout :], self.n_train)

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._load()[: self.n_heldout])

    def format_prompt(self, prompt: Prompt) -> str:
        return f"Question: {prompt.text.strip()}\nGive the final answer in \\boxed{{}}.\nAnswer:"

    def chat_content(self, prompt: Prompt) -> str:
        return f"{prompt.text.strip()}\n{BOXED_INSTRUCTION}"

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """1.0 iff :func:`extract_answer` (math style) of the response is equivalent to the gold LaTeX."""
        gold = _gold_of(prompt)
        try:
            return 1.0 if answers_match(gold, extract_answer(response_text, "math")) else 0.0
        except Exception:  # noqa: BLE001
            log.debug("reward failed for %s", prompt.pid, exc_info=True)
            return 0.0
