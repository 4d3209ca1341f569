"""genolong.train: ``genolong finetune``.

- :class:`~genolong.train.module.GenoLMModule`: the LightningModule (loss, AdamW + warm-up/cosine,
  MoE bias balancing, NaN/inf guard, held-out loss);
- :class:`~genolong.train.callbacks.StepMetrics`: throughput, memory and ``steps.jsonl``;
- :func:`~genolong.train.finetune.run`: a recipe -> a trained, checkpointed, exported model.
"""

from __future__ import annotations

from .callbacks import StepMetrics, read_step_log
from .finetune import FinetuneResult, RunPaths, latest_checkpoint, run
from .module import GenoLMModule, NonFiniteLossError, OptimSettings, freeze_parameters

__all__ = [
    "FinetuneResult",
    "GenoLMModule",
    "NonFiniteLossError",
    "OptimSettings",
    "RunPaths",
    "StepMetrics",
    "freeze_parameters",
    "latest_checkpoint",
    "read_step_log",
    "run",
]
