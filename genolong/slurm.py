"""``genolong finetune`` under SLURM: the job's task layout checked against the recipe before
torch is imported (a wrong layout costs a second, not the start-up), and the partial save a kill
left behind named when the run resumes. Imports nothing heavy.

What SLURM itself does with the job (signals, requeues, kills, the exit codes it records) is in
docs/scale-out.md ("SLURM"); the job script the tests run is docs/slurm/finetune.sbatch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .config import ParallelSection, Recipe, load_recipe
from .errors import InputError

__all__ = ["TaskLayoutError", "check_task_layout", "load_job_recipe", "partial_saves"]


class TaskLayoutError(InputError):
    """The SLURM job's tasks disagree with the recipe's ``parallel.devices`` x ``num_nodes``. Every
    rank raises it (each exits 2); ``show`` is true on one (``SLURM_PROCID`` 0), which prints it."""

    def __init__(self, message: str, show: bool = True):
        super().__init__(message)
        self.show = show


def _slurm_launched(environ: Mapping[str, str]) -> bool:
    """Lightning takes this process for SLURM's (``SLURMEnvironment.detect``): ``SLURM_NTASKS`` set,
    a job not named ``bash`` / ``interactive``, and no torchrun around it (torchrun's own variables
    take precedence in Lightning)."""
    if "SLURM_NTASKS" not in environ or environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return False
    return not ("TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ)


def check_task_layout(parallel: ParallelSection, environ: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`TaskLayoutError` when this process runs in a SLURM job (as Lightning sees it)
    whose layout is not the recipe's: ``--ntasks=N`` without ``--ntasks-per-node`` (Lightning
    refuses it), tasks per node other than ``parallel.devices``, nodes other than
    ``parallel.num_nodes``, or the tasks of an ``srun`` missing (the batch script's own shell
    running a multi-task job's command). The message names both layouts and the ``#SBATCH`` line
    that fits the recipe. Nothing is checked outside SLURM."""
    if not _slurm_launched(environ):
        return
    devices, nodes = parallel.devices, parallel.num_nodes
    ntasks = int(environ.get("SLURM_NTASKS", "1"))
    per_node = environ.get("SLURM_NTASKS_PER_NODE")
    nnodes = int(environ.get("SLURM_NNODES", "1"))
    recipe = f"the recipe runs parallel.devices={devices} x parallel.num_nodes={nodes} processes"
    fix = (
        f"put `#SBATCH --nodes={nodes} --ntasks-per-node={devices}` in the job script and start genolong with "
        f"`srun` (docs/slurm/finetune.sbatch), or set parallel.devices / parallel.num_nodes to the job's layout"
    )
    if ntasks > 1 and per_node is None:
        job = f"--ntasks={ntasks} without --ntasks-per-node"
    elif per_node is not None and per_node.split("(")[0] != str(devices):
        # SLURM_NTASKS_PER_NODE: "2", or "2(x3)" for 3 nodes of 2
        job = f"--ntasks-per-node={per_node.split('(')[0]}"
    elif nnodes != nodes:
        job = f"--nodes={nnodes}"
    elif ntasks > 1 and "SLURM_STEP_ID" not in environ:
        job = f"{ntasks} tasks, but this process is the batch script's, not one of srun's tasks"
    else:
        return
    show = environ.get("SLURM_PROCID", "0") == "0"
    raise TaskLayoutError(f"the SLURM job's tasks ({job}) do not match the recipe: {recipe}; {fix}", show=show)


def load_job_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """``genolong finetune``'s recipe (:func:`genolong.config.load_recipe`), checked against the
    SLURM job's tasks (:func:`check_task_layout`) before torch is imported."""
    recipe = load_recipe(path, overrides)
    check_task_layout(recipe.parallel)
    return recipe


def partial_saves(directory: Path) -> list[Path]:
    """The ``step*.ckpt.tmp`` a killed save left in ``directory`` (SIGKILL after ``KillWait``), which
    a resumed run ignores (:func:`genolong.train.finetune.latest_checkpoint`) and the next save of
    that step replaces."""
    return sorted(directory.glob("step*.ckpt.tmp")) if directory.is_dir() else []
