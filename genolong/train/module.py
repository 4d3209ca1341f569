"""The LightningModule around GenoLM: loss, optimiser and schedule, MoE bias balancing, NaN guard.

The model is built in :meth:`GenoLMModule.configure_model` (Lightning's ``ModelParallelStrategy``
calls it once the process group exists), then ``genolong.parallel.parallelize`` applies the
memory techniques and, in a multi-process job, context parallelism and FSDP2 over the job's
``(dp_replicate, dp_shard, cp)`` mesh.

In a multi-process job every rank of a context-parallel group receives the same windows (the data
module shards by data-parallel rank) and runs the model on its contiguous slice; the loss a rank
backpropagates is its NLL sum over the *global* count of targets (one all-reduce of two scalars
per step), and FSDP2 sums the gradients over the ranks, so the step is the one a single process
would take on the whole global batch. Logged losses, the indexer KL, the MoE loads (and so the
routing-bias updates, identical on every rank) and the validation loss are reduced over all ranks.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config.schema import LoraSection
from ..data.alphabet import PAD
from ..data.windows import context_cut_spans, context_parallel_bounds
from ..errors import GenolongError, InputError
from ..model.config import KEEP_FP32
from ..model.dsa import DSAMixer
from ..model.lm import GenoLM
from ..model.loss import bits_per_base
from ..model.moe import MoE, RoutingStats, moe_layers
from ..model.vocab import VocabMap
from ..parallel.expert import ep_comm_counter
from ..parallel.load import to_meta
from ..parallel.mesh import ParallelSizes, build_mesh, cp_rank, cp_size, dp_size, ep_size

__all__ = [
    "BIAS_UPDATES",
    "KEEP_FP32",
    "GenoLMModule",
    "NonFiniteLossError",
    "OptimSettings",
    "WarmupCosine",
    "cast_frozen_parameters",
    "clip_grad_norm_by_mesh",
    "cut_windows",
    "freeze_parameters",
    "low_precision_parameters",
    "routing_bias_step",
]

log = logging.getLogger("genolong")

#: Rules of the routing-bias update (``OptimSettings.moe_bias_update``, see :func:`routing_bias_step`).
BIAS_UPDATES = ("sign", "proportional")


class NonFiniteLossError(GenolongError):
    """Too many consecutive steps with a NaN/inf loss or gradient."""


@dataclass(frozen=True)
class OptimSettings:
    """AdamW with linear warm-up and cosine decay.

    Attributes:
        lr: peak learning rate.
        min_lr: final learning rate (the cosine ends there at ``max_steps``).
        warmup_steps: linear warm-up steps from ``lr / warmup_steps``.
        max_steps: optimiser steps of the run.
        weight_decay: decoupled weight decay of matrices (norm weights, biases and the other
            1-D parameters get none).
        betas: AdamW betas.
        eps: AdamW epsilon.
        moe_bias_rate: aux-loss-free router balancing (DeepSeek-V3's gamma): after every step each
            MoE's ``e_score_correction_bias`` moves towards equal expert load by this much (0: off).
        moe_bias_update: ``"sign"`` (DeepSeek-V3: every bias moves by ``moe_bias_rate``) or
            ``"proportional"`` (by ``moe_bias_rate`` times the expert's relative load error; see
            :func:`routing_bias_step`).
        moe_balance_loss_weight: ``alpha`` of the sequence-wise balance loss of every MoE layer
            (:mod:`genolong.model.moe`; 0: off).
    """

    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_steps: int = 0
    max_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    moe_bias_rate: float = 0.001
    moe_bias_update: str = "sign"
    moe_balance_loss_weight: float = 0.0


class WarmupCosine:
    """``LambdaLR`` factor: linear warm-up to 1, then cosine down to ``min_ratio`` at ``max_steps``.

    A class, not a closure, so that the scheduler's ``state_dict`` holds plain numbers (checkpoints
    load with ``weights_only=True``).
    """

    def __init__(self, warmup_steps: int, max_steps: int, min_ratio: float):
        self.warmup_steps, self.max_steps, self.min_ratio = int(warmup_steps), int(max_steps), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.max_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def freeze_parameters(model: torch.nn.Module, patterns: Sequence[str]) -> int:
    """Set ``requires_grad=False`` on parameters whose name matches any glob in ``patterns``
    (e.g. ``"embed_tokens.*"``, ``"layers.*.mlp.experts.*"``); returns how many elements froze.

    Raises:
        GenolongError: a pattern that matches no parameter (a typo would silently train everything).
    """
    frozen = 0
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise GenolongError(f"freeze pattern {pattern!r} matches no parameter (names look like {names[1]!r})")
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def low_precision_parameters(model: torch.nn.Module) -> list[str]:
    """The parameters of ``model`` that a frozen run may hold in a low-precision dtype, by name.

    The rule: the weight and bias of every ``nn.Linear`` (LoRA's wrapped base layers included) and
    the routed experts' ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, but none that
    matches :data:`KEEP_FP32` and none that another kind of module also holds (a head tied to the
    embedding). Every use of these is a matmul (``F.linear``, ``einsum`` over ``kv_b_proj``'s
    weight, the LM head's ``rows @ W.T``) that autocast runs in bf16 in a ``bf16-mixed`` run
    anyway: a bf16 copy stored once is the copy autocast makes from the fp32 master at every
    step, so the forward is bitwise unchanged. Everything else stays fp32 because bf16 storage
    would change the math: the embedding (a lookup: a bf16 table would put the residual stream in
    bf16), the norm and mHC weights, the KDA gate parameters, the DSA indexer's pooling
    parameters and the router, which the model reads in fp32 arithmetic (``.float()``, fp32
    promotion). At GLM-5.3-Flash scale the rule covers all but ~0.7B of the 313B parameters
    (the embedding, 0.63B, is most of the rest).
    """
    from ..model.moe import Experts

    keep: set[int] = set()
    cast: dict[int, str] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            names = ("weight", "bias")
        elif isinstance(module, Experts):
            names = ("gate_up_proj", "down_proj")
        else:
            names = ()
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if name in names and not KEEP_FP32.search(full):
                cast.setdefault(id(param), full)
            else:
                keep.add(id(param))
    return [name for key, name in cast.items() if key not in keep]


def cast_frozen_parameters(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen (``requires_grad=False``) parameter that :func:`low_precision_parameters`
    allows in ``dtype``, in place (the ``nn.Parameter`` objects stay, their data is replaced):
    a frozen weight then costs only its storage, with no fp32 master, no gradient and no
    optimiser state. Trained parameters are untouched. Returns how many elements were cast.

    Call it before FSDP2 shards the model (it then shards and gathers the frozen weights in
    ``dtype``) and only in a ``bf16-mixed`` run: in ``32-true`` the weights are read in fp32.

    Under LoRA the adapted layers' own forward (``base(x) + B A x``) is unchanged too; where the
    model reads an adapted layer's matrix (DSA's absorbed ``kv_b_proj``, the routed experts with
    adapters) the effective weight ``W + s B A`` is formed in the base's dtype
    (:class:`genolong.model.lora.LoraLinear`), so there a bf16 base rounds the sum once more
    than autocast of an fp32 sum would: bf16 rounding, not bitwise.
    """
    allowed = set(low_precision_parameters(model))
    cast = 0
    for name, param in model.named_parameters():
        if name in allowed and not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += param.numel()
    return cast


def cut_windows(tokens: torch.Tensor, cut: int) -> torch.Tensor:
    """Cut windows ``[B, T]`` into ``[B * n, cut + 1]`` pieces that score the same targets with at
    most ``cut`` bases of context each (:func:`genolong.data.windows.context_cut_spans`); a short
    last piece is right-padded with PAD, which is never a target and, being after every real
    token, never seen by one (the model is causal). ``cut >= T - 1`` returns ``tokens`` itself."""
    spans = context_cut_spans(tokens.shape[1], cut)
    if len(spans) == 1:
        return tokens
    pieces = tokens.new_full((tokens.shape[0], len(spans), cut + 1), PAD)
    for k, (start, stop) in enumerate(spans):
        pieces[:, k, : stop - start] = tokens[:, start:stop]
    return pieces.reshape(-1, cut + 1)


def routing_bias_step(load: torch.Tensor, rate: float, rule: str = "sign") -> torch.Tensor:
    """The change of one MoE layer's ``e_score_correction_bias`` after a step with expert loads
    ``load [E]``: towards equal load, ``rate * sign(mean - load)`` (``"sign"``, DeepSeek-V3) or
    ``rate * (mean - load) / mean`` (``"proportional"``: an expert with no row rises by ``rate``,
    one with ``E/k`` x the mean, every token's, falls by ``(E/k - 1) rate``; a nearly balanced
    layer barely moves, where ``sign`` keeps jittering by ``rate``). Returns ``[E]`` float32."""
    load = load.float()
    mean = load.mean()
    if rule == "sign":
        return rate * torch.sign(mean - load)
    if rule == "proportional":
        return rate * (mean - load) / mean.clamp_min(1e-9)
    raise ValueError(f"moe_bias_update must be one of {BIAS_UPDATES}, got {rule!r}")


def _mesh_of(param: torch.Tensor) -> Any:
    """The device mesh of a DTensor parameter (None for a plain tensor)."""
    return param.device_mesh if isinstance(param, DTensor) else None


def clip_grad_norm_by_mesh(parameters: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global 2-norm of the gradients of ``parameters`` to ``max_norm``, for parameters
    that are DTensors on different device meshes (dense FSDP2 and expert-parallel ones): the norm
    of each mesh's gradients (a full reduction over that mesh), summed in squares, then torch's
    ``clip_grads_with_norm_`` per mesh. Returns the total norm (a plain 0-d tensor), as
    ``torch.nn.utils.clip_grad_norm_`` does; equal to it up to float summation order."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(_mesh_of(p), []).append(p)
    squares = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2)
    total = (torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)).float()
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over all ranks of the job (``x`` itself in a single process)."""
    if _distributed():
        x = x.clone()
        dist.all_reduce(x)
    return x


class GenoLMModule(L.LightningModule):
    """Trains a :class:`GenoLM` on store windows.

    Args:
        build_model: returns the plain model (from a preset or ``GenoLM.from_pretrained``); called
            once, in :meth:`configure_model`.
        optim: optimiser and schedule settings.
        parallelize: ``(model, mesh) -> model`` applying the memory techniques and parallelism
            (``genolong.parallel.parallelize`` with the recipe's settings bound; ``mesh`` is None
            in a single process); default identity.
        parallel: the recipe's ``parallel`` section (``cp``, ``dp_shard``, ``dp_replicate``):
            the mesh built in a multi-process job (default None: one process only).
        softmask_weight: loss weight of soft-masked bases (default 1.0).
        ce_chunk_tokens: rows per chunk of the cross-entropy (default 4096).
        vocab: base ids -> the checkpoint's token ids (default None: nucleotide ids).
        freeze: parameter-name globs not trained (default none).
        max_consecutive_nonfinite: stop after this many NaN/inf steps in a row (default 5).
        indexer_kl_weight: weight of the DSA indexer KL (mean over the full-indexer layers) added to
            the loss; it trains only the indexers (default 1.0; 0: logged, not trained).
        extra_checkpoint_state: plain data stored in every checkpoint (the resolved recipe).
        context_cut: train each target with at most this many bases of context (windows cut by
            :func:`cut_windows`; the short-context control); default None: whole windows.
        moe_capacity_factor: per-expert capacity over the mean rows per token chunk, over it rows
            are dropped (``MoE.capacity_factor``; default None: no capacity).
        moe_collapse_steps: warn (once per run) when some experts of a layer got no token, or one
            expert took over half the tokens, for this many steps in a row (default 20).
        lora: low-rank adapters (the recipe's ``model.lora``,
            :class:`~genolong.config.schema.LoraSection`), applied by
            :func:`genolong.model.lora.apply_lora` before ``parallelize``: every base weight is
            frozen, only the adapters (and ``modules_to_save``) train, and the MoE routing-bias
            update is off (the biases are base state; the adapter must describe the whole
            change). Default None: no adapters.
        frozen_dtype: store the frozen parameters (``freeze``, or the base under ``lora``) in this
            dtype (:func:`cast_frozen_parameters`), e.g. ``torch.bfloat16`` in a ``bf16-mixed``
            run; default None: every parameter stays as built (``32-true``).
        load_weights: ``(model, kept, device) -> None`` for a ``build_model`` that returns a
            meta-device model (the sharded loader): called once the model is parallelized, it
            allocates each rank's shards, puts back ``kept`` (the adapters LoRA drew before the
            model went to meta: :func:`genolong.parallel.load.to_meta`) and reads the base's
            weights into them (:func:`genolong.parallel.load.materialize`,
            :func:`~genolong.parallel.load.fill_from_safetensors`). Default None: ``build_model``
            returns real weights.
        checkpoint_frozen: whether checkpoints hold the frozen parameters (default True). False
            when they can be read from the base checkpoint again (``--resume``): a checkpoint
            then holds only what training changes (trained parameters, buffers, optimiser state,
            loop and data position, RNG); the strategy saves and restores accordingly
            (:class:`genolong.train.finetune.AtomicModelParallelStrategy`).

    Batches are the data module's: ``tokens`` torch.long ``[B, T]`` (store tokens, case kept).
    Logged every step: ``train/loss`` (nats per counted base), ``train/bits_per_base``,
    ``train/tokens`` (counted targets), ``train/indexer_kl``, ``train/lr``, ``train/moe_load_max_over_mean`` (worst
    layer), ``train/moe_dead_experts`` (experts without a row this step, all layers),
    ``train/moe_balance_loss`` (mean over layers of ``sum_i f_i P_i``, when the loss is on),
    ``train/moe_dropped_fraction`` (with a capacity) and per MoE layer ``L`` (its index in the
    model) ``moe/layerL/load_max_over_mean``, ``moe/layerL/dead_fraction``,
    ``moe/layerL/router_entropy`` (mean nats per token) and ``moe/layerL/dropped_fraction``
    (with a capacity), all over the global batch; ``train/nonfinite_steps``; with expert
    parallelism also ``train/ep_rows/rank{r}`` (the (token, slot) rows global rank ``r``'s
    experts received, summed over the MoE layers) and
    ``train/ep_load_max_over_mean`` (busiest EP rank over its group's mean, worst layer and group:
    the reference's 4x figure); the callbacks add throughput, memory and the all-to-all bytes.
    """

    def __init__(
        self,
        build_model: Callable[[], GenoLM],
        optim: OptimSettings,
        parallelize: Callable[[GenoLM, DeviceMesh | None], GenoLM] | None = None,
        parallel: ParallelSizes | None = None,
        softmask_weight: float = 1.0,
        ce_chunk_tokens: int = 4096,
        vocab: VocabMap | None = None,
        freeze: Sequence[str] = (),
        max_consecutive_nonfinite: int = 5,
        indexer_kl_weight: float = 1.0,
        extra_checkpoint_state: Mapping[str, Any] | None = None,
        context_cut: int | None = None,
        moe_capacity_factor: float | None = None,
        moe_collapse_steps: int = 20,
        lora: LoraSection | None = None,
        frozen_dtype: torch.dtype | None = None,
        load_weights: Callable[[GenoLM, Mapping[str, torch.Tensor], torch.device], None] | None = None,
        checkpoint_frozen: bool = True,
    ):
        super().__init__()
        if optim.moe_bias_update not in BIAS_UPDATES:
            raise InputError(
                f"train.moe_bias_update must be one of {', '.join(BIAS_UPDATES)}, got {optim.moe_bias_update!r}"
            )
        self.moe_capacity_factor = moe_capacity_factor
        self.moe_collapse_steps = moe_collapse_steps
        self.context_cut = context_cut
        self.build_model = build_model
        self.optim = optim
        self.parallelize_fn = parallelize
        self.parallel = parallel
        self.mesh: DeviceMesh | None = None
        self.softmask_weight = softmask_weight
        self.ce_chunk_tokens = ce_chunk_tokens
        self.vocab = vocab
        self.freeze = tuple(freeze)
        if lora is not None and self.freeze:
            raise InputError("model.freeze beside model.lora: LoRA freezes every base weight itself; drop model.freeze")
        self.lora = lora
        self.frozen_dtype = frozen_dtype
        self.load_weights = load_weights
        self.checkpoint_frozen = checkpoint_frozen
        self.lora_modules: list[str] = []  # the module names apply_lora wrapped
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.indexer_kl_weight = indexer_kl_weight
        self.extra_checkpoint_state = dict(extra_checkpoint_state or {})
        self.model: GenoLM | None = None
        self.indexers: list[DSAMixer] = []
        self.moes: list[MoE] = []
        self.moe_layers: list[int] = []  # model layer index of each of self.moes
        self._step_routing: list[RoutingStats] = []  # per MoE layer, summed over ranks
        self._step_balance: float | None = None  # mean over layers of sum_i f_i P_i, over ranks
        self._dead_streak: torch.Tensor | None = None  # [layers, E] steps in a row without a row
        self._hog_streak: torch.Tensor | None = None  # [layers] steps in a row one expert took > 1/2
        self._collapse_warned = False
        self._step_received: torch.Tensor | None = None  # [world, MoE layers] rows each rank's experts received
        self.consecutive_nonfinite = 0
        self.nonfinite_steps = 0

    # -- model -------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the model once (Lightning may call this hook again, e.g. for validation)."""
        if self.model is not None:
            return
        model = self.build_model()
        if self.lora is not None:
            from ..model.lora import apply_lora

            self.lora_modules = apply_lora(model, self.lora)
            if self.optim.moe_bias_rate > 0 and moe_layers(model) and self.global_rank == 0:
                log.info(
                    "genolong: the MoE routing-bias update (train.moe_bias_update_rate %g) is off under model.lora: "
                    "the routing biases are base state, and the adapter must describe the whole change",
                    self.optim.moe_bias_rate,
                )
        if self.freeze:
            freeze_parameters(model, self.freeze)
        if self.frozen_dtype is not None:
            # before parallelize: FSDP2 then shards and gathers the frozen weights in this dtype
            # (on a meta model only the dtype changes: the shards are allocated in it)
            cast_frozen_parameters(model, self.frozen_dtype)
        meta = any(p.is_meta for p in model.parameters())
        if meta and self.load_weights is None:
            raise InputError("GenoLMModule: build_model returned a meta-device model but no load_weights fills it")
        # LoRA's adapters, drawn on the CPU when applied to the meta base: kept aside while the
        # model is sharded on the meta device, each rank's part put back once allocated
        kept = to_meta(model) if meta else {}
        self.indexers = [m for m in model.modules() if isinstance(m, DSAMixer) and m.indexer is not None]
        moes = moe_layers(model)
        self.moes, self.moe_layers = [m for _, _, m in moes], [index for _, index, _ in moes]
        for moe in self.moes:
            moe.capacity_factor = self.moe_capacity_factor
            moe.balance_loss_weight = self.optim.moe_balance_loss_weight * self._balance_loss_scale()
        for mixer in self.indexers:
            mixer.indexer_kl = True
        if _distributed():
            if self.parallel is None:
                raise InputError("a multi-process run needs the recipe's parallel section (GenoLMModule(parallel=...))")
            self.mesh = build_mesh(self.parallel, world_size=dist.get_world_size(), device_type=self.device.type)
            if cp_size(self.mesh) > 1 and self.context_cut is not None:
                raise InputError(
                    "train.context_cut trains short pieces one process can hold: set parallel.cp: 1 with it"
                )
        self.model = self.parallelize_fn(model, self.mesh) if self.parallelize_fn is not None else model
        if meta:
            assert self.load_weights is not None
            # each rank's shards allocated in their dtypes and read from the base (genolong.parallel.load)
            self.load_weights(self.model, kept, self.device)

    def _balance_loss_scale(self) -> float:
        """The balance loss's share on this rank: each rank adds the mean loss of its own rows (a
        window, or its CP slice) and FSDP sums the gradients over the ranks, and Lightning divides
        the model's loss (not this one) by the accumulated batches; so ``1 / (world x batches)``
        makes the step the one of the mean over all rows."""
        world = dist.get_world_size() if _distributed() else 1
        accumulate = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
        return 1.0 / (world * accumulate)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [B, T]`` -> (NLL sum in nats, counted-target weight sum) of this rank's share:
        the whole windows in one process, its context-parallel slice of them otherwise (the slice's
        last position predicts the next slice's first token)."""
        assert self.model is not None, "configure_model() has not run"
        if self.context_cut is not None:
            tokens = cut_windows(tokens, self.context_cut)
        next_tokens = None
        if cp_size(self.mesh) > 1:
            total = tokens.shape[1]
            lo, hi = context_parallel_bounds(total, cp_rank(self.mesh), cp_size(self.mesh))
            tokens, next_tokens = tokens[:, lo:hi], (tokens[:, hi : hi + 1] if hi < total else None)
        return self.model.loss(tokens, self.softmask_weight, self.ce_chunk_tokens, self.vocab, next_tokens)

    # -- optimisation ------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        o = self.optim
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if ep_size(self.mesh) > 1:
            # parameters on the expert mesh get their own group: the optimiser's foreach ops
            # (the default on GPU) cannot mix DTensors of different meshes in one list
            groups = [
                {"params": [p for p in group["params"] if _mesh_of(p) == mesh], "weight_decay": group["weight_decay"]}
                for mesh in dict.fromkeys(_mesh_of(p) for p in decay + no_decay)
                for group in groups
            ]
            groups = [g for g in groups if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, WarmupCosine(o.warmup_steps, o.max_steps, o.min_lr / o.lr)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, except under expert parallelism with norm clipping: the global
        gradient norm is summed from one norm per device mesh (torch's ``clip_grad_norm_``
        stacks per-tensor norms, which DTensors of different meshes cannot be), then every
        gradient is scaled by the same factor (:func:`clip_grad_norm_by_mesh`)."""
        if ep_size(self.mesh) > 1 and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            clip_grad_norm_by_mesh([p for g in optimizer.param_groups for p in g["params"]], float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor | None:
        nll, weight = self(batch["tokens"])
        kls = [m.last_indexer_kl for m in self.indexers if m.last_indexer_kl is not None]
        kl = torch.stack(kls).mean() if kls else None
        # global sums over all ranks: (NLL, target weight, indexer KL); a NaN anywhere is a NaN
        # in the sums, so every rank takes the same decision below
        totals = _all_reduce_sum(
            torch.stack(
                [
                    nll.detach().float(),
                    weight.detach().float(),
                    kl.detach().float() if kl is not None else nll.new_zeros(()),
                ]
            )
        )
        global_weight = totals[1].clamp_min(1.0)
        loss = nll / global_weight  # this rank's share: the shares sum to the global mean
        # each CP group's KL shares sum to its sequences' KL; average that over the DP groups
        kl_share = None if kl is None else kl / dp_size(self.mesh)
        total = loss if kl_share is None or self.indexer_kl_weight == 0 else loss + self.indexer_kl_weight * kl_share
        mean = float(totals[0] / global_weight)
        if not math.isfinite(mean) or not math.isfinite(float(totals[2])):
            self._count_nonfinite("loss")
            return None  # Lightning skips backward and the optimiser step (on every rank)
        self._reduce_moe_loads()
        if kl is not None:
            self.log("train/indexer_kl", float(totals[2]) / dp_size(self.mesh))
        self.log("train/loss", mean, prog_bar=True)
        self.log("train/bits_per_base", bits_per_base(mean))
        self.log("train/tokens", float(totals[1]))
        self._log_routing()
        if self._step_received is not None:
            for rank, rows in enumerate(self._step_received.sum(1).tolist()):
                self.log(f"train/ep_rows/rank{rank}", float(rows))
            self.log("train/ep_load_max_over_mean", self._worst_ep_load())
        self.log("train/nonfinite_steps", float(self.nonfinite_steps))
        if self._trainer is not None and self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return total

    def _reduce_moe_loads(self) -> None:
        """Keep this step's routing statistics of every MoE layer (:class:`RoutingStats`, and the
        balance loss), summed over all ranks (one all-reduce), so the logged balance and the
        routing-bias updates see the global batch and agree on every rank. Kept apart from
        ``MoE.last_routing``, which a recomputed forward in backward overwrites with the local
        statistics."""
        stats = [m.last_routing for m in self.moes]
        if not stats or any(x is None for x in stats):
            self._step_routing, self._step_received, self._step_balance = [], None, None
            return
        ep = ep_size(self.mesh)
        # float64: the received-row counts under EP can pass 2**24 at reference scale, and the
        # entropy sums are over every token
        dtype = torch.float64
        device = stats[0].load.device  # type: ignore[union-attr]
        balance = [m.last_balance_loss for m in self.moes]
        per_layer = torch.tensor(
            [
                [
                    float(x.dropped),
                    float(x.entropy),
                    float(x.tokens),  # type: ignore[union-attr]
                    float(b) if b is not None else 0.0,
                ]
                for x, b in zip(stats, balance)
            ],
            dtype=dtype,
            device=device,
        )
        parts = [x.load.to(dtype).reshape(-1) for x in stats] + [per_layer.reshape(-1)]  # type: ignore[union-attr]
        if ep > 1:
            # the rows each rank's experts received, per layer: this rank's row of a [world, layers]
            # table, the others zero, summed with the loads in the same all-reduce
            world, rank = dist.get_world_size(), dist.get_rank()
            table = torch.zeros(world, len(self.moes), dtype=dtype, device=device)
            table[rank] = torch.tensor(
                [float(getattr(m, "last_received", 0)) for m in self.moes], dtype=dtype, device=table.device
            )
            parts.append(table.reshape(-1))
        summed = _all_reduce_sum(torch.cat(parts))
        sizes = [m.gate.num_experts for m in self.moes]
        n_loads, n_layers = sum(sizes), len(self.moes)
        layers = summed[n_loads : n_loads + 4 * n_layers].view(-1, 4)
        self._step_routing = [
            RoutingStats(load.round().long(), row[0].round().long(), row[1], int(row[2]))
            for load, row in zip(summed[:n_loads].split(sizes), layers)
        ]
        world = dist.get_world_size() if _distributed() else 1
        self._step_balance = float(layers[:, 3].mean()) / world if any(b is not None for b in balance) else None
        self._step_received = summed[n_loads + 4 * n_layers :].view(-1, n_layers) if ep > 1 else None

    def _log_routing(self) -> None:
        """Log this step's routing statistics (see the class docstring) and warn, once per run,
        about a collapsed layer."""
        summaries = [stats.summary() for stats in self._step_routing]
        # max / mean rows per expert of this step, worst MoE layer (1.0 = balanced)
        self.log("train/moe_load_max_over_mean", max((x["load_max_over_mean"] for x in summaries), default=0.0))
        if not summaries:
            return
        for layer, summary in zip(self.moe_layers, summaries):
            self.log(f"moe/layer{layer}/load_max_over_mean", summary["load_max_over_mean"])
            self.log(f"moe/layer{layer}/dead_fraction", summary["dead_fraction"])
            self.log(f"moe/layer{layer}/router_entropy", summary["router_entropy"])
            if self.moe_capacity_factor is not None:
                self.log(f"moe/layer{layer}/dropped_fraction", summary["dropped_fraction"])
        self.log("train/moe_dead_experts", float(sum(int((s.load == 0).sum()) for s in self._step_routing)))
        if self._step_balance is not None:
            self.log("train/moe_balance_loss", self._step_balance)
        if self.moe_capacity_factor is not None:
            dropped = sum(float(s.dropped) for s in self._step_routing)
            rows = sum(float(s.load.sum() + s.dropped) for s in self._step_routing)
            self.log("train/moe_dropped_fraction", dropped / rows if rows else 0.0)
        self._check_collapse(summaries)

    def _check_collapse(self, summaries: list[dict[str, float]]) -> None:
        """Count, per layer, the steps in a row that each expert got no row and that one expert
        took over half the tokens; warn once per run when either reaches ``moe_collapse_steps``
        (a fresh router can pass either for a step or two by chance)."""
        dead = torch.stack([s.load == 0 for s in self._step_routing]).long()  # [layers, E]
        hogged = torch.tensor([s["top_expert_share"] > 0.5 for s in summaries], dtype=torch.long)  # [layers]
        if self._dead_streak is None or self._dead_streak.shape != dead.shape:
            self._dead_streak, self._hog_streak = torch.zeros_like(dead), torch.zeros_like(hogged)
        self._dead_streak = (self._dead_streak + 1) * dead
        self._hog_streak = (self._hog_streak + 1) * hogged
        if self._collapse_warned:
            return
        n = self.moe_collapse_steps
        for j, (layer, summary) in enumerate(zip(self.moe_layers, summaries)):
            long_dead = int((self._dead_streak[j] >= n).sum())
            if int(self._hog_streak[j]) >= n or long_dead:
                what = (
                    f"one expert took over half the tokens for {n} steps ({summary['top_expert_share']:.0%} now)"
                    if int(self._hog_streak[j]) >= n
                    else f"{long_dead} of {dead.shape[1]} experts got no token for {n} steps"
                )
                if self.global_rank == 0:
                    log.warning(
                        "genolong: MoE layer %d collapsed at step %d: %s, load max/mean %.2f; balance it with "
                        "train.moe_balance_loss_weight (e.g. 0.1) or train.moe_bias_update: proportional",
                        layer,
                        self.global_step + 1,
                        what,
                        summary["load_max_over_mean"],
                    )
                self._collapse_warned = True
                return

    def _worst_ep_load(self) -> float:
        """Rows received by the busiest rank of an EP group over the group's mean, worst MoE
        layer and group (1.0 = balanced); 0.0 without expert parallelism."""
        if self._step_received is None:
            return 0.0
        ep = ep_size(self.mesh)
        groups = self._step_received.view(-1, ep, len(self.moes))  # [EP groups, ep, layers]
        return float((groups.max(1).values / groups.mean(1).clamp_min(1e-9)).max())

    def ep_comm_bytes(self, reset: bool = True) -> dict[str, int] | None:
        """This process's expert-parallel all-to-all bytes since the last reset
        (:class:`genolong.parallel.expert.AllToAllCounter`: ``forward``, ``recompute``,
        ``backward``, ``splits``, ``dispatches``); None without expert parallelism."""
        counter = None if self.model is None else ep_comm_counter(self.model)
        if counter is None:
            return None
        out = counter.as_dict()
        if reset:
            counter.reset()
        return out

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip (zero) a step whose gradients hold NaN/inf, counting it like a NaN loss."""
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in self.parameters()
            if p.grad is not None
        ]
        # each rank holds a shard of the gradients: agree on whether any shard is non-finite
        bad = torch.tensor([0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0], device=self.device)
        if float(_all_reduce_sum(bad)) > 0:
            for p in self.parameters():
                p.grad = None
            self._count_nonfinite("gradient")
        else:
            self.consecutive_nonfinite = 0
            self._balance_experts()

    def _balance_experts(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise under-loaded experts' routing bias, lower
        over-loaded ones' (:func:`routing_bias_step` with ``optim.moe_bias_rate`` and
        ``optim.moe_bias_update``). Done with the optimiser step (before Lightning's checkpoint
        callbacks run), from the last forward's expert loads."""
        if self.optim.moe_bias_rate <= 0 or self.lora is not None:
            return
        for module, stats in zip(self.moes, self._step_routing):
            bias = module.gate.e_score_correction_bias
            step = routing_bias_step(stats.load, self.optim.moe_bias_rate, self.optim.moe_bias_update)
            bias.add_(step.to(bias.device, bias.dtype))

    def _count_nonfinite(self, what: str) -> None:
        self.consecutive_nonfinite += 1
        self.nonfinite_steps += 1
        if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.consecutive_nonfinite} steps in a row had a non-finite {what} (last at step "
                f"{self.global_step}); lower train.lr, check the data, or raise train.max_consecutive_nonfinite"
            )

    # -- validation: mean held-out loss over the eval tiles -------------------------------------------
    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        nll, weight = self(batch["tokens"])
        self._val_nll += float(nll)
        self._val_weight += float(weight)

    def on_validation_epoch_start(self) -> None:
        self._val_nll, self._val_weight = 0.0, 0.0

    def on_validation_epoch_end(self) -> None:
        # sums over all ranks (each holds other tiles, or another slice of the same ones)
        nll, weight = (
            float(x)
            for x in _all_reduce_sum(
                torch.tensor([self._val_nll, self._val_weight], dtype=torch.float64, device=self.device)
            )
        )
        if weight > 0:
            mean = nll / weight
            self.log("eval/loss", mean, prog_bar=True)
            self.log("eval/bits_per_base", bits_per_base(mean))
            self.log("eval/tokens", weight)

    # -- checkpoints -------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["genolong"] = {**self.extra_checkpoint_state, "nonfinite_steps": self.nonfinite_steps}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.nonfinite_steps = int(checkpoint.get("genolong", {}).get("nonfinite_steps", 0))
