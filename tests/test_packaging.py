"""Packaging: kernels/ and evaluation/ install inside the genolong namespace; the sample ships."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import genolong.evaluation
import genolong.kernels
from genolong.cli import main
from genolong.quickstart import sample_fasta

ROOT = Path(__file__).resolve().parents[1]


def test_namespace_mapping_in_this_install(tmp_path: Path) -> None:
    assert Path(genolong.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(genolong.evaluation.__file__).resolve() == ROOT / "evaluation" / "__init__.py"
    # Outside the source tree, the install must not expose a top-level `kernels`/`evaluation`
    # (a PyPI package called kernels exists).
    probe = "import importlib.util as u; print([s and s.origin for s in map(u.find_spec, ('kernels', 'evaluation'))])"
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert str(ROOT) not in found
    assert sample_fasta().is_file() and Path(f"{sample_fasta()}.fai").is_file() and Path(f"{sample_fasta()}.gzi").is_file()


@pytest.mark.slow
def test_wheel_contents(tmp_path: Path) -> None:
    """A built wheel maps kernels/ -> genolong/kernels, evaluation/ -> genolong/evaluation, data/ ->
    genolong/bundled, with the sample genome and no top-level kernels/ or tests/."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("genolong-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "genolong/kernels/__init__.py",
        "genolong/evaluation/__init__.py",
        "genolong/data/prepare.py",
        "genolong/bundled/sample/sample.fa.gz",
        "genolong/bundled/sample/sample.fa.gz.fai",
        "genolong/bundled/sample/sample.fa.gz.gzi",
        "genolong/bundled/sample/README.md",
    ):
        assert expected in names, expected
    assert not any(n.startswith(("kernels/", "evaluation/", "tests/", "data/")) for n in names)
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text and "Provides-Extra: test" in text


def test_cli_help_and_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("genolong ")
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    help_text = capsys.readouterr().out
    assert "--min-gap" in help_text and "--force" in help_text


def test_quickstart_command(tmp_path: Path) -> None:
    """`genolong quickstart` as a user runs it (a subprocess), shortened to 2 steps at 1,024
    tokens: prepare, base model on held-out chr22, fine-tune, fine-tuned model on the same tiles.
    Run twice: the second run replaces the first (store and run directory)."""
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-m", "genolong.cli", "quickstart", "--out", str(tmp_path / "qs"), "--quiet",
             "--set", "train.max_steps=2", "--set", "train.warmup_steps=1", "--set", "data.context=1024",
             "--set", "eval.every_n_steps=2", "--set", "checkpoint.every_n_steps=2"],
            capture_output=True, text=True,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    assert "train: 6,179,943 tokens in 5 segments" in run.stdout
    assert "eval: 900,000 tokens in 2 segments" in run.stdout
    assert (tmp_path / "qs" / "genome" / "manifest.json").is_file()
    lines = run.stdout.splitlines()
    base = next(line for line in lines if line.strip().startswith("base "))
    tuned = next(line for line in lines if line.strip().startswith("fine-tuned "))
    assert float(base.split()[1]) > 0 and float(tuned.split()[1]) > 0
    run_dir = tmp_path / "qs" / "runs" / "quickstart"
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step0000002.ckpt"]
