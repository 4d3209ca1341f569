"""The two-stage (regions, then tiles) paired bootstrap of the spread benchmark, against known answers."""

from __future__ import annotations

import numpy as np
import pytest

from genolong.errors import InputError
from genolong.evaluation.bootstrap import hierarchical_paired_bootstrap, paired_bootstrap


def _group(n_tiles: int, factor: float, seed: int, k: int = 3) -> tuple[np.ndarray, ...]:
    """``n_tiles`` tiles of random difficulty where run B's loss is about ``factor`` times run A's (tile noise 2%)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(50, 100, size=(n_tiles, k)).astype(np.float64)
    a_nll = tokens * rng.uniform(0.8, 1.6, size=(n_tiles, 1))
    return tokens, a_nll, tokens.copy(), a_nll * factor * rng.normal(1.0, 0.02, size=(n_tiles, 1))


def test_point_estimate_pools_every_tile() -> None:
    groups = [_group(7, 0.97, 1), _group(12, 1.01, 2), _group(2, 0.9, 3)]
    concat = [np.concatenate([g[i] for g in groups]) for i in range(4)]
    pooled = hierarchical_paired_bootstrap(groups, n_boot=200)
    plain = paired_bootstrap(*concat, n_boot=200)
    for name in ("a_mean", "b_mean", "diff", "rel"):
        np.testing.assert_allclose(getattr(pooled, name), getattr(plain, name), rtol=1e-12, err_msg=name)
    assert (pooled.rel_lo <= pooled.rel).all() and (pooled.rel <= pooled.rel_hi).all()


def test_interval_carries_the_between_region_spread() -> None:
    # two regions of equal tokens, B 10% worse on every tile of one and 10% better on every tile of the other:
    # the tiles inside a region agree, so the region draw decides each replicate: {+10%, 0, -10%} with
    # probabilities 1/4, 1/2, 1/4, and the 95% interval is [-10%, +10%]
    tokens = np.full((20, 2), 64.0)
    up = (tokens, tokens * 1.0, tokens, tokens * 1.1)
    down = (tokens, tokens * 1.0, tokens, tokens * 0.9)
    pooled = hierarchical_paired_bootstrap([up, down], n_boot=2000, seed=3)
    np.testing.assert_allclose(pooled.rel, 0.0, atol=1e-12)
    np.testing.assert_allclose(pooled.rel_lo, -0.1, atol=1e-9)
    np.testing.assert_allclose(pooled.rel_hi, 0.1, atol=1e-9)
    # a tile bootstrap over all 40 tiles treats them as exchangeable: far narrower
    plain = paired_bootstrap(*(np.concatenate([u, d]) for u, d in zip(up, down)), n_boot=2000)
    assert (plain.rel_hi - plain.rel_lo < 0.08).all()


def test_one_region_is_the_tile_bootstrap_in_distribution() -> None:
    # one group: stage one always draws it, so only the tile noise is left; same width as paired_bootstrap
    # up to Monte Carlo error (4000 replicates each: the 2.5% quantile moves by a few % of the width)
    group = _group(30, 0.98, 5)
    hier = hierarchical_paired_bootstrap([group], n_boot=4000, seed=1)
    plain = paired_bootstrap(*group, n_boot=4000, seed=2)
    width_h, width_p = hier.rel_hi - hier.rel_lo, plain.rel_hi - plain.rel_lo
    np.testing.assert_allclose(width_h, width_p, rtol=0.15)


def test_same_seed_same_interval_and_bad_input() -> None:
    groups = [_group(5, 0.95, 1), _group(9, 1.02, 2)]
    a, b = (
        hierarchical_paired_bootstrap(groups, n_boot=300, seed=7),
        hierarchical_paired_bootstrap(groups, n_boot=300, seed=7),
    )
    np.testing.assert_array_equal(a.rel_lo, b.rel_lo)  # exact: the same numpy computation, the same seed (no torch)
    with pytest.raises(InputError, match="at least one group"):
        hierarchical_paired_bootstrap([])
    t, n, _, _ = _group(4, 1.0, 1)
    with pytest.raises(InputError, match="same \\[tiles, buckets\\]"):
        hierarchical_paired_bootstrap([(t, n, t[:3], n[:3])])
    with pytest.raises(InputError, match="same buckets"):
        hierarchical_paired_bootstrap([(t, n, t, n), (t[:, :2], n[:, :2], t[:, :2], n[:, :2])])


def _spread_script():
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("heldout_spread", ROOT / "benchmarks" / "heldout_spread.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spread_tiles_cover_the_region_evenly() -> None:
    script = _spread_script()
    assert script.spread(109, 4).tolist() == [0, 36, 72, 108]  # first, last and evenly between: not the first 4
    assert script.spread(2, 4).tolist() == [0, 1]  # chrM: both whole tiles
    assert script.spread(5, 1).tolist() == [0]


def test_pooled_figure_and_range_from_per_tile_arrays() -> None:
    """The benchmark's pooled figure is the hierarchical bootstrap of its regions' arrays, and its range the
    smallest and largest per-region change (each region's ratio of sums)."""
    script = _spread_script()
    regions = {}
    for name, factor, n in (("x", 0.98, 6), ("y", 1.01, 4), ("z", 0.95, 2)):
        t, a, _, b = _group(n, factor, seed=n, k=2)
        regions[name] = {
            "buckets": ["<1k", "1k-2k"],
            "runs": {"cut": {"tokens": t, "nll": a}, "full": {"tokens": t, "nll": b}},
        }
    out = script.pooled(regions, "cut", "full", n_boot=500)
    groups = [
        tuple(
            np.concatenate([c, c.sum(axis=1, keepdims=True)], axis=1)
            for c in (
                r["runs"]["cut"]["tokens"],
                r["runs"]["cut"]["nll"],
                r["runs"]["full"]["tokens"],
                r["runs"]["full"]["nll"],
            )
        )
        for r in regions.values()
    ]
    want = hierarchical_paired_bootstrap(groups, n_boot=500)
    assert out["buckets"]["all"]["change_pct"] == pytest.approx(100 * want.rel[-1])
    assert out["buckets"]["1k-2k"]["ci"] == pytest.approx([100 * want.rel_lo[1], 100 * want.rel_hi[1]])
    per_region = [100 * (r["runs"]["full"]["nll"].sum() / r["runs"]["cut"]["nll"].sum() - 1) for r in regions.values()]
    assert out["range"]["all"] == pytest.approx([min(per_region), max(per_region)])


def test_quickstart_report_cites_the_spread_under_full_vs_cut(tmp_path) -> None:
    """REPORT.md puts the committed spread figure (labelled as the benchmark's) right under the full-vs-cut
    comparison it gives context to, and only there."""
    from types import SimpleNamespace

    from genolong.evaluation.stats import compare
    from genolong.quickstart import _spread_context, _Stages, _Story, _write_report
    from tests.evaluation.test_eval_stats import result_from_tokens, synthetic_tokens

    table = synthetic_tokens(n_tiles=4, seed=1)
    cut = result_from_tokens(table, 64, label="cut")
    full = result_from_tokens(table.assign(nll=table["nll"] * 0.98), 64, label="full")
    recipe = SimpleNamespace(
        train=SimpleNamespace(max_steps=6, lr=3e-4),
        data=SimpleNamespace(batch_size=1, context=8192),
        model=SimpleNamespace(freeze=[]),
    )
    story = _Story(
        context=8192,
        cut=1024,
        tiles=4,
        recipe=recipe,
        base=tmp_path,
        reading={},
        results={"tuned-cut": cut, "tuned": full},
        comparisons=[
            ("tuned-cut", "tuned", "full vs cut", compare(cut, full)),
            ("tuned", "tuned-cut", "the other way", compare(full, cut)),
        ],
    )
    _write_report(tmp_path / "REPORT.md", story, _Stages(1))
    report = (tmp_path / "REPORT.md").read_text()
    assert report.count(_spread_context()) == 1
    assert report.index("### full vs cut") < report.index(_spread_context()) < report.index("### the other way")


def test_report_ranks_the_quickstart_region_among_the_others() -> None:
    """The REPORT's spread line says where chr22 stands among the regions (full - cut: more negative,
    larger gain), and the wording follows the figures."""
    from genolong.quickstart import _rank

    figures = {"chr22": -1.3, "HLA": -0.9, "chr16": -1.1, "chrM": -0.6}
    assert _rank("chr22", figures) == "the largest"
    assert _rank("chr16", figures) == "the second largest"
    assert _rank("HLA", figures) == "the second smallest"
    assert _rank("chrM", figures) == "the smallest"
    assert _rank("chr22", {**figures, "chr16": -1.3}) == "the largest"  # a tie ranks together
    assert _rank("chr22", {**figures, "chr22": -0.5}) == "the smallest"
