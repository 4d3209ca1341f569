"""Buckets of preceding-context length and block-bootstrap confidence intervals, on plain arrays.

The numerical layer under :mod:`.results` (an :class:`EvalResult`'s bucket table) and :mod:`.stats`
(the comparison of two results): it imports neither, so the evaluation modules import one way
(``bootstrap`` <- ``results`` <- ``stats``; ``tests/test_imports.py`` checks it). Every name here
is also importable from :mod:`genolong.evaluation.stats`, where it lived first.

A token's bucket is fixed by its *offset*: the number of bases before it in its evaluation tile
(``1 .. L - 1``; a tile's first base is never a target). That is the preceding context a full-context
run gives the model, and the same token keeps the same bucket in a ``--context-cut`` run of the same
tiles, so full and cut runs of one model are compared bucket by bucket on identical tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd

from ..errors import InputError

__all__ = [
    "bucket_edges",
    "bucket_labels",
    "format_bases",
    "resample_indices",
    "resample_counts",
    "bootstrap_replicates",
    "block_bootstrap",
    "PairedCI",
    "paired_bootstrap",
    "paired_replicates",
    "paired_ci",
    "hierarchical_paired_bootstrap",
    "bucket_table_from_arrays",
    "split_bucket_table_from_arrays",
    "BUCKET_COLUMNS",
    "SOFTMASK_CLASSES",
]


def bucket_edges(context: int, first: int = 1024) -> np.ndarray:
    """Log2-spaced bucket edges of preceding-context length for tiles of ``context`` tokens.

    Bucket ``i`` holds offsets ``[edges[i], edges[i + 1])``: ``[1, first)``, ``[first, 2 first)``,
    ``[2 first, 4 first)``, ... and a last bucket ending at ``context`` (offsets run to
    ``context - 1``).

    Args:
        context: tile length ``L`` (>= 2).
        first: upper edge of the first bucket (default 1024: "<1k", "1k-2k", ...).

    Returns:
        ``[K + 1]`` int64, strictly increasing, ``edges[0] = 1`` and ``edges[-1] = context``.
    """
    if context < 2:
        raise InputError(f"evaluation context must be at least 2 tokens (one target), got {context}")
    if first < 2:
        raise InputError(f"the first bucket edge must be at least 2, got {first}")
    edges = [1]
    edge = first
    while edge < context:
        edges.append(edge)
        edge *= 2
    edges.append(context)
    return np.asarray(edges, dtype=np.int64)


def format_bases(n: int) -> str:
    """Short length label: 1024 -> "1k", 1048576 -> "1M", 1000 -> "1000"."""
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}k"
    return str(n)


def bucket_labels(edges: np.ndarray) -> list[str]:
    """Labels of the buckets of ``edges``: "<1k", "1k-2k", ..., "256k-512k"."""
    labels = []
    for i in range(len(edges) - 1):
        lo, hi = int(edges[i]), int(edges[i + 1])
        labels.append(f"<{format_bases(hi)}" if lo == 1 else f"{format_bases(lo)}-{format_bases(hi)}")
    return labels


# --------------------------------------------------------------------------------------------------
# Block bootstrap over tiles
# --------------------------------------------------------------------------------------------------

# Replicates are drawn in blocks of at most this many (replicate, tile) cells, so that memory stays
# bounded (a few tens of MB) whatever the number of tiles; the draws depend only on (W, n_boot, seed).
_BLOCK_CELLS = 1 << 21

_LN2 = math.log(2.0)


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise InputError(f"confidence level must be strictly between 0 and 1 (e.g. 0.95), got {level}")


def _check_n_boot(n_boot: int) -> None:
    if int(n_boot) < 1:
        raise InputError(f"the number of bootstrap resamples must be at least 1 (e.g. 2000), got {n_boot}")


def resample_indices(n_tiles: int, n_boot: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Tile indices of ``n_boot`` bootstrap resamples of ``n_tiles`` tiles, in blocks of replicates.

    Each replicate draws ``n_tiles`` tiles uniformly with replacement. Blocks of ``c`` replicates
    (``c * n_tiles`` at most about two million cells) are drawn in order from one
    ``numpy.random.default_rng(seed)``, so the whole sequence depends only on the three arguments:
    every bootstrap in this module (and a brute-force check in a test) sees the same resamples.

    Args:
        n_tiles: number of tiles ``W`` (>= 1).
        n_boot: number of replicates (>= 1).
        seed: seed of the numpy Generator (default 0).

    Yields:
        ``[c, W]`` int64 arrays of tile indices in ``[0, W)``; the ``c`` add up to ``n_boot``.
    """
    if n_tiles < 1:
        raise InputError(f"the bootstrap needs at least one tile, got {n_tiles}")
    _check_n_boot(n_boot)
    rng = np.random.default_rng(seed)
    per_block = max(1, _BLOCK_CELLS // n_tiles)
    done = 0
    while done < n_boot:
        c = min(per_block, n_boot - done)
        yield rng.integers(0, n_tiles, size=(c, n_tiles), dtype=np.int64)
        done += c


def resample_counts(n_tiles: int, n_boot: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Tile multiplicities of the resamples of :func:`resample_indices` (same arguments, same draws).

    Yields:
        ``[c, W]`` int64 arrays: entry ``[r, w]`` is how many times replicate ``r`` drew tile ``w``
        (each row sums to ``W``). A replicate's sum of a per-tile quantity ``x [W, K]`` is then
        ``counts @ x``.
    """
    for idx in resample_indices(n_tiles, n_boot, seed):
        c = idx.shape[0]
        # one bincount for the whole block: replicate r's tile w lands in cell r * W + w
        flat = idx + (np.arange(c, dtype=np.int64) * n_tiles)[:, None]
        yield np.bincount(flat.ravel(), minlength=c * n_tiles).reshape(c, n_tiles)


def _as_tile_matrix(name: str, x: np.ndarray, dtype: type) -> np.ndarray:
    arr = np.asarray(x, dtype=dtype)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[0] < 1:
        raise InputError(f"{name} must be a [tiles, buckets] array with at least one tile, got shape {np.shape(x)}")
    return arr


def _check_pair(tokens: np.ndarray, nll: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    t = _as_tile_matrix(f"{what} tokens", tokens, np.float64)
    n = _as_tile_matrix(f"{what} nll", nll, np.float64)
    if t.shape != n.shape:
        raise InputError(f"{what} tokens {t.shape} and nll {n.shape} must have the same [tiles, buckets] shape")
    if (t < 0).any():
        raise InputError(f"{what} tokens must be non-negative counts")
    return t, n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with NaN where ``den == 0`` (a bucket with no tokens has no mean)."""
    out = np.full(np.broadcast(num, den).shape, np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _percentiles(reps: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of each column of ``reps [n_boot, K]``, ignoring undefined replicates.

    A replicate is undefined (NaN) in a bucket when it happened to draw no tile with tokens there
    (possible only for a bucket present in few tiles); such replicates are left out of that bucket's
    interval. A column with no defined replicate gives NaN.
    """
    alpha = (1.0 - level) / 2.0
    lo = np.full(reps.shape[1], np.nan)
    hi = np.full(reps.shape[1], np.nan)
    ok = ~np.isnan(reps).all(axis=0)
    if ok.any():
        q = np.nanquantile(reps[:, ok], [alpha, 1.0 - alpha], axis=0)
        lo[ok], hi[ok] = q[0], q[1]
    return lo, hi


def bootstrap_replicates(tokens: np.ndarray, nll: np.ndarray, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """Per-replicate mean NLL (ratio of sums) over tiles resampled with replacement.

    Args:
        tokens: ``[W, K]`` counted targets of each tile in each bucket (a ``[W]`` vector is one bucket).
        nll: ``[W, K]`` summed NLL (nats) of those targets.
        n_boot: number of replicates (default 2000).
        seed: resampling seed (default 0); the resamples are those of :func:`resample_counts`.

    Returns:
        ``[n_boot, K]`` float64: ``sum(nll) / sum(tokens)`` of each replicate; NaN where a replicate
        has no tokens in a bucket.
    """
    t, n = _check_pair(tokens, nll, "bootstrap")
    x = np.concatenate([n, t], axis=1)
    k = t.shape[1]
    out = np.empty((int(n_boot), k))
    row = 0
    for counts in resample_counts(t.shape[0], n_boot, seed):
        sums = counts.astype(np.float64) @ x
        out[row : row + counts.shape[0]] = _ratio(sums[:, :k], sums[:, k:])
        row += counts.shape[0]
    return out


def block_bootstrap(
    tokens: np.ndarray, nll: np.ndarray, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean NLL per bucket with a percentile block-bootstrap interval over tiles.

    Tiles are the blocks: tokens inside one tile are dependent, tiles are resampled whole.

    Args:
        tokens: ``[W, K]`` counted targets per tile and bucket.
        nll: ``[W, K]`` summed NLL (nats) per tile and bucket.
        n_boot: number of replicates (default 2000).
        seed: resampling seed (default 0).
        level: interval coverage (default 0.95).

    Returns:
        ``(mean, lo, hi)``, each ``[K]`` float64 nats: ``mean = sum(nll) / sum(tokens)`` over all
        tiles and the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the replicates. All
        NaN for a bucket without tokens.
    """
    _check_level(level)
    t, n = _check_pair(tokens, nll, "bootstrap")
    mean = _ratio(n.sum(axis=0), t.sum(axis=0))
    lo, hi = _percentiles(bootstrap_replicates(t, n, n_boot, seed), level)
    empty = np.isnan(mean)
    lo[empty] = np.nan
    hi[empty] = np.nan
    return mean, lo, hi


class PairedCI(NamedTuple):
    """Point estimates and percentile intervals of a paired comparison, each ``[K]`` float64.

    ``diff = b_mean - a_mean`` (nats); ``rel = b_mean / a_mean - 1`` (a fraction, not percent).
    """

    a_mean: np.ndarray
    b_mean: np.ndarray
    diff: np.ndarray
    diff_lo: np.ndarray
    diff_hi: np.ndarray
    rel: np.ndarray
    rel_lo: np.ndarray
    rel_hi: np.ndarray


def paired_replicates(
    a_tokens: np.ndarray, a_nll: np.ndarray, b_tokens: np.ndarray, b_nll: np.ndarray, n_boot: int = 2000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Per-replicate difference and relative change of mean NLL from run A to run B (paired).

    Both runs are resampled with the SAME tile indices (those of :func:`resample_counts`) in every
    replicate; a caller that needs an interval of a function of several columns (e.g. the gap
    between two columns' relative changes) takes it from these replicates, so it rests on the
    same resamples as the columns' own intervals.

    Args:
        a_tokens, a_nll: ``[W, K]`` counted targets and summed NLL (nats) of run A.
        b_tokens, b_nll: the same for run B, on the same ``W`` tiles (same order).
        n_boot: number of replicates (default 2000).
        seed: resampling seed (default 0).

    Returns:
        ``(diffs, rels)``, each ``[n_boot, K]`` float64: ``mean_b - mean_a`` (nats) and
        ``mean_b / mean_a - 1`` of each replicate; NaN where a replicate has no tokens in a column.
    """
    at, an = _check_pair(a_tokens, a_nll, "run A")
    bt, bn = _check_pair(b_tokens, b_nll, "run B")
    if at.shape != bt.shape:
        raise InputError(
            f"paired bootstrap needs the same [tiles, buckets] in both runs, got {at.shape} and {bt.shape}"
        )
    k = at.shape[1]
    x = np.concatenate([an, at, bn, bt], axis=1)
    diffs = np.empty((int(n_boot), k))
    rels = np.empty((int(n_boot), k))
    row = 0
    for counts in resample_counts(at.shape[0], n_boot, seed):
        s = counts.astype(np.float64) @ x
        ma = _ratio(s[:, :k], s[:, k : 2 * k])
        mb = _ratio(s[:, 2 * k : 3 * k], s[:, 3 * k :])
        c = counts.shape[0]
        diffs[row : row + c] = mb - ma
        rels[row : row + c] = _ratio(mb, ma) - 1.0
        row += c
    return diffs, rels


def paired_bootstrap(
    a_tokens: np.ndarray,
    a_nll: np.ndarray,
    b_tokens: np.ndarray,
    b_nll: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> PairedCI:
    """Difference and relative change of mean NLL between runs A and B on the same tiles.

    Both runs are resampled with the SAME tile indices in every replicate, so tile-to-tile variation
    shared by A and B (hard and easy regions of the genome) cancels out of the interval.

    Args:
        a_tokens, a_nll: ``[W, K]`` counted targets and summed NLL (nats) of run A.
        b_tokens, b_nll: the same for run B, on the same ``W`` tiles (same order).
        n_boot: number of replicates (default 2000).
        seed: resampling seed (default 0).
        level: interval coverage (default 0.95).

    Returns:
        :class:`PairedCI` of ``[K]`` arrays (NaN where a bucket has no tokens).
    """
    _check_level(level)
    return paired_ci(
        a_tokens, a_nll, b_tokens, b_nll, *paired_replicates(a_tokens, a_nll, b_tokens, b_nll, n_boot, seed), level
    )


def paired_ci(
    a_tokens: np.ndarray,
    a_nll: np.ndarray,
    b_tokens: np.ndarray,
    b_nll: np.ndarray,
    diffs: np.ndarray,
    rels: np.ndarray,
    level: float = 0.95,
) -> PairedCI:
    """:class:`PairedCI` from the point sums (``[W, K]`` each, as :func:`paired_replicates`) and the
    replicates ``diffs``, ``rels`` (``[n_boot, K]``) that :func:`paired_replicates` drew."""
    _check_level(level)
    at, an = _check_pair(a_tokens, a_nll, "run A")
    bt, bn = _check_pair(b_tokens, b_nll, "run B")
    a_mean = _ratio(an.sum(axis=0), at.sum(axis=0))
    b_mean = _ratio(bn.sum(axis=0), bt.sum(axis=0))
    diff_lo, diff_hi = _percentiles(diffs, level)
    rel_lo, rel_hi = _percentiles(rels, level)
    empty = np.isnan(a_mean) | np.isnan(b_mean)
    for arr in (diff_lo, diff_hi, rel_lo, rel_hi):
        arr[empty] = np.nan
    return PairedCI(a_mean, b_mean, b_mean - a_mean, diff_lo, diff_hi, _ratio(b_mean, a_mean) - 1.0, rel_lo, rel_hi)


def hierarchical_paired_bootstrap(
    groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> PairedCI:
    """Paired comparison of runs A and B pooled over groups of tiles (regions), with a two-stage
    bootstrap: resample the groups, then the tiles inside each drawn group.

    The point estimate pools every tile of every group (ratio of sums, as :func:`paired_bootstrap`
    on all tiles together), so a group weighs by its tokens. The interval counts the groups as the
    unit of variation: each replicate draws ``G`` groups with replacement and, for each draw, that
    group's ``W_g`` tiles with replacement (a group drawn twice gets two independent tile draws), so
    the interval carries the between-group spread as well as the tile noise. With few groups it is
    wide, as it should be: ``G`` groups are all that say how much a new region can differ.

    Args:
        groups: one ``(a_tokens, a_nll, b_tokens, b_nll)`` per group, each ``[W_g, K]`` (as
            :func:`paired_replicates`; ``W_g`` may differ between groups, ``K`` may not).
        n_boot: number of replicates (default 2000).
        seed: seed of the one ``numpy.random.default_rng`` all draws come from (default 0).
        level: interval coverage (default 0.95).

    Returns:
        :class:`PairedCI` of ``[K]`` arrays over all groups' tiles (NaN where a bucket has no tokens).
    """
    _check_level(level)
    _check_n_boot(n_boot)
    if not groups:
        raise InputError("the hierarchical bootstrap needs at least one group of tiles")
    checked = []
    for g, (a_t, a_n, b_t, b_n) in enumerate(groups):
        at, an = _check_pair(a_t, a_n, f"group {g} run A")
        bt, bn = _check_pair(b_t, b_n, f"group {g} run B")
        if at.shape != bt.shape:
            raise InputError(f"group {g}: runs A and B need the same [tiles, buckets], got {at.shape} and {bt.shape}")
        checked.append(np.concatenate([an, at, bn, bt], axis=1))  # [W_g, 4K]
    k = checked[0].shape[1] // 4
    if any(x.shape[1] != 4 * k for x in checked):
        raise InputError("every group needs the same buckets (K columns)")
    n_groups, n_boot = len(checked), int(n_boot)
    rng = np.random.default_rng(seed)
    which = rng.integers(0, n_groups, size=(n_boot, n_groups))  # [n_boot, G]: the groups each replicate draws
    sums = np.zeros((n_boot, 4 * k))
    for slot in range(n_groups):
        for g, x in enumerate(checked):
            rows = np.flatnonzero(which[:, slot] == g)
            if rows.size:  # these replicates draw group g in this slot: a fresh tile resample each
                idx = rng.integers(0, x.shape[0], size=(rows.size, x.shape[0]))
                sums[rows] += x[idx].sum(axis=1)
    ma = _ratio(sums[:, :k], sums[:, k : 2 * k])
    mb = _ratio(sums[:, 2 * k : 3 * k], sums[:, 3 * k :])
    diffs, rels = mb - ma, _ratio(mb, ma) - 1.0
    a_n, a_t, b_n, b_t = (np.concatenate([x[:, i * k : (i + 1) * k] for x in checked]) for i in range(4))
    return paired_ci(a_t, a_n, b_t, b_n, diffs, rels, level)


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------

BUCKET_COLUMNS = ["bucket", "lo", "hi", "tokens", "nats", "ci_lo", "ci_hi", "bits", "bits_ci_lo", "bits_ci_hi"]


def _with_overall(x: np.ndarray) -> np.ndarray:
    """``[W, K]`` -> ``[W, K + 1]``: the buckets and their row sum (the overall "all" column)."""
    return np.concatenate([x, x.sum(axis=1, keepdims=True)], axis=1)


def _bucket_frame(edges: np.ndarray) -> pd.DataFrame:
    edges = np.asarray(edges, dtype=np.int64)
    return pd.DataFrame(
        {
            "bucket": bucket_labels(edges) + ["all"],
            "lo": np.append(edges[:-1], edges[0]).astype(np.int64),
            "hi": np.append(edges[1:], edges[-1]).astype(np.int64),
        }
    )


def _check_edges(edges: np.ndarray, k: int) -> np.ndarray:
    e = np.asarray(edges, dtype=np.int64)
    if e.ndim != 1 or len(e) != k + 1 or len(e) < 2 or (np.diff(e) <= 0).any() or e[0] < 1:
        raise InputError(
            f"bucket edges must be {k + 1} strictly increasing offsets >= 1 for {k} buckets, got {list(np.ravel(edges))}"
        )
    return e


def bucket_table_from_arrays(
    tile_tokens: np.ndarray,
    tile_nll: np.ndarray,
    edges: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> pd.DataFrame:
    """The bucket table of one run: per bucket and overall, tokens, mean NLL and a block-bootstrap CI.

    Args:
        tile_tokens: ``[W, K]`` int counted targets per tile and bucket.
        tile_nll: ``[W, K]`` float summed NLL (nats) per tile and bucket.
        edges: ``[K + 1]`` bucket edges (bucket ``i`` = offsets ``[edges[i], edges[i + 1])``).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and coverage (0.95).

    Returns:
        DataFrame with columns ``bucket, lo, hi, tokens, nats, ci_lo, ci_hi, bits, bits_ci_lo,
        bits_ci_hi``: ``K`` bucket rows then the overall row ``"all"`` (``lo = edges[0]``,
        ``hi = edges[-1]``), whose replicates use the same resamples as the buckets. Loss columns
        are NaN for a bucket without tokens.
    """
    t, n = _check_pair(tile_tokens, tile_nll, "bucket table")
    e = _check_edges(edges, t.shape[1])
    mean, lo, hi = block_bootstrap(_with_overall(t), _with_overall(n), n_boot, seed, level)
    table = _bucket_frame(e)
    table["tokens"] = _with_overall(np.asarray(tile_tokens, dtype=np.int64).reshape(t.shape)).sum(axis=0)
    table["nats"], table["ci_lo"], table["ci_hi"] = mean, lo, hi
    table["bits"], table["bits_ci_lo"], table["bits_ci_hi"] = mean / _LN2, lo / _LN2, hi / _LN2
    return table[BUCKET_COLUMNS]


#: The two classes of the soft-mask split, in the order of the last axis of the split arrays
#: (``EvalResult.softmask_tokens [W, K, 2]``): 0 = unmasked (upper case in the FASTA: unique
#: sequence as RepeatMasker sees it), 1 = soft-masked (lower case: repeats, low complexity).
SOFTMASK_CLASSES = ("unmasked", "soft-masked")


def _split_columns(x: np.ndarray) -> np.ndarray:
    """``[W, K, C]`` -> ``[W, C * (K + 1)]``: class-major blocks of the buckets and their row sum."""
    return np.concatenate([_with_overall(x[:, :, c]) for c in range(x.shape[2])], axis=1)


def split_bucket_table_from_arrays(
    tile_tokens: np.ndarray,
    tile_nll: np.ndarray,
    edges: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> pd.DataFrame:
    """The bucket table of one run split by the soft-mask class of the target base.

    One block bootstrap over tiles for every (class, bucket) column, so both classes' intervals
    rest on the same resamples (and on those of :func:`bucket_table_from_arrays` with the same
    ``n_boot`` and ``seed``).

    Args:
        tile_tokens: ``[W, K, 2]`` int counted targets per tile, bucket and class
            (:data:`SOFTMASK_CLASSES` order).
        tile_nll: ``[W, K, 2]`` float summed NLL (nats) of those targets.
        edges: ``[K + 1]`` bucket edges.
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and coverage (0.95).

    Returns:
        DataFrame with columns ``softmask`` (bool: the rows of soft-masked bases) then
        :data:`BUCKET_COLUMNS`: the ``K + 1`` rows of the unmasked bases (buckets, then ``"all"``),
        then those of the soft-masked bases.
    """
    t = np.asarray(tile_tokens)
    n = np.asarray(tile_nll, dtype=np.float64)
    if t.ndim != 3 or t.shape[2] != len(SOFTMASK_CLASSES) or n.shape != t.shape:
        raise InputError(f"the soft-mask split needs [tiles, buckets, 2] tokens and nll, got {t.shape} and {n.shape}")
    e = _check_edges(edges, t.shape[1])
    flat_t = _split_columns(t.astype(np.int64))
    mean, lo, hi = block_bootstrap(flat_t, _split_columns(n), n_boot, seed, level)
    frames = []
    for c in range(t.shape[2]):
        table = _bucket_frame(e)
        cols = slice(c * (t.shape[1] + 1), (c + 1) * (t.shape[1] + 1))
        table["tokens"] = flat_t[:, cols].sum(axis=0)
        table["nats"], table["ci_lo"], table["ci_hi"] = mean[cols], lo[cols], hi[cols]
        table["bits"], table["bits_ci_lo"], table["bits_ci_hi"] = mean[cols] / _LN2, lo[cols] / _LN2, hi[cols] / _LN2
        frames.append(table[BUCKET_COLUMNS].assign(softmask=bool(c))[["softmask", *BUCKET_COLUMNS]])
    return pd.concat(frames, ignore_index=True)
