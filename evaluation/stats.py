"""Paired comparison of two evaluation results, and (re-exported) the bucket and bootstrap statistics.

A token's bucket is fixed by its *offset*: the number of bases before it in its evaluation tile
(``1 .. L - 1``; a tile's first base is never a target). That is the preceding context a full-context
run gives the model, and the same token keeps the same bucket in a ``--context-cut`` run of the same
tiles, so full and cut runs of one model are compared bucket by bucket on identical tokens.

The array-level statistics live in :mod:`.bootstrap`, below :mod:`.results`; this module sits above
both (it compares :class:`EvalResult` objects), so nothing imports in a circle. The names of
:mod:`.bootstrap` are re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..errors import InputError
from .bootstrap import (
    BUCKET_COLUMNS,
    SOFTMASK_CLASSES,
    PairedCI,
    _bucket_frame,
    _percentiles,
    _split_columns,
    _with_overall,
    block_bootstrap,
    bootstrap_replicates,
    bucket_edges,
    bucket_labels,
    bucket_table_from_arrays,
    format_bases,
    paired_bootstrap,
    paired_ci,
    paired_replicates,
    resample_counts,
    resample_indices,
)
from .results import EvalResult, check_by

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
    "bucket_table_from_arrays",
    "check_comparable",
    "compare",
    "compare_softmask",
    "BUCKET_COLUMNS",
    "COMPARE_COLUMNS",
    "GAP_COLUMNS",
]

COMPARE_COLUMNS = [
    "bucket",
    "lo",
    "hi",
    "tokens",
    "a_nats",
    "b_nats",
    "diff",
    "diff_ci_lo",
    "diff_ci_hi",
    "rel_pct",
    "rel_ci_lo",
    "rel_ci_hi",
    "supported",
]
#: Columns of the soft-mask gap table (:func:`compare_softmask`), relative changes in percent.
GAP_COLUMNS = [
    "bucket",
    "lo",
    "hi",
    "unmasked_tokens",
    "masked_tokens",
    "unmasked_rel_pct",
    "unmasked_rel_ci_lo",
    "unmasked_rel_ci_hi",
    "masked_rel_pct",
    "masked_rel_ci_lo",
    "masked_rel_ci_hi",
    "gap_pct",
    "gap_ci_lo",
    "gap_ci_hi",
    "supported",
]


def _where(r: EvalResult) -> str:
    name = r.label
    return f"{name} ({r.source})" if r.source is not None else name


def check_comparable(a: EvalResult, b: EvalResult) -> None:
    """Raise :class:`InputError` unless ``a`` and ``b`` scored exactly the same tokens in the same buckets.

    Checks, in order: the token-set fingerprints, the bucket edges, and the counted tokens of every
    (tile, bucket) cell (the last catches a damaged or hand-edited result whose fingerprint matches).
    """
    fix = "evaluate both with the same --store, --split, --context and --max-tiles"
    if a.fingerprint != b.fingerprint:
        raise InputError(
            f"cannot compare {_where(a)} with {_where(b)}: they scored different token sets "
            f"(fingerprint {a.fingerprint[:12]} vs {b.fingerprint[:12]}); {fix}"
        )
    if not np.array_equal(a.edges, b.edges):
        raise InputError(
            f"cannot compare {_where(a)} with {_where(b)}: their bucket edges differ "
            f"({list(a.edges)} vs {list(b.edges)}); {fix}"
        )
    if a.tile_tokens.shape != b.tile_tokens.shape or not np.array_equal(a.tile_tokens, b.tile_tokens):
        raise InputError(
            f"cannot compare {_where(a)} with {_where(b)}: the fingerprints match but the token counts "
            f"per tile and bucket differ, so one result is damaged; re-run `genolong evaluate` for both"
        )
    # the fingerprint does not cover the soft-masking (results of older versions must still compare),
    # so the split's counts are checked where both keep it
    if a.has_softmask and b.has_softmask and not np.array_equal(a.softmask_tokens, b.softmask_tokens):
        raise InputError(
            f"cannot compare {_where(a)} with {_where(b)}: the token counts per tile and bucket match but "
            f"their soft-masked (lower-case) counts differ, so they scored stores of differently masked "
            f"FASTAs or one result is damaged; {fix}, from one `genolong prepare` store"
        )


def compare(
    a: EvalResult, b: EvalResult, n_boot: int = 2000, seed: int = 0, level: float = 0.95, by: str | None = None
) -> pd.DataFrame:
    """Per-bucket and overall change of loss from run A to run B, with paired block-bootstrap CIs.

    Works for base vs tuned, full vs ``--context-cut``, tuned vs control: any two results of the same
    token set (same fingerprint, edges and per-tile counts; otherwise :class:`InputError`).

    Args:
        a: the reference run (e.g. the base model).
        b: the run compared with it (e.g. the tuned model).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and coverage (0.95).
        by: None (default): all bases pooled; ``"softmask"``: split by the target's soft-mask
            class (see :func:`compare_softmask`, whose first table this is).

    Returns:
        DataFrame with columns ``bucket, lo, hi, tokens, a_nats, b_nats, diff, diff_ci_lo,
        diff_ci_hi, rel_pct, rel_ci_lo, rel_ci_hi, supported``: ``diff = b - a`` in nats,
        ``rel_pct = 100 (b / a - 1)`` with its interval in percent, ``supported`` = the diff interval
        excludes 0. ``K`` bucket rows then the overall row ``"all"`` (from the row sums over buckets,
        with the same resamples).
    """
    check_by(by)
    if by == "softmask":
        return compare_softmask(a, b, n_boot, seed, level)[0]
    check_comparable(a, b)
    ci = paired_bootstrap(
        _with_overall(a.tile_tokens),
        _with_overall(a.tile_nll),
        _with_overall(b.tile_tokens),
        _with_overall(b.tile_nll),
        n_boot,
        seed,
        level,
    )
    return _compare_frame(a.edges, _with_overall(a.tile_tokens).sum(axis=0), ci)


def _compare_frame(edges: np.ndarray, tokens: np.ndarray, ci: PairedCI) -> pd.DataFrame:
    """A :data:`COMPARE_COLUMNS` table of ``K + 1`` rows from their token counts and paired CI."""
    table = _bucket_frame(edges)
    table["tokens"] = tokens
    table["a_nats"], table["b_nats"] = ci.a_mean, ci.b_mean
    table["diff"], table["diff_ci_lo"], table["diff_ci_hi"] = ci.diff, ci.diff_lo, ci.diff_hi
    table["rel_pct"], table["rel_ci_lo"], table["rel_ci_hi"] = 100.0 * ci.rel, 100.0 * ci.rel_lo, 100.0 * ci.rel_hi
    with np.errstate(invalid="ignore"):
        table["supported"] = (ci.diff_lo > 0) | (ci.diff_hi < 0)
    return table[COMPARE_COLUMNS]


def compare_softmask(
    a: EvalResult, b: EvalResult, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`compare` split by soft-masking, and the gap between the two classes' relative changes.

    Every (class, bucket) column and the gap are taken from ONE paired block bootstrap over tiles
    (the resamples of :func:`compare` with the same ``n_boot`` and ``seed``), so the gap's interval
    is paired twice: A with B on each resampled tile, and the soft-masked with the unmasked bases of
    the same tiles.

    Args:
        a, b: the reference run and the run compared with it; both must keep the soft-mask split
            (:class:`InputError` naming the fix otherwise) and be comparable (:func:`check_comparable`).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and coverage (0.95).

    Returns:
        ``(table, gap)``. ``table``: a ``softmask`` column (bool) then :data:`COMPARE_COLUMNS`: the
        ``K + 1`` rows (buckets, then ``"all"``) of the unmasked bases, then those of the soft-masked
        bases. ``gap``: :data:`GAP_COLUMNS`, ``K + 1`` rows: each class's tokens and relative
        change in percent with its interval (the ``rel_*`` columns of ``table``), ``gap_pct =
        masked_rel_pct - unmasked_rel_pct`` (percentage points; below 0: the loss falls more, or rises less, on
        soft-masked bases) with its interval, ``supported`` = that interval excludes 0.
    """
    check_comparable(a, b)
    a.require_softmask()
    b.require_softmask()
    k = a.tile_tokens.shape[1] + 1
    at, an = _split_columns(a.softmask_tokens), _split_columns(a.softmask_nll)
    bt, bn = _split_columns(b.softmask_tokens), _split_columns(b.softmask_nll)
    diffs, rels = paired_replicates(at, an, bt, bn, n_boot, seed)
    ci = paired_ci(at, an, bt, bn, diffs, rels, level)
    frames = []
    for c in range(len(SOFTMASK_CLASSES)):
        cols = slice(c * k, (c + 1) * k)
        part = PairedCI(*(x[cols] for x in ci))
        frames.append(_compare_frame(a.edges, at[:, cols].sum(axis=0), part).assign(softmask=bool(c)))
    table = pd.concat(frames, ignore_index=True)[["softmask", *COMPARE_COLUMNS]]
    gap = _bucket_frame(a.edges)
    for c, name in enumerate(("unmasked", "masked")):
        rows = table[table["softmask"] == bool(c)]
        for col in ("tokens", "rel_pct", "rel_ci_lo", "rel_ci_hi"):
            gap[f"{name}_{col}"] = rows[col].to_numpy()
    gap["gap_pct"] = gap["masked_rel_pct"] - gap["unmasked_rel_pct"]
    lo, hi = _percentiles(rels[:, k:] - rels[:, :k], level)
    empty = np.isnan(ci.rel[:k]) | np.isnan(ci.rel[k:])
    lo[empty], hi[empty] = np.nan, np.nan
    gap["gap_ci_lo"], gap["gap_ci_hi"] = 100.0 * lo, 100.0 * hi
    with np.errstate(invalid="ignore"):
        gap["supported"] = (lo > 0) | (hi < 0)
    return table, gap[GAP_COLUMNS]
