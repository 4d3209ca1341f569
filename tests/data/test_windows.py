"""Tests for genolong.data.windows: train windows, eval tiles, context-parallel slices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genolong.data import alphabet
from genolong.data.windows import (
    EvalTiles,
    TrainWindows,
    context_parallel_bounds,
    context_parallel_slice,
)
from genolong.errors import InputError


@dataclass
class FakeSplit:
    """A split held in memory: what windows need of a store split."""

    name: str
    tokens: np.ndarray
    segments: pd.DataFrame


def make_split(lengths: list[int], seed: int = 0, contigs: list[str] | None = None, gap: int = 1000) -> FakeSplit:
    """Segments of the given lengths, back to back in ``tokens`` and separated by ``gap`` on the genome."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in lengths]
    contigs = contigs or [f"chr{1 + i // 2}" for i in range(len(lengths))]
    tokens = rng.choice(np.array([1, 2, 3, 4, 5, 9, 10, 11, 12, 13], dtype=np.uint8), size=sum(lengths))
    rows, offset, pos = [], 0, {}
    for contig, n in zip(contigs, lengths):
        start = pos.get(contig, 17)
        rows.append((contig, start, start + n, offset))
        pos[contig] = start + n + gap
        offset += n
    seg = pd.DataFrame(rows, columns=["contig", "start", "end", "offset"])
    return FakeSplit("train", tokens, seg)


def reverse_complement_text(text: str) -> str:
    """Independent oracle: reverse complement on letters, case kept."""
    return text.translate(str.maketrans("ACGTNacgtn", "TGCANtgcan"))[::-1]


def key(window) -> tuple:
    return (window.index, window.contig, window.start, window.strand, window.tokens.tobytes())


# -- train windows ----------------------------------------------------------------------------


def test_windows_lie_in_one_segment_and_match_the_tokens():
    split = make_split([500, 120, 90, 1000, 64, 300])
    L = 100
    windows = TrainWindows(split, L, seed=3)
    seg = split.segments
    text = alphabet.decode(split.tokens)
    strands = set()
    for w in windows.take(400):
        row = seg.iloc[w.segment]
        assert row["contig"] == w.contig
        assert row["start"] <= w.start and w.end == w.start + L <= row["end"]
        assert w.offset == row["offset"] + w.start - row["start"]
        assert w.tokens.dtype == np.uint8 and w.tokens.shape == (L,)
        forward = text[w.offset : w.offset + L]
        expected = forward if w.strand == "+" else reverse_complement_text(forward)
        assert alphabet.decode(w.tokens) == expected
        strands.add(w.strand)
    assert strands == {"+", "-"}
    # the 90- and 64-base segments are never used
    used = {w.segment for w in windows.take(400)}
    assert used == {0, 1, 3, 5}


def test_every_valid_start_is_reachable_and_nothing_beyond():
    # segments of L + 2 and L bases: starts {0, 1, 2} and {0}; 4 valid starts in all
    split = make_split([12, 10, 9])
    windows = TrainWindows(split, 10, seed=0, rc_prob=0.0)
    seen = {(w.segment, w.start - int(split.segments["start"][w.segment])) for w in windows.take(200)}
    assert seen == {(0, 0), (0, 1), (0, 2), (1, 0)}
    assert windows.valid_starts == 4


def test_segment_chance_is_proportional_to_valid_starts():
    L = 100
    split = make_split([L + 299, L + 99])  # 300 and 100 valid starts: 3 to 1
    windows = TrainWindows(split, L, seed=11, rc_prob=0.25)
    n = 4000
    drawn = [windows.locate(i) for i in range(n)]
    first = sum(seg == 0 for seg, _, _ in drawn)
    p, sd = 0.75, (0.75 * 0.25 / n) ** 0.5
    assert abs(first / n - p) < 5 * sd
    minus = sum(strand == "-" for _, _, strand in drawn)
    assert abs(minus / n - 0.25) < 5 * (0.25 * 0.75 / n) ** 0.5
    assert all(strand == "+" for _, _, strand in (TrainWindows(split, L, rc_prob=0.0).locate(i) for i in range(200)))
    assert all(strand == "-" for _, _, strand in (TrainWindows(split, L, rc_prob=1.0).locate(i) for i in range(200)))


def test_unreachable_bases_are_reported():
    split = make_split([500, 99, 100, 30])
    windows = TrainWindows(split, 100)
    assert windows.unreachable_bases == 99 + 30
    assert windows.unreachable_segments == 2
    assert windows.total_bases == 729
    assert windows.valid_starts == 401 + 1
    line = windows.describe()
    assert "129" in line and "L=100" in line and "\n" not in line


def test_same_seed_same_windows_other_seed_other_windows():
    split = make_split([5000, 3000, 700])
    a = [key(w) for w in TrainWindows(split, 256, seed=5).take(30)]
    b = [key(w) for w in TrainWindows(split, 256, seed=5).take(30)]
    c = [key(w) for w in TrainWindows(split, 256, seed=6).take(30)]
    assert a == b
    assert sum(x[1:] != y[1:] for x, y in zip(a, c)) >= 25


def test_window_i_is_a_pure_function_of_seed_and_i():
    split = make_split([5000, 3000])
    stream = TrainWindows(split, 128, seed=2).take(40)
    fresh = TrainWindows(split, 128, seed=2)
    assert key(fresh.window(37)) == key(stream[37])
    assert key(fresh.window(3)) == key(stream[3])
    assert [w.index for w in stream] == list(range(40))


def test_state_dict_resume_gives_the_identical_continuation():
    split = make_split([5000, 3000, 900])
    run = TrainWindows(split, 200, seed=9)
    iterator = iter(run)
    for _ in range(17):
        next(iterator)
    state = run.state_dict()
    assert state == {"next_index": 17, "seed": 9, "length": 200}
    assert all(isinstance(v, int) for v in state.values())
    expected = [key(next(iterator)) for _ in range(20)]
    resumed = TrainWindows(split, 200, seed=9)
    resumed.load_state_dict(dict(state))
    assert [key(w) for w in resumed.take(20)] == expected
    with pytest.raises(InputError, match="seed=9"):
        TrainWindows(split, 200, seed=10).load_state_dict(state)


def test_data_parallel_ranks_shard_the_single_rank_stream():
    split = make_split([4000, 2500, 800])
    single = {w.index: key(w) for w in TrainWindows(split, 300, seed=4).take(30)}
    shards = [TrainWindows(split, 300, seed=4, rank=r, world_size=3).take(10) for r in range(3)]
    seen: dict[int, tuple] = {}
    for r, shard in enumerate(shards):
        assert [w.index for w in shard] == list(range(r, 30, 3))
        for w in shard:
            assert w.index not in seen
            seen[w.index] = key(w)
    assert seen == single


def test_resume_with_another_world_size_continues_the_global_stream():
    split = make_split([4000, 2500])
    ranks = [TrainWindows(split, 300, seed=4, rank=r, world_size=2) for r in range(2)]
    for w in ranks:
        w.take(5)
    states = [w.state_dict() for w in ranks]
    assert states[0] == states[1] and states[0]["next_index"] == 10
    single = TrainWindows(split, 300, seed=4)
    single.load_state_dict(states[0])
    assert [key(w) for w in single.take(4)] == [key(w) for w in TrainWindows(split, 300, seed=4).take(14)[10:]]


def test_advance_past_follows_consumed_global_indices():
    split = make_split([4000])
    w = TrainWindows(split, 100, rank=1, world_size=4)
    w.advance_past(9)  # this rank's windows 1, 5, 9 consumed
    assert w.position == 3 and w.next_index == 12
    w.advance_past(5)  # never goes back
    assert w.position == 3


def test_too_long_window_is_a_clear_error():
    split = make_split([500, 1200, 300])
    with pytest.raises(InputError) as info:
        TrainWindows(split, 1201)
    message = str(info.value)
    assert "\n" not in message
    assert "L=1,201" in message and "1,200" in message and "chr1:1517-2717" in message
    assert "min-gap" in message
    TrainWindows(split, 1200)  # exactly the longest segment is fine


@pytest.mark.parametrize(
    "kwargs",
    [dict(length=0), dict(seed=-1), dict(rc_prob=1.5), dict(rank=2, world_size=2), dict(world_size=0)],
)
def test_bad_arguments_raise(kwargs):
    args = dict(length=10) | kwargs
    with pytest.raises(InputError):
        TrainWindows(make_split([100]), **args)


# -- eval tiles -------------------------------------------------------------------------------


def check_tiles(split: FakeSplit, L: int) -> EvalTiles:
    tiles = EvalTiles(split, L)
    frame = tiles.tiles
    cover = np.zeros(len(split.tokens), dtype=np.int64)
    for offset, length in zip(frame["offset"], frame["length"]):
        cover[offset : offset + length] += 1
    assert (cover == 1).all()  # every base exactly once
    seg = split.segments
    for i, tile in enumerate(tiles):
        row = seg.iloc[tile.segment]
        assert tile.index == i and tile.contig == row["contig"]
        assert row["start"] <= tile.start and tile.start + tile.length <= row["end"]
        assert tile.offset - row["offset"] == tile.start - row["start"]
        assert 1 <= tile.length <= L
        # only a segment's last tile may be short
        assert tile.length == L or tile.start + tile.length == row["end"]
        np.testing.assert_array_equal(
            tile.tokens, split.tokens[tile.offset : tile.offset + tile.length]
        )  # exact: tokens
    return tiles


def test_eval_tiles_cover_every_base_exactly_once():
    split = make_split([250, 100, 99, 1, 301])
    tiles = check_tiles(split, 100)
    assert list(tiles.tiles["length"]) == [100, 100, 50, 100, 99, 1, 100, 100, 100, 1]
    assert len(EvalTiles(split, 10_000)) == 5  # one tile per segment


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8), L=st.integers(1, 70))
def test_eval_tiles_property(lengths, L):
    check_tiles(make_split(lengths), L)


# -- context parallelism ----------------------------------------------------------------------


def test_context_parallel_slices_are_contiguous_and_tile_the_sequence():
    x = np.arange(24)
    parts = [context_parallel_slice(x, r, 4) for r in range(4)]
    assert [list(p) for p in parts] == [list(range(6 * r, 6 * r + 6)) for r in range(4)]
    t = torch.arange(2 * 12).reshape(2, 12)
    joined = torch.cat([context_parallel_slice(t, r, 3) for r in range(3)], dim=-1)
    assert torch.equal(joined, t)  # exact: integer slices
    assert torch.equal(context_parallel_slice(t, 1, 2, dim=0), t[1:2])  # exact: integer slices
    assert context_parallel_bounds(1_048_576, 7, 8) == (917_504, 1_048_576)


def test_context_parallel_size_must_divide_the_length():
    with pytest.raises(InputError, match="does not divide"):
        context_parallel_slice(np.arange(10), 0, 3)
    with pytest.raises(InputError):
        context_parallel_bounds(12, 3, 3)
