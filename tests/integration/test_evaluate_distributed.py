"""`genolong evaluate` and `genolong check-logprobs` as multi-process jobs on CPU (gloo), against
the one-process run of the same model (`tiny`, seeded):

- cp 2 (Lightning Fabric starts both processes; the model loaded from a sharded DCP checkpoint
  straight onto the mesh) and cp 2 x dp_shard 2 (four processes, from the export directory, each
  rank reading its slices of the safetensors): the bucket sums, per-offset sums and per-token
  table equal the one-process ones to 1e-5 relative (context parallelism sums in another order);
- dp 2 (torchrun starts the processes, as a cluster does): the same tables; a dp 2 run started by
  Lightning and SIGKILLed (the whole job) after its first committed round resumes and ends with
  tables identical to the uninterrupted dp 2 run;
- check-logprobs with cp 2: the same per-token log-probs of both paths as one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from genolong.cli import main
from genolong.config import parse_recipe
from genolong.evaluation.score import read_tokens
from genolong.model import PRESETS, GenoLM

# the tests that launch jobs (distributed, slow) take 30-60 s each on 2 shared cores, mostly process start-up

_ENV = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_TABLES = ("tile_buckets.parquet", "tile_buckets_softmask.parquet", "positions.parquet")


def _model(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _command(args: list[str], torchrun: int = 0) -> list[str]:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        if torchrun
        else [sys.executable]
    )
    return [*launcher, "-m", "genolong.cli", *args]


def _run(args: list[str], torchrun: int = 0) -> None:
    run = subprocess.run(_command(args, torchrun), env=_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]


def _parallel(devices: int, cp: int = 1) -> list[str]:
    return ["--set", "parallel.accelerator=cpu", "--set", f"parallel.devices={devices}", "--set", f"parallel.cp={cp}"]


def _assert_tables_close(a: Path, b: Path, rel: float = 1e-5) -> None:
    """The per-tile bucket sums, per-offset sums and per-token table of two results: token counts,
    positions and bases equal, NLL sums to ``rel`` relative."""
    for name in _TABLES:
        x, y = pq.read_table(a / name).to_pandas(), pq.read_table(b / name).to_pandas()
        assert list(x.columns) == list(y.columns), name
        for column in x.columns:
            if "nll" in column:
                np.testing.assert_allclose(y[column], x[column], rtol=rel, atol=0, err_msg=f"{name} {column}")
            else:
                assert (x[column].to_numpy() == y[column].to_numpy()).all(), (
                    f"{name} {column}"
                )  # exact: counts, indices
    x, y = read_tokens(a), read_tokens(b)
    pd.testing.assert_frame_equal(x.drop(columns="nll"), y.drop(columns="nll"))
    np.testing.assert_allclose(y["nll"], x["nll"], rtol=rel, atol=0)


def _dcp_checkpoint(model_dir: Path, store: Path, out: Path) -> Path:
    """A sharded checkpoint as a multi-process finetune writes it (DCP shards of ``state_dict.model.*``
    plus Lightning's meta.pt holding the recipe) of the model in ``model_dir``."""
    import torch.distributed.checkpoint as dcp

    weights = GenoLM.from_pretrained(model_dir).state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"state_dict": {f"model.{k}": v for k, v in weights.items()}}, checkpoint_id=out, no_dist=True)
    recipe = parse_recipe(
        {"model": {"preset": "tiny"}, "data": {"store": str(store), "context": 256}, "train": {"max_steps": 1}},
        name="dcp",
    )
    torch.save({"genolong": {"recipe": recipe.to_dict()}}, out / "meta.pt")
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallel_evaluations_equal_one_process(sample_store: Path, tmp_path: Path) -> None:
    model = _model(tmp_path)
    common = ["--store", str(sample_store), "--context", "256", "--max-tiles", "3", "--first-bucket", "64", "--quiet"]
    assert main(["evaluate", str(model), *common, "--out", str(tmp_path / "one")]) == 0
    checkpoint = _dcp_checkpoint(model, sample_store, tmp_path / "run" / "checkpoints" / "step0000001.ckpt")
    _run(["evaluate", str(checkpoint), *common, "--out", str(tmp_path / "cp2"), *_parallel(2, cp=2)])
    _assert_tables_close(tmp_path / "one", tmp_path / "cp2")
    _run(["evaluate", str(model), *common, "--out", str(tmp_path / "cp2dp2"), *_parallel(4, cp=2)])
    _assert_tables_close(tmp_path / "one", tmp_path / "cp2dp2")
    meta = json.loads((tmp_path / "cp2dp2" / "meta.json").read_text())
    assert meta["parallel"] == {"world": 4, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "ep": 1}
    assert meta["tiles"] == 3 and meta["segment_tokens"] is None


@pytest.mark.distributed
@pytest.mark.slow
def test_data_parallel_evaluation_equals_one_process_and_resumes_after_a_kill(
    sample_store: Path, tmp_path: Path
) -> None:
    model = _model(tmp_path)
    common = [
        "evaluate",
        str(model),
        "--store",
        str(sample_store),
        "--context",
        "1024",
        "--max-tiles",
        "6",
        "--first-bucket",
        "256",
        "--quiet",
    ]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    _run([*common, "--out", str(tmp_path / "whole"), *_parallel(2)], torchrun=2)
    _assert_tables_close(tmp_path / "one", tmp_path / "whole")

    # the whole job killed once its first round of 2 tiles is committed: started by Lightning (its
    # ranks in the session of the first, so one killpg reaches them all; torchrun's workers would
    # outlive a kill of torchrun alone), resumed by the same launch
    state = tmp_path / ".killed.partial" / "state.npz"
    proc = subprocess.Popen(
        _command([*common, "--out", str(tmp_path / "killed"), *_parallel(2)]),
        env=_ENV,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_file():
            try:
                with np.load(state) as z:
                    if int(z["next_tile"]) >= 2:
                        break
            except (OSError, ValueError, KeyError):
                pass  # being replaced right now
        time.sleep(0.02)
    assert proc.poll() is None, "the evaluation ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed").exists()  # nothing half-written under the result name
    with np.load(state) as z:
        done = int(z["next_tile"])
    assert done in (2, 4)  # whole rounds only
    _run([*common, "--out", str(tmp_path / "killed"), *_parallel(2)])
    for name in ("tiles.parquet", *_TABLES, "buckets.csv"):
        a, b = tmp_path / "killed" / name, tmp_path / "whole" / name
        # exact: both jobs run one layout in OMP_NUM_THREADS=1 processes (same ops, same order)
        if name.endswith(".parquet"):
            assert pq.read_table(a).equals(pq.read_table(b)), name  # exact: as above
        else:
            assert a.read_text() == b.read_text(), name  # exact: as above
    pd.testing.assert_frame_equal(
        read_tokens(tmp_path / "killed"), read_tokens(tmp_path / "whole"), check_exact=True
    )  # exact: as above


@pytest.mark.distributed
@pytest.mark.slow
def test_check_logprobs_with_context_parallelism_equals_one_process(sample_store: Path, tmp_path: Path) -> None:
    model = _model(tmp_path)
    common = [
        "check-logprobs",
        str(model),
        "--store",
        str(sample_store),
        "--context",
        "192",
        "--max-tiles",
        "1",
        "--quiet",
    ]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    _run([*common, "--out", str(tmp_path / "cp2"), *_parallel(2, cp=2)])
    one, two = (pd.read_parquet(tmp_path / d / "tokens.parquet") for d in ("one", "cp2"))
    assert len(one) == len(two) > 0
    assert (one["tile"].to_numpy() == two["tile"].to_numpy()).all() and (
        one["offset"].to_numpy() == two["offset"].to_numpy()
    ).all()  # exact: indices
    np.testing.assert_allclose(two["train_logprob"], one["train_logprob"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(two["decode_logprob"], one["decode_logprob"], rtol=1e-5, atol=0)


def test_tiles_are_dealt_in_rounds_of_dp() -> None:
    from genolong.evaluation.distributed import tile_rounds

    assert list(tile_rounds(0, 5, 2)) == [[0, 1], [2, 3], [4]]
    assert list(tile_rounds(2, 5, 2)) == [[2, 3], [4]]  # a resumed run starts at its committed round
    assert list(tile_rounds(0, 3, 1)) == [[0], [1], [2]]


def test_the_parallel_layout_errors_are_one_line(
    sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model(tmp_path)
    args = ["evaluate", str(model), "--store", str(sample_store), "--context", "256", "--out", str(tmp_path / "x")]
    cases = {
        ("--set", "train.lr=1"): "without --recipe only the parallel section can be set",
        ("--set", "parallel.cp=two"): "parallel.cp must be an integer",
        ("--set", "parallel.cp=2"): "does not divide the world size 1",  # one process cannot hold two CP ranks
        (
            "--set",
            "parallel.devices=2",
            "--set",
            "parallel.cp=2",
            "--set",
            "parallel.ep=3",
        ): "parallel.ep = 3 does not divide",
    }
    for extra, message in cases.items():
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_a_multi_process_scoring_run_keeps_glibcs_allocator(tmp_path: Path) -> None:
    # one process keeps freed memory (speed); several shard to fit memory, where the kept heap grew
    # each rank back to the one-process peak (benchmarks/evaluate_memory.py)
    from genolong.cli import _shards_for_memory, build_parser

    def parse(*extra: str) -> bool:
        return _shards_for_memory(build_parser().parse_args(["evaluate", "m", "--store", "s", *extra]))

    assert not parse()
    assert not parse("--set", "parallel.cp=1")
    assert parse("--set", "parallel.devices=2", "--set", "parallel.cp=2")
    assert not _shards_for_memory(build_parser().parse_args(["finetune", "r.yaml"]))


@pytest.mark.distributed
@pytest.mark.slow
def test_multi_process_probe_equals_one_process(sample_store: Path, tmp_path: Path) -> None:
    # cp 2 x dp_shard 2 over 3 tiles: each tile split over a CP pair, the second round one tile for
    # two dp groups (the idle group reruns it and is dropped); one process streams the full views
    # through a PrefillStream, the ranks run plain forwards: equal up to float rounding
    from genolong.evaluation.probe import ProbeResult

    model = _model(tmp_path)
    common = ["--store", str(sample_store), "--context", "256", "--repeat-bases", "16", "--max-tiles", "3", "--quiet"]
    assert main(["probe", str(model), *common, "--out", str(tmp_path / "one")]) == 0
    _run(["probe", str(model), *common, "--out", str(tmp_path / "four"), *_parallel(4, cp=2)])
    one, four = ProbeResult.load(tmp_path / "one"), ProbeResult.load(tmp_path / "four")
    assert list(four.distances) == [32, 64, 128] and four.meta["parallel"]["world"] == 4
    assert (one.tile_tokens == four.tile_tokens).all()  # exact: counts
    np.testing.assert_allclose(four.tile_full, one.tile_full, rtol=1e-5, atol=0)
    np.testing.assert_allclose(four.tile_cut, one.tile_cut, rtol=1e-5, atol=0)
