"""``genolong finetune RECIPE``: build the model, data, strategy, loggers and checkpoints; train.

Run directory layout (``runs/<name>/`` unless the recipe says otherwise)::

    recipe.yaml            the resolved recipe (every key; paths absolute)
    checkpoints/           step0000020.ckpt ... (Lightning; written atomically, the last
                           ``checkpoint.keep_last`` kept), including the window sampler position;
                           in a multi-process run each is a directory of shards (DCP + meta.pt)
    logs/steps.jsonl       one record per training batch (flushed as written) and per evaluation
    logs/csv/metrics.csv   Lightning CSV logger;  logs/tensorboard/  TensorBoard event files
    adapter/               with ``model.lora``: the trained adapters in the PEFT format
                           (adapter_config.json + adapter_model.safetensors)
    export/                the final model in the GLM-5.3-Flash format (config.json + safetensors);
                           with ``model.lora`` the adapters merged into the base weights; written by
                           every rank, each its own shards (:mod:`genolong.train.export`; the same
                           code writes ``genolong export``'s, from a step checkpoint:
                           :func:`genolong.train.export_run.export_from_checkpoint`)

A signal of ``train.stop_signals`` (default SIGTERM, SIGUSR1: preemption, a time limit) ends the
step in progress on every rank, writes that step's checkpoint, and exits with status 75 after one
line naming it (:mod:`genolong.train.preemption`); under SLURM, SIGUSR1 also requeues the job.
Started again (or requeued), such a run resumes by itself, without ``--resume``.

With ``checkpoint.async_save`` a save copies the step's state to host memory and a background
thread writes it (:mod:`genolong.train.async_checkpoint`): the same checkpoint, at most one in
flight, the last one complete before the export and before :func:`run` returns; a failed write is
raised at the next step boundary (one process) or the next save (a job). In a multi-process run
each rank hashes its own shard for the manifest, and checks its own shard on resume.

``--resume`` continues from the newest intact checkpoint in ``checkpoints/`` (each is checked
against the checksum manifest written with it; a damaged newer one is named on stderr): the model, optimiser,
schedule, loop counters, MoE routing biases and the window stream, so the losses of the steps that
follow equal those of an uninterrupted run (CPU, deterministic). Checkpoints load with
``weights_only=True``: nothing in them is unpickled as code. A run from a base checkpoint
(``model.checkpoint``) saves what training changes (trained parameters, their optimiser state,
adapters, buffers, RNG, data position) and the base's path and digest; ``--resume`` checks the
digest and reads the frozen weights from the base again (:mod:`genolong.train.base`). A run from
a preset's fresh weights saves the whole model.

The model of a run from a base is built on the meta device and parallelized, then each rank
allocates and reads only its own shards (:mod:`genolong.parallel.load`).

In a ``bf16-mixed`` run the frozen parameters (``model.freeze``, or every base weight under
``model.lora``) are stored in bf16 where that leaves the forward unchanged
(:func:`genolong.train.module.cast_frozen_parameters`): checkpoints and the export hold them in
bf16, everything trained in fp32.

Processes: ``parallel.devices x parallel.num_nodes``, started by Lightning, or by torchrun / SLURM
(Lightning joins them); the module builds the ``(dp_replicate, dp_shard, cp)`` mesh and applies
context parallelism, expert parallelism (``parallel.ep``: the routed experts spread over ``ep``
consecutive ranks, checkpoints and the export in the one-process layout) and FSDP2
(:mod:`genolong.train.module`, :func:`genolong.parallel.parallelize`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
import shutil
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config import Recipe
from ..config.schema import LoraSection
from ..console import is_rank_zero, quiet_run
from ..data.alphabet import STORE_ALPHABET
from ..data.datamodule import GenomeDataModule
from ..data.repeats import RepeatPlanting
from ..data.store import GenomeStore
from ..errors import InputError, Stopped
from ..files import fsync, fsync_tree, writing
from ..integrity import DamagedFileError, check_weights, remove_manifest, shard_entries, write_manifest
from ..model.lm import GenoLM
from ..model.vocab import VocabMap
from ..parallel import parallelize
from ..parallel.timeout import describe_stall, in_frames, stall_guard
from ..signals import SignalFlag, keep_only
from ..slurm import check_task_layout, partial_saves
from .async_checkpoint import BackgroundWriter, snapshot
from .base import absent_keys, base_reference, check_same_base, load_base_weights, load_partial_dcp
from .callbacks import SaveRecipe, StepMetrics, TrainingBar
from .module import GenoLMModule, OptimSettings
from .preemption import RunCheckpoint, StopSignalConnector, auto_resume_reason, finish_stop, remove_marker

__all__ = ["AtomicModelParallelStrategy", "FinetuneResult", "RunPaths", "intact_checkpoint", "latest_checkpoint", "run"]

log = logging.getLogger("genolong")

_STEP_FILE = re.compile(r"^step(\d+)\.ckpt$")


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints appear whole or not at all.

    Each checkpoint is written to ``<name>.tmp`` beside its final path, its checksum manifest
    written (:mod:`genolong.integrity`: inside a DCP directory, beside a file), flushed to disk
    and renamed into place; a failure (disk full, a kill) leaves the previous checkpoints as they
    were and no partial file under a checkpoint name.
    """

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: ``checkpoint.async_save``: the write of a save runs here while training goes on
        self.writer: BackgroundWriter | None = BackgroundWriter() if async_save else None
        self._checkpoint_group: dist.ProcessGroup | None = None
        #: ``genolong export`` in one process: a sharded (DCP) checkpoint's model state is read whole
        #: into the plain model (:meth:`_load_dcp_whole`); a run's --resume never does
        self.weights_for_export = False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))
        if self.writer is not None:
            # at most one save in flight: the previous one is complete (or its error raised) first
            self.writer.wait()
        # one temporary name for the whole job: in a multi-process run every rank writes its shard
        # into the same DCP directory; rank 0 alone clears a killed run's leftover first (the
        # others wait, so nobody writes into a directory being deleted) and renames at the end,
        # once the DCP save (a collective) has every shard on disk
        tmp = path.with_name(path.name + ".tmp")
        if self.is_global_zero:
            _remove(tmp)
        self.barrier("genolong_checkpoint_start")
        needed = _tensor_bytes(checkpoint)
        if self.writer is None:
            self._write(checkpoint, path, tmp, needed, group=None)
            self.barrier("genolong_checkpoint")
            return
        # the state of this step, copied now (the only wait): the next optimiser step cannot change it
        state = snapshot(checkpoint)
        group = self._background_group()
        self.writer.submit(functools.partial(self._write, state, path, tmp, needed, group))

    def _background_group(self) -> dist.ProcessGroup | None:
        """A process group of its own for the background writes' collectives (DCP's plan and
        finish, the shard digests), so that they never interleave with the training's on the
        default group; None in a one-process run (no collective)."""
        if not self._save_distributed_checkpoint:
            return None
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._checkpoint_group

    def _write(
        self, checkpoint: dict[str, Any], path: Path, tmp: Path, needed: int, group: dist.ProcessGroup | None
    ) -> None:
        """Write ``checkpoint`` to ``tmp``, its manifest, then rename it to ``path`` (rank 0). In a
        multi-process run each rank hashes its own shard and rank 0 writes the manifest from the
        gathered digests. Runs in the training thread, or (``async_save``) in the background with
        ``group`` for the collectives."""
        distributed = self._save_distributed_checkpoint
        try:
            # a full disk or a file-size limit: one error naming the checkpoint and its size
            with writing(path, needed=needed, work=tmp):
                known: dict[str, dict[str, Any]] = {}
                if distributed:
                    _save_dcp(checkpoint, tmp, group, self.is_global_zero)
                    # each rank hashes the shard it wrote, from the page cache; rank 0 gets the digests
                    joined = dist.is_available() and dist.is_initialized()
                    mine = shard_entries(tmp, dist.get_rank(group) if joined else 0)
                    gathered: list[dict[str, dict[str, Any]] | None] = [mine]
                    if joined:
                        gathered = [None] * dist.get_world_size(group)
                        dist.all_gather_object(gathered, mine, group=group)
                    for entries in gathered:
                        known.update(entries or {})
                elif self.is_global_zero:
                    self.checkpoint_io.save_checkpoint(checkpoint, tmp)
                if self.is_global_zero:
                    # the data is complete: its checksums, then the checkpoint under its name (a file's
                    # manifest first, so that no checkpoint file is ever seen without its manifest)
                    write_manifest(tmp, final=path, known=known)
                    fsync_tree(tmp)
                    if path.is_dir():  # a resumed run saving again the step of a damaged DCP directory
                        _remove(path)
                    os.replace(tmp, path)
                    fsync(path.parent)
        except BaseException:
            if self.is_global_zero:
                _remove(tmp)
                if not path.exists():
                    remove_manifest(path)
            raise
        if group is not None:
            dist.barrier(group=group)

    def finish_saves(self, raise_error: bool = True) -> None:
        """Wait for the background save in flight (``async_save``): the last checkpoint is complete
        when this returns. Its error is raised, or with ``raise_error=False`` (another error is
        already on its way) printed as one line on stderr."""
        if self.writer is None:
            return
        try:
            self.writer.wait()
        except BaseException as error:
            if raise_error:
                raise
            if self.is_global_zero:
                print(f"genolong: the last checkpoint was not written: {error}", file=sys.stderr, flush=True)

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Lightning's removal (``checkpoint.keep_last``), with the manifest beside a checkpoint file;
        with ``async_save``, once the newer checkpoint being written is in place (never if its write fails)."""

        def remove() -> None:
            super(AtomicModelParallelStrategy, self).remove_checkpoint(filepath)
            if self.is_global_zero:
                remove_manifest(filepath)

        if self.writer is None:
            remove()
        else:
            self.writer.then(remove)

    def teardown(self) -> None:
        # the pending save must not be lost, nor race the process group's end; its error is raised by finish_saves
        if self.writer is not None:
            with contextlib.suppress(BaseException):
                self.writer.close()
        super().teardown()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's model state for a checkpoint; without the frozen parameters when the module
        says they are read from the base again (``GenoLMModule.checkpoint_frozen`` False): a
        checkpoint then holds what training changes."""
        module = self.lightning_module
        if module is None or getattr(module, "checkpoint_frozen", True):
            return super().lightning_module_state_dict()
        assert self.model is not None
        options = StateDictOptions(
            full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True, ignore_frozen_params=True
        )
        return get_model_state_dict(self.model, options=options)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's loader for sharded (DTensor) models; for a plain, unsharded model (one
        process, no FSDP) a full checkpoint file, read with ``weights_only=True`` unless told
        otherwise: model and optimiser states are set here, the rest is returned to Lightning.
        A checkpoint without the frozen parameters (read from the base by the sharded loader
        before this runs) restores the rest of the model (:func:`~genolong.train.base.absent_keys` checks what it lacks)."""
        assert self.model is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            self._check_shards(path)
            stored = _stored_keys(path)
            if not absent_keys(self.model, self.lightning_module, stored, path):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            return load_partial_dcp(self.model, self.optimizers, path, stored, weights_only)
        if path.is_dir() and self.weights_for_export:
            return self._load_dcp_whole(path, weights_only)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only)
        strict = self.lightning_module.strict_loading and not absent_keys(
            self.model, self.lightning_module, set(checkpoint["state_dict"]), path
        )
        set_model_state_dict(
            self.model, checkpoint.pop("state_dict"), options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        # Lightning saved the optimiser states re-keyed by parameter id (torch's standard format)
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            optimizer.load_state_dict(state)
        return checkpoint

    def _load_dcp_whole(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """A multi-process run's sharded (DCP) checkpoint read whole into this process's plain
        model (``genolong export`` of it in one process, :attr:`weights_for_export`): the model
        state :func:`_save_dcp` wrote, resharded by torch.distributed.checkpoint; the rest
        (``meta.pt``) returned to Lightning. The optimiser states are not restored: their param
        groups follow the run's mesh (one per device mesh under expert parallelism), and an export
        does not need them."""
        from torch.distributed.checkpoint import load

        assert self.model is not None and self.lightning_module is not None
        stored = _stored_keys(path)
        # a checkpoint without the frozen parameters: the base's, read before this runs, stay
        absent = absent_keys(self.model, self.lightning_module, stored, path)
        state: dict[str, Any] = {
            "state_dict": {k: v for k, v in get_model_state_dict(self.model).items() if k in stored}
        }
        load(state, checkpoint_id=path)
        strict = self.lightning_module.strict_loading and not absent
        set_model_state_dict(self.model, state.pop("state_dict"), options=StateDictOptions(strict=strict))
        return torch.load(
            path / "meta.pt", map_location="cpu", weights_only=True if weights_only is None else weights_only
        )

    def _check_shards(self, path: Path) -> None:
        """Each rank checks the checksums of its own shard of a DCP checkpoint (the rest was checked
        before the run started, :func:`intact_checkpoint`); a damaged shard found by any rank is
        raised on every rank.

        Raises:
            DamagedFileError: the first damaged shard, named.
        """
        if not path.is_dir():
            return
        found: DamagedFileError | None = None
        try:
            check_weights(path, shards=(self.global_rank, self.world_size))
        except DamagedFileError as error:
            found = error
        reports: list[tuple[str, str] | None] = [None] * self.world_size
        dist.all_gather_object(reports, None if found is None else (str(found.file), found.problem))
        for report in reports:
            if report is not None:
                raise DamagedFileError(
                    Path(report[0]),
                    report[1],
                    f"move {path.name} away and run with --resume again to resume from an older checkpoint",
                ) from None


def _save_dcp(checkpoint: dict[str, Any], path: Path, group: dist.ProcessGroup | None, is_global_zero: bool) -> None:
    """Lightning's sharded checkpoint (``ModelParallelStrategy.save_checkpoint``): the model and
    optimiser states with torch.distributed.checkpoint (collectives on ``group``), the rest in
    ``meta.pt`` by rank 0."""
    from torch.distributed.checkpoint import save

    path.mkdir(parents=True, exist_ok=True)
    state = dict(checkpoint)
    converted = {"state_dict": state.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(state.pop("optimizer_states", []))})
    save(converted, checkpoint_id=path, process_group=group)
    if is_global_zero:
        torch.save(state, path / "meta.pt")


def _tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) checkpoint dict: about the size on disk of the whole
    save, every rank's shards together (a DTensor counts with its global shape, a plain tensor
    once: DCP writes a replicated one once), the same figure on every rank."""
    if isinstance(state, DTensor):
        return math.prod(state.shape) * state.element_size()
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _remove(path: Path) -> None:
    """Remove a file or a directory tree if it exists."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes (see the module docstring)."""

    root: Path
    checkpoints: Path
    logs: Path

    @classmethod
    def of(cls, recipe: Recipe) -> RunPaths:
        """The run's paths: ``checkpoint.dir`` and ``logging.dir`` (``runs/<name>/...`` unless the
        recipe says otherwise); the root, holding recipe.yaml and export/, is the checkpoint
        directory's parent."""
        assert recipe.checkpoint.dir is not None and recipe.logging.dir is not None  # filled in on load
        checkpoints = Path(recipe.checkpoint.dir)
        return cls(root=checkpoints.parent, checkpoints=checkpoints, logs=Path(recipe.logging.dir))

    @property
    def steps(self) -> Path:
        return self.logs / "steps.jsonl"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"


def _checkpoints(directory: Path) -> list[Path]:
    """The ``step*.ckpt`` in ``directory`` (temporary files ignored), newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete ``step*.ckpt`` in ``directory`` (temporary files ignored), or None."""
    found = _checkpoints(directory)
    return found[0] if found else None


def _damage(checkpoint: Path, error: DamagedFileError) -> str:
    """``error``'s problem, naming the file inside a checkpoint directory or the manifest beside it."""
    if error.file == checkpoint:
        return error.problem
    inside = error.file.relative_to(checkpoint) if error.file.is_relative_to(checkpoint) else error.file.name
    return f"{inside}: {error.problem}"


def intact_checkpoint(directory: Path, hash_shards: bool = True) -> Path | None:
    """The newest ``step*.ckpt`` in ``directory`` that passes its checks
    (:func:`genolong.integrity.check_weights`: the checksum manifest, the file format), or None
    when there is no checkpoint at all. ``hash_shards=False`` (the ranks of a multi-process job):
    the checksums of the DCP shard files are left to the rank that reads each
    (:meth:`AtomicModelParallelStrategy.load_checkpoint`), their sizes checked here. Each newer damaged one is named in one line on stderr
    (``step0000020.ckpt is damaged (truncated: ...); resuming from step0000010.ckpt``), by rank 0.

    Raises:
        InputError: there are checkpoints and none is intact (each named with its problem).
    """
    damaged: list[tuple[Path, DamagedFileError]] = []
    for checkpoint in _checkpoints(directory):
        try:
            check_weights(checkpoint, shards=None if hash_shards else (0, 0))
        except DamagedFileError as error:
            damaged.append((checkpoint, error))
            continue
        except FileNotFoundError:  # removed meanwhile (by rank 0 of a job, keeping the last ones)
            continue
        if is_rank_zero():
            for bad, error in damaged:
                print(
                    f"genolong: {bad.name} is damaged ({_damage(bad, error)}); resuming from {checkpoint.name}",
                    file=sys.stderr,
                    flush=True,
                )
        return checkpoint
    if damaged:
        listed = "; ".join(f"{bad.name} ({_damage(bad, error)})" for bad, error in damaged)
        raise InputError(
            f"--resume: no intact checkpoint in {directory}: {listed}; move them away and run without "
            "--resume to start again"
        )
    return None


@dataclass(frozen=True)
class FinetuneResult:
    """What a run produced."""

    paths: RunPaths
    global_step: int
    resumed_from: Path | None
    export: Path | None
    is_global_zero: bool = True  # False on the other processes of a multi-process job
    adapter: Path | None = None  # runs/NAME/adapter/ of a model.lora run (rank 0)

    def summary(self, name: str) -> str:
        """The line a finished ``genolong finetune`` prints (rank 0): steps, logs, export."""
        done = f"genolong finetune: {name}: {self.global_step} steps; logs in {self.paths.logs}"
        return done + (f"; model exported to {self.export}" if self.export else "")


def _check_store(recipe: Recipe) -> None:
    """The store must open (schema), encode bases as this genolong does, and hold the splits the
    recipe names.

    Raises:
        InputError: another alphabet; StoreError: damaged, another schema, a missing split.
    """
    store = GenomeStore.open(recipe.data.store, verify=False)
    expected = {str(k): v for k, v in STORE_ALPHABET.items()}
    if store.manifest.get("alphabet") != expected:
        raise InputError(
            f"genome store {recipe.data.store} encodes bases as {store.manifest.get('alphabet')}, this genolong's "
            f"model reads {expected}; re-create the store with `genolong prepare`"
        )
    splits = [recipe.data.train_split]
    if recipe.data.eval_split and recipe.eval.every_n_steps:
        splits.append(recipe.data.eval_split)
    for split in splits:
        store.split(split)


def _kernels(recipe: Recipe, backend: str) -> str:
    """Load the model's kernel backend now, before any rank builds a model, and name what will
    run (in the words of ``genolong plan``'s "on this machine" line,
    :func:`genolong.kernels.probe.kernel_line`): ``auto`` on a CUDA machine without the GPU
    kernels stops the run here with one line naming ``pip install 'genolong[gpu]'``.

    Raises:
        InputError: the backend cannot load here (:func:`genolong.kernels.backends.get_backend`).
    """
    from ..kernels.backends import get_backend
    from ..kernels.probe import cuda_here, kernel_line

    loaded = get_backend(backend)
    # what runs CUDA tensors; a CPU recipe's tensors always take the torch reference
    on_cuda = recipe.parallel.accelerator != "cpu" and cuda_here()
    kda = loaded.impls.get("chunk_kda_gated", "torch") if on_cuda else "torch"
    dsa = loaded.impls.get("kpool_topk", "torch") if on_cuda else "torch"
    return kernel_line(backend, loaded.name, kda, dsa)


def _build_model(recipe: Recipe) -> GenoLM:
    """The plain model: the checkpoint's weights, or the preset's fresh ones (seeded). The seed is
    set in both cases: the LoRA adapters initialised next (``apply_lora``, in the module's
    ``configure_model``) are then the same in every run of the recipe and on every rank."""
    config = recipe.model_config()
    chunk = recipe.memory.moe_chunk_tokens
    torch.manual_seed(recipe.seed)
    if recipe.model.checkpoint is not None:
        # on the meta device: the module shards it, then _load_weights reads each rank's part
        with torch.device("meta"):
            return GenoLM(config, moe_chunk_tokens=chunk)
    return GenoLM(config, moe_chunk_tokens=chunk)


def _parallelize(recipe: Recipe, model: GenoLM, mesh: DeviceMesh | None) -> GenoLM:
    """The recipe's memory techniques, and over a multi-process ``mesh`` context parallelism and
    FSDP2; a bf16-mixed run all-gathers parameters in bf16 and reduces gradients in fp32."""
    m = recipe.memory
    mixed = mesh is not None and recipe.train.precision == "bf16-mixed"
    parallelize(
        model,
        recompute=m.recompute,
        recompute_modules=m.recompute_modules,
        recompute_chunk_tokens=m.recompute_chunk_tokens,
        offload=m.offload,
        offload_min_bytes=m.offload_min_bytes,
        moe_chunk_tokens=m.moe_chunk_tokens,
        mesh=mesh,
        param_dtype=torch.bfloat16 if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
        ep=recipe.parallel.ep if mesh is not None else None,
    )
    return model


def _full_model(model: GenoLM, lora: LoraSection | None = None) -> GenoLM | None:
    """The whole model on rank 0 (None on the other ranks; every rank must call this: gathering a
    sharded model is a collective). The export's reference path, before it wrote without a gather
    (:mod:`genolong.train.export`): kept for the tests and benchmarks/sharded_export.py.

    Without ``lora``: ``model`` itself when it is not sharded; for an FSDP2 model, a plain copy
    with the full parameters. With ``lora`` (the section ``model`` was adapted with): always a
    plain copy, with the same adapters, that shares no storage with ``model``, so that merging it
    leaves the live model as it was.
    """
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if not sharded and lora is None:
        return model
    if sharded:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
    else:
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    with torch.device("meta"):
        plain = GenoLM(model.config)
        if lora is not None:
            from ..model.lora import apply_lora

            apply_lora(plain, lora)
    plain.load_state_dict(state, assign=True)
    return plain


def _merged_export(model: GenoLM) -> GenoLM:
    """``model`` (a plain copy with adapters, from :func:`_full_model`) with its adapters merged,
    in place. The adapted base weights (linear layers, and routed experts with adapters) are taken
    to fp32 first: ``merge_lora`` stores ``W + s B A`` in ``W``'s dtype, and a frozen bf16 base
    (a ``bf16-mixed`` run) would round the adapters' small update away."""
    from ..model.lora import ExpertAdapters, lora_modules, merge_lora

    adapted = [module.base for module in lora_modules(model).values()]
    adapted += [module for module in model.modules() if isinstance(getattr(module, "lora", None), ExpertAdapters)]
    for module in adapted:
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
    return merge_lora(model)


def _trainer(
    recipe: Recipe,
    paths: RunPaths,
    callbacks: list[L.Callback],
    environment: ClusterEnvironment | None = None,
    **overrides: Any,
) -> L.Trainer:
    """The run's Lightning trainer; ``overrides``: Trainer arguments that replace the recipe's
    (``genolong export``: no logger, no training batch)."""
    p, t = recipe.parallel, recipe.train
    accelerator = "cuda" if p.accelerator == "gpu" else p.accelerator
    loggers: list[Any] = []
    if recipe.logging.csv:
        loggers.append(CSVLogger(paths.logs, name="csv", version=""))
    if recipe.logging.tensorboard:
        loggers.append(TensorBoardLogger(paths.logs, name="tensorboard", version="", default_hp_metric=False))
    # Lightning's mesh is (data_parallel, tensor_parallel); genolong.parallel builds its own
    # (dp_replicate, dp_shard, cp) mesh from the recipe when it needs one
    strategy = AtomicModelParallelStrategy(
        data_parallel_size=p.dp_size,
        tensor_parallel_size=p.cp,
        save_distributed_checkpoint=p.world_size > 1,
        # the default group's timeout (and its rendezvous'); the sub-groups get it from build_mesh
        timeout=timedelta(seconds=p.timeout_s),
        async_save=recipe.checkpoint.async_save,
    )
    every = recipe.eval.every_n_steps
    if recipe.logging.progress_bar:  # genolong's one bar, instead of Lightning's per-epoch and validation bars
        callbacks = [*callbacks, TrainingBar()]
    settings: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=p.devices,
        num_nodes=p.num_nodes,
        strategy=strategy,
        precision=t.precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.grad_clip or None,
        callbacks=callbacks,
        logger=loggers or False,
        log_every_n_steps=recipe.logging.every_n_steps,
        enable_progress_bar=recipe.logging.progress_bar,
        enable_model_summary=False,
        enable_checkpointing=True,
        val_check_interval=every * t.accumulate_grad_batches if every else None,
        check_val_every_n_epoch=None,
        limit_val_batches=1.0 if every else 0,
        # the data module deals windows and eval tiles out by data-parallel rank itself (the ranks
        # of a context-parallel group must get the same ones; every rank the same number)
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        deterministic=False,
        default_root_dir=paths.root,
        # a launcher's own (Ray Train's); None: Lightning's detection (SLURM, torchrun, its own)
        plugins=[environment] if environment is not None else None,
    )
    trainer = L.Trainer(**{**settings, **overrides})
    # signals stop the run at a step boundary, with a checkpoint (genolong.train.preemption)
    trainer._signal_connector = StopSignalConnector(trainer, SignalFlag(t.stop_signals))
    return trainer


#: the environment variables Lightning's launcher sets in the process it runs in, even alone (restored
#: after a one-process run: a child process that inherits LOCAL_RANK takes itself for a launched rank
#: and starts no ranks of its own, so a later multi-process job waits for them forever)
_RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def run(recipe: Recipe, resume: bool = False, environment: ClusterEnvironment | None = None) -> FinetuneResult:
    """Train ``recipe``; returns where things went. ``environment``: the cluster environment of the
    launcher that started this process (Ray Train's, :mod:`genolong.train.ray_launcher`), or None
    for Lightning's own detection. Lightning's banners, tips and its own warnings
    are hidden unless ``--verbose``, and the other ranks of a multi-process job print errors only
    (:func:`genolong.console.quiet_run`).

    Raises:
        InputError: missing store/checkpoint, a store the model cannot read, ``resume`` with no
            checkpoint, or a fresh run over a directory that already has checkpoints.
    """
    with leaves_no_process_group(), quiet_run():
        return _run(recipe, resume, environment)


@contextlib.contextmanager
def leaves_no_process_group() -> Iterator[None]:
    """Run a one-process Lightning job inside and leave no process group nor launcher variables
    behind. Lightning starts a process group even for one process and sets the launcher's variables
    (``_RENDEZVOUS_VARIABLES``), and never undoes either: a one-process run called as a library (the
    quickstart, a notebook, the tests, ``genolong export``) would leave a TCP store listening on
    MASTER_PORT, which every later child process inherits (EADDRINUSE), LOCAL_RANK, with which a
    later ``genolong finetune`` child starts no ranks of its own (a hang), and later code would take
    this process for one rank of a distributed job. A group that was there before is kept."""
    had_group = dist.is_available() and dist.is_initialized()
    rendezvous = {name: os.environ.get(name) for name in _RENDEZVOUS_VARIABLES}
    try:
        yield
    finally:
        if not had_group and dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
            dist.destroy_process_group()
            for name, value in rendezvous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _run(recipe: Recipe, resume: bool, environment: ClusterEnvironment | None = None) -> FinetuneResult:
    if environment is None:  # the job's tasks against the recipe, before anything loads (one line, exit 2)
        check_task_layout(recipe.parallel)
    keep_only(tuple(signal.Signals[s] for s in recipe.train.stop_signals))
    recipe.check_paths()
    config = recipe.model_config()
    vocab = recipe.vocab_map(config)
    _check_store(recipe)
    paths = RunPaths.of(recipe)
    one = recipe.parallel.world_size == 1
    resume_from = intact_checkpoint(paths.checkpoints, one) if resume else latest_checkpoint(paths.checkpoints)
    if not resume and resume_from is not None and (reason := auto_resume_reason(paths.root)) is not None:
        # a run stopped by a signal, or its requeued SLURM job, continues by itself
        resume, resume_from = True, intact_checkpoint(paths.checkpoints, one)
        if is_rank_zero() and resume_from is not None:
            # a save SIGKILL cut short (SLURM's KillWait) is named here, in the same line
            cut = "".join(f"; {p.name} (a save cut short) ignored" for p in partial_saves(paths.checkpoints))
            print(f"genolong: resuming from {resume_from.name}: {reason}{cut}", file=sys.stderr, flush=True)
    if resume and resume_from is None:
        raise InputError(
            f"--resume: nothing to resume in {paths.checkpoints} (no step*.ckpt); run without --resume to start"
        )
    if not resume and resume_from is not None:
        raise InputError(
            f"{paths.checkpoints} already holds checkpoints ({resume_from.name}); pass --resume to continue "
            "that run, or set another name / checkpoint.dir"
        )

    # the kernels, once the input is known good (an input error stays the run's one line) and
    # before any rank builds a model
    log.info("genolong: kernels: %s", _kernels(recipe, config.kernel_backend))
    base = base_reference(recipe)
    if resume and resume_from is not None:
        check_same_base(resume_from, base)
    module = _module(recipe, vocab, resume=resume)
    d = recipe.data
    datamodule = GenomeDataModule(
        d.store,
        train_length=d.context,
        eval_length=recipe.eval_context,
        train_split=d.train_split,
        eval_split=d.eval_split if recipe.eval.every_n_steps else None,
        batch_size=d.batch_size,
        eval_batch_size=recipe.eval.batch_size,
        seed=recipe.seed,
        rc_prob=d.rc_prob,
        num_workers=d.num_workers,
        windows_per_epoch=d.windows_per_epoch,
        verify=d.verify,
        eval_max_tiles=recipe.eval.max_tiles,
        planting=None if d.plant_repeats is None else RepeatPlanting(**dataclasses.asdict(d.plant_repeats)),
    )
    every = recipe.checkpoint.every_n_steps or recipe.train.max_steps
    checkpoints = RunCheckpoint(
        paths.root,
        dirpath=paths.checkpoints,
        filename="step{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=every,
        save_top_k=recipe.checkpoint.keep_last,
        monitor="step",
        mode="max",
        save_last=False,
        save_on_train_epoch_end=True,
        # a step's checkpoint replaces one of the same name: the damaged newest one that --resume
        # went past, not a "step0000020-v1.ckpt" beside it that the next --resume would not see
        enable_version_counter=False,
    )
    # the recipe is written once the processes know their ranks (rank 0 writes, the others wait):
    # every rank of a job runs this function, on a cluster at the same instant
    stall = StallReport(recipe.parallel.timeout_s)
    callbacks = [SaveRecipe(recipe, paths.root / "recipe.yaml"), checkpoints, StepMetrics(paths.steps), stall]
    if recipe.checkpoint.async_save and recipe.parallel.world_size == 1:
        # one process: a failed background save ends the run at the next step boundary (a job's
        # ranks find it at the next save, together: one rank alone must not leave the collectives)
        callbacks.append(SaveCheck())
    trainer = _trainer(recipe, paths, callbacks, environment)
    # the module logs eval/* already summed over all ranks (Lightning cannot know)
    warnings.filterwarnings(
        "ignore", message=r".*when logging on epoch level in distributed setting", category=UserWarning
    )
    # a rank that stops answering ends the others within parallel.timeout_s, with one line naming it
    # (StallReport names it while the trainer still knows where it was, before Lightning's teardown)
    strategy = trainer.strategy
    assert isinstance(strategy, AtomicModelParallelStrategy)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from if resume else None, weights_only=True)
        strategy.finish_saves()  # the last checkpoint is complete before the export and the return
    except SIGTERMException:
        strategy.finish_saves()  # the stop step's checkpoint, complete before the line that names it
        # Lightning's exit after RunCheckpoint saved the step where a stop signal was agreed
        stop = (
            trainer._signal_connector.preemption if isinstance(trainer._signal_connector, StopSignalConnector) else None
        )
        if stop is None:
            raise
        stop = finish_stop(stop, trainer.is_global_zero)  # the requeue, now that the checkpoint is complete
        raise Stopped(stop.message(), show=trainer.is_global_zero) from None
    except Exception:
        # the save in flight completes (the last good state on disk); a failure of it is named too
        strategy.finish_saves(raise_error=False)
        if stall.error is not None:
            raise stall.error from None
        raise
    with stall_guard(recipe.parallel.timeout_s, lambda exc: "writing the export"):
        return _export(recipe, paths, trainer, module, resume_from if resume else None)


def _stored_keys(path: Path) -> set[str]:
    """The model state keys a sharded (DCP) checkpoint holds (its metadata, without reading data)."""
    from torch.distributed.checkpoint import FileSystemReader

    return {
        k.removeprefix("state_dict.")
        for k in FileSystemReader(path).read_metadata().state_dict_metadata
        if k.startswith("state_dict.")
    }


def _module(recipe: Recipe, vocab: VocabMap, resume: bool = False) -> GenoLMModule:
    """The Lightning module of ``recipe`` (the model is built in its ``configure_model``; with a base
    checkpoint, on the meta device and filled by the sharded loader, which with ``resume`` (or an
    export's restore) leaves the trained parameters to the checkpoint)."""
    base = base_reference(recipe)
    m = recipe.memory
    return GenoLMModule(
        build_model=functools.partial(_build_model, recipe),
        optim=OptimSettings(
            lr=recipe.train.lr,
            min_lr=recipe.train.min_lr,
            warmup_steps=recipe.train.warmup_steps,
            max_steps=recipe.train.max_steps,
            weight_decay=recipe.train.weight_decay,
            betas=recipe.train.betas,
            eps=recipe.train.eps,
            moe_bias_rate=recipe.train.moe_bias_update_rate,
            moe_bias_update=recipe.train.moe_bias_update,
            moe_balance_loss_weight=recipe.train.moe_balance_loss_weight,
        ),
        parallelize=functools.partial(_parallelize, recipe),
        parallel=recipe.parallel,
        softmask_weight=recipe.model.softmask_weight,
        ce_chunk_tokens=m.ce_chunk_tokens,
        vocab=None if vocab == VocabMap.identity() else vocab,
        freeze=recipe.model.freeze,
        lora=recipe.model.lora,
        frozen_dtype=torch.bfloat16 if recipe.train.precision == "bf16-mixed" else None,
        max_consecutive_nonfinite=recipe.train.max_consecutive_nonfinite,
        indexer_kl_weight=recipe.train.indexer_kl_weight,
        extra_checkpoint_state={"recipe": recipe.to_dict(), **({"base": base} if base is not None else {})},
        load_weights=None if recipe.model.checkpoint is None else functools.partial(load_base_weights, recipe, resume),
        # with a base checkpoint the frozen weights are read from it again on --resume: not saved
        checkpoint_frozen=recipe.model.checkpoint is None,
        context_cut=recipe.train.context_cut,
        moe_capacity_factor=m.moe_capacity_factor,
        moe_collapse_steps=recipe.logging.moe_collapse_steps,
    )


class SaveCheck(L.Callback):
    """Raises the error of a failed background save (``checkpoint.async_save``; a
    :class:`~genolong.errors.DiskFullError`, say) at the end of the next training batch."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        writer = strategy.writer if isinstance(strategy, AtomicModelParallelStrategy) else None
        if writer is not None and writer.failed() is not None:
            writer.wait()


class StallReport(L.Callback):
    """Turns a collective timeout during ``fit`` into :class:`genolong.errors.CollectiveTimeoutError`
    (:func:`genolong.parallel.timeout.describe_stall`), kept in ``error`` for :func:`run` to raise:
    Lightning's ``on_exception`` runs while the trainer still knows the step and the stage."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.error: Exception | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.error = describe_stall(exception, self.timeout_s, _where(trainer, exception))


def _where(trainer: L.Trainer, exc: BaseException) -> str:
    """Where a multi-process run was when a collective timed out, for the error line."""
    step = trainer.global_step
    if in_frames(exc, "save_checkpoint"):
        return f"saving the step-{step} checkpoint; no checkpoint of that step is left"
    if trainer.validating or trainer.sanity_checking:
        return f"the held-out evaluation after step {step}"
    if trainer.training:
        return f"training step {step + 1}"
    return "starting the run" if step == 0 else f"after step {step}"


def _export(
    recipe: Recipe, paths: RunPaths, trainer: L.Trainer, module: GenoLMModule, resumed_from: Path | None
) -> FinetuneResult:
    """The adapters and the export of a trained run (every rank takes part, each writing its own
    shards: :func:`write_exports`); the offload host pool is released first."""
    from .export import release_offload_pool, write_exports

    assert module.model is not None
    release_offload_pool(module.model)
    adapter, export = write_exports(recipe, module.model, paths.root)
    # so that the export is there when run() returns on any rank
    trainer.strategy.barrier("genolong_export")
    if trainer.is_global_zero:
        remove_marker(paths.root)  # finished: a later start without --resume refuses the checkpoints again
    return FinetuneResult(
        paths=paths,
        global_step=trainer.global_step,
        resumed_from=resumed_from,
        export=export,
        is_global_zero=trainer.is_global_zero,
        adapter=adapter,
    )
