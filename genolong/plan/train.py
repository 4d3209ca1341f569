"""The training plan (:func:`plan`, :class:`Plan`): will a recipe's training step fit, per GPU and per
node, and if not, what is the cheapest change that does?

Per GPU (one process), device memory is the sum of:

- **parameters, gradients, optimizer state** under FSDP2 sharding. The shard group is
  ``dp_shard * cp`` ranks (as the recipes say: with context parallelism, parameters are sharded
  over all ranks of a replica); ``dp_replicate`` replicas each hold a full sharded copy.
  ``32-true``: fp32 parameters (4 B), gradients (4 B), AdamW moments (8 B) per parameter.
  ``bf16-mixed``: fp32 master parameters, fp32 gradients (FSDP reduce dtype) and fp32 moments,
  the same 16 B per parameter, plus the bf16 compute copies below.
- **FSDP working copies** (:func:`fsdp_resident_bytes`): the root unit (final norm, LM head),
  gathered for the whole step, with its trained parameters' fp32 gradient until the step's last
  reduce-scatter; the block in use (the last block from its forward to its backward: it is not
  resharded) and the one prefetched, in the compute dtype (the ``KEEP_FP32`` modules' units in
  fp32); the unsharded gradient of one unit before its reduce-scatter (fp32). Without sharding:
  the bf16 compute copies of two units in bf16-mixed, nothing in fp32.
- **saved activations** that stay on the device (see
  :func:`~genolong.plan.activations.activation_estimate`), for
  ``tokens_per_rank = batch_size * context / cp`` tokens.
- **transients** while backward runs: the activations a recomputed region rebuilds (the largest
  one), the activation gradients in flight (3 x the residual streams of a layer), and the
  largest of: one MoE dispatch chunk, the DSA indexer/top-k and sparse-attention buffers (with
  the CP all-gather of the latent and pooled keys), the cross-entropy chunk.
- **workspace**: the CUDA context and the cuBLAS / cuBLASLt workspaces
  (:data:`~genolong.plan.constants.CUDA_CONTEXT_BYTES`,
  :data:`~genolong.plan.constants.CUBLAS_WORKSPACE_BYTES`), the NCCL communicators of each mesh
  dimension the step uses (:func:`nccl_communicators`), each a stated constant with its source,
  plus :data:`~genolong.plan.constants.FRAGMENTATION` of everything else (allocator rounding and
  fragmentation).

Expert parallelism (``parallel.ep``): each MoE layer's routed experts are split over ``ep`` ranks
of the ``dp_shard x cp`` ranks (``E / ep`` per rank) and are their own FSDP unit over the
``dp_shard x cp / ep`` ranks left (:func:`~genolong.plan.comm.fsdp_unit_groups`); the busiest rank
holds the imbalance (default 4x) times the mean expert rows.

Pinned host memory per GPU is the offloaded activation pool at its peak (end of forward);
per node it is that times the GPUs of a node. The plan also carries the communication per rank
per step (:func:`~genolong.plan.comm.comm_estimate`).

What holds it honest: the activation lines rest on :mod:`genolong.plan.activations`' measurements;
``tests/plan/test_plan_train.py`` holds the parameter, gradient and optimizer bytes to the model's
parameter count exactly, the reference recipes to the reference run's figures on 64 GPUs (1m's
180 GiB of pinned host memory per GPU, 256k within 98 GiB) and every suggestion to a plan that
fits when the change is applied.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import Recipe, kernel_multiple, parse_recipe
from ..errors import InputError
from ..kernels.probe import describe_here
from ..model.config import ModelConfig
from ..parallel.recompute import DEFAULT_SELECTIVE
from ..units import format_bytes, format_count
from .activations import (
    _BLOCK_RECOMPUTE,
    TrainedParts,
    _resolve_kinds,
    activation_estimate,
    chunked_recompute_terms,
    dsa_buffer_bytes,
)
from .backends import DSA_KERNELS, KDA_KERNELS, backend_kernels
from .comm import COMM_PARTS, PAYLOAD, RECEIVED, SENT, CommEstimate, comm_estimate, fsdp_unit_groups
from .constants import (
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACES,
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    GIB,
    NCCL_ALLTOALL_PEER_BYTES,
    NCCL_COMM_BYTES,
    NCCL_SINGLE_RANK_BYTES,
)
from .params import ParameterSplit, fp32_unit_parameters, parameter_split
from .recipe import _check_positive, _describe, _mesh_sizes, _model_config, _with_gpus, recipe_moe_imbalance

__all__ = [
    "ATTENTION_LORA",
    "ATTENTION_ONLY_FREEZE",
    "TRANSIENTS",
    "Plan",
    "fsdp_resident_bytes",
    "nccl_communicators",
    "plan",
]

#: ``model.freeze`` that trains the attention layers (``self_attn``: KDA and DSA) only, the
#: quickstart's list (``recipes/quickstart.yaml``).
ATTENTION_ONLY_FREEZE: tuple[str, ...] = (
    "embed_tokens.*",
    "lm_head.*",
    "norm.*",
    "layers.*.mlp.*",
    "layers.*.attn_hc.*",
    "layers.*.ffn_hc.*",
    "layers.*.input_layernorm.*",
    "layers.*.post_attention_layernorm.*",
)
#: ``model.lora`` that adapts every attention projection (the ``nn.Linear`` modules under ``self_attn``).
ATTENTION_LORA = "{targets: [layers.*.self_attn.*]}"

#: Device line items that do not coexist (the plan counts the largest).
TRANSIENTS = (
    "MoE dispatch chunk",
    "MoE all-to-all buffers (busiest rank)",
    "DSA indexer / top-k / gather buffers",
    "cross-entropy chunk",
)


@dataclass
class Plan:
    """Per-GPU memory plan of a recipe on a cluster (see :func:`plan`; :func:`~genolong.plan.format_plan` prints it).

    Attributes:
        recipe: the recipe's name.
        model: a one-line description of the architecture.
        gpus, gpus_per_node, nodes: the cluster.
        cp, dp_shard, dp_replicate: the mesh; ``shard_group = cp * dp_shard`` ranks share one
            sharded copy of parameters, gradients and optimizer state.
        tokens_per_rank: ``batch_size * context / cp``.
        precision, recompute, recompute_modules, offload, moe_chunk_tokens, ce_chunk_tokens:
            the recipe's settings the plan used.
        parameters: total parameters of the model.
        device: bytes per GPU by line item (parameters, gradients, optimizer, fsdp working
            copies, saved activations, rebuilt activations, activation gradients, MoE dispatch,
            DSA buffers, cross-entropy chunk, workspace), in print order.
        transient_peak: which of the mutually exclusive transients (MoE dispatch, DSA buffers,
            cross-entropy chunk) the total counts (the largest).
        activations_by_kind: saved activation bytes (device + host) by part of the model, under
            the recipe's recompute.
        plain_by_kind: the same without recompute (what recomputation rebuilds, layer by layer).
        device_total: the predicted peak per GPU; gpu_mem: the budget (bytes).
        host_per_gpu, host_per_node: pinned host memory for offloaded activations; host_mem:
            the per-node budget (bytes) or None (not checked).
        fits_device, fits_host, fits: the verdict.
        comm: bytes through the collectives per rank per training step (:func:`~genolong.plan.comm_estimate`):
            KDA and DSA context-parallel rows and FSDP rows, each in its stated convention.
        suggestion: the cheapest change that fits, as ``--set`` overrides (and ``--gpus N`` when
            it needs more GPUs); empty when the plan fits or nothing tried fits.
        suggestion_total: the predicted per-GPU total after the suggestion (None if none).
        assumptions: the assumptions the numbers rest on, most important first.
        ep: expert-parallel size; experts_per_rank: routed experts of each MoE layer a rank
            holds (``n_routed_experts / ep``); expert_shard_group: ranks an experts unit is
            FSDP-sharded over (``shard_group / ep``).
        kernel_backend, kda_kernel, dsa_kernel: the model's backend and the kernels it counts.
        kernels_here: what that backend runs on the machine the plan was made on, probed without
            importing torch (:func:`genolong.kernels.probe.describe_here`; the run logs the
            same words), or its refusal (``auto`` on CUDA without ``genolong[gpu]``).
        recompute_chunk_tokens: ``chunked``'s piece (None for the other modes).
        rebuilt_region: which region the rebuilt line is (chunked: the half).
        trained_parameters, frozen_parameters, adapter_parameters: the run's parameters with a
            gradient (adapters included), without one (``model.freeze``, every base weight under
            ``model.lora``) and the LoRA adapters (:func:`~genolong.plan.params.parameter_split`);
            ``parameters`` is trained + frozen.
        trainable_suggestion: when the plan does not fit and the recipe trains every parameter:
            the first of training the attention layers only (:data:`ATTENTION_ONLY_FREEZE`) or
            LoRA on them (:data:`ATTENTION_LORA`), alone or with the memory settings the
            suggestion search tries, that fits (``--set`` overrides; empty when none does);
            ``trainable_suggestion_total``: its per-GPU total.
    """

    recipe: str
    model: str
    gpus: int
    gpus_per_node: int
    nodes: int
    cp: int
    dp_shard: int
    dp_replicate: int
    shard_group: int
    tokens_per_rank: int
    precision: str
    recompute: str
    recompute_modules: tuple[str, ...]
    offload: bool
    moe_chunk_tokens: int | None
    ce_chunk_tokens: int
    parameters: int
    device: dict[str, int]
    transient_peak: str
    activations_by_kind: dict[str, int]
    plain_by_kind: dict[str, int]
    device_total: int
    gpu_mem: int
    host_per_gpu: int
    host_per_node: int
    host_mem: int | None
    fits_device: bool
    fits_host: bool
    fits: bool
    comm: CommEstimate
    suggestion: list[str] = field(default_factory=list)
    suggestion_total: int | None = None
    assumptions: list[str] = field(default_factory=list)
    ep: int = 1
    experts_per_rank: int = 0
    expert_shard_group: int = 1
    kernel_backend: str = "torch"
    kda_kernel: str = "torch"
    dsa_kernel: str = "torch"
    recompute_chunk_tokens: int | None = None
    rebuilt_region: str = ""
    trained_parameters: int = 0
    frozen_parameters: int = 0
    adapter_parameters: int = 0
    trainable_suggestion: list[str] = field(default_factory=list)
    trainable_suggestion_total: int | None = None
    kernels_here: str = ""
    checkpoint_bytes: int = 0
    checkpoint_disk_bytes: int = 0
    keep_last: int = 1
    load_read_per_rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field (bytes as integers) for ``genolong plan --json``."""
        out = dataclasses.asdict(self)
        out["recompute_modules"] = list(self.recompute_modules)
        out["comm"]["totals"] = {part: self.comm.part_total(part) for part in COMM_PARTS}
        out["comm"]["wire_totals"] = {part: self.comm.part_wire(part) for part in COMM_PARTS}
        out["comm"]["conventions"] = {"kda": PAYLOAD, "dsa": RECEIVED, "ep": SENT, "fsdp": RECEIVED}
        return out


def fsdp_resident_bytes(
    config: ModelConfig, shard: int, ep: int, split: ParameterSplit | None, dtype_bytes: int
) -> dict[str, int]:
    """What FSDP2's gathered units hold on a rank (bytes), as :func:`genolong.parallel.apply_fsdp`
    builds them over ``shard`` ranks:

    - ``root``: the root unit (final norm, LM head), gathered at the start of the forward and
      kept until the end of the backward; ``root grad``: its trained parameters' gradient in the
      gathered dtype (FSDP2 casts it to the reduce dtype only for the reduce-scatter), kept
      unsharded from the head's backward until the step's last reduce-scatter;
    - ``last block``: every unit of the last layer (its experts unit under EP), not resharded after
      its forward (backward needs it first);
    - ``unit``: the largest other unit gathered (a block in use, or one prefetched);
    - ``grad``: the largest trained unit's fp32 gradient before its reduce-scatter.

    In bf16-mixed (``dtype_bytes`` 2) the modules of the ``KEEP_FP32`` parameters are fp32 units
    (:func:`~genolong.plan.params.fp32_unit_parameters`): 2 more bytes per parameter of theirs.
    """
    units = fsdp_unit_groups(config, shard, ep, split=split)
    fp32 = fp32_unit_parameters(config) if dtype_bytes < 4 else {}
    extra = {layer: (4 - dtype_bytes) * n for layer, n in fp32.items()}
    last = config.num_hidden_layers - 1
    root = [u for u in units if u.kind == "root"]
    blocks = [u for u in units if u.kind != "root"]
    gathered = [u.params * dtype_bytes + (extra.get(u.layer, 0) if u.kind == "block" else 0) for u in blocks]
    return {
        "root": sum(u.params * dtype_bytes for u in root),
        "root grad": sum(dtype_bytes * u.trained for u in root),
        "last block": sum(g for u, g in zip(blocks, gathered) if u.layer == last),
        "unit": max(gathered, default=0),
        "grad": 4 * max((u.trained for u in blocks), default=0),
    }


def nccl_communicators(gpus: int, cp: int, replicate: int, shard: int, ep: int) -> dict[str, int]:
    """The NCCL communicators a training step creates on a rank, by mesh dimension, with their
    device buffers (bytes; :data:`~genolong.plan.constants.NCCL_COMM_BYTES` each, all-to-all
    peers :data:`~genolong.plan.constants.NCCL_ALLTOALL_PEER_BYTES` more, a single-rank one
    :data:`~genolong.plan.constants.NCCL_SINGLE_RANK_BYTES`): the default group (the loss's
    all-reduce), FSDP's ``dp_shard x cp`` group, the CP group (KDA states, DSA keys), the
    ``dp_replicate`` group (HSDP), the EP group (its all-to-alls) and the expert FSDP group
    (``shard / ep`` ranks). torch creates each on its first collective; distinct groups over the
    same ranks are distinct communicators. One process: none."""
    if gpus <= 1:
        return {}
    out = {f"world {gpus}": NCCL_COMM_BYTES}
    if shard > 1:
        out[f"fsdp {shard}"] = NCCL_COMM_BYTES
    if cp > 1:
        out[f"cp {cp}"] = NCCL_COMM_BYTES
    if replicate > 1:
        out[f"dp_replicate {replicate}"] = NCCL_COMM_BYTES
    if ep > 1:
        out[f"ep {ep} all-to-all"] = NCCL_COMM_BYTES + (ep - 1) * NCCL_ALLTOALL_PEER_BYTES
        efsdp = max(shard // ep, 1)
        out[f"expert fsdp {efsdp}"] = NCCL_COMM_BYTES if efsdp > 1 else NCCL_SINGLE_RANK_BYTES
    return out


#: bytes per parameter of a base checkpoint as released (GLM-5.3-Flash's safetensors are bf16)
BASE_BYTES_PER_PARAM = 2


def checkpoint_figures(
    recipe: Recipe, split: Any, shard: int, routing_biases: int, frozen_bytes: int
) -> tuple[int, int, int]:
    """(bytes per save, bytes on disk with ``checkpoint.keep_last`` saves, bytes each rank reads of
    the base at load) for a recipe (:mod:`genolong.parallel.load`, :mod:`genolong.train.finetune`).

    A save holds the trained parameters (fp32), their AdamW moments (2 x fp32) and the routing
    biases (fp32 buffers, ``routing_biases`` of them); the frozen parameters (``frozen_bytes``
    each) only when the run has no base checkpoint to read them from again (a preset's fresh
    weights). At load every rank reads its ``1/shard`` of the base (:data:`BASE_BYTES_PER_PARAM`
    per parameter; the adapters are not in the base); 0 without a base."""
    save = 12 * split.trained + 4 * routing_biases
    if recipe.model.checkpoint is None:
        save += frozen_bytes * split.frozen
    keep = max(recipe.checkpoint.keep_last, 1)
    read = (
        0
        if recipe.model.checkpoint is None
        else math.ceil(BASE_BYTES_PER_PARAM * (split.total - split.adapters) / shard)
    )
    return save, save * keep, read


def _plan_once(
    recipe: Recipe,
    cfg: ModelConfig,
    gpus: int,
    gpu_mem_gib: float,
    host_mem_gib: float | None,
    gpus_per_node: int,
    moe_imbalance: float | None,
    kda_kernel: str,
    dsa_kernel: str = "torch",
) -> Plan:
    par, mem = recipe.parallel, recipe.memory
    moe_imbalance, imbalance_source = recipe_moe_imbalance(recipe, moe_imbalance)
    cp, rep, ep, dp_shard, shard, moe_layers = _mesh_sizes(par, cfg, gpus)
    context = recipe.data.context
    if context % cp:
        raise InputError(f"data.context {context} is not divisible by parallel.cp {cp}")
    tokens = recipe.data.batch_size * context // cp
    bf16 = recipe.train.precision == "bf16-mixed"
    a = 2 if bf16 else 4
    H, m = cfg.hidden_size, cfg.hc_mult
    split = parameter_split(cfg, recipe.model.freeze, recipe.model.lora)
    count = split.total
    # which parts train: frozen ones keep no weight-gradient inputs (None: all train, as before)
    trained = (
        TrainedParts.from_names(cfg, split.trained_names, split.adapted, split.lora_dropout)
        if split.any_frozen
        else None
    )

    # parameters, gradients, AdamW state: fp32 for the trained parameters, sharded over the shard
    # group (ceil: uneven shards); under EP an experts unit holds E / ep experts over shard / ep
    # ranks: the same share per rank. Frozen parameters: their storage only, at the compute dtype
    # (bf16 in bf16-mixed, fp32 in 32-true): no master, no gradient, no AdamW state.
    per_rank = math.ceil(split.trained / shard)
    device: dict[str, int]
    if split.any_frozen:
        device = {
            "trained parameters (fp32 master, sharded)": 4 * per_rank,
            f"frozen parameters ({'bf16' if bf16 else 'fp32'}, sharded, no master)": a
            * math.ceil(split.frozen / shard),
            "gradients (fp32, sharded, trained only)": 4 * per_rank,
            "AdamW moments (2 x fp32, sharded, trained only)": 8 * per_rank,
        }
    else:
        device = {
            "parameters (fp32 master, sharded)": 4 * per_rank,
            "gradients (fp32, sharded)": 4 * per_rank,
            "AdamW moments (2 x fp32, sharded)": 8 * per_rank,
        }
    units = fsdp_unit_groups(cfg, shard, ep, split=split)
    unit = max(u.params for u in units)
    unit_trained = max(u.trained for u in units)
    if shard > 1:
        # gathered at the compute dtype (frozen ones are stored in it), the trained grads reduced
        # from fp32; the root stays gathered all step, the last block from its forward to its
        # backward (genolong.parallel.apply_fsdp, torchtitan's choice), one block in use and one
        # prefetched otherwise
        fsdp = fsdp_resident_bytes(cfg, shard, ep, split, a)
        device["FSDP root unit (final norm + LM head) unsharded all step, + its grad"] = (
            fsdp["root"] + fsdp["root grad"]
        )
        device["FSDP units in use + prefetched (the last block from its forward to its backward) + grad (1 unit)"] = (
            max(fsdp["last block"], fsdp["unit"]) + fsdp["unit"] + fsdp["grad"]
        )
    else:  # unsharded: only the trained fp32 masters need bf16 compute copies
        device["FSDP unsharded params (2 units) + grad (1 unit)"] = 2 * unit_trained * a if bf16 else 0

    # under EP the busiest rank holds moe_imbalance x the mean (token, slot) rows of its experts
    expert_load = moe_imbalance if ep > 1 else None
    act = activation_estimate(
        cfg,
        context // cp,
        recompute=mem.recompute,
        recompute_modules=mem.recompute_modules,
        offload=mem.offload,
        offload_min_bytes=mem.offload_min_bytes,
        dtype_bytes=a,
        indexer_kl=True,
        moe_chunk_tokens=mem.moe_chunk_tokens,
        batch=recipe.data.batch_size,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        cp=cp,
        recompute_chunk_tokens=mem.recompute_chunk_tokens,
        expert_load=expert_load,
        trained=trained,
    )
    device["saved activations (resident peak)"] = act.peak_resident_bytes
    rebuilt_region = ""
    if mem.recompute == "chunked":
        regions = [
            chunked_recompute_terms(
                cfg,
                i,
                tokens,
                mem.recompute_chunk_tokens,
                cp=cp,
                dtype_bytes=a,
                indexer_kl=True,
                moe_chunk_tokens=mem.moe_chunk_tokens,
                kda_kernel=kda_kernel,
                dsa_kernel=dsa_kernel,
                expert_load=expert_load,
                trained=trained,
            )
            for i in range(cfg.num_hidden_layers)
        ]
        rebuilt_region = max(regions, key=lambda r: r.rebuilt_bytes + r.layer_bytes).rebuilt_region
        device[f"rebuilt activations (chunked: {rebuilt_region}, + the layer's carried states / keys)"] = (
            act.rebuilt_bytes
        )
    else:
        device["rebuilt activations (largest recomputed region)"] = act.rebuilt_bytes
    device["activation gradients in flight (3 x streams)"] = 3 * tokens * m * H * a

    # transients that do not coexist: the largest counts
    moe_bytes = 0
    if moe_layers:
        c = min(mem.moe_chunk_tokens or tokens, tokens)
        k = cfg.num_experts_per_tok
        # the busiest rank's rows: in (H), out (H) and the expert's intermediate (3I), at the imbalance
        moe_bytes = int(moe_imbalance * c * k * (2 * H + 3 * cfg.moe_intermediate_size) * a)
        if ep > 1:  # and the rank's own (token, slot) rows: the dispatch send and the combine receive buffers
            moe_bytes += 2 * c * k * H * a
    # the whole sequence's latent and pooled index keys under CP, and their gradients
    dsa_bytes = dsa_buffer_bytes(cfg, recipe.data.batch_size * context, cp, a, gradients=True)
    ce = min(mem.ce_chunk_tokens, tokens)
    ce_bytes = ce * cfg.vocab_size * (2 * 4 + a)
    moe_name = "MoE all-to-all buffers (busiest rank)" if ep > 1 else "MoE dispatch chunk"
    transients = {
        moe_name: moe_bytes,
        "DSA indexer / top-k / gather buffers": dsa_bytes,
        "cross-entropy chunk": ce_bytes,
    }
    peak_name = max(transients, key=lambda k: transients[k])
    for name, value in transients.items():
        device[name] = value
    subtotal = sum(v for k, v in device.items() if k not in transients) + transients[peak_name]
    communicators = nccl_communicators(gpus, cp, rep, shard, ep)
    device["CUDA context + cuBLAS / cuBLASLt workspaces"] = (
        CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES
    )
    device[f"NCCL communicators ({', '.join(communicators) or 'none'})"] = sum(communicators.values())
    device["allocator fragmentation"] = int(FRAGMENTATION * subtotal)
    total = subtotal + sum(device[k] for k in list(device)[-3:])

    gpu_mem = int(gpu_mem_gib * GIB)
    per_node = min(gpus_per_node, gpus)
    host_gpu = max(act.pinned_pool_bytes, act.peak_offloaded_bytes)  # the pinned pool: power-of-two buffers
    host_node = host_gpu * per_node
    host_mem = None if host_mem_gib is None else int(host_mem_gib * GIB)
    fits_device = total <= gpu_mem
    fits_host = host_mem is None or host_node <= host_mem
    backend = cfg.kernel_backend
    if kda_kernel == "torch":
        kda_note = "(genolong's torch kernels: validated against ActivationMeter within 10% on tiny/small, fp32)"
    else:
        kda_note = (
            "(fla-core's ChunkKDAFunction save set, read from fla/ops/kda/chunk.py save_for_backward: "
            "q, k, v, g_cumsum, g, beta, Aqk, Akk fp32; not runnable on CPU, so not metered)"
        )
    dsa_note = (
        "DSA kernels 'triton' (genolong's Triton kernels: metered on CPU under TRITON_INTERPRET=1)"
        if dsa_kernel == "triton"
        else "DSA kernels 'torch'"
    )
    recompute_note = (
        f"recompute {mem.recompute}"
        + (f" ({', '.join(mem.recompute_modules or DEFAULT_SELECTIVE)})" if mem.recompute == "selective" else "")
        + ": the largest recomputed region is rebuilt whole during its backward (MoE chunks do not bound it)"
    )
    if mem.recompute == "chunked":
        recompute_note = (
            f"recompute chunked ({mem.recompute_chunk_tokens:,} tokens): saved per layer the block input "
            "streams only (as full; metered); during one layer's backward its carried extras (KDA: conv tail "
            "and fp32 state per segment boundary, + state maps under CP; DSA: kv latent and pooled keys up to "
            "the slice's end) and one feed-forward chunk with the mid-block streams [T, m, H], or one "
            "attention segment, at a time (chunked_recompute_terms; the backward-peak slopes in T and in the "
            "chunk are held to measurement on tiny/small)"
        )
    assumptions = [
        f"saved activations from formulas over the config, {tokens:,} tokens per rank, kernel_backend {backend!r}: "
        f"KDA chunk kernel {kda_kernel!r} "
        + kda_note
        + f"; {dsa_note}"
        + (
            "; 'auto' counted as on a CUDA machine with Triton and fla-core >= 0.5.2 (resolve_auto -> 'triton')"
            if backend == "auto" and kda_kernel != "torch"
            else ""
        )
        + "; bf16 sizes assume bf16 compute with the layers' fp32 parts kept fp32",
        (
            f"parameters, gradients and AdamW state fp32 (16 B/param) sharded over cp x dp_shard = {shard} ranks (FSDP2); "
            if not split.any_frozen
            else f"trained parameters ({format_count(split.trained)}"
            + (f", LoRA adapters {format_count(split.adapters)} of them" if split.lora else "")
            + f"): fp32 master, gradient and AdamW state (16 B/param); frozen ({format_count(split.frozen)}): stored at "
            f"{'bf16 (2 B' if bf16 else 'fp32 (4 B'}/param), no master, gradient or optimizer state; all sharded over "
            f"cp x dp_shard = {shard} ranks (FSDP2), no gradient reduce-scatter for frozen parameters; "
        )
        + f"2 unsharded units in {'bf16' if bf16 else 'fp32'} + 1 unsharded fp32 gradient in flight (the largest unit: "
        f"{format_count(unit)} params"
        + (f"; the most trained in one unit: {format_count(unit_trained)}" if split.any_frozen else "")
        + ")",
        recompute_note,
        "offload: every saved tensor of at least offload_min_bytes goes to pinned host memory, one host copy per "
        "distinct view autograd saves, each rounded up to a power of two by torch's pinned caching allocator (the "
        "pool per GPU); two layers are back on the device in backward (prefetch: the H2D copies are allocated on "
        "the copy stream, whose pool the compute stream cannot reuse; counted in the resident peak, two layers)"
        if mem.offload
        else "offload off: all saved activations stay on the device",
        f"MoE dispatch buffer for the busiest GPU at {moe_imbalance:g} x the mean load ({imbalance_source})"
        + (
            f"; expert parallelism ep {ep}: {cfg.n_routed_experts // ep} experts per rank, each MoE layer's experts an "
            f"FSDP unit over {shard // ep} ranks; the busiest rank's expert activations at {moe_imbalance:g} x, plus its own "
            "dispatch-send and combine-receive rows"
            if ep > 1
            else ""
        ),
        "DSA under CP all-gathers the whole sequence's kv latent and pooled index keys (and their gradients)",
        f"CUDA context {format_bytes(CUDA_CONTEXT_BYTES)} + {CUBLAS_WORKSPACES} cuBLAS workspaces of "
        f"{format_bytes(CUBLAS_WORKSPACE_BYTES)}; NCCL per communicator {format_bytes(NCCL_COMM_BYTES)} (NVIDIA/nccl#964), "
        f"+ {format_bytes(NCCL_ALLTOALL_PEER_BYTES)} per all-to-all peer (nccl#1685), a single-rank one "
        f"{format_bytes(NCCL_SINGLE_RANK_BYTES)} (nccl#2363); + {FRAGMENTATION:.0%} fragmentation; the largest of MoE dispatch, "
        "DSA buffers and the cross-entropy chunk counts (they do not overlap)",
        "indexer KL on (the trainer computes it); batch_size sequences per rank"
        + "; mHC mixing weights (normalisation, Sinkhorn) rebuilt in backward, only pre kept (HyperConnection.recompute_weights)",
        "communication per rank per training step (one forward + backward, accumulate_grad_batches = 1): KDA rows "
        "count the payload each rank hands to the collective (cp_kda_comm_bytes, conv_halo_comm_bytes), DSA and FSDP "
        "rows the bytes each rank receives (cp_dsa_comm_bytes; FSDP per unit (S-1) x ceil(n/S)), EP rows the bytes each "
        "rank sends at balanced routing (ep_comm_bytes); the wire column converts every row to bytes sent with ring "
        "algorithms; recompute repeats the mixers' (and the MoE's) forward collectives",
    ]
    comm = comm_estimate(
        cfg,
        context // cp,
        cp,
        batch=recipe.data.batch_size,
        dtype_bytes=a,
        recompute=mem.recompute,
        recompute_modules=mem.recompute_modules,
        shard_group=shard,
        dp_replicate=rep,
        ep=ep,
        moe_chunk_tokens=mem.moe_chunk_tokens,
        split=split if split.any_frozen else None,
    )
    save, on_disk, read = checkpoint_figures(recipe, split, shard, moe_layers * cfg.n_routed_experts, a)
    return Plan(
        checkpoint_bytes=save,
        checkpoint_disk_bytes=on_disk,
        keep_last=max(recipe.checkpoint.keep_last, 1),
        load_read_per_rank=read,
        recipe=recipe.name,
        model=_describe(cfg, count, split),
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        nodes=math.ceil(gpus / gpus_per_node),
        cp=cp,
        dp_shard=dp_shard,
        dp_replicate=rep,
        shard_group=shard,
        tokens_per_rank=tokens,
        precision=recipe.train.precision,
        recompute=mem.recompute,
        recompute_modules=tuple(mem.recompute_modules),
        offload=mem.offload,
        moe_chunk_tokens=mem.moe_chunk_tokens,
        ce_chunk_tokens=mem.ce_chunk_tokens,
        parameters=count,
        device=device,
        transient_peak=peak_name,
        activations_by_kind=act.by_kind,
        plain_by_kind=act.plain_by_kind,
        device_total=int(total),
        gpu_mem=gpu_mem,
        host_per_gpu=host_gpu,
        host_per_node=host_node,
        host_mem=host_mem,
        fits_device=fits_device,
        fits_host=fits_host,
        fits=fits_device and fits_host,
        comm=comm,
        assumptions=assumptions,
        ep=ep,
        experts_per_rank=cfg.n_routed_experts // ep if moe_layers else 0,
        expert_shard_group=shard // ep,
        kernel_backend=backend,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        recompute_chunk_tokens=mem.recompute_chunk_tokens if mem.recompute == "chunked" else None,
        rebuilt_region=rebuilt_region,
        trained_parameters=split.trained,
        frozen_parameters=split.frozen,
        adapter_parameters=split.adapters,
    )


def _candidates(recipe: Recipe, cfg: ModelConfig, gpus: int) -> list[tuple[list[str], int]]:
    """Changes to try, cheapest first: (``--set`` overrides, gpus)."""
    mem, par = recipe.memory, recipe.parallel
    out: list[tuple[list[str], int]] = []
    if mem.recompute == "none":
        out.append((["memory.recompute=selective", "memory.recompute_modules=[attn,hc]"], gpus))
    if mem.recompute != "full":
        if mem.recompute == "selective":
            kinds = _resolve_kinds("selective", mem.recompute_modules)
            if not {"moe", "mlp"} <= kinds:
                mods = sorted(set(mem.recompute_modules or DEFAULT_SELECTIVE) | {"ffn"})
                out.append(([f"memory.recompute_modules=[{','.join(mods)}]"], gpus))
    # (a selective recipe's module list must go with it: the key applies to selective only)
    clear = ["memory.recompute_modules=[]"] if mem.recompute_modules else []
    if mem.recompute not in _BLOCK_RECOMPUTE:
        out.append((["memory.recompute=full", *clear], gpus))
    if mem.recompute != "chunked":  # the same work as full, the rebuilt region bounded by the chunk
        out.append((["memory.recompute=chunked", *clear], gpus))
    if not mem.offload:
        out.append((["memory.offload=true"], gpus))
    tokens = recipe.data.batch_size * recipe.data.context // par.cp
    assert cfg.mlp_layer_types is not None
    if "sparse" in cfg.mlp_layer_types and gpus % (par.cp * par.dp_replicate) == 0:
        # expert parallelism: E / ep experts per rank, the experts unit sharded over the rest
        fold = gpus // par.dp_replicate
        for ep in range(par.ep + 1, min(fold, cfg.n_routed_experts) + 1):
            if fold % ep == 0 and cfg.n_routed_experts % ep == 0:
                out.append(([f"parallel.ep={ep}"], gpus))
    if "sparse" in cfg.mlp_layer_types:
        chunk = min(mem.moe_chunk_tokens or tokens, tokens)
        if chunk > 1024:
            out.append(([f"memory.moe_chunk_tokens={chunk // 4}"], gpus))
    if mem.ce_chunk_tokens > 512:
        out.append(([f"memory.ce_chunk_tokens={mem.ce_chunk_tokens // 4}"], gpus))
    cp = par.cp
    for factor in (2, 4, 8):
        new = cp * factor
        if recipe.data.context % kernel_multiple(cfg, new) == 0 and gpus % (new * par.dp_replicate) == 0:
            out.append(([f"parallel.cp={new}", "parallel.dp_shard=-1"], gpus))
    for factor in (2, 4):  # more GPUs: a larger FSDP group shards parameters and optimizer state thinner
        out.append((["parallel.dp_shard=-1"], gpus * factor))
    return out


def plan(
    recipe: Recipe,
    gpus: int | None = None,
    gpu_mem_gib: float = 80.0,
    host_mem_gib: float | None = None,
    gpus_per_node: int = 8,
    moe_imbalance: float | None = None,
    *,
    kda_kernel: str | None = None,
    dsa_kernel: str | None = None,
) -> Plan:
    """Plan a recipe's memory per GPU and per node; suggest the cheapest change when it does not fit.

    Args:
        recipe: a loaded :class:`~genolong.config.Recipe` (its architecture comes from the
            checkpoint's config.json when present, else from ``model.preset``).
        gpus: GPUs in all (default: the recipe's ``devices x num_nodes``); ``dp_shard`` becomes
            ``gpus / (cp * dp_replicate)``.
        gpu_mem_gib: device memory per GPU in GiB (default 80).
        host_mem_gib: host RAM per node in GiB for the pinned offload pool, or None (not checked).
        gpus_per_node: GPUs per node (default 8).
        moe_imbalance: busiest-GPU MoE load over the mean (default None: the recipe's, see
            :func:`~genolong.plan.recipe_moe_imbalance`).
        kda_kernel: KDA chunk kernel whose saved tensors count: ``torch`` or ``fla`` (default
            None: what the model's ``kernel_backend`` runs on the recipe's accelerator,
            :func:`~genolong.plan.backend_kernels`; ``auto`` on a GPU recipe is fla's ``chunk_kda``).
        dsa_kernel: ``torch`` or ``triton`` (default None: from the backend, as ``kda_kernel``).

    Returns:
        A :class:`Plan`. When it does not fit, ``suggestion`` holds the first change of a
        cost-ordered list (selective recompute, more modules, full recompute, chunked recompute,
        offload, expert parallelism, smaller MoE chunks, smaller cross-entropy chunks, larger CP,
        more GPUs) that fits on its own, trying the changes that keep the mesh and the GPUs first,
        alone, then the shortest prefix of them together; then a larger CP or more GPUs alone;
        else the shortest prefix of the whole list applied together that fits.

    Raises:
        InputError: a non-positive or non-integer size, gpus not divisible by the mesh, a
            recipe whose architecture cannot be resolved.
    """
    if not isinstance(recipe, Recipe):
        raise InputError(f"plan needs a Recipe (genolong.config.load_recipe), got {type(recipe).__name__}")
    _check_positive("--gpus", gpus, int, allow_none=True)
    _check_positive("--gpu-mem", gpu_mem_gib)
    _check_positive("--host-mem", host_mem_gib, allow_none=True)
    _check_positive("--gpus-per-node", gpus_per_node, int)
    _check_positive("moe_imbalance", moe_imbalance, allow_none=True)
    if moe_imbalance is not None and moe_imbalance < 1:
        raise InputError(f"moe_imbalance is the busiest GPU's load over the mean and must be >= 1, got {moe_imbalance}")
    cfg = _model_config(recipe)
    default_kda, default_dsa = backend_kernels(cfg.kernel_backend, recipe.parallel.accelerator)
    kernel = default_kda if kda_kernel is None else kda_kernel
    dsa = default_dsa if dsa_kernel is None else dsa_kernel
    if kernel not in KDA_KERNELS:
        raise InputError(f"kda_kernel {kernel!r} is unknown; choose one of {', '.join(KDA_KERNELS)}")
    if dsa not in DSA_KERNELS:
        raise InputError(f"dsa_kernel {dsa!r} is unknown; choose one of {', '.join(DSA_KERNELS)}")
    world = recipe.parallel.world_size if gpus is None else gpus
    base = _plan_once(recipe, cfg, world, gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance, kernel, dsa)
    base.kernels_here = describe_here(cfg.kernel_backend)
    if base.fits:
        return base
    data = recipe.to_dict()

    def attempt(overrides: list[str], n: int) -> Plan | None:
        try:
            changed = parse_recipe(data, _with_gpus(overrides, n, gpus_per_node))
            return _plan_once(changed, cfg, n, gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance, kernel, dsa)
        except InputError:
            return None

    candidates = _candidates(recipe, cfg, world)
    # the settings that keep the mesh and the GPUs (recompute, offload, EP, chunks) are cheaper than
    # a larger CP or more GPUs: try each of them, then them together, before the mesh changes
    cheap = [c for c in candidates if c[1] == world and not any(o.startswith("parallel.cp=") for o in c[0])]
    mesh = [c for c in candidates if c not in cheap]

    def fits(overrides: list[str], n: int) -> bool:
        """Plan with ``overrides`` on ``n`` GPUs; when it fits, record it as the suggestion."""
        result = attempt(overrides, n)
        if result is None or not result.fits:
            return False
        base.suggestion = overrides + ([f"--gpus {n}"] if n != world else [])
        base.suggestion_total = result.device_total
        return True

    def first_single(options: list[tuple[list[str], int]]) -> bool:
        return any(fits(overrides, n) for overrides, n in options)

    def first_prefix(options: list[tuple[list[str], int]]) -> bool:
        merged: dict[str, str] = {}
        n = world
        for overrides, m in options:
            for item in overrides:
                merged[item.split("=", 1)[0]] = item
            n = max(n, m)
            if fits(list(merged.values()), n):
                return True
        return False

    if not (first_single(cheap) or first_prefix(cheap) or first_single(mesh)):
        first_prefix(candidates)
    if not recipe.model.freeze and recipe.model.lora is None:
        # train fewer parameters: attention only, then LoRA on it; alone, then with the memory
        # settings that keep the mesh (recompute, offload, EP, chunks), checked by planning each
        merged: dict[str, str] = {}
        for overrides, _ in cheap:
            for item in overrides:
                merged[item.split("=", 1)[0]] = item
        trainable = [f"model.freeze=[{','.join(ATTENTION_ONLY_FREEZE)}]", f"model.lora={ATTENTION_LORA}"]
        for extra in ([], list(merged.values())):
            for option in trainable:
                result = attempt([option, *extra], world)
                if result is not None and result.fits:
                    base.trainable_suggestion = [option, *extra]
                    base.trainable_suggestion_total = result.device_total
                    return base
    return base
