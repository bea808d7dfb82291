"""What a rollout instance must know about a LoRA run, on the wire: :class:`AdapterSpec`.

With ``trainer.lora`` a weight version is an *adapter*: the LoRA tensors of every targeted linear layer
(``model.layers.<i>.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``, the names PEFT saves
without its ``base_model.model.`` prefix), served, checksummed, sealed, relayed and pulled exactly as a full version
is. The base model never changes during a run; its identity is the whole-version checksum of its wire bytes
(:attr:`AdapterSpec.base_checksum`: the base published in ``base_dtype`` with ``base_chunk_bytes`` chunks, as any
version is), and the checksum the manager routes by is the adapter's combined with it
(:func:`adapter_version_checksum`), so an instance serving an adapter on another base never matches.

The trainer sends the spec in ``TrainerHello``; the manager forwards it in every ``Welcome`` (and journals it with
the hello). An empty spec (``None``) means a run that trains every weight.
"""
from __future__ import annotations

import msgspec

from rlboost_hpc.protocol.weight_msgs import combine_checksums

__all__ = ["AdapterSpec", "EMULATED_BASE", "adapter_version_checksum"]

#: ``AdapterSpec.base_path`` of an emulated base (``trainer.backend = "emulated"``): no tensors — an emulated engine
#: spends the modelled time of loading ``base_bytes`` instead (load tests at a production shape).
EMULATED_BASE = "emulated:"


class AdapterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A LoRA run's adapter and the base it applies to.

    Attributes:
        rank: r, the adapter rank (≥ 1). alpha: PEFT's ``lora_alpha`` (the update is scaled by alpha / r).
        targets: the HF linear modules adapted in every decoder layer, short names in model order
            (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``).
        base_checksum: the base's whole-version checksum (xxh3 of its chunk checksums) in ``base_dtype`` with
            ``base_chunk_bytes`` chunks; base_bytes: its wire size in bytes.
        base_path: the model directory as the trainer names it (a node that sees it loads the base from there);
            "" when it has none.
        base_endpoint: the trainer's base server (one version, the base: the pull of a node that does not see
            ``base_path``); "" when the trainer serves none.
        max_adapters: adapter versions an engine keeps servable at once (k + 1 under ``rollout.max_staleness`` k).
    """

    rank: int
    alpha: float
    targets: list[str]
    base_checksum: int
    base_bytes: int
    base_dtype: str = "bfloat16"
    base_chunk_bytes: int = 4 << 20
    base_path: str = ""
    base_endpoint: str = ""
    max_adapters: int = 1

    @property
    def scaling(self) -> float:
        """The factor of the adapter's update ``B·A·x``: alpha / rank (PEFT without rsLoRA)."""
        return float(self.alpha) / float(self.rank)

    def version_checksum(self, adapter_checksum: int) -> int:
        """The checksum of an adapter version on this base (:func:`adapter_version_checksum`)."""
        return adapter_version_checksum(adapter_checksum, self.base_checksum)


def adapter_version_checksum(adapter_checksum: int, base_checksum: int) -> int:
    """The identity of an adapter version applied to a base: the checksum of the pair (adapter's whole-version
    checksum, base's), so a different base or a different adapter gives a different value (unsigned 64-bit)."""
    return combine_checksums([int(adapter_checksum), int(base_checksum)])
