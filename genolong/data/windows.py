"""Training windows, evaluation tiles and context-parallel slicing over a :class:`~genolong.data.store.Split`.

* :class:`TrainWindows` draws seeded random windows of ``L`` tokens, each inside one segment (a
  window never crosses an N gap that split a chromosome), reverse-complemented with probability
  ``rc_prob``. Window ``i`` is a pure function of ``(seed, i)``: data-parallel ranks shard one
  global stream (rank ``r`` takes ``r, r + world_size, ...``) and a resumed run, restored from
  :meth:`TrainWindows.state_dict`, sees exactly the windows it would have seen.
* :class:`EvalTiles` cuts every segment of a split into consecutive tiles of ``L`` tokens (the last
  tile of a segment is shorter), covering every base exactly once.
* :func:`context_parallel_slice` gives a context-parallel rank its contiguous share of a sequence.

Only two things of a split are used: slicing ``split.tokens[a:b]`` (returns a numpy array) and the
``split.segments`` frame (contig, start, end, offset), so any object with those two attributes works.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import pandas as pd

from ..errors import InputError
from .alphabet import reverse_complement
from .repeats import PLANT_STREAM, RepeatPlanting, plant_repeats

__all__ = [
    "SplitLike",
    "context_cut_spans",
    "Window",
    "TrainWindows",
    "Tile",
    "EvalTiles",
    "context_parallel_bounds",
    "context_parallel_slice",
]

logger = logging.getLogger(__name__)


class SplitLike(Protocol):
    """What windows need of a split: ``tokens`` (1-D, slicing gives a numpy uint8 array) and
    ``segments`` (DataFrame with columns contig, start, end, offset)."""

    @property
    def tokens(self) -> Any: ...

    @property
    def segments(self) -> pd.DataFrame: ...


def _split_name(split: SplitLike) -> str:
    return repr(getattr(split, "name", "?"))


def _read(split: SplitLike, offset: int, length: int) -> np.ndarray:
    """``[length]`` uint8 tokens ``split.tokens[offset:offset + length]``, as a fresh array."""
    tokens = np.asarray(split.tokens[offset : offset + length], dtype=np.uint8)
    if not tokens.flags.owndata or not tokens.flags.writeable:
        tokens = tokens.copy()  # a numpy-backed split returns a view of its buffer
    return tokens


class _SegmentTable:
    """The segment frame as numpy columns (no per-window pandas access)."""

    def __init__(self, split: SplitLike):
        seg = split.segments
        self.contig = seg["contig"].to_numpy(dtype=object)
        self.start = seg["start"].to_numpy(dtype=np.int64)
        self.end = seg["end"].to_numpy(dtype=np.int64)
        self.offset = seg["offset"].to_numpy(dtype=np.int64)
        self.length = self.end - self.start
        if (self.length <= 0).any():
            bad = int(np.flatnonzero(self.length <= 0)[0])
            raise InputError(
                f"split {_split_name(split)}: segment {bad} ({self.contig[bad]}:{self.start[bad]}-{self.end[bad]}) "
                "is empty or reversed; re-create the store with `genolong prepare --force`"
            )


@dataclass(frozen=True)
class Window:
    """One training window.

    Attributes:
        index: the window's number in the global stream (a pure function of ``(seed, index)``).
        tokens: ``[L]`` uint8 token ids, case kept; reverse-complemented when ``strand == "-"``
            (``tokens[0]`` is then the complement of the base at ``end - 1``).
        contig: the contig name, e.g. ``"chr1"``.
        start: 0-based genomic start of the window on the forward strand (``end = start + L``).
        strand: ``"+"`` (as stored) or ``"-"`` (reverse complement).
        segment: row of ``split.segments`` that holds the window.
        offset: index of the window's first forward-strand base in ``split.tokens``.
    """

    index: int
    tokens: np.ndarray
    contig: str
    start: int
    strand: str
    segment: int
    offset: int

    @property
    def end(self) -> int:
        """0-based exclusive genomic end, ``start + L``."""
        return self.start + int(self.tokens.shape[0])


class TrainWindows:
    """Seeded random windows of ``length`` tokens, each inside one segment of a split.

    The start of window ``i`` is uniform over all valid starts of the split (a segment of ``n``
    bases has ``n - length + 1``), so a segment is chosen with probability proportional to its
    number of valid starts; segments shorter than ``length`` are skipped and their bases are
    unreachable (see :attr:`unreachable_bases` and :meth:`describe`). The strand is ``"-"`` with
    probability ``rc_prob``. Window ``i`` depends only on ``(seed, i)`` (a numpy ``Generator``
    seeded with ``[seed, i]``), never on what was drawn before.

    Data parallelism: rank ``r`` of ``world_size`` takes global windows ``r, r + world_size, ...``;
    the union over ranks is the single-rank stream. Iterating yields this rank's windows from the
    current position on and advances it, so :meth:`state_dict` after ``n`` windows resumes at the
    ``n + 1``-th. The state holds the *global* index of the next round, so a run may resume with
    another ``world_size`` and continue the same global stream.

    Args:
        split: the split to draw from (``GenomeStore.split("train")`` or any :class:`SplitLike`).
        length: window length ``L`` in tokens (>= 1).
        seed: non-negative seed (default 0).
        rc_prob: probability of the reverse-complement strand (default 0.5; 0 disables it).
        rank: data-parallel rank (default 0).
        world_size: number of data-parallel ranks (default 1). Context-parallel ranks of one
            data-parallel group must share a rank here (they split each window, see
            :func:`context_parallel_slice`).
        planting: plant diverged copies of earlier material into a share of the windows
            (:class:`~genolong.data.repeats.RepeatPlanting`, the recipe's ``data.plant_repeats``);
            default None: the windows as stored. Planting draws from its own generator, so
            windows keep their place, strand and order.

    Raises:
        InputError: if no segment holds ``length`` tokens (the message names the longest segment
            and the fix), or an argument is out of range.
    """

    def __init__(
        self,
        split: SplitLike,
        length: int,
        seed: int = 0,
        rc_prob: float = 0.5,
        rank: int = 0,
        world_size: int = 1,
        planting: RepeatPlanting | None = None,
    ):
        length, seed = int(length), int(seed)
        if length < 1:
            raise InputError(f"window length must be at least 1 token, got {length}")
        if seed < 0:
            raise InputError(f"seed must be a non-negative integer, got {seed}")
        if not 0.0 <= float(rc_prob) <= 1.0:
            raise InputError(f"rc_prob (reverse-complement probability) must be in [0, 1], got {rc_prob}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise InputError(f"data-parallel rank {rank} is not in [0, world_size={world_size})")
        self.split = split
        self.length = length
        self.seed = seed
        self.rc_prob = float(rc_prob)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.planting = planting

        self._seg = seg = _SegmentTable(split)
        valid = np.maximum(seg.length - length + 1, 0)  # [S] valid starts per segment
        self._usable = np.flatnonzero(valid > 0)  # [U] segment rows that can hold a window
        if self._usable.size == 0:
            name = _split_name(split)
            if seg.length.size == 0:
                raise InputError(f"split {name} has no segments; re-create the store with `genolong prepare`")
            i = int(np.argmax(seg.length))
            longest = int(seg.length[i])
            raise InputError(
                f"window length L={length:,} is longer than every segment of split {name} (longest: "
                f"{seg.contig[i]}:{seg.start[i]}-{seg.end[i]}, {longest:,} bases); use L <= {longest:,} "
                "or prepare the store with a larger --min-gap so that fewer N runs split the chromosomes"
            )
        self._cum = np.cumsum(valid[self._usable])  # [U] int64, cumulative valid starts
        self.valid_starts = int(self._cum[-1])
        self.total_bases = int(seg.length.sum())
        self.unreachable_segments = int(seg.length.size - self._usable.size)
        self.unreachable_bases = int(seg.length[valid == 0].sum())
        self._base = 0  # global index where round 0 of this run starts (from load_state_dict)
        self._local = 0  # windows of this rank consumed since _base
        logger.info("%s", self.describe())

    # -- the stream ---------------------------------------------------------------------------

    def global_index(self, local: int) -> int:
        """Global window number of this rank's ``local``-th window counted from the restored state."""
        return self._base + self.rank + self.world_size * int(local)

    def locate(self, index: int) -> tuple[int, int, str]:
        """Where window ``index`` lies, without reading tokens.

        Returns:
            ``(segment, offset_in_segment, strand)``: the row of ``split.segments``, the start
            relative to the segment's start, and ``"+"`` or ``"-"``.
        """
        if index < 0:
            raise InputError(f"window index must be non-negative, got {index}")
        rng = np.random.default_rng([self.seed, int(index)])
        u = int(rng.integers(self.valid_starts))
        k = int(np.searchsorted(self._cum, u, side="right"))
        within = u - (int(self._cum[k - 1]) if k else 0)
        strand = "-" if rng.random() < self.rc_prob else "+"
        return int(self._usable[k]), within, strand

    def window(self, index: int) -> Window:
        """Window number ``index`` of the global stream (the same for every rank and every run).

        Returns:
            A :class:`Window` with ``tokens`` ``[L]`` uint8.
        """
        segment, within, strand = self.locate(index)
        seg = self._seg
        offset = int(seg.offset[segment]) + within
        tokens = _read(self.split, offset, self.length)
        if strand == "-":
            tokens = reverse_complement(tokens)
        if self.planting is not None:
            tokens, _ = plant_repeats(
                tokens, np.random.default_rng([self.seed, int(index), PLANT_STREAM]), self.planting
            )
        return Window(
            index=int(index),
            tokens=tokens,
            contig=str(seg.contig[segment]),
            start=int(seg.start[segment]) + within,
            strand=strand,
            segment=segment,
            offset=offset,
        )

    def __iter__(self) -> Iterator[Window]:
        """This rank's windows from the current position on (endless); each one advances the
        position, so ``state_dict()`` taken after a window was yielded resumes after it."""
        while True:
            index = self.global_index(self._local)
            window = self.window(index)
            self._local += 1
            yield window

    def take(self, count: int) -> list[Window]:
        """The next ``count`` windows of this rank (advances the position by ``count``)."""
        out = [self.window(self.global_index(self._local + k)) for k in range(int(count))]
        self._local += len(out)
        return out

    @property
    def position(self) -> int:
        """Windows of this rank consumed since the state this run started from."""
        return self._local

    @position.setter
    def position(self, value: int) -> None:
        if value < 0:
            raise InputError(f"position must be non-negative, got {value}")
        self._local = int(value)

    def advance_past(self, index: int) -> None:
        """Mark every window of this rank up to global ``index`` (inclusive) as consumed.

        Used by a data loader's consumer (the main process) to follow what the training loop has
        actually used, when windows are read ahead in worker processes.
        """
        local = (int(index) - self._base - self.rank) // self.world_size + 1
        self._local = max(self._local, local)

    @property
    def next_index(self) -> int:
        """Global index at which the next round of all ranks starts (ranks advance in lockstep)."""
        return self._base + self.world_size * self._local

    def state_dict(self) -> dict[str, int]:
        """The resumable position: ``{"next_index": int, "seed": int, "length": int}``."""
        return {"next_index": self.next_index, "seed": self.seed, "length": self.length}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (possibly taken with another ``world_size``).

        Raises:
            InputError: if the state was made with another seed or window length (the stream
                would not continue; start a new run or use the old seed and length).
        """
        for key in ("seed", "length"):
            if key in state and int(state[key]) != getattr(self, key):
                raise InputError(
                    f"train window state was saved with {key}={int(state[key])} but this run uses "
                    f"{key}={getattr(self, key)}; resume with the same {key}, or start a fresh run"
                )
        self._base = int(state["next_index"])
        self._local = 0

    # -- reporting ----------------------------------------------------------------------------

    def describe(self) -> str:
        """One line: how many segments and bases a window of this length can reach."""
        frac = self.unreachable_bases / self.total_bases if self.total_bases else 0.0
        return (
            f"train windows L={self.length:,} on split {_split_name(self.split)}: "
            f"{self._usable.size} of {self._seg.length.size} segments usable, "
            f"{self.valid_starts:,} valid starts; {self.unreachable_bases:,} of {self.total_bases:,} "
            f"bases ({frac:.2%}) unreachable in {self.unreachable_segments} shorter segment"
            f"{'' if self.unreachable_segments == 1 else 's'}"
        )

    def __repr__(self) -> str:
        return (
            f"TrainWindows(L={self.length}, seed={self.seed}, rc_prob={self.rc_prob}, rank={self.rank}, "
            f"world_size={self.world_size}, next_index={self.next_index})"
        )


@dataclass(frozen=True)
class Tile:
    """One evaluation tile.

    Attributes:
        index: row of :attr:`EvalTiles.tiles`.
        tokens: ``[length]`` uint8 token ids (forward strand, case kept).
        contig: contig name.
        start: 0-based genomic start.
        offset: index of the first base in ``split.tokens``.
        length: number of tokens (``L``, or fewer for the last tile of a segment).
        segment: row of ``split.segments``.
    """

    index: int
    tokens: np.ndarray
    contig: str
    start: int
    offset: int
    length: int
    segment: int


class EvalTiles:
    """Consecutive tiles of ``length`` tokens over every segment of a split.

    Tiles cover every base of the split exactly once; each segment starts a new tile and its last
    tile is shorter when ``length`` does not divide the segment.

    Args:
        split: the split (``GenomeStore.split("eval")`` or any :class:`SplitLike`).
        length: tile length ``L`` in tokens (>= 1).

    Attributes:
        tiles: DataFrame, one row per tile in token order, columns ``contig`` (str), ``start``
            (0-based genomic), ``offset`` (into ``split.tokens``), ``length`` and ``segment``.
    """

    def __init__(self, split: SplitLike, length: int):
        length = int(length)
        if length < 1:
            raise InputError(f"tile length must be at least 1 token, got {length}")
        self.split = split
        self.length = length
        seg = _SegmentTable(split)
        n_tiles = -(-seg.length // length)  # [S] ceil division
        segment = np.repeat(np.arange(seg.length.size, dtype=np.int64), n_tiles)  # [N]
        first_tile = np.cumsum(n_tiles) - n_tiles  # [S] index of each segment's first tile
        within = (np.arange(segment.size, dtype=np.int64) - first_tile[segment]) * length  # [N]
        self.tiles = pd.DataFrame(
            {
                "contig": pd.Series(seg.contig[segment], dtype=object),
                "start": seg.start[segment] + within,
                "offset": seg.offset[segment] + within,
                "length": np.minimum(length, seg.length[segment] - within),
                "segment": segment,
            }
        )
        self._contig = seg.contig[segment]
        self._start = self.tiles["start"].to_numpy()
        self._offset = self.tiles["offset"].to_numpy()
        self._length = self.tiles["length"].to_numpy()
        self._segment = segment

    def __len__(self) -> int:
        return len(self.tiles)

    def __getitem__(self, index: int) -> Tile:
        """Tile ``index`` with its tokens read from the split."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"tile {index} out of range for {n} tiles")
        index = int(index) % n
        offset, length = int(self._offset[index]), int(self._length[index])
        return Tile(
            index=index,
            tokens=_read(self.split, offset, length),
            contig=str(self._contig[index]),
            start=int(self._start[index]),
            offset=offset,
            length=length,
            segment=int(self._segment[index]),
        )

    def __iter__(self) -> Iterator[Tile]:
        for index in range(len(self)):
            yield self[index]

    def select(self, keep: np.ndarray) -> EvalTiles:
        """The tiles where ``keep`` (``[N]`` bool) is true, in order, numbered afresh from 0
        (``evaluate --regions``: the tiles that overlap the regions)."""
        keep = np.asarray(keep, bool)
        chosen = copy.copy(self)
        chosen.tiles = self.tiles[keep].reset_index(drop=True)
        chosen._contig, chosen._start = self._contig[keep], self._start[keep]
        chosen._offset, chosen._length, chosen._segment = self._offset[keep], self._length[keep], self._segment[keep]
        return chosen

    def __repr__(self) -> str:
        return f"EvalTiles(L={self.length}, tiles={len(self)}, split={_split_name(self.split)})"


def context_parallel_bounds(total: int, cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Bounds ``[cp_rank * T / cp_size, (cp_rank + 1) * T / cp_size)`` of a context-parallel shard.

    Args:
        total: sequence length ``T``.
        cp_rank: this rank's index in the context-parallel group, ``0 <= cp_rank < cp_size``.
        cp_size: context-parallel group size; must divide ``T``.

    Raises:
        InputError: if ``cp_size`` does not divide ``T`` or the rank is out of range.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise InputError(f"context-parallel rank {cp_rank} is not in [0, cp_size={cp_size})")
    if total % cp_size:
        raise InputError(
            f"context-parallel size {cp_size} does not divide the sequence length {total:,}; "
            f"use a window length that is a multiple of {cp_size} (e.g. {total // cp_size * cp_size:,})"
        )
    shard = total // cp_size
    return cp_rank * shard, (cp_rank + 1) * shard


_Seq = TypeVar("_Seq")


def context_parallel_slice(x: _Seq, cp_rank: int, cp_size: int, dim: int = -1) -> _Seq:
    """The contiguous shard of ``x`` that context-parallel rank ``cp_rank`` holds.

    Args:
        x: numpy array or torch tensor, e.g. tokens ``[B, T]`` or ``[T]``.
        cp_rank: rank in the context-parallel group.
        cp_size: group size; must divide ``x.shape[dim]``.
        dim: the sequence axis (default -1).

    Returns:
        ``x`` sliced to ``[..., T / cp_size, ...]`` along ``dim`` (a view, not a copy).

    Raises:
        InputError: see :func:`context_parallel_bounds`.
    """
    ndim = len(x.shape)  # type: ignore[attr-defined]
    axis = dim % ndim
    lo, hi = context_parallel_bounds(int(x.shape[axis]), cp_rank, cp_size)  # type: ignore[attr-defined]
    return x[(slice(None),) * axis + (slice(lo, hi),)]  # type: ignore[index]


def context_cut_spans(length: int, cut: int | None) -> list[tuple[int, int]]:
    """Token spans ``[start, stop)`` that score targets ``1 .. length - 1`` of a window with at most
    ``cut`` bases of context each: ``[kC, min(kC + C + 1, length))`` (consecutive spans share one
    token, so every target is scored exactly once); one span ``[0, length)`` when ``cut`` is None or
    ``>= length - 1``. Span ``k`` scores targets ``kC + 1 .. stop - 1``, target ``t`` seeing
    ``(t - 1) % C + 1`` bases. Used by ``genolong evaluate --context-cut`` and ``train.context_cut``
    (the short-context control)."""
    if cut is None or cut >= length - 1:
        return [(0, length)]
    if cut < 1:
        raise InputError(f"--context-cut must be at least 1 base, got {cut}")
    return [(start, min(start + cut + 1, length)) for start in range(0, length - 1, cut)]
