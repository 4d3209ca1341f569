"""``genolong export RUN|CKPT``: the exports of a finetune run's step checkpoint.

The checkpoint is restored with the code ``--resume`` uses (:func:`export_from_checkpoint`: the
Lightning module built as the run builds it, Lightning's restore through
:class:`genolong.train.finetune.AtomicModelParallelStrategy`, in a ``fit`` that trains no batch),
then written by :func:`genolong.train.export.write_exports`, the code ``finetune`` runs at its end:
each rank its own shards. Under torchrun (or srun) every rank takes part on the recipe's mesh;
otherwise one process restores the checkpoint, a multi-process run's sharded one included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError
from .export import release_offload_pool, write_exports

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment

    from ..config import Recipe

__all__ = ["export_command", "export_from_checkpoint", "resolve_target"]


def export_from_checkpoint(
    recipe: Recipe,
    checkpoint: Path,
    out: Path,
    model_export: bool | None = None,
    adapter_export: bool | None = None,
    environment: ClusterEnvironment | None = None,
) -> tuple[Path | None, Path | None, bool]:
    """Restore a run's step checkpoint and write its exports into ``out`` (``out/export``,
    ``out/adapter``: :func:`write_exports`), on this process or on the recipe's mesh (every rank
    calls; Lightning joins torchrun's ranks). The trained state comes back through the code
    ``--resume`` uses: the module built as the run builds it, then Lightning's restore of the
    checkpoint (:meth:`genolong.train.finetune.AtomicModelParallelStrategy.load_checkpoint`) in a ``fit`` that trains no
    batch; no data store is opened. One process restoring a multi-process run's sharded checkpoint
    reads its model state whole (not its optimiser states, which an export does not need).

    Returns:
        (adapter directory, export directory, is rank 0); the directories None where not written.

    Raises:
        InputError: the checkpoint is damaged or does not fit the recipe's model.
    """
    from ..console import quiet_run
    from .finetune import AtomicModelParallelStrategy, RunPaths, _module, _trainer, leaves_no_process_group

    with leaves_no_process_group(), quiet_run():
        config = recipe.model_config()
        module = _module(recipe, recipe.vocab_map(config), resume=True)  # the trained weights come from the checkpoint
        trainer = _trainer(
            recipe,
            RunPaths.of(recipe),
            [],
            environment,
            logger=False,
            limit_train_batches=0,
            limit_val_batches=0,
            val_check_interval=None,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=out,
        )
        strategy = trainer.strategy
        assert isinstance(strategy, AtomicModelParallelStrategy)
        strategy.weights_for_export = True
        # the restore --resume runs (model, optimiser, loops); limit_train_batches=0: no batch, no data
        trainer.fit(module, train_dataloaders=[], ckpt_path=checkpoint, weights_only=True)
        assert module.model is not None
        release_offload_pool(module.model)
        adapter, export = write_exports(recipe, module.model, out, model_export, adapter_export)
        trainer.strategy.barrier("genolong_export")
        return adapter, export, trainer.is_global_zero


#: the recipe keys ``genolong export`` sets to restore a run's checkpoint in one process
_ONE_PROCESS = (
    "parallel.devices=1",
    "parallel.num_nodes=1",
    "parallel.cp=1",
    "parallel.dp_shard=-1",
    "parallel.dp_replicate=1",
    "parallel.ep=1",
)


def _launched() -> bool:
    """Whether this process is one rank of a job a launcher started (torchrun, SLURM's srun)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ or "SLURM_NTASKS" in os.environ


def resolve_target(target: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(run directory, checkpoint) of ``genolong export``'s ``RUN|CKPT``: a run directory (its
    newest intact checkpoint) or one ``step*.ckpt`` of it (``RUN/checkpoints/stepN.ckpt``).

    Raises:
        InputError: neither, or a run without an intact checkpoint (one line naming it).
    """
    from .finetune import _STEP_FILE, intact_checkpoint

    path = Path(target)
    if _STEP_FILE.match(path.name) and path.exists():
        root = path.parent.parent
        if not (root / "recipe.yaml").is_file():
            raise InputError(
                f"{path}: no recipe.yaml in {root}; give a checkpoint of a finetune run "
                "(runs/NAME/checkpoints/stepN.ckpt) or the run directory"
            )
        from ..integrity import check_weights

        # the ranks of a job check the sizes here, each its own shard's checksums on load (as --resume)
        check_weights(path, shards=(0, 0) if _launched() else None)
        return root, path
    if not (path / "recipe.yaml").is_file():
        raise InputError(
            f"{path}: not a finetune run directory (no recipe.yaml) nor a step*.ckpt of one; "
            "give runs/NAME or runs/NAME/checkpoints/stepN.ckpt"
        )
    from ..config import load_recipe
    from .finetune import RunPaths

    checkpoints = RunPaths.of(load_recipe(path / "recipe.yaml")).checkpoints
    found = intact_checkpoint(checkpoints, hash_shards=not _launched())
    if found is None:
        raise InputError(f"{path}: no checkpoint in {checkpoints}; the run saved none (checkpoint.every_n_steps)")
    return path, found


def export_command(
    target: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    merged: bool = False,
    adapter: bool = False,
) -> int:
    """``genolong export RUN|CKPT [--merged] [--adapter] [--out DIR]``: the exports of a run's step
    checkpoint, as ``finetune`` writes them at its end (:func:`genolong.train.finetune.write_exports`),
    into ``DIR/export`` (the model; adapters merged under LoRA) and ``DIR/adapter`` (PEFT, under
    LoRA). Default DIR: ``RUN/exports/stepN``. ``merged``: the model only; ``adapter``: the adapter
    only; neither: both. Under torchrun (or srun) every rank runs this on the recipe's mesh and
    writes its own shards; otherwise one process restores the checkpoint (sharded ones too).
    Prints one line on rank 0; returns the exit status (0).

    Raises:
        InputError: see :func:`resolve_target`; ``adapter`` for a run without ``model.lora``.
    """
    from ..config import load_recipe

    root, checkpoint = resolve_target(target)
    recipe = load_recipe(root / "recipe.yaml", () if _launched() else _ONE_PROCESS)
    if adapter and not merged and recipe.model.lora is None:
        raise InputError(f"--adapter: {root} trained no LoRA adapters (model.lora is not set); drop --adapter")
    model_export = merged or not adapter
    adapter_export = recipe.model.lora is not None and (adapter or not merged)
    destination = Path(out) if out is not None else root / "exports" / checkpoint.stem
    written_adapter, written_model, is_zero = export_from_checkpoint(
        recipe, checkpoint, destination, model_export=model_export, adapter_export=adapter_export
    )
    if is_zero:
        written = [str(p) for p in (written_model, written_adapter) if p is not None]
        print(f"genolong export: {checkpoint.name} of {root.name} -> {', '.join(written)}", flush=True)
    return 0
