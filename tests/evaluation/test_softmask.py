"""--by softmask: bucket tables, comparisons and figures split by soft-masked vs unmasked bases.

Oracles: pandas group-bys of the per-token table (synthetic, and the one ``genolong evaluate``
writes), brute-force bootstraps over the resamples of ``resample_indices``, and constructed gap
tables for the quickstart REPORT's wording.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from genolong.cli import main
from genolong.errors import InputError
from genolong.evaluation.plots import bucket_figure, relative_change_figure
from genolong.evaluation.results import EvalResult
from genolong.evaluation.score import evaluate, read_tokens
from genolong.evaluation.stats import (
    BUCKET_COLUMNS,
    COMPARE_COLUMNS,
    GAP_COLUMNS,
    bucket_edges,
    compare,
    compare_softmask,
    resample_indices,
)
from genolong.model import PRESETS, GenoLM
from genolong.quickstart import _softmask_reading, _softmask_section, _Story
from tests.evaluation.test_eval_stats import result_from_tokens, synthetic_tokens
from tests.evaluation.test_evaluate import make_split
from tests.helpers import SOFTMASKED_CHR16, write_fasta

pytestmark = pytest.mark.usefixtures("one_thread")

N_BOOT = 300


@pytest.fixture(scope="module")
def chr16_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose eval split is the soft-masked hg38 chr16 slice of tests/data (42% lower case:
    the bundled sample's held-out chr22 is upper case, it has no soft-masked base to split)."""
    from genolong.data.prepare import prepare_genome

    tmp = tmp_path_factory.mktemp("chr16")
    other = write_fasta(tmp / "m.fa", [("chrM", "ACGT" * 300)])
    prepare_genome([SOFTMASKED_CHR16, other], tmp / "genome", train="MT", eval="16", progress=False)
    return tmp / "genome"


def _pair(seed: int = 21, masked_gain: float = 0.04, unmasked_gain: float = 0.0, noise: float = 0.01):
    """A base run and a tuned run on the same tokens: the tuned loss lower by ``masked_gain`` on
    soft-masked targets and ``unmasked_gain`` on the others, with per-token noise."""
    table = synthetic_tokens(n_tiles=30, context=64, seed=seed, masked=0.4)
    rng = np.random.default_rng(seed + 7)
    tuned = table.copy()
    gain = np.where(table["softmask"], masked_gain, unmasked_gain)
    tuned["nll"] = table["nll"] * (1.0 - gain) + rng.normal(0.0, noise, size=len(table))
    return (
        table.assign(nll_b=tuned["nll"]),
        result_from_tokens(table, 64, label="base"),
        result_from_tokens(tuned, 64, label="tuned"),
    )


def _with_overall(t: np.ndarray) -> np.ndarray:
    return np.c_[t, t.sum(axis=1)]


def test_split_bucket_table_is_the_per_token_groupby_with_the_same_resamples() -> None:
    table, a, _ = _pair()
    got = a.bucket_table(N_BOOT, seed=3, by="softmask")
    assert list(got.columns) == ["softmask", *BUCKET_COLUMNS]
    assert got["softmask"].tolist() == [False] * 5 + [True] * 5
    assert got["bucket"].tolist() == (a.labels + ["all"]) * 2
    table["bucket"] = np.searchsorted(a.edges, table["offset"], side="right") - 1
    for m in (False, True):
        rows = got[got["softmask"] == m]
        sub = table[table["softmask"] == m]
        by = sub.groupby("bucket")["nll"].agg(["size", "mean"])
        np.testing.assert_array_equal(rows["tokens"], np.r_[by["size"], len(sub)])  # exact: counts
        np.testing.assert_allclose(
            rows["nats"], np.r_[by["mean"], sub["nll"].mean()], rtol=1e-12
        )  # float sums in another order
        # the block bootstrap over tiles, by hand: the same tile indices for both classes
        k = a.tile_tokens.shape[1]
        t = _with_overall(a.softmask_tokens[..., int(m)])
        n = _with_overall(a.softmask_nll[..., int(m)])
        reps = [
            n[idx].sum(0) / t[idx].sum(0) for idx in np.concatenate(list(resample_indices(a.n_tiles, N_BOOT, seed=3)))
        ]
        q = np.quantile(reps, [0.025, 0.975], axis=0)
        np.testing.assert_allclose(rows["ci_lo"], q[0], rtol=1e-12)  # the same sums, another summation order
        np.testing.assert_allclose(rows["ci_hi"], q[1], rtol=1e-12)
        assert len(rows) == k + 1
    # the split adds up to the pooled table's tokens, bucket by bucket
    pooled = a.bucket_table(N_BOOT, seed=3)
    np.testing.assert_array_equal(got["tokens"].to_numpy().reshape(2, -1).sum(0), pooled["tokens"])
    assert np.array_equal(a.softmask_tokens.sum(axis=2), a.tile_tokens)
    assert np.array_equal(a.softmask_nll[..., 0] + a.softmask_nll[..., 1], a.tile_nll)  # exact: tile_nll is that sum


def test_compare_softmask_is_paired_over_tiles_and_the_gap_uses_the_same_resamples() -> None:
    table, a, b = _pair(masked_gain=0.05, unmasked_gain=0.0, noise=0.005)
    split, gap = compare_softmask(a, b, N_BOOT, seed=5)
    assert list(split.columns) == ["softmask", *COMPARE_COLUMNS] and list(gap.columns) == GAP_COLUMNS
    pd.testing.assert_frame_equal(compare(a, b, N_BOOT, seed=5, by="softmask"), split)
    table["bucket"] = np.searchsorted(a.edges, table["offset"], side="right") - 1
    ta = {m: _with_overall(a.softmask_tokens[..., m]) for m in (0, 1)}
    na = {m: _with_overall(a.softmask_nll[..., m]) for m in (0, 1)}
    nb = {m: _with_overall(b.softmask_nll[..., m]) for m in (0, 1)}
    rels: dict[int, list[np.ndarray]] = {0: [], 1: []}
    diffs: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for idx in np.concatenate(list(resample_indices(a.n_tiles, N_BOOT, seed=5))):
        for m in (0, 1):
            ma, mb = na[m][idx].sum(0) / ta[m][idx].sum(0), nb[m][idx].sum(0) / ta[m][idx].sum(0)
            diffs[m].append(mb - ma)
            rels[m].append(mb / ma - 1)
    for m in (0, 1):
        rows = split[split["softmask"] == bool(m)]
        sub = table[table["softmask"] == bool(m)]
        means = sub.groupby("bucket")[["nll", "nll_b"]].mean()
        np.testing.assert_allclose(rows["a_nats"], np.r_[means["nll"], sub["nll"].mean()], rtol=1e-12)
        np.testing.assert_allclose(rows["b_nats"], np.r_[means["nll_b"], sub["nll_b"].mean()], rtol=1e-12)
        dq = np.quantile(diffs[m], [0.025, 0.975], axis=0)
        rq = np.quantile(rels[m], [0.025, 0.975], axis=0)
        # the same sums in another order (a matrix product): rounding only
        np.testing.assert_allclose(rows["diff_ci_lo"], dq[0], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(rows["diff_ci_hi"], dq[1], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(rows["rel_ci_lo"], 100 * rq[0], rtol=1e-9, atol=1e-13)
        np.testing.assert_allclose(rows["rel_ci_hi"], 100 * rq[1], rtol=1e-9, atol=1e-13)
    gq = np.quantile(np.asarray(rels[1]) - np.asarray(rels[0]), [0.025, 0.975], axis=0)
    np.testing.assert_allclose(gap["gap_ci_lo"], 100 * gq[0], rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(gap["gap_ci_hi"], 100 * gq[1], rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(gap["gap_pct"], gap["masked_rel_pct"] - gap["unmasked_rel_pct"], rtol=1e-12)
    # a 5% gain on the soft-masked bases only: a supported gap, below 0, in every bucket
    assert gap["supported"].all() and (gap["gap_ci_hi"] < 0).all()
    # and the pooled comparison is unchanged by the split (the same resamples)
    pooled = compare(a, b, N_BOOT, seed=5)
    assert pooled["tokens"].tolist() == list(split["tokens"].to_numpy().reshape(2, -1).sum(0))


def test_an_older_result_without_the_split_loads_and_refuses_only_by_softmask(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, a, b = _pair()
    dirs = {}
    for r in (a, b):
        d = tmp_path / r.label
        d.mkdir()
        r.save(d)
        dirs[r.label] = d
    back = EvalResult.load(dirs["base"])
    np.testing.assert_array_equal(back.softmask_nll, a.softmask_nll)  # exact: saved and read back
    np.testing.assert_array_equal(back.softmask_tokens, a.softmask_tokens)
    (dirs["base"] / "tile_buckets_softmask.parquet").unlink()  # as a result of an older genolong
    old = EvalResult.load(dirs["base"])
    assert not old.has_softmask
    pd.testing.assert_frame_equal(old.bucket_table(50), a.bucket_table(50))
    pd.testing.assert_frame_equal(compare(old, b, 50), compare(a, b, 50))  # old and new compare pooled
    with pytest.raises(InputError, match=r"no soft-mask split.*re-run `genolong evaluate`") as err:
        old.bucket_table(50, by="softmask")
    assert str(dirs["base"]) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(InputError, match="re-run `genolong evaluate`"):
        compare_softmask(old, b, 50)
    assert (
        main(["compare", str(dirs["base"]), str(dirs["tuned"]), "--by", "softmask", "--out", str(tmp_path / "c")]) == 2
    )
    err_text = capsys.readouterr().err.strip()
    assert "\n" not in err_text and "re-run `genolong evaluate`" in err_text and not (tmp_path / "c").exists()
    assert main(["plot", str(dirs["tuned"]), str(dirs["base"]), "--by", "softmask", "--out", str(tmp_path / "f")]) == 2
    assert "re-run `genolong evaluate`" in capsys.readouterr().err and not (tmp_path / "f").exists()
    assert main(["compare", str(dirs["base"]), str(dirs["tuned"])]) == 0  # the pooled comparison still works
    # a damaged split: one line naming the file
    d = tmp_path / "damaged"
    d.mkdir()
    a.save(d)
    import pyarrow.parquet as pq

    cells = pq.read_table(d / "tile_buckets_softmask.parquet")
    pq.write_table(cells.slice(0, cells.num_rows - 2), d / "tile_buckets_softmask.parquet")
    with pytest.raises(InputError, match="tile_buckets_softmask.parquet is not the dense"):
        EvalResult.load(d)
    with pytest.raises(InputError, match="do not add up"):
        EvalResult(
            a.meta,
            a.tiles,
            a.tile_tokens,
            a.tile_nll,
            a.position_tokens,
            a.position_nll,
            softmask_tokens=a.softmask_tokens[..., ::-1] * 2,
            softmask_nll=a.softmask_nll,
        )


def test_comparable_checks_the_split_counts() -> None:
    table, a, _ = _pair()
    flipped = table.copy()
    flipped.loc[flipped.index[:40], "softmask"] = ~flipped["softmask"].iloc[:40]
    flipped.attrs = table.attrs
    other = result_from_tokens(flipped, 64, label="other mask")
    compare(a, result_from_tokens(flipped.drop(columns="softmask"), 64, label="no split"), 20)  # no split: pooled works
    with pytest.raises(InputError, match="soft-masked \\(lower-case\\) counts differ"):
        compare(a, other, 20)


def test_cli_compare_and_plot_by_softmask(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, a, b = _pair()
    for r in (a, b):
        (tmp_path / r.label).mkdir()
        r.save(tmp_path / r.label)
    assert (
        main(
            [
                "compare",
                str(tmp_path / "base"),
                str(tmp_path / "tuned"),
                "--by",
                "softmask",
                "--n-boot",
                "200",
                "--out",
                str(tmp_path / "cmp"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    split, gap = compare_softmask(a, b, 200)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "cmp" / "compare_softmask.csv"), split, check_dtype=False)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "cmp" / "softmask_gap.csv"), gap, check_dtype=False)
    assert "| soft-masked | all |" in printed and f"{gap['gap_pct'].iloc[-1]:.2f}" in printed
    assert (
        main(
            [
                "plot",
                str(tmp_path / "base"),
                str(tmp_path / "tuned"),
                "--by",
                "softmask",
                "--n-boot",
                "100",
                "--format",
                "png",
                "--out",
                str(tmp_path / "fig"),
            ]
        )
        == 0
    )
    for stem in ("position_loss", "buckets", "relative_change", "buckets_softmask", "relative_change_softmask"):
        assert (tmp_path / "fig" / f"{stem}.png").read_bytes().startswith(b"\x89PNG"), stem
    series = pd.read_csv(tmp_path / "fig" / "relative_change_softmask.csv")
    assert series["softmask"].tolist() == [False] * 5 + [True] * 5
    np.testing.assert_allclose(series["rel_pct"], compare(a, b, 100, by="softmask")["rel_pct"])
    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal of an unknown split
        main(["compare", str(tmp_path / "base"), str(tmp_path / "tuned"), "--by", "repeats"])
    assert exit_.value.code == 2 and "invalid choice: 'repeats'" in capsys.readouterr().err


def test_split_figures_draw_the_split_tables() -> None:
    _, a, b = _pair()
    fig, series = bucket_figure([a, b], 100, by="softmask")
    assert len(fig.axes) == 2 and [ax.get_title() for ax in fig.axes] == [
        "unmasked bases",
        "soft-masked bases (lower case: repeats)",
    ]
    for m, ax in zip((False, True), fig.axes):
        for run, line in zip((a, b), [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]):
            want = run.bucket_table(100, by="softmask")
            want = want[want["softmask"] == m]
            np.testing.assert_array_equal(line.get_ydata(), want["nats"].to_numpy())  # exact: the same computation
    assert set(series.columns) >= {"run", "softmask", "nats", "ci_lo", "ci_hi"} and len(series) == 20
    fig, series = relative_change_figure([a, b], 100, by="softmask")
    assert len(fig.axes) == 2 and len(series) == 10
    with pytest.raises(InputError, match="--by 'rows'"):
        bucket_figure([a], 10, by="rows")


def test_evaluate_split_is_the_per_token_table_and_adds_up_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"]).eval()
    split = make_split([700, 333], seed=9, n_run=(40, 90))
    result = evaluate(model, split, tmp_path / "r", context=256, first_bucket=32, progress=False)
    assert np.array_equal(result.softmask_tokens.sum(axis=2), result.tile_tokens)  # exact: counts
    assert np.array_equal(
        result.softmask_nll[..., 0] + result.softmask_nll[..., 1], result.tile_nll
    )  # exact by construction
    tokens = read_tokens(tmp_path / "r")
    tokens["nll"] = tokens["nll"].astype(np.float64)  # evaluate sums the float32 NLL in float64
    edges = bucket_edges(256, 32)
    tokens["bucket"] = np.searchsorted(edges, tokens.offset, side="right") - 1
    sums = tokens.groupby(["tile", "bucket", "softmask"]).nll.agg(["size", "sum"])
    got_tokens = np.zeros_like(result.softmask_tokens)
    got_nll = np.zeros_like(result.softmask_nll)
    for (tile, bucket, masked), row in sums.iterrows():
        got_tokens[tile, bucket, int(masked)] = row["size"]
        got_nll[tile, bucket, int(masked)] = row["sum"]
    assert 0 < result.softmask_tokens[..., 1].sum() < result.tokens
    np.testing.assert_array_equal(result.softmask_tokens, got_tokens)  # exact: counts
    np.testing.assert_allclose(result.softmask_nll, got_nll, rtol=1e-12)  # float64 sums of float32, another order
    loaded = EvalResult.load(tmp_path / "r")
    np.testing.assert_array_equal(loaded.softmask_nll, result.softmask_nll)  # exact: saved and read back


def test_evaluate_cli_prints_the_split_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chr16_store: Path
) -> None:
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    assert (
        main(
            [
                "evaluate",
                str(tmp_path / "model"),
                "--store",
                str(chr16_store),
                "--context",
                "1024",
                "--max-tiles",
                "4",
                "--first-bucket",
                "256",
                "--quiet",
                "--by",
                "softmask",
                "--out",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    table = EvalResult.load(tmp_path / "r").bucket_table(by="softmask")
    assert "split by softmask" in printed and (table.loc[table["bucket"] == "all", "tokens"] > 0).all()
    for r in table[table["bucket"] == "all"].itertuples():
        name = "soft-masked" if r.softmask else "unmasked"
        assert f"| {name} | all | {int(r.tokens):,} | {r.nats:.4f} |" in printed


def _gap(
    unmasked: tuple[float, float, float], masked: tuple[float, float, float], gap: tuple[float, float, float]
) -> pd.DataFrame:
    """A one-row ("all") gap table with the given (change, lo, hi) in percent."""
    return pd.DataFrame(
        [
            {
                "bucket": "all",
                "lo": 1,
                "hi": 64,
                "unmasked_tokens": 600,
                "masked_tokens": 400,
                "unmasked_rel_pct": unmasked[0],
                "unmasked_rel_ci_lo": unmasked[1],
                "unmasked_rel_ci_hi": unmasked[2],
                "masked_rel_pct": masked[0],
                "masked_rel_ci_lo": masked[1],
                "masked_rel_ci_hi": masked[2],
                "gap_pct": gap[0],
                "gap_ci_lo": gap[1],
                "gap_ci_hi": gap[2],
                "supported": gap[1] > 0 or gap[2] < 0,
            }
        ]
    )[GAP_COLUMNS]


def test_report_wording_follows_the_intervals() -> None:
    # supported: repeats carry more of the gain
    text = " ".join(
        _softmask_reading(_gap((-0.20, -0.30, -0.10), (-0.90, -1.10, -0.70), (-0.70, -0.90, -0.50)), "cut", "full")
    )
    assert "the gain on soft-masked bases (repeats), 0.90% [0.70, 1.10], is larger than on unmasked bases" in text
    assert "+0.20% [+0.10, +0.30]" in text and "repeats carry more of the gain" in text and "excludes 0" in text
    # supported the other way: unique sequence
    text = " ".join(
        _softmask_reading(_gap((-0.90, -1.10, -0.70), (-0.20, -0.30, -0.10), (0.70, 0.50, 0.90)), "cut", "full")
    )
    assert "unique sequence carries more of the gain" in text and "gain on unmasked bases" in text
    # both classes gain but the intervals overlap: no claim of which carries it
    text = " ".join(
        _softmask_reading(_gap((-0.30, -0.50, -0.10), (-0.50, -0.90, -0.10), (-0.20, -0.60, 0.20)), "cut", "full")
    )
    assert "includes 0" in text and "do not separate the two" in text and "carry more of the gain" not in text
    assert "Only the change" not in text  # both classes are supported on their own
    # only one class excludes 0 on its own: said, with what it does not show
    text = " ".join(
        _softmask_reading(_gap((-0.10, -0.30, 0.10), (-0.50, -0.90, -0.10), (-0.40, -0.90, 0.05)), "cut", "full")
    )
    assert "do not separate" in text and "Only the change on soft-masked bases (repeats) excludes 0 on its own" in text
    # a supported gap between two increases is no gain
    text = " ".join(_softmask_reading(_gap((0.90, 0.70, 1.10), (0.20, 0.05, 0.35), (-0.70, -0.90, -0.50)), "a", "b"))
    assert "rises less on soft-masked bases" in text and "neither shows a gain" in text and "carry more" not in text
    # no soft-masked bases at all
    nan = (math.nan, math.nan, math.nan)
    assert "too few" in " ".join(_softmask_reading(_gap((-0.1, -0.2, 0.0), nan, nan), "a", "b"))


def test_quickstart_report_section_on_a_real_evaluation(tmp_path: Path, chr16_store: Path) -> None:
    """The REPORT's section from two evaluations of real soft-masked human DNA (hg38 chr16)."""
    from genolong.data.store import GenomeStore

    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"]).eval()
    split = GenomeStore.open(chr16_store).split("eval")
    full = evaluate(
        model, split, tmp_path / "full", context=256, max_tiles=4, first_bucket=64, label="full", progress=False
    )
    cut = evaluate(
        model,
        split,
        tmp_path / "cut",
        context=256,
        context_cut=32,
        max_tiles=4,
        first_bucket=64,
        label="cut",
        progress=False,
    )
    gap = compare_softmask(cut, full)[1]
    story = _Story(
        context=256,
        cut=32,
        tiles=4,
        recipe=None,
        results={"cut": cut, "full": full},
        softmask=[("cut", "full", "What does context beyond 32 buy?", gap)],
    )
    text = "\n".join(_softmask_section(story))
    masked = int(full.softmask_tokens[..., 1].sum())
    assert "## Repeats or unique sequence" in text and f"marks {masked:,} of the {full.tokens:,} scored bases" in text
    r = gap.iloc[-1]
    assert f"{r.gap_pct:.2f} [{r.gap_ci_lo:.2f}, {r.gap_ci_hi:.2f}]" in text
    assert _softmask_reading(gap, "cut", "full")[0] in text and "too few" not in text


def test_quickstart_report_section_says_when_nothing_is_soft_masked() -> None:
    """The bundled chr22 slice is upper case: the section says the split cannot be made, no tables."""
    table = synthetic_tokens(n_tiles=6, context=64, seed=2, masked=0.3)
    table["softmask"] = False
    result = result_from_tokens(table, 64, label="base")
    story = _Story(context=64, cut=8, tiles=6, recipe=None, results={"base": result})
    text = "\n".join(_softmask_section(story))
    assert f"None of the {result.tokens:,} scored bases is soft-masked" in text and "--by softmask" in text
    assert "|" not in text  # no table of empty classes
    assert _softmask_section(_Story(context=64, cut=8, tiles=6, recipe=None)) == []
