"""The log-prob gap check (genolong.evaluation.logprobs): training path vs step-by-step decode path.

One ``tiny`` model (random init, seed 0) is scored on a small synthetic split with soft-masked runs,
an N run inside a segment and segments whose last tile is short (so a batch carries N padding).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from genolong.errors import InputError
from genolong.evaluation import logprobs as lpmod
from genolong.evaluation.logprobs import (
    FP32_MEAN_BOUND,
    TABLE_COLUMNS,
    LogprobGap,
    check_logprobs,
    decode_target_logprobs,
    gap_figure,
)
from genolong.model import GenoLM, ModelConfig
from genolong.model.decode import sequence_log_probs
from genolong.model.loss import model_inputs
from tests.helpers import assert_bitwise_equal

L = 192  # tiles of the main check: 7 tiles, 1,264 tokens, one batch
FIRST = 48  # buckets <48, 48-96, 96-192: tiny's top-k (8 pools of 8) starts dropping pools at offset ~71


@dataclass
class Split:
    """An in-memory split: what EvalTiles reads (tokens, segments) and a name."""

    name: str
    tokens: np.ndarray
    segments: pd.DataFrame


def make_split(lengths: tuple[int, ...] = (700, 500), seed: int = 0) -> Split:
    """Random bases 1..4 in back-to-back segments, with soft-masked runs (lowercase), an N run of 30
    inside segment 0, a lowercase n and a few scattered N."""
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    tokens = rng.integers(1, 5, size=total).astype(np.uint8)
    tokens[100:260] |= 8  # soft-masked repeat
    tokens[900:1010] |= 8
    tokens[400:430] = 5  # an N gap too short to split the segment
    tokens[[33, 555, 1100]] = 5
    tokens[1111] = 5 | 8  # lowercase n
    rows, offset = [], 0
    for i, n in enumerate(lengths):
        rows.append((f"chr{i + 1}", 1000, 1000 + n, offset))
        offset += n
    return Split("eval", tokens, pd.DataFrame(rows, columns=["contig", "start", "end", "offset"]))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> GenoLM:
    torch.manual_seed(0)
    return GenoLM(ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def split() -> Split:
    return make_split()


@pytest.fixture(scope="module")
def gap(model: GenoLM, split: Split) -> LogprobGap:
    return check_logprobs(model, split, L, max_tiles=None, first_bucket=FIRST, label="tiny-seed0")


def expected_targets(split: Split, context: int) -> list[tuple[int, int]]:
    """(tile, offset) of every counted target, from the raw tokens: a base A/C/G/T (either case)
    at tile positions 1 .. length - 1."""
    out = []
    tile = 0
    for _, seg in split.segments.iterrows():
        n = int(seg["end"] - seg["start"])
        for start in range(0, n, context):
            toks = split.tokens[int(seg["offset"]) + start : int(seg["offset"]) + min(start + context, n)]
            out.extend((tile, t) for t in range(1, len(toks)) if 1 <= (int(toks[t]) & 7) <= 4)
            tile += 1
    return out


def test_fp32_gap_is_within_the_bound_in_every_bucket(gap: LogprobGap, split: Split) -> None:
    # the bound: fp32 mean |log p_train - log p_decode| <= 1e-5 on tiny, here per bucket too
    table = gap.table()
    assert list(table.columns) == TABLE_COLUMNS
    assert table["bucket"].tolist() == ["<48", "48-96", "96-192", "all"]
    assert gap.dtype == "float32" and gap.context == L and gap.tiles == 7
    assert (table["tokens"] > 0).all()
    assert (table["mean_abs_diff"] <= FP32_MEAN_BOUND).all(), table.to_string()
    assert np.isfinite(gap.train_logprob).all() and np.isfinite(gap.decode_logprob).all()
    assert (gap.train_logprob < 0).all() and (gap.decode_logprob < 0).all()
    # exactly the counted targets: soft-masked bases in, N (either case) out, padding out
    want = expected_targets(split, L)
    assert sorted(zip(gap.tile.tolist(), gap.offset.tolist())) == want
    offsets = np.array([o for _, o in want])
    for _, row in table.iterrows():
        assert row["tokens"] == int(((offsets >= row["lo"]) & (offsets < row["hi"])).sum())
    assert table["tokens"].iloc[-1] == len(want) == gap.tokens
    got = set(zip(gap.tile.tolist(), gap.offset.tolist()))
    assert {(0, o) for o in range(100, 192)} <= got  # the soft-masked run (tokens 100-259) counts
    assert not {(2, o) for o in range(16, 46)} & got and (0, 33) not in got  # the N run (400-429), an N
    assert not {(3, o) for o in range(124, L)} & got  # tile 3 is 124 tokens: its padding never counts


def test_table_equals_brute_force_over_the_tokens(gap: LogprobGap) -> None:
    table = gap.table().set_index("bucket")
    np.testing.assert_array_equal(gap.abs_diff, np.abs(gap.train_logprob.astype(np.float64) - gap.decode_logprob))
    diffs = gap.abs_diff.tolist()
    assert table.loc["all", "tokens"] == len(diffs)
    assert table.loc["all", "mean_abs_diff"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    assert table.loc["all", "max_abs_diff"] == max(diffs)
    assert (table.loc["all", "lo"], table.loc["all", "hi"]) == (1, L)
    for label, lo, hi in (("<48", 1, 48), ("48-96", 48, 96), ("96-192", 96, 192)):
        part = [d for d, o in zip(diffs, gap.offset.tolist()) if lo <= o < hi]
        assert (table.loc[label, "lo"], table.loc[label, "hi"], table.loc[label, "tokens"]) == (lo, hi, len(part))
        assert table.loc[label, "mean_abs_diff"] == pytest.approx(sum(part) / len(part), rel=1e-12)
        assert table.loc[label, "max_abs_diff"] == max(part)


def test_per_token_values_are_the_paths_on_the_unpadded_tile(gap: LogprobGap, model: GenoLM, split: Split) -> None:
    # tile 3 is the 124-token tail of segment 0, padded with N to 192 in the batch: its values must be
    # those of the tile alone, at the right offsets (training path over the whole tile, decode path
    # over its first 40 tokens by the library's own sequence_log_probs)
    from genolong.data.windows import EvalTiles

    tile = EvalTiles(split, L)[3]
    assert tile.length == 124
    tok = torch.from_numpy(tile.tokens.astype(np.int64))[None]
    nll = model.token_nll(tok)[0]
    mine = gap.tile == 3
    want_offsets = (torch.nonzero(~torch.isnan(nll))[:, 0] + 1).numpy()
    np.testing.assert_array_equal(gap.offset[mine], want_offsets)
    np.testing.assert_allclose(gap.train_logprob[mine], -nll[want_offsets - 1].numpy(), rtol=0, atol=2e-6)
    dec = sequence_log_probs(model, model_inputs(tok[:, :40]))[0]
    head = mine & (gap.offset < 40)
    np.testing.assert_allclose(gap.decode_logprob[head], dec[gap.offset[head] - 1].numpy(), rtol=0, atol=2e-6)


def test_stepwise_gather_equals_sequence_log_probs(model: GenoLM) -> None:
    ids = torch.randint(1, 6, (2, 37), generator=torch.Generator().manual_seed(3))
    assert_bitwise_equal(decode_target_logprobs(model, ids), sequence_log_probs(model, ids), "gathered log-probs")


def test_save_writes_valid_files_and_the_figure_draws_the_table(
    gap: LogprobGap, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "gap"
    paths = gap.save(out)
    assert set(paths) == {"csv", "json", "tokens", "png", "pdf"}
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 5000
    assert paths["pdf"].read_bytes()[:5] == b"%PDF-" and b"%%EOF" in paths["pdf"].read_bytes()[-64:]
    table = gap.table()
    pd.testing.assert_frame_equal(pd.read_csv(paths["csv"]), table, check_dtype=False, rtol=1e-12)
    doc = json.loads(paths["json"].read_text())
    assert doc["meta"]["context"] == L and doc["meta"]["dtype"] == "float32" and doc["meta"]["label"] == "tiny-seed0"
    assert doc["meta"]["bucket_edges"] == [1, 48, 96, 192] and doc["meta"]["tokens"] == gap.tokens
    assert [r["bucket"] for r in doc["table"]] == table["bucket"].tolist()
    assert [r["max_abs_diff"] for r in doc["table"]] == table["max_abs_diff"].tolist()
    pd.testing.assert_frame_equal(pd.read_parquet(paths["tokens"]), gap.frame())

    # the figure's series are the table's bucket rows, drawn from the CSV read back
    fig, plotted = gap_figure(pd.read_csv(paths["csv"]))
    buckets = table[table["bucket"] != "all"].reset_index(drop=True)
    pd.testing.assert_frame_equal(plotted, buckets, check_dtype=False, rtol=1e-12)
    ax = fig.axes[0]
    lines = {line.get_gid(): line for line in ax.get_lines()}
    for column in ("mean_abs_diff", "max_abs_diff"):
        np.testing.assert_allclose(lines[column].get_ydata(), buckets[column].to_numpy(), rtol=1e-12)
        np.testing.assert_array_equal(lines[column].get_xdata(), np.arange(len(buckets)))
    assert ax.get_yscale() == "log" and "nats" in ax.get_ylabel() and "bases" in ax.get_xlabel()
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == buckets["bucket"].tolist()

    # an existing result is replaced only by a complete one; a failed save leaves it untouched
    before = paths["csv"].read_bytes()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(lpmod, "gap_figure", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        gap.save(out)
    assert paths["csv"].read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["gap"]
    monkeypatch.undo()
    gap.save(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gap"]


def test_a_decode_path_that_differs_is_detected(model: GenoLM, split: Split) -> None:
    # a weight changed between the two paths (as a decode engine with a wrong weight would be)
    # must show up far above the bound; the clean run on the same tile is the control
    bad = copy.deepcopy(model)
    clean = check_logprobs(bad, split, 64, max_tiles=1, first_bucket=16)
    assert clean.table()["mean_abs_diff"].iloc[-1] <= FP32_MEAN_BOUND
    weight = bad.layers[5].mlp.shared_experts.down_proj.weight
    original = bad.token_nll

    def then_perturb(*args: object, **kwargs: object) -> torch.Tensor:
        out = original(*args, **kwargs)
        with torch.no_grad():
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)) * weight.std())
        return out

    bad.token_nll = then_perturb  # type: ignore[method-assign]
    table = check_logprobs(bad, split, 64, max_tiles=1, first_bucket=16).table()
    assert table["max_abs_diff"].iloc[-1] > 1e-3 and table["mean_abs_diff"].iloc[-1] > 1e-4, table.to_string()


def test_bfloat16_runs_in_the_model_dtype(model: GenoLM, split: Split) -> None:
    half = copy.deepcopy(model).to(torch.bfloat16)
    gap = check_logprobs(half, split, 64, max_tiles=2, first_bucket=16, batch_size=1)
    assert gap.dtype == "bfloat16" and gap.tiles == 2 and set(gap.tile.tolist()) == {0, 1}
    table = gap.table()
    # bf16 rounding (8 bits of mantissa) is visible but small; NaN or a wrong path would not be
    assert np.isfinite(gap.abs_diff).all()
    assert 0 < table["mean_abs_diff"].iloc[-1] < 0.05 and table["max_abs_diff"].iloc[-1] < 0.5, table.to_string()


def test_bad_input_names_the_fix(model: GenoLM, split: Split) -> None:
    with pytest.raises(InputError, match="--context"):
        check_logprobs(model, split, 1)
    with pytest.raises(InputError, match="--context"):
        check_logprobs(model, split, 0)
    with pytest.raises(InputError, match="--max-tiles"):
        check_logprobs(model, split, 64, max_tiles=0)
    with pytest.raises(InputError, match="--max-tiles"):
        check_logprobs(model, split, 64, max_tiles=-2)
    with pytest.raises(InputError, match="batch_size"):
        check_logprobs(model, split, 64, batch_size=0)
    with pytest.raises(InputError, match="first bucket"):
        check_logprobs(model, split, 64, first_bucket=1)
    with pytest.raises(InputError, match="GenoLM"):
        check_logprobs(torch.nn.Linear(2, 2), split, 64)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="columns"):
        gap_figure(pd.DataFrame({"bucket": ["all"]}))
