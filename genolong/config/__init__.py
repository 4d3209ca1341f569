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

The package, one way (a module imports only the ones listed before it):

- ``messages``: the wording of an error (a value as YAML writes it, what a type needs, the nearest
  valid key, a field's help line); it knows nothing of the schema.
- ``schema``: the eight section classes, their field types and bounds, :data:`KDA_CHUNK`,
  :data:`SHAPE_FIELDS`, :func:`kernel_multiple` and :func:`reading_changes`.
- ``recipe``: :class:`Recipe`, :func:`recipe_schema` and the checks after validation.
- ``loading``: the YAML loader, ``--set``, :func:`load_recipe`, :func:`parse_recipe`,
  :func:`parse_set`, :func:`recipe_diff`, and pydantic's errors as one-line ``InputError``.
"""

from __future__ import annotations

from .loading import (
    _RecipeLoader,  # noqa: F401 - private, but tests read YAML with it as a recipe is read
    load_recipe,
    parse_recipe,
    parse_set,
    recipe_diff,
)
from .recipe import Recipe, recipe_schema
from .schema import (
    KDA_CHUNK,
    RECOMPUTE_MODULES,
    SHAPE_FIELDS,
    CheckpointSection,
    DataSection,
    EvalSection,
    LoggingSection,
    LoraSection,
    MemorySection,
    ModelSection,
    ParallelSection,
    TrainSection,
    kernel_multiple,
    reading_changes,
)

__all__ = [
    "KDA_CHUNK",
    "RECOMPUTE_MODULES",
    "SHAPE_FIELDS",
    "LoraSection",
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
    "reading_changes",
    "recipe_diff",
    "recipe_schema",
]
