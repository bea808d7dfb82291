"""The llama2.c tokenizer (``tok512.bin``): encode/decode exactly as llama2.c's ``run.c`` does.

Invariants:
- :meth:`Llama2cTokenizer.encode` is llama2.c's ``encode``: optional BOS, then (for non-empty text) a dummy
  prefix space, each UTF-8 code point mapped to its piece or, if absent, to byte-fallback ids ``byte + 3``,
  then repeatedly merge the adjacent pair whose concatenation is a piece with the highest score (leftmost
  pair on ties), optional EOS. For text without repeated spaces this equals SentencePiece on
  ``tok512.reconstructed.model``.
- :meth:`Llama2cTokenizer.decode` concatenates piece bytes (``<0xNN>`` pieces as the raw byte), drops BOS/EOS,
  strips the leading space of a piece that follows BOS (llama2.c's rule), and decodes UTF-8 with replacement.
  ``decode(encode(t, bos=True)) == t`` for any text ``t`` whose first character is not a space.
- Ids are ids: the tokenizer is only used at the edges (prompts in, text for rewards/logs out); the engine
  never re-tokenises.
"""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Iterable

from rlboost_hpc.models.arch import ModelFormatError
from rlboost_hpc.paths import unreadable

__all__ = ["Llama2cTokenizer"]

_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")


class Llama2cTokenizer:
    """A llama2.c BPE tokenizer (pieces, merge scores, byte fallback at ids 3..258).

    Attributes:
        pieces: list of ``bytes``, one per id.
        scores: list of float merge scores, one per id.
        vocab_size: number of ids.
        bos_id / eos_id: 1 / 2.
    """

    bos_id: int = 1
    eos_id: int = 2
    byte_offset: int = 3

    def __init__(self, pieces: list[bytes], scores: list[float], max_token_length: int = 0) -> None:
        if len(pieces) != len(scores):
            raise ValueError(f"{len(pieces)} pieces but {len(scores)} scores")
        if len(pieces) < self.byte_offset + 256:
            raise ModelFormatError(f"vocabulary of {len(pieces)} pieces has no byte fallback (needs ≥ 259)")
        self.pieces = list(pieces)
        self.scores = [float(s) for s in scores]
        self.vocab_size = len(pieces)
        self.max_token_length = max_token_length
        # First id of each piece (llama2.c's bsearch over a sorted vocab; pieces are unique in practice).
        self._lookup: dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self._lookup.setdefault(p, i)
        # Raw bytes each id decodes to.
        self._bytes: list[bytes] = []
        for p in self.pieces:
            m = _BYTE_PIECE.match(p)
            self._bytes.append(bytes([int(m.group(1), 16)]) if m else p)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], vocab_size: int | None = None) -> "Llama2cTokenizer":
        """Read a llama2.c ``tokenizer.bin`` (uint32 max_token_length, then per id: f32 score, i32 len, bytes).

        ``vocab_size``: number of ids to read; default: read entries until the file ends.

        Raises:
            ModelFormatError: the file is missing, truncated or has a negative/oversized piece length.
        """
        p = Path(path)
        why = unreadable(p)
        if why is not None:  # "not found" only when it is not there
            raise ModelFormatError(f"{p}: tokenizer file {why}")
        raw = p.read_bytes()
        if len(raw) < 4:
            raise ModelFormatError(f"{p}: file too short: expected at least 4 bytes, got {len(raw)}")
        (max_len,) = struct.unpack_from("<I", raw, 0)
        off = 4
        pieces: list[bytes] = []
        scores: list[float] = []
        while off < len(raw) and (vocab_size is None or len(pieces) < vocab_size):
            if off + 8 > len(raw):
                raise ModelFormatError(f"{p}: truncated entry {len(pieces)} at byte {off} (file has {len(raw)} bytes)")
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            if n < 0 or off + n > len(raw):
                raise ModelFormatError(
                    f"{p}: entry {len(pieces)} claims {n} bytes at offset {off}, file has {len(raw)} bytes"
                )
            pieces.append(raw[off:off + n])
            scores.append(score)
            off += n
        if vocab_size is not None and len(pieces) != vocab_size:
            raise ModelFormatError(f"{p}: expected {vocab_size} entries, file holds {len(pieces)}")
        return cls(pieces, scores, max_len)

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (llama2.c rules). Returns a list of ints in ``[0, vocab_size)``."""
        ids: list[int] = [self.bos_id] if bos else []
        body: list[int] = []
        if text:
            body.append(self._lookup[b" "])  # dummy prefix, as SentencePiece's add_dummy_prefix
        for ch in text:
            b = ch.encode("utf-8", errors="surrogatepass")
            i = self._lookup.get(b)
            if i is not None:
                body.append(i)
            else:
                body.extend(self.byte_offset + x for x in b)
        self._merge(body)
        ids.extend(body)
        if eos:
            ids.append(self.eos_id)
        return ids

    def _merge(self, toks: list[int]) -> None:
        """Greedy highest-score adjacent-pair merging, in place (leftmost best pair wins ties)."""
        pieces, scores, lookup = self.pieces, self.scores, self._lookup
        # pair_id[i]: merged id of (toks[i], toks[i+1]) or -1
        pair = [lookup.get(pieces[toks[i]] + pieces[toks[i + 1]], -1) for i in range(len(toks) - 1)]
        while True:
            best_score, best_i = -1e10, -1
            for i, pid in enumerate(pair):
                if pid >= 0 and scores[pid] > best_score:
                    best_score, best_i = scores[pid], i
            if best_i < 0:
                return
            toks[best_i] = pair[best_i]
            del toks[best_i + 1]
            del pair[best_i]
            if best_i > 0:
                pair[best_i - 1] = lookup.get(pieces[toks[best_i - 1]] + pieces[toks[best_i]], -1)
            if best_i < len(toks) - 1:
                pair[best_i] = lookup.get(pieces[toks[best_i]] + pieces[toks[best_i + 1]], -1)

    # ------------------------------------------------------------------ decode
    def decode_piece(self, prev_id: int, token_id: int) -> bytes:
        """llama2.c's ``decode(prev, token)``: raw bytes of ``token_id`` (leading space stripped after BOS)."""
        b = self.pieces[token_id]
        if prev_id == self.bos_id and b[:1] == b" ":
            b = b[1:]
        m = _BYTE_PIECE.match(b)
        return bytes([int(m.group(1), 16)]) if m else b

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of ``ids`` (BOS/EOS dropped, llama2.c's after-BOS space rule applied)."""
        out = bytearray()
        prev = -1
        for t in ids:
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} out of range [0, {self.vocab_size})")
            if t not in (self.bos_id, self.eos_id):
                out += self.decode_piece(prev, t)
            prev = t
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: BOS/EOS skipped, ``<0xNN>`` pieces as bytes, invalid UTF-8 replaced by U+FFFD.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
