"""Streamed scoring (chunked prefill, genolong.model.stream) against the one-shot forward.

Oracle: ``GenoLM.forward`` / ``GenoLM.token_nll`` on the whole sequence. The streamed path carries
the KDA states and conv tails and the DSA latent / pooled-key caches from segment to segment; it
equals the one-shot forward up to float summation order (the KDA recurrence walks other chunks when
a segment does not start on a 64-token chunk boundary, and BLAS may round a product of another
shape differently), so per-token NLL and hidden states are compared to ``TOL`` = 1e-5 (observed
max |diff| about 2e-6 in fp32 on tiny and small).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from genolong.cli import main
from genolong.errors import InputError
from genolong.evaluation.score import evaluate, read_tokens, score_tile
from genolong.model import PRESETS, GenoLM
from genolong.model.stream import PrefillStream, StreamDSA, stream_token_nll
from tests.evaluation.test_evaluate import make_split

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5  # float summation order (see the module docstring), far below a top-k flip's ~1e-2


@pytest.fixture(scope="module")
def tiny() -> GenoLM:
    torch.manual_seed(0)
    return GenoLM(PRESETS["tiny"]).eval()


@pytest.fixture(scope="module")
def small() -> GenoLM:
    torch.manual_seed(0)
    return GenoLM(PRESETS["small"]).eval()


def dna(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random store tokens A/C/G/T (1..4) ``[batch, length]``."""
    return torch.randint(1, 5, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan())  # exact: the same targets count
    return (a - b).nan_to_num().abs().max().item()


@pytest.mark.parametrize("segment", [64, 192, 333])
def test_streamed_token_nll_equals_one_shot_on_tiny(tiny: GenoLM, segment: int) -> None:
    tokens = dna(2, 1000, seed=1)
    tokens[1, 500:530] = 5  # an N run: not counted in either path
    ref = tiny.token_nll(tokens)
    got = tiny.token_nll(tokens, segment_tokens=segment)
    assert max_diff(got, ref) <= TOL


@pytest.mark.parametrize("segment", [192, 333])
def test_streamed_token_nll_equals_one_shot_on_small(small: GenoLM, segment: int) -> None:
    tokens = dna(1, 1000, seed=2)
    assert max_diff(small.token_nll(tokens, segment_tokens=segment), small.token_nll(tokens)) <= TOL


def full_indexer_layers(model: GenoLM) -> list[int]:
    return [i for i, block in enumerate(model.layers) if getattr(block.self_attn, "indexer", None) is not None]


def test_extend_with_irregular_segments_gives_the_forward_rows(tiny: GenoLM) -> None:
    """Segments of any length, including single tokens and pool-straddling ones, in one stream.

    Top-k is discontinuous: the two paths' index scores differ by float rounding, so a pool whose
    score ties the selection boundary within rounding can be chosen by one path and not the other
    (here one query of one layer in 1,400 x 2 query-layers), which moves that token by ~1e-2 (see
    :mod:`genolong.model.decode`). So the one-shot forward runs with the streamed selections
    (forward hooks on the full indexers) and must match to ``TOL``; the selections must agree on
    all but a few queries.
    """
    b, t = 2, 700
    ids = dna(b, t, seed=3)
    layers = full_indexer_layers(tiny)
    chosen: dict[int, torch.Tensor] = {}
    stream = PrefillStream(tiny, batch_size=b)  # capacity 0: the caches grow as needed
    seg_end = [0]

    def record(layer: int):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            rows = args[0].shape[1]  # the segment plus the incomplete pool's rows run again
            chosen.setdefault(layer, torch.full((b, t, out.shape[-1]), -2, dtype=out.dtype))
            chosen[layer][:, seg_end[0] - rows : seg_end[0]] = out

        return hook

    hooks = [tiny.layers[i].self_attn.indexer.register_forward_hook(record(i)) for i in layers]
    bounds = [0, 1, 2, 9, 64, 65, 200, 217, 500, 700]
    try:
        parts = []
        for s0, s1 in zip(bounds, bounds[1:]):
            seg_end[0] = s1
            parts.append(stream.extend(ids[:, s0:s1]))
    finally:
        for handle in hooks:
            handle.remove()
    assert stream.position == t
    own: dict[int, torch.Tensor] = {}

    def force(layer: int):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            own[layer] = out
            return chosen[layer]

        return hook

    hooks = [tiny.layers[i].self_attn.indexer.register_forward_hook(force(i)) for i in layers]
    try:
        with torch.no_grad():
            ref = tiny(ids)
    finally:
        for handle in hooks:
            handle.remove()
    with torch.no_grad():
        got_lp, ref_lp = (tiny.logits(h).float().log_softmax(-1) for h in (torch.cat(parts, dim=1), ref))
    assert max_diff(got_lp, ref_lp) <= TOL
    flips = sum(int((own[i].sort(-1).values != chosen[i].sort(-1).values).any(-1).sum()) for i in layers)
    assert flips <= 2, f"{flips} selections differ"
    # what a DSA layer keeps: one latent per token, one pooled key per completed pool, the tail pool's rows
    p = tiny.config.index_kpool
    dsa = [s for s in stream.layers if isinstance(s, StreamDSA)]
    assert dsa and all(s.latent.shape[1] >= t and s.pending.shape[1] == t % p for s in dsa)


def test_a_lost_cache_breaks_the_match(tiny: GenoLM) -> None:
    """The carried state matters: emptying a DSA latent cache or a KDA state between segments moves the scores."""
    ids = dna(1, 600, seed=4)
    with torch.no_grad():
        ref = tiny(ids)
    for kind in ("dsa", "kda"):
        stream = PrefillStream(tiny, capacity=600)
        first = stream.extend(ids[:, :300])
        for state in stream.layers:
            if kind == "dsa" and isinstance(state, StreamDSA):
                state.latent.zero_()
            elif kind == "kda" and not isinstance(state, StreamDSA):
                state.recurrent.zero_()
        rest = stream.extend(ids[:, 300:])
        assert max_diff(first, ref[:, :300]) <= TOL
        assert max_diff(rest, ref[:, 300:]) > 1e-3, kind


def test_segments_at_or_beyond_the_length_are_the_one_shot_forward(
    tiny: GenoLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = dna(1, 300, seed=5)
    called = {"n": 0}

    def counting(*args, **kwargs):
        called["n"] += 1
        return stream_token_nll(*args, **kwargs)

    monkeypatch.setattr("genolong.model.stream.stream_token_nll", counting)
    ref = tiny.token_nll(tokens)
    assert torch.equal(tiny.token_nll(tokens, segment_tokens=300), ref)  # exact: the same one forward
    assert called["n"] == 0
    tiny.token_nll(tokens, segment_tokens=299)
    assert called["n"] == 1


def test_score_tile_streams_each_context_cut_span(tiny: GenoLM) -> None:
    tokens = make_split([900], seed=6).tokens
    for cut in (None, 250):
        ref = score_tile(tiny, tokens, context_cut=cut)
        got = score_tile(tiny, tokens, context_cut=cut, segment_tokens=100)
        np.testing.assert_array_equal(got.offset, ref.offset)  # exact: the same targets
        np.testing.assert_array_equal(got.context, ref.context)  # exact: the same visible context
        assert np.abs(got.nll - ref.nll).max() <= TOL


def test_evaluate_records_segment_tokens_and_matches_one_shot(tiny: GenoLM, tmp_path: Path) -> None:
    split = make_split([700, 300], seed=7)
    one = evaluate(tiny, split, tmp_path / "one", context=512, first_bucket=64, progress=False)
    streamed = evaluate(tiny, split, tmp_path / "st", context=512, first_bucket=64, progress=False, segment_tokens=96)
    assert one.meta["segment_tokens"] is None and streamed.meta["segment_tokens"] == 96
    np.testing.assert_allclose(streamed.tile_nll, one.tile_nll, rtol=TOL)
    np.testing.assert_array_equal(streamed.tile_tokens, one.tile_tokens)  # exact: counts
    a, b = read_tokens(tmp_path / "one"), read_tokens(tmp_path / "st")
    assert np.abs(a["nll"].to_numpy() - b["nll"].to_numpy()).max() <= TOL


def test_a_resumed_evaluation_must_have_the_same_segment_tokens(
    tiny: GenoLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    split = make_split([600], seed=8)
    real = GenoLM.token_nll
    calls = {"n": 0}

    def failing(self: GenoLM, *args, **kwargs):  # the second tile fails, as a crash would
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated crash")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenoLM, "token_nll", failing)
    with pytest.raises(RuntimeError):
        evaluate(tiny, split, tmp_path / "r", context=256, progress=False, segment_tokens=64)
    monkeypatch.setattr(GenoLM, "token_nll", real)
    settings = json.loads((tmp_path / ".r.partial" / "settings.json").read_text())
    assert settings["segment_tokens"] == 64
    # another segment length: the partial work (scored streamed at 64) is discarded, not resumed
    counted = {"n": 0}

    def counting(self: GenoLM, *args, **kwargs):
        counted["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenoLM, "token_nll", counting)
    result = evaluate(tiny, split, tmp_path / "r", context=256, progress=False, segment_tokens=100)
    assert counted["n"] == result.n_tiles and result.meta["segment_tokens"] == 100


def test_evaluate_cli_segment_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str], sample_store: Path) -> None:
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    common = [str(tmp_path / "model"), "--store", str(sample_store), "--context", "256", "--max-tiles", "2", "--quiet"]
    assert main(["evaluate", *common, "--segment-tokens", "0", "--out", str(tmp_path / "one")]) == 0
    assert main(["evaluate", *common, "--segment-tokens", "77", "--out", str(tmp_path / "st")]) == 0
    meta = {n: json.loads((tmp_path / n / "meta.json").read_text()) for n in ("one", "st")}
    assert meta["one"]["segment_tokens"] is None and meta["st"]["segment_tokens"] == 77
    assert abs(meta["st"]["nll_sum"] - meta["one"]["nll_sum"]) <= TOL * abs(meta["one"]["nll_sum"])
    capsys.readouterr()
    assert main(["evaluate", *common, "--segment-tokens", "-3", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--segment-tokens" in err


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_segment_tokens_is_a_one_line_input_error(tiny: GenoLM, bad: object) -> None:
    with pytest.raises(InputError, match="--segment-tokens must be a positive"):
        tiny.token_nll(dna(1, 50, seed=9), segment_tokens=bad)  # type: ignore[arg-type]


def test_a_context_parallel_model_is_refused(tiny: GenoLM) -> None:
    mixer = tiny.layers[0].self_attn
    mixer.cp_group = object()  # as apply_context_parallel records it
    try:
        with pytest.raises(InputError, match="context parallelism"):
            PrefillStream(tiny)
    finally:
        mixer.cp_group = None
