"""Sealed chunks: weight bytes encrypted once per send with AES-256-GCM instead of by ZeroMQ CURVE.

CURVE (libsodium's XSalsa20-Poly1305, run by libzmq's I/O threads) authenticates and encrypts every frame on the
I/O thread that owns the connection: ~1 GB/s per connection on a 16-core machine, a 0.22× cap on a plain pull.
AES-256-GCM with the CPU's AES and carry-less-multiply instructions runs at 7–10 GB/s per core and releases the
GIL, and a sealed chunk is opened straight into the receive buffer (the copy a plain pull makes anyway).

Protocol (the messages live in :mod:`rlboost_hpc.protocol.weight_msgs`):

- Each published version gets a fresh random 256-bit key and a 128-bit ticket (:func:`new_access`). Both travel
  only inside the version's :class:`~rlboost_hpc.protocol.weight_msgs.Manifest` (``sealed``), which a holder sends
  only over its CURVE socket — so only a client holding the run's CURVE client key learns them.
- The holder also listens on a plain TCP port (``Sealed.port``) where it answers ``GetChunk`` requests that carry
  the version's ticket, with the chunk sealed under the version's key: a random 96-bit nonce (in the ``Chunk``
  header), the ciphertext and a 16-byte tag, bound by the associated data to (version, chunk index, delta base).
  Manifests are never served there.
- Relay holders adopt the key and ticket of the version they hold (they pulled its manifest from the trainer).

Guarantees (the CURVE ones, for the weight bytes): an unauthenticated peer cannot read weights (it sees only
ciphertext; the key never leaves CURVE), nor inject any (a frame that does not open under the version's key and
its own version/index/base is rejected before a byte reaches the buffer; every chunk is then still checked
against the trainer's xxh3 checksum). Random nonces: a key seals at most chunks × pullers × retries frames per
version (≈ 10⁶ for a 16 GB model and 64 pullers), far below the 2³² bound for random GCM nonces. What it does
not prevent, like any open port: a network eavesdropper who saw a ticket can make the holder send ciphertext.
"""
from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32  #: AES-256
TICKET_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16  #: a sealed frame is the plaintext's length plus this

_AAD = struct.Struct("<16sQQq")
_DOMAIN = b"rlboost-weights\x00"
_NOT_OPEN = ("the sealed frame does not open under the version's key (tampered, or another version's, chunk's "
             "or base's)")


class SealError(ValueError):
    """A sealed frame did not open: wrong key, tampered bytes, or a frame of another version/chunk/base."""


def new_access() -> tuple[bytes, bytes]:
    """A fresh (key, ticket) pair for one version: 32 and 16 random bytes from the OS."""
    return AESGCM.generate_key(bit_length=256), os.urandom(TICKET_BYTES)


def _aad(version: int, index: int, base: int | None) -> bytes:
    return _AAD.pack(_DOMAIN, version, index, -1 if base is None else base)


class Sealer:
    """Seals and opens the chunks of one version under its key (thread-safe; no state besides the key)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealing key has {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)

    def seal(self, plaintext: "bytes | memoryview", version: int, index: int, base: int | None = None
             ) -> tuple[bytes, bytes]:
        """``(nonce, frame)``: ``plaintext`` encrypted and authenticated for chunk ``index`` of ``version`` (its delta
        payload against ``base`` when given); ``frame`` has ``len(plaintext) + TAG_BYTES`` bytes."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, plaintext, _aad(version, index, base))

    def open_into(self, nonce: bytes, frame: "bytes | memoryview", version: int, index: int, base: int | None,
                  dest: memoryview) -> None:
        """Decrypt ``frame`` into ``dest`` (exactly ``len(frame) - TAG_BYTES`` bytes) after checking its tag.

        Raises:
            SealError: the frame does not open under this key for (version, index, base), or has the wrong size
                (``dest`` is then left unspecified: the caller fetches the chunk again).
        """
        if len(nonce) != NONCE_BYTES or len(frame) != len(dest) + TAG_BYTES:
            raise SealError(f"sealed frame of {len(frame)} bytes with a {len(nonce)}-byte nonce for a "
                            f"{len(dest)}-byte chunk")
        try:
            self._aead.decrypt_into(nonce, frame, _aad(version, index, base), dest)
        except InvalidTag:
            raise SealError(_NOT_OPEN) from None

    def open(self, nonce: bytes, frame: "bytes | memoryview", version: int, index: int, base: int | None) -> bytes:
        """The plaintext of a sealed delta payload (a new ``bytes``). Raises SealError like :meth:`open_into`."""
        if len(nonce) != NONCE_BYTES:
            raise SealError(f"sealed frame with a {len(nonce)}-byte nonce")
        try:
            return self._aead.decrypt(nonce, frame, _aad(version, index, base))
        except InvalidTag:
            raise SealError(_NOT_OPEN) from None
