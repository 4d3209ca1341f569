"""The light commands start without torch or Lightning (issue 18).

``genolong --help``, every subcommand's ``--help``, ``prepare``, ``plan``, ``compare`` and
``plot`` must never import torch or Lightning (about a second of imports on 2 cores: it made
``genolong --help`` take seconds and ``genolong prepare`` 3x slower than ``gzip -dc``). One fresh
interpreter runs every command in turn and records, after each, which heavy modules are loaded;
the first command after which one appears is the one that imported it. Correctness only: no wall
times are asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from genolong.cli import COMMANDS
from genolong.evaluation.results import FORMAT, EvalResult
from genolong.evaluation.stats import bucket_edges

REPO = Path(__file__).resolve().parents[2]
#: top-level packages none of the light commands may import
HEAVY = ("torch", "lightning", "pytorch_lightning")

# Runs in a fresh interpreter: argv lists as JSON on the command line; prints one JSON line per
# command: its exit code and the heavy modules loaded so far (SystemExit from --help is a return).
RUNNER = """
import json, sys
from genolong.cli import main
heavy = tuple(sys.argv[1].split(","))
for argv in json.loads(sys.argv[2]):
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    loaded = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in heavy})
    print("RESULT " + json.dumps({"argv": argv, "rc": rc, "heavy": loaded}), flush=True)
"""


def _tiny_result(directory: Path, label: str, seed: int) -> Path:
    """A small saved ``genolong evaluate`` result (4 tiles of 64 tokens) for compare and plot."""
    rng = np.random.default_rng(seed)
    context, w = 64, 4
    edges = bucket_edges(context, first=8)
    k = len(edges) - 1
    tile_tokens = np.tile(np.diff(edges), (w, 1)).astype(np.int64)
    tile_nll = tile_tokens * rng.uniform(1.2, 1.4, size=(w, k))
    position_tokens = np.r_[0, np.full(context - 1, w)].astype(np.int64)
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
        "tokens": int(tile_tokens.sum()),
        "nll_sum": float(tile_nll.sum()),
        "fingerprint": "f" * 64,
        "dtype": "float32",
    }
    tiles = pd.DataFrame(
        {"tile": np.arange(w), "contig": ["chr22"] * w, "start": np.arange(w) * context, "length": np.full(w, context)}
    )
    position_nll = position_tokens * rng.uniform(1.2, 1.4, context)
    position_nll *= tile_nll.sum() / position_nll.sum()  # the result checks that both tables add up to the same loss
    result = EvalResult(
        meta=meta,
        tiles=tiles,
        tile_tokens=tile_tokens,
        tile_nll=tile_nll,
        position_tokens=position_tokens,
        position_nll=position_nll,
    )
    directory.mkdir(parents=True)
    result.save(directory)
    return directory


@pytest.fixture(scope="module")
def startup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every light command run once, in order, in one fresh interpreter: ``" ".join(argv)`` ->
    ``{"rc": exit code, "heavy": heavy packages loaded after it}``."""
    tmp = tmp_path_factory.mktemp("startup")
    a, b = _tiny_result(tmp / "a", "A", 0), _tiny_result(tmp / "b", "B", 1)
    commands = sorted(command.name for command in COMMANDS)
    runs = [
        ["--help"],
        *([c, "--help"] for c in commands),
        [
            "prepare",
            str(REPO / "data" / "sample" / "sample.fa.gz"),
            "--out",
            str(tmp / "store"),
            "--train",
            "chr1",
            "--eval",
            "chr22",
            "--quiet",
        ],
        ["plan", str(REPO / "recipes" / "quickstart.yaml"), "--gpus", "1"],
        ["plan", str(REPO / "recipes" / "quickstart.yaml"), "--gpus", "1", "--evaluate"],
        ["compare", str(a), str(b), "--n-boot", "50"],
        ["plot", str(a), str(b), "--out", str(tmp / "figures"), "--format", "png", "--n-boot", "50"],
    ]
    # pandas is watched too, as a control: compare needs it, so the runner must report it from then on
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, ",".join((*HEAVY, "pandas")), json.dumps(runs)],
        capture_output=True,
        text=True,
        cwd=tmp,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [
        json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert [r["argv"] for r in results] == runs, proc.stderr[-3000:]
    return {
        " ".join(r["argv"]): {**r, "heavy": [m for m in r["heavy"] if m in HEAVY], "pandas": "pandas" in r["heavy"]}
        for r in results
    }


def test_help_texts_load_no_torch(startup: dict[str, dict]) -> None:
    helps = {k: v for k, v in startup.items() if k.endswith("--help")}
    assert "--help" in helps and "finetune --help" in helps and "quickstart --help" in helps  # every subcommand
    for command, result in helps.items():
        assert result["rc"] == 0, command
        assert result["heavy"] == [], f"`genolong {command}` imported {result['heavy']}"


@pytest.mark.parametrize("command", ["prepare", "plan", "compare", "plot"])
def test_light_commands_load_no_torch(startup: dict[str, dict], command: str) -> None:
    runs = {k: v for k, v in startup.items() if k.split()[0] == command and not k.endswith("--help")}
    assert runs
    for argv, result in runs.items():
        assert result["rc"] == 0, argv
        assert result["heavy"] == [], f"`genolong {argv}` imported {result['heavy']}"


def test_runner_reports_what_a_command_loads(startup: dict[str, dict]) -> None:
    """The check can fail: the runner reports a watched package once a command imports it (pandas,
    which --help never needs and compare does)."""
    assert not startup["--help"]["pandas"]
    compare = next(v for k, v in startup.items() if k.startswith("compare ") and not k.endswith("--help"))
    assert compare["pandas"]


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`genolong plan RECIPE | head`: the reader gone before the plan is printed gives no traceback,
    and the status of a command killed by SIGPIPE (141), as cat's."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "genolong.cli", "plan", str(REPO / "recipes" / "quickstart.yaml"), "--gpus", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the command has written anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()[-2000:]
    assert b"Traceback" not in err and b"BrokenPipeError" not in err
