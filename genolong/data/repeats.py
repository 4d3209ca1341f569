"""Planted diverged copies: training windows that reward reading far back.

About half of the human genome is interspersed repeats (Alu elements of ~300 bases, about 10% of
the genome, one every ~3 kb on average; L1 fragments up to 6 kb), most of them copies of a family
consensus that have drifted 5-20% apart by point substitutions and small indels, on either strand.
A model that finds an earlier copy and reads it predicts the later one better, but the nearer
copies of a family lie thousands of bases back, and a short training run on natural windows
seldom rewards looking that far. :func:`plant_repeats` makes the reward explicit: into a share of
the training windows it writes copies of the window's own earlier material, ``d`` bases further
on, diverged and possibly reverse-complemented, with length, distance and divergence drawn like
real repeats (:class:`RepeatPlanting`). The window keeps its length; the planted bases replace
what was there (every base still a real human base, only in another place).

A planted window is a pure function of ``(seed, window index)`` and the settings: the generator is
seeded with ``[seed, index, PLANT_STREAM]``, apart from the one that places the window, so
planting changes no window's place, strand or order and a resumed run plants the same copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .alphabet import BASE_MASK, SOFTMASK, N, reverse_complement

__all__ = ["PLANT_STREAM", "PlantedCopy", "RepeatPlanting", "plant_repeats"]

#: Third seed word of the planting generator (``[seed, index, PLANT_STREAM]``): a stream apart
#: from :meth:`~genolong.data.windows.TrainWindows.locate`'s ``[seed, index]``.
PLANT_STREAM = 0x5EED_C0DE


@dataclass(frozen=True)
class RepeatPlanting:
    """How copies are planted into training windows (the recipe's ``data.plant_repeats``).

    Attributes:
        share: probability that a window gets copies, in [0, 1]. Default 0.5.
        copies: copies planted into such a window (each drawn independently; one that does not fit
            the window is skipped). Default 2.
        min_length, max_length: copy length in bases, uniform in ``[min_length, max_length]``.
            Defaults 50 and 400 (Alu is ~300).
        min_distance: the least distance ``d`` from a source base to its copy; ``d`` is
            log-uniform in ``[max(min_distance, m + 1), L - m]`` for a copy of ``m`` bases in a
            window of ``L`` (every scale of distance gets equal weight). Default 64.
        max_distance: the largest ``d``, or None (default) for the window's limit ``L - m``.
        max_divergence: the divergence of each copy is uniform in ``[0, max_divergence]``: the
            expected share of its bases that were edited (real family members: 0.05-0.2).
            Default 0.2.
        indel_share: share of the edits that are indels of 1-3 bases (half insertions of random
            bases, half deletions) instead of substitutions. Default 0.1.
        inverted: probability that a copy is the reverse complement of its source (real
            interspersed repeats lie on either strand with equal odds). Default 0.5.
    """

    share: float = 0.5
    copies: int = 2
    min_length: int = 50
    max_length: int = 400
    min_distance: int = 64
    max_distance: int | None = None
    max_divergence: float = 0.2
    indel_share: float = 0.1
    inverted: float = 0.5

    def __post_init__(self) -> None:
        for name in ("share", "max_divergence", "indel_share", "inverted"):
            value = float(getattr(self, name))
            if not 0.0 <= value <= 1.0:
                raise InputError(f"data.plant_repeats.{name} must be in [0, 1], got {value}")
        if self.copies < 0:
            raise InputError(f"data.plant_repeats.copies must be >= 0, got {self.copies}")
        if not 1 <= self.min_length <= self.max_length:
            raise InputError(
                f"data.plant_repeats needs 1 <= min_length <= max_length, got {self.min_length} and {self.max_length}"
            )
        if self.min_distance < 1 or (self.max_distance is not None and self.max_distance < self.min_distance):
            raise InputError(
                f"data.plant_repeats needs 1 <= min_distance <= max_distance, got {self.min_distance} "
                f"and {self.max_distance}"
            )


@dataclass(frozen=True)
class PlantedCopy:
    """One planted copy: ``tokens[start:start + length]`` now holds an edited copy of the source
    ``tokens[start - distance:start - distance + length]`` as it was before planting.

    Attributes:
        start: first base of the copy in the window.
        length: bases written (the copy's length ``m``).
        distance: ``d``, from the source's first base to the copy's.
        divergence: the edit rate drawn for this copy.
        inverted: the copy is the source's reverse complement.
    """

    start: int
    length: int
    distance: int
    divergence: float
    inverted: bool


def _diverge(source: np.ndarray, rate: float, indel_share: float, rng: np.random.Generator) -> np.ndarray:
    """``source [m]`` with point substitutions and 1-3 base indels at ``rate`` edits per base,
    cut or padded (with the source's own continuation of random bases) back to ``m`` bases."""
    m = source.shape[0]
    out: list[np.ndarray] = []
    i = 0
    edits = np.flatnonzero(rng.random(m) < rate)
    for e in edits:
        if e < i:  # inside a deletion just made
            continue
        out.append(source[i:e])
        kind = rng.random()
        case = source[e] & SOFTMASK
        if kind >= indel_share:  # substitution: another base, case kept
            base = source[e] & BASE_MASK
            if base == N:
                out.append(source[e : e + 1])
            else:
                new = (base - 1 + rng.integers(1, 4)) % 4 + 1  # one of the three other bases
                out.append(np.array([new | case], dtype=source.dtype))
            i = e + 1
        elif kind < indel_share / 2:  # insertion of 1-3 random bases before source[e]
            out.append((rng.integers(1, 5, int(rng.integers(1, 4))) | case).astype(source.dtype))
            out.append(source[e : e + 1])
            i = e + 1
        else:  # deletion of 1-3 bases
            i = e + int(rng.integers(1, 4))
    out.append(source[i:])
    edited = np.concatenate(out) if out else source[:0]
    if edited.shape[0] >= m:
        return edited[:m]
    pad = (rng.integers(1, 5, m - edited.shape[0])).astype(source.dtype)
    return np.concatenate([edited, pad])


def plant_repeats(
    tokens: np.ndarray, rng: np.random.Generator, settings: RepeatPlanting
) -> tuple[np.ndarray, list[PlantedCopy]]:
    """Plant diverged copies of a window's earlier material into it (see the module docstring).

    Args:
        tokens: ``[L]`` uint8 store tokens (case kept), not modified.
        rng: the window's planting generator (``np.random.default_rng([seed, index, PLANT_STREAM])``).
        settings: :class:`RepeatPlanting`.

    Returns:
        ``(planted [L] uint8, copies)``: the window with the copies written in order (a later copy
        may read or overwrite an earlier one, as repeats nest in real DNA), and what was planted
        (empty when the window drew no copies or none fit).
    """
    out = np.array(tokens, copy=True)
    if rng.random() >= settings.share:
        return out, []
    length = int(out.shape[0])
    planted: list[PlantedCopy] = []
    for _ in range(settings.copies):
        m = int(rng.integers(settings.min_length, settings.max_length + 1))
        lo = max(settings.min_distance, m + 1)  # the copy starts after its source ends: no overlap
        hi = length - m if settings.max_distance is None else min(settings.max_distance, length - m)
        divergence = float(rng.uniform(0.0, settings.max_divergence))
        inverted = bool(rng.random() < settings.inverted)
        if hi < lo:  # the window is too short for this copy
            continue
        d = int(math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
        d = min(max(d, lo), hi)
        start = int(rng.integers(d, length - m + 1))
        source = out[start - d : start - d + m]
        if inverted:
            source = reverse_complement(source)
        out[start : start + m] = _diverge(source, divergence, settings.indel_share, rng)
        planted.append(PlantedCopy(start, m, d, divergence, inverted))
    return out, planted
