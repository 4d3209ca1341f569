"""Figures: valid PNG/PDF files, and the drawn data series equal the saved tables."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from genolong.errors import InputError
from genolong.evaluation.plots import (
    OKABE_ITO,
    bucket_figure,
    plot_results,
    position_figure,
    relative_change_figure,
)
from genolong.evaluation.stats import compare
from tests.evaluation.test_eval_stats import result_from_tokens, synthetic_tokens

N_BOOT = 200


@pytest.fixture(scope="module")
def runs() -> list:
    """base, tuned (same tokens, lower loss at long offsets) and a run on another token set."""
    table = synthetic_tokens(n_tiles=16, context=256, seed=11)
    base = result_from_tokens(table, 256, label="base")
    tuned_table = table.copy()
    tuned_table["nll"] = table["nll"] * (1.0 - 0.03 * (table["offset"] >= 64))
    tuned = result_from_tokens(tuned_table, 256, label="tuned")
    other = result_from_tokens(
        synthetic_tokens(n_tiles=16, context=256, seed=12), 256, label="other", fingerprint="0" * 64
    )
    return [base, tuned, other]


def _data_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_label() and not line.get_label().startswith("_")]


def _drawn(actual: np.ndarray, expected: np.ndarray) -> None:
    """A drawn series against its table, bit for bit: both come from the same numpy/pandas
    computation on the same arrays (no torch, so no torch threads to change a summation order)."""
    np.testing.assert_array_equal(actual, expected)  # exact: the same numpy computation on the same data


def test_position_figure_draws_the_position_curves(runs) -> None:
    fig, series = position_figure(runs[:2], bins_per_octave=4)
    ax = fig.axes[0]
    lines = _data_lines(ax)
    assert [line.get_label() for line in lines] == ["base", "tuned"]
    assert ax.get_xscale() == "log" and "nats/base" in ax.get_ylabel() and "preceding bases" in ax.get_xlabel()
    assert ax.get_title() and ax.get_legend() is not None
    for run, line in zip(runs[:2], lines):
        curve = run.position_curve(4)
        curve = curve[curve["tokens"] > 0]
        _drawn(line.get_xdata(), curve["offset_mid"].to_numpy())
        _drawn(line.get_ydata(), curve["nats"].to_numpy())
        part = series[series["run"] == run.label]
        _drawn(part["offset_mid"].to_numpy(), line.get_xdata())
        _drawn(part["nats"].to_numpy(), line.get_ydata())
    assert [line.get_color() for line in lines] == [OKABE_ITO[0], OKABE_ITO[1]]


def test_bucket_figure_error_bars_are_the_bucket_table_cis(runs) -> None:
    fig, series = bucket_figure(runs[:2], n_boot=N_BOOT, seed=3)
    ax = fig.axes[0]
    lines = _data_lines(ax)
    assert [line.get_label() for line in lines] == ["base", "tuned"]
    assert "nats/base" in ax.get_ylabel() and ax.get_xlabel() and ax.get_title()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["base", "tuned"]
    assert [t.get_text() for t in ax.get_xticklabels()] == runs[0].labels + ["all"]
    intervals = ax.collections  # one LineCollection of vertical CI segments per run
    assert len(intervals) == 2
    for run, line, segs in zip(runs[:2], lines, intervals):
        table = run.bucket_table(n_boot=N_BOOT, seed=3)
        seg = np.asarray(segs.get_segments())  # [K + 1, 2 points, (x, y)]
        _drawn(seg[:, 0, 1], table["ci_lo"].to_numpy())
        _drawn(seg[:, 1, 1], table["ci_hi"].to_numpy())
        _drawn(seg[:, 0, 0], line.get_xdata())
        _drawn(line.get_ydata(), table["nats"].to_numpy())
        part = series[series["run"] == run.label]
        _drawn(part[["nats", "ci_lo", "ci_hi"]].to_numpy(), table[["nats", "ci_lo", "ci_hi"]].to_numpy())
    # runs side by side: the same bucket at two distinct x positions, within its category
    xs = [line.get_xdata() for line in lines]
    assert (xs[0] < xs[1]).all() and (np.abs(xs[1] - np.arange(len(xs[1]))) < 0.5).all()


def test_relative_change_figure_is_the_compare_table(runs) -> None:
    fig, series = relative_change_figure(runs[:2], n_boot=N_BOOT, seed=1)
    ax = fig.axes[0]
    table = compare(runs[0], runs[1], n_boot=N_BOOT, seed=1)
    (line,) = _data_lines(ax)
    _drawn(line.get_ydata(), table["rel_pct"].to_numpy())
    seg = np.asarray(ax.collections[0].get_segments())
    _drawn(seg[:, 0, 1], table["rel_ci_lo"].to_numpy())
    _drawn(seg[:, 1, 1], table["rel_ci_hi"].to_numpy())
    _drawn(series["rel_pct"].to_numpy(), table["rel_pct"].to_numpy())
    _drawn(series["supported"].to_numpy(), table["supported"].to_numpy())
    # the horizontal line at 0
    assert any(np.array_equal(np.asarray(l.get_ydata(), float), [0.0, 0.0]) for l in ax.get_lines())  # exact: constants
    assert "%" in ax.get_ylabel()
    # the tuned run is 3% better from offset 64 on, unchanged before
    rel = table["rel_pct"].to_numpy()
    assert runs[0].edges.tolist() == [1, 8, 16, 32, 64, 128, 256]
    assert np.allclose(rel[4:-1], -3.0) and (rel[:4] == 0).all() and -3.0 < rel[-1] < 0
    with pytest.raises(InputError, match="fingerprint"):
        relative_change_figure([runs[0], runs[2]], n_boot=N_BOOT)
    with pytest.raises(InputError, match="at least 2"):
        relative_change_figure(runs[:1])


def test_plot_results_writes_valid_files_equal_to_the_tables(
    runs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = plt.get_fignums()
    out = tmp_path / "figs"
    with caplog.at_level(logging.WARNING, logger="genolong.evaluation.plots"):
        written = plot_results(runs, out, n_boot=N_BOOT, seed=0)
    assert plt.get_fignums() == before  # no pyplot figures were created or left open
    stems = ["position_loss", "buckets", "relative_change"]
    assert sorted(written) == sorted(f"{s}.{ext}" for s in stems for ext in ("png", "pdf", "csv"))
    assert sorted(p.name for p in out.iterdir()) == sorted(written)  # no temporary leftovers
    for stem in stems:
        png = (out / f"{stem}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        with Image.open(out / f"{stem}.png") as im:
            im.verify()
        with Image.open(out / f"{stem}.png") as im:
            assert im.size[0] > 400 and im.size[1] > 300
        assert (out / f"{stem}.pdf").read_bytes().startswith(b"%PDF")
    # the run with another token set is left out of the relative-change figure, with one warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "other" in warnings[0].getMessage()

    pos = pd.read_csv(out / "position_loss.csv")
    assert sorted(set(pos["run"])) == ["base", "other", "tuned"]
    _, series = position_figure(runs)
    np.testing.assert_allclose(
        pos[["offset_mid", "nats"]].to_numpy(), series[["offset_mid", "nats"]].to_numpy(), rtol=1e-15
    )
    buckets = pd.read_csv(out / "buckets.csv")
    np.testing.assert_allclose(
        buckets[buckets["run"] == "tuned"][["nats", "ci_lo", "ci_hi"]].to_numpy(),
        runs[1].bucket_table(n_boot=N_BOOT, seed=0)[["nats", "ci_lo", "ci_hi"]].to_numpy(),
        rtol=1e-15,
    )
    rel = pd.read_csv(out / "relative_change.csv")
    assert set(rel["run"]) == {"tuned"}
    np.testing.assert_allclose(
        rel["rel_ci_lo"].to_numpy(),
        compare(runs[0], runs[1], n_boot=N_BOOT, seed=0)["rel_ci_lo"].to_numpy(),
        rtol=1e-15,
    )


def test_plot_results_single_run_and_bad_format(runs, tmp_path: Path) -> None:
    written = plot_results(runs[:1], tmp_path, formats=("png",), n_boot=50)
    assert sorted(written) == ["buckets.csv", "buckets.png", "position_loss.csv", "position_loss.png"]
    with pytest.raises(InputError, match="unknown figure format"):
        plot_results(runs[:1], tmp_path, formats=("gif2",), n_boot=50)
    with pytest.raises(InputError, match="at least 1"):
        plot_results([], tmp_path)


def test_bucket_figure_merges_runs_of_other_contexts(runs) -> None:
    short = result_from_tokens(synthetic_tokens(n_tiles=8, context=64, seed=13), 64, label="short")
    fig, series = bucket_figure([runs[0], short], n_boot=50)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["<8", "8-16", "16-32", "32-64", "64-128", "128-256", "all"]
    part = series[series["run"] == "short"]
    assert part["bucket"].tolist() == ["<8", "8-16", "16-32", "32-64", "all"]
    # the short run's buckets sit in the categories of the same offsets, and its overall row in "all"
    np.testing.assert_array_equal(np.rint(part["x"].to_numpy()), [0, 1, 2, 3, 6])  # exact: integers
