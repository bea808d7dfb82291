"""What a rollout engine's weights come from: the one description of a pulled version (:class:`PulledVersion`) and of
a LoRA run's loaded base (:class:`BaseWeights`), the contract of a weight source (:class:`WeightSource`) and the one
rule for a version's identity (:func:`identity`) — between the sources (a worker's network pulls, the trainer's
shared memory for its reserved engines, the trainer's own publisher) and the agent that loads what they give.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from rlboost_hpc.protocol.adapter import AdapterSpec
from rlboost_hpc.protocol.auth import RunKeys

if TYPE_CHECKING:
    import torch

    from rlboost_hpc.models.arch import ModelArch

__all__ = ["BaseWeights", "PulledVersion", "WeightSource", "identity"]


def identity(checksum: int, adapter: AdapterSpec | None) -> int:
    """A version's identity from the whole-version checksum of its bytes, as the trainer announces it: that checksum,
    or (a LoRA run, ``adapter``) the adapter's combined with the base's (:meth:`AdapterSpec.version_checksum`)."""
    return checksum if adapter is None else adapter.version_checksum(checksum)


@dataclass(frozen=True)
class BaseWeights:
    """The base an instance loaded: its HF-named tensors (views of one buffer, or the trainer's own tensors), its
    checksum and wire bytes, where it came from (``"path"``, ``"cache"``, ``"pull"`` or ``"trainer"``), the seconds
    it took and the bytes received over the network for it (0 unless pulled)."""

    state_dict: "Mapping[str, torch.Tensor]"
    checksum: int
    nbytes: int
    source: str
    seconds: float = 0.0
    wire_bytes: int = 0


@dataclass(frozen=True)
class PulledVersion:
    """What a weight source hands the rollout agent for one version — the one description of a pulled version
    between them. ``state_dict``: name → tensor (views the engine copies from while loading); ``checksum``: the
    whole-version checksum (0: not known); ``nbytes``: bytes of the full version; ``pull_s``: seconds the source
    took; ``wire_bytes``: bytes received over the network for it (less than ``nbytes`` for a delta; 0 when nothing
    moved, e.g. a view of the trainer's own buffer); ``phases``: the pull's own figures (seconds per phase, bytes
    from relay peers, delta chunks: ``WeightPuller``'s ``PulledWeights.phases``; empty for other sources)."""

    state_dict: Mapping
    checksum: int = 0
    nbytes: int = 0
    pull_s: float = 0.0
    wire_bytes: int = 0
    phases: Mapping[str, float] = field(default_factory=dict)


class WeightSource(Protocol):
    """Where a rollout agent's weight versions come from (:class:`~rlboost_hpc.rollout.remote_weights.RemoteWeights`
    over the network; :class:`~rlboost_hpc.rollout.shared_weights.SharedVersions` for the trainer's reserved engines;
    the trainer's :class:`~rlboost_hpc.trainer.publisher.WeightPublisher` for its own process)."""

    def pull(self, endpoint: str, version: int, *, peers: Sequence[str] = (), keys: RunKeys | None = None,
             shards: str = "", checksum: int = 0, adapter: AdapterSpec | None = None) -> PulledVersion:
        """``version`` from the holder at ``endpoint`` (the manager's ``Welcome``), through relay ``peers`` where
        the manager named some, as a CURVE client of ``keys``; ``shards``: the assembly manifest (JSON) of a
        sharded version ("" for one holder); ``checksum``: the version's identity the manager announced (0: not
        known; with ``adapter``, a LoRA run's, :func:`identity`) — a holder's version of that number with another
        identity (another lineage) is refused. Raises on failure (the agent reports the error to the manager)."""
        ...

    def base(self, spec: AdapterSpec, arch: "ModelArch", *, keys: RunKeys | None = None,
             label: str = "") -> BaseWeights:
        """A LoRA run's base for this instance (:func:`~rlboost_hpc.weights.lora_base.fetch_base`). Raises
        :class:`~rlboost_hpc.weights.lora_base.BaseMismatch` when this node can only load another base."""
        ...
