"""The whole recipe (:class:`Recipe`: a name, a seed and the eight sections), its JSON Schema, and
every check a recipe passes after pydantic has validated its types.

The checks are plain functions (:func:`_check`: each value that needs a story, the parallel mesh
against the device count, the schedule against the step budget; :func:`_resolve_model` and the
``_check_*`` functions under it: the window lengths, expert parallelism and recompute segments
against the model's architecture). They live beside the class: :meth:`Recipe.model_config` runs
the model checks (again, once a checkpoint is on disk) and the checks read a Recipe, so in two
modules each would import the other.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import StrictStr

from ..data.alphabet import VOCAB_SIZE
from ..errors import InputError
from ..files import replace_file
from ..model.config import INDEXED_ATTENTION, LINEAR_ATTENTION, PRESETS, ModelConfig
from ..model.vocab import BASE_LETTERS, VocabMap
from .messages import _attribute_docs, _Context, _plain, _short, _show, _suggest_value
from .schema import (
    KDA_CHUNK,
    RECOMPUTE_MODULES,
    SHAPE_FIELDS,
    CheckpointSection,
    DataSection,
    EvalSection,
    LoggingSection,
    MemorySection,
    ModelSection,
    ParallelSection,
    TrainSection,
    _NonNegInt,
    _section,
    kernel_multiple,
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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
        pads = {
            "pad": config.pad_token_id,
            "bos": config.bos_token_id,
            "eos": None if isinstance(config.eos_token_id, list) else config.eos_token_id,
        }
        if isinstance(mode, dict):
            letters = {k: v for k, v in mode.items() if k in BASE_LETTERS.values()}
            vocab = VocabMap.from_mapping(
                letters,
                pad=mode.get("pad", pads["pad"]),
                bos=mode.get("bos", pads["bos"]),
                eos=mode.get("eos", pads["eos"]),
            )
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


@functools.cache
def _recipe_adapter() -> pydantic.TypeAdapter[Recipe]:
    # built on first use (with defer_build on the sections): importing genolong.config stays cheap
    return pydantic.TypeAdapter(Recipe)


#: The Recipe's sections by key, in file order (adding a section to the Recipe adds it here).
_SECTIONS: dict[str, type] = {
    name: tp for name, tp in typing.get_type_hints(Recipe).items() if dataclasses.is_dataclass(tp)
}


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
    for cls in (Recipe, *_SECTIONS.values()):
        node = schema if cls is Recipe else schema["$defs"][cls.__name__]
        node["description"] = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        docs = _attribute_docs(cls)
        for name, prop in node["properties"].items():
            if name in docs:
                prop["description"] = docs[name]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "genolong recipe"}


# -- checks --------------------------------------------------------------------------------------


def _check(recipe: Recipe, ctx: _Context) -> None:
    """Every value and cross-field check; raises the first failure."""

    def need(ok: bool, key: str | tuple[str, ...], message: str) -> None:
        if not ok:
            raise ctx.error(key, message)

    need(
        bool(_NAME_RE.match(recipe.name)),
        "name",
        f"name = {recipe.name!r}: use letters, digits, '.', '_' and '-' only (it names the run directory runs/<name>/)",
    )

    m = recipe.model
    if m.preset is None and m.checkpoint is None:
        raise ctx.error(
            "model",
            "model needs a preset (train from scratch) or a checkpoint (fine-tune), or both; "
            f"e.g. model.preset: small (presets: {', '.join(PRESETS)})",
        )
    if m.preset is not None and m.preset not in PRESETS:
        raise ctx.error(
            "model.preset", f"model.preset = {m.preset!r} is not a preset; {_suggest_value(m.preset, list(PRESETS))}"
        )
    if m.vocab_map == "tokenizer" and m.checkpoint is None:
        raise ctx.error(
            ("model.vocab_map", "model.checkpoint"),
            "model.vocab_map = 'tokenizer' reads the checkpoint's tokenizer.json but model.checkpoint is not set; "
            "set model.checkpoint or give the ids as a mapping {A: id, ...}",
        )
    for i, pattern in enumerate(m.freeze):
        need(
            bool(pattern.strip()),
            "model.freeze",
            f"model.freeze item {i} is empty; give a parameter-name glob such as 'layers.*.mlp.*'",
        )
    if m.lora is not None:
        need(
            not m.freeze,
            ("model.freeze", "model.lora"),
            "model.freeze with model.lora: under LoRA every base weight is frozen already; drop model.freeze "
            "(name modules to train in full in model.lora.modules_to_save)",
        )
        need(
            bool(m.lora.targets) or m.lora.routed_experts,
            "model.lora.targets",
            "model.lora.targets is empty; give module-name globs such as 'layers.*.self_attn.*'",
        )
        for key, patterns in (("targets", m.lora.targets), ("modules_to_save", m.lora.modules_to_save)):
            for i, pattern in enumerate(patterns):
                need(
                    bool(pattern.strip()),
                    f"model.lora.{key}",
                    f"model.lora.{key} item {i} is empty; give a module-name glob such as 'layers.*.self_attn.*'",
                )

    d = recipe.data
    need(
        0.0 <= d.rc_prob <= 1.0,
        "data.rc_prob",
        f"data.rc_prob = {d.rc_prob}: a probability must be in [0, 1] (0 turns reverse complement off)",
    )
    need(
        bool(d.train_split.strip()),
        "data.train_split",
        "data.train_split is empty; name a split of the store (default 'train')",
    )
    need(
        d.eval_split != d.train_split,
        ("data.eval_split", "data.train_split"),
        f"data.eval_split = data.train_split = {d.train_split!r}: evaluating on the training split measures nothing held out; "
        "use the store's held-out split (default 'eval') or null",
    )

    t = recipe.train
    need(t.lr > 0, "train.lr", f"train.lr = {t.lr}: the learning rate must be > 0")
    need(
        0 <= t.min_lr <= t.lr,
        ("train.min_lr", "train.lr"),
        f"train.min_lr = {t.min_lr}: must be in [0, train.lr = {t.lr}] (the cosine decays from lr to min_lr)",
    )
    need(
        t.warmup_steps < t.max_steps,
        ("train.warmup_steps", "train.max_steps"),
        f"train.warmup_steps = {t.warmup_steps}: must be less than train.max_steps = {t.max_steps}; shorten the warm-up or train longer",
    )
    for beta in t.betas:
        need(
            0.0 <= beta < 1.0,
            "train.betas",
            f"train.betas = {_show(t.betas)}: each beta must be in [0, 1), e.g. [0.9, 0.95]",
        )
    need(t.eps > 0, "train.eps", f"train.eps = {t.eps}: must be > 0 (e.g. 1.0e-8)")

    mem = recipe.memory
    for i, module in enumerate(mem.recompute_modules):
        if module not in RECOMPUTE_MODULES:
            raise ctx.error(
                "memory.recompute_modules",
                f"memory.recompute_modules item {i} = {module!r} is not a module type; "
                f"{_suggest_value(module, list(RECOMPUTE_MODULES))}",
            )
    need(
        len(set(mem.recompute_modules)) == len(mem.recompute_modules),
        "memory.recompute_modules",
        f"memory.recompute_modules = {_show(mem.recompute_modules)} lists a module type twice; list each once",
    )
    if mem.recompute == "selective":
        need(
            bool(mem.recompute_modules),
            ("memory.recompute_modules", "memory.recompute"),
            f"memory.recompute = 'selective' needs memory.recompute_modules (any of {', '.join(RECOMPUTE_MODULES)}), e.g. [attn, moe]",
        )
    else:
        need(
            not mem.recompute_modules,
            ("memory.recompute_modules", "memory.recompute"),
            f"memory.recompute_modules = {_show(mem.recompute_modules)} applies only to memory.recompute = 'selective' "
            f"(it is {mem.recompute!r}); set recompute to selective or make the list empty",
        )
    need(
        mem.moe_capacity_factor is None or mem.moe_capacity_factor >= 1.0,
        "memory.moe_capacity_factor",
        f"memory.moe_capacity_factor = {mem.moe_capacity_factor}: must be at least 1.0 (below it tokens are dropped even at "
        "perfectly balanced routing), e.g. 1.25-2.0, or null for no capacity",
    )
    need(
        mem.moe_imbalance >= 1.0,
        "memory.moe_imbalance",
        f"memory.moe_imbalance = {mem.moe_imbalance}: the busiest expert's load over the mean is at least 1.0 (balanced); "
        "the reference saw 4.0",
    )
    need(
        mem.recompute_chunk_tokens % KDA_CHUNK == 0,
        "memory.recompute_chunk_tokens",
        f"memory.recompute_chunk_tokens = {mem.recompute_chunk_tokens:,}: must be a multiple of the KDA chunk of {KDA_CHUNK} "
        f"tokens; use {max(KDA_CHUNK, mem.recompute_chunk_tokens // KDA_CHUNK * KDA_CHUNK):,}",
    )

    p = recipe.parallel
    for key in (
        "devices",
        "num_nodes",
        "cp",
        "dp_replicate",
        "ep",
    ):  # not in the types: callers build ParallelSection directly
        need(getattr(p, key) >= 1, f"parallel.{key}", f"parallel.{key} = {getattr(p, key)}: must be at least 1")
    need(
        p.dp_shard == -1 or p.dp_shard >= 1,
        "parallel.dp_shard",
        f"parallel.dp_shard = {p.dp_shard}: must be at least 1, or -1 for all ranks left",
    )
    world = p.world_size
    if p.dp_shard == -1:
        need(
            world % (p.cp * p.dp_replicate) == 0,
            "parallel",
            f"parallel.cp ({p.cp}) x parallel.dp_replicate ({p.dp_replicate}) = {p.cp * p.dp_replicate} does not divide the "
            f"{world} processes (devices {p.devices} x num_nodes {p.num_nodes}); choose sizes whose product divides {world}",
        )
    else:
        need(
            p.cp * p.dp_shard * p.dp_replicate == world,
            "parallel",
            f"parallel.cp ({p.cp}) x dp_shard ({p.dp_shard}) x dp_replicate ({p.dp_replicate}) = {p.cp * p.dp_shard * p.dp_replicate} "
            f"but there are {world} processes (devices {p.devices} x num_nodes {p.num_nodes}); make the product {world} "
            "or set dp_shard: -1",
        )
    if p.dp_shard != -1 or world % (p.cp * p.dp_replicate) == 0:
        fold = p.dp_shard_size * p.cp  # the ranks of one replica: expert parallelism is drawn from them
        need(
            fold % p.ep == 0,
            ("parallel.ep", "parallel.dp_shard", "parallel.cp"),
            f"parallel.ep = {p.ep} does not divide parallel.dp_shard x parallel.cp = {p.dp_shard_size} x {p.cp} = {fold} "
            f"(the ranks the experts are spread over); choose ep among the divisors of {fold}",
        )

    e = recipe.eval
    need(
        e.every_n_steps == 0 or d.eval_split is not None,
        ("eval.every_n_steps", "data.eval_split"),
        f"eval.every_n_steps = {e.every_n_steps} but data.eval_split is null; name the held-out split or set eval.every_n_steps: 0",
    )

    # the window length against the model: needs the architecture (preset, or the checkpoint's
    # config.json when it is already on disk); a missing checkpoint is checked at run time by
    # Recipe.model_config / Recipe.check_paths
    config = _resolve_model(recipe, ctx, read_checkpoint=True, require_checkpoint=False)
    if config is None:
        _check_context(recipe, None, ctx)


def _resolve_model(
    recipe: Recipe, ctx: _Context | str, *, read_checkpoint: bool, require_checkpoint: bool
) -> ModelConfig | None:
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
        raise ctx.error(
            ("memory.recompute_chunk_tokens", "model"),
            f"memory.recompute_chunk_tokens = {mem.recompute_chunk_tokens:,}: must be a multiple of {unit:,} (whole KDA "
            f"chunks and DSA key pools of this model) under memory.recompute: chunked; use {lower:,}",
        )


def _check_experts(recipe: Recipe, config: ModelConfig, ctx: _Context) -> None:
    """``parallel.ep`` against the model: it must split every MoE layer's routed experts evenly."""
    ep = recipe.parallel.ep
    if ep == 1:
        return
    if "sparse" not in (config.mlp_layer_types or ()):
        raise ctx.error(
            ("parallel.ep", "model"),
            f"parallel.ep = {ep} but the model has no MoE layer (every mlp_layer_types "
            "entry is dense); set parallel.ep: 1",
        )
    if config.n_routed_experts % ep:
        raise ctx.error(
            ("parallel.ep", "model"),
            f"parallel.ep = {ep} does not divide the model's n_routed_experts = "
            f"{config.n_routed_experts}; choose ep among the divisors of {config.n_routed_experts}",
        )


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
            raise ctx.error(
                (key, "parallel.cp", "model"), f"{key} = {length:,}: must be a multiple of {multiple:,} ({why}); {fix}"
            )
        if config is not None and length > config.max_position_embeddings:
            raise ctx.error(
                (key, "model"),
                f"{key} = {length:,} exceeds the model's max_position_embeddings ({config.max_position_embeddings:,}); "
                "use a shorter context or raise model.overrides.max_position_embeddings",
            )
