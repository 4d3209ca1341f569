"""Buckets, block-bootstrap CIs, compare and EvalResult files against brute force on synthetic tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from genolong.errors import InputError
from genolong.evaluation import bootstrap
from genolong.evaluation.results import FORMAT, EvalResult
from genolong.evaluation.stats import (
    BUCKET_COLUMNS,
    COMPARE_COLUMNS,
    block_bootstrap,
    bootstrap_replicates,
    bucket_edges,
    bucket_labels,
    bucket_table_from_arrays,
    compare,
    paired_bootstrap,
    resample_counts,
    resample_indices,
)

# --------------------------------------------------------------------------------------------------
# synthetic per-token tables -> EvalResult (shared with test_eval_plots.py)
# --------------------------------------------------------------------------------------------------


def synthetic_tokens(
    n_tiles: int = 24, context: int = 64, seed: int = 0, drop: float = 0.1, masked: float = 0.0
) -> pd.DataFrame:
    """Per-token rows (tile, offset, nll) of ``n_tiles`` tiles of ``context`` tokens.

    Tiles have a random difficulty (so tiles are real blocks), the last tile is short (as a
    segment's last tile), and a fraction ``drop`` of targets is not counted (N bases). With
    ``masked > 0`` also a ``softmask`` column: about that fraction of each tile's targets, in runs
    (as repeats are), drawn from a generator of their own (the other columns stay those without).
    """
    rng = np.random.default_rng(seed)
    lengths = np.full(n_tiles, context)
    lengths[-1] = context // 2 + 3
    rows = []
    for tile, length in enumerate(lengths):
        offsets = np.arange(1, length)
        offsets = offsets[rng.random(len(offsets)) >= drop]
        level = rng.gamma(8.0, 1.35 / 8.0)
        # loss falls a little with offset, like a model that uses its context
        nll = rng.gamma(4.0, level / 4.0, size=len(offsets)) * (1.0 - 0.05 * np.log2(offsets) / np.log2(context))
        rows.append(pd.DataFrame({"tile": tile, "offset": offsets, "nll": nll}))
    table = pd.concat(rows, ignore_index=True)
    if masked > 0:
        mask_rng = np.random.default_rng(seed + 1000)
        run = np.cumsum(mask_rng.random(len(table)) < 0.05)  # runs of ~20 targets share a class
        table["softmask"] = (mask_rng.random(run[-1] + 1) < masked)[run]
    table.attrs["lengths"] = lengths
    return table


def result_from_tokens(
    table: pd.DataFrame, context: int, edges: np.ndarray | None = None, label: str = "A", fingerprint: str = "f" * 64
) -> EvalResult:
    """Aggregate a per-token table into an :class:`EvalResult` (what ``genolong evaluate`` stores)."""
    edges = bucket_edges(context, first=8) if edges is None else np.asarray(edges)
    lengths = table.attrs["lengths"]
    w, k = len(lengths), len(edges) - 1
    tile = table["tile"].to_numpy()
    offset = table["offset"].to_numpy()
    nll = table["nll"].to_numpy(np.float64)
    bucket = np.searchsorted(edges, offset, side="right") - 1
    tile_tokens = np.zeros((w, k), np.int64)
    tile_nll = np.zeros((w, k))
    np.add.at(tile_tokens, (tile, bucket), 1)
    np.add.at(tile_nll, (tile, bucket), nll)
    split: dict[str, np.ndarray] = {}
    if "softmask" in table.columns:  # the soft-mask split, and the per-tile sums as its sums (as evaluate does)
        cls = table["softmask"].to_numpy(bool).astype(np.int64)
        split = {"softmask_tokens": np.zeros((w, k, 2), np.int64), "softmask_nll": np.zeros((w, k, 2))}
        np.add.at(split["softmask_tokens"], (tile, bucket, cls), 1)
        np.add.at(split["softmask_nll"], (tile, bucket, cls), nll)
        tile_nll = split["softmask_nll"][..., 0] + split["softmask_nll"][..., 1]
    meta = {
        "format": FORMAT,
        "label": label,
        "checkpoint": f"{label}.ckpt",
        "store": "genome",
        "split": "eval",
        "context": context,
        "context_cut": None,
        "bucket_edges": [int(e) for e in edges],
        "tiles": w,
        "tokens": int(len(table)),
        "nll_sum": float(tile_nll.sum()),
        "fingerprint": fingerprint,
        "dtype": "float32",
    }
    tiles = pd.DataFrame(
        {
            "tile": np.arange(w),
            "contig": ["chr22"] * (w - 3) + ["chrX"] * 3,
            "start": np.cumsum(np.r_[0, lengths[:-1]]) + 5000,
            "length": lengths,
        }
    )
    return EvalResult(
        meta=meta,
        tiles=tiles,
        tile_tokens=tile_tokens,
        tile_nll=tile_nll,
        position_tokens=np.bincount(offset, minlength=context),
        position_nll=np.bincount(offset, weights=nll, minlength=context),
        **split,
    )


# --------------------------------------------------------------------------------------------------
# buckets
# --------------------------------------------------------------------------------------------------


def test_bucket_edges_and_labels() -> None:
    assert bucket_edges(8192).tolist() == [1, 1024, 2048, 4096, 8192]
    assert bucket_labels(bucket_edges(8192)) == ["<1k", "1k-2k", "2k-4k", "4k-8k"]
    assert bucket_edges(1000).tolist() == [1, 1000]
    assert bucket_edges(1024).tolist() == [1, 1024]
    assert bucket_edges(1025).tolist() == [1, 1024, 1025]
    assert bucket_edges(20, first=4).tolist() == [1, 4, 8, 16, 20]
    assert bucket_labels(bucket_edges(20, first=4)) == ["<4", "4-8", "8-16", "16-20"]
    assert bucket_labels(bucket_edges(1 << 20))[-1] == "512k-1M"
    assert bucket_edges(1 << 20).dtype == np.int64
    with pytest.raises(InputError, match="at least 2"):
        bucket_edges(1)
    with pytest.raises(InputError, match="first bucket edge"):
        bucket_edges(100, first=1)


# --------------------------------------------------------------------------------------------------
# block bootstrap
# --------------------------------------------------------------------------------------------------


def test_resample_counts_are_the_bincount_of_the_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    # small blocks so that several blocks of replicates are drawn
    monkeypatch.setattr(bootstrap, "_BLOCK_CELLS", 100)
    idx = np.concatenate(list(resample_indices(30, 50, seed=3)))
    counts = np.concatenate(list(resample_counts(30, 50, seed=3)))
    assert idx.shape == counts.shape == (50, 30)
    for r in range(50):
        np.testing.assert_array_equal(counts[r], np.bincount(idx[r], minlength=30))  # exact: counts
    assert (counts.sum(axis=1) == 30).all()
    # the draws depend on the seed only
    np.testing.assert_array_equal(idx, np.concatenate(list(resample_indices(30, 50, seed=3))))  # exact: indices
    assert not np.array_equal(idx, np.concatenate(list(resample_indices(30, 50, seed=4))))  # exact: indices


@pytest.mark.parametrize("block_cells", [100, 1 << 21])
def test_block_bootstrap_matches_brute_force(monkeypatch: pytest.MonkeyPatch, block_cells: int) -> None:
    monkeypatch.setattr(bootstrap, "_BLOCK_CELLS", block_cells)
    rng = np.random.default_rng(0)
    w, k, n_boot = 30, 3, 300
    tokens = rng.integers(0, 50, size=(w, k))
    tokens[:, 2] = 0
    tokens[[4, 17], 2] = [5, 9]  # a bucket present in two tiles only: some replicates miss it
    nll = tokens * rng.gamma(5.0, 0.25, size=(w, k))
    mean, lo, hi = block_bootstrap(tokens, nll, n_boot=n_boot, seed=7, level=0.9)

    reps = []
    for idx in np.concatenate(list(resample_indices(w, n_boot, seed=7))):
        t, n = tokens[idx].sum(axis=0), nll[idx].sum(axis=0)
        reps.append([n[j] / t[j] if t[j] > 0 else np.nan for j in range(k)])
    reps = np.asarray(reps)
    np.testing.assert_allclose(bootstrap_replicates(tokens, nll, n_boot, seed=7), reps, rtol=1e-12)
    np.testing.assert_allclose(mean, nll.sum(axis=0) / tokens.sum(axis=0), rtol=1e-14)
    for j in range(k):
        col = reps[:, j][~np.isnan(reps[:, j])]
        np.testing.assert_allclose([lo[j], hi[j]], np.quantile(col, [0.05, 0.95]), rtol=1e-12)
    assert np.isnan(reps[:, 2]).any()


def test_ci_contains_point_and_collapses_for_identical_tiles() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(10, 60, size=(40, 4))
    nll = tokens * rng.gamma(6.0, 0.22, size=(40, 4))
    mean, lo, hi = block_bootstrap(tokens, nll, n_boot=500, seed=0)
    assert (lo <= mean).all() and (mean <= hi).all() and (lo < hi).all()

    same_t = np.tile([[12, 30, 7]], (25, 1))
    same_n = np.tile([[15.5, 41.25, 9.0]], (25, 1))
    mean, lo, hi = block_bootstrap(same_t, same_n, n_boot=200, seed=5)
    np.testing.assert_allclose(mean, [15.5 / 12, 41.25 / 30, 9.0 / 7], rtol=1e-15)
    np.testing.assert_allclose(lo, mean, rtol=1e-13)
    np.testing.assert_allclose(hi, mean, rtol=1e-13)


def test_bootstrap_coverage_on_known_truth() -> None:
    # tiles with a random level around a known mean: the ratio-of-sums estimator targets `truth`
    truth, w, repeats, hits, widths = 1.3, 60, 200, 0, []
    rng = np.random.default_rng(42)
    for rep in range(repeats):
        tokens = rng.integers(50, 150, size=w)
        nll = tokens * (truth + rng.normal(0.0, 0.15, size=w))
        _, lo, hi = block_bootstrap(tokens, nll, n_boot=400, seed=rep)
        hits += bool(lo[0] <= truth <= hi[0])
        widths.append(hi[0] - lo[0])
    coverage = hits / repeats
    assert 0.90 <= coverage <= 0.99, coverage
    # the interval's width matches the standard error of a mean of 60 tiles (sd 0.15): 2 * 1.96 * se
    assert abs(np.mean(widths) / (2 * 1.96 * 0.15 / math.sqrt(w)) - 1) < 0.15


def test_empty_bucket_and_bad_arguments() -> None:
    tokens = np.array([[3, 0], [4, 0]])
    nll = np.array([[3.0, 0.0], [5.0, 0.0]])
    mean, lo, hi = block_bootstrap(tokens, nll, n_boot=50)
    assert np.isnan([mean[1], lo[1], hi[1]]).all() and not np.isnan([mean[0], lo[0], hi[0]]).any()
    with pytest.raises(InputError, match="level"):
        block_bootstrap(tokens, nll, level=1.5)
    with pytest.raises(InputError, match="resamples"):
        block_bootstrap(tokens, nll, n_boot=0)
    with pytest.raises(InputError, match="same"):
        block_bootstrap(tokens, nll[:, :1])


# --------------------------------------------------------------------------------------------------
# bucket table
# --------------------------------------------------------------------------------------------------


def test_bucket_table_matches_per_token_groupby() -> None:
    table = synthetic_tokens(n_tiles=24, context=64, seed=2)
    result = result_from_tokens(table, 64)
    got = result.bucket_table(n_boot=300, seed=1)
    assert list(got.columns) == BUCKET_COLUMNS
    assert got["bucket"].tolist() == ["<8", "8-16", "16-32", "32-64", "all"]
    assert got["lo"].tolist() == [1, 8, 16, 32, 1] and got["hi"].tolist() == [8, 16, 32, 64, 64]

    edges = result.edges
    table["bucket"] = pd.cut(table["offset"], bins=edges, right=False, labels=bucket_labels(edges))
    brute = table.groupby("bucket", observed=False)["nll"].agg(["size", "mean"])
    np.testing.assert_array_equal(got["tokens"].to_numpy()[:-1], brute["size"].to_numpy())  # exact: counts
    np.testing.assert_allclose(got["nats"].to_numpy()[:-1], brute["mean"].to_numpy(), rtol=1e-12)
    assert got["tokens"].iloc[-1] == len(table)
    np.testing.assert_allclose(got["nats"].iloc[-1], table["nll"].mean(), rtol=1e-12)
    np.testing.assert_allclose(got["bits"], got["nats"] / math.log(2), rtol=1e-15)
    np.testing.assert_allclose(got["bits_ci_lo"], got["ci_lo"] / math.log(2), rtol=1e-15)

    # the CIs are those of a brute-force bootstrap over per-token rows grouped by tile
    idx_all = np.concatenate(list(resample_indices(24, 300, seed=1)))
    per_tile = table.groupby(["tile", "bucket"], observed=False)["nll"].agg(["size", "sum"])
    t = per_tile["size"].to_numpy().reshape(24, -1)
    n = per_tile["sum"].to_numpy().reshape(24, -1)
    t, n = np.c_[t, t.sum(1)], np.c_[n, n.sum(1)]
    reps = np.array([n[i].sum(0) / t[i].sum(0) for i in idx_all])
    q = np.quantile(reps, [0.025, 0.975], axis=0)
    np.testing.assert_allclose(got["ci_lo"], q[0], rtol=1e-12)
    np.testing.assert_allclose(got["ci_hi"], q[1], rtol=1e-12)


def test_bucket_table_empty_bucket_is_nan() -> None:
    t = np.array([[5, 0], [6, 0]])
    got = bucket_table_from_arrays(t, t * 1.5, np.array([1, 8, 16]), n_boot=20)
    assert got["tokens"].tolist() == [11, 0, 11]
    assert got.loc[1, ["nats", "ci_lo", "ci_hi", "bits"]].isna().all()
    np.testing.assert_allclose(got.loc[2, ["nats", "ci_lo", "ci_hi"]].to_numpy(float), 1.5, rtol=1e-15)


def test_position_curve_matches_brute_force() -> None:
    table = synthetic_tokens(n_tiles=10, context=200, seed=3)
    curve = result_from_tokens(table, 200).position_curve(bins_per_octave=4)
    lo, hi = curve["lo"].to_numpy(), curve["hi"].to_numpy()
    assert lo[0] == 1 and hi[-1] == 200 and (lo[1:] == hi[:-1]).all() and (hi > lo).all()
    expect = np.unique(np.rint(2.0 ** (np.arange(40) / 4)).astype(int))
    np.testing.assert_array_equal(lo, expect[expect < 200])  # exact: integer edges
    for row in curve.itertuples():
        sel = table[(table["offset"] >= row.lo) & (table["offset"] < row.hi)]
        assert row.tokens == len(sel)
        np.testing.assert_allclose(row.nats, sel["nll"].mean(), rtol=1e-12)
        np.testing.assert_allclose(row.offset_mid, math.sqrt(row.lo * (row.hi - 1)), rtol=1e-15)


# --------------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------------


def _pair(noise: float, shift: float = 0.0, seed: int = 4) -> tuple[pd.DataFrame, EvalResult, EvalResult]:
    table = synthetic_tokens(n_tiles=30, context=64, seed=seed)
    a = result_from_tokens(table, 64, label="base")
    rng = np.random.default_rng(seed + 100)
    tb = table.copy()
    tb["nll"] = table["nll"] * (1.0 - shift) + rng.normal(0.0, noise, size=len(table))
    b = result_from_tokens(tb, 64, label="tuned")
    return table.assign(nll_b=tb["nll"]), a, b


def test_compare_matches_brute_force() -> None:
    table, a, b = _pair(noise=0.05, shift=0.02)
    got = compare(a, b, n_boot=300, seed=2)
    assert list(got.columns) == COMPARE_COLUMNS
    assert got["bucket"].tolist() == a.labels + ["all"]

    table["bucket"] = np.searchsorted(a.edges, table["offset"], side="right") - 1
    by = table.groupby("bucket")[["nll", "nll_b"]].mean()
    a_mean = np.r_[by["nll"].to_numpy(), table["nll"].mean()]
    b_mean = np.r_[by["nll_b"].to_numpy(), table["nll_b"].mean()]
    np.testing.assert_allclose(got["a_nats"], a_mean, rtol=1e-12)
    np.testing.assert_allclose(got["b_nats"], b_mean, rtol=1e-12)
    np.testing.assert_allclose(got["diff"], b_mean - a_mean, rtol=1e-9)
    np.testing.assert_allclose(got["rel_pct"], 100 * (b_mean / a_mean - 1), rtol=1e-9)

    # paired: the same tile indices for A and B in every replicate
    ta, na = np.c_[a.tile_tokens, a.tile_tokens.sum(1)], np.c_[a.tile_nll, a.tile_nll.sum(1)]
    nb = np.c_[b.tile_nll, b.tile_nll.sum(1)]
    diffs, rels = [], []
    for idx in np.concatenate(list(resample_indices(a.n_tiles, 300, seed=2))):
        ma, mb = na[idx].sum(0) / ta[idx].sum(0), nb[idx].sum(0) / ta[idx].sum(0)
        diffs.append(mb - ma)
        rels.append(mb / ma - 1)
    dq = np.quantile(diffs, [0.025, 0.975], axis=0)
    rq = np.quantile(rels, [0.025, 0.975], axis=0)
    np.testing.assert_allclose(got["diff_ci_lo"], dq[0], rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(got["diff_ci_hi"], dq[1], rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(got["rel_ci_lo"], 100 * rq[0], rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(got["rel_ci_hi"], 100 * rq[1], rtol=1e-9, atol=1e-13)
    np.testing.assert_array_equal(got["supported"], (dq[0] > 0) | (dq[1] < 0))  # exact: bools
    # a 2% lower loss with small noise is supported everywhere
    assert got["supported"].all() and (got["rel_ci_hi"] < 0).all()


def test_paired_ci_is_narrower_than_unpaired() -> None:
    _, a, b = _pair(noise=0.02, shift=0.0)
    paired = paired_bootstrap(a.tile_tokens, a.tile_nll, b.tile_tokens, b.tile_nll, n_boot=400, seed=0)
    # unpaired: A and B resampled independently (different seeds)
    ra = bootstrap_replicates(a.tile_tokens, a.tile_nll, 400, seed=1)
    rb = bootstrap_replicates(b.tile_tokens, b.tile_nll, 400, seed=2)
    uq = np.quantile(rb - ra, [0.025, 0.975], axis=0)
    paired_width = paired.diff_hi - paired.diff_lo
    assert (paired_width < 0.5 * (uq[1] - uq[0])).all(), (paired_width, uq[1] - uq[0])


def test_compare_identical_runs_is_not_supported() -> None:
    table = synthetic_tokens(n_tiles=12, context=64, seed=5)
    a = result_from_tokens(table, 64, label="A")
    b = result_from_tokens(table, 64, label="B")
    got = compare(a, b, n_boot=100)
    assert (got["diff"] == 0).all() and (got["diff_ci_lo"] == 0).all() and (got["diff_ci_hi"] == 0).all()
    assert not got["supported"].any()


def test_compare_refuses_other_token_sets(tmp_path: Path) -> None:
    table = synthetic_tokens(n_tiles=12, context=64, seed=6)
    a = result_from_tokens(table, 64, label="base")
    other = result_from_tokens(table, 64, label="other", fingerprint="0" * 64)
    a_dir, o_dir = tmp_path / "base_run", tmp_path / "other_run"
    a_dir.mkdir()
    o_dir.mkdir()
    a.save(a_dir)
    other.save(o_dir)
    with pytest.raises(InputError) as err:
        compare(EvalResult.load(a_dir), EvalResult.load(o_dir), n_boot=10)
    msg = str(err.value)
    assert "base" in msg and "other" in msg and str(a_dir) in msg and str(o_dir) in msg
    assert "fingerprint" in msg and "--store" in msg and "--max-tiles" in msg and "\n" not in msg

    wide = result_from_tokens(table, 64, edges=np.array([1, 16, 64]), label="wide")
    with pytest.raises(InputError, match="bucket edges differ") as err:
        compare(a, wide, n_boot=10)
    assert "base" in str(err.value) and "wide" in str(err.value) and "--context" in str(err.value)

    # same fingerprint, different per-tile counts: a damaged result
    moved = table.copy()
    moved.loc[moved.index[0], "tile"] = 1
    moved.attrs = table.attrs
    with pytest.raises(InputError, match="token counts per tile"):
        compare(a, result_from_tokens(moved, 64, label="moved"), n_boot=10)


# --------------------------------------------------------------------------------------------------
# EvalResult files
# --------------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    result = result_from_tokens(synthetic_tokens(n_tiles=9, context=64, seed=7), 64)
    result.meta["tokens_per_second"] = np.float64(1234.5)  # numpy scalars are written as JSON numbers
    result.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "buckets.csv",
        "meta.json",
        "positions.parquet",
        "tile_buckets.parquet",
        "tiles.parquet",
    ]
    back = EvalResult.load(tmp_path)
    assert back.meta == json.loads(json.dumps(result.meta, default=float)) and back.source == tmp_path
    pd.testing.assert_frame_equal(back.tiles, result.tiles)
    for name in ("tile_tokens", "tile_nll", "position_tokens", "position_nll"):
        np.testing.assert_array_equal(getattr(back, name), getattr(result, name))  # exact: saved and read back
        assert getattr(back, name).dtype == getattr(result, name).dtype
    assert (back.label, back.context, back.fingerprint, back.tokens) == ("A", 64, "f" * 64, result.tokens)
    assert back.mean_nll == result.mean_nll and back.context_cut is None

    schema = {
        name: pq.read_schema(tmp_path / name) for name in ("tiles.parquet", "tile_buckets.parquet", "positions.parquet")
    }
    assert [(f.name, str(f.type)) for f in schema["tiles.parquet"]] == [
        ("tile", "int64"),
        ("contig", "string"),
        ("start", "int64"),
        ("length", "int64"),
    ]
    assert [(f.name, str(f.type)) for f in schema["tile_buckets.parquet"]] == [
        ("tile", "int64"),
        ("bucket", "int64"),
        ("tokens", "int64"),
        ("nll_sum", "double"),
    ]
    assert [(f.name, str(f.type)) for f in schema["positions.parquet"]] == [
        ("offset", "int64"),
        ("tokens", "int64"),
        ("nll_sum", "double"),
    ]
    cells = pq.read_table(tmp_path / "tile_buckets.parquet").to_pandas()
    assert cells["tile"].tolist() == list(np.repeat(np.arange(9), 4))  # dense, tile-major
    csv = pd.read_csv(tmp_path / "buckets.csv")
    pd.testing.assert_frame_equal(csv, result.bucket_table(), check_dtype=False)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist.*genolong evaluate"):
        EvalResult.load(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no meta.json.*genolong evaluate"):
        EvalResult.load(empty)

    good = result_from_tokens(synthetic_tokens(n_tiles=6, context=64, seed=8), 64)

    def saved(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        good.save(d)
        return d

    d = saved("format")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(meta | {"format": "genolong-eval/0"}))
    with pytest.raises(InputError, match="genolong-eval/0.*genolong evaluate") as err:
        EvalResult.load(d)
    assert str(d) in str(err.value)

    d = saved("shape")
    cells = pq.read_table(d / "tile_buckets.parquet").to_pandas()
    pq.write_table(pq.read_table(d / "tile_buckets.parquet").slice(0, len(cells) - 4), d / "tile_buckets.parquet")
    with pytest.raises(InputError, match="dense 6 tiles x 4 buckets") as err:
        EvalResult.load(d)
    assert str(d) in str(err.value)

    d = saved("tokens")
    (d / "meta.json").write_text(json.dumps(meta | {"tokens": meta["tokens"] + 1}))
    with pytest.raises(InputError, match="token totals disagree"):
        EvalResult.load(d)

    d = saved("positions")
    (d / "positions.parquet").unlink()
    with pytest.raises(InputError, match="lacks positions.parquet"):
        EvalResult.load(d)

    with pytest.raises(InputError, match="expected \\(6, 4\\)"):
        EvalResult(
            good.meta,
            good.tiles,
            good.tile_tokens[:, :3],
            good.tile_nll[:, :3],
            good.position_tokens,
            good.position_nll,
        )
    with pytest.raises(InputError, match="not an existing directory"):
        good.save(tmp_path / "nowhere")
