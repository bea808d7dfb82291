"""The trainer-backend interface: what the RL loop needs from a training framework.

The CPU torch backend implements it here; the Megatron-core backend (``megatron_bridge/``) implements the
same contract. Invariant: a backend never talks to sockets or the manager; it computes logprobs, accumulates
gradients of micro-batches and steps its optimizer, and exports full HF-named weights for publication.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch


@dataclass
class Sample:
    """One trained response: prompt and response ids (int), behaviour logprobs (float32, len = response),
    and its GRPO advantage (float). ``loss_mask`` (bool, len = response; None = all True): which response tokens
    the policy generated and are trained — a multi-turn trajectory's observation tokens are False (context only:
    no loss, no logprob comparison)."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    loss_mask: list[bool] | None = None


class TrainerBackend(abc.ABC):
    """What the RL loop (``trainer/loop.py``), checkpoints (``trainer/checkpoint.py``) and the run use of a training
    framework — nothing else is called on a backend."""

    @abc.abstractmethod
    def accumulate(self, batch: list[Sample], responses_in_step: int) -> dict[str, float]:
        """Forward + backward of one micro-batch, adding its share of the step loss to the gradients.

        ``responses_in_step`` is the total number of responses of the RL step (the 1/G·Σ normaliser), so any
        split into micro-batches yields the same gradient. Returns metrics (loss, clip_frac, kl, logprob_diff
        = mean |trainer logprob − behaviour logprob| over tokens, tokens).
        """

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip gradients, step, zero gradients. Returns ``grad_norm`` and ``lr``."""

    @abc.abstractmethod
    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """The current policy weights with Hugging Face names (fp32 views; the publisher casts)."""

    @abc.abstractmethod
    def token_logprobs(self, batch: list[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """No-grad logprobs of each response's tokens under the policy (or the frozen reference):
        a list of [len(response)] float32 tensors."""

    @abc.abstractmethod
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """No-grad full-vocabulary fp32 logits ``[B, T, V]`` of the policy for ``input_ids`` (``[B, T]`` int, no
        padding), on the CPU — what an exported model must reproduce (a check and monitoring path, never the RL
        loop's). Collective for distributed backends: the result on the rank that runs the loop, None elsewhere."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str | os.PathLike, extra_state: Mapping | None = None) -> None:
        """Write model and optimizer state (and ``extra_state``, plain data) into the directory ``path`` (created);
        collective for distributed backends. Restored by :meth:`load_checkpoint` with the same layout."""

    def checkpoint_writer(self, path: str | os.PathLike) -> Callable[[], None]:
        """Capture the state :meth:`save_checkpoint` would write into ``path``, now; return the function that
        writes it, which may run in another thread while training goes on (the captured state never changes).
        Default: write now (collective backends save together) and return a no-op."""
        self.save_checkpoint(path)
        return lambda: None

    @abc.abstractmethod
    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore what :meth:`save_checkpoint` wrote into ``path``; returns its ``extra_state`` ({} if none)."""

    #: The assembly manifest (:mod:`rlboost_hpc.weights.sharded`) when the backend serves its own weight shards —
    #: one weight server per model-parallel holder rank — else None (the run publishes :meth:`export_weights`).
    shard_manifest: dict | None = None
    #: :meth:`export_weights` calls that gathered pieces from other ranks (0 for a single-process backend).
    gathered_exports: int = 0

    def publish_shards(self, version: int) -> dict:
        """Every holder publishes its own pieces as ``version`` (collective for distributed backends). Returns, on
        the rank that runs the RL loop, ``{"publish_s", "bytes" (one full version), "update_bytes" (what a puller
        holding the previous version receives), "checksum" (``weights.sharded.version_checksum``), "per_rank"}``.
        Only called when :attr:`shard_manifest` is set. Raises RuntimeError otherwise."""
        raise RuntimeError(f"{type(self).__name__} does not serve weight shards")

    def shard_stats(self) -> list[dict]:
        """Per holder: ``{"rank", "position", "bytes_served", "delta_bytes_served", "chunks_served", "publishes"}``
        (bytes: full chunks / delta payloads sent). Collective for distributed backends; [] without shards."""
        return []

    def close(self) -> None:
        """Release what the backend holds beyond memory (process groups, servers). Idempotent; default: nothing."""
