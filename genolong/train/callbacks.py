"""Training callbacks: per-step throughput and memory, and the machine-readable step log.

:class:`StepMetrics` runs every training batch inside an
:class:`~genolong.memory.meter.ActivationMeter` and logs, through the trainer's loggers (CSV and
TensorBoard) and to ``steps.jsonl`` in the run directory:

- ``perf/step_time_s`` and ``perf/tokens_per_s`` (window tokens of the batch / step time);
- ``memory/saved_activation_bytes`` (peak device-resident saved activations),
  ``memory/offloaded_activation_bytes`` (peak in the host pool), ``memory/peak_bytes`` (CUDA
  ``max_memory_allocated`` on GPU, the process peak RSS on CPU);
- what the run holds, this process's local bytes (DTensor local shards under FSDP2 and expert
  parallelism; :func:`held_bytes`): ``memory/parameter_bytes`` (= ``..._trained_...`` +
  ``..._frozen_...``), ``memory/trained_parameter_bytes``, ``memory/frozen_parameter_bytes``,
  ``memory/gradient_bytes`` (the gradients present at the end of the batch),
  ``memory/optimizer_bytes`` (every tensor of the optimisers' state: AdamW's ``exp_avg``,
  ``exp_avg_sq`` and ``step``; 0 before the first step), and the element counts of the whole
  model ``params/trained`` and ``params/frozen`` (global, not per rank);
- with expert parallelism, ``perf/ep_alltoall_bytes_forward``, ``..._recompute``,
  ``..._backward`` and ``..._splits``: the bytes this process's expert-parallel all-to-alls sent
  to other ranks during the batch (:class:`genolong.parallel.expert.AllToAllCounter`; rank 0's
  in steps.jsonl);
- whatever the module logged for the step (loss, bits per base, lr, MoE load and the per-layer
  routing statistics ``moe/layerL/...``, EP load, ...).

``steps.jsonl`` gets one JSON object per training batch, flushed as it is written: a run killed
at any moment keeps every finished step, and a resumed run appends the steps it redoes (readers
take the last record of each step).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar
from torch.distributed.tensor import DTensor

from ..config import Recipe
from ..memory.meter import ActivationMeter

__all__ = ["SaveRecipe", "StepMetrics", "TrainingBar", "held_bytes", "read_step_log"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def held_bytes(model: torch.nn.Module | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, float]:
    """What a training process holds for its parameters, gradients and optimiser state.

    Args:
        model: the (possibly parallelized) model; None gives zeros.
        optimizers: the run's optimisers (their ``state`` tensors are counted).

    Returns:
        ``memory/parameter_bytes``, ``memory/trained_parameter_bytes`` (``requires_grad``),
        ``memory/frozen_parameter_bytes``, ``memory/gradient_bytes`` (the ``.grad`` tensors
        present now), ``memory/optimizer_bytes`` (every tensor in the optimisers' per-parameter
        state: AdamW's two moments at the parameter's dtype and its 0-d fp32 ``step``), all this
        process's local bytes (a DTensor's local shard), and ``params/trained`` and
        ``params/frozen``, element counts of the whole model (a DTensor's global size). Buffers
        (the MoE routing biases) are not parameters and not counted.
    """
    out = dict.fromkeys(
        (
            "memory/parameter_bytes",
            "memory/trained_parameter_bytes",
            "memory/frozen_parameter_bytes",
            "memory/gradient_bytes",
            "memory/optimizer_bytes",
            "params/trained",
            "params/frozen",
        ),
        0.0,
    )
    if model is None:
        return out
    for param in model.parameters():
        kind = "trained" if param.requires_grad else "frozen"
        out[f"memory/{kind}_parameter_bytes"] += _nbytes(param)
        out[f"params/{kind}"] += param.numel()
        if param.grad is not None:
            out["memory/gradient_bytes"] += _nbytes(param.grad)
    out["memory/parameter_bytes"] = out["memory/trained_parameter_bytes"] + out["memory/frozen_parameter_bytes"]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            out["memory/optimizer_bytes"] += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return out


class SaveRecipe(L.Callback):
    """Writes the resolved recipe into the run directory once, from global rank 0, when the job's
    processes are set up (Lightning's ``setup`` hook runs after the process group exists); the
    other ranks wait for it at a barrier.

    Every rank of a multi-process job runs ``genolong finetune`` from the start (torchrun and SLURM
    start them at the same instant on a shared filesystem): a write before the ranks are known
    would be made by all of them at once.

    Args:
        recipe: the resolved recipe (:meth:`~genolong.config.Recipe.save` writes it atomically).
        path: where, normally ``runs/<name>/recipe.yaml``.
    """

    def __init__(self, recipe: Recipe, path: str | Path):
        self.recipe = recipe
        self.path = Path(path)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.recipe.save(self.path)
        trainer.strategy.barrier("genolong_recipe")


class StepMetrics(L.Callback):
    """Throughput and memory per training batch, and the ``steps.jsonl`` record.

    Args:
        path: the JSONL file (appended to; parents created).
        meter: measure saved activations with an :class:`ActivationMeter` (default True).
    """

    def __init__(self, path: str | Path, meter: bool = True):
        self.path = Path(path)
        self.use_meter = meter
        self._meter: ActivationMeter | None = None
        self._started = 0.0
        self._handle: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("a")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.use_meter:
            meter = ActivationMeter(getattr(pl_module, "model", None))
            self._meter = meter.__enter__()  # set only once entered: on_exception closes it
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        _ep_bytes(pl_module)  # zero the all-to-all counter: the batch's own bytes are read at its end
        self._started = time.perf_counter()

    def _close_meter(self) -> dict[str, Any]:
        if self._meter is None:
            return {}
        self._meter.__exit__(None, None, None)
        summary = self._meter.summary()
        self._meter = None
        return summary

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed = time.perf_counter() - self._started
        memory = self._close_meter()
        tokens = int(batch["tokens"].numel())
        if pl_module.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(pl_module.device))
        else:
            peak = int(memory.get("peak_rss_bytes", 0))
        metrics = {
            "perf/step_time_s": elapsed,
            "perf/tokens_per_s": tokens / max(elapsed, 1e-9),
            "memory/peak_bytes": float(peak),
        }
        if memory:
            metrics["memory/saved_activation_bytes"] = float(memory["peak_resident_bytes"])
            metrics["memory/offloaded_activation_bytes"] = float(memory["peak_offloaded_bytes"])
        metrics.update(held_bytes(getattr(pl_module, "model", None), trainer.optimizers))
        for kind, count in (_ep_bytes(pl_module) or {}).items():
            if kind != "dispatches":
                metrics[f"perf/ep_alltoall_bytes_{kind}"] = float(count)
        pl_module.log_dict(metrics)
        if self._handle is not None:
            record: dict[str, Any] = {"step": trainer.global_step, "batch": batch_idx, "window_tokens": tokens}
            for key, value in {**trainer.callback_metrics, **metrics}.items():
                if key.startswith(("train/", "perf/", "memory/", "params/", "moe/")):
                    record[key] = float(value)
            self._handle.write(json.dumps(record) + "\n")
            self._handle.flush()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._handle is not None and "eval/loss" in trainer.callback_metrics:
            record = {
                "step": trainer.global_step,
                **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("eval/")},
            }
            self._handle.write(json.dumps(record) + "\n")
            self._handle.flush()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close_meter()
        self._close()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def _close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class TrainingBar(ProgressBar):
    """The run's one progress bar (global rank 0, on stderr): optimiser steps out of
    ``max_steps``, with the training loss and, once evaluated, the held-out loss.

    Lightning's own bars count batches per epoch ("Epoch 0/-2" for a run bounded by steps) and open
    a nested "Validation DataLoader" bar at every evaluation; here an evaluation only updates the
    loss shown. Off a terminal (a log file) the bar is redrawn at most every 30 s: a few lines, not
    one per step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._bar: Any = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        from tqdm.auto import tqdm

        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._bar = tqdm(
            total=total,
            initial=trainer.global_step,
            desc="train",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.1 if sys.stderr.isatty() else 30.0,
        )

    def _show(self, trainer: L.Trainer) -> None:
        if self._bar is None:
            return
        shown = {"loss": "train/loss", "eval loss": "eval/loss"}
        metrics = trainer.progress_bar_metrics
        # the losses first: update() draws the bar (when due), with the postfix as it stands
        self._bar.set_postfix({k: f"{float(metrics[m]):.4f}" for k, m in shown.items() if m in metrics}, refresh=False)
        self._bar.update(trainer.global_step - self._bar.n)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._show(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._show(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._show(trainer)
        self._close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _ep_bytes(pl_module: L.LightningModule) -> dict[str, int] | None:
    """The module's expert-parallel all-to-all bytes since the last call (then zeroed), or None."""
    read = getattr(pl_module, "ep_comm_bytes", None)
    return read(reset=True) if callable(read) else None


def read_step_log(path: str | Path) -> dict[int, dict[str, Any]]:
    """``steps.jsonl`` -> {step: last training record of that step} (a resumed run's redone
    steps replace the first attempt's). Evaluation records are skipped."""
    steps: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            steps[int(record["step"])] = record
    return steps
