"""Tests for genolong.data.repeats: diverged copies planted into training windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from genolong.config import load_recipe
from genolong.data import alphabet
from genolong.data.repeats import PLANT_STREAM, RepeatPlanting, plant_repeats
from genolong.data.windows import TrainWindows
from genolong.errors import InputError
from tests.data.test_windows import make_split

BASES = np.array([1, 2, 3, 4, 9, 10, 11, 12], dtype=np.uint8)  # A C G T, upper and lower case


def random_window(rng: np.random.Generator, length: int) -> np.ndarray:
    return rng.choice(BASES, size=length)


def test_an_unedited_copy_equals_its_source_d_bases_back() -> None:
    rng = np.random.default_rng(0)
    settings = RepeatPlanting(share=1.0, copies=1, max_divergence=0.0, inverted=0.0)
    seen = 0
    for i in range(200):
        tokens = random_window(rng, 2048)
        out, copies = plant_repeats(tokens, np.random.default_rng([7, i, PLANT_STREAM]), settings)
        assert out.shape == tokens.shape and out.dtype == tokens.dtype
        (c,) = copies
        assert settings.min_length <= c.length <= settings.max_length
        assert max(settings.min_distance, c.length + 1) <= c.distance <= 2048 - c.length
        np.testing.assert_array_equal(
            out[c.start : c.start + c.length], tokens[c.start - c.distance : c.start - c.distance + c.length]
        )  # exact: uint8 tokens
        # everything outside the copy is the window as it was
        outside = np.ones(2048, bool)
        outside[c.start : c.start + c.length] = False
        np.testing.assert_array_equal(out[outside], tokens[outside])  # exact: uint8 tokens
        seen += 1
    assert seen == 200


def test_an_inverted_copy_is_the_reverse_complement_of_its_source_case_kept() -> None:
    rng = np.random.default_rng(1)
    settings = RepeatPlanting(share=1.0, copies=1, max_divergence=0.0, inverted=1.0)
    for i in range(50):
        tokens = random_window(rng, 1024)
        out, (c,) = plant_repeats(tokens, np.random.default_rng([1, i, PLANT_STREAM]), settings)
        assert c.inverted
        source = tokens[c.start - c.distance : c.start - c.distance + c.length]
        np.testing.assert_array_equal(
            out[c.start : c.start + c.length], alphabet.reverse_complement(source)
        )  # exact: uint8 tokens


def test_substitutions_change_the_drawn_share_of_bases_and_keep_case() -> None:
    """Substitution-only copies differ from their source at the drawn divergence: over 400 copies
    the mean per-copy mismatch rate is within 0.01 of the mean drawn rate (the binomial noise
    of ~90k bases is ~0.001), and no base changes case."""
    rng = np.random.default_rng(2)
    settings = RepeatPlanting(share=1.0, copies=1, max_divergence=0.3, indel_share=0.0, inverted=0.0)
    mismatch, drawn = [], []
    for i in range(400):
        tokens = random_window(rng, 1024)
        out, (c,) = plant_repeats(tokens, np.random.default_rng([2, i, PLANT_STREAM]), settings)
        copy = out[c.start : c.start + c.length]
        source = tokens[c.start - c.distance : c.start - c.distance + c.length]
        np.testing.assert_array_equal(copy & alphabet.SOFTMASK, source & alphabet.SOFTMASK)  # exact: uint8 tokens
        mismatch.append(float(np.mean(copy != source)))
        drawn.append(c.divergence)
    assert max(drawn) <= 0.3 and min(drawn) >= 0.0
    assert abs(np.mean(mismatch) - np.mean(drawn)) < 0.01
    assert np.mean(drawn) == pytest.approx(0.15, abs=0.02)  # uniform on [0, 0.3]


def test_indels_shift_the_copy_against_its_source() -> None:
    """With indels only, a copy matches its source up to its first edit and then, after a shift
    of 1-3 bases, again: its best shifted alignment matches better than the unshifted one."""
    rng = np.random.default_rng(3)
    settings = RepeatPlanting(
        share=1.0, copies=1, min_length=200, max_length=200, max_divergence=0.02, indel_share=1.0, inverted=0.0
    )
    shifted_better = 0
    edited = 0
    for i in range(100):
        tokens = random_window(rng, 1024)
        out, (c,) = plant_repeats(tokens, np.random.default_rng([3, i, PLANT_STREAM]), settings)
        copy = out[c.start : c.start + c.length].astype(int)
        source = tokens[c.start - c.distance : c.start - c.distance + c.length + 3].astype(int)
        differ = np.flatnonzero(copy != source[:200])
        if differ.size == 0 or differ[0] > 130:
            continue  # no edit, or too near the end to compare 50 bases after it
        edited += 1
        first = int(differ[0])
        tail = copy[first + 10 : first + 60]
        same = float(np.mean(tail == source[first + 10 : first + 60]))
        best = max(
            float(np.mean(tail == np.concatenate([source, np.zeros(8, int)])[first + 10 + s : first + 60 + s]))
            for s in range(-3, 4)
            if s
        )
        shifted_better += best > same
    assert edited > 30
    assert shifted_better / edited > 0.7


def test_distances_are_log_uniform_and_the_share_of_windows_holds() -> None:
    rng = np.random.default_rng(4)
    settings = RepeatPlanting(share=0.3, copies=2, min_length=50, max_length=50, min_distance=64, max_divergence=0.0)
    distances, planted = [], 0
    n = 1500
    for i in range(n):
        out, copies = plant_repeats(random_window(rng, 8192), np.random.default_rng([4, i, PLANT_STREAM]), settings)
        planted += bool(copies)
        distances += [c.distance for c in copies]
    assert planted / n == pytest.approx(0.3, abs=0.04)  # binomial sd 0.012
    logs = np.log(distances)
    lo, hi = math.log(64), math.log(8192 - 50 + 1)
    # log-uniform: each third of the log range holds a third of the copies (sd ~0.015 at ~900 copies)
    thirds = np.histogram(logs, bins=np.linspace(lo, hi, 4))[0] / len(logs)
    np.testing.assert_allclose(thirds, 1 / 3, atol=0.06)


def test_a_window_too_short_for_a_copy_is_left_as_it_is() -> None:
    tokens = random_window(np.random.default_rng(5), 300)
    out, copies = plant_repeats(
        tokens, np.random.default_rng(0), RepeatPlanting(share=1.0, min_length=200, max_length=200)
    )
    assert copies == [] and np.array_equal(out, tokens)  # exact: uint8 tokens


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"share": 1.5}, r"data\.plant_repeats\.share must be in \[0, 1\], got 1\.5"),
        ({"min_length": 400, "max_length": 50}, r"min_length <= max_length"),
        ({"min_distance": 500, "max_distance": 100}, r"min_distance <= max_distance"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        RepeatPlanting(**kwargs)


def test_train_windows_keep_place_strand_and_order_and_resume_with_the_same_copies() -> None:
    split = make_split([5000, 7000, 3000])
    settings = RepeatPlanting(share=1.0, copies=3)
    plain = TrainWindows(split, 1024, seed=11)
    planted = TrainWindows(split, 1024, seed=11, planting=settings)
    a = planted.take(20)
    b = plain.take(20)
    assert [(w.contig, w.start, w.strand, w.index) for w in a] == [(w.contig, w.start, w.strand, w.index) for w in b]
    assert sum(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b)) == 20  # exact: uint8 tokens
    # the planted window is exactly plant_repeats of the stored one, with the window's own generator
    for w, raw in zip(a, b):
        expected, _ = plant_repeats(raw.tokens, np.random.default_rng([11, w.index, PLANT_STREAM]), settings)
        np.testing.assert_array_equal(w.tokens, expected)  # exact: uint8 tokens
    # a resumed stream plants the same copies
    again = TrainWindows(split, 1024, seed=11, planting=settings)
    again.load_state_dict({"next_index": 10, "seed": 11, "length": 1024})
    for w, x in zip(again.take(10), a[10:]):
        np.testing.assert_array_equal(w.tokens, x.tokens)  # exact: uint8 tokens


def test_the_recipe_key_reaches_the_windows(tmp_path) -> None:
    text = tmp_path / "r.yaml"
    text.write_text(
        "name: r\nmodel:\n  preset: tiny\ndata:\n  store: genome\n  context: 1024\n  plant_repeats:\n    share: 0.25\n    inverted: 0.0\n"
        "train:\n  max_steps: 1\n"
    )
    recipe = load_recipe(text)
    p = recipe.data.plant_repeats
    assert (p.share, p.copies, p.min_length, p.max_length, p.inverted) == (0.25, 2, 50, 400, 0.0)
    text.write_text(
        "name: r\nmodel:\n  preset: tiny\ndata:\n  store: genome\n  context: 1024\n  plant_repeats:\n    share: 2.0\ntrain:\n  max_steps: 1\n"
    )
    with pytest.raises(InputError, match=r"data\.plant_repeats\.share = 2\.0: must be <= 1$"):
        load_recipe(text)


def test_the_recipe_section_and_the_planting_settings_have_the_same_keys_and_defaults() -> None:
    """``data.plant_repeats`` (the schema's section, with bounds for the JSON Schema) is turned into
    :class:`RepeatPlanting` key for key by ``finetune``: the two must not drift apart."""
    import dataclasses

    from genolong.config.schema import PlantRepeatsSection

    section = {f.name: f.default for f in dataclasses.fields(PlantRepeatsSection)}
    settings = {f.name: f.default for f in dataclasses.fields(RepeatPlanting)}
    assert section == settings
