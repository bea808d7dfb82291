"""A weight version's identity: one type wherever a version travels (trainer → manager → instance, the lineage).

A version is named by its number *and* its whole-version checksum (xxh3 over its chunks' checksums,
``weights/store.py``; in a LoRA run the adapter's checksum combined with the base's, ``protocol/adapter.py``) — never
by the number alone: a trainer resumed from an older checkpoint makes versions whose numbers live instances may
already hold, made by other weights. A checksum of 0 means "not known" (a trainer that gave none).

The wire messages keep the two fields flat (``version``, ``checksum``: two varints) and give this type back as their
``identity``.
"""
from __future__ import annotations

import msgspec

__all__ = ["NO_VERSION", "VersionId"]


class VersionId(msgspec.Struct, frozen=True):
    """``number``: the version (≥ 0; -1: none); ``checksum``: its whole-version checksum (unsigned 64-bit; 0: not
    known)."""

    number: int
    checksum: int = 0

    def same_weights(self, other: "VersionId") -> bool:
        """Whether the two name the same weights: the same number, and — where both checksums are known — the same
        checksum (an unknown one on either side leaves the number to decide)."""
        both = self.checksum and other.checksum
        return self.number == other.number and not (both and self.checksum != other.checksum)

    def __str__(self) -> str:
        return f"{self.number} (checksum {self.checksum:016x})" if self.checksum else str(self.number)


#: No version held or announced yet.
NO_VERSION = VersionId(-1, 0)
