"""Training recipes: a frozen, fully typed schema and a strict YAML loader.

A recipe is one YAML file with a ``name``, a ``seed`` and eight sections::

    name: 512k                 # run name (default: the file's stem)
    seed: 0                    # seeds model init, window sampling and dropout
    model:      ModelSection       what to train: preset and/or checkpoint, overrides, freezing
    data:       DataSection        the genome store, window length, batch size, workers
    train:      TrainSection       AdamW, warm-up + cosine schedule, clipping, precision, NaN guard
    memory:     MemorySection      recompute, CPU activation offload, MoE / cross-entropy chunks
    parallel:   ParallelSection    devices, nodes, context / data-parallel mesh sizes
    eval:       EvalSection        periodic held-out evaluation
    checkpoint: CheckpointSection  where, how often, how many, safetensors export
    logging:    LoggingSection     where, how often, CSV / TensorBoard / progress bar

:func:`load_recipe` reads a file, applies ``--set a.b=c`` overrides and checks everything before
any work starts: an unknown key is an :class:`~genolong.errors.InputError` naming the full dotted
key and the nearest valid one; a wrong type (``true`` for a number, ``"8"`` for an integer, a
scalar for a list) or an impossible value names the key, the value and the fix; cross-field checks
tie the window length to what the kernels need (KDA chunks of :data:`KDA_CHUNK` tokens, DSA key
pools of ``index_kpool`` tokens, per context-parallel shard), the mesh to the device count and the
schedule to the step budget.

Types, keys and bounds are pydantic v2 models (the sections are frozen pydantic dataclasses with
strict scalars: no ``"8"`` -> 8, no ``1.0`` -> 1); its ``ValidationError`` becomes the one-line
``InputError`` above. :func:`recipe_schema` gives their JSON Schema for editors (``genolong recipe
schema``); the cross-field checks are plain functions run after validation.

Paths: a relative path in a recipe (or in ``--set``) resolves against the **current directory**
(the directory ``genolong`` runs in), not the recipe's directory, so ``store: genome`` in
``recipes/512k.yaml`` means ``./genome`` when run from the repository root. Loaded recipes hold
absolute paths, so the copy a run stores (:meth:`Recipe.save`) names the same files from anywhere.

YAML: values are read with ``yaml.safe_load`` semantics, with one fix: ``1e-4`` is a number (YAML
1.2), not the string PyYAML 1.1 makes of it. Duplicate keys are errors.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BeforeValidator, ConfigDict, PlainValidator, StrictBool, StrictFloat, StrictInt, StrictStr, WithJsonSchema
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from .data.alphabet import VOCAB_SIZE
from .errors import InputError
from .files import replace_file
from .model.config import INDEXED_ATTENTION, LINEAR_ATTENTION, PRESETS, ModelConfig
from .model.vocab import BASE_LETTERS, VocabMap
from .parallel.recompute import MODULE_KINDS

__all__ = [
    "KDA_CHUNK",
    "RECOMPUTE_MODULES",
    "SHAPE_FIELDS",
    "ModelSection",
    "DataSection",
    "TrainSection",
    "MemorySection",
    "ParallelSection",
    "EvalSection",
    "CheckpointSection",
    "LoggingSection",
    "Recipe",
    "load_recipe",
    "parse_recipe",
    "parse_set",
    "kernel_multiple",
    "recipe_diff",
    "recipe_schema",
]

#: Tokens per KDA chunk (``genolong.kernels.kda.chunk_kda``'s default, fla's chunk size). A
#: context-parallel shard must hold whole chunks: KDA passes states between ranks at chunk ends.
KDA_CHUNK = 64

#: Module kinds that ``memory.recompute: selective`` can recompute in backward (the single source
#: is ``genolong.parallel.recompute.MODULE_KINDS``): ``kda`` and ``dsa`` (the token mixers;
#: ``attn`` = both), ``moe`` and ``mlp`` (the MoE and dense feed-forwards; ``ffn`` = both) and
#: ``hc`` (the hyper-connection weights).
RECOMPUTE_MODULES: tuple[str, ...] = tuple(MODULE_KINDS)

#: ModelConfig fields that fix parameter shapes: when a recipe names both a preset and a
#: checkpoint, the checkpoint's config.json must agree with the preset on these.
SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
    "index_head_dim", "index_n_heads", "index_kpool", "linear_head_dim", "linear_num_heads",
    "linear_conv_kernel_dim", "hc_mult", "tie_word_embeddings", "attention_bias", "layer_types",
    "mlp_layer_types", "indexer_types",
)

_VOCAB_MAP_MODES = ("auto", "identity", "tokenizer")
_VOCAB_MAP_KEYS = ("A", "C", "G", "T", "N", "pad", "bos", "eos")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# ModelConfig fields a recipe may override: all but the config.json bookkeeping, plus the
# ``pattern`` shorthand that ModelConfig.replace expands into layer_types ("KKKD").
_MODEL_OVERRIDE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("extra", "wrapper")) + ("pattern",)


# -- field types ---------------------------------------------------------------------------------
# pydantic validates the recipe. Strictness is per scalar (StrictInt, StrictFloat, StrictBool,
# StrictStr: no "8" -> 8, no 1.0 -> 1, no 1 -> true; an int is a float): ConfigDict(strict=True)
# would also refuse the YAML mapping of a section and the list of a tuple field.

#: The section classes: frozen, keyword-only (so the Recipe can list its fields in file order)
#: pydantic dataclasses; an unknown key, inf or nan is an error.
_section = pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True))
# bounds a value must keep (in the JSON Schema too); the checks with a story are in _check
_Count = Annotated[StrictInt, pydantic.Field(ge=1)]
_NonNegInt = Annotated[StrictInt, pydantic.Field(ge=0)]
_NonNegFloat = Annotated[StrictFloat, pydantic.Field(ge=0)]


def _recipe_error(message: str, whole: bool = False) -> PydanticCustomError:
    """A validation error that :func:`_input_error` prints after ``KEY = VALUE (kind): `` (or
    ``whole``: as it is, the message names the key)."""
    return PydanticCustomError("recipe" if whole else "recipe_value", "{message}", {"message": message})


def _abspath(value: Any) -> Any:
    # relative to the current directory (see the module docstring), kept absolute
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value.strip()):
        return Path(os.path.abspath(os.path.expanduser(os.fspath(value))))
    raise _recipe_error("must be a path (a non-empty string)")


_Path = Annotated[Path, BeforeValidator(_abspath)]

_STRICT = {int: StrictInt, float: StrictFloat, bool: StrictBool, str: StrictStr}


def _strict(tp: Any) -> Any:
    """``tp`` (a ModelConfig field type) with its scalars strict (``int | list[int]`` ->
    ``StrictInt | list[StrictInt]``)."""
    if tp in _STRICT:
        return _STRICT[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_strict(a) for a in args)]
    if origin in (tuple, list):
        return origin[tuple(a if a is Ellipsis else _strict(a) for a in args)]
    return tp


_MODEL_HINTS = typing.get_type_hints(ModelConfig)
#: ``model.overrides``: any ModelConfig field (with its type) and ``pattern``, none required.
_Overrides = TypedDict(  # type: ignore[misc]
    "ModelOverrides", {n: StrictStr if n == "pattern" else _strict(_MODEL_HINTS[n]) for n in _MODEL_OVERRIDE_FIELDS}, total=False)
_Overrides.__pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[attr-defined]


def _vocab_map(raw: Any) -> str | dict[str, int]:
    """``model.vocab_map``: a mode name or ``{A: id, C: id, G: id, T: id, N: id[, pad, bos, eos]}``."""
    if isinstance(raw, str) and raw not in _VOCAB_MAP_MODES:
        close = difflib.get_close_matches(raw, _VOCAB_MAP_MODES, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "or give {A: id, C: id, G: id, T: id, N: id}"
        raise _recipe_error(f"must be one of {', '.join(map(repr, _VOCAB_MAP_MODES))} or a mapping of base ids; {hint}")
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, Mapping):
        raise _recipe_error("must be 'auto', 'identity', 'tokenizer' or a mapping {A: id, C: id, G: id, T: id, N: id}")
    for name, value in raw.items():
        sub = f"model.vocab_map.{name}"
        if name not in _VOCAB_MAP_KEYS:
            raise _recipe_error(f"unknown key {sub}; {_suggest(str(name), _VOCAB_MAP_KEYS, 'model.vocab_map.')}", whole=True)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _recipe_error(f"{sub} = {_show(value)}: token ids are non-negative integers; give this model's id for {name}", whole=True)
    missing = [b for b in BASE_LETTERS.values() if b not in raw]
    if missing:
        raise _recipe_error(f"model.vocab_map lacks {', '.join(missing)}; give a token id for each of A, C, G, T, N", whole=True)
    return dict(raw)


_VocabMap = Annotated[str | dict[str, int], PlainValidator(_vocab_map), WithJsonSchema({"anyOf": [
    {"enum": list(_VOCAB_MAP_MODES)},
    {"type": "object", "properties": {k: {"type": "integer", "minimum": 0} for k in _VOCAB_MAP_KEYS},
     "required": list(BASE_LETTERS.values()), "additionalProperties": False},
]})]


# -- sections ------------------------------------------------------------------------------------


@_section
class ModelSection:
    """What to train.

    Attributes:
        preset: a :data:`~genolong.model.config.PRESETS` name (``tiny``, ``small``, ``1b``,
            ``glm-5.3-flash``) or None. Without ``checkpoint`` the model starts from this
            geometry with fresh weights; with one, it is the geometry the checkpoint must have
            (checked against its config.json), which also lets ``genolong plan`` size a run
            before the checkpoint is downloaded. Default None.
        checkpoint: a GLM-5.3-Flash-format directory (config.json + safetensors) to start from,
            or None (train from scratch). Default None. At least one of preset/checkpoint.
        overrides: ModelConfig fields to change (e.g. ``{pattern: KKKD, num_hidden_layers: 4}``
            from scratch, or ``{index_topk: 4096}`` over a checkpoint). Default ``{}``.
        vocab_map: how genolong's base ids reach the model's vocabulary: ``auto`` (identity for
            a nucleotide vocabulary of 8, else ``tokenizer``), ``identity``, ``tokenizer`` (the
            single-letter tokens of the checkpoint's tokenizer.json), or a mapping
            ``{A: id, C: id, G: id, T: id, N: id[, pad: id, bos: id, eos: id]}``. Default ``auto``.
        freeze: glob patterns (``fnmatch``) over parameter names, e.g. ``["embed_tokens.*",
            "layers.*.mlp.*"]``; matching parameters are not trained. Default ``()``.
        softmask_weight: loss weight of soft-masked (lowercase, repeat) target bases; Evo 2 uses
            0.1. Default 1.0.
    """

    preset: StrictStr | None = None
    checkpoint: _Path | None = None
    overrides: _Overrides = field(default_factory=dict)  # type: ignore[assignment]
    vocab_map: _VocabMap = "auto"
    freeze: tuple[StrictStr, ...] = ()
    softmask_weight: _NonNegFloat = 1.0


@_section
class DataSection:
    """The genome store and the training windows (the arguments of :class:`~genolong.data.datamodule.GenomeDataModule`).

    Attributes:
        store: the store directory made by ``genolong prepare`` (required). Which chromosomes
            train and which are held out is fixed there (``--train chr1,chr2 --eval chr22``).
        context: training window length in tokens (required; ``train_length``).
        batch_size: windows per batch per data-parallel group. Default 1.
        rc_prob: probability that a training window is reverse-complemented. Default 0.5.
        num_workers: DataLoader worker processes per rank (0: read in the training process).
            Default 0.
        train_split: the store split training windows come from. Default ``"train"``.
        eval_split: the split held-out evaluation tiles; None for no evaluation. Default ``"eval"``.
        windows_per_epoch: training windows per epoch per data-parallel rank, or None for an
            endless stream (``train.max_steps`` ends the run). Default None.
        verify: check every store file's sha256 when opening the store. Default True.
    """

    store: _Path
    context: _Count
    batch_size: _Count = 1
    rc_prob: StrictFloat = 0.5
    num_workers: _NonNegInt = 0
    train_split: StrictStr = "train"
    eval_split: StrictStr | None = "eval"
    windows_per_epoch: _Count | None = None
    verify: StrictBool = True


@_section
class TrainSection:
    """Optimiser, schedule, precision and the non-finite-loss guard.

    AdamW with a linear warm-up from 0 to ``lr`` over ``warmup_steps`` optimiser steps, then a
    cosine decay to ``min_lr`` at ``max_steps``.

    Attributes:
        max_steps: optimiser steps of the run (required).
        lr: peak learning rate (> 0). Default 1e-4.
        min_lr: learning rate at the end of the cosine (0 <= min_lr <= lr). Default 0.0.
        warmup_steps: linear warm-up steps (< max_steps). Default 0.
        weight_decay: AdamW decoupled weight decay. Default 0.1.
        betas: AdamW (beta1, beta2). Default (0.9, 0.95).
        eps: AdamW epsilon. Default 1e-8.
        grad_clip: clip the global gradient norm to this (0: no clipping). Default 1.0.
        accumulate_grad_batches: batches per optimiser step. Default 1.
        precision: ``"32-true"`` or ``"bf16-mixed"`` (Lightning's names). Default ``"32-true"``.
        max_consecutive_nonfinite: a step with a NaN/inf loss or gradient is skipped; this many
            in a row stop the run. Default 3.
        indexer_kl_weight: weight of the DSA indexer KL loss (the indexer learns to pick the keys
            the main attention uses; 0 freezes it in effect, the KL is still logged). Default 1.0.
        moe_bias_update_rate: step of the MoE routing-bias balancing (DeepSeek-V3's gamma: after
            each step the bias of an overloaded expert drops, of an underloaded one rises; 0 turns
            it off). Default 0.001.
        moe_bias_update: how far the bias moves: ``sign`` (DeepSeek-V3: by the rate, whatever
            the error; made for runs of many thousands of steps) or ``proportional`` (by the rate
            times the relative load error ``(mean - load) / mean``: a collapsed layer moves
            several rates a step, a balanced one barely; for fine-tuning runs of tens to hundreds
            of steps). Default ``sign``.
        moe_balance_loss_weight: weight ``alpha`` of DeepSeek-V3's complementary sequence-wise
            balance loss ``alpha * sum_i f_i P_i`` in every MoE layer (it trains the router
            itself towards equal load within each window; 0: off). DeepSeek-V3 used 1e-4 over
            14.8T tokens; short runs need more (see BENCHMARKS.md). Default 0.0.
        context_cut: train with at most this many bases of context per target: each window is
            cut into pieces of ``context_cut + 1`` tokens sharing one token (the same targets, the
            same loss weights, less context), the short-context control of ``genolong quickstart
            --control``. None (default): the whole window.
    """

    max_steps: _Count
    lr: StrictFloat = 1e-4
    min_lr: StrictFloat = 0.0
    warmup_steps: _NonNegInt = 0
    weight_decay: _NonNegFloat = 0.1
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.95)
    eps: StrictFloat = 1e-8
    grad_clip: _NonNegFloat = 1.0
    accumulate_grad_batches: _Count = 1
    precision: Literal["32-true", "bf16-mixed"] = "32-true"
    max_consecutive_nonfinite: _Count = 3
    indexer_kl_weight: _NonNegFloat = 1.0
    moe_bias_update_rate: _NonNegFloat = 0.001
    moe_bias_update: Literal["sign", "proportional"] = "sign"
    moe_balance_loss_weight: _NonNegFloat = 0.0
    context_cut: _Count | None = None


@_section
class MemorySection:
    """Single-process activation-memory techniques (applied by ``genolong.parallel``).

    Attributes:
        recompute: ``none``, ``selective`` (the module types in ``recompute_modules``),
            ``full`` (every layer: only layer inputs are kept; backward rebuilds a whole layer) or
            ``chunked`` (only layer inputs are kept, as ``full``, but backward rebuilds the
            attention half and the feed-forward half of a block separately, each in pieces of
            ``recompute_chunk_tokens`` tokens, so the largest rebuilt region no longer grows with
            the sequence). Default ``none``.
        recompute_modules: for ``selective``, any of :data:`RECOMPUTE_MODULES` (e.g. ``[attn,
            moe]``: both token mixers and the MoE). Default ``()``.
        offload: move saved activations to (pinned) host memory during forward and bring them
            back during backward. Default False.
        offload_min_bytes: offload only saved tensors at least this large. Default 1 MiB.
        moe_chunk_tokens: MoE dispatch chunk in tokens (bounds per-expert buffers), or None for
            all tokens at once. Default None.
        ce_chunk_tokens: rows per chunk of the fused LM-head cross-entropy. Default 4096.
        recompute_chunk_tokens: for ``chunked``, tokens rebuilt at a time (a multiple of the KDA
            chunk, :data:`KDA_CHUNK`). Default 16384.
        moe_capacity_factor: a hard bound on each routed expert's rows in training: at most
            ``ceil(factor x mean)`` (token, slot) rows per expert per MoE token chunk; the rows
            over it (lowest routing weight first) are dropped, counted and logged. For a memory
            bound you can rely on (the plan sizes the dispatch for it); null: nothing dropped.
            Default None.
        moe_imbalance: the busiest expert's (and EP rank's) load over the mean that ``genolong
            plan`` sizes the MoE dispatch for (the reference saw 4x); with
            ``moe_capacity_factor`` the plan takes the smaller of the two. Default 4.0.
    """

    recompute: Literal["none", "selective", "full", "chunked"] = "none"
    recompute_modules: tuple[StrictStr, ...] = ()
    offload: StrictBool = False
    offload_min_bytes: _NonNegInt = 1 << 20
    moe_chunk_tokens: _Count | None = None
    ce_chunk_tokens: _Count = 4096
    recompute_chunk_tokens: _Count = 16384
    moe_capacity_factor: StrictFloat | None = None
    moe_imbalance: StrictFloat = 4.0


@_section
class ParallelSection:
    """Devices and the parallel mesh: ``cp * dp_shard * dp_replicate = devices * num_nodes``.

    Attributes:
        accelerator: ``cpu``, ``gpu``, ``cuda`` or ``auto`` (Lightning's names). Default ``auto``.
        devices: processes (GPUs) per node. Default 1.
        num_nodes: nodes. Default 1.
        cp: context-parallel size: each window is cut into ``cp`` contiguous shards, one per rank
            of a group. Default 1.
        dp_shard: FSDP (sharded data-parallel) size, or -1 for all ranks left after ``cp`` and
            ``dp_replicate``. Default -1.
        dp_replicate: replicated data-parallel size (HSDP: replicas of a sharded group). Default 1.
        ep: expert-parallel size: each MoE layer's routed experts are split over ``ep`` ranks
            drawn from the ``dp_shard x cp`` ranks of a replica (folded into the mesh, no extra
            GPUs), tokens travel to their experts' ranks by all-to-all; must divide
            ``dp_shard x cp`` and the model's ``n_routed_experts``. Default 1.
    """

    accelerator: Literal["cpu", "gpu", "cuda", "auto"] = "auto"
    devices: StrictInt = 1
    num_nodes: StrictInt = 1
    cp: StrictInt = 1
    dp_shard: StrictInt = -1
    dp_replicate: StrictInt = 1
    ep: StrictInt = 1

    @property
    def world_size(self) -> int:
        """All processes: ``devices * num_nodes``."""
        return self.devices * self.num_nodes

    @property
    def dp_shard_size(self) -> int:
        """``dp_shard`` with -1 resolved to ``world_size / (cp * dp_replicate)``."""
        return self.world_size // (self.cp * self.dp_replicate) if self.dp_shard == -1 else self.dp_shard

    @property
    def dp_size(self) -> int:
        """Data-parallel groups (each sees its own windows): ``dp_shard_size * dp_replicate``."""
        return self.dp_shard_size * self.dp_replicate


@_section
class EvalSection:
    """Periodic held-out evaluation during training (the full tables come from ``genolong evaluate``).

    Attributes:
        every_n_steps: evaluate every this many optimiser steps (0: never during training).
            Default 0.
        max_tiles: evaluate at most this many tiles of the eval split (in order), or None for
            all. Default None.
        context: eval tile length in tokens, or None for ``data.context``. Default None.
        batch_size: tiles per eval batch. Default 1.
    """

    every_n_steps: _NonNegInt = 0
    max_tiles: _Count | None = None
    context: _Count | None = None
    batch_size: _Count = 1


@_section
class CheckpointSection:
    """Lightning checkpoints (with the window sampler state) and the safetensors export.

    Attributes:
        dir: checkpoint directory; None (default) resolves to ``runs/<name>/checkpoints``.
        every_n_steps: save every this many optimiser steps (0: only at the end). Default 100.
        keep_last: keep this many most recent checkpoints. Default 2.
        export_safetensors: at the end, also write the model in the GLM-5.3-Flash checkpoint
            format (config.json + safetensors) beside the checkpoints. Default True.
    """

    dir: _Path | None = None
    every_n_steps: _NonNegInt = 100
    keep_last: _Count = 2
    export_safetensors: StrictBool = True


@_section
class LoggingSection:
    """Per-step metrics.

    Attributes:
        dir: log directory; None (default) resolves to ``runs/<name>/logs``.
        every_n_steps: log every this many optimiser steps. Default 1.
        csv: write ``metrics.csv``. Default True.
        tensorboard: write TensorBoard event files. Default True.
        progress_bar: show a progress bar. Default True.
        moe_collapse_steps: warn (once per run) when a MoE layer has experts that got no token,
            or one expert that took over half the tokens, for this many steps in a row. Default 20.
    """

    dir: _Path | None = None
    every_n_steps: _Count = 1
    csv: StrictBool = True
    tensorboard: StrictBool = True
    progress_bar: StrictBool = True
    moe_collapse_steps: _Count = 20


@_section
class Recipe:
    """A whole training recipe (see the module docstring); build it with :func:`load_recipe`.

    Attributes:
        name: run name (letters, digits, ``.``, ``_``, ``-``); default the recipe file's stem.
        seed: non-negative seed of model init, window sampling and everything random. Default 0.
        model, data, train, memory, parallel, eval, checkpoint, logging: the sections.
    """

    name: StrictStr
    seed: _NonNegInt = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection
    train: TrainSection
    memory: MemorySection = field(default_factory=MemorySection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    @property
    def eval_context(self) -> int:
        """Eval tile length: ``eval.context``, or ``data.context`` when that is None."""
        return self.data.context if self.eval.context is None else self.eval.context

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-safe dict of every key (paths as strings, tuples as lists), in schema order.

        ``parse_recipe(recipe.to_dict()) == recipe``.
        """
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(Recipe)}

    def to_yaml(self) -> str:
        """:meth:`to_dict` as YAML text (``load_recipe`` of it gives an equal recipe)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_yaml` to ``path`` atomically (a temporary file unique to this call, fsynced,
        then renamed); returns it."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = f"# resolved recipe {self.name!r}: every key, paths absolute\n" + self.to_yaml()
        replace_file(out, lambda tmp: tmp.write_text(text), durable=True)
        return out

    def model_config(self) -> ModelConfig:
        """The model's architecture, checked against the rest of the recipe.

        From ``model.checkpoint``'s config.json when a checkpoint is named (it must then match
        ``model.preset`` on :data:`SHAPE_FIELDS`, when a preset is named too), else from
        ``model.preset``; ``model.overrides`` applied on top.

        Raises:
            InputError: unreadable checkpoint config, a preset/checkpoint mismatch, or a window
                length the model cannot take (see :func:`kernel_multiple`).
        """
        config = _resolve_model(self, "recipe", read_checkpoint=True, require_checkpoint=True)
        assert config is not None
        return config

    def vocab_map(self, config: ModelConfig | None = None) -> VocabMap:
        """The :class:`~genolong.model.vocab.VocabMap` of ``model.vocab_map``.

        Args:
            config: the resolved model config (default: :meth:`model_config`).

        Raises:
            InputError: ``tokenizer`` mode without a checkpoint tokenizer, or ids outside the
                model's vocabulary.
        """
        config = self.model_config() if config is None else config
        mode = self.model.vocab_map
        pads = {"pad": config.pad_token_id, "bos": config.bos_token_id, "eos": None if isinstance(config.eos_token_id, list) else config.eos_token_id}
        if isinstance(mode, dict):
            letters = {k: v for k, v in mode.items() if k in BASE_LETTERS.values()}
            vocab = VocabMap.from_mapping(letters, pad=mode.get("pad", pads["pad"]), bos=mode.get("bos", pads["bos"]), eos=mode.get("eos", pads["eos"]))
        elif mode == "identity" or (mode == "auto" and config.vocab_size == VOCAB_SIZE):
            vocab = VocabMap.identity()
        else:
            if self.model.checkpoint is None:
                raise InputError(
                    f"model.vocab_map = {mode!r} needs the checkpoint's tokenizer.json but model.checkpoint is not set; "
                    "give the ids as model.vocab_map: {A: id, C: id, G: id, T: id, N: id}"
                )
            vocab = VocabMap.from_tokenizer(self.model.checkpoint, **pads)
        too_big = [i for i in vocab.ids if i >= config.vocab_size]
        if too_big:
            raise InputError(
                f"model.vocab_map gives token ids {too_big} but the model's vocab_size is {config.vocab_size}; "
                "use ids of this model's vocabulary"
            )
        return vocab

    def check_paths(self) -> None:
        """Check that the input paths exist (call before starting a run; loading does not).

        Raises:
            InputError: ``data.store`` is not a directory with a manifest.json, or
                ``model.checkpoint`` is not a directory with a config.json.
        """
        if not (self.data.store / "manifest.json").is_file():
            raise InputError(
                f"data.store = {str(self.data.store)!r} is not a genome store (no manifest.json); "
                "create it with `genolong prepare FASTA --out DIR` or fix the path (relative paths are "
                "taken from the current directory)"
            )
        ckpt = self.model.checkpoint
        if ckpt is not None and not (ckpt / "config.json").is_file():
            raise InputError(
                f"model.checkpoint = {str(ckpt)!r} is not a checkpoint directory (no config.json); "
                "point it at a GLM-5.3-Flash-format directory, or remove it to train model.preset from scratch"
            )


# -- public helpers ------------------------------------------------------------------------------


def kernel_multiple(config: ModelConfig, cp: int = 1) -> int:
    """The number of tokens a window length must be a multiple of, for ``config`` at CP size ``cp``.

    Each context-parallel shard (``context / cp`` tokens) must hold whole KDA chunks
    (:data:`KDA_CHUNK`; only if the model has KDA layers) and whole DSA key pools
    (``index_kpool``; only if it has DSA layers): ``cp * lcm(those)``.
    """
    assert config.layer_types is not None
    unit = 1
    if LINEAR_ATTENTION in config.layer_types:
        unit = math.lcm(unit, KDA_CHUNK)
    if INDEXED_ATTENTION in config.layer_types:
        unit = math.lcm(unit, config.index_kpool)
    return cp * unit


def parse_set(item: str) -> tuple[str, Any]:
    """Split one ``--set`` item ``a.b=c`` into ``("a.b", value)``; the value is parsed as YAML.

    ``--set train.lr=3e-4`` gives a float, ``--set data.eval_split=null`` None,
    ``--set model.freeze=[embed_tokens.*]`` a list. Key validity is checked by :func:`load_recipe`.

    Raises:
        InputError: no ``=``, a malformed key, or a value that is not valid YAML.
    """
    if not isinstance(item, str) or "=" not in item:
        raise InputError(f"--set {item!r}: write KEY=VALUE with a dotted key, e.g. --set train.lr=3e-4")
    key, text = item.split("=", 1)
    key = key.strip()
    if not _KEY_RE.match(key):
        raise InputError(f"--set {item!r}: {key!r} is not a dotted key; write e.g. --set data.context=131072")
    try:
        value = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InputError(f"--set {item!r}: the value is not valid YAML ({_one_line(exc)}); quote it or fix it") from None
    return key, value


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply ``--set`` overrides, and check everything.

    Args:
        path: the YAML file.
        overrides: ``"a.b=c"`` items (see :func:`parse_set`), applied in order on top of the file.

    Returns:
        The recipe; relative paths resolved against the current directory, ``checkpoint.dir``
        and ``logging.dir`` defaulted under ``runs/<name>/``.

    Raises:
        InputError: a missing or unparsable file, an unknown key (with the nearest valid key), a
            wrong type, an impossible value or an inconsistent combination; one line naming the
            key, the value and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"recipe {str(path)!r} does not exist; give the path of a recipe YAML file (see recipes/)") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise InputError(f"recipe {str(path)!r} is not a readable YAML text file ({exc})") from None
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InputError(f"recipe {str(path)!r} is not valid YAML: {_one_line(exc)}") from None
    if data is None:
        data = {}
    return parse_recipe(data, overrides, name=path.stem, source=f"recipe {str(path)!r}")


def parse_recipe(data: Mapping[str, Any], overrides: Sequence[str] = (), *, name: str | None = None, source: str = "recipe") -> Recipe:
    """Build a checked :class:`Recipe` from a dict as read from YAML (see :func:`load_recipe`).

    Args:
        data: the recipe mapping (``Recipe.to_dict()`` output, or parsed YAML).
        overrides: ``"a.b=c"`` items applied on top.
        name: default run name when ``data`` has none.
        source: how error messages name the input (e.g. ``"recipe 'recipes/512k.yaml'"``).

    Raises:
        InputError: as :func:`load_recipe`.
    """
    if not isinstance(data, Mapping):
        raise InputError(f"{source}: the top level must be a mapping of sections (model:, data:, train:, ...), got {_kind(data)}")
    raw: dict[str, Any] = _deep_copy(data)
    if isinstance(overrides, str):
        overrides = (overrides,)
    sets: dict[str, str] = {}
    for item in overrides:
        key, value = parse_set(item)
        _check_set_key(key, item)
        _assign(raw, key, value, item)
        sets[key] = item
    if name is not None and "name" not in raw:
        raw["name"] = name
    # an empty section (every key commented out) reads as null: take it as {}
    for section in ("model", "data", "train", "memory", "parallel", "eval", "checkpoint", "logging"):
        if section in raw and raw[section] is None:
            raw[section] = {}
    if isinstance(raw.get("model"), dict) and raw["model"].get("overrides", {}) is None:
        raw["model"]["overrides"] = {}
    ctx = _Context(source, sets)
    try:
        recipe = _recipe_adapter().validate_python(raw)
    except pydantic.ValidationError as exc:
        first = min(exc.errors(include_url=False), key=lambda e: _rank(e["loc"]))
        raise _input_error(first, raw, ctx) from None
    recipe = _finish(recipe)
    _check(recipe, ctx)
    return recipe


def recipe_diff(a: Recipe, b: Recipe) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two recipes: ``{key: (value in a, value in b)}``.

    Use it on ``--resume`` to show what changed since the stored recipe.
    """
    flat_a, flat_b = _flatten(a.to_dict()), _flatten(b.to_dict())
    keys = list(flat_a) + [k for k in flat_b if k not in flat_a]
    return {k: (flat_a.get(k), flat_b.get(k)) for k in keys if flat_a.get(k) != flat_b.get(k)}


def recipe_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a recipe file, from the section models, each key
    described by its section's docstring. ``genolong recipe schema --out recipe.schema.json`` writes
    it; an editor with a YAML language server then completes and checks recipes that start with
    ``# yaml-language-server: $schema=recipe.schema.json``.

    The cross-field checks (window length against the kernels, the mesh against the devices) are
    :func:`load_recipe`'s, not the schema's.
    """
    schema = _recipe_adapter().json_schema()
    schema["required"].remove("name")  # the file's stem by default
    for cls in (Recipe, *_SECTIONS):
        node = schema if cls is Recipe else schema["$defs"][cls.__name__]
        node["description"] = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        docs = _attribute_docs(cls)
        for name, prop in node["properties"].items():
            if name in docs:
                prop["description"] = docs[name]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "genolong recipe"}

# -- YAML ----------------------------------------------------------------------------------------


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.2) and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if isinstance(key, (str, int, float, bool)) and key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} at line {line}; keep one", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


# -- building ------------------------------------------------------------------------------------


class _Context:
    """Where values came from, for error messages: the file, or a ``--set`` item."""

    def __init__(self, source: str, sets: Mapping[str, str]):
        self.source = source
        self.sets = sets

    def error(self, key: str | tuple[str, ...], message: str) -> InputError:
        """An InputError for ``message`` about dotted ``key`` (or the keys a cross-field check
        involves), prefixed with the ``--set`` item that last set one of them, else the source."""
        keys = (key,) if isinstance(key, str) else key
        origin = self.source
        for set_key, item in self.sets.items():
            if any(k == set_key or k.startswith(set_key + ".") or set_key.startswith(k + ".") for k in keys):
                origin = f"--set {item!r}"
        return InputError(f"{origin}: {message}")


@functools.cache
def _recipe_adapter() -> pydantic.TypeAdapter[Recipe]:
    # built on first use (with defer_build on the sections): importing genolong.config stays cheap
    return pydantic.TypeAdapter(Recipe)


_SECTIONS = (ModelSection, DataSection, TrainSection, MemorySection, ParallelSection, EvalSection, CheckpointSection, LoggingSection)
_HINTS: dict[Any, dict[str, Any]] = {}


def _hints(cls: Any) -> dict[str, Any]:
    """Field name -> type (``Annotated`` and ``Strict*`` stripped to the plain type), in order."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _field_types(tp: Any) -> dict[str, Any] | None:
    """The keys a mapping of type ``tp`` may hold (a section, the Recipe, model.overrides) with
    their types; None for a plain value."""
    return _hints(tp) if tp is _Overrides or dataclasses.is_dataclass(tp) else None


def _suggest(key: str, valid: Sequence[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return f"valid keys{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"


def _attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of a section's docstring, one plain line each (no reST roles)."""
    docs: dict[str, str] = {}
    name = None
    for line in inspect.cleandoc(cls.__doc__ or "").partition("Attributes:")[2].splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            docs[name] = match.group(2)
        elif name is not None and line.startswith("        "):
            docs[name] += " " + line.strip()
    return {k: re.sub(r":\w+:`~?([^`]+)`", r"\1", v).replace("``", "") for k, v in docs.items()}


def _field_help(cls: type, name: str) -> str:
    return _attribute_docs(cls).get(name, name).split(". ")[0].rstrip(".")


def _input_error(error: Mapping[str, Any], raw: Mapping[str, Any], ctx: _Context) -> InputError:
    """One pydantic validation error as genolong's one-line InputError: the dotted key (from the
    error's ``loc``), the value as written, what was expected and the fix (from the field's type)."""
    loc, kind = error["loc"], error["type"]
    parent: Any = None
    tp: Any = Recipe
    parts: list[str] = []
    value: Any = raw
    for part in loc:
        fields = _field_types(tp)
        if fields is None or part not in fields:
            break
        parent, tp = tp, fields[part]
        parts.append(part)
        value = value.get(part) if isinstance(value, Mapping) else None
    rest, key = loc[len(parts):], ".".join(parts)
    if kind == "recipe":  # a message written whole by a validator (model.vocab_map)
        return ctx.error(key, error["msg"])
    if kind in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):
        prefix, name = (key + "." if key else ""), str(rest[0])
        note = " (not a ModelConfig field)" if tp is _Overrides else ""
        return ctx.error(prefix + name, f"unknown key {prefix}{name}{note}; {_suggest(name, list(_hints(tp)), prefix)}")
    if kind == "missing" and not rest:
        while dataclasses.is_dataclass(tp):  # a whole section left out: name its first required key
            parent = tp
            name = next(f.name for f in dataclasses.fields(tp) if f.default is f.default_factory is dataclasses.MISSING)
            key, tp = f"{key}.{name}", _hints(tp)[name]
        return ctx.error(key, f"missing required key {key}; add it to the recipe ({_field_help(parent, key.rsplit('.', 1)[-1])})")
    if _field_types(tp) is not None:
        what = "mapping of ModelConfig fields (e.g. {num_hidden_layers: 4})" if tp is _Overrides else "mapping of keys"
        return ctx.error(key, f"{key or 'the recipe'} must be a {what}, got {_kind(value)} {value!r}")
    if kind in ("too_long", "too_short") or (kind == "missing" and rest):
        message = f"must be {_describe(tp)}, got {len(value)}"
    elif kind == "recipe_value":
        message = error["msg"]
    elif kind in ("greater_than_equal", "finite_number"):
        bound = error.get("ctx", {}).get("ge")
        message = "must be a finite number" if bound is None else "must be at least 1" if bound == 1 else f"must be >= {bound:g}"
        optional = type(None) in typing.get_args(tp)
        return ctx.error(key, f"{key} = {_show(value)}: {message}{' (or null)' if optional and bound == 1 else ''}")
    elif rest and isinstance(rest[0], int) and typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        item = args[0] if args[-1] is Ellipsis else args[rest[0]]
        message = f"item {rest[0]} ({error['input']!r}) {_expected(item, error['input'])}"
    else:
        message = _expected(tp, value)
    return ctx.error(key, f"{key} = {_show(value)} ({_kind(value)}): {message}")


def _rank(loc: tuple[Any, ...]) -> tuple[int, ...]:
    """Sort key of an error: the recipe's field order (an unknown key first in its mapping)."""
    tp: Any = Recipe
    out = []
    for part in loc:
        fields = _field_types(tp) or {}
        names = list(fields)
        out.append(names.index(part) if part in names else -1 if names or not isinstance(part, int) else part)
        tp = fields.get(part)
    return tuple(out)


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    plain = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path", type(None): "null"}
    if tp in plain:
        return plain[tp]
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {'' if args[-1] is Ellipsis or origin is list else f'{len(args)} '}{_plural(args[0])}"
    return "a mapping" if origin in (dict, Mapping) or tp in (dict, Mapping) else str(tp)


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, _describe(tp))


def _expected(tp: Any, value: Any) -> str:
    """What type ``tp`` needs, said to someone who wrote ``value``, with the fix."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1 and value is not None:
            return f"{_expected(options[0], value)} (or null)"
        return f"must be {_describe(tp)}" + (", not null" if value is None else "")
    if value is None:
        return f"must be {_describe(tp)}, not null; give a value or delete the key for the default"
    if typing.get_origin(tp) is Literal:
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.5)
        return f"must be {_describe(tp)}" + (f"; did you mean {close[0]!r}?" if close else "")
    if tp in (int, float) and isinstance(value, bool):
        return f"must be {_describe(tp)}, not true/false" + ("; write a whole number" if tp is int else "")
    if tp in (int, float) and isinstance(value, str):
        return f"must be {_describe(tp)}; write " + ("the number without quotes" if tp is int else "it without quotes (e.g. 3.0e-4)")
    if tp is int and isinstance(value, float) and value.is_integer():
        return f"must be an integer; write {int(value)} without a decimal point or exponent"
    fixes = {bool: " (unquoted)", str: "; put it in quotes", tuple: "; write a YAML list in brackets, e.g. [a, b]"}
    return f"must be {_describe(tp)}{fixes.get(typing.get_origin(tp) or tp, '')}"


def _show(value: Any) -> str:
    """A value as YAML writes it inline (true, null, 'text', [1, 2])."""
    if value is None or isinstance(value, (bool, list, tuple, Mapping)):
        text = yaml.safe_dump(_plain(value), default_flow_style=True).replace("\n...", "")
        return " ".join(text.split())
    return repr(value)


def _kind(value: Any) -> str:
    kinds = ((type(None), "null"), (bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
             ((list, tuple), "a list"), (Mapping, "a mapping"))
    return next((name for types_, name in kinds if isinstance(value, types_)), type(value).__name__)


def _finish(recipe: Recipe) -> Recipe:
    """Fill the name-dependent defaults (run directories under ``runs/<name>/``)."""
    if recipe.checkpoint.dir is None:
        recipe = dataclasses.replace(recipe, checkpoint=dataclasses.replace(recipe.checkpoint, dir=_abspath(f"runs/{recipe.name}/checkpoints")))
    if recipe.logging.dir is None:
        recipe = dataclasses.replace(recipe, logging=dataclasses.replace(recipe.logging, dir=_abspath(f"runs/{recipe.name}/logs")))
    return recipe


# -- --set ---------------------------------------------------------------------------------------


def _check_set_key(key: str, item: str) -> None:
    """Reject a ``--set`` key that names nothing in the schema (with the nearest valid key)."""
    parts = key.split(".")
    tp: Any = Recipe
    for depth, part in enumerate(parts):
        prefix = "".join(p + "." for p in parts[:depth])
        fields = _field_types(tp)
        if fields is None:
            if parts[depth - 1] == "vocab_map" and depth == len(parts) - 1:
                return  # one base id: model.vocab_map.A=5 (the validator checks the name)
            raise InputError(f"--set {item!r}: {prefix[:-1]} is a single value, it has no key {part!r}; set {prefix[:-1]} itself")
        if part not in fields:
            note = " (not a ModelConfig field)" if tp is _Overrides else ""
            raise InputError(f"--set {item!r}: unknown key {prefix}{part}{note}; {_suggest(part, list(fields), prefix)}")
        tp = fields[part]


def _assign(raw: dict[str, Any], key: str, value: Any, item: str) -> None:
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or (part == "vocab_map" and isinstance(child, str)):
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise InputError(f"--set {item!r}: {where} in the recipe is {child!r}, not a mapping; fix the recipe or set {where} whole")
        node = child
    node[parts[-1]] = value


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep_copy(v) for v in value]
    return value


# -- checks --------------------------------------------------------------------------------------


def _check(recipe: Recipe, ctx: _Context) -> None:
    """Every value and cross-field check; raises the first failure."""

    def need(ok: bool, key: str | tuple[str, ...], message: str) -> None:
        if not ok:
            raise ctx.error(key, message)

    need(bool(_NAME_RE.match(recipe.name)), "name",
         f"name = {recipe.name!r}: use letters, digits, '.', '_' and '-' only (it names the run directory runs/<name>/)")

    m = recipe.model
    if m.preset is None and m.checkpoint is None:
        raise ctx.error("model", "model needs a preset (train from scratch) or a checkpoint (fine-tune), or both; "
                                 f"e.g. model.preset: small (presets: {', '.join(PRESETS)})")
    if m.preset is not None and m.preset not in PRESETS:
        raise ctx.error("model.preset", f"model.preset = {m.preset!r} is not a preset; {_suggest_value(m.preset, list(PRESETS))}")
    if m.vocab_map == "tokenizer" and m.checkpoint is None:
        raise ctx.error(("model.vocab_map", "model.checkpoint"),
                        "model.vocab_map = 'tokenizer' reads the checkpoint's tokenizer.json but model.checkpoint is not set; "
                        "set model.checkpoint or give the ids as a mapping {A: id, ...}")
    for i, pattern in enumerate(m.freeze):
        need(bool(pattern.strip()), "model.freeze", f"model.freeze item {i} is empty; give a parameter-name glob such as 'layers.*.mlp.*'")

    d = recipe.data
    need(0.0 <= d.rc_prob <= 1.0, "data.rc_prob", f"data.rc_prob = {d.rc_prob}: a probability must be in [0, 1] (0 turns reverse complement off)")
    need(bool(d.train_split.strip()), "data.train_split", "data.train_split is empty; name a split of the store (default 'train')")
    need(d.eval_split != d.train_split, ("data.eval_split", "data.train_split"),
         f"data.eval_split = data.train_split = {d.train_split!r}: evaluating on the training split measures nothing held out; "
         "use the store's held-out split (default 'eval') or null")

    t = recipe.train
    need(t.lr > 0, "train.lr", f"train.lr = {t.lr}: the learning rate must be > 0")
    need(0 <= t.min_lr <= t.lr, ("train.min_lr", "train.lr"), f"train.min_lr = {t.min_lr}: must be in [0, train.lr = {t.lr}] (the cosine decays from lr to min_lr)")
    need(t.warmup_steps < t.max_steps, ("train.warmup_steps", "train.max_steps"),
         f"train.warmup_steps = {t.warmup_steps}: must be less than train.max_steps = {t.max_steps}; shorten the warm-up or train longer")
    for beta in t.betas:
        need(0.0 <= beta < 1.0, "train.betas", f"train.betas = {_show(t.betas)}: each beta must be in [0, 1), e.g. [0.9, 0.95]")
    need(t.eps > 0, "train.eps", f"train.eps = {t.eps}: must be > 0 (e.g. 1.0e-8)")

    mem = recipe.memory
    for i, module in enumerate(mem.recompute_modules):
        if module not in RECOMPUTE_MODULES:
            raise ctx.error("memory.recompute_modules", f"memory.recompute_modules item {i} = {module!r} is not a module type; "
                                                        f"{_suggest_value(module, list(RECOMPUTE_MODULES))}")
    need(len(set(mem.recompute_modules)) == len(mem.recompute_modules), "memory.recompute_modules",
         f"memory.recompute_modules = {_show(mem.recompute_modules)} lists a module type twice; list each once")
    if mem.recompute == "selective":
        need(bool(mem.recompute_modules), ("memory.recompute_modules", "memory.recompute"),
             f"memory.recompute = 'selective' needs memory.recompute_modules (any of {', '.join(RECOMPUTE_MODULES)}), e.g. [attn, moe]")
    else:
        need(not mem.recompute_modules, ("memory.recompute_modules", "memory.recompute"),
             f"memory.recompute_modules = {_show(mem.recompute_modules)} applies only to memory.recompute = 'selective' "
             f"(it is {mem.recompute!r}); set recompute to selective or make the list empty")
    need(mem.moe_capacity_factor is None or mem.moe_capacity_factor >= 1.0, "memory.moe_capacity_factor",
         f"memory.moe_capacity_factor = {mem.moe_capacity_factor}: must be at least 1.0 (below it tokens are dropped even at "
         "perfectly balanced routing), e.g. 1.25-2.0, or null for no capacity")
    need(mem.moe_imbalance >= 1.0, "memory.moe_imbalance",
         f"memory.moe_imbalance = {mem.moe_imbalance}: the busiest expert's load over the mean is at least 1.0 (balanced); "
         "the reference saw 4.0")
    need(mem.recompute_chunk_tokens % KDA_CHUNK == 0, "memory.recompute_chunk_tokens",
         f"memory.recompute_chunk_tokens = {mem.recompute_chunk_tokens:,}: must be a multiple of the KDA chunk of {KDA_CHUNK} "
         f"tokens; use {max(KDA_CHUNK, mem.recompute_chunk_tokens // KDA_CHUNK * KDA_CHUNK):,}")

    p = recipe.parallel
    for key in ("devices", "num_nodes", "cp", "dp_replicate", "ep"):  # not in the types: callers build ParallelSection directly
        need(getattr(p, key) >= 1, f"parallel.{key}", f"parallel.{key} = {getattr(p, key)}: must be at least 1")
    need(p.dp_shard == -1 or p.dp_shard >= 1, "parallel.dp_shard", f"parallel.dp_shard = {p.dp_shard}: must be at least 1, or -1 for all ranks left")
    world = p.world_size
    if p.dp_shard == -1:
        need(world % (p.cp * p.dp_replicate) == 0, "parallel",
             f"parallel.cp ({p.cp}) x parallel.dp_replicate ({p.dp_replicate}) = {p.cp * p.dp_replicate} does not divide the "
             f"{world} processes (devices {p.devices} x num_nodes {p.num_nodes}); choose sizes whose product divides {world}")
    else:
        need(p.cp * p.dp_shard * p.dp_replicate == world, "parallel",
             f"parallel.cp ({p.cp}) x dp_shard ({p.dp_shard}) x dp_replicate ({p.dp_replicate}) = {p.cp * p.dp_shard * p.dp_replicate} "
             f"but there are {world} processes (devices {p.devices} x num_nodes {p.num_nodes}); make the product {world} "
             "or set dp_shard: -1")
    if p.dp_shard != -1 or world % (p.cp * p.dp_replicate) == 0:
        fold = p.dp_shard_size * p.cp  # the ranks of one replica: expert parallelism is drawn from them
        need(fold % p.ep == 0, ("parallel.ep", "parallel.dp_shard", "parallel.cp"),
             f"parallel.ep = {p.ep} does not divide parallel.dp_shard x parallel.cp = {p.dp_shard_size} x {p.cp} = {fold} "
             f"(the ranks the experts are spread over); choose ep among the divisors of {fold}")

    e = recipe.eval
    need(e.every_n_steps == 0 or d.eval_split is not None, ("eval.every_n_steps", "data.eval_split"),
         f"eval.every_n_steps = {e.every_n_steps} but data.eval_split is null; name the held-out split or set eval.every_n_steps: 0")

    # the window length against the model: needs the architecture (preset, or the checkpoint's
    # config.json when it is already on disk); a missing checkpoint is checked at run time by
    # Recipe.model_config / Recipe.check_paths
    config = _resolve_model(recipe, ctx, read_checkpoint=True, require_checkpoint=False)
    if config is None:
        _check_context(recipe, None, ctx)


def _suggest_value(value: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(value, valid, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(map(repr, valid))}"


def _resolve_model(recipe: Recipe, ctx: _Context | str, *, read_checkpoint: bool, require_checkpoint: bool) -> ModelConfig | None:
    """The recipe's ModelConfig (see :meth:`Recipe.model_config`), context-checked; None when the
    architecture is unknown (checkpoint not on disk, no preset) and ``require_checkpoint`` is False."""
    if isinstance(ctx, str):
        ctx = _Context(ctx, {})
    m = recipe.model
    overrides = dict(m.overrides)
    preset: ModelConfig | None = None
    if m.preset is not None:
        try:
            preset = ModelConfig.from_preset(m.preset, **overrides)
        except InputError as exc:
            key = "model.overrides" if overrides else "model.preset"
            raise ctx.error(key, f"{key}: {exc}") from None
    config = preset
    ckpt = m.checkpoint
    if ckpt is not None and (require_checkpoint or (read_checkpoint and (ckpt / "config.json").is_file())):
        try:
            loaded = ModelConfig.from_pretrained(ckpt)
        except InputError as exc:
            raise ctx.error("model.checkpoint", f"model.checkpoint: {exc}") from None
        try:
            config = loaded.replace(**overrides) if overrides else loaded
        except InputError as exc:
            raise ctx.error("model.overrides", f"model.overrides over {str(ckpt)!r}: {exc}") from None
        if preset is not None:
            for name in SHAPE_FIELDS:
                if getattr(config, name) != getattr(preset, name):
                    raise ctx.error(
                        ("model.checkpoint", "model.preset", "model.overrides"),
                        f"model.checkpoint {str(ckpt)!r} has {name} = {_short(getattr(config, name))} but model.preset "
                        f"{m.preset!r} has {_short(getattr(preset, name))}; point model.checkpoint at a {m.preset!r} "
                        "checkpoint or remove model.preset",
                    )
    if config is not None:
        _check_context(recipe, config, ctx)
        _check_experts(recipe, config, ctx)
        _check_recompute_chunk(recipe, config, ctx)
    return config


def _check_recompute_chunk(recipe: Recipe, config: ModelConfig, ctx: _Context) -> None:
    """``memory.recompute_chunk_tokens`` against the model under ``chunked`` recompute: segments of
    whole KDA chunks and whole DSA key pools (a DSA query segment selects over whole pools)."""
    mem = recipe.memory
    if mem.recompute != "chunked":
        return
    unit = kernel_multiple(config)
    if mem.recompute_chunk_tokens % unit:
        lower = max(unit, mem.recompute_chunk_tokens // unit * unit)
        raise ctx.error(("memory.recompute_chunk_tokens", "model"),
                        f"memory.recompute_chunk_tokens = {mem.recompute_chunk_tokens:,}: must be a multiple of {unit:,} (whole KDA "
                        f"chunks and DSA key pools of this model) under memory.recompute: chunked; use {lower:,}")


def _check_experts(recipe: Recipe, config: ModelConfig, ctx: _Context) -> None:
    """``parallel.ep`` against the model: it must split every MoE layer's routed experts evenly."""
    ep = recipe.parallel.ep
    if ep == 1:
        return
    if "sparse" not in (config.mlp_layer_types or ()):
        raise ctx.error(("parallel.ep", "model"), f"parallel.ep = {ep} but the model has no MoE layer (every mlp_layer_types "
                                                  "entry is dense); set parallel.ep: 1")
    if config.n_routed_experts % ep:
        raise ctx.error(("parallel.ep", "model"), f"parallel.ep = {ep} does not divide the model's n_routed_experts = "
                                                  f"{config.n_routed_experts}; choose ep among the divisors of {config.n_routed_experts}")


def _short(value: Any) -> str:
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) < 60 else text[:57] + "..."


def _check_context(recipe: Recipe, config: ModelConfig | None, ctx: _Context) -> None:
    """Window lengths (train and eval) against the kernels and the CP size."""
    cp = recipe.parallel.cp
    if config is None:
        multiple, why = cp * KDA_CHUNK, f"the KDA chunk of {KDA_CHUNK} tokens"
    else:
        multiple = kernel_multiple(config, cp)
        parts = []
        assert config.layer_types is not None
        if LINEAR_ATTENTION in config.layer_types:
            parts.append(f"the KDA chunk of {KDA_CHUNK} tokens")
        if INDEXED_ATTENTION in config.layer_types:
            parts.append(f"the DSA key pool of {config.index_kpool} tokens")
        why = " and ".join(parts)
    if cp > 1:
        why = f"parallel.cp = {cp} shards, each holding whole units of {why}"
    for key, length in (("data.context", recipe.data.context), ("eval.context", recipe.eval.context)):
        if length is None:
            continue
        if length % multiple:
            lower, upper = length // multiple * multiple, (length // multiple + 1) * multiple
            fix = f"use {upper:,}" if lower == 0 else f"use {lower:,} or {upper:,}"
            raise ctx.error((key, "parallel.cp", "model"), f"{key} = {length:,}: must be a multiple of {multiple:,} ({why}); {fix}")
        if config is not None and length > config.max_position_embeddings:
            raise ctx.error((key, "model"), f"{key} = {length:,} exceeds the model's max_position_embeddings ({config.max_position_embeddings:,}); "
                                 "use a shorter context or raise model.overrides.max_position_embeddings")


# -- output --------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value and key not in ("overrides", "vocab_map"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
