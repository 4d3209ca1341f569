"""Damaged weights and checkpoints: one line naming the file and the problem, nothing written;
``--resume`` past a damaged newest checkpoint to the newest intact one.

Every kind of file genolong reads weights from (the safetensors export, the one-process ``.ckpt``
file, the sharded DCP directory's shard, ``.metadata`` and ``meta.pt``, and the checksum manifests
themselves) is truncated and bit-flipped, then given to ``genolong evaluate`` in-process. The
checkpoints come from one tiny in-process finetune (2 steps, a checkpoint each) shared by the
module; the DCP directories are written from them by genolong's own strategy.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from genolong.cli import main
from genolong.config import load_recipe
from genolong.errors import InputError
from genolong.integrity import DamagedFileError, check_weights, write_manifest
from genolong.train.finetune import AtomicModelParallelStrategy, intact_checkpoint, run

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Run:
    """The module's finetune run and the DCP copies of its checkpoints."""

    recipe: Path
    root: Path
    dcp: Path  # a checkpoints/ directory holding step0000001.ckpt/ and step0000002.ckpt/ as DCP directories


def _write_recipe(path: Path, store: Path, root: Path) -> Path:
    recipe = {
        "name": "tiny",
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 64},
        "train": {"max_steps": 2, "warmup_steps": 0},
        "eval": {"every_n_steps": 0},
        "checkpoint": {"dir": str(root / "checkpoints"), "every_n_steps": 1, "keep_last": 2},
        "logging": {"dir": str(root / "logs"), "progress_bar": False, "tensorboard": False, "csv": False},
        "parallel": {"accelerator": "cpu"},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def tiny_run(sample_store: Path, tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Run:
    """The cheapest run with two checkpoints and an export: the tiny preset, 64-token windows, 2 steps."""
    base = tmp_path_factory.mktemp("tiny_run")
    root = base / "runs" / "tiny"
    recipe = _write_recipe(base / "tiny.yaml", sample_store, root)
    run(load_recipe(recipe))
    dcp = base / "dcp" / "checkpoints"
    dcp.mkdir(parents=True)
    strategy = AtomicModelParallelStrategy(save_distributed_checkpoint=True)
    for step in (1, 2):
        name = f"step{step:07d}.ckpt"
        strategy.save_checkpoint(torch.load(root / "checkpoints" / name, weights_only=True), dcp / name)
    return Run(recipe=recipe, root=root, dcp=dcp)


def test_writers_leave_manifests(tiny_run: Run) -> None:
    checkpoints = tiny_run.root / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step0000001.ckpt",
        "step0000001.ckpt.checksums.json",
        "step0000002.ckpt",
        "step0000002.ckpt.checksums.json",
    ]
    assert sorted(p.name for p in (tiny_run.root / "export").iterdir()) == [
        "checksums.json",
        "config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in (tiny_run.dcp / "step0000002.ckpt").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "checksums.json",
        "meta.pt",
    ]
    for checkpoint in (checkpoints / "step0000002.ckpt", tiny_run.root / "export", tiny_run.dcp / "step0000002.ckpt"):
        assert check_weights(checkpoint) is True  # a manifest vouched for every file


# -- damage -----------------------------------------------------------------------------------------
def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


_DAMAGE = {"truncate": _truncate, "flip": _flip}


def _copy(tiny_run: Run, kind: str, dest: Path) -> Path:
    """A private copy of one checkpoint of ``kind``; returns what genolong is pointed at."""
    if kind == "export":
        return Path(shutil.copytree(tiny_run.root / "export", dest / "export"))
    if kind == "dcp":
        return Path(shutil.copytree(tiny_run.dcp / "step0000002.ckpt", dest / "checkpoints" / "step0000002.ckpt"))
    (dest / "checkpoints").mkdir(parents=True)
    for name in ("step0000002.ckpt", "step0000002.ckpt.checksums.json"):
        shutil.copy2(tiny_run.root / "checkpoints" / name, dest / "checkpoints" / name)
    return dest / "checkpoints" / "step0000002.ckpt"


def _evaluate_fails(target: Path, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``genolong evaluate target``: exit 2, one stderr line (returned), no output directory."""
    out = tmp_path / "evaluations" / "result"
    code = main(
        ["evaluate", str(target), "--store", str(store), "--context", "64", "--max-tiles", "1", "--out", str(out)]
    )
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert code == 2 and "\n" not in line and line.startswith("genolong evaluate: error: "), captured.err
    assert not (tmp_path / "evaluations").exists()  # nothing written, not even the parent
    return line


# (kind, the file damaged inside it, what the line says for a truncation, for a bit flip)
_CASES = [
    ("export", "model.safetensors", "truncated: ", "crc32 checksum differs"),
    ("export", "checksums.json", "checksum manifest is not JSON", "checksum manifest"),
    ("ckpt", "step0000002.ckpt", "truncated: ", "crc32 checksum differs"),
    ("ckpt", "step0000002.ckpt.checksums.json", "checksum manifest is not JSON", "checksum manifest"),
    ("dcp", "__0_0.distcp", "truncated: ", "crc32 checksum differs"),
    ("dcp", ".metadata", "truncated: ", "crc32 checksum differs"),
    ("dcp", "meta.pt", "truncated: ", "crc32 checksum differs"),
    ("dcp", "checksums.json", "checksum manifest is not JSON", "checksum manifest"),
]


@pytest.mark.parametrize("damage", list(_DAMAGE))
@pytest.mark.parametrize(("kind", "name", "truncated", "flipped"), _CASES, ids=[f"{k}-{n}" for k, n, *_ in _CASES])
def test_damaged_file_is_named_in_one_line(
    tiny_run: Run,
    sample_store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    name: str,
    truncated: str,
    flipped: str,
    damage: str,
) -> None:
    target = _copy(tiny_run, kind, tmp_path / "copy")
    victim = target.parent / name if kind == "ckpt" else target / name
    _DAMAGE[damage](victim)
    line = _evaluate_fails(target, sample_store, tmp_path, capsys)
    assert f"{victim} is damaged (" in line
    assert (truncated if damage == "truncate" else flipped) in line, line


# without a manifest (an older genolong's checkpoint) the formats' own structure still names a truncation
_STRUCTURE = [
    ("export", "model.safetensors", "checksums.json", "truncated: "),
    ("ckpt", "step0000002.ckpt", "step0000002.ckpt.checksums.json", "truncated: "),
    ("dcp", "__0_0.distcp", "checksums.json", "truncated: "),
    ("dcp", ".metadata", "checksums.json", "DCP metadata is truncated"),
    ("dcp", "meta.pt", "checksums.json", "truncated: "),
]


@pytest.mark.parametrize(("kind", "name", "manifest", "says"), _STRUCTURE, ids=[f"{k}-{n}" for k, n, *_ in _STRUCTURE])
def test_truncation_without_manifest(
    tiny_run: Run,
    sample_store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    name: str,
    manifest: str,
    says: str,
) -> None:
    target = _copy(tiny_run, kind, tmp_path / "copy")
    folder = target.parent if kind == "ckpt" else target
    (folder / manifest).unlink()
    _truncate(folder / name)
    line = _evaluate_fails(target, sample_store, tmp_path, capsys)
    assert f"{folder / name} is damaged ({says}" in line, line


def test_bit_flip_in_ckpt_without_manifest_fails_its_zip_crc(tiny_run: Run, tmp_path: Path) -> None:
    target = _copy(tiny_run, "ckpt", tmp_path)
    target.with_name(target.name + ".checksums.json").unlink()
    _flip(target)
    with pytest.raises(DamagedFileError, match=r"step0000002\.ckpt is damaged \(member .* fails its CRC-32"):
        check_weights(target)


def test_old_checkpoint_without_manifest_loads_with_a_note(
    tiny_run: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from genolong.evaluation.score import load_eval_model

    target = _copy(tiny_run, "ckpt", tmp_path)
    target.with_name(target.name + ".checksums.json").unlink()
    with caplog.at_level("INFO", logger="genolong"):
        load_eval_model(target)
    assert f"{target} has no checksum manifest" in caplog.text


def test_wrong_dtype_and_unreadable_config(tiny_run: Run, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from genolong.model import GenoLM

    target = _copy(tiny_run, "export", tmp_path)
    tensors = load_file(target / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    write_manifest(target)  # written by genolong: the manifest agrees, the loader's own check speaks
    with pytest.raises(
        InputError, match=rf"tensor {name} in model.safetensors is stored as I32 but the model expects a floating"
    ):
        GenoLM.from_pretrained(target)
    (target / "config.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(InputError, match=r"config\.json is not valid JSON"):
        GenoLM.from_pretrained(target)
    (target / "config.json").write_text("[1, 2]")
    with pytest.raises(InputError, match=r"config\.json is not a model config \(a JSON list"):
        GenoLM.from_pretrained(target)


# -- --resume -------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", list(_DAMAGE))
@pytest.mark.parametrize("layout", ["ckpt", "dcp"])
def test_intact_checkpoint_skips_a_damaged_newest(
    tiny_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, damage: str
) -> None:
    source = tiny_run.root / "checkpoints" if layout == "ckpt" else tiny_run.dcp
    checkpoints = Path(shutil.copytree(source, tmp_path / "checkpoints"))
    newest = checkpoints / "step0000002.ckpt"
    _DAMAGE[damage](newest / "__0_0.distcp" if layout == "dcp" else newest)
    assert intact_checkpoint(checkpoints) == checkpoints / "step0000001.ckpt"
    line = capsys.readouterr().err.strip()
    inside = "__0_0.distcp: " if layout == "dcp" else ""
    problem = "truncated: " if damage == "truncate" else "crc32 checksum differs"
    assert line.startswith(f"genolong: step0000002.ckpt is damaged ({inside}{problem}") and "\n" not in line, line
    assert line.endswith("; resuming from step0000001.ckpt")
    # none intact: one error naming them all
    _truncate(checkpoints / "step0000001.ckpt" / ".metadata" if layout == "dcp" else checkpoints / "step0000001.ckpt")
    with pytest.raises(
        InputError,
        match=r"--resume: no intact checkpoint in .*: step0000002\.ckpt \(.*\); step0000001\.ckpt \(.*truncated",
    ):
        intact_checkpoint(checkpoints)


def test_resume_from_the_older_checkpoint(
    tiny_run: Run, sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run(resume=True)`` with a truncated newest checkpoint: says so, resumes from the older one,
    trains the missing step and writes the newest again, intact."""
    root = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.root / "checkpoints", root / "checkpoints")
    _truncate(root / "checkpoints" / "step0000002.ckpt")
    recipe = load_recipe(
        _write_recipe(tmp_path / "tiny.yaml", sample_store, root), ["checkpoint.export_safetensors=false"]
    )
    capsys.readouterr()
    result = run(recipe, resume=True)
    err = capsys.readouterr().err
    assert "genolong: step0000002.ckpt is damaged (truncated: " in err and "; resuming from step0000001.ckpt" in err
    assert result.resumed_from == root / "checkpoints" / "step0000001.ckpt" and result.global_step == 2
    assert check_weights(root / "checkpoints" / "step0000002.ckpt") is True  # written again, whole
