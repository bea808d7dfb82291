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

from rlboost_hpc.trainer.algorithms.grpo import GRPOOptions, finish_stats, gradient_scale, merge_stats


@dataclass
class Sample:
    """One trained response: prompt and response ids (int), behaviour logprobs (float32, len = response: the rollout
    engine's log π_beh of each generated token, 0 for observation tokens), and its GRPO advantage (float).
    ``loss_mask`` (bool, len = response; None = all True): which response tokens the policy generated and are
    trained — a multi-turn trajectory's observation tokens are False (context only: no loss, no logprob comparison).
    ``finish_reason``: why the response (or trajectory) ended, one of
    :data:`rlboost_hpc.protocol.messages.FINISH_REASONS` (``stop`` or a truncation cause). ``staleness`` (int, len =
    response; None under strict on-policy): versions between each token's producer and the version trained."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    loss_mask: list[bool] | None = None
    finish_reason: str = "stop"
    staleness: list[int] | None = None

    @property
    def truncated(self) -> bool:
        """Cut by a budget (max_new_tokens, the turn cap, the trajectory budget) rather than ended by the model."""
        return self.finish_reason != "stop"

    def generated_tokens(self) -> int:
        """Response tokens the policy generated (those of ``loss_mask``, else all)."""
        return len(self.response_ids) if self.loss_mask is None else sum(map(bool, self.loss_mask))


class StepAccumulator:
    """What a backend keeps between the micro-batches of one RL step and applies at its optimizer step: the step's
    responses and loss tokens (``token_mean``'s normaliser, known only once every group arrived) and the merged loss
    statistics of :func:`~rlboost_hpc.trainer.algorithms.grpo.grpo_loss`."""

    def __init__(self, objective: GRPOOptions) -> None:
        self.objective = objective
        self.responses, self.loss_tokens, self.stats = 0, 0, {}

    def add_batch(self, batch: list[Sample], responses_in_step: int) -> None:
        """Count a micro-batch (all of it: every rank of a distributed backend sees the whole batch)."""
        self.responses = responses_in_step
        skip = self.objective.mask_truncated
        self.loss_tokens += sum(s.generated_tokens() for s in batch if not (skip and s.truncated))

    def add_stats(self, stats: dict[str, float]) -> None:
        """Merge a micro-batch's (or replica's) :func:`~rlboost_hpc.trainer.algorithms.grpo.stats_to_floats`."""
        self.stats = merge_stats(self.stats, stats)

    def gradient_scale(self) -> float:
        """:func:`~rlboost_hpc.trainer.algorithms.grpo.gradient_scale` of the step so far."""
        return gradient_scale(self.objective, self.responses, self.loss_tokens)

    def finish(self) -> dict[str, float]:
        """The step's loss metrics (:func:`~rlboost_hpc.trainer.algorithms.grpo.finish_stats`, ``{}`` where no
        stats were added); starts the next step."""
        out = finish_stats(self.stats) if self.stats else {}
        self.responses, self.loss_tokens, self.stats = 0, 0, {}
        return out


def behaviour_tensor(batch: list[Sample], shape: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, L-1]`` float32 behaviour logprobs at the predicted positions of :func:`~rlboost_hpc.trainer.backends.
    torch_backend.pack`'s layout (position P−1+k predicts response token k; 0 elsewhere)."""
    beh = torch.zeros(shape, dtype=torch.float32)
    for i, s in enumerate(batch):
        P = len(s.prompt_ids)
        beh[i, P - 1 : P - 1 + len(s.response_ids)] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    return beh.to(device)


def staleness_tensor(batch: list[Sample], shape: tuple[int, int], device: torch.device | str = "cpu"
                     ) -> torch.Tensor | None:
    """``[B, L-1]`` int64 staleness of each response token at :func:`behaviour_tensor`'s positions (0 elsewhere);
    None when no sample carries one (strict on-policy)."""
    if all(s.staleness is None for s in batch):
        return None
    st = torch.zeros(shape, dtype=torch.int64)
    for i, s in enumerate(batch):
        if s.staleness is not None:
            P = len(s.prompt_ids)
            st[i, P - 1 : P - 1 + len(s.response_ids)] = torch.tensor(s.staleness, dtype=torch.int64)
    return st.to(device)


def truncated_tensor(batch: list[Sample], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B]`` bool: which samples were truncated."""
    return torch.tensor([s.truncated for s in batch], dtype=torch.bool, device=device)


class TrainerBackend(abc.ABC):
    """What the RL loop (``trainer/loop.py``), checkpoints (``trainer/checkpoint.py``) and the run use of a training
    framework — nothing else is called on a backend."""

    @abc.abstractmethod
    def accumulate(self, batch: list[Sample], responses_in_step: int) -> dict[str, float]:
        """Forward + backward of one micro-batch, adding its share of the step loss to the gradients.

        ``responses_in_step`` is the total number of responses of the RL step (the 1/G·Σ normaliser; ``token_mean``
        rescales at :meth:`optimizer_step`), so any split into micro-batches yields the same gradient. Returns the
        micro-batch's metrics: ``loss`` (its loss sum ÷ responses_in_step), ``tokens`` (generated tokens) and those of
        :func:`~rlboost_hpc.trainer.algorithms.grpo.finish_stats` (clip_frac, kl, ratio_max, logprob_diff = mean
        |trainer logprob − behaviour logprob| over generated tokens, and the other mismatch figures).
        """

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Scale gradients to the step's normaliser (:class:`StepAccumulator`), clip, step, zero gradients. Returns
        ``grad_norm``, ``lr`` and the whole step's loss metrics (as :meth:`accumulate`'s, over every micro-batch;
        ``logprob_diff_max`` and ``ratio_max`` the step's largest)."""

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
