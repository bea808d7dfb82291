"""Two tools of a user's own (``task.turns.tools``): plain functions; their type hints and docstrings are the JSON
schema the chat template shows the model (transformers' ``get_json_schema``). They run in the manager's tool
processes, in the trainer's allocation, each call under ``task.turns.timeout_s``."""
from __future__ import annotations

GLOSSARY = {
    "dragon": "a big, friendly creature that can fly",
    "castle": "a large stone house where a king and queen live",
    "picnic": "a meal eaten outside on a blanket",
    "rainbow": "an arc of colours in the sky after the rain",
}


def dictionary(word: str) -> str:
    """Explain a word a child might not know.

    Args:
        word: the word to explain, e.g. "castle".
    """
    return GLOSSARY.get(word.strip().lower(), f"I do not know the word {word!r}")


def count_letters(word: str, letter: str) -> int:
    """Count how many times a letter appears in a word.

    Args:
        word: the word to look at.
        letter: the single letter to count.
    """
    return word.lower().count(letter.lower())
