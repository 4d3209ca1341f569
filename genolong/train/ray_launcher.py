"""``genolong finetune RECIPE --launcher ray``: the same fine-tune on a Ray cluster, by Ray Train.

The command runs on the Ray driver (the head node, a ``ray job submit``, a laptop with a local
Ray): it checks the recipe and the run directory as ``genolong finetune`` does, then starts a
``ray.train.torch.TorchTrainer`` of ``parallel.devices x parallel.num_nodes`` workers (one CPU
each with gloo, or one GPU each with NCCL for ``parallel.accelerator: gpu``). Ray starts the
process group in every worker (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK; the
default group's timeout is ``parallel.timeout_s``), and each worker runs
:func:`genolong.train.finetune.run` on the same recipe, with the same ``--set`` overrides, as a
process started by torchrun would, Lightning joining it through Ray's
``RayLightningEnvironment`` (its ranks read from Ray Train's context, never from SLURM or
torchelastic variables the Ray workers may have inherited). Rank 0 writes every output, as
under the other launchers. Ray is an optional extra (``pip install 'genolong[ray]'``).

A worker that dies (a node lost, a process killed) fails the attempt; Ray Train then starts
the whole worker group again, up to ``--max-failures`` times (``FailureConfig``), and the
restarted workers resume from the newest intact checkpoint of the run
(:func:`genolong.train.preemption.auto_resume_reason`: ``GENOLONG_RAY_RESUME``). A fresh run over
a directory that already holds checkpoints is refused on the driver, as by ``genolong finetune``,
before any worker starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import GenolongError, InputError

__all__ = ["RAY_RESUME_VARIABLE", "launch", "require_ray"]

#: set in every Ray Train worker by :func:`launch`: a worker group that Ray starts again after a
#: failure resumes from the run's checkpoints (genolong.train.preemption.auto_resume_reason)
RAY_RESUME_VARIABLE = "GENOLONG_RAY_RESUME"

_INSTALL = "pip install 'genolong[ray]'"


def require_ray() -> Any:
    """The ``ray.train.torch`` module, or one line saying how to install it.

    Raises:
        InputError: Ray (with its ``train`` extra) is not installed.
    """
    try:
        import ray.train.torch as ray_torch
    except ImportError as error:
        raise InputError(f"--launcher ray needs Ray Train, which is not installed ({error}); {_INSTALL}") from None
    return ray_torch


def _worker_error(error: BaseException) -> BaseException:
    """The error that ended a Ray Train job: the lowest rank's own exception when the workers
    failed (unwrapped from Ray's task errors), a genolong error first; else ``error`` itself."""
    failures = getattr(error, "worker_failures", None) or {}
    chains: list[list[BaseException]] = []
    for rank in sorted(failures):
        chain: list[BaseException] = []
        exc: BaseException | None = failures[rank]
        while exc is not None and len(chain) < 8:  # RayTaskError(cause=...), exception chains
            chain.append(exc)
            exc = getattr(exc, "cause", None) or exc.__cause__
        chains.append(chain)
    genolong = [e for chain in chains for e in chain if isinstance(e, GenolongError)]
    if genolong:
        return genolong[0]
    return chains[0][-1] if chains and chains[0] else error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _connect_error(address: str | None, error: BaseException) -> str:
    """The one line for a Ray cluster that ``ray.init`` could not join (``address``: as given to
    ``--ray-address``, None for ``RAY_ADDRESS``): with the fix for the case seen most, a cluster
    with Ray's token authentication (on by default for ``ray start`` from Ray 2.59) joined by a
    driver without it: ``ray.init`` then fails with an ``InvalidAuthToken`` in its cause."""
    where = f"--ray-address {address}" if address else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS', '')}"
    causes, exc = [], error
    while exc is not None and len(causes) < 8:
        causes.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    text = " ".join(causes)
    if "InvalidAuthToken" in text or "AuthenticationError" in text:
        fix = (
            "the cluster uses Ray's token authentication: set RAY_AUTH_MODE=token for this command (the token from "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token, the cluster's), or use --ray-address auto on a node of the cluster"
        )
    else:
        fix = "check that a Ray cluster runs there (`ray status --address ADDRESS`) and is reachable from this machine"
    return f"{where}: cannot join the Ray cluster ({str(error).splitlines()[0] if str(error) else type(error).__name__}); {fix}"


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: ``genolong finetune RECIPE`` as one rank of the job (runs in the
    worker process; Ray has set up torch.distributed)."""
    from ray.train.lightning import RayLightningEnvironment

    from ..config import load_recipe
    from .finetune import run

    if os.path.isdir(config["cwd"]):  # relative paths of the recipe mean what they meant on the driver
        os.chdir(config["cwd"])
    os.environ[RAY_RESUME_VARIABLE] = "1"
    recipe = load_recipe(config["recipe"], config["overrides"])
    result = run(recipe, resume=config["resume"], environment=RayLightningEnvironment())
    if result.is_global_zero:
        print(result.summary(recipe.name), flush=True)


def launch(
    recipe_path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
    address: str | None = None,
    max_failures: int = 3,
) -> int:
    """Run ``genolong finetune`` on a Ray cluster (see the module docstring); returns the exit status.

    Args:
        recipe_path: the YAML recipe.
        overrides: its ``--set KEY=VALUE`` items.
        resume: ``--resume`` (continue from the newest intact checkpoint).
        address: the Ray cluster (``ray.init``'s address: ``auto``, ``ray://HOST:10001``); None:
            ``RAY_ADDRESS``, else a local Ray instance started for the job.
        max_failures: how many times Ray Train starts the worker group again after a failure.

    Raises:
        InputError: Ray is not installed, the recipe is invalid, the run directory holds
            checkpoints of a finished or other run (without ``--resume``), or ``ray.init`` cannot
            join the cluster at ``address``.
    """
    ray_torch = require_ray()
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from ..config import load_recipe
    from .finetune import RunPaths, latest_checkpoint
    from .preemption import auto_resume_reason

    recipe = load_recipe(recipe_path, overrides)
    recipe.check_paths()  # a missing store or checkpoint: one line here, not a failure of every worker
    paths = RunPaths.of(recipe)
    existing = latest_checkpoint(paths.checkpoints)
    if existing is not None and not resume and auto_resume_reason(paths.root) is None:
        raise InputError(
            f"{paths.checkpoints} already holds checkpoints ({existing.name}); pass --resume to continue "
            "that run, or set another name / checkpoint.dir"
        )
    p = recipe.parallel
    gpu = p.accelerator == "gpu"
    config = {
        "recipe": str(Path(recipe_path).resolve()),
        "overrides": list(overrides),
        "resume": resume,
        "cwd": os.getcwd(),
    }
    started_ray = not ray.is_initialized()
    if started_ray:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        except ConnectionError as error:  # no cluster there, or one that refused this client
            raise InputError(_connect_error(address, error)) from None
    try:
        trainer = ray_torch.TorchTrainer(
            _worker,
            train_loop_config=config,
            torch_config=ray_torch.TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=int(p.timeout_s)),
            scaling_config=ScalingConfig(
                num_workers=p.world_size, use_gpu=gpu, resources_per_worker={"GPU": 1} if gpu else {"CPU": 1}
            ),
            run_config=RunConfig(
                name=f"genolong-{recipe.name}",
                storage_path=str((paths.root / "ray").resolve()),
                failure_config=FailureConfig(max_failures=max_failures),
            ),
        )
        try:
            trainer.fit()
        except Exception as error:  # ray.train's TrainingFailedError: the workers' tracebacks are above
            cause = _worker_error(error)
            if isinstance(cause, GenolongError):  # the same input error on the workers: one line, status 2
                raise cause from None
            print(
                f"genolong finetune: error: the Ray Train job failed (restarts allowed: {max_failures}; the "
                f"workers' errors are above): {_first_line(cause)}",
                file=sys.stderr,
            )
            return 1
    finally:
        if started_ray:
            ray.shutdown()
    return 0
