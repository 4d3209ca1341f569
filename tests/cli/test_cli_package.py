"""The command line as a package (issue 48): one module per command, the ``parallel`` section of
the scoring commands checked by the recipe layer's schema, ``--kernel-backend`` from the kernel
registry. Fast: nothing here loads torch or a model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import genolong.cli as cli
from genolong.cli.common import backend_choices
from genolong.cli.scoring import parallel_from_sets
from genolong.config import ParallelSection
from genolong.errors import InputError
from genolong.kernels import backends

CLI = Path(cli.__file__).parent


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{command: its parser}`` of the ``genolong`` parser, in the order ``--help`` lists them."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_of_the_registry_is_a_subcommand_that_runs_its_module() -> None:
    parsers = _subparsers(cli.build_parser())
    assert list(parsers) == [c.name for c in cli.COMMANDS]
    assert len({c.name for c in cli.COMMANDS}) == len(cli.COMMANDS) == 13
    for command in cli.COMMANDS:
        assert parsers[command.name].get_default("func") is command.run, command.name


def test_no_module_of_the_command_line_is_over_400_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in CLI.glob("*.py")}
    assert "evaluate.py" in sizes and "common.py" in sizes
    assert max(sizes.values()) <= 400, sizes


def test_kernel_backend_choices_are_the_registry_with_auto_first(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_choices() == ("auto", "torch", "fla", "triton")
    # a backend registered later (a plugin, or one added to kernels/backends.py) is a choice without an edit here
    monkeypatch.setitem(backends._LOADERS, "mine", backends._torch_backend)
    assert backend_choices() == ("auto", "torch", "fla", "triton", "mine")
    parsers = _subparsers(cli.build_parser())
    for name in ("evaluate", "probe", "check-logprobs", "variants"):
        option = next(a for a in parsers[name]._actions if "--kernel-backend" in a.option_strings)
        assert tuple(option.choices or ()) == ("auto", "torch", "fla", "triton", "mine"), name
        assert option.default is None


def test_parallel_sets_take_the_section_s_own_values() -> None:
    assert parallel_from_sets([]) == ParallelSection()
    section = parallel_from_sets(
        [
            "parallel.devices=2",
            "parallel.cp=2",
            "parallel.accelerator=cpu",
            "parallel.timeout_s=7",
            "parallel.devices=4",
        ]
    )
    assert (section.devices, section.cp, section.accelerator, section.world_size) == (
        4,
        2,
        "cpu",
        4,
    )  # the last item wins
    assert isinstance(section.timeout_s, float) and section.timeout_s == 7.0  # whole seconds held as a number
    assert parallel_from_sets(["parallel.timeout_s=0.5"]).timeout_s == 0.5


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            "train.lr=1",
            "without --recipe only the parallel section can be set, one of parallel.accelerator, "
            "parallel.devices, parallel.num_nodes, parallel.cp, parallel.dp_shard, parallel.dp_replicate, "
            "parallel.ep, parallel.timeout_s",
        ),
        ("parallel.gpus=2", "without --recipe only the parallel section can be set, one of parallel.accelerator"),
        ("parallel.accelerator=tpu", "parallel.accelerator is one of cpu, gpu, cuda, auto"),
        ("parallel.accelerator=1", "parallel.accelerator is one of cpu, gpu, cuda, auto"),
        ("parallel.devices=x", "parallel.devices must be an integer"),
        ("parallel.cp=2.0", "parallel.cp must be an integer"),
        ("parallel.ep=true", "parallel.ep must be an integer"),
        ("parallel.dp_shard=null", "parallel.dp_shard must be an integer"),
        ("parallel.timeout_s=0", "parallel.timeout_s must be a number of seconds > 0"),
        ("parallel.timeout_s=-1.5", "parallel.timeout_s must be a number of seconds > 0"),
        ("parallel.timeout_s=true", "parallel.timeout_s must be a number of seconds > 0"),
        ("parallel.timeout_s=.nan", "parallel.timeout_s must be a number of seconds > 0"),
        ("parallel.timeout_s='30'", "parallel.timeout_s must be a number of seconds > 0"),
    ],
)
def test_a_bad_parallel_set_is_one_line_naming_the_item(item: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        parallel_from_sets(["parallel.devices=2", item])
    text = str(info.value)
    assert text.startswith(f"--set {item!r}: {message}") and "\n" not in text, text


def test_an_infinite_timeout_is_a_one_line_error_not_a_traceback() -> None:
    # the section refuses inf (allow_inf_nan=False): a --set item now says so in one line, where the
    # checks copied into the command line let it through to a pydantic traceback
    with pytest.raises(
        InputError, match=r"^--set 'parallel.timeout_s=.inf': parallel.timeout_s must be a number of seconds > 0$"
    ):
        parallel_from_sets(["parallel.timeout_s=.inf"])


def test_the_scoring_commands_report_a_bad_parallel_set_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # through main: the error is the command's one line with exit code 2, before any model or store is read
    for command in (
        ["evaluate", "m", "--store", "s", "--context", "128"],
        ["probe", "m", "--store", "s", "--context", "128"],
        ["check-logprobs", "m", "--store", "s", "--context", "64", "--out", str(tmp_path / "x")],
    ):
        assert cli.main([*command, "--set", "parallel.timeout_s=0"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"genolong {command[0]}: error: --set 'parallel.timeout_s=0': "
            "parallel.timeout_s must be a number of seconds > 0\n"
        ), err


def test_log_lines_follow_the_stderr_of_the_moment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """genolong's log handler writes to the ``sys.stderr`` of each record, not to the one it was
    made under: a handler made under a capture that is closed later would make every later log
    line an "I/O operation on closed file" error (seen under pytest-xdist)."""
    import io
    import logging

    logger = logging.getLogger("genolong")
    kept, level = list(logger.handlers), logger.level
    logger.handlers.clear()
    try:
        first = io.StringIO()
        with monkeypatch.context() as m:
            m.setattr("sys.stderr", first)
            cli._setup_logging()  # made while sys.stderr is `first`
            logger.info("into the first stream")
        assert first.getvalue() == "into the first stream\n"
        first.close()
        logger.info("after the first stream closed")
        captured = capsys.readouterr().err
        assert "after the first stream closed" in captured and "closed file" not in captured
    finally:
        logger.handlers[:] = kept
        logger.setLevel(level)
