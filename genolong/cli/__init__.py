"""The ``genolong`` command line: each subcommand parses its arguments and calls one function.

User errors (:class:`genolong.errors.GenolongError`) print as one line on stderr with exit code 2;
Ctrl-C exits with 130; a run stopped by a signal at a safe point (SIGTERM, SIGUSR1: preemption, a
time limit; :class:`genolong.errors.Stopped`) prints one line and exits with 75. Anything else is
a bug and keeps its traceback.

The package, one module per command (its parser and its run), plus what they share:

- ``common``: the :class:`~genolong.cli.common.Command` record and the arguments several parsers
  take (``--recipe`` / ``--set`` for the processes, ``--kernel-backend`` from the kernel registry,
  what to score, ``--by``, ``--verbose``).
- ``scoring``: the steps the scoring commands share (the ``parallel`` section, checked by the
  recipe layer's schema; the kernel backend; the context; the model each process loads).
- ``prepare``, ``finetune``, ``plan``, ``evaluate``, ``probe``, ``variants``, ``compare``,
  ``plot``, ``tracks``, ``check_logprobs``, ``quickstart``, ``recipe``: the commands, in the order
  ``genolong --help`` lists them (:data:`COMMANDS`).

A new command is a module here with an ``add(sub)`` that adds its parser (imports nothing heavy:
``genolong --help`` loads no torch, tests/cli/test_cli_startup.py), a ``run(args) -> int`` that imports
what it needs inside, and ``COMMAND = Command("name", add, run)`` (``model=True`` when it runs a
model); then one import and one entry in :data:`COMMANDS` below.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..allocator import keep_freed_memory
from ..errors import PREEMPTED_EXIT_CODE, GenolongError, Stopped
from ..signals import catch_from_start, ignore_from_now
from . import (
    check_logprobs,
    compare,
    evaluate,
    export,
    finetune,
    plan,
    plot,
    prepare,
    probe,
    quickstart,
    recipe,
    tracks,
    variants,
)
from .common import Command

__all__ = ["COMMANDS", "build_parser", "entry", "main"]

#: every subcommand, in the order ``genolong --help`` lists them: add a new command's ``COMMAND`` here
COMMANDS: tuple[Command, ...] = (
    prepare.COMMAND,
    finetune.COMMAND,
    export.COMMAND,
    plan.COMMAND,
    evaluate.COMMAND,
    probe.COMMAND,
    variants.COMMAND,
    compare.COMMAND,
    plot.COMMAND,
    tracks.COMMAND,
    check_logprobs.COMMAND,
    quickstart.COMMAND,
    recipe.COMMAND,
)
_BY_NAME = {command.name: command for command in COMMANDS}

#: ``genolong --help``: what the tool does, for a user (the module docstring is for developers)
_DESCRIPTION = """\
Fine-tune DNA language models at long context (up to a million bases) on human
chromosomes, and measure what the longer context buys."""
_EPILOG = """\
typical order:
  genolong quickstart                  the whole story on a bundled human sample, on a CPU (minutes)
  genolong prepare GENOME.fa.gz --out STORE
                                       encode chromosomes once into a genome store
  genolong plan RECIPE.yaml            check that a training recipe fits your GPUs' memory
  genolong finetune RECIPE.yaml        train; the model is saved under runs/NAME/
  genolong evaluate runs/NAME --store STORE
                                       held-out loss by how much context each base had
  genolong compare A_DIR B_DIR         change in loss between two evaluations, with intervals
  genolong plot A_DIR B_DIR --out FIGURES
                                       figures from evaluations

Run `genolong COMMAND --help` for a command's options; recipes/ holds example recipes."""


class _VersionAction(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata is slow to import)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        default: str = argparse.SUPPRESS,
        help: str | None = None,
    ) -> None:  # noqa: A002 - argparse's keyword
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from .. import __version__

        print(f"genolong {__version__}")  # on stdout, as argparse's own version action prints
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand (:data:`COMMANDS`); ``args.func`` is the command's run."""
    parser = argparse.ArgumentParser(
        prog="genolong", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction, help="print genolong's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub).set_defaults(func=command.run)
    return parser


class _StderrHandler(logging.Handler):
    """Writes each record to whatever ``sys.stderr`` is when it is emitted, not to the stream that
    was ``sys.stderr`` when the handler was made (``logging.StreamHandler``): ``main`` called as a
    library (a notebook, a test capturing output) would otherwise leave a handler on a stream that
    is closed later ("I/O operation on closed file" in a later command's output)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's own rule: a failing handler reports and carries on
            self.handleError(record)


def _setup_logging() -> None:
    """genolong's own log lines (checkpoint loading, kernel backend) on stderr, once."""
    logger = logging.getLogger("genolong")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _shards_for_memory(args: argparse.Namespace) -> bool:
    """A scoring command that runs on several processes (its ``--recipe`` / ``--set parallel.*``
    layout): it shards the model to fit memory, so it keeps glibc's allocator. With the kept-freed
    heap, FSDP2's gather / free of one block after another grows every rank's heap back to about the
    whole model's footprint: 4 CPU ranks (cp 2 x dp_shard 2) peaked at 0.98x one process's RSS above
    the imports, 0.48x with glibc's defaults (benchmarks/evaluate_memory.py)."""
    if not _BY_NAME[args.command].scoring or not hasattr(args, "set"):
        return False
    from .scoring import parallel_section  # when a command runs, not for --help

    return parallel_section(args).world_size > 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``genolong`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for provenance (genolong variants)
    _setup_logging()
    from ..console import set_verbose

    set_verbose(getattr(args, "verbose", False))
    try:
        if _BY_NAME[args.command].model and not _shards_for_memory(args):
            # before torch allocates anything: freed activations are reused, not faulted in anew
            # (genolong.allocator; GENOLONG_MALLOC=system opts out)
            keep_freed_memory()
        return int(args.func(args))
    except GenolongError as exc:
        if getattr(exc, "show", True):  # False: another rank of the job prints it (genolong.slurm)
            print(f"genolong {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:  # a signal, at a safe point: the work so far is saved; not finished
        if exc.show:
            print(f"genolong {args.command}: {exc}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        print(f"genolong {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # whoever read the output went away (`genolong plan RECIPE | head`): stop without a
        # traceback, with the status a command killed by SIGPIPE has (as cat's), and point stdout
        # at /dev/null so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except Exception as exc:
        # a full disk or a file-size limit outside genolong's writers (which name their output:
        # genolong.files.writing), e.g. a log file: one line too. A file-size limit reaches here as
        # EFBIG because CPython ignores SIGXFSZ (whose default action would kill the process).
        from ..files import full_disk_error

        error = full_disk_error(exc)
        if error is None:
            raise
        print(f"genolong {args.command}: error: {error}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The ``genolong`` console script (and ``python -m genolong.cli``): :func:`main` with this
    process's arguments, then exit with its code.

    A process that is still a rank of a torch.distributed job at the end (the processes Lightning,
    torchrun or SLURM start for a multi-process ``finetune`` / ``evaluate`` / ``variants``) exits
    through :func:`genolong.parallel.shutdown.exit_process`, without the interpreter's finalization,
    where gloo's worker threads can abort a run whose work is done; so does a stopped one (75, SLURM's KillWait)."""
    if sys.argv[1:2] == ["finetune"]:  # a stop signal before training stops it too (genolong.signals)
        catch_from_start()
    code = main()
    ignore_from_now()  # the status is decided: a late stop signal must not change it
    from ..parallel.shutdown import exit_process, in_process_group

    if in_process_group() or code == PREEMPTED_EXIT_CODE:  # stopped: out before SLURM's KillWait ends
        exit_process(code)
    sys.exit(code)
