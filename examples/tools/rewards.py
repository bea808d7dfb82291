"""The reward of the tools example (TRL's batched signature): dialogue in the story's final turn, and a bonus when
the trajectory used a tool's answer (the final turn mentions the glossary's word it asked about)."""
from __future__ import annotations


def dialogue(prompts, completions, **columns) -> list[float]:
    """1.0 when the final assistant turn holds a double quote."""
    return [1.0 if '"' in c else 0.0 for c in completions]


def mentions_topic(prompts, completions, topic, **columns) -> list[float]:
    """1.0 when the final turn mentions the row's ``topic`` word (which the dictionary tool explains)."""
    return [1.0 if t in c.lower() else 0.0 for c, t in zip(completions, topic)]
