"""Packaging: kernels/ and evaluation/ install inside the genolong namespace; the sample ships."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import genolong.evaluation
import genolong.kernels
from genolong.cli import main
from genolong.evaluation.probe import ProbeResult
from genolong.evaluation.results import EvalResult
from genolong.evaluation.stats import compare
from genolong.quickstart import bundled_base, sample_fasta

ROOT = Path(__file__).resolve().parents[1]


def test_namespace_mapping_in_this_install(tmp_path: Path) -> None:
    assert Path(genolong.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(genolong.evaluation.__file__).resolve() == ROOT / "evaluation" / "__init__.py"
    # Outside the source tree, the install must not expose a top-level `kernels`/`evaluation`
    # (a PyPI package called kernels exists, and transformers from 5.25 requires it). The virtualenv
    # may lie inside the checkout (CI's .venv), so the check is on the two folders themselves.
    probe = "import importlib.util as u; print([s and s.origin for s in map(u.find_spec, ('kernels', 'evaluation'))])"
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert str(ROOT / "kernels") not in found and str(ROOT / "evaluation") not in found, found
    assert sample_fasta().is_file() and Path(f"{sample_fasta()}.fai").is_file() and Path(f"{sample_fasta()}.gzi").is_file()



def test_top_level_kernels_from_the_checkout_root_is_the_installed_distribution(tmp_path: Path) -> None:
    """Run from the checkout's root (its folder then first on sys.path), ``import kernels`` gives the
    installed ``kernels`` distribution, which transformers imports, not the repository's kernels/
    folder; with no such distribution it fails as a plain missing module does."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHICH = 'the distribution'\n")
    (site / "kernels" / "utils.py").write_text("PART = 'its submodule'\n")
    probe = "import kernels, kernels.utils; print(kernels.WHICH, '/', kernels.utils.PART, '/', kernels.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"the distribution / its submodule / {site / 'kernels' / '__init__.py'}"


def test_top_level_kernels_from_the_checkout_root_without_the_distribution_is_an_empty_folder() -> None:
    """With no ``kernels`` distribution anywhere, ``import kernels`` from the checkout's root gives
    what Python gives for a folder that is not a package: an empty module with no ``__file__``,
    ``__version__`` or submodules, never the repository's kernels/ code. That is what transformers
    5.17's ``is_kernels_available`` needs: ``find_spec("kernels")`` finds the folder (nothing can
    make it skip a path entry), no metadata names a version, so it imports the module and calls it
    "not available" when it has neither ``__version__`` nor ``__file__``; a ModuleNotFoundError
    there (as before) made every transformers model import fail from the root."""
    probe = ("import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
             "import importlib, importlib.metadata, importlib.util\n"
             "spec = importlib.util.find_spec('kernels')\n"
             "try:\n    importlib.metadata.version('kernels'); dist = 'dist'\n"
             "except importlib.metadata.PackageNotFoundError:\n    dist = 'no-dist'\n"
             "module = importlib.import_module('kernels')\n"  # transformers 5.17 does this here
             "print(spec is not None, dist, getattr(module, '__version__', 'N/A'), getattr(module, '__file__', None),\n"
             "      list(module.__path__), [n for n in vars(module) if not n.startswith('__')])\n"
             "try:\n    import kernels.backends\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
             "try:\n    from kernels import get_kernel\nexcept ImportError:\n    print('ImportError')\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == ["True no-dist N/A None [] []", "kernels.backends", "ImportError"], run.stdout


@pytest.mark.slow
def test_wheel_contents(tmp_path: Path) -> None:
    """A built wheel maps kernels/ -> genolong/kernels, evaluation/ -> genolong/evaluation, data/ ->
    genolong/bundled, with the sample genome and no top-level kernels/ or tests/.

    Built from a copy of the tree: setuptools writes build/ and *.egg-info into the source it
    builds, so two test runs at once (tests/run_twice.sh, two checkouts' CI) building the
    repository itself would overwrite each other's files."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "genome",
        "genolong-quickstart*", "evaluations", "lightning_logs"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True,
    )
    (wheel,) = tmp_path.glob("genolong-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "genolong/kernels/__init__.py",
        "genolong/evaluation/__init__.py",
        "genolong/data/prepare.py",
        "genolong/config/schema.py",
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
    """`genolong quickstart --control` as a user runs it (a subprocess), shortened to 2 steps at
    2,048 tokens and 2 held-out tiles: prepare, evaluate the base, fine-tune, evaluate full and cut,
    train and evaluate the control, compare, plot, REPORT.md. Run twice into the same directory:
    first the cheapest run (1 step, 1 tile, no probe, no control), then the full one, which replaces
    its store, runs and results (the first run's step-1 checkpoint must be gone). The second run
    starts from the first one's export (`--set model.checkpoint`): that checkpoint, not the bundled
    base, is what it scores and reports as the base. The first run also scores the bundled base read
    with the recipe's wider DSA key budget; the second's base already has it, so it does not."""
    common = [sys.executable, "-m", "genolong.cli", "quickstart", "--out", str(tmp_path / "qs"), "--quiet",
              "--set", "data.context=2048"]
    first = ["--eval-tiles", "1", "--probe-tiles", "0", "--set", "train.max_steps=1", "--set", "train.warmup_steps=0",
             "--set", "eval.every_n_steps=1", "--set", "checkpoint.every_n_steps=1"]
    second = ["--control", "--eval-tiles", "2", "--probe-tiles", "1", "--set", "train.max_steps=2",
              "--set", "train.warmup_steps=1", "--set", "eval.every_n_steps=2", "--set", "checkpoint.every_n_steps=2"]
    started_from = tmp_path / "one-step"
    for extra in (first, [*second, "--set", f"model.checkpoint={started_from}"]):
        run = subprocess.run([*common, *extra], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        if extra is first:
            assert sorted(p.name for p in (tmp_path / "qs" / "runs" / "quickstart" / "checkpoints").iterdir())[0] == "step0000001.ckpt"
            first_base = EvalResult.load(tmp_path / "qs" / "eval" / "base")
            assert Path(first_base.meta["checkpoint"]) == bundled_base().resolve()
            # the recipe reads with 2,048 DSA keys (model.overrides), the bundled base's config.json with
            # 512: the base is also scored read that way (one stage more), and the report separates the two
            assert "[7/7 |" in run.stdout and "/8 |" not in run.stdout
            read = EvalResult.load(tmp_path / "qs" / "eval" / "base-read")
            assert read.label == "base, 2,048 DSA keys" and read.mean_nll != first_base.mean_nll
            assert read.fingerprint == first_base.fingerprint
            first_report = (tmp_path / "qs" / "REPORT.md").read_text()
            for what in ("Read with 2,048 keys per DSA query (index_topk; the base's config.json: 512)",
                         "(the base read with 2,048 DSA keys vs base, no training)",
                         "What did the 1 training step change? (fine-tuned vs base, both read with 2,048 DSA keys)"):
                assert what in first_report, what
            shutil.copytree(tmp_path / "qs" / "runs" / "quickstart" / "export", started_from)
    assert "train: 6,179,943 tokens in 5 segments" in run.stdout
    assert "eval: 900,000 tokens in 2 segments" in run.stdout
    assert "[9/9 |" in run.stdout and "genolong quickstart: done in" in run.stdout
    qs = tmp_path / "qs"
    assert (qs / "genome" / "manifest.json").is_file()
    for name in ("quickstart", "control"):
        assert (qs / "runs" / name / "export" / "model.safetensors").is_file()
        assert sorted(p.name for p in (qs / "runs" / name / "checkpoints").iterdir()) == ["step0000002.ckpt", "step0000002.ckpt.checksums.json"]
    results = {name: EvalResult.load(qs / "eval" / name) for name in ("base", "tuned", "tuned-cut", "control")}
    assert not (qs / "eval" / "base-read").exists()  # the base it started from already reads with 2,048 keys
    # the base scored is the checkpoint the fine-tune started from (one step past the bundled base)
    assert results["base"].meta["checkpoint"] == str(started_from)
    assert len({r.fingerprint for r in results.values()}) == 1  # the same tokens everywhere
    assert results["tuned-cut"].context_cut == 1024 and results["tuned"].context_cut is None
    assert results["tuned"].tokens == results["base"].tokens > 4000
    # the control was trained on the same windows with the context cut: it differs from the tuned model
    assert results["control"].mean_nll != results["tuned"].mean_nll
    report = (qs / "REPORT.md").read_text()
    for what in ("## Held-out loss by preceding context", "fine-tuned vs base", "full vs cut at 1,024",
                 "fine-tuned vs short-context control", "figures/position_loss.png", "figures/relative_change.png",
                 "training the DSA attention layers only (610.0K of 9.3M parameters", "How much held-out DNA the intervals rest on: 2 tiles",
                 "## MoE routing on the held-out tiles", "## Long-range recall: planted repeats (genolong probe)",
                 "figures/probe.png"):
        assert what in report, what
    # the routing table: the base's layers as its evaluation measured them
    for r in results["base"].meta["routing"]:
        assert f"| {r['layer']} | {r['load_max_over_mean']:.2f} ({r['dead_experts']} dead) |" in report
    table = compare(results["base"], results["tuned"])
    overall = table.set_index("bucket").loc["all"]
    assert f"{overall.b_nats:.4f}" in report and f"{overall.rel_pct:.2f}%" in report
    for name in ("base", "tuned"):  # the probe, one tile per model
        assert ProbeResult.load(qs / "probe" / name).meta["tiles"] == 1
    for figure in ("position_loss", "buckets", "relative_change", "probe"):
        assert (qs / "figures" / f"{figure}.png").read_bytes().startswith(b"\x89PNG")
        assert (qs / "figures" / f"{figure}.pdf").read_bytes().startswith(b"%PDF")
