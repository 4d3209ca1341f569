"""``genolong finetune``: train as a recipe says (:func:`genolong.train.finetune.run`), in this
process and the ranks Lightning, torchrun or SLURM start, or on a Ray cluster
(:mod:`genolong.train.ray_launcher`)."""

from __future__ import annotations

import argparse

from .common import Command, Subcommands, set_argument, verbose_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``finetune`` to the subcommands and return its parser."""
    tune = sub.add_parser(
        "finetune",
        help="train the model on a genome store, as a YAML recipe says; results in runs/NAME/",
        description=(
            "Fine-tune (or train from scratch) the model (GLM-5.3-Flash architecture: linear attention, sparse "
            "attention and mixture-of-experts layers) on windows of a genome store, with the recipe's memory "
            "settings, on one or more CPUs or GPUs; checkpoints, logs and the exported model go to runs/NAME/."
        ),
    )
    tune.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/)")
    set_argument(tune, "override a recipe key, e.g. --set train.max_steps=20 (repeatable)")
    tune.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint of this run (a run stopped by a signal, or its requeued "
        "SLURM job, resumes without it)",
    )
    tune.add_argument(
        "--launcher",
        choices=("lightning", "ray"),
        default="lightning",
        help="lightning (default): this process is the job, or one rank of it (Lightning starts the "
        "others, or joins torchrun's / SLURM's); ray: start the job's parallel.devices x "
        "parallel.num_nodes ranks as Ray Train workers on a Ray cluster (pip install "
        "'genolong[ray]'; docs/scale-out.md)",
    )
    tune.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="with --launcher ray: the Ray cluster (auto, ray://HOST:10001; default RAY_ADDRESS, else a local Ray)",
    )
    tune.add_argument(
        "--max-failures",
        type=int,
        default=3,
        metavar="N",
        help="with --launcher ray: start the workers again up to N times after a failure; they resume "
        "from the newest intact checkpoint (default: %(default)s)",
    )
    tune.epilog = (
        "exit status: 0 finished; 2 an error in the input (one line); 75 stopped by a signal of "
        "train.stop_signals (default SIGTERM, SIGUSR1: preemption, a time limit) after writing the "
        "checkpoint of the step it was in (one line names it); under SLURM, SIGUSR1 (--signal=USR1@N) also "
        "requeues the job. A SLURM job script (the tests run it): docs/slurm/finetune.sbatch; docs/scale-out.md."
    )
    verbose_argument(tune)
    return tune


def run(args: argparse.Namespace) -> int:
    """Run ``genolong finetune``: one line of summary from the job's rank 0."""
    if args.launcher == "ray":
        from ..train.ray_launcher import launch

        return launch(
            args.recipe, args.set, resume=args.resume, address=args.ray_address, max_failures=args.max_failures
        )
    from ..slurm import load_job_recipe

    recipe = load_job_recipe(args.recipe, args.set)  # a SLURM job's tasks checked before torch loads
    from ..train.finetune import run as train

    result = train(recipe, resume=args.resume)
    if result.is_global_zero:  # one line for the job, not one per process
        print(result.summary(recipe.name))
    return 0


COMMAND = Command("finetune", add, run, model=True)
