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
from .bootstrap import (BUCKET_COLUMNS, PairedCI, _bucket_frame, _with_overall, block_bootstrap, bootstrap_replicates,
                        bucket_edges, bucket_labels, bucket_table_from_arrays, format_bases, paired_bootstrap,
                        resample_counts, resample_indices)
from .results import EvalResult

__all__ = [
    "bucket_edges", "bucket_labels", "format_bases",
    "resample_indices", "resample_counts", "bootstrap_replicates", "block_bootstrap",
    "PairedCI", "paired_bootstrap", "bucket_table_from_arrays", "check_comparable", "compare",
    "BUCKET_COLUMNS", "COMPARE_COLUMNS",
]

COMPARE_COLUMNS = ["bucket", "lo", "hi", "tokens", "a_nats", "b_nats", "diff", "diff_ci_lo", "diff_ci_hi",
                   "rel_pct", "rel_ci_lo", "rel_ci_hi", "supported"]


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
        raise InputError(f"cannot compare {_where(a)} with {_where(b)}: they scored different token sets "
                         f"(fingerprint {a.fingerprint[:12]} vs {b.fingerprint[:12]}); {fix}")
    if not np.array_equal(a.edges, b.edges):
        raise InputError(f"cannot compare {_where(a)} with {_where(b)}: their bucket edges differ "
                         f"({list(a.edges)} vs {list(b.edges)}); {fix}")
    if a.tile_tokens.shape != b.tile_tokens.shape or not np.array_equal(a.tile_tokens, b.tile_tokens):
        raise InputError(f"cannot compare {_where(a)} with {_where(b)}: the fingerprints match but the token counts "
                         f"per tile and bucket differ, so one result is damaged; re-run `genolong evaluate` for both")


def compare(a: EvalResult, b: EvalResult, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """Per-bucket and overall change of loss from run A to run B, with paired block-bootstrap CIs.

    Works for base vs tuned, full vs ``--context-cut``, tuned vs control: any two results of the same
    token set (same fingerprint, edges and per-tile counts; otherwise :class:`InputError`).

    Args:
        a: the reference run (e.g. the base model).
        b: the run compared with it (e.g. the tuned model).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and coverage (0.95).

    Returns:
        DataFrame with columns ``bucket, lo, hi, tokens, a_nats, b_nats, diff, diff_ci_lo,
        diff_ci_hi, rel_pct, rel_ci_lo, rel_ci_hi, supported``: ``diff = b - a`` in nats,
        ``rel_pct = 100 (b / a - 1)`` with its interval in percent, ``supported`` = the diff interval
        excludes 0. ``K`` bucket rows then the overall row ``"all"`` (from the row sums over buckets,
        with the same resamples).
    """
    check_comparable(a, b)
    ci = paired_bootstrap(_with_overall(a.tile_tokens), _with_overall(a.tile_nll),
                          _with_overall(b.tile_tokens), _with_overall(b.tile_nll), n_boot, seed, level)
    table = _bucket_frame(a.edges)
    table["tokens"] = _with_overall(a.tile_tokens).sum(axis=0)
    table["a_nats"], table["b_nats"] = ci.a_mean, ci.b_mean
    table["diff"], table["diff_ci_lo"], table["diff_ci_hi"] = ci.diff, ci.diff_lo, ci.diff_hi
    table["rel_pct"], table["rel_ci_lo"], table["rel_ci_hi"] = 100.0 * ci.rel, 100.0 * ci.rel_lo, 100.0 * ci.rel_hi
    with np.errstate(invalid="ignore"):
        table["supported"] = (ci.diff_lo > 0) | (ci.diff_hi < 0)
    return table[COMPARE_COLUMNS]
