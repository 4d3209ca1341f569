"""genolong evaluate: per-token NLL by preceding context, --context-cut, resumable outputs.

Oracles: the model run by hand on each span, pandas group-bys of the per-token table, and an
uninterrupted evaluation for the killed-and-restarted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from genolong.cli import main
from genolong.data.alphabet import BASE_MASK, SOFTMASK, N
from genolong.data.windows import EvalTiles, context_cut_spans
from genolong.errors import InputError
from genolong.evaluation.results import EvalResult
from genolong.evaluation.score import evaluate, load_eval_model, read_tokens, score_tile, scoring_kernel_backend
from genolong.evaluation.stats import bucket_edges, compare
from genolong.model import PRESETS, GenoLM
from genolong.model.moe import record_routing
from genolong.train.module import cut_windows
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class ArraySplit:
    """A split held in memory: ``tokens`` uint8 and the segment table (the SplitLike protocol)."""

    tokens: np.ndarray
    segments: pd.DataFrame
    name: str = "eval"


def make_split(lengths: list[int], seed: int, n_run: tuple[int, int] | None = None) -> ArraySplit:
    """Random A/C/G/T segments (a third soft-masked), optionally with an N run, on contig chrT."""
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    tokens = rng.integers(1, 5, size=total).astype(np.uint8)
    tokens[rng.random(total) < 0.33] |= SOFTMASK
    if n_run is not None:
        tokens[n_run[0] : n_run[1]] = N
    offsets = np.cumsum([0, *lengths[:-1]])
    starts = offsets * 2 + 1000  # segments separated by gaps on the contig
    segments = pd.DataFrame({"contig": "chrT", "start": starts, "end": starts + np.asarray(lengths), "offset": offsets})
    return ArraySplit(tokens, segments)


@pytest.fixture(scope="module")
def tiny() -> GenoLM:
    torch.manual_seed(0)
    return GenoLM(PRESETS["tiny"]).eval()


# -- context cut ----------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [2, 3, 64, 100, 257])
@pytest.mark.parametrize("cut", [1, 2, 7, 64, 99, 256, None])
def test_context_cut_spans_score_every_target_once_with_at_most_cut_context(length: int, cut: int | None) -> None:
    seen: dict[int, int] = {}
    for start, stop in context_cut_spans(length, cut):
        for target in range(start + 1, stop):
            assert target not in seen
            seen[target] = target - start  # bases visible to the model
    assert sorted(seen) == list(range(1, length))
    for target, visible in seen.items():
        assert visible == (target if cut is None or cut >= length - 1 else (target - 1) % cut + 1)
        assert cut is None or visible <= cut


def test_score_tile_cut_equals_each_span_run_alone(tiny: GenoLM) -> None:
    tokens = make_split([160], seed=1, n_run=(40, 47)).tokens
    cut = 37
    scores = score_tile(tiny, tokens, context_cut=cut)
    # brute force: every target with exactly its visible bases as the whole input
    ids = torch.from_numpy(tokens).long()[None]
    expected = []
    for target in range(1, tokens.size):
        visible = (target - 1) % cut + 1
        nll = tiny.token_nll(ids[:, target - visible : target + 1])[0, -1]
        if not torch.isnan(nll):
            expected.append((target, visible, float(nll)))
    assert scores.offset.tolist() == [e[0] for e in expected]
    assert scores.context.tolist() == [e[1] for e in expected]
    np.testing.assert_allclose(scores.nll, [e[2] for e in expected], rtol=0, atol=2e-5)
    assert N not in scores.base and set(np.unique(scores.base)) <= {1, 2, 3, 4}


def test_cut_windows_trains_on_the_same_targets(tiny: GenoLM) -> None:
    tokens = torch.from_numpy(make_split([2 * 131], seed=2).tokens).long().view(2, 131)
    pieces = cut_windows(tokens, 20)
    assert pieces.shape == (2 * 7, 21)
    nll, weight = tiny.loss(pieces)
    by_span = [tiny.loss(tokens[:, a:b]) for a, b in context_cut_spans(131, 20)]
    assert float(weight) == float(sum(w for _, w in by_span)) == float(tiny.loss(tokens)[1])
    torch.testing.assert_close(nll, sum(n for n, _ in by_span), rtol=1e-5, atol=1e-5)
    assert cut_windows(tokens, 130) is tokens


# -- evaluate ---------------------------------------------------------------------------------------


def test_evaluate_tables_agree_with_the_per_token_table(tiny: GenoLM, tmp_path: Path) -> None:
    split = make_split([700, 333, 129], seed=3, n_run=(100, 180))
    result = evaluate(tiny, split, tmp_path / "r", context=256, first_bucket=32, label="tiny", progress=False)
    tokens = read_tokens(tmp_path / "r")
    tiles = EvalTiles(split, 256)
    assert result.meta["tiles"] == len(tiles) == 3 + 2 + 1
    # every counted target is there once, with its genomic position, base and soft-mask flag
    expected = []
    for tile in tiles:
        for t in range(1, tile.length):
            token = int(tile.tokens[t])
            if token & BASE_MASK != N:
                expected.append((tile.index, tile.start + t, t, token & BASE_MASK, bool(token & SOFTMASK)))
    got = list(zip(tokens.tile, tokens.position, tokens.offset, tokens.base, tokens.softmask))
    assert got == expected
    assert (tokens.context == tokens.offset).all() and (tokens.contig == "chrT").all()
    assert result.meta["tokens"] == len(tokens) and np.isfinite(tokens.nll).all()
    # the per-tile x bucket and per-offset sums are group-bys of the per-token table
    edges = bucket_edges(256, 32)
    tokens["bucket"] = np.searchsorted(edges, tokens.offset, side="right") - 1
    sums = tokens.groupby(["tile", "bucket"]).nll.agg(["size", "sum"])
    for (tile, bucket), row in sums.iterrows():
        assert result.tile_tokens[tile, bucket] == row["size"]
        assert result.tile_nll[tile, bucket] == pytest.approx(row["sum"], rel=1e-6)
    assert result.tile_tokens.sum() == len(tokens)
    per_offset = tokens.groupby("offset").nll.agg(["size", "sum"])
    np.testing.assert_array_equal(result.position_tokens[per_offset.index], per_offset["size"])
    np.testing.assert_allclose(result.position_nll[per_offset.index], per_offset["sum"], rtol=1e-6)
    # the loss of the model's own loss function, over the same tiles
    with torch.no_grad():
        total = sum(float(tiny.loss(torch.from_numpy(t.tokens).long()[None])[0]) for t in tiles)
    assert result.meta["nll_sum"] == pytest.approx(total, rel=1e-5)
    # the routing statistics: per MoE layer every tile's tokens, top-k rows each, the loads those
    # of the model's own forwards over the tiles
    routing = result.meta["routing"]
    moe_layers = [i for i, t in enumerate(tiny.config.mlp_layer_types) if t == "sparse"]
    assert [r["layer"] for r in routing] == moe_layers
    routed = sum(t.length for t in tiles)
    with record_routing(tiny) as totals, torch.no_grad():
        for t in tiles:
            tiny(torch.from_numpy(t.tokens).long()[None] & BASE_MASK)
    for r, stats in zip(routing, totals.values()):
        assert r["tokens"] == routed and sum(r["load"]) == routed * tiny.config.num_experts_per_tok
        assert r["load"] == stats.load.tolist()  # exact: row counts
        assert r["dead_experts"] == sum(x == 0 for x in r["load"])
        assert r["load_max_over_mean"] == pytest.approx(max(r["load"]) / np.mean(r["load"]))
        assert r["router_entropy"] == pytest.approx(float(stats.entropy) / stats.tokens, rel=1e-6)
    # the saved directory loads back to the same result
    loaded = EvalResult.load(tmp_path / "r")
    np.testing.assert_array_equal(loaded.tile_nll, result.tile_nll)  # exact: saved and read back
    assert loaded.meta["fingerprint"] == result.meta["fingerprint"]
    assert not (tmp_path / ".r.partial").exists()


def test_context_cut_at_or_beyond_the_tile_reproduces_the_full_run(tiny: GenoLM, tmp_path: Path) -> None:
    split = make_split([600, 250], seed=4)
    full = evaluate(tiny, split, tmp_path / "full", context=256, progress=False)
    for cut in (255, 256, 10_000):
        same = evaluate(tiny, split, tmp_path / f"cut{cut}", context=256, context_cut=cut, progress=False)
        assert_bitwise_equal(same.tile_nll, full.tile_nll, f"tile NLL with context_cut={cut}")
        assert_bitwise_equal(same.position_nll, full.position_nll, f"position NLL with context_cut={cut}")
        pd.testing.assert_frame_equal(read_tokens(tmp_path / f"cut{cut}"), read_tokens(tmp_path / "full"))
    cut = evaluate(tiny, split, tmp_path / "cut16", context=256, context_cut=16, progress=False)
    assert cut.meta["fingerprint"] == full.meta["fingerprint"]  # same tokens ...
    assert not np.array_equal(cut.tile_nll, full.tile_nll)  # ... other scores
    assert read_tokens(tmp_path / "cut16").context.max() == 16


def test_evaluate_refuses_bad_input(tiny: GenoLM, tmp_path: Path) -> None:
    split = make_split([300], seed=5)
    evaluate(tiny, split, tmp_path / "r", context=128, progress=False)
    with pytest.raises(InputError, match="already exists; pass --force"):
        evaluate(tiny, split, tmp_path / "r", context=128, progress=False)
    with pytest.raises(InputError, match="context-cut"):
        evaluate(tiny, split, tmp_path / "s", context=128, context_cut=0, progress=False)
    with pytest.raises(InputError, match="max-tiles"):
        evaluate(tiny, split, tmp_path / "s", context=128, max_tiles=0, progress=False)
    with pytest.raises(InputError, match="at least 2"):
        evaluate(tiny, split, tmp_path / "s", context=1, progress=False)
    assert not (tmp_path / "s").exists()
    with pytest.raises(InputError, match="is not a checkpoint"):
        load_eval_model(tmp_path / "r")


# -- planted long-range structure --------------------------------------------------------------------


def planted(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Windows whose bases are 70% one base chosen per window (the rest uniform): the longer the
    context, the better a model can tell which base dominates."""
    dominant = rng.integers(1, 5, size=(batch, 1))
    noise = rng.integers(1, 5, size=(batch, length))
    return np.where(rng.random((batch, length)) < 0.6, dominant, noise).astype(np.uint8)


def test_full_context_beats_the_cut_on_planted_long_range_structure(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"])
    rng = np.random.default_rng(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(16):
        nll, weight = model.loss(torch.from_numpy(planted(rng, 4, 128)).long())
        optimizer.zero_grad()
        (nll / weight).backward()
        optimizer.step()
    model.eval()
    windows = planted(np.random.default_rng(1), 24, 256)
    offsets = np.arange(24) * 256
    split = ArraySplit(
        windows.reshape(-1), pd.DataFrame({"contig": "chrP", "start": offsets, "end": offsets + 256, "offset": offsets})
    )
    full = evaluate(
        model, split, tmp_path / "full", 256, first_bucket=16, label="full", progress=False, write_tokens=False
    )
    cut = evaluate(
        model,
        split,
        tmp_path / "cut",
        256,
        context_cut=8,
        first_bucket=16,
        label="cut 8",
        progress=False,
        write_tokens=False,
    )
    table = compare(cut, full).set_index("bucket")
    beyond = table.drop(index=["<16", "all"])
    assert len(beyond) == 4  # 16-32, 32-64, 64-128, 128-256
    assert (beyond["diff"] < 0).all() and (beyond["diff_ci_hi"] < 0).all() and beyond["supported"].all()
    assert table.loc["all", "diff_ci_hi"] < 0
    # within the first 8 bases of a tile both runs see the same context: no difference
    first = cut.position_nll[1:9] - full.position_nll[1:9]
    np.testing.assert_allclose(first, 0.0, atol=1e-4)


# -- the command line: kill and resume --------------------------------------------------------------


def test_evaluate_killed_and_restarted_gives_identical_tables(sample_store: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    args = [
        "evaluate",
        str(tmp_path / "model"),
        "--store",
        str(sample_store),
        "--context",
        "2048",
        "--max-tiles",
        "8",
        "--first-bucket",
        "256",
        "--quiet",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-c",
        "import sys, torch; torch.set_num_threads(1); from genolong.cli import main; sys.exit(main(sys.argv[1:]))",
    ]
    state = tmp_path / ".killed.partial" / "state.npz"
    proc = subprocess.Popen([*command, *args, "--out", str(tmp_path / "killed")], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_file():
            try:
                with np.load(state) as z:
                    if int(z["next_tile"]) >= 3:
                        break
            except (OSError, ValueError, KeyError):
                pass  # being replaced right now
        time.sleep(0.02)
    assert proc.poll() is None, "the evaluation ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed").exists()  # nothing half-written under the result name
    with np.load(state) as z:
        done = int(z["next_tile"])
    assert 3 <= done < 8
    subprocess.run([*command, *args, "--out", str(tmp_path / "killed")], env=env, check=True)
    subprocess.run([*command, *args, "--out", str(tmp_path / "whole")], env=env, check=True)
    for name in (
        "tiles.parquet",
        "tile_buckets.parquet",
        "tile_buckets_softmask.parquet",
        "positions.parquet",
        "buckets.csv",
    ):
        a, b = tmp_path / "killed" / name, tmp_path / "whole" / name
        if name.endswith(".parquet"):
            assert pq.read_table(a).equals(pq.read_table(b)), name
        else:
            assert a.read_text() == b.read_text(), name
    pd.testing.assert_frame_equal(read_tokens(tmp_path / "killed"), read_tokens(tmp_path / "whole"))
    meta = [json.loads((tmp_path / d / "meta.json").read_text()) for d in ("killed", "whole")]
    for m in meta:
        for key in ("seconds", "tokens_per_second", "label"):
            m.pop(key)
    assert meta[0] == meta[1]


def test_evaluate_cli_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], sample_store: Path) -> None:
    assert main(["evaluate", str(tmp_path / "nothing"), "--store", str(sample_store), "--context", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a checkpoint" in err
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    assert main(["evaluate", str(tmp_path / "model"), "--store", str(sample_store)]) == 2
    assert "give --context" in capsys.readouterr().err


def test_compare_plot_and_check_logprobs_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sample_store: Path
) -> None:
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    common = ["--store", str(sample_store), "--max-tiles", "3", "--first-bucket", "64", "--quiet"]
    assert (
        main(["evaluate", str(tmp_path / "model"), "--context", "256", "--out", str(tmp_path / "full"), *common]) == 0
    )
    assert (
        main(
            [
                "evaluate",
                str(tmp_path / "model"),
                "--context",
                "256",
                "--context-cut",
                "32",
                "--out",
                str(tmp_path / "cut"),
                *common,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "evaluate",
                str(tmp_path / "model"),
                "--context",
                "128",
                "--out",
                str(tmp_path / "short"),
                "--kernel-backend",
                "torch",
                *common,
            ]
        )
        == 0
    )
    # the kernels are chosen as finetune chooses them (auto: the torch reference on a CPU) and recorded
    assert {k: EvalResult.load(tmp_path / "full").meta[k] for k in ("kernel_backend", "kernel_backend_resolved")} == {
        "kernel_backend": "auto",
        "kernel_backend_resolved": "torch",
    }
    assert EvalResult.load(tmp_path / "short").meta["kernel_backend"] == "torch"
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "cut"), str(tmp_path / "full"), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "cmp" / "compare.csv")
    expected = compare(EvalResult.load(tmp_path / "cut"), EvalResult.load(tmp_path / "full"))
    np.testing.assert_allclose(table["diff"], expected["diff"])
    assert f"{expected['diff'].iloc[-1]:.4f}" in printed
    # other tiles (another context) are other tokens: refused in one line
    assert main(["compare", str(tmp_path / "full"), str(tmp_path / "short")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--context" in err
    assert main(["plot", str(tmp_path / "full"), str(tmp_path / "cut"), "--out", str(tmp_path / "fig")]) == 0
    for stem in ("position_loss", "buckets", "relative_change"):
        assert (tmp_path / "fig" / f"{stem}.png").read_bytes().startswith(b"\x89PNG")
        assert (tmp_path / "fig" / f"{stem}.pdf").read_bytes().startswith(b"%PDF")
    capsys.readouterr()
    assert (
        main(
            [
                "check-logprobs",
                str(tmp_path / "model"),
                "--store",
                str(sample_store),
                "--context",
                "192",
                "--first-bucket",
                "64",
                "--out",
                str(tmp_path / "gap"),
                "--quiet",
            ]
        )
        == 0
    )
    gap = pd.read_csv(tmp_path / "gap" / "logprob_gap.csv").set_index("bucket")
    assert gap.loc["all", "tokens"] > 150 and gap.loc["all", "mean_abs_diff"] <= 1e-5
    assert (tmp_path / "gap" / "logprob_gap.png").is_file()
    assert json.loads((tmp_path / "gap" / "logprob_gap.json").read_text())["meta"]["kernel_backend_resolved"] == "torch"
    assert (
        main(
            [
                "check-logprobs",
                str(tmp_path / "model"),
                "--store",
                str(sample_store),
                "--context",
                "192",
                "--out",
                str(tmp_path / "gap"),
            ]
        )
        == 2
    )
    assert "already exists" in capsys.readouterr().err


def test_scoring_kernel_backend_is_the_flag_then_the_run_recipe_then_auto(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(run / "export")
    assert scoring_kernel_backend(run / "export") == "auto"  # no recipe beside it
    assert load_eval_model(run / "export")[0].config.kernel_backend == "auto"
    (run / "recipe.yaml").write_text("model:\n  overrides:\n    kernel_backend: torch\n")
    assert scoring_kernel_backend(run / "export") == "torch"
    assert scoring_kernel_backend(run) == "torch"
    assert load_eval_model(run / "export")[0].config.kernel_backend == "torch"
    assert scoring_kernel_backend(run / "export", "triton") == "triton"  # the flag wins
    assert load_eval_model(run / "export", kernel_backend="auto")[0].config.kernel_backend == "auto"


def test_an_interrupted_evaluation_resumes_only_for_the_same_weights(
    tiny: GenoLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    split = make_split([1000], seed=6)
    whole = evaluate(tiny, split, tmp_path / "whole", context=128, progress=False)
    calls = {"n": 0}
    real = GenoLM.token_nll

    def failing(self: GenoLM, *args, **kwargs):  # the third tile fails, as a crash would
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenoLM, "token_nll", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        evaluate(tiny, split, tmp_path / "r", context=128, progress=False)
    assert not (tmp_path / "r").exists() and sorted(p.name for p in (tmp_path / ".r.partial" / "tokens").iterdir()) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    monkeypatch.setattr(GenoLM, "token_nll", real)
    # other weights: the partial work is discarded, the result is that model's own
    torch.manual_seed(1)
    other = GenoLM(PRESETS["tiny"]).eval()
    fresh = evaluate(other, split, tmp_path / "other-fresh", context=128, progress=False)
    calls["n"] = 0
    monkeypatch.setattr(GenoLM, "token_nll", failing)
    with pytest.raises(RuntimeError):
        evaluate(tiny, split, tmp_path / "r2", context=128, progress=False)
    monkeypatch.setattr(GenoLM, "token_nll", real)
    (tmp_path / ".r2.partial").rename(tmp_path / ".other.partial")
    switched = evaluate(other, split, tmp_path / "other", context=128, progress=False)
    assert_bitwise_equal(switched.tile_nll, fresh.tile_nll, "tile NLL of the other model, not resumed")
    # the same weights: it resumes at tile 2 (2 tiles are not scored again) and ends equal to one run
    counted = {"n": 0}

    def counting(self: GenoLM, *args, **kwargs):
        counted["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenoLM, "token_nll", counting)
    resumed = evaluate(tiny, split, tmp_path / "r", context=128, progress=False)
    assert counted["n"] == whole.n_tiles - 2
    assert_bitwise_equal(resumed.tile_nll, whole.tile_nll, "tile NLL of the resumed evaluation")
    assert_bitwise_equal(resumed.position_nll, whole.position_nll, "position NLL of the resumed evaluation")
    # the soft-mask split is in the committed state too
    assert_bitwise_equal(resumed.softmask_nll, whole.softmask_nll, "soft-mask split NLL of the resumed evaluation")
    np.testing.assert_array_equal(resumed.softmask_tokens, whole.softmask_tokens)  # exact: counts
    pd.testing.assert_frame_equal(read_tokens(tmp_path / "r"), read_tokens(tmp_path / "whole"))


def test_load_eval_model_reads_the_weights_with_overrides(tmp_path: Path) -> None:
    """``load_eval_model(overrides=...)``: the checkpoint's weights in the model its config with the
    overrides builds (here a wider DSA key budget, as the quickstart reads its base); targets whose
    whole past both budgets select score the same, later ones differently; a shape is refused."""
    from genolong.config import reading_changes

    torch.manual_seed(0)
    tiny_config = PRESETS["tiny"]
    GenoLM(tiny_config).save_pretrained(tmp_path / "model")
    base, _ = load_eval_model(tmp_path / "model")
    wide, _ = load_eval_model(tmp_path / "model", overrides={"index_topk": 256})
    assert base.config.index_topk == 64 and wide.config.index_topk == 256
    assert {m.index_topk for m in wide.modules() if hasattr(m, "index_topk")} == {256}
    assert reading_changes(base.config, wide.config) == {"index_topk": 256}
    assert reading_changes(base.config, base.config.replace(kernel_backend="triton", hidden_size=32)) == {}
    # an independent build of the overridden config with the same weights scores the same
    reference = GenoLM(tiny_config.replace(index_topk=256)).eval()
    reference.load_state_dict(base.state_dict())
    ids = torch.randint(1, 5, (1, 301))  # A, C, G, T
    with torch.no_grad():
        nll_base, nll_wide, nll_ref = (m.token_nll(ids)[0] for m in (base, wide, reference))
    torch.testing.assert_close(nll_wide, nll_ref, rtol=0, atol=0)
    # tolerance: the two budgets select the same keys for the first 64 targets; float rounding of
    # the same sums in another gather order only
    torch.testing.assert_close(nll_base[:63], nll_wide[:63], rtol=1e-5, atol=1e-6)
    assert (nll_base[128:] - nll_wide[128:]).abs().max() > 1e-4  # 64 of up to 300 keys vs all of them
    with pytest.raises(InputError, match="hidden_size"):
        load_eval_model(tmp_path / "model", overrides={"hidden_size": 32})
