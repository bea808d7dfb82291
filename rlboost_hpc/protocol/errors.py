"""Errors of the wire protocol.

Invariant: every byte string that arrives from a socket and cannot be turned into a known, valid message
raises :class:`ProtocolError` (never a bare msgspec/struct/Unicode error), so that a receiver can reject the
frame, count it by :attr:`ProtocolError.reason` and keep serving.
"""
from __future__ import annotations


class ProtocolError(ValueError):
    """A frame could not be decoded into a known, valid message.

    The message says why; ``reason`` classifies it for counters: ``"oversized"`` (above the size limit,
    checked before parsing), ``"empty"``, ``"malformed"`` (not msgpack, truncated, huge declared lengths),
    ``"invalid"`` (unknown message tag, a message of the other direction, wrong field type or range,
    an inconsistent manifest), ``"framing"`` (wrong number of frames).
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason
