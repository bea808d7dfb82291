"""A reward function beside the environment's own reward (TRL's batched signature): the final turn names a
direction. The run adds it to the environment's term by task.rewards.weights."""
from __future__ import annotations


def names_a_direction(prompts, completions, **columns) -> list[float]:
    """1.0 when the final assistant turn says "up" or "down"."""
    return [1.0 if ("up" in c.lower().split() or "down" in c.lower().split()) else 0.0 for c in completions]
