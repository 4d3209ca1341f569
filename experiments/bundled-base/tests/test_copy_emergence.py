"""experiments/bundled-base/copy_emergence.py's pieces: the doubled training window (an exact or diverged copy of
its first half, case kept, only A/C/G/T substituted, each by another base) and the held-out pairs
(the same second half after the stored first half and after itself), and one worker run end to end
on `tiny` (a JSON curve with a paired interval around each gain, and the final model's reach)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from copy_emergence import doubled, heldout_pairs

from genolong.data.alphabet import BASE_MASK, SOFTMASK, A, N, T

HERE = Path(__file__).resolve().parents[1]  # experiments/bundled-base/


def _bases(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(A, T + 1, n).astype(np.uint8)
    tokens[rng.random(n) < 0.4] |= SOFTMASK  # soft-masked stretches
    tokens[:7] = N
    return tokens


def test_doubled_exact_copy() -> None:
    tokens = _bases(300, 0)
    out = doubled(tokens, 128, 0.0, np.random.default_rng(1))
    assert out.shape == (256,) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[:128], tokens[:128])  # exact: integer tokens
    np.testing.assert_array_equal(out[128:], tokens[:128])  # exact: integer tokens


def test_doubled_diverged_copy_substitutes_bases_only() -> None:
    half, divergence = 4000, 0.3
    tokens = _bases(2 * half, 2)
    out = doubled(tokens, half, divergence, np.random.default_rng(3))
    first, copy = out[:half], out[half:]
    np.testing.assert_array_equal(first, tokens[:half])  # exact: integer tokens
    changed = copy != first
    # every change is a base turned into another base, its case kept; N never changes
    assert np.all((copy[changed] & BASE_MASK) != (first[changed] & BASE_MASK))
    assert np.all(((copy[changed] & BASE_MASK) >= A) & ((copy[changed] & BASE_MASK) <= T))
    np.testing.assert_array_equal(copy & SOFTMASK, first & SOFTMASK)  # exact: integer flags
    assert not changed[:7].any()
    # the share changed is the divergence among the bases (binomial sd of 0.3 over 3993: 0.0073)
    share = changed[7:].mean()
    assert abs(share - divergence) < 4 * np.sqrt(divergence * (1 - divergence) / (half - 7)), share
    # the three other bases are drawn evenly
    moved = ((copy[changed] & BASE_MASK).astype(int) - (first[changed] & BASE_MASK).astype(int)) % 4
    counts = np.bincount(moved, minlength=4)
    assert counts[0] == 0 and counts[1:].min() > 0.28 * changed.sum(), counts


def test_heldout_pairs(sample_store: Path) -> None:
    stored, copied = heldout_pairs(sample_store, 64, 12)
    assert stored.shape == copied.shape == (12, 128)
    assert np.all(((stored & BASE_MASK) >= A) & ((stored & BASE_MASK) <= T))  # no N in a chosen tile
    np.testing.assert_array_equal(copied[:, 64:], stored[:, 64:])  # exact: the same second half
    np.testing.assert_array_equal(copied[:, :64], stored[:, 64:])  # exact: ... after itself
    assert len({bytes(row) for row in stored}) == 12  # distinct tiles, spread over the split


def _run_worker(store: Path, *options: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One copy_emergence worker on ``tiny`` at H = 32, one thread, with ``options`` added."""
    cmd = [
        sys.executable,
        str(HERE / "copy_emergence.py"),
        "--worker",
        "--half",
        "32",
        "--store",
        str(store),
        "--preset",
        "tiny",
        *options,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        check=check,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


def test_worker_curve(sample_store: Path) -> None:
    done = _run_worker(
        sample_store,
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--eval-tiles",
        "6",
        "--tokens-per-step",
        "256",
        "--divergence",
        "0.1",
        "--reach",
        "32,64",
        "--reach-tiles",
        "4",
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["half"] == 32 and result["batch"] == 4
    curve = result["curve"]
    assert [row["step"] for row in curve] == [0, 1, 2]
    assert [row["tokens"] for row in curve] == [0, 256, 512]
    for row in curve:
        assert row["gain"] == pytest.approx(row["after_other"] - row["after_copy"], abs=1e-9)
        assert row["gain_lo"] <= row["gain"] <= row["gain_hi"]
        assert 0.5 < row["after_other"] < 3.0  # nats per base of an untrained-to-barely-trained model
    assert sorted(result["reach"]) == ["32", "64"]
    for cell in result["reach"].values():
        assert cell["gain"] == pytest.approx(cell["after_other"] - cell["after_copy"], abs=1e-9)
        assert cell["gain_lo"] <= cell["gain"] <= cell["gain_hi"]


def test_worker_freeze_and_silence(sample_store: Path, tmp_path: Path) -> None:
    """--freeze and --silence leave those parameters as initialised while the rest trains."""
    import torch

    from genolong.model import GenoLM
    from genolong.model.config import PRESETS

    _run_worker(
        sample_store,
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--eval-tiles",
        "4",
        "--tokens-per-step",
        "128",
        "--reach",
        "32",
        "--reach-tiles",
        "4",
        "--silence",
        "0",
        "--freeze=layers.2.self_attn.*",
        "--save",
        str(tmp_path),
    )
    torch.manual_seed(0)  # the worker's seed: the same initial weights
    initial = GenoLM(PRESETS["tiny"]).state_dict()
    trained = GenoLM.from_pretrained(tmp_path / "h32").state_dict()
    kept = [k for k in initial if k.startswith(("layers.0.self_attn.", "layers.2.self_attn."))]
    assert kept and all(torch.equal(trained[k], initial[k]) for k in kept)  # exact: never updated
    moved = "layers.1.self_attn.o_proj.weight"  # a mixer neither frozen nor silenced: trained
    assert not torch.equal(trained[moved], initial[moved])  # exact: two AdamW steps move every trained weight


def test_worker_refuses_a_missing_layer(sample_store: Path) -> None:
    done = _run_worker(sample_store, "--steps", "1", "--silence", "0,8", check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("--silence 0,8: the model has layers 0-7;")
