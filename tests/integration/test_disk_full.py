"""A full disk or a file-size limit (issue 27, item 4): a checkpoint, the export, the LoRA adapter, an
evaluate result or a store that cannot be written ends with one line naming the output and the
bytes it needed, exit status 2, no temporary files left, and every earlier output as it was.

Each case runs the command in a subprocess under a file-size limit (``RLIMIT_FSIZE``), so no real
filesystem fills: from the start (prepare, evaluate) or from the moment the writer under test is
called (the second checkpoint of a run, the export, the adapter: a smaller limit from the start would
stop the run's first checkpoint). CPython ignores SIGXFSZ, so the write fails with EFBIG instead of
the process being killed. One case fills a real filesystem (a 3 MiB tmpfs; root only).
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genolong.integrity import check_weights
from genolong.quickstart import SAMPLE_EVAL, SAMPLE_TRAIN, sample_fasta
from genolong.train import read_step_log
from tests.train.test_finetune import _recipe as _finetune_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

# Runs a genolong command with the file-size limit set when TARGET ("module:attribute.path") is
# called for the CALLS-th time (argv: TARGET CALLS LIMIT command...).
_LIMIT_AT_CALL = """
import importlib, resource, sys
from genolong.cli import main
target, calls, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
module, _, attribute = target.partition(":")
*parents, name = attribute.split(".")
owner = importlib.import_module(module)
for parent in parents:
    owner = getattr(owner, parent)
real, seen = getattr(owner, name), [0]
def limited(*args, **kwargs):
    seen[0] += 1
    if seen[0] == calls:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return real(*args, **kwargs)
setattr(owner, name, limited)
sys.exit(main(sys.argv[4:]))
"""


def _genolong(
    *args: str, cwd: Path, limit: int | None = None, at: tuple[str, int] | None = None
) -> subprocess.CompletedProcess:
    """``genolong ARGS`` in a subprocess; ``limit``: its file-size limit in bytes, from the start
    or (``at``) from the given call of a function on."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    if at is not None:
        assert limit is not None
        argv = [sys.executable, "-c", _LIMIT_AT_CALL, at[0], str(at[1]), str(limit), *args]
        preexec = None
    else:
        argv = [sys.executable, "-m", "genolong.cli", *args]
        preexec = None if limit is None else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=preexec)


def _the_line(run: subprocess.CompletedProcess, command: str, output: Path, reason: str) -> str:
    """The run failed with exit status 2 and one error line on stderr, its last, naming ``output``,
    the bytes it needed and ``reason``; no traceback. Returns the line."""
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    lines = run.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == [lines[-1]], run.stderr[-3000:]
    line = lines[-1]
    assert line.startswith(f"genolong {command}: error: cannot write {output}: {reason}"), line
    assert re.search(r"it needed (about|more than) [\d,]+ bytes", line), line
    assert re.search(r"[\d,]+ bytes free on its filesystem", line), line
    print(line)
    return line


def _leftovers(root: Path) -> list[str]:
    """Temporary files and directories of genolong's writers under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if re.search(r"\.(tmp|old)\b|\.ckpt\.tmp$", p.name))


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (what "intact" compares)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _recipe(tmp_path: Path, store: Path, name: str, **sections: dict) -> Path:
    """test_finetune's tiny recipe: 4 steps, a checkpoint every 2, no evaluation, outputs in runs/NAME."""
    train = {"max_steps": 4, "warmup_steps": 0, **sections.pop("train", {})}
    return _finetune_recipe(tmp_path, store, name, train=train, eval={"every_n_steps": 0}, **sections)


def test_disk_full_cause_and_writing(tmp_path: Path) -> None:
    """The cause is found behind a library's own exception (safetensors' text, a DCP rank's
    failure) and nowhere else; ``writing`` names the output, not the temporary file that failed."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from genolong.errors import DiskFullError
    from genolong.files import disk_full_cause, writing

    text = Exception("Error while serializing: I/O error: File too large (os error 27)")
    assert disk_full_cause(text).errno == errno.EFBIG
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        rank = CheckpointException("save failed", {1: _wrap_exception(exc)})
    assert disk_full_cause(rank).errno == errno.ENOSPC
    assert (
        disk_full_cause(OSError(errno.EACCES, "Permission denied")) is None and disk_full_cause(ValueError("x")) is None
    )
    out, work = tmp_path / "export", tmp_path / ".export.tmp"
    work.mkdir()
    (work / "config.json").write_text("{}")
    with pytest.raises(DiskFullError) as caught, writing(out, needed=1234, work=work):
        with writing(work / "model.safetensors", work=work / "model.safetensors"):
            raise text
    assert caught.value.filename == str(out) and caught.value.needed == 1234 and caught.value.errno == errno.EFBIG
    assert str(caught.value).startswith(f"cannot write {out}: File too large") and "it needed about 1,234 bytes" in str(
        caught.value
    )
    with pytest.raises(PermissionError), writing(out, work=work):  # other errors pass unchanged
        raise PermissionError(errno.EACCES, "Permission denied")


def test_checkpoint_then_export(sample_store: Path, tmp_path: Path) -> None:
    """A run whose second checkpoint meets a 3 MB file-size limit (a checkpoint is 6 MB): one line,
    the step-2 checkpoint intact; ``--resume`` continues from it, writes the step-4 checkpoint, and
    its export then meets a 1 MB limit (the export is 2 MB): one line, the checkpoints intact."""
    recipe = _recipe(tmp_path, sample_store, "full")
    run_dir = tmp_path / "runs" / "full"
    checkpoints = run_dir / "checkpoints"
    saving = "genolong.train.finetune:AtomicModelParallelStrategy.save_checkpoint"
    run = _genolong("finetune", str(recipe), cwd=tmp_path, limit=3_000_000, at=(saving, 2))
    _the_line(run, "finetune", checkpoints / "step0000004.ckpt", "File too large")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step0000002.ckpt", "step0000002.ckpt.checksums.json"]
    assert not (run_dir / "export").exists() and _leftovers(tmp_path) == []
    check_weights(checkpoints / "step0000002.ckpt")  # its checksums and format: intact
    first = torch.load(checkpoints / "step0000002.ckpt", weights_only=True)
    assert first["global_step"] == 2
    step2 = _digests(checkpoints)

    run = _genolong(
        "finetune",
        str(recipe),
        "--resume",
        cwd=tmp_path,
        limit=1_000_000,
        at=("genolong.train.export:export_model", 1),
    )
    _the_line(run, "finetune", run_dir / "export", "File too large")
    assert sorted(read_step_log(run_dir / "logs" / "steps.jsonl")) == [1, 2, 3, 4]  # resumed: steps 3 and 4 trained
    assert {
        name: digest for name, digest in _digests(checkpoints).items() if name in step2
    } == step2  # step 2 unchanged
    check_weights(checkpoints / "step0000004.ckpt")
    assert torch.load(checkpoints / "step0000004.ckpt", weights_only=True)["global_step"] == 4
    assert not (run_dir / "export").exists() and _leftovers(tmp_path) == []


def test_adapter(sample_store: Path, tmp_path: Path) -> None:
    """A LoRA run whose adapter meets a 10 kB file-size limit: one line; its checkpoint intact."""
    recipe = _recipe(
        tmp_path,
        sample_store,
        "lora",
        train={"max_steps": 1},
        checkpoint={"every_n_steps": 1},
        model={"lora": {"targets": ["layers.*.self_attn.*"], "rank": 4, "alpha": 8.0}},
    )
    run_dir = tmp_path / "runs" / "lora"
    run = _genolong("finetune", str(recipe), cwd=tmp_path, limit=10_000, at=("genolong.model.lora:save_adapter", 1))
    _the_line(run, "finetune", run_dir / "adapter", "File too large")
    assert not (run_dir / "adapter").exists() and not (run_dir / "export").exists() and _leftovers(tmp_path) == []
    check_weights(run_dir / "checkpoints" / "step0000001.ckpt")


def test_evaluate_result(sample_store: Path, tmp_path: Path) -> None:
    """``evaluate --force`` over an earlier result, under a 4 kB file-size limit (a tile's per-token
    table is 5.5 kB): one line; the earlier result intact."""
    from genolong.data.store import GenomeStore
    from genolong.evaluation.score import evaluate
    from genolong.model import PRESETS, GenoLM

    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"])
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "eval"
    evaluate(model, GenomeStore.open(sample_store).split("eval"), out, 256, max_tiles=2, progress=False)
    before = _digests(out)
    run = _genolong(
        "evaluate",
        "model",
        "--store",
        str(sample_store),
        "--out",
        "eval",
        "--force",
        "--context",
        "256",
        "--max-tiles",
        "2",
        "--quiet",
        cwd=tmp_path,
        limit=4096,
    )
    _the_line(run, "evaluate", Path("eval"), "File too large")
    assert _digests(out) == before and _leftovers(tmp_path) == []


def test_prepare_store(sample_store: Path, tmp_path: Path) -> None:
    """``prepare --force`` over an earlier store, under a 1 MB file-size limit (its token shard is
    1.8 MB): one line; the earlier store intact."""
    out = tmp_path / "genome"
    shutil.copytree(sample_store, out)
    before = _digests(out)
    run = _genolong(
        "prepare",
        str(sample_fasta()),
        "--out",
        str(out),
        "--force",
        "--quiet",
        "--train",
        ",".join(SAMPLE_TRAIN),
        "--eval",
        ",".join(SAMPLE_EVAL),
        cwd=tmp_path,
        limit=1_000_000,
    )
    _the_line(run, "prepare", out, "File too large")
    assert (
        _digests(out) == before
        and _leftovers(tmp_path) == []
        and sorted(p.name for p in tmp_path.iterdir()) == ["genome"]
    )


def test_prepare_on_a_full_filesystem(sample_store: Path, tmp_path: Path) -> None:
    """A real ENOSPC: ``prepare --force`` on a 3 MiB tmpfs that holds the earlier 2.2 MB store
    (mounted here, unmounted at the end; root only): one line with the free bytes; the store intact."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "genolong-test", str(disk)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        out = disk / "genome"
        shutil.copytree(sample_store, out)
        before = _digests(out)
        run = _genolong(
            "prepare",
            str(sample_fasta()),
            "--out",
            str(out),
            "--force",
            "--quiet",
            "--train",
            ",".join(SAMPLE_TRAIN),
            "--eval",
            ",".join(SAMPLE_EVAL),
            cwd=tmp_path,
        )
        line = _the_line(run, "prepare", out, "No space left on device")
        free = int(re.search(r"([\d,]+) bytes free", line).group(1).replace(",", ""))
        # measured before the temporary store was removed; a write can fill the filesystem to its
        # last byte first (0 free: seen with zarr 3.0.8, the floor), so 0 is a true figure too
        assert 0 <= free <= shutil.disk_usage(disk).free < 3 * 2**20
        assert _digests(out) == before and sorted(p.name for p in disk.iterdir()) == ["genome"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
