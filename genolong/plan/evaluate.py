"""The evaluation plan (``genolong plan RECIPE --evaluate --context N``, :func:`eval_plan`,
:class:`EvalPlan`): the memory per GPU of scoring a recipe's model, a forward-only pass on the
recipe's mesh.

Per GPU: the weights in the scoring dtype sharded over ``dp_shard x cp`` (EP: ``E / ep`` experts
per rank, as in training), two unsharded FSDP units in flight, the largest half-block's forward
working set on the rank's ``context / cp`` tokens (:func:`forward_working_set`: the same
per-tensor inventory as the training plan, :mod:`genolong.plan.activations`, an upper bound for a
forward without grad, plus fla-core's forward temporaries, the DSA buffers with the all-gathered
keys under CP, one MoE dispatch chunk) or the LM-head phase (:func:`eval_outside_tensors`), and
with ``--segment-tokens`` one segment's working set plus the stream caches
(:func:`stream_cache_tensors`); host memory for loading each rank's slices.

What holds it honest: ``tests/plan/test_plan_evaluate.py`` measures the no_grad peak of ``token_nll``
(one-shot and streamed, torch kernels, one process) at 0.46-0.82x of the plan's activation lines
on ``tiny`` and ``small``, and checks the 1M tile on 64 GPUs against an independent count (the
meta-device model's parameters, fla-core's forward buffers and the gathered latent counted by
hand); ``benchmarks/stream_eval.py``'s peak RSS of the bundled base, one forward and streamed,
is 0.64-1.03x of the plan (BENCHMARKS.md). The GPU path (fla-core under CP) is not measured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import KDA_CHUNK, Recipe, kernel_multiple, parse_recipe
from ..errors import InputError
from ..model.config import INDEXED_ATTENTION, ModelConfig, parameter_count
from ..units import format_bytes, format_count
from .activations import _half, _index_slots, dsa_buffer_bytes, outside_saved_tensors
from .backends import DSA_KERNELS, KDA_KERNELS, backend_kernels
from .constants import _F32, _I64, FRAGMENTATION, GIB, WORKSPACE_BYTES
from .recipe import (
    _check_positive,
    _describe,
    _largest_unit,
    _mesh_sizes,
    _model_config,
    _with_gpus,
    recipe_moe_imbalance,
)

__all__ = [
    "CPU_PROCESS_BYTES",
    "EVAL_CHUNK_ROWS",
    "EvalPlan",
    "WorkingTensor",
    "eval_outside_tensors",
    "eval_plan",
    "forward_working_set",
    "stream_cache_tensors",
]

#: MoE tensors the dispatch makes per chunk of ``memory.moe_chunk_tokens`` tokens (the router reads
#: each chunk's rows, the experts run them); the input, the shared expert and the routed outputs are
#: whole-slice tensors (``genolong.model.moe.MoE.forward``).
_MOE_PER_CHUNK = frozenset(
    {
        "input fp32 (router)",
        "router scores",
        "top-k indices, order, token map",
        "routing weights",
        "routed experts",
        "EP received rows",
    }
)
#: Fixed process memory of a CPU run (``parallel.accelerator: cpu``) besides tensors: Python, torch
#: and genolong imported (measured here: RSS 0.38 GiB after importing torch, numpy, pandas,
#: ``genolong.cli`` and ``genolong.evaluation.score``; rounded up to 0.5 GiB for what a run adds).
CPU_PROCESS_BYTES = GIB // 2
#: Evaluation LM-head rows per chunk (``genolong evaluate``'s ``chunk_size`` default, score_tile).
EVAL_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class WorkingTensor:
    """One tensor (or group of tensors) alive at the peak of a forward-only pass.

    Attributes:
        kind: the part it belongs to (``kda``, ``dsa``, ``moe``, ``mlp``, ``mhc``, ``norm``,
            ``outside``, ``stream cache``).
        name: what it is.
        nbytes: bytes.
    """

    kind: str
    name: str
    nbytes: int


def _fla_forward_temporaries(cfg: ModelConfig, cp_path: bool) -> float:
    """fp32 bytes per token fla-core's ``chunk_kda_fwd`` allocates besides its save set and frees
    before it returns (``fla/ops/kda/chunk_fwd.py``: ``disable_recompute=False`` drops w, u, qg, kg,
    v_new and h; qg is not made): per head ``w``, ``kg`` (K each), ``u``, ``v_new`` (V each), the
    chunk states ``h [NT, K, V]`` (``K V / C`` per token), the in-chunk diagonal blocks ``Akkd``
    (16, ``chunk_intra.py``) and, with the gate in the kernel (one process), the chunk-local
    cumulative gate ``g_cumsum`` (K; under CP it is in the save set). Under CP the values are the
    widened ``[v | 0]`` (``V + K`` columns)."""
    heads, K = cfg.linear_num_heads, cfg.linear_head_dim
    V = K + K if cp_path else K
    floats = 2 * K + 2 * V + K * V / KDA_CHUNK + 16 + (0 if cp_path else K)
    return heads * floats * _F32


def forward_working_set(
    config: ModelConfig,
    layer: int,
    half: str,
    tokens: int,
    *,
    dtype_bytes: int = 4,
    kda_kernel: str = "torch",
    dsa_kernel: str = "torch",
    cp: int = 1,
    moe_chunk_tokens: int | None = None,
    expert_load: float | None = None,
    sequence_tokens: int | None = None,
) -> list[WorkingTensor]:
    """What one half of block ``layer`` holds at the peak of a forward-only pass (``torch.no_grad``).

    Counted from the training inventory (one set of per-tensor formulas): the half's saved
    tensors without recompute (:func:`~genolong.plan.layer_saved_tensors`, ``indexer_kl=False``: evaluation does
    not compute the indexer KL) are every tensor its forward makes that a backward would read, and
    a forward without grad holds them at most all at once (it frees some before the half ends: an
    upper bound; ``tests/plan/test_plan_evaluate.py`` measures it on ``tiny`` and ``small``). Added: the
    half's output streams ``[T, m, H]`` (made while the input streams live); on a KDA half with
    fla-core's kernel its forward temporaries (:func:`_fla_forward_temporaries`); on a DSA half
    :func:`~genolong.plan.dsa_buffer_bytes` without gradients (under CP the all-gathered latent and pooled keys of
    the whole sequence); the top-k indices a full DSA layer hands to the shared layer after it
    (its feed-forward half and the shared layer's attention half); on a MoE half the per-chunk
    tensors for one dispatch chunk only (:data:`_MOE_PER_CHUNK`) and the routed outputs (the
    chunks' list and its concatenation, ``2 x [T, H]``).

    Args:
        config: the architecture.
        layer: layer index.
        half: ``attention`` or ``ffn``.
        tokens: tokens of the pass (the rank's slice ``context / cp``, or one streamed segment).
        dtype_bytes: the parameter/compute dtype's bytes (4: fp32, 2: bf16).
        kda_kernel, dsa_kernel: as :func:`~genolong.plan.layer_saved_tensors`.
        cp: context-parallel size (KDA's CP path; DSA's gathered keys).
        moe_chunk_tokens: MoE dispatch chunk (default None: the whole pass at once).
        expert_load: under EP the busiest rank's rows over the mean (default None: no EP).
        sequence_tokens: tokens of the whole sequence the CP group holds (default ``tokens * cp``).

    Returns:
        The :class:`WorkingTensor` list (bytes).
    """
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None and cfg.mlp_layer_types is not None
    if half not in ("attention", "ffn"):
        raise InputError(f"half must be 'attention' or 'ffn', got {half!r}")
    a, H, m = dtype_bytes, cfg.hidden_size, cfg.hc_mult
    items = _half(
        cfg,
        layer,
        half,
        a,
        frozenset(),
        indexer_kl=False,
        tokens=tokens,
        moe_chunk_tokens=moe_chunk_tokens,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        cp_path=cp > 1,
        expert_load=expert_load,
    )
    chunk = min(moe_chunk_tokens or tokens, tokens)
    out = [
        WorkingTensor(
            t.kind, t.name, int(round(t.nbytes(chunk if t.kind == "moe" and t.name in _MOE_PER_CHUNK else tokens)))
        )
        for t in items
    ]
    out.append(WorkingTensor("mhc", f"{half} half's output streams [T, m, H]", tokens * m * H * a))
    is_dsa = cfg.layer_types[layer] == INDEXED_ATTENTION
    shared = is_dsa and cfg.indexer_types[layer] == "shared"
    hands_on = is_dsa and not shared and cfg.indexer_types[min(layer + 1, cfg.num_hidden_layers - 1)] == "shared"
    slots = _index_slots(cfg)
    if half == "attention":
        if not is_dsa and kda_kernel == "fla":
            out.append(
                WorkingTensor(
                    "kda",
                    "fla chunk_kda forward temporaries (w, u, kg, v_new, h, ...)",
                    int(round(tokens * _fla_forward_temporaries(cfg, cp > 1))),
                )
            )
        if is_dsa:
            seq = tokens * cp if sequence_tokens is None else sequence_tokens
            name = "DSA indexer / top-k / gather buffers" + (" + all-gathered latent and pooled keys" if cp > 1 else "")
            out.append(WorkingTensor("dsa", name, dsa_buffer_bytes(cfg, seq, cp, a, gradients=False)))
        if shared:
            out.append(WorkingTensor("dsa", "received top-k indices", tokens * slots * _I64))
    else:
        if hands_on:
            out.append(WorkingTensor("dsa", "top-k indices handed to the next (shared) layer", tokens * slots * _I64))
        if cfg.mlp_layer_types[layer] == "sparse":
            out.append(WorkingTensor("moe", "routed outputs: per-chunk list + concatenation", 2 * tokens * H * a))
    return out


def stream_cache_tensors(config: ModelConfig, tokens: int, dtype_bytes: int = 4) -> list[WorkingTensor]:
    """What :class:`genolong.model.stream.PrefillStream` carries between segments of a ``tokens``-token
    sequence: per DSA layer the kv latent of every token (``[T, kv_lora_rank]``, model dtype) and,
    on full-indexer layers, the pooled index keys (``[T / P, index_head_dim]``) and at most
    ``P - 1`` pending layer inputs (H); per KDA layer the fp32 state ``[heads, dk, dv]`` and the
    short conv's ``kernel - 1`` rows of q|k|v (fp32)."""
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    a, P = dtype_bytes, cfg.index_kpool
    dsa = [i for i, t in enumerate(cfg.layer_types) if t == INDEXED_ATTENTION]
    full = [i for i in dsa if cfg.indexer_types[i] == "full"]
    n_kda = len(cfg.layer_types) - len(dsa)
    heads, d = cfg.linear_num_heads, cfg.linear_head_dim
    out = []
    if dsa:
        out.append(
            WorkingTensor(
                "stream cache",
                f"DSA kv latent of every token ({len(dsa)} layers)",
                len(dsa) * tokens * cfg.kv_lora_rank * a,
            )
        )
        out.append(
            WorkingTensor(
                "stream cache",
                f"DSA pooled index keys + pending pool rows ({len(full)} full layers)",
                len(full) * (tokens // P * cfg.index_head_dim + (P - 1) * cfg.hidden_size) * a,
            )
        )
    if n_kda:
        out.append(
            WorkingTensor(
                "stream cache",
                f"KDA states + conv tails ({n_kda} layers)",
                n_kda * (heads * d * d + (cfg.linear_conv_kernel_dim - 1) * 3 * heads * d) * _F32,
            )
        )
    return out


def eval_outside_tensors(
    config: ModelConfig, tokens: int, pass_tokens: int, dtype_bytes: int = 4, chunk_rows: int = EVAL_CHUNK_ROWS
) -> list[WorkingTensor]:
    """The LM-head phase of a forward-only scoring pass over ``pass_tokens`` tokens (the whole
    slice, or the last streamed segment), of a tile slice of ``tokens`` tokens: the streams
    ``[n, m, H]`` the final norm collapses, the final norm and the scored hidden rows
    (:func:`~genolong.plan.outside_saved_tensors`: ids, norm fp32 input, rsqrt, output, hidden, targets,
    weights), one LM-head chunk (``chunk_rows x vocab`` logits in the dtype, their fp32 copy and
    ``logsumexp``'s exponentials), and the whole slice's ids, model inputs, targets and NLL."""
    cfg, a, n = config, dtype_bytes, pass_tokens
    rows = min(chunk_rows, n)
    out = [WorkingTensor("mhc", "streams [T, m, H] into the final norm", n * cfg.hc_mult * cfg.hidden_size * a)]
    out += [WorkingTensor("outside", t.name, int(round(t.nbytes(n)))) for t in outside_saved_tensors(cfg, a)]
    out.append(
        WorkingTensor("outside", "LM-head chunk: logits, fp32 copy, logsumexp", rows * cfg.vocab_size * (a + 2 * _F32))
    )
    out.append(
        WorkingTensor(
            "outside",
            "tile ids, model inputs, targets, per-token NLL (whole slice)",
            tokens * (3 * _I64 + 1 + 2 * _F32),
        )
    )
    return out


@dataclass
class EvalPlan:
    """Per-GPU memory plan of scoring a recipe's model at a context on a cluster (see
    :func:`eval_plan`; :func:`~genolong.plan.format_eval_plan` prints it).

    Attributes:
        recipe, model: the recipe's name and a one-line description of the architecture.
        gpus, gpus_per_node, nodes: the cluster; accelerator: the recipe's.
        cp, dp_shard, dp_replicate, shard_group, ep, experts_per_rank, expert_shard_group: the mesh
            (as the training plan's; tiles are dealt to the ``dp_shard x dp_replicate`` groups).
        context: tokens per tile; tokens_per_rank: ``context / cp``; segment_tokens: streamed
            segment (None: one forward per slice).
        dtype: parameter dtype of the scoring (``float32`` or ``bfloat16``); moe_chunk_tokens:
            the MoE dispatch chunk.
        kernel_backend, kda_kernel, dsa_kernel: the backend and the kernels counted.
        parameters: total parameters.
        device: bytes per GPU by line item, in print order.
        working: the largest forward working set's tensors (:class:`WorkingTensor`).
        peak_phase: where the activation peak is (e.g. ``layer 3 attention (DSA)``).
        phase_bytes: activation peak by layer type and half (``KDA attention``, ``MoE ffn``, ...)
            and the LM head.
        device_total, gpu_mem: predicted peak and budget per GPU (bytes).
        host: host bytes per GPU by line item (loading); host_per_gpu, host_per_node, host_mem:
            totals and the per-node budget (None: not checked).
        fits_device, fits_host, fits: the verdict.
        suggestion: the first change tried that fits (``--set`` overrides, or ``--gpus N``);
            suggestion_total: its per-GPU total.
        assumptions: what the numbers rest on.
    """

    recipe: str
    model: str
    gpus: int
    gpus_per_node: int
    nodes: int
    accelerator: str
    cp: int
    dp_shard: int
    dp_replicate: int
    shard_group: int
    ep: int
    experts_per_rank: int
    expert_shard_group: int
    context: int
    tokens_per_rank: int
    segment_tokens: int | None
    dtype: str
    moe_chunk_tokens: int | None
    kernel_backend: str
    kda_kernel: str
    dsa_kernel: str
    parameters: int
    device: dict[str, int]
    working: list[WorkingTensor]
    peak_phase: str
    phase_bytes: dict[str, int]
    device_total: int
    gpu_mem: int
    host: dict[str, int]
    host_per_gpu: int
    host_per_node: int
    host_mem: int | None
    fits_device: bool
    fits_host: bool
    fits: bool
    suggestion: list[str] = field(default_factory=list)
    suggestion_total: int | None = None
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field (bytes as integers) for ``genolong plan --evaluate --json``."""
        return dataclasses.asdict(self)


_EVAL_DTYPES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2}


def _eval_once(
    recipe: Recipe,
    cfg: ModelConfig,
    gpus: int,
    context: int,
    gpu_mem_gib: float,
    host_mem_gib: float | None,
    gpus_per_node: int,
    moe_imbalance: float | None,
    kda_kernel: str,
    dsa_kernel: str,
    dtype: str,
    segment_tokens: int | None,
) -> EvalPlan:
    par, mem = recipe.parallel, recipe.memory
    imbalance, imbalance_source = recipe_moe_imbalance(recipe, moe_imbalance)
    cp, rep, ep, dp_shard, shard, moe_layers = _mesh_sizes(par, cfg, gpus)
    unit = kernel_multiple(cfg, cp)
    if context % unit:
        raise InputError(
            f"--context {context} is not a multiple of {unit} (cp {cp} x the KDA chunk / DSA pool); "
            f"use e.g. {max(unit, context // unit * unit)}"
        )
    if segment_tokens is not None and shard > 1:
        # PrefillStream calls each block's parts itself, outside FSDP2's per-block gather hooks, and
        # refuses a model with context parallelism installed
        raise InputError(
            f"--segment-tokens streams a tile through one process holding the whole model; this mesh "
            f"shards it over cp x dp_shard = {cp} x {dp_shard}: drop --segment-tokens, or set parallel.cp=1 "
            "and parallel.dp_shard=1 (replicas: parallel.dp_replicate)"
        )
    a = _EVAL_DTYPES[dtype]
    H = cfg.hidden_size
    count = parameter_count(cfg).total
    tokens = context // cp
    streamed = segment_tokens is not None and segment_tokens < tokens
    n = segment_tokens if streamed else tokens
    assert n is not None
    gpu = par.accelerator != "cpu"

    device: dict[str, int] = {
        f"parameters ({dtype}, sharded over {shard})" if shard > 1 else f"parameters ({dtype})": a
        * math.ceil(count / shard)
    }
    largest = _largest_unit(cfg, ep)
    device["FSDP unsharded params (2 units: computing + prefetched)"] = 2 * largest * a if shard > 1 else 0

    expert_load = imbalance if ep > 1 else None
    kw = dict(
        dtype_bytes=a,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        cp=cp,
        moe_chunk_tokens=mem.moe_chunk_tokens,
        expert_load=expert_load,
        sequence_tokens=context,
    )
    # outside the block being computed: the whole slice's ids, inputs and NLL; streamed, the caches too
    resident = [
        WorkingTensor(
            "outside",
            "tile ids, model inputs, targets, per-token NLL (whole slice)",
            tokens * (3 * _I64 + 1 + 2 * _F32),
        )
    ]
    if streamed:
        resident += stream_cache_tensors(cfg, tokens, a)
    resident_bytes = sum(t.nbytes for t in resident)
    phases: dict[str, int] = {}
    best: tuple[int, str, list[WorkingTensor]] = (-1, "", [])
    for i in range(cfg.num_hidden_layers):
        mixer = "DSA" if cfg.layer_types[i] == INDEXED_ATTENTION else "KDA"
        ffn = "MoE" if cfg.mlp_layer_types[i] == "sparse" else "dense"
        for half, label in (("attention", f"{mixer} attention"), ("ffn", f"{ffn} ffn")):
            items = forward_working_set(cfg, i, half, n, **kw)  # type: ignore[arg-type]
            size = sum(t.nbytes for t in items)
            phases[label] = max(phases.get(label, 0), size)
            if size > best[0]:
                best = (size, f"layer {i} {label}", items)
    head = [t for t in eval_outside_tensors(cfg, tokens, n, a) if not t.name.startswith("tile ids")]
    phases["LM head"] = sum(t.nbytes for t in head)
    if phases["LM head"] > best[0]:
        best = (phases["LM head"], "LM head", head)
    peak, phase, working = best
    device[f"forward working set ({phase}, {n:,} tokens)"] = peak
    device["tile ids, inputs, NLL" + (" + stream caches (DSA latent, pooled keys; KDA states)" if streamed else "")] = (
        resident_bytes
    )
    if ep > 1 and moe_layers:
        # the rank's own (token, slot) rows of one chunk: the dispatch send and combine receive buffers
        c = min(mem.moe_chunk_tokens or n, n)
        device["MoE all-to-all send + receive (own rows, one chunk)"] = 2 * c * cfg.num_experts_per_tok * H * a
    subtotal = sum(device.values())
    fixed = WORKSPACE_BYTES if gpu else CPU_PROCESS_BYTES
    device["workspace (context, NCCL, fragmentation)" if gpu else "process (Python, torch) + fragmentation"] = int(
        fixed + FRAGMENTATION * subtotal
    )
    total = sum(device.values())

    # host memory while loading: each rank reads its own slices (never the whole model)
    biggest = max(parameter_count(cfg).embedding, parameter_count(cfg).lm_head)
    host = {
        "read buffer: the largest checkpoint tensor (embedding / LM head)": biggest * a,
        "staged shard of the weights before the copy to the device": a * math.ceil(count / shard) if gpu else 0,
    }
    host_gpu = sum(host.values())
    per_node = min(gpus_per_node, gpus)
    host_node = host_gpu * per_node
    host_mem = None if host_mem_gib is None else int(host_mem_gib * GIB)
    gpu_mem = int(gpu_mem_gib * GIB)
    fits_device = total <= gpu_mem
    fits_host = host_mem is None or host_node <= host_mem
    assumptions = [
        "forward only (torch.no_grad): no gradients, no optimizer state, nothing saved for backward; "
        "the peak is the largest half-block's working set: its saved tensors as training would keep them "
        "(the planner's per-tensor inventory, an upper bound: without grad the layer frees them as it goes; "
        "measured on tiny/small, CPU, fp32, one-shot and streamed: the no_grad peak is 0.46-0.82x of it, tests/plan/test_plan_evaluate.py)"
        + (
            "; fla chunk_kda's forward temporaries (w, u, kg, v_new, chunk states h) added"
            if kda_kernel == "fla"
            else ""
        ),
        f"weights in {dtype} sharded over cp x dp_shard = {shard} ranks (FSDP2"
        + (
            f"; ep {ep}: {cfg.n_routed_experts // ep} experts per rank, each MoE layer's experts a unit over {shard // ep}"
            if ep > 1
            else ""
        )
        + f"); 2 unsharded units in flight (the largest: {format_count(largest)} params)",
        f"kernel_backend {cfg.kernel_backend!r} -> KDA {kda_kernel}, DSA {dsa_kernel}"
        + (
            " (auto counted as on a CUDA machine with Triton and fla-core)"
            if cfg.kernel_backend == "auto" and gpu
            else ""
        ),
        (
            f"context parallelism: each of the {cp} ranks scores {tokens:,} tokens of the {context:,}-token tile; DSA "
            "all-gathers the whole tile's kv latent and pooled index keys (forward: once, no gradients)"
        )
        if cp > 1
        else (
            f"streamed in segments of {segment_tokens:,} tokens (genolong.model.stream.PrefillStream): one segment's "
            "working set plus the DSA latent / pooled-key caches of the whole tile and the KDA states"
            if streamed
            else f"one forward over the {tokens:,}-token tile"
        ),
        f"MoE dispatch in chunks of {mem.moe_chunk_tokens or 'all'} tokens (memory.moe_chunk_tokens)"
        + (f"; the busiest EP rank's expert rows at {imbalance:g} x the mean ({imbalance_source})" if ep > 1 else ""),
        f"LM head {EVAL_CHUNK_ROWS} rows per chunk (evaluate's chunk_size); the largest of the phases counts",
        (
            "loading: each rank reads only its slices (safetensors get_slice / dcp.load into the sharded model); host "
            "per GPU: the largest tensor's read buffer plus the rank's shard staged before the copy"
        )
        if gpu
        else "CPU run: 'device' is the process's memory; loading streams the safetensors one tensor at a time",
        (f"workspace {format_bytes(WORKSPACE_BYTES)}" if gpu else f"process {format_bytes(CPU_PROCESS_BYTES)}")
        + f" + {FRAGMENTATION:.0%} fragmentation",
    ]
    return EvalPlan(
        recipe=recipe.name,
        model=_describe(cfg, count),
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        nodes=math.ceil(gpus / gpus_per_node),
        accelerator=par.accelerator,
        cp=cp,
        dp_shard=dp_shard,
        dp_replicate=rep,
        shard_group=shard,
        ep=ep,
        experts_per_rank=cfg.n_routed_experts // ep if moe_layers else 0,
        expert_shard_group=shard // ep,
        context=context,
        tokens_per_rank=tokens,
        segment_tokens=segment_tokens if streamed else None,
        dtype=dtype,
        moe_chunk_tokens=mem.moe_chunk_tokens,
        kernel_backend=cfg.kernel_backend,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        parameters=count,
        device=device,
        working=working,
        peak_phase=phase,
        phase_bytes=phases,
        device_total=int(total),
        gpu_mem=gpu_mem,
        host=host,
        host_per_gpu=host_gpu,
        host_per_node=host_node,
        host_mem=host_mem,
        fits_device=fits_device,
        fits_host=fits_host,
        fits=fits_device and fits_host,
        assumptions=assumptions,
    )


def eval_plan(
    recipe: Recipe,
    context: int | None = None,
    gpus: int | None = None,
    gpu_mem_gib: float = 80.0,
    host_mem_gib: float | None = None,
    gpus_per_node: int = 8,
    moe_imbalance: float | None = None,
    *,
    dtype: str | None = None,
    segment_tokens: int | None = None,
    kda_kernel: str | None = None,
    dsa_kernel: str | None = None,
) -> EvalPlan:
    """Plan the memory per GPU of scoring a recipe's model on tiles of ``context`` tokens
    (``genolong plan RECIPE --evaluate``): forward only, on the recipe's mesh.

    Args:
        recipe: a loaded :class:`~genolong.config.Recipe`.
        context: tokens per tile (default None: the recipe's eval context, ``eval.context`` or
            ``data.context``); a multiple of ``cp`` x the KDA chunk / DSA pool.
        gpus: GPUs in all (default: the recipe's ``devices x num_nodes``); ``dp_shard`` becomes
            ``gpus / (cp * dp_replicate)``: the data-parallel groups tiles are dealt to.
        gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance: as :func:`~genolong.plan.plan`.
        dtype: parameter dtype of the scoring, ``float32`` or ``bfloat16`` (default None: bf16
            for a ``bf16-mixed`` recipe, else fp32).
        segment_tokens: stream each tile in segments of this many tokens (``evaluate
            --segment-tokens``; only where each process holds the whole model: ``cp = dp_shard =
            1``); default None: one forward.
        kda_kernel, dsa_kernel: as :func:`~genolong.plan.plan` (default: from the model's ``kernel_backend`` on
            the recipe's accelerator).

    Returns:
        An :class:`EvalPlan`. When it does not fit, ``suggestion`` holds the first of: expert
        parallelism, smaller MoE chunks, streaming (``--segment-tokens``, unsharded), a larger CP, more
        GPUs that fits alone.

    Raises:
        InputError: a non-positive size, a context not divisible as the mesh needs, gpus not
            divisible by the mesh, ``segment_tokens`` on a sharded mesh, an unknown dtype or kernel.
    """
    if not isinstance(recipe, Recipe):
        raise InputError(f"eval_plan needs a Recipe (genolong.config.load_recipe), got {type(recipe).__name__}")
    _check_positive("--context", context, int, allow_none=True)
    _check_positive("--segment-tokens", segment_tokens, int, allow_none=True)
    _check_positive("--gpus", gpus, int, allow_none=True)
    _check_positive("--gpu-mem", gpu_mem_gib)
    _check_positive("--host-mem", host_mem_gib, allow_none=True)
    _check_positive("--gpus-per-node", gpus_per_node, int)
    _check_positive("moe_imbalance", moe_imbalance, allow_none=True)
    if moe_imbalance is not None and moe_imbalance < 1:
        raise InputError(f"moe_imbalance is the busiest GPU's load over the mean and must be >= 1, got {moe_imbalance}")
    if dtype is None:
        dtype = "bfloat16" if recipe.train.precision == "bf16-mixed" else "float32"
    if dtype not in _EVAL_DTYPES:
        raise InputError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(_EVAL_DTYPES)}")
    dtype = "float32" if _EVAL_DTYPES[dtype] == 4 else "bfloat16"
    cfg = _model_config(recipe)
    default_kda, default_dsa = backend_kernels(cfg.kernel_backend, recipe.parallel.accelerator)
    kda = default_kda if kda_kernel is None else kda_kernel
    dsa = default_dsa if dsa_kernel is None else dsa_kernel
    if kda not in KDA_KERNELS:
        raise InputError(f"kda_kernel {kda!r} is unknown; choose one of {', '.join(KDA_KERNELS)}")
    if dsa not in DSA_KERNELS:
        raise InputError(f"dsa_kernel {dsa!r} is unknown; choose one of {', '.join(DSA_KERNELS)}")
    ctx = recipe.eval_context if context is None else context
    world = recipe.parallel.world_size if gpus is None else gpus
    args = (ctx, gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance, kda, dsa, dtype, segment_tokens)
    base = _eval_once(recipe, cfg, world, *args)
    if base.fits:
        return base
    data = recipe.to_dict()
    par, mem = recipe.parallel, recipe.memory
    # (overrides, gpus, segment tokens), cheapest first: the same GPUs, then more of them
    options: list[tuple[list[str], int, int | None]] = []
    assert cfg.mlp_layer_types is not None
    if "sparse" in cfg.mlp_layer_types:
        fold = world // par.dp_replicate
        options += [
            ([f"parallel.ep={e}"], world, segment_tokens)
            for e in range(par.ep + 1, min(fold, cfg.n_routed_experts) + 1)
            if fold % e == 0 and cfg.n_routed_experts % e == 0 and world % (par.cp * par.dp_replicate) == 0
        ]
        chunk = min(mem.moe_chunk_tokens or base.tokens_per_rank, base.tokens_per_rank)
        if chunk > 1024:
            options.append(([f"memory.moe_chunk_tokens={chunk // 4}"], world, segment_tokens))
    if world == par.dp_replicate:  # each process holds the whole model: stream the tile (--segment-tokens)
        current = segment_tokens or ctx
        options += [([], world, s) for s in (65536, 16384, 4096) if s < current]
    if segment_tokens is None:
        options += [
            ([f"parallel.cp={par.cp * f}", "parallel.dp_shard=-1"], world, None)
            for f in (2, 4, 8)
            if world % (par.cp * f * par.dp_replicate) == 0
        ]
    options += [(["parallel.dp_shard=-1"], world * f, segment_tokens) for f in (2, 4)]
    for overrides, n, segment in options:
        try:
            changed = parse_recipe(data, _with_gpus(overrides, n, gpus_per_node))
            result = _eval_once(changed, cfg, n, *args[:-1], segment)
        except InputError:
            continue
        if result.fits:
            base.suggestion = (
                overrides
                + ([f"--gpus {n}"] if n != world else [])
                + ([f"--segment-tokens {segment}"] if segment != segment_tokens else [])
            )
            base.suggestion_total = result.device_total
            break
    return base
