"""genolong.train: ``genolong finetune``.

- :class:`~genolong.train.module.GenoLMModule`: the LightningModule (loss, AdamW + warm-up/cosine,
  MoE bias balancing, NaN/inf guard, held-out loss; frozen parameters and LoRA adapters);
- :func:`~genolong.train.module.cast_frozen_parameters`: frozen weights stored in bf16 where the
  forward stays the same (:func:`~genolong.train.module.low_precision_parameters`);
- :class:`~genolong.train.callbacks.StepMetrics`: throughput, memory (what the run holds:
  :func:`~genolong.train.callbacks.held_bytes`) and ``steps.jsonl``;
- :func:`~genolong.train.finetune.run`: a recipe -> a trained, checkpointed, exported model (and,
  with ``model.lora``, its PEFT adapter).
"""

from __future__ import annotations

from .callbacks import StepMetrics, held_bytes, read_step_log
from .finetune import FinetuneResult, RunPaths, latest_checkpoint, run
from .module import (
    GenoLMModule,
    NonFiniteLossError,
    OptimSettings,
    cast_frozen_parameters,
    freeze_parameters,
    low_precision_parameters,
)

__all__ = [
    "FinetuneResult",
    "GenoLMModule",
    "NonFiniteLossError",
    "OptimSettings",
    "RunPaths",
    "StepMetrics",
    "cast_frozen_parameters",
    "freeze_parameters",
    "held_bytes",
    "latest_checkpoint",
    "low_precision_parameters",
    "read_step_log",
    "run",
]
