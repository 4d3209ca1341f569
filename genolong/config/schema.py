"""The sections of a recipe: eight frozen pydantic dataclasses, their field types and bounds, and
the window-length constants the kernels impose (:data:`KDA_CHUNK`, :func:`kernel_multiple`).

A section's docstring is its documentation everywhere: its ``Attributes:`` entries describe the
keys in the JSON Schema (``genolong recipe schema``) and give the help of a missing-key error, so
keep one entry per field, in field order. Scalars are strict (no ``"8"`` -> 8, no ``1.0`` -> 1);
a bound that is part of a type (``_Count``: at least 1) is in the JSON Schema too, while the
checks that need several keys or a story are in ``recipe`` (:class:`~genolong.config.Recipe`
holds the sections).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import (
    BeforeValidator,
    ConfigDict,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
)
from typing_extensions import TypedDict

from ..model.config import INDEXED_ATTENTION, LINEAR_ATTENTION, ModelConfig
from ..model.vocab import BASE_LETTERS
from ..parallel.recompute import MODULE_KINDS
from .messages import _recipe_error, _show, _suggest

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
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_shared_experts",
    "n_routed_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "index_head_dim",
    "index_n_heads",
    "index_kpool",
    "linear_head_dim",
    "linear_num_heads",
    "linear_conv_kernel_dim",
    "hc_mult",
    "tie_word_embeddings",
    "attention_bias",
    "layer_types",
    "mlp_layer_types",
    "indexer_types",
)

#: ModelConfig fields that are bookkeeping or say how, not what, the model computes: never a
#: difference in how a checkpoint is read (:func:`reading_changes`).
_NOT_READING_FIELDS = ("extra", "wrapper", "kernel_backend")


def reading_changes(base: ModelConfig, other: ModelConfig) -> dict[str, Any]:
    """The ModelConfig fields in which ``other`` differs from ``base`` while every parameter shape
    stays the same (not :data:`SHAPE_FIELDS`): what to change to read ``base``'s weights as
    ``other``'s model reads its own, e.g. ``{"index_topk": 2048}`` when a fine-tune widens the DSA
    layers' key budget (``model.overrides``). Empty when the two differ in shapes only or not at
    all; ``kernel_backend`` (the same numbers by another implementation) never counts.

    Args:
        base: e.g. a checkpoint's config.json.
        other: e.g. a recipe's :meth:`Recipe.model_config` over that checkpoint.

    Returns:
        ``{field: other's value}`` in field order.
    """
    skip = set(SHAPE_FIELDS) | set(_NOT_READING_FIELDS)
    return {
        f.name: getattr(other, f.name)
        for f in dataclasses.fields(ModelConfig)
        if f.name not in skip and getattr(other, f.name) != getattr(base, f.name)
    }


_VOCAB_MAP_MODES = ("auto", "identity", "tokenizer")
_VOCAB_MAP_KEYS = ("A", "C", "G", "T", "N", "pad", "bos", "eos")
# ModelConfig fields a recipe may override: all but the config.json bookkeeping, plus the
# ``pattern`` shorthand that ModelConfig.replace expands into layer_types ("KKKD").
_MODEL_OVERRIDE_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("extra", "wrapper")
) + ("pattern",)


# -- field types ---------------------------------------------------------------------------------
# pydantic validates the recipe. Strictness is per scalar (StrictInt, StrictFloat, StrictBool,
# StrictStr: no "8" -> 8, no 1.0 -> 1, no 1 -> true; an int is a float): ConfigDict(strict=True)
# would also refuse the YAML mapping of a section and the list of a tuple field.

#: The section classes: frozen, keyword-only (so the Recipe can list its fields in file order)
#: pydantic dataclasses; an unknown key, inf or nan is an error.
_section = pydantic.dataclasses.dataclass(
    frozen=True, kw_only=True, config=ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True)
)
# bounds a value must keep (in the JSON Schema too); the checks with a story are in recipe._check
_Count = Annotated[StrictInt, pydantic.Field(ge=1)]
#: the signals a recipe may name in ``train.stop_signals`` (SIGKILL and SIGSTOP cannot be caught)
StopSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT", "SIGXCPU"]
_NonNegInt = Annotated[StrictInt, pydantic.Field(ge=0)]
_NonNegFloat = Annotated[StrictFloat, pydantic.Field(ge=0)]


def _abspath(value: Any) -> Any:
    """A path value (``str`` or ``os.PathLike``) made absolute against the current directory (see
    genolong.config's docstring); an empty one is an error."""
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
        return typing.Union[tuple(_strict(a) for a in args)]  # noqa: UP007 - a union built at run time
    if origin in (tuple, list):
        return origin[tuple(a if a is Ellipsis else _strict(a) for a in args)]
    return tp


_MODEL_HINTS = typing.get_type_hints(ModelConfig)
#: ``model.overrides``: any ModelConfig field (with its type) and ``pattern``, none required.
_Overrides = TypedDict(  # type: ignore[misc]
    "ModelOverrides",
    {n: StrictStr if n == "pattern" else _strict(_MODEL_HINTS[n]) for n in _MODEL_OVERRIDE_FIELDS},
    total=False,
)
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
            raise _recipe_error(
                f"unknown key {sub}; {_suggest(str(name), _VOCAB_MAP_KEYS, 'model.vocab_map.')}", whole=True
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _recipe_error(
                f"{sub} = {_show(value)}: token ids are non-negative integers; give this model's id for {name}",
                whole=True,
            )
    missing = [b for b in BASE_LETTERS.values() if b not in raw]
    if missing:
        raise _recipe_error(
            f"model.vocab_map lacks {', '.join(missing)}; give a token id for each of A, C, G, T, N", whole=True
        )
    return dict(raw)


_VocabMap = Annotated[
    str | dict[str, int],
    PlainValidator(_vocab_map),
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": list(_VOCAB_MAP_MODES)},
                {
                    "type": "object",
                    "properties": {k: {"type": "integer", "minimum": 0} for k in _VOCAB_MAP_KEYS},
                    "required": list(BASE_LETTERS.values()),
                    "additionalProperties": False,
                },
            ]
        }
    ),
]


# -- sections ------------------------------------------------------------------------------------


@_section
class LoraSection:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the base model's linear layers, in the PEFT format.

    Every matched ``nn.Linear`` of shape ``[out, in]`` gets ``lora_A [rank, in]`` (Kaiming-uniform,
    as PEFT) and ``lora_B [out, rank]`` (zeros), and computes ``base(x) + (alpha / rank) *
    lora_B(lora_A(dropout(x)))``; at step 0 the model is the base model exactly. Under LoRA every
    base weight is frozen (``model.freeze`` is then redundant and refused), the MoE routing biases
    included (they are base state, and the adapter file must describe the whole change); only the
    adapters and ``modules_to_save`` train. A run writes ``runs/NAME/adapter/``
    (``adapter_config.json``, ``adapter_model.safetensors``, as ``peft`` writes them for
    transformers' ``glm5_next``) and the merged model in ``runs/NAME/export/``.

    Attributes:
        rank: the adapters' rank ``r``. Default 16.
        alpha: the scaling numerator: updates are scaled by ``alpha / rank``. Default 32.0.
        dropout: dropout on the adapters' input during training, in [0, 1). Default 0.0.
        targets: ``fnmatch`` globs over GenoLM module names; every matched ``nn.Linear`` gets an
            adapter, e.g. ``["layers.*.self_attn.*"]`` (KDA and DSA projections, the DSA
            indexer's included) or ``["layers.*.mlp.shared_experts.*"]``; a glob that matches no
            linear layer is an error. Required.
        routed_experts: also give every routed expert of every MoE layer its own adapters on
            ``gate_up_proj`` and ``down_proj`` (batched per expert; ``rank`` each). Default False.
        modules_to_save: ``fnmatch`` globs over module names trained in full beside the adapters
            and stored in the adapter file (PEFT's ``modules_to_save``), e.g. ``["norm"]``.
            Default ``()``.
    """

    rank: _Count = 16
    alpha: Annotated[StrictFloat, pydantic.Field(gt=0)] = 32.0
    dropout: Annotated[StrictFloat, pydantic.Field(ge=0, lt=1)] = 0.0
    targets: tuple[StrictStr, ...]
    routed_experts: StrictBool = False
    modules_to_save: tuple[StrictStr, ...] = ()


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
        lora: low-rank adapters (:class:`LoraSection`), or None (train the unfrozen parameters in
            full rank). Default None.
    """

    preset: StrictStr | None = None
    checkpoint: _Path | None = None
    overrides: _Overrides = field(default_factory=dict)  # type: ignore[assignment]
    vocab_map: _VocabMap = "auto"
    freeze: tuple[StrictStr, ...] = ()
    softmask_weight: _NonNegFloat = 1.0
    lora: LoraSection | None = None


_Share = Annotated[StrictFloat, pydantic.Field(ge=0, le=1)]


@_section
class PlantRepeatsSection:
    """Diverged copies of earlier material planted into a share of the training windows, so that
    reading far back pays (:class:`genolong.data.repeats.RepeatPlanting`, whose defaults and
    meaning these keys carry).

    Attributes:
        share: probability that a window gets copies. Default 0.5.
        copies: copies per such window. Default 2.
        min_length, max_length: copy length in bases, uniform. Defaults 50 and 400.
        min_distance, max_distance: copy distance ``d``, log-uniform (``max_distance`` None: up
            to the window). Defaults 64 and None.
        max_divergence: each copy's edit rate is uniform in ``[0, max_divergence]``. Default 0.2.
        indel_share: share of the edits that are 1-3 base indels. Default 0.1.
        inverted: probability that a copy is reverse-complemented. Default 0.5.
    """

    share: _Share = 0.5
    copies: _Count = 2
    min_length: _Count = 50
    max_length: _Count = 400
    min_distance: _Count = 64
    max_distance: _Count | None = None
    max_divergence: _Share = 0.2
    indel_share: _Share = 0.1
    inverted: _Share = 0.5


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
        plant_repeats: plant diverged copies of earlier material into training windows
            (:class:`PlantRepeatsSection`), or None (default): the windows as stored.
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
    plant_repeats: PlantRepeatsSection | None = None


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
        stop_signals: the signals that stop the run cleanly (preemption, a time limit): every
            rank finishes the optimiser step it is in, the ranks agree on that step, a checkpoint
            of it is written, and ``genolong finetune`` exits with status 75
            (:data:`genolong.errors.PREEMPTED_EXIT_CODE`). A rerun (or a requeued SLURM job)
            resumes from it without ``--resume``. Under SLURM, Lightning's requeue signal
            (SIGUSR1) also requeues the job (``scontrol requeue``). ``[]``: no handling (a
            signal ends the process at once, as by default). Default ``[SIGTERM, SIGUSR1]``.
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
    stop_signals: tuple[StopSignal, ...] = ("SIGTERM", "SIGUSR1")


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
        timeout_s: seconds any collective (an FSDP all-gather, a CP exchange, a barrier) may wait
            for the other ranks before the job gives up, on every process group of the job (> 0).
            A rank that stops answering (a hung filesystem, a dead NIC, a stopped process) then
            ends the others within this time plus at most 30 s (naming it) with one line and a
            non-zero exit, instead of torch's 30 min (gloo) or 10 min (NCCL) and a stack trace
            per rank. It must exceed the longest wait a healthy job has at a collective: the
            slowest rank's work between two collectives, the start-up (every rank loading its
            checkpoint shards) and rank 0's own writes while the others wait (the checkpoint
            manifest, the export). Default 300.0 (5 min: minutes above a 1M-token step's
            seconds between collectives, minutes below the library defaults).
    """

    accelerator: Literal["cpu", "gpu", "cuda", "auto"] = "auto"
    devices: StrictInt = 1
    num_nodes: StrictInt = 1
    cp: StrictInt = 1
    dp_shard: StrictInt = -1
    dp_replicate: StrictInt = 1
    ep: StrictInt = 1
    timeout_s: Annotated[StrictFloat, pydantic.Field(gt=0)] = 300.0

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
        async_save: write each checkpoint in the background while the next steps train: the
            state is copied to host memory at the step boundary (the only stall), then written,
            checksummed and renamed into place by a background thread, at most one save in flight;
            a failed write ends the run at the next step boundary. Default False: the copy costs
            host memory the size of this rank's checkpoint (~73 GB per rank for GLM-5.3-Flash on
            64 ranks), which the long-context recipes need for activation offload.
    """

    dir: _Path | None = None
    every_n_steps: _NonNegInt = 100
    keep_last: _Count = 2
    export_safetensors: StrictBool = True
    async_save: StrictBool = False


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
