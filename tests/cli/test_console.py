"""What the model commands print (genolong.console): genolong's own lines, Lightning's banners,
tips and its own warnings only with --verbose, warnings about the user's setup always, and on a
multi-process job rank 0 alone."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from genolong import console
from genolong.cli import main

# small ops: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

# what Lightning printed between genolong's lines before genolong.console (issue 18)
_NOISE = (
    "GPU available",
    "TPU available",
    "Tip:",
    "litlogger",
    "Initializing distributed",
    "distributed_backend",
    "All distributed processes registered",
    "limit_val_batches",
    "Validation DataLoader",
    "Sanity Checking",
    "`Trainer.fit` stopped",
    "LeafSpec",
)


@pytest.fixture(autouse=True)
def _fresh_console(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts, and leaves the process, without --verbose; the command line's handler
    for genolong's lines is made anew on this test's stderr (main() adds it once per process);
    Lightning's records reach the root logger (caplog) whatever handlers it set up on import."""
    console.set_verbose(False)
    for name in ("genolong", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "level", logger.level)
    for name in ("lightning.pytorch", "lightning.fabric"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
    yield
    console.set_verbose(False)


def _library_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages below WARNING that Lightning's and torch's loggers let through."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(("lightning", "pytorch_lightning", "torch")) and r.levelno < logging.WARNING
    ]


def _tiny_recipe(tmp_path: Path, store: Path, name: str, **sections: dict) -> Path:
    """One training step of the tiny model at 64 tokens, one held-out tile scored, the progress
    bar on: the smallest run that goes through Lightning's setup, fit, validation and export."""
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 64},
        "train": {"max_steps": 1, "warmup_steps": 0},
        "eval": {"every_n_steps": 1, "max_tiles": 1},
        "checkpoint": {"dir": str(tmp_path / "runs" / name / "checkpoints"), "every_n_steps": 1, "keep_last": 1},
        "logging": {"dir": str(tmp_path / "runs" / name / "logs"), "progress_bar": True, "tensorboard": False},
        "parallel": {"accelerator": "cpu"},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe[section], **values}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _finetune(tmp_path: Path, store: Path, name: str, *args: str, **sections: dict) -> list[warnings.WarningMessage]:
    """``genolong finetune`` in this process; returns the warnings that got through genolong's
    filters (recorded, with every other filter set to "always": what a user would see)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        launcher = {
            name: os.environ.get(name)
            for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
        }
        assert main(["finetune", str(_tiny_recipe(tmp_path, store, name, **sections)), *args]) == 0
    import torch.distributed as dist

    # a one-process run ends the process group Lightning started for it and restores the launcher's
    # variables: later code in this process must not take itself for one rank of a job, nor a child
    # process inherit the port of a store or a LOCAL_RANK (genolong.train.finetune.run)
    assert not dist.is_initialized()
    assert {name: os.environ.get(name) for name in launcher} == launcher
    return seen


def test_finetune_prints_genolong_lines_and_setup_warnings_only(
    sample_store: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a machine with more CPUs than this one: Lightning's PossibleUserWarning about the data loader
    # workers (a warning about the user's setup, raised inside Lightning) must still show
    from lightning.pytorch.trainer.connectors import data_connector

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda devices: 4)
    seen = _finetune(tmp_path, sample_store, "quiet")
    out, err = capfd.readouterr()
    printed = out + err
    assert "genolong finetune: quiet: 1 steps" in out
    assert "train windows L=64" in err  # genolong's own log lines stay
    assert [noise for noise in _NOISE if noise in printed] == []
    assert _library_records(caplog) == []
    bars = [line for line in err.replace("\r", "\n").splitlines() if "step" in line and "%" in line]
    assert bars and all(line.startswith("train:") for line in bars)  # one bar: genolong's training bar
    assert "1/1" in bars[-1] and "loss=" in bars[-1] and "eval loss=" in bars[-1]
    messages = [str(w.message) for w in seen]
    assert any("does not have many workers" in m for m in messages), messages
    assert not [w for w in seen if issubclass(w.category, (DeprecationWarning, FutureWarning))], messages
    assert logging.getLogger("lightning.pytorch").level == logging.INFO  # restored after the run


def test_finetune_verbose_shows_lightning(
    sample_store: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    seen = _finetune(
        tmp_path, sample_store, "loud", "--verbose", eval={"every_n_steps": 0}, checkpoint={"export_safetensors": False}
    )
    out, _ = capfd.readouterr()
    assert "genolong finetune: loud: 1 steps" in out
    shown = "\n".join(_library_records(caplog))
    # (the distributed banner comes once per process: a test before this one may have initialised it)
    for line in ("GPU available", "TPU available", "Tip:", "`Trainer.fit` stopped"):
        assert line in shown, line
    # Lightning's own deprecation chatter is back too
    assert any(w.filename.endswith("_pytree.py") for w in seen), [str(w.message) for w in seen]


@pytest.mark.parametrize(
    ("env", "zero"),
    [
        ({}, True),
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),
        ({"RANK": "3", "LOCAL_RANK": "1"}, False),  # torchrun
        ({"LOCAL_RANK": "1"}, False),  # started by Lightning itself
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # the first process of the second node
        ({"LOCAL_RANK": "0", "NODE_RANK": "0", "SLURM_PROCID": "5"}, True),  # Lightning's order: LOCAL_RANK first
        ({"SLURM_PROCID": "2"}, False),  # srun
        ({"SLURM_PROCID": "0"}, True),
    ],
)
def test_rank_zero_from_the_launcher_environment(
    env: dict[str, str], zero: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _launcher_env(monkeypatch, env)
    assert console.is_rank_zero() is zero


def test_rank_zero_from_torch_distributed_once_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    _launcher_env(monkeypatch, {"LOCAL_RANK": "0"})
    started = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch.distributed", started)
    assert not console.is_rank_zero()


def _launcher_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """The launcher's variables ``env`` only, and no process group (whatever an earlier test of this
    process left initialised)."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)


def test_other_ranks_print_errors_only(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("genolong")
    handler = logging.StreamHandler()  # on the current stderr, as the command line's
    logger.addHandler(handler)
    try:
        _launcher_env(monkeypatch, {"LOCAL_RANK": "1"})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with console.quiet_run(verbose=False):
                print("a line of rank 1")
                logger.warning("a warning of rank 1")
                logging.getLogger("lightning.pytorch.trainer").warning("Lightning on rank 1")
                logger.error("an error of rank 1")
                warnings.warn("a warning raised on rank 1", UserWarning, stacklevel=1)
            print("after")
        out, err = capfd.readouterr()
        assert out == "after\n"
        assert "an error of rank 1" in err and "rank 1" not in err.replace("an error of rank 1", "")
        assert seen == []
        _launcher_env(monkeypatch, {"LOCAL_RANK": "0"})  # rank 0: genolong's warnings and lines shown
        with console.quiet_run(verbose=False):
            print("a line of rank 0")
            logger.warning("a warning of rank 0")
        out, err = capfd.readouterr()
        assert out == "a line of rank 0\n" and "a warning of rank 0" in err
    finally:
        logger.removeHandler(handler)


def test_library_warnings_hidden_setup_warnings_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule of genolong.console.HIDDEN_WARNINGS, warning by warning (raised as if from the
    module named)."""
    import lightning  # noqa: F401  (its UserWarning rule applies once it is imported)
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    _launcher_env(monkeypatch, {})
    cases = [  # (module it is raised in, category, shown)
        ("lightning.pytorch.utilities._pytree", FutureWarning, False),
        ("lightning.pytorch.trainer.connectors.logger_connector.result", UserWarning, False),
        ("torch.distributed.checkpoint.state_dict_loader", UserWarning, False),
        ("torch.storage", DeprecationWarning, False),
        ("lightning.pytorch.trainer.connectors.data_connector", PossibleUserWarning, True),
        ("torch.cuda", UserWarning, True),
        ("genolong.train.module", UserWarning, True),
        ("genolong.data.windows", DeprecationWarning, True),
    ]
    for module, category, shown in cases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with console.quiet_run(verbose=False):
                warnings.warn_explicit("message", category, f"{module.replace('.', '/')}.py", 1, module=module)
        assert bool(seen) is shown, (module, category)
    # Lightning's "srun is available but not used": noise outside a SLURM job, setup advice inside one
    srun = "The `srun` command is available on your system but is not used. HINT: ..."
    for job_id, shown in ((None, False), ("42", True)):
        if job_id is None:
            monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        else:
            monkeypatch.setenv("SLURM_JOB_ID", job_id)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with console.quiet_run(verbose=False):
                warnings.warn_explicit(
                    srun,
                    PossibleUserWarning,
                    "lightning/fabric/plugins/environments/slurm.py",
                    204,
                    module="lightning.fabric.plugins.environments.slurm",
                )
        assert bool(seen) is shown, job_id
