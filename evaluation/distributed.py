"""Scoring in several processes: the pieces ``evaluate`` and ``check-logprobs`` share (and any
other per-tile scorer, e.g. ``genolong probe``).

A scoring job runs on the ``(dp_replicate, dp_shard, cp)`` mesh of the recipe's ``parallel``
section (:func:`genolong.parallel.mesh.build_mesh`), forward only:

- the processes are started by Lightning Fabric (:func:`launch`: ``parallel.devices`` processes per
  node started by Fabric itself, or joined when torchrun / SLURM started them), as ``finetune``'s
  are started by the Trainer with the same ``ModelParallelStrategy``;
- the model is sharded over the mesh (:func:`shard_for_scoring`: context parallelism, expert
  parallelism, FSDP2 over ``dp_shard x cp``) and loaded straight into the shards
  (:func:`load_sharded_model`: a sharded DCP checkpoint by ``dcp.load`` into the DTensor state dict,
  an export directory by reading each rank's slices of the safetensors);
- tiles are dealt to the data-parallel groups a *round* at a time (:func:`tile_rounds`: tile ``i``
  to dp rank ``i mod dp``); every rank runs one forward per round (a rank without a tile in the last
  round runs a padding tile, because FSDP's all-gathers and the CP collectives are collective);
- a context-parallel group scores its tile's slices (:func:`share_nll`), the per-tile arrays are
  gathered to global rank 0 (:func:`gather_to_writer`), which alone assembles them
  (:func:`assemble_nll`) and writes; the caller commits its progress once per round.

In one process (``group = ScoringGroup()``, the default everywhere) every function is the plain
one-process path: one loop serves both, so results, resume and metadata keep one format.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.alphabet import PAD, VOCAB_SIZE
from ..errors import InputError, Stopped
from ..integrity import check_weights
from ..model.loss import model_inputs, next_token_nll
from ..model.vocab import VocabMap
from ..signals import SignalFlag
from .checkpoint import _DCP_META, check_adapter, load_eval_model, merge_adapter, scoring_kernel_backend

__all__ = [
    "ScoringGroup",
    "assemble_nll",
    "broadcast_from_writer",
    "gather_to_writer",
    "launch",
    "load_scoring_model",
    "padded_length",
    "padding_tile",
    "raise_on_every_rank",
    "shard_for_scoring",
    "share_nll",
    "stop_if_signalled",
    "tile_rounds",
    "unsharded",
]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ScoringGroup:
    """Where this process stands in a scoring job.

    Attributes:
        mesh: the job's ``(dp_replicate, dp_shard, cp)`` mesh (:func:`genolong.parallel.mesh.build_mesh`);
            default None: one process.
        parallel: the ``parallel`` section the mesh was built from (recorded in the results'
            settings); default None (one process).

    ``dp_rank`` / ``dp_size`` say which tiles this process scores (tile ``i`` belongs to dp rank
    ``i mod dp_size``), ``cp_rank`` / ``cp_size`` which slice of it; global rank 0 is the writer.
    """

    mesh: Any = None
    parallel: Any = None

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.mesh is not None and dist.is_initialized() and dist.get_world_size() > 1

    @property
    def rank(self) -> int:
        """Global rank (0 in one process)."""
        return dist.get_rank() if self.distributed else 0

    @property
    def world(self) -> int:
        """Processes in the job (1 in one process)."""
        return dist.get_world_size() if self.distributed else 1

    @property
    def is_writer(self) -> bool:
        """Global rank 0: the one process that reads the progress state and writes results."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel index (its CP group's tiles)."""
        from ..parallel.mesh import dp_rank

        return dp_rank(self.mesh) if self.distributed else 0

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: tiles scored at once."""
        from ..parallel.mesh import dp_size

        return dp_size(self.mesh) if self.distributed else 1

    @property
    def cp_rank(self) -> int:
        """This process's slice of its tile."""
        from ..parallel.mesh import cp_rank

        return cp_rank(self.mesh) if self.distributed else 0

    @property
    def cp_size(self) -> int:
        """Slices per tile."""
        from ..parallel.mesh import cp_size

        return cp_size(self.mesh) if self.distributed else 1

    def layout(self) -> dict[str, int]:
        """The mesh as plain data (``world``, ``dp_replicate``, ``dp_shard``, ``cp``, ``ep``), for the
        results' settings: per-token NLL depends on ``cp`` (another summation order), so a resumed
        evaluation must run on the same layout."""
        if not self.distributed:
            return {"world": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "ep": 1}
        from ..parallel.mesh import ep_size

        return {
            "world": self.world,
            "dp_replicate": self.mesh["dp_replicate"].size(),
            "dp_shard": self.mesh["dp_shard"].size(),
            "cp": self.cp_size,
            "ep": ep_size(self.mesh),
        }


def launch(parallel: Any, function: Callable[[ScoringGroup], _T]) -> _T:
    """Run ``function(group)`` in every process of the ``parallel`` section's job.

    One process (``devices x num_nodes == 1``): ``function(ScoringGroup())`` here, no process group.
    Otherwise Lightning Fabric with a ``ModelParallelStrategy`` (as ``finetune``'s Trainer): it
    starts ``parallel.devices`` processes per node itself (re-running this command line), or joins
    those torchrun / SLURM started; then the ``(dp_replicate, dp_shard, cp)`` mesh is built
    (:func:`genolong.parallel.mesh.build_mesh`) and ``function`` runs on every rank.

    Args:
        parallel: a :class:`genolong.config.ParallelSection` (``accelerator``, ``devices``,
            ``num_nodes``, ``cp``, ``dp_shard``, ``dp_replicate``, ``ep``, ``timeout_s``: every
            collective's timeout; a rank that stops answering ends the others with
            :class:`genolong.errors.CollectiveTimeoutError`).
        function: the per-process work; its return value is returned on every rank.

    What it prints: :func:`genolong.console.quiet_run` (Lightning's lines hidden unless
    ``--verbose``; the ranks other than 0 print errors only).

    Raises:
        InputError: sizes that do not make a mesh (:func:`genolong.parallel.mesh.mesh_shape`).
    """
    from ..config import ParallelSection
    from ..console import quiet_run
    from ..parallel.mesh import build_mesh, mesh_shape
    from ..parallel.timeout import stall_guard

    world = parallel.world_size
    mesh_shape(parallel.cp, parallel.dp_shard, parallel.dp_replicate, world, ep=parallel.ep)  # errors before launching
    if world == 1:
        with quiet_run():
            return function(ScoringGroup())
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    # entered once Lightning is imported, so that its own warnings are judged too: no
    # "Initializing distributed" banner, and the ranks other than 0 print errors only
    with quiet_run():
        accelerator = "cuda" if parallel.accelerator == "gpu" else parallel.accelerator
        timeout_s = float(getattr(parallel, "timeout_s", None) or ParallelSection().timeout_s)
        strategy = ModelParallelStrategy(
            parallelize_fn=lambda model, mesh: model,
            data_parallel_size=parallel.dp_size,
            tensor_parallel_size=parallel.cp,
            timeout=timedelta(seconds=timeout_s),
        )
        fabric = L.Fabric(
            accelerator=accelerator, devices=parallel.devices, num_nodes=parallel.num_nodes, strategy=strategy
        )
        fabric.launch()
        # a rank that stops answering ends the others within parallel.timeout_s, with one line naming it
        with stall_guard(timeout_s, lambda exc: "scoring"):
            mesh = build_mesh(parallel, world_size=dist.get_world_size(), device_type=fabric.device.type)
            return function(ScoringGroup(mesh, parallel))


def tile_rounds(start: int, n_tiles: int, dp: int) -> Iterator[list[int]]:
    """Tile indices ``[start, n_tiles)`` in rounds of ``dp`` (the last one shorter): round ``r`` holds
    tiles ``start + r * dp + d`` for dp ranks ``d = 0 .. dp - 1``."""
    for first in range(start, n_tiles, dp):
        yield list(range(first, min(first + dp, n_tiles)))


def padding_tile(length: int) -> np.ndarray:
    """``[length]`` PAD tokens: what a dp rank without a tile in the last round scores (its forward
    takes part in the collectives; no target counts)."""
    return np.full(length, PAD, dtype=np.uint8)


def gather_to_writer(obj: _T, group: ScoringGroup) -> list[_T] | None:
    """Every rank's ``obj`` (picklable), in global rank order, on the writer (global rank 0); None
    on the others. ``[obj]`` in one process. A collective: every rank must call it."""
    if not group.distributed:
        return [obj]
    out: list[Any] | None = [None] * group.world if group.is_writer else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_from_writer(obj: _T, group: ScoringGroup) -> _T:
    """The writer's ``obj`` on every rank (a collective); ``obj`` itself in one process."""
    if not group.distributed:
        return obj
    box = [obj if group.is_writer else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a positive multiple of ``multiple``."""
    return max(1, math.ceil(length / multiple)) * multiple


@torch.no_grad()
def share_nll(
    model: torch.nn.Module,
    tokens: np.ndarray,
    group: ScoringGroup,
    multiple: int,
    vocab: VocabMap | None = None,
    chunk_size: int = 4096,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """This CP rank's per-target NLL of one tile (or a batch of tiles), the model's context
    parallelism installed.

    The tiles are padded on the right with PAD to ``P``, a multiple of ``multiple``
    (:func:`genolong.config.kernel_multiple` at the CP size: each slice holds whole KDA chunks and
    DSA pools; padding changes nothing before it, every layer being causal, and never counts);
    CP rank ``c`` runs the inputs ``[c P / cp, (c + 1) P / cp)`` and scores the targets
    ``c P / cp + 1 ..`` up to the next slice's first token (as the trainer's loss does).

    Args:
        model: the model with context parallelism over ``group``'s CP ranks (and FSDP2).
        tokens: ``[T]`` or ``[B, T]`` uint8 / int store tokens of the tile(s) (case kept).
        group: the scoring job.
        multiple: the padded length's unit.
        vocab: base ids -> model ids (default None: nucleotide ids).
        chunk_size: LM-head rows per chunk (default 4096).
        device: where the model runs.

    Returns:
        ``[n]`` (or ``[B, n]``) float32: NLL of targets ``lo + 1 .. lo + n`` of the padded tile
        (NaN: not counted); :func:`assemble_nll` puts the slices of a CP group together.
    """
    from ..data.windows import context_parallel_bounds

    rows = np.atleast_2d(tokens)
    total = padded_length(int(rows.shape[1]), multiple)
    padded = np.full((rows.shape[0], total), PAD, dtype=np.int64)
    padded[:, : rows.shape[1]] = rows
    lo, hi = context_parallel_bounds(total, group.cp_rank, group.cp_size)
    ids = torch.from_numpy(padded).to(device)
    local = ids[:, lo:hi]
    inputs = model_inputs(local) if vocab is None else vocab.to_model(local)
    hidden = model(inputs)  # [B, n, H]
    if hi < total:  # the slice's last row predicts the next slice's first token
        hidden = F.pad(hidden, (0, 0, 0, 1))  # a dummy row: next_token_nll scores rows [:-1]
        nll = next_token_nll(hidden, model.lm_head.weight, ids[:, lo : hi + 1], chunk_size, vocab)
    else:
        nll = next_token_nll(hidden, model.lm_head.weight, local, chunk_size, vocab)
    out = nll.float().cpu().numpy()
    return out[0] if np.ndim(tokens) == 1 else out


def assemble_nll(slices: Sequence[np.ndarray], length: int) -> np.ndarray:
    """A tile's ``[length - 1]`` per-target NLL (``[B, length - 1]`` for a batch) from its CP slices
    (:func:`share_nll`, in CP rank order) or its one-process NLL (one slice)."""
    whole = np.concatenate(list(slices), axis=-1) if len(slices) > 1 else np.asarray(slices[0])
    assert whole.shape[-1] >= length - 1, (whole.shape, length)
    return whole[..., : max(length - 1, 0)]


# -- the model on the mesh -------------------------------------------------------------------------


def shard_for_scoring(
    model: torch.nn.Module, group: ScoringGroup, moe_chunk_tokens: int | None = None
) -> torch.nn.Module:
    """Install the job's parallelism on a plain model, in place, for forward-only scoring: context
    parallelism over the CP ranks, expert parallelism (``parallel.ep``), FSDP2 over ``dp_shard x cp``
    (:func:`genolong.parallel.parallelize`; no recompute, no offload: nothing is saved for a
    backward that never runs, the scorers run under ``torch.no_grad()``). One process: ``model``
    unchanged (except the MoE chunk). Returns ``model``.
    """
    from ..parallel import parallelize

    if not group.distributed:
        from ..parallel.parallelize import apply_moe_chunks

        apply_moe_chunks(model, moe_chunk_tokens)
        return model
    ep = getattr(group.parallel, "ep", 1) if group.parallel is not None else None
    return parallelize(model, moe_chunk_tokens=moe_chunk_tokens, mesh=group.mesh, ep=ep)


def load_scoring_model(
    checkpoint: str | os.PathLike[str],
    group: ScoringGroup,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernel_backend: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
) -> tuple[torch.nn.Module, VocabMap | None]:
    """The model to score with and its vocabulary map, on ``group``'s mesh.

    One process: :func:`genolong.evaluation.checkpoint.load_eval_model` (the whole model). Several: the
    model is built on the meta device, sharded (:func:`shard_for_scoring`), allocated shard by
    shard on ``device`` and filled from the checkpoint without ever holding it whole: a sharded
    (DCP) checkpoint directory of a multi-process finetune by ``dcp.load`` into the DTensor state
    dict (resharded to this mesh, whatever mesh wrote it); an export directory (config.json +
    safetensors) by reading only this rank's slice of each tensor.

    ``kernel_backend``: as :func:`~genolong.evaluation.checkpoint.load_eval_model` (default None: the
    run's recipe's, else ``auto``). ``adapter``: a PEFT LoRA adapter directory for the base
    ``checkpoint``, merged into the loaded weights in memory, each rank into its own shards
    (:func:`~genolong.evaluation.checkpoint.merge_adapter`); default None.

    Raises:
        InputError: as :func:`~genolong.evaluation.checkpoint.load_eval_model`; a one-process ``.ckpt``
            file (a single pickle: evaluate its run's export/ directory instead, or in one process).
    """
    if not group.distributed:
        return load_eval_model(checkpoint, dtype=dtype, device=device, kernel_backend=kernel_backend, adapter=adapter)
    if adapter is not None:
        check_adapter(checkpoint, adapter)  # before the base loads
    kernel_backend = scoring_kernel_backend(checkpoint, kernel_backend)
    from ..config import parse_recipe
    from ..model.config import ModelConfig
    from ..model.lm import GenoLM

    path = Path(checkpoint)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "export" / "config.json").is_file():
        path = path / "export"
    export = path.is_dir() and (path / "config.json").is_file()
    sharded = path.is_dir() and path.suffix == ".ckpt" and (path / _DCP_META).is_file()
    if not export and not sharded:
        if path.is_file() and path.suffix == ".ckpt":
            raise InputError(
                f"{path} is a one-process checkpoint file (one pickle of the whole model): evaluate it in one "
                "process, or its run's export/ directory on several"
            )
        raise InputError(
            f"{path} is not a checkpoint: give a directory with config.json + safetensors (a run's export/), "
            "a run directory (runs/NAME) or a sharded runs/NAME/checkpoints/step*.ckpt directory"
        )
    check_weights(path)  # every rank: a damaged file in one line, before anything is read
    vocab = None
    base = None  # a checkpoint's base reference (it then omits the frozen weights)
    if export:
        config = ModelConfig.from_pretrained(path)
        if config.vocab_size != VOCAB_SIZE:
            vocab = VocabMap.from_tokenizer(path, pad=config.pad_token_id, bos=config.bos_token_id)
    else:
        meta = torch.load(path / _DCP_META, map_location="cpu", weights_only=True, mmap=True)
        recipe_data = meta.get("genolong", {}).get("recipe")
        if recipe_data is None:
            raise InputError(
                f"{path} is not a genolong finetune checkpoint (no recipe inside); give a run's export/ directory"
            )
        recipe = parse_recipe(recipe_data, source=str(path))
        base = meta.get("genolong", {}).get("base")
        if recipe.model.lora is not None:
            raise InputError(
                f"{path} is a LoRA run's checkpoint (its recipe sets model.lora): score it in one process, "
                "or score the run's export/ (merged) or its base with --adapter runs/NAME/adapter on several"
            )
        config = recipe.model_config()
        if dtype != torch.float32:
            raise InputError(
                f"{path}: a Lightning checkpoint is evaluated in float32; for --dtype {dtype} evaluate "
                "the run's export/ directory (genolong finetune writes it at the end)"
            )
        mapped = recipe.vocab_map(config)
        vocab = None if mapped == VocabMap.identity() else mapped
    config = config.replace(kernel_backend=kernel_backend)
    if not export and base is not None:
        # a checkpoint of what training changed: the frozen weights from the run's base (sharded
        # loader), the rest from the checkpoint, then every weight in float32
        from .checkpoint import _base_names, _to_float32, base_of_checkpoint

        model = base_of_checkpoint(
            recipe, config, base, path, mesh_fn=lambda m: shard_for_scoring(m, group), device=device
        )
        _fill_from_dcp(model, path, _base_names(model))
        _to_float32(model)
        return model.eval(), vocab
    with torch.device("meta"):
        model = GenoLM(config)
        for param in model.parameters():  # parameters in ``dtype``; buffers keep theirs (the router bias fp32)
            param.data = param.data.to(dtype)
    shard_for_scoring(model, group)
    model.to_empty(device=device)
    if export:
        _fill_from_export(model, path)
    else:
        _fill_from_dcp(model, path)
    if adapter is not None:
        merge_adapter(model, adapter)
    return model.eval(), vocab


def _fill_from_export(model: torch.nn.Module, directory: Path) -> None:
    """Fill a sharded model's local parts from a GLM-5.3-Flash-format directory, reading only this
    rank's rows of each checkpoint tensor: the sharded loader training uses too
    (:func:`genolong.parallel.load.fill_from_safetensors`); floating tensors cast to the
    parameters' dtype, buffers keep theirs."""
    from ..parallel.load import fill_from_safetensors

    fill_from_safetensors(model, directory)


def _fill_from_dcp(model: torch.nn.Module, path: Path, from_base: set[str] | None = None) -> None:
    """Fill a sharded model from a sharded (DCP) finetune checkpoint: ``dcp.load`` into the DTensor
    state dict reads only each rank's parts (resharded from the mesh that wrote it); the
    optimiser states in it are not read. ``from_base``: names already read from the run's base
    that the checkpoint may lack (its frozen weights)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    weights = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
    if from_base:
        stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        weights = {
            k: v for k, v in weights.items() if f"state_dict.{k}" in stored or k.removeprefix("model.") not in from_base
        }
    try:
        dcp.load({"state_dict": weights}, checkpoint_id=path)
    except Exception as error:  # DCP reports a missing key or another shape as a CheckpointException
        raise InputError(f"{path} does not fit its recipe's model ({str(error).splitlines()[-1][:200]})") from error
    set_model_state_dict(
        model, {k.removeprefix("model."): v for k, v in weights.items()}, options=StateDictOptions(strict=not from_base)
    )


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP2 unit of ``model`` all-gathered for the block (a collective; the whole model on
    every rank: for paths that call submodules directly, such as the step-by-step decoder),
    resharded afterwards. While inside, no unit reshards after its forward, so a unit called
    inside (the token embedding, by the decoder) does not all-gather again: the ranks may then
    run different numbers of steps. Nothing happens for a model without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    reshards = [_reshards_after_forward(unit) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshard in zip(units, reshards):
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)


def _reshards_after_forward(unit: torch.nn.Module) -> bool:
    """Whether an FSDP2 unit frees its gathered parameters after forward (as
    :func:`genolong.parallel.parallelize.apply_fsdp` set it)."""
    group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    return group is not None and group.post_forward_mesh_info is not None


def stop_if_signalled(
    stop: SignalFlag, done: int, total: int, work: Path, device: Any, group: ScoringGroup, unit: str = "tiles"
) -> None:
    """Raise :class:`~genolong.errors.Stopped` (the CLI: one line, status 75) if a stop signal
    reached any rank (:meth:`SignalFlag.agree`; a collective in a job of several processes: every
    rank calls it at the same round). Call it at a round boundary: ``done`` work items (``unit``,
    default "tiles") of ``total`` are committed in ``work``, where a rerun of the same command resumes."""
    got = stop.agree(device=device) if group.distributed else stop.local()
    if got:
        raise Stopped(
            f"stopped by {SignalFlag.names(got)} after {done} of {total} {unit}; they are kept in {work}, "
            "where the same command resumes",
            show=group.is_writer,
        )


def raise_on_every_rank(error: str | None, group: ScoringGroup) -> None:
    """Raise :class:`~genolong.errors.InputError` with the writer's ``error`` on every rank, or
    return when it is None (a collective: every rank calls it, the others' ``error`` is ignored).

    A failure one process finds (a resumed run's other settings, a bad variant in its share) must
    end every rank: the others would otherwise wait in the next collective until
    ``parallel.timeout_s``. In one process: raise ``error`` if given."""
    error = broadcast_from_writer(error, group)
    if error is not None:
        raise InputError(error)
