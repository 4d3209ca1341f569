"""The only home of genolong's token ids, lookup tables and complement table.

One base is one token. Token ids fit in 4 bits so that a store compresses well and the model's
vocabulary stays tiny:

====  =====  ==========================================================
id    base   meaning
====  =====  ==========================================================
0     (pad)  padding; never in a store
1     A
2     C
3     G
4     T
5     N      unknown base, or an IUPAC ambiguity code (R, Y, ...)
6     (bos)  reserved special token (beginning of sequence)
7     (eos)  reserved special token (end of sequence)
+8           soft-mask flag: lowercase in the FASTA (a=9, c=10, g=11, t=12, n=13)
====  =====  ==========================================================

The store keeps case (UCSC soft-masks repeats in lowercase); the model sees ``token & BASE_MASK``
(uppercase) and the loss reads ``token & SOFTMASK`` for its soft-mask weight.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PAD",
    "A",
    "C",
    "G",
    "T",
    "N",
    "BOS",
    "EOS",
    "SOFTMASK",
    "BASE_MASK",
    "VOCAB_SIZE",
    "STORE_ALPHABET",
    "IUPAC_AMBIGUITY",
    "INVALID",
    "AMBIGUOUS",
    "ENCODE_LUT",
    "ENCODE_TABLE",
    "DECODE_LUT",
    "COMPLEMENT_LUT",
    "encode",
    "decode",
    "reverse_complement",
    "is_n",
]

PAD = 0
A = 1
C = 2
G = 3
T = 4
N = 5
BOS = 6
EOS = 7
SOFTMASK = 8
BASE_MASK = 7
VOCAB_SIZE = 8  # what the model embeds: pad, A, C, G, T, N, bos, eos (case stripped)

#: Token id -> base letter for every id a store may hold (used in the manifest).
STORE_ALPHABET: dict[int, str] = {
    A: "A",
    C: "C",
    G: "G",
    T: "T",
    N: "N",
    A | SOFTMASK: "a",
    C | SOFTMASK: "c",
    G | SOFTMASK: "g",
    T | SOFTMASK: "t",
    N | SOFTMASK: "n",
}

#: IUPAC nucleotide ambiguity codes (uppercase); each becomes N (case kept) and is counted.
IUPAC_AMBIGUITY = b"RYSWKMBDHV"

#: Sentinel ids that the first-pass table produces and that never reach a store.
INVALID = 255  # any byte that is not a base letter: an error naming the record and line
AMBIGUOUS = 6  # IUPAC ambiguity code, uppercase (AMBIGUOUS | SOFTMASK for lowercase); -> N


def _build_encode_lut() -> np.ndarray:
    lut = np.full(256, INVALID, dtype=np.uint8)
    for letter, token in ((b"A", A), (b"C", C), (b"G", G), (b"T", T), (b"N", N)):
        lut[letter[0]] = token
        lut[letter.lower()[0]] = token | SOFTMASK
    for code in IUPAC_AMBIGUITY:
        lut[code] = AMBIGUOUS
        lut[code + 32] = AMBIGUOUS | SOFTMASK
    return lut


#: byte -> token id for a first pass over raw sequence bytes. Ambiguity codes map to the sentinel
#: ``AMBIGUOUS`` (so that they can be counted in the same pass), everything else that is not a base
#: to ``INVALID``. Call ``resolve_ambiguous`` afterwards to turn the sentinels into N.
ENCODE_LUT: np.ndarray = _build_encode_lut()
#: The same table as bytes, for ``bytes.translate`` (one C pass that also deletes line breaks).
ENCODE_TABLE: bytes = ENCODE_LUT.tobytes()


def _build_decode_lut() -> np.ndarray:
    lut = np.full(256, ord("?"), dtype=np.uint8)
    for token, letter in STORE_ALPHABET.items():
        lut[token] = ord(letter)
    return lut


#: token id -> ASCII letter (case kept); ids outside the store alphabet decode to '?'.
DECODE_LUT: np.ndarray = _build_decode_lut()


def _build_complement_lut() -> np.ndarray:
    lut = np.arange(256, dtype=np.uint8)  # specials and unknown ids map to themselves
    for x, y in ((A, T), (C, G), (G, C), (T, A), (N, N)):
        lut[x] = y
        lut[x | SOFTMASK] = y | SOFTMASK  # complement keeps case
    return lut


#: token id -> token id of the complementary base (case kept; specials unchanged).
COMPLEMENT_LUT: np.ndarray = _build_complement_lut()


def resolve_ambiguous(tokens: np.ndarray) -> int:
    """Turn ``AMBIGUOUS`` sentinels (either case) into N in place.

    Args:
        tokens: ``[L]`` uint8 array produced with ``ENCODE_LUT``/``ENCODE_TABLE``.

    Returns:
        How many ambiguity codes were replaced.
    """
    mask = (tokens & BASE_MASK) == AMBIGUOUS
    count = int(np.count_nonzero(mask))
    if count:
        tokens[mask] = N | (tokens[mask] & SOFTMASK)
    return count


def encode(sequence: str | bytes) -> np.ndarray:
    """Encode bases to store token ids, keeping case; ambiguity codes become N.

    Args:
        sequence: the bases, e.g. ``"ACGTNacgtn"``; no line breaks.

    Returns:
        ``[len(sequence)]`` uint8 token ids.

    Raises:
        ValueError: if a character is not a base letter or an IUPAC ambiguity code.
    """
    raw = sequence.encode("ascii", errors="replace") if isinstance(sequence, str) else bytes(sequence)
    tokens = ENCODE_LUT[np.frombuffer(raw, dtype=np.uint8)]
    bad = np.flatnonzero(tokens == INVALID)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"invalid character {chr(raw[i])!r} at position {i}: expected A, C, G, T, N "
            "(either case) or an IUPAC ambiguity code"
        )
    resolve_ambiguous(tokens)
    return tokens


def decode(tokens: np.ndarray | bytes | list[int]) -> str:
    """Decode store token ids back to bases, case kept.

    Args:
        tokens: ``[L]`` token ids (any integer array-like, e.g. ``split.tokens[a:b]``).

    Returns:
        The bases as a string of length ``L``.
    """
    array = np.asarray(tokens)
    if array.dtype != np.uint8:
        array = array.astype(np.uint8)
    return DECODE_LUT[array].tobytes().decode("ascii")


def reverse_complement(tokens: np.ndarray) -> np.ndarray:
    """Reverse complement token ids, keeping each base's case (soft-mask flag).

    Args:
        tokens: ``[..., L]`` uint8 (or integer) token ids; the last axis is the sequence.

    Returns:
        A new array of the same shape and dtype.
    """
    array = np.asarray(tokens)
    return COMPLEMENT_LUT[array[..., ::-1]].astype(array.dtype, copy=False)


def is_n(tokens: np.ndarray) -> np.ndarray:
    """Boolean mask of N tokens (either case).

    Args:
        tokens: ``[...]`` token ids.

    Returns:
        ``[...]`` bool.
    """
    return (np.asarray(tokens) & BASE_MASK) == N
