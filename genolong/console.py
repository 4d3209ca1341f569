"""What a command that runs a model prints: genolong's own lines, one progress bar per stage, and
warnings about the user's own setup; Lightning's and torch's chatter only with ``--verbose``.

The one place that decides it. :func:`quiet_run` wraps the work of ``finetune`` (and the
quickstart's fine-tuning), of ``evaluate`` / ``probe`` / ``check-logprobs`` (around
:func:`genolong.evaluation.distributed.launch`) and of the whole ``quickstart``; the command line
sets :func:`set_verbose` from ``--verbose``. Inside it, unless verbose:

- the loggers of Lightning (``lightning.pytorch``, ``lightning.fabric``, ``pytorch_lightning``,
  ``lightning_fabric``) and of ``torch.distributed`` show warnings and errors only: no "GPU
  available / TPU available" lines, no advertisement tips, no "Initializing distributed" /
  "distributed_backend=gloo" banner, no ``limit_val_batches`` or "``Trainer.fit`` stopped" lines
  (all ``rank_zero_info`` / ``log.info`` in Lightning);
- Python warnings raised *inside* those libraries about their own API are hidden; warnings about
  the user's setup are kept (the rule is spelled out at :data:`HIDDEN_WARNINGS`);
- in a multi-process job every rank but global rank 0 prints errors only: its standard output
  goes nowhere, its loggers (genolong's included) show errors, its warnings are dropped. Errors are
  exceptions and still reach stderr (as one line through the command line, or a traceback).

With ``--verbose`` nothing is changed: Lightning's own defaults, every rank.

This module imports neither torch nor Lightning (the command line imports it to set the flag).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

__all__ = ["HIDDEN_WARNINGS", "LIBRARY_LOGGERS", "is_rank_zero", "quiet_run", "set_verbose", "verbose"]

#: the loggers quietened to WARNING on rank 0 (ERROR on the other ranks)
LIBRARY_LOGGERS = (
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "lightning_fabric",
    "torch.distributed",
)

_LIBRARIES = r"(lightning|pytorch_lightning|lightning_fabric|lightning_utilities|torch)(\.|$)"
_LIGHTNING = r"(lightning|pytorch_lightning|lightning_fabric|lightning_utilities)(\.|$)"

#: ``(category, module regex)`` of the warnings hidden unless ``--verbose``. A warning is judged
#: by the module it is attributed to (where it is raised) and its category:
#:
#: - deprecations (``DeprecationWarning``, ``PendingDeprecationWarning``, ``FutureWarning``, and
#:   Lightning's ``LightningDeprecationWarning``) raised inside Lightning or torch: their own API
#:   changing under them (e.g. Lightning's ``_pytree`` calling torch's deprecated ``LeafSpec``);
#:   nothing a genolong user calls or can change;
#: - ``UserWarning`` raised inside Lightning: its comments on how genolong drives it (epoch-level
#:   logging in a distributed setting, a checkpoint directory that is not empty on ``--resume``);
#: - ``UserWarning`` raised inside ``torch.distributed``: collective and checkpoint internals
#:   ("torch.distributed is disabled", FSDP / DCP state-dict notices).
#:
#: Kept: every warning raised in genolong or in the user's own code; Lightning's
#: ``PossibleUserWarning``, its own category for warnings about the user's data and machine (too
#: few data loader workers for the CPUs, a logging interval longer than the epoch, ``srun``
#: available but not used, inside a SLURM job only); torch's other warnings (the GPU and its driver in ``torch.cuda``,
#: data loader worker counts in ``torch.utils.data``). Misconfigurations such as ``num_nodes``
#: not matching SLURM's or torchrun's world are errors, never hidden.
HIDDEN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (DeprecationWarning, _LIBRARIES),
    (PendingDeprecationWarning, _LIBRARIES),
    (FutureWarning, _LIBRARIES),
    (UserWarning, _LIGHTNING),
    (UserWarning, r"torch\.distributed(\.|$)"),
)

#: Lightning's warning that ``srun`` is installed but the process was not started by it: kept
#: inside a SLURM job (``SLURM_JOB_ID`` set), hidden outside one
_SRUN_NOT_USED = r"The `srun` command is available on your system but is not used"

_verbose = False


def set_verbose(flag: bool) -> None:
    """Set ``--verbose`` for this process (the command line calls it once, before the command)."""
    global _verbose
    _verbose = bool(flag)


def verbose() -> bool:
    """Whether ``--verbose`` was given."""
    return _verbose


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 of its job (True in one process).

    Once ``torch.distributed`` is initialised, its rank. Before (the processes of a job start the
    command from the beginning), the launcher's environment, in Lightning's order: ``RANK``
    (torchrun), then ``LOCAL_RANK`` with ``NODE_RANK`` / ``GROUP_RANK`` (the processes Lightning
    starts itself; torchrun), then ``SLURM_PROCID`` (srun; checked last because it is also set in
    an allocation that runs one process).
    """
    dist = sys.modules.get("torch.distributed")  # never imported here: only if the command already did
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    rank = _int_env("RANK")
    if rank is not None:
        return rank == 0
    local = _int_env("LOCAL_RANK")
    if local is not None:
        node = _int_env("NODE_RANK")
        node = _int_env("GROUP_RANK") if node is None else node
        return local == 0 and not node
    procid = _int_env("SLURM_PROCID")
    return procid is None or procid == 0


def _hide_library_warnings() -> None:
    """Install :data:`HIDDEN_WARNINGS` (in front of the filters in force: they win), keeping
    Lightning's ``PossibleUserWarning``.

    Lightning's ``UserWarning`` rule is installed only once Lightning is imported, together with
    the exception for ``PossibleUserWarning`` (a subclass: matched first, being inserted last);
    importing Lightning here would cost a scoring command in one process, which never uses it,
    half a second. The entry points that import Lightning later enter :func:`quiet_run` again
    after importing it.
    """
    lightning = sys.modules.get("lightning.fabric.utilities.warnings")
    for category, module in HIDDEN_WARNINGS:
        if module != _LIGHTNING or category is not UserWarning or lightning is not None:
            warnings.filterwarnings("ignore", category=category, module=module)
    if lightning is not None:
        warnings.filterwarnings("default", category=lightning.PossibleUserWarning)
    if "SLURM_JOB_ID" not in os.environ:
        # outside a SLURM job, "srun is available but not used" says only that SLURM's client is
        # installed on the machine (twice per command); inside a job it is about the user's setup
        warnings.filterwarnings("ignore", message=_SRUN_NOT_USED)


@contextlib.contextmanager
def quiet_run(verbose: bool | None = None) -> Iterator[None]:
    """The block prints as the module docstring says; everything is restored on exit (logger
    levels, warning filters, standard output). Nests.

    Args:
        verbose: change nothing (default None: :func:`verbose`, the ``--verbose`` flag).
    """
    if _verbose if verbose is None else verbose:
        yield
        return
    zero = is_rank_zero()
    names = LIBRARY_LOGGERS if zero else (*LIBRARY_LOGGERS, "genolong")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        if zero:
            _hide_library_warnings()
        else:
            warnings.simplefilter("ignore")
            devnull = stack.enter_context(open(os.devnull, "w"))
            stack.enter_context(contextlib.redirect_stdout(devnull))
        for logger in loggers:
            logger.setLevel(logging.WARNING if zero else logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
