"""Checkpoints written in the background (issue 27, item 3: ``checkpoint.async_save``).

- An async run writes, at every step, the same checkpoint bytes (and manifests) as a synchronous
  run, with the same losses; the last checkpoint is complete when ``finetune`` returns, even when
  the background write is slow.
- A background write that fails (a file-size limit from the second checkpoint on) ends the run with
  one line and exit status 2; the previous checkpoint stays (its removal by ``keep_last`` waits for
  the newer one to be in place).
- A resume from an async checkpoint continues exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from genolong.config import load_recipe
from genolong.integrity import check_weights
from genolong.train import read_step_log
from genolong.train.async_checkpoint import first_difference
from genolong.train.finetune import AtomicModelParallelStrategy, run
from tests.helpers import genolong_frames
from tests.integration.test_disk_full import _genolong, _leftovers, _the_line
from tests.train.test_finetune import _recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(
    tmp_path: Path, store: Path, name: str, async_save: bool, steps: int = 4, keep_last: int = 4, every: int = 1
) -> Path:
    return _recipe(
        tmp_path,
        store,
        name,
        train={"max_steps": steps, "warmup_steps": 0},
        eval={"every_n_steps": 0},
        data={"store": str(store), "context": 64},
        checkpoint={"every_n_steps": every, "keep_last": keep_last, "async_save": async_save},
    )


def _renamed(x: object) -> object:
    """``x`` with the async run's paths (in keys and values) written as the sync run's."""
    if isinstance(x, str):
        return x.replace("/runs/async/", "/runs/sync/")
    if isinstance(x, dict):
        return {_renamed(k): _renamed(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_renamed(v) for v in x)
    return x


def _same_checkpoint(a: Path, b: Path) -> None:
    """Two step*.ckpt of runs that differ only in name and directories: every tensor record of the
    zip byte for byte, and the same contents but for the recipe."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:

        def records(z: zipfile.ZipFile) -> dict[str, bytes]:
            return {
                n.split("/", 1)[1]: z.read(n)
                for n in z.namelist()
                if not n.endswith(("data.pkl", "version", "serialization_id"))
            }

        ra, rb = records(za), records(zb)
        assert ra.keys() == rb.keys() and all(ra[k] == rb[k] for k in ra), a.name
    ca, cb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    for c in (ca, cb):
        c["genolong"].pop("recipe")
    assert first_difference(ca, _renamed(cb)) is None, a.name


def test_async_checkpoints_equal_sync_ones_bitwise(
    sample_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(load_recipe(_tiny(tmp_path, sample_store, "sync", async_save=False)))
    # a slow background write: finetune must still return with the last checkpoint in place
    write = AtomicModelParallelStrategy._write

    def slow(self, *args, **kwargs):  # noqa: ANN001, ANN202
        time.sleep(0.3)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(AtomicModelParallelStrategy, "_write", slow)
    result = run(load_recipe(_tiny(tmp_path, sample_store, "async", async_save=True)))
    checkpoints = result.paths.checkpoints
    names = [f"step{s:07d}.ckpt" for s in range(1, 5)]
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted([*names, *(n + ".checksums.json" for n in names)])
    check_weights(checkpoints / names[-1])
    for name in names:  # every step's checkpoint: the state of that step, bit for bit
        _same_checkpoint(tmp_path / "runs" / "sync" / "checkpoints" / name, checkpoints / name)
    a = read_step_log(tmp_path / "runs" / "sync" / "logs" / "steps.jsonl")
    b = read_step_log(tmp_path / "runs" / "async" / "logs" / "steps.jsonl")
    assert [a[s]["train/loss"] for s in range(1, 5)] == [b[s]["train/loss"] for s in range(1, 5)]


def test_a_failed_background_write_is_one_line_and_keeps_the_previous_checkpoint(
    sample_store: Path, tmp_path: Path
) -> None:
    """keep_last 1: the step-2 checkpoint would be removed once step 4's is saved; step 4's write
    fails in the background (a 3 MB file-size limit; a checkpoint is 6 MB), so step 2's stays."""
    recipe = _tiny(tmp_path, sample_store, "full", async_save=True, steps=6, keep_last=1, every=2)
    recipe.write_text(recipe.read_text().replace("context: 64", "context: 256"))
    checkpoints = tmp_path / "runs" / "full" / "checkpoints"
    run = _genolong(
        "finetune",
        str(recipe),
        cwd=tmp_path,
        limit=3_000_000,
        at=("genolong.train.finetune:AtomicModelParallelStrategy._write", 2),
    )
    _the_line(run, "finetune", checkpoints / "step0000004.ckpt", "File too large")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step0000002.ckpt", "step0000002.ckpt.checksums.json"]
    check_weights(checkpoints / "step0000002.ckpt")
    assert torch.load(checkpoints / "step0000002.ckpt", weights_only=True)["global_step"] == 2
    assert max(read_step_log(tmp_path / "runs" / "full" / "logs" / "steps.jsonl")) < 6  # stopped at a step boundary
    assert not (tmp_path / "runs" / "full" / "export").exists() and _leftovers(tmp_path) == []


def test_resume_from_an_async_checkpoint_is_exact(sample_store: Path, tmp_path: Path) -> None:
    recipe = _tiny(tmp_path, sample_store, "resumed", async_save=True, every=2)
    root = tmp_path / "runs" / "resumed"
    run(load_recipe(recipe))
    first = read_step_log(root / "logs" / "steps.jsonl")
    export = {
        k: v.clone()
        for k, v in torch.load(root / "checkpoints" / "step0000004.ckpt", weights_only=True)["state_dict"].items()
    }
    for p in root.glob("checkpoints/step0000004.ckpt*"):
        p.unlink()
    (root / "logs" / "steps.jsonl").rename(root / "logs" / "first.jsonl")
    run(load_recipe(recipe), resume=True)
    second = read_step_log(root / "logs" / "steps.jsonl")
    assert sorted(second) == [3, 4]
    assert [second[s]["train/loss"] for s in (3, 4)] == [first[s]["train/loss"] for s in (3, 4)]
    again = torch.load(root / "checkpoints" / "step0000004.ckpt", weights_only=True)["state_dict"]
    assert again.keys() == export.keys() and all(torch.equal(again[k], export[k]) for k in export)  # one thread: exact


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_hash_their_own_shards_and_verify_them_on_resume(sample_store: Path, tmp_path: Path) -> None:
    """A torchrun dp = 2 job with async saves: each checkpoint's manifest lists every file, with the
    sizes and checksums a full re-hash computes (each rank hashed its own shard); a changed byte in
    rank 1's shard stops ``--resume`` with one line naming it; the intact checkpoint resumes exactly."""
    import subprocess

    import yaml

    from genolong.integrity import MANIFEST_NAME, file_checksum
    from tests.integration.test_finetune_distributed import _finetune as _job
    from tests.integration.test_finetune_distributed import _recipe as _job_recipe

    recipe = _job_recipe(tmp_path, sample_store, "dp2", {"devices": 2, "cp": 1})
    data = yaml.safe_load(recipe.read_text())
    data["checkpoint"]["async_save"] = True
    data["eval"]["every_n_steps"] = 0
    recipe.write_text(yaml.safe_dump(data))
    _job(recipe, torchrun=2)
    checkpoints = tmp_path / "runs" / "dp2" / "checkpoints"
    for step in (2, 4):
        directory = checkpoints / f"step{step:07d}.ckpt"
        manifest = json.loads((directory / MANIFEST_NAME).read_text())["files"]
        files = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST_NAME)
        assert sorted(manifest) == files and {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(files)
        for name in files:
            assert manifest[name] == {
                "bytes": (directory / name).stat().st_size,
                "crc32": file_checksum(directory / name),
            }, name

    log = tmp_path / "runs" / "dp2" / "logs" / "steps.jsonl"
    first = read_step_log(log)
    shutil.rmtree(checkpoints / "step0000004.ckpt")
    log.rename(log.with_name("first.jsonl"))
    shard = checkpoints / "step0000002.ckpt" / "__1_0.distcp"
    original = shard.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    failed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "genolong.cli",
            "finetune",
            str(recipe),
            "--resume",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0
    assert "__1_0.distcp is damaged (crc32 checksum differs" in failed.stderr, failed.stderr[-3000:]
    # one line per rank; the only traceback is torchrun's own report of a failed child (no genolong frame)
    assert genolong_frames(failed.stderr) == [], failed.stderr[-3000:]
    shard.write_bytes(original)
    if log.exists():
        log.unlink()
    _job(recipe, "--resume", torchrun=2)
    resumed = read_step_log(log)
    assert sorted(resumed) == [3, 4]
    assert [resumed[s]["train/loss"] for s in (3, 4)] == [first[s]["train/loss"] for s in (3, 4)]


def test_the_manifest_from_the_ranks_digests_equals_a_full_rehash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 hashes only what no rank vouched for (``.metadata``, ``meta.pt``); the manifest is
    the one a full re-hash writes; ``check_weights(shards=(rank, world))`` hashes that rank's shard."""
    from genolong import integrity

    directory = tmp_path / "step0000002.ckpt"
    directory.mkdir()
    for name, size in ((".metadata", 100), ("__0_0.distcp", 3000), ("__1_0.distcp", 2000), ("meta.pt", 50)):
        (directory / name).write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    full = integrity.write_manifest(directory).read_bytes()
    hashed: list[str] = []
    real = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda path, *a: hashed.append(Path(path).name) or real(path, *a))
    known = {**integrity.shard_entries(directory, 0), **integrity.shard_entries(directory, 1)}
    assert sorted(hashed) == ["__0_0.distcp", "__1_0.distcp"]  # each by "its" rank
    hashed.clear()
    assert integrity.write_manifest(directory, known=known).read_bytes() == full
    assert sorted(hashed) == [".metadata", "meta.pt"]
    hashed.clear()
    monkeypatch.setattr(integrity, "_kind", lambda path: "none")  # the checksums only (fake DCP files)
    integrity.check_weights(directory, shards=(1, 2))
    assert sorted(hashed) == [".metadata", "__1_0.distcp", "meta.pt"]
