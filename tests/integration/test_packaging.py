"""Packaging: kernels/ and evaluation/ install inside the genolong namespace; the sample ships."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import genolong.evaluation
import genolong.kernels
from genolong.cli import main
from genolong.evaluation.probe import ProbeResult
from genolong.evaluation.results import EvalResult
from genolong.evaluation.stats import compare
from genolong.quickstart import bundled_base, sample_fasta

ROOT = Path(__file__).resolve().parents[2]


def test_namespace_mapping_in_this_install(tmp_path: Path) -> None:
    assert Path(genolong.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(genolong.evaluation.__file__).resolve() == ROOT / "evaluation" / "__init__.py"
    # Outside the source tree, the install must not expose a top-level `kernels`/`evaluation`
    # (a PyPI package called kernels exists, and transformers from 5.25 requires it). The virtualenv
    # may lie inside the checkout (CI's .venv), so the check is on the two folders themselves.
    probe = "import importlib.util as u; print([s and s.origin for s in map(u.find_spec, ('kernels', 'evaluation'))])"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert str(ROOT / "kernels") not in found and str(ROOT / "evaluation") not in found, found
    assert (
        sample_fasta().is_file() and Path(f"{sample_fasta()}.fai").is_file() and Path(f"{sample_fasta()}.gzi").is_file()
    )


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
    probe = (
        "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
        "import importlib, importlib.metadata, importlib.util\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "try:\n    importlib.metadata.version('kernels'); dist = 'dist'\n"
        "except importlib.metadata.PackageNotFoundError:\n    dist = 'no-dist'\n"
        "module = importlib.import_module('kernels')\n"  # transformers 5.17 does this here
        "print(spec is not None, dist, getattr(module, '__version__', 'N/A'), getattr(module, '__file__', None),\n"
        "      list(module.__path__), [n for n in vars(module) if not n.startswith('__')])\n"
        "try:\n    import kernels.backends\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
        "try:\n    from kernels import get_kernel\nexcept ImportError:\n    print('ImportError')\n"
    )
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
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            "runs",
            "genome",
            "genolong-quickstart*",
            "evaluations",
            "lightning_logs",
        ),
    )
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


def test_quickstart_command(sample_store: Path, tmp_path: Path) -> None:
    """`genolong quickstart --control` as a user runs it (a subprocess), shortened to 2 steps at
    2,048 tokens and 2 held-out tiles: prepare, evaluate the base (and the base read with the
    recipe's wider DSA key budget), fine-tune, evaluate full and cut, train and evaluate the control,
    probe, compare, plot, REPORT.md. Run once, into a directory that already holds an earlier run's
    outputs (a prepared store, a step-1 checkpoint of each run, evaluations, probes, figures, a
    report): it replaces them all. (What base it scores when `--set model.checkpoint` names another,
    and that a base already read with 2,048 keys is scored once: the cheaper
    test_quickstart_scores_the_base_it_starts_from_read_as_the_fine_tune_reads_it.)"""
    qs = tmp_path / "qs"
    # an earlier run's outputs, each of which this run must replace
    shutil.copytree(sample_store, qs / "genome")
    stale = [qs / "runs" / name / "checkpoints" / "step0000001.ckpt" for name in ("quickstart", "control")]
    stale += [qs / "eval" / "old" / "meta.json", qs / "probe" / "old" / "meta.json", qs / "figures" / "old.png"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("an earlier run's")
    (qs / "REPORT.md").write_text("an earlier run's report")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "genolong.cli",
            "quickstart",
            "--out",
            str(qs),
            "--quiet",
            "--set",
            "data.context=2048",
            "--control",
            "--eval-tiles",
            "2",
            "--probe-tiles",
            "1",
            "--set",
            "train.max_steps=2",
            "--set",
            "train.warmup_steps=1",
            "--set",
            "eval.every_n_steps=2",
            "--set",
            "checkpoint.every_n_steps=2",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "train: 6,179,943 tokens in 5 segments" in run.stdout
    assert "eval: 900,000 tokens in 2 segments" in run.stdout
    # the recipe reads with 2,048 DSA keys (model.overrides), the bundled base's config.json with
    # 512: the base is also scored read that way (one stage more), and the report separates the two
    assert "[10/10 |" in run.stdout and "/11 |" not in run.stdout and "genolong quickstart: done in" in run.stdout
    assert not [p for p in stale if p.exists()], "an earlier run's outputs were left"
    assert (qs / "genome" / "manifest.json").is_file()
    for name in ("quickstart", "control"):
        assert (qs / "runs" / name / "export" / "model.safetensors").is_file()
        assert sorted(p.name for p in (qs / "runs" / name / "checkpoints").iterdir()) == [
            "step0000002.ckpt",
            "step0000002.ckpt.checksums.json",
        ]
    assert sorted(p.name for p in (qs / "eval").iterdir()) == ["base", "base-read", "control", "tuned", "tuned-cut"]
    results = {
        name: EvalResult.load(qs / "eval" / name) for name in ("base", "base-read", "tuned", "tuned-cut", "control")
    }
    # the base scored (and read the other way) is the checkpoint the fine-tune started from: the bundled one
    assert (
        Path(results["base"].meta["checkpoint"])
        == Path(results["base-read"].meta["checkpoint"])
        == bundled_base().resolve()
    )
    assert (
        results["base-read"].label == "base, 2,048 DSA keys"
        and results["base-read"].mean_nll != results["base"].mean_nll
    )
    assert len({r.fingerprint for r in results.values()}) == 1  # the same tokens everywhere
    assert results["tuned-cut"].context_cut == 1024 and results["tuned"].context_cut is None
    assert results["tuned"].tokens == results["base"].tokens > 4000
    # the control was trained on the same windows with the context cut: it differs from the tuned model
    assert results["control"].mean_nll != results["tuned"].mean_nll
    report = (qs / "REPORT.md").read_text()
    for what in (
        "## Held-out loss by preceding context",
        "fine-tuned vs base",
        "full vs cut at 1,024",
        "fine-tuned vs short-context control",
        "figures/position_loss.png",
        "figures/relative_change.png",
        "training the DSA attention layers only (610.0K of 9.3M parameters",
        "How much held-out DNA the intervals rest on: 2 tiles",
        "## MoE routing on the held-out tiles",
        "## Long-range recall: planted repeats (genolong probe)",
        "figures/probe.png",
        "Read with 2,048 keys per DSA query (index_topk; the base's config.json: 512)",
        "(the base read with 2,048 DSA keys vs base, no training)",
        "What did the 2 training steps change? (fine-tuned vs base, both read with 2,048 DSA keys)",
    ):
        assert what in report, what
    # the routing table: the base's layers as its evaluation measured them
    for r in results["base"].meta["routing"]:
        assert f"| {r['layer']} | {r['load_max_over_mean']:.2f} ({r['dead_experts']} dead) |" in report
    table = compare(results["base"], results["tuned"])
    overall = table.set_index("bucket").loc["all"]
    assert f"{overall.b_nats:.4f}" in report and f"{overall.rel_pct:.2f}%" in report
    assert sorted(p.name for p in (qs / "probe").iterdir()) == ["base", "tuned"]
    for name in ("base", "tuned"):  # the probe, one tile per model
        assert ProbeResult.load(qs / "probe" / name).meta["tiles"] == 1
    for figure in ("position_loss", "buckets", "relative_change", "probe"):
        assert (qs / "figures" / f"{figure}.png").read_bytes().startswith(b"\x89PNG")
        assert (qs / "figures" / f"{figure}.pdf").read_bytes().startswith(b"%PDF")


class _Trained(Exception):
    """Raised by the stand-in fine-tune: the stages after it are not under test."""


@pytest.mark.parametrize("own_base", [False, True], ids=["bundled-base", "own-base-with-2048-keys"])
def test_quickstart_scores_the_base_it_starts_from_read_as_the_fine_tune_reads_it(
    own_base: bool, sample_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quickstart's stages up to the fine-tune, with the scoring and the training stood in for
    (what they record is what is checked): without ``--set model.checkpoint`` the bundled base is
    scored, then scored again read with the recipe's 2,048 DSA keys (its config.json has 512), and
    the fine-tune starts from it; with ``--set model.checkpoint=DIR`` naming a base whose config.json
    already has 2,048 keys, DIR is what is scored and fine-tuned, once: no base-read stage."""
    import genolong.evaluation.score as score
    import genolong.train.finetune as finetune
    from genolong.data import GenomeStore
    from genolong.model.config import ModelConfig
    from genolong.quickstart import _Stages, _story

    base = bundled_base().resolve()
    overrides = ["data.context=2048"]
    if own_base:
        base = tmp_path / "own-base"
        config = ModelConfig.from_pretrained(bundled_base())
        assert config.index_topk == 512
        config.replace(index_topk=2048).save_pretrained(base)
        overrides.append(f"model.checkpoint={base}")
    loaded: list[tuple[Path, dict]] = []
    scored: list[tuple[str, str, str]] = []
    trained: list[str] = []

    def load_eval_model(path: Path, overrides: dict | None = None) -> tuple[object, None]:
        loaded.append((Path(path).resolve(), dict(overrides or {})))
        return object(), None

    def evaluate(model, split, out: Path, context: int, **kwargs):
        scored.append((out.name, kwargs["label"], kwargs["meta"]["checkpoint"]))
        return SimpleNamespace(mean_nll=2.0, tokens=1, meta={"tokens_per_second": 1.0})

    def run(recipe):
        trained.append(recipe.model.checkpoint)
        raise _Trained

    monkeypatch.setattr(score, "load_eval_model", load_eval_model)
    monkeypatch.setattr(score, "evaluate", evaluate)
    monkeypatch.setattr(finetune, "run", run)
    with pytest.raises(_Trained):
        _story(tmp_path / "qs", GenomeStore.open(sample_store), overrides, False, False, 1, _Stages(10))
    assert [Path(c).resolve() for c in trained] == [base]
    if own_base:
        assert [(n, lab, Path(c).resolve()) for n, lab, c in scored] == [("base", "base", base)]
        assert loaded == [(base, {})]
    else:
        assert [(n, lab, Path(c).resolve()) for n, lab, c in scored] == [
            ("base", "base", base),
            ("base-read", "base, 2,048 DSA keys", base),
        ]
        assert loaded == [(base, {}), (base, {"index_topk": 2048})]
