"""A version as a weight holder serves it (:class:`Held`): manifest, reply frames, buffer, delta, sealer."""
from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from rlboost_hpc.protocol.weight_msgs import GetManifest, Manifest, encode
from rlboost_hpc.weights import delta as delta_codec
from rlboost_hpc.weights import sealed as sealing


def reply_frames(manifest: Manifest) -> tuple[bytes, bytes]:
    """The manifest's reply frames: whole, and without its tensor table (for pullers holding its layout)."""
    whole = encode(manifest)
    return whole, whole if manifest.layout is None else encode(msgspec.structs.replace(manifest, tensors=None))


@dataclass(frozen=True)
class Held:
    """One version a holder serves: its manifest (and reply frames), buffer, delta and sealer."""

    manifest: Manifest
    manifest_frames: tuple[bytes, bytes]  # (whole, without the table): :func:`reply_frames`
    buffer: torch.Tensor  # uint8, 1-D, total_bytes
    view: memoryview  # of buffer (read-only), for zero-copy chunk frames
    n_chunks: int
    delta: "delta_codec.Delta | None" = None  # against the version published before, when worth it
    delta_manifest_frames: tuple[bytes, bytes] | None = None  # the manifest with its DeltaInfo
    sealer: "sealing.Sealer | None" = None  # under manifest.sealed.key, when the version is served sealed

    def manifest_frame(self, req: GetManifest) -> bytes:
        """The reply to ``req``: with the delta when it asks from the delta's base, without the table when it
        holds this layout."""
        frames = self.delta_manifest_frames if self.delta_manifest_frames is not None and self.delta is not None \
            and req.base == self.delta.base_version else self.manifest_frames
        return frames[1] if req.layout is not None and req.layout == self.manifest.layout else frames[0]
