"""Bytes through the collectives per rank per training step (:func:`comm_estimate`, ``Plan.comm``),
and the FSDP2 units they gather and reduce (:func:`fsdp_units`, :func:`fsdp_unit_groups`).

The context-parallel collectives of the token mixers, summed over the layers from the exact
per-call formulas (KDA: :func:`genolong.kernels.kda.cp.cp_kda_comm_bytes` and
``conv_halo_comm_bytes``, which count the payload a rank hands to the collective; DSA:
:func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes`, which counts the bytes a rank receives), the
forward collectives again when recompute reruns a mixer, expert parallelism's all-to-alls
(:func:`ep_comm_bytes`: each MoE layer's routed experts split over ``ep`` ranks, the bytes a rank
sends) and FSDP2's parameter all-gathers and gradient reduce-scatter over the shard group (bytes
received; under EP each MoE layer's experts are their own unit over the ``dp_shard x cp / ep``
ranks left). Every row also gives the bytes a rank sends with ring algorithms, one unit for all
rows.

What holds it honest: ``benchmarks/cp_step.py`` holds the CP rows to the bytes counted through
``torch.distributed`` (BENCHMARKS.md); ``benchmarks/ep_step.py`` and
``tests/parallel/test_expert_parallel.py`` hold :func:`ep_comm_bytes` to
:class:`genolong.parallel.expert.AllToAllCounter` to the byte; ``tests/plan/test_plan_comm.py`` holds
the rows to the per-call formulas summed by hand and the FSDP units to the model's modules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError
from ..kernels.comm_bytes import conv_halo_payload, cp_dsa_comm_bytes, kda_state_payload
from ..model.config import INDEXED_ATTENTION, LINEAR_ATTENTION, ModelConfig, parameter_count
from .activations import _BLOCK_RECOMPUTE, _resolve_kinds
from .constants import _F32, _I64
from .params import ParameterSplit

__all__ = [
    "COMM_CONVENTIONS",
    "COMM_PARTS",
    "PAYLOAD",
    "RECEIVED",
    "SENT",
    "CommEstimate",
    "CommRow",
    "FSDPUnit",
    "comm_estimate",
    "ep_comm_bytes",
    "fsdp_unit_groups",
    "fsdp_units",
    "routed_expert_parameters",
]

#: Counting conventions of a :class:`CommRow`. ``payload``: the bytes this rank hands to the
#: collective (for an all-gather its own piece, for an all-reduce the whole buffer), as
#: :func:`genolong.kernels.kda.cp.cp_kda_comm_bytes` and ``conv_halo_comm_bytes`` count.
#: ``received``: the bytes this rank receives from the other ranks, as
#: :func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes` counts (and FSDP here).
PAYLOAD = "payload"
RECEIVED = "received"
#: ``sent``: the bytes this rank sends to the other ranks (point-to-point payload of an
#: all-to-all; rows for the rank itself do not travel), as :func:`ep_comm_bytes` counts.
SENT = "sent"
COMM_CONVENTIONS = (PAYLOAD, RECEIVED, SENT)
#: The parts of :class:`CommEstimate`, in table order.
COMM_PARTS = ("kda", "dsa", "ep", "fsdp")


@dataclass(frozen=True)
class CommRow:
    """One line of a rank's communication in one training step (forward + backward of
    ``batch_size`` sequences): one kind of collective summed over the layers or FSDP units it runs in.

    Attributes:
        part: ``kda`` and ``dsa`` (the context-parallel collectives of the token mixers, over the
            ``cp`` group), ``ep`` (the MoE all-to-alls over the ``ep`` group) or ``fsdp``
            (parameter all-gathers and gradient reductions, over the ``dp_shard x cp`` shard
            group, the experts units over ``dp_shard x cp / ep``, and across ``dp_replicate``
            replicas).
        name: what travels.
        layers: the layers (or FSDP units) the row sums over.
        convention: :data:`PAYLOAD`, :data:`RECEIVED` or :data:`SENT` (see there); ``forward``, ``recompute``
            and ``backward`` count in it, so that they equal the per-call formulas summed.
        forward: bytes of the forward collectives.
        recompute: bytes of the forward collectives that recomputation runs again in backward
            (the CP collectives sit inside the recomputed mixers; 0 without recompute).
        backward: bytes of the backward collectives.
        wire: bytes this rank sends with ring algorithms (all-gather of a piece ``p``:
            ``(W - 1) p``; all-reduce of a buffer ``N``: ``2 (W - 1) / W * N``; reduce-scatter:
            ``(W - 1) / W * N``, which equals the bytes received): one unit for every row.
    """

    part: str
    name: str
    layers: int
    convention: str
    forward: int
    recompute: int
    backward: int
    wire: int

    @property
    def total(self) -> int:
        """``forward + recompute + backward`` in the row's convention."""
        return self.forward + self.recompute + self.backward


@dataclass
class CommEstimate:
    """Bytes through the collectives of one rank in one training step (see :func:`comm_estimate`).

    Attributes:
        cp, shard_group, dp_replicate: the group sizes the rows assume.
        tokens_per_rank: ``batch * T_local`` tokens of the rank's slices.
        rows: the :class:`CommRow` lines, KDA, then DSA, then EP, then FSDP.
        ep: the expert-parallel size the EP rows assume.
    """

    cp: int
    shard_group: int
    dp_replicate: int
    tokens_per_rank: int
    rows: list[CommRow]
    ep: int = 1

    def part_total(self, part: str) -> int:
        """Per-step bytes of ``part`` (``kda``, ``dsa``, ``ep`` or ``fsdp``) in its rows' convention (one per part)."""
        return sum(r.total for r in self.rows if r.part == part)

    def part_wire(self, part: str) -> int:
        """Per-step ring-algorithm bytes sent for ``part``."""
        return sum(r.wire for r in self.rows if r.part == part)


def _ring_allgather(piece: int, world: int) -> int:
    return (world - 1) * piece


def _ring_allreduce(buffer: int, world: int) -> int:
    return 2 * (world - 1) * buffer // world


def fsdp_units(config: ModelConfig) -> list[int]:
    """Parameters of each FSDP2 unit as :func:`genolong.parallel.apply_fsdp` builds them: one per
    block (in layer order), then the root (embedding, final norm, LM head); they sum to
    :func:`~genolong.model.config.parameter_count` ``.total``."""
    cfg = config
    assert cfg.layer_types is not None and cfg.mlp_layer_types is not None and cfg.indexer_types is not None
    pc = parameter_count(cfg)
    root = pc.embedding + pc.lm_head + cfg.hidden_size
    blocks: list[int] = []
    previous = root
    # a block's count is the difference of two prefixes of the layer schedule (a prefix is a
    # valid config: a shared-indexer layer always follows the full layer it reads)
    for i in range(1, cfg.num_hidden_layers + 1):
        prefix = cfg.replace(
            num_hidden_layers=i,
            layer_types=cfg.layer_types[:i],
            mlp_layer_types=cfg.mlp_layer_types[:i],
            indexer_types=cfg.indexer_types[:i],
        )
        count = parameter_count(prefix).total
        blocks.append(count - previous)
        previous = count
    return blocks + [root]


def routed_expert_parameters(config: ModelConfig) -> int:
    """Parameters of one MoE layer's routed experts: ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, ``3 E I H`` (``genolong.model.moe.Experts``)."""
    return 3 * config.n_routed_experts * config.moe_intermediate_size * config.hidden_size


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP2 unit as a rank sees it.

    Attributes:
        kind: ``embedding`` (the token embedding), ``block`` (a block; under EP without its
            routed experts), ``experts`` (one MoE layer's ``E / ep`` routed experts of this rank's
            EP group) or ``root`` (final norm and LM head).
        layer: the block's layer index (None for the root).
        params: parameters the unit gathers (its unsharded size on this rank).
        group: ranks it is sharded over (``dp_shard * cp``, or ``dp_shard * cp / ep`` for experts).
        trained: parameters of the unit with a gradient (its reduce-scatter's size); -1 (the
            default): all of ``params``.
    """

    kind: str
    layer: int | None
    params: int
    group: int
    trained: int = -1

    def __post_init__(self) -> None:
        if self.trained < 0:
            object.__setattr__(self, "trained", self.params)


def fsdp_unit_groups(
    config: ModelConfig, shard_group: int = 1, ep: int = 1, split: ParameterSplit | None = None
) -> list[FSDPUnit]:
    """The FSDP2 units in order (the embedding, each block, then under EP its experts unit, then
    the root: final norm and LM head), as :func:`genolong.parallel.apply_fsdp` builds them.

    With expert parallelism (``ep > 1``) each MoE block's routed experts are a separate unit:
    ``E / ep`` experts (``3 E I H / ep`` parameters) sharded over the ``shard_group / ep`` ranks
    left after EP, the rest of the block over all ``shard_group`` ranks. ``ep = 1``: the units of
    :func:`fsdp_units`, each over ``shard_group``.

    ``split`` (:func:`~genolong.plan.params.parameter_split`): the run's trained and frozen
    parameters and adapters; the units then hold the adapters too, and ``trained`` says how many
    of their parameters have a gradient. None (default): every parameter trains, no adapters.
    """
    cfg = config
    assert cfg.mlp_layer_types is not None
    if split is not None:
        out_split: list[FSDPUnit] = []
        for kind, layer in [("embedding", None)] + [("block", i) for i in range(cfg.num_hidden_layers)]:
            total, trained = split.unit(kind, layer, ep)
            out_split.append(FSDPUnit(kind, layer, total, shard_group, trained))
            if kind == "block" and ep > 1 and cfg.mlp_layer_types[layer] == "sparse":
                total, trained = split.unit("experts", layer, ep)
                out_split.append(FSDPUnit("experts", layer, total, max(shard_group // ep, 1), trained))
        total, trained = split.unit("root", None, ep)
        out_split.append(FSDPUnit("root", None, total, shard_group, trained))
        return out_split
    units = fsdp_units(cfg)
    expert = routed_expert_parameters(cfg)
    embedding = parameter_count(cfg).embedding
    out: list[FSDPUnit] = [FSDPUnit("embedding", None, embedding, shard_group)]
    for i, n in enumerate(units[:-1]):
        if ep > 1 and cfg.mlp_layer_types[i] == "sparse":
            out.append(FSDPUnit("block", i, n - expert, shard_group))
            out.append(FSDPUnit("experts", i, expert // ep, max(shard_group // ep, 1)))
        else:
            out.append(FSDPUnit("block", i, n, shard_group))
    out.append(FSDPUnit("root", None, units[-1] - embedding, shard_group))
    return out


def ep_comm_bytes(
    config: ModelConfig, tokens: int, ep: int, chunk_tokens: int | None, dtype_bytes: int
) -> dict[str, int]:
    """Bytes one rank SENDS through expert parallelism's all-to-alls in one forward and one
    backward, summed over the model's MoE layers (recompute not included: a recomputed MoE runs
    its forward exchanges again, the count exchange included).

    At exactly balanced routing (each rank sends ``c k / ep`` (token, slot) rows to every EP
    rank, itself included; its own rows do not travel), per MoE layer per chunk of ``c`` tokens
    (``chunk_tokens``, the last chunk the remainder; None: the whole slice), top-k ``k``, hidden
    ``H``, ``a = dtype_bytes``, ``E`` routed experts:

    - forward: dispatch ``(ep - 1) c k H a / ep`` (integer division) and combine the same;
    - backward: dispatch and combine reversed, the same two again;
    - splits: before each dispatch, the rows per expert of the receiving rank, ``E / ep`` int64 to
      each of the ``ep - 1`` other ranks (the combine and the backward reuse them).

    :class:`genolong.parallel.expert.AllToAllCounter` measures the same three numbers
    (``forward``, ``backward``, ``splits``); ``benchmarks/ep_step.py`` and
    ``tests/parallel/test_expert_parallel.py`` hold them equal to the byte.

    Args:
        config: the architecture (``num_experts_per_tok``, ``hidden_size``, ``n_routed_experts``,
            the MoE layers).
        tokens: tokens of the rank's slice (``batch * T / cp``).
        ep: expert-parallel size (1: nothing travels).
        chunk_tokens: ``memory.moe_chunk_tokens`` or None.
        dtype_bytes: the activation dtype's bytes (2: bf16, 4: fp32).

    Returns:
        ``{"forward": int, "backward": int, "splits": int}``.
    """
    for name, value in (("tokens", tokens), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    assert config.mlp_layer_types is not None
    layers = sum(t == "sparse" for t in config.mlp_layer_types)
    if ep == 1 or layers == 0:
        return {"forward": 0, "backward": 0, "splits": 0}
    c = min(chunk_tokens or tokens, tokens)
    sizes = [c] * (tokens // c) + ([tokens % c] if tokens % c else [])
    row = config.num_experts_per_tok * config.hidden_size * dtype_bytes
    data = sum((ep - 1) * n * row // ep for n in sizes)
    splits = len(sizes) * (ep - 1) * (config.n_routed_experts // ep) * _I64
    return {"forward": layers * 2 * data, "backward": layers * 2 * data, "splits": layers * splits}


def comm_estimate(
    config: ModelConfig,
    tokens: int,
    cp: int,
    *,
    batch: int = 1,
    dtype_bytes: int = 4,
    recompute: str = "none",
    recompute_modules: Sequence[str] = (),
    shard_group: int = 1,
    dp_replicate: int = 1,
    ep: int = 1,
    moe_chunk_tokens: int | None = None,
    split: ParameterSplit | None = None,
) -> CommEstimate:
    """Bytes one rank moves through the collectives in one training step (forward + backward).

    Context parallelism (per layer call, the exact per-call formulas, summed over the layers):

    - KDA layer (:data:`PAYLOAD` convention): :func:`genolong.kernels.kda.cp.cp_kda_comm_bytes`
      (state all-gather forward, all-reduce backward; fp32 states) and
      :func:`~genolong.kernels.kda.cp.conv_halo_comm_bytes` (the short conv's ``kernel - 1`` rows
      of q|k|v, ``3 * heads * head_dim`` channels in the compute dtype, plus the 8-byte length).
    - DSA layer (:data:`RECEIVED` convention): :func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes`,
      the kv latent and, on ``full``-indexer layers only, the pooled index keys (all-gather
      forward, reduce-scatter backward), in the compute dtype. The indexer KL's 8-byte count
      all-reduce per full layer is not counted.
    - Recompute (``full``, or ``selective`` with the mixer's kind) runs a mixer's forward
      collectives again in backward.

    FSDP2 (:data:`RECEIVED` convention; ``S = shard_group`` ranks, per unit of ``n`` parameters
    a shard of ``ceil(n / S)``; the per-parameter padding of FSDP2 is ignored):
    parameter all-gather in forward, ``(S - 1) ceil(n / S) dtype_bytes`` per unit; again in
    backward for the units resharded after forward (every block but the last; the root is not);
    the fp32 gradient reduce-scatter ``(S - 1) ceil(n / S) 4``; with ``dp_replicate = R > 1`` a
    ring all-reduce of the fp32 gradient shard across replicas, ``2 (R - 1) / R ceil(n / S) 4``.

    Args:
        config: the architecture.
        tokens: ``T_local``, tokens of one sequence slice on this rank (``context / cp``).
        cp: the context-parallel group size (1: no CP rows are non-zero).
        batch: sequences per step on this rank (default 1).
        dtype_bytes: bytes of the compute dtype (4: fp32, 2: bf16; FSDP's parameter dtype).
        recompute, recompute_modules: as :func:`~genolong.plan.activation_estimate`.
        shard_group: FSDP ranks sharing one sharded copy (``dp_shard * cp``; 1: no FSDP).
        dp_replicate: replicas (HSDP; default 1).
        ep: expert-parallel size (default 1). With ``ep > 1``: an EP row (:data:`SENT`,
            :func:`ep_comm_bytes`; recompute of the MoE repeats its forward pair) and the expert
            units' FSDP rows over ``shard_group / ep`` ranks (:func:`fsdp_unit_groups`).
        moe_chunk_tokens: ``memory.moe_chunk_tokens`` (one all-to-all pair per chunk).
        split: the run's trained and frozen parameters (:func:`~genolong.plan.params.parameter_split`):
            the all-gathers move every parameter of a unit (frozen ones are stored at the compute
            dtype), the gradient reduce-scatter and the HSDP all-reduce only its trained ones (a
            unit with none has no reduce-scatter). None (default): all parameters train.

    Returns:
        A :class:`CommEstimate` (bytes per rank per step, integers).

    Raises:
        InputError: non-positive sizes, a bad dtype or recompute setting.
    """
    for name, value in (
        ("tokens", tokens),
        ("cp", cp),
        ("batch", batch),
        ("shard_group", shard_group),
        ("dp_replicate", dp_replicate),
        ("ep", ep),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if dtype_bytes not in (2, 4):
        raise InputError(f"dtype_bytes must be 4 (fp32) or 2 (bf16), got {dtype_bytes!r}")
    kinds = _resolve_kinds(recompute, recompute_modules)
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    n_kda = sum(t == LINEAR_ATTENTION for t in cfg.layer_types)
    n_full = sum(t == INDEXED_ATTENTION and i == "full" for t, i in zip(cfg.layer_types, cfg.indexer_types))
    n_shared = sum(t == INDEXED_ATTENTION and i == "shared" for t, i in zip(cfg.layer_types, cfg.indexer_types))
    redo_kda = recompute in _BLOCK_RECOMPUTE or "kda" in kinds
    redo_dsa = recompute in _BLOCK_RECOMPUTE or "dsa" in kinds
    redo_moe = recompute in _BLOCK_RECOMPUTE or "moe" in kinds
    compute = dtype_bytes  # element bytes of the compute dtype: fp32 4, bf16 2
    rows: list[CommRow] = []

    def payload_row(name: str, layers: int, call: dict[str, int], redo: bool) -> CommRow:
        # forward calls are all-gathers of the rank's piece, backward calls all-reduces of W pieces
        fwd, bwd = layers * call["forward"], layers * call["backward"]
        rec = fwd if redo else 0
        wire = _ring_allgather(fwd + rec, cp) + _ring_allreduce(bwd, cp)
        return CommRow("kda", name, layers, PAYLOAD, fwd, rec, bwd, wire)

    heads, d = cfg.linear_num_heads, cfg.linear_head_dim
    # the counts of cp_kda_comm_bytes / conv_halo_comm_bytes, from their torch-free arithmetic
    state = kda_state_payload(batch, heads, d, d, cp, 4)  # the mixer runs KDA on fp32 q, k, v
    halo = conv_halo_payload(batch, 3 * heads * d, cfg.linear_conv_kernel_dim, cp, compute)
    rows.append(payload_row("KDA state all-gather fwd / all-reduce bwd (cp_kda_comm_bytes)", n_kda, state, redo_kda))
    rows.append(payload_row("KDA short-conv halo (conv_halo_comm_bytes)", n_kda, halo, redo_kda))
    for name, layers, full in (
        ("DSA latent + pooled index keys, full-indexer layers", n_full, True),
        ("DSA latent, shared-indexer layers", n_shared, False),
    ):
        call = cp_dsa_comm_bytes(cfg, batch, tokens, cp, full_indexer=full, dtype_bytes=dtype_bytes)
        fwd, bwd = layers * call["forward"], layers * call["backward"]
        rec = fwd if redo_dsa else 0
        # received bytes of an all-gather / reduce-scatter are what a ring sends
        rows.append(CommRow("dsa", name + " (cp_dsa_comm_bytes)", layers, RECEIVED, fwd, rec, bwd, fwd + rec + bwd))

    if ep > 1:
        if shard_group % ep:
            raise InputError(f"parallel.ep = {ep} does not divide the shard group dp_shard x cp = {shard_group}")
        call = ep_comm_bytes(cfg, batch * tokens, ep, moe_chunk_tokens, dtype_bytes)
        n_moe = sum(t == "sparse" for t in (cfg.mlp_layer_types or ()))
        forward = call["forward"] + call["splits"]
        rec = forward if redo_moe else 0
        rows.append(
            CommRow(
                "ep",
                "EP dispatch + combine all-to-all, split sizes (ep_comm_bytes)",
                n_moe,
                SENT,
                forward,
                rec,
                call["backward"],
                forward + rec + call["backward"],
            )
        )

    S, R = shard_group, dp_replicate
    all_units = fsdp_unit_groups(cfg, S, ep, split=split)
    last_block = cfg.num_hidden_layers - 1
    p_dtype = "bf16" if dtype_bytes == 2 else "fp32"
    for kind, label in (("dense", ""), ("experts", "experts ")):
        units = [u for u in all_units if (u.kind == "experts") == (kind == "experts")]
        if not units:
            continue
        G = units[0].group
        shards = [math.ceil(u.params / u.group) for u in units]
        # every unit but the last block's (and its experts) is resharded after forward; the root is not
        resharded = [sh for u, sh in zip(units, shards) if u.kind != "root" and u.layer != last_block]
        gather_fwd = sum((u.group - 1) * sh * dtype_bytes for u, sh in zip(units, shards))
        gather_bwd = sum((G - 1) * sh * dtype_bytes for sh in resharded)
        # only the trained parameters have gradients to reduce (a frozen unit none)
        reduced = [u for u in units if u.trained > 0]
        reduce = sum((u.group - 1) * math.ceil(u.trained / u.group) * _F32 for u in reduced)
        over = f", over {G}" if kind == "experts" else ""
        rows.append(
            CommRow(
                "fsdp",
                f"FSDP {label}parameter all-gather fwd ({p_dtype}{over})",
                len(units),
                RECEIVED,
                gather_fwd,
                0,
                0,
                gather_fwd,
            )
        )
        rows.append(
            CommRow(
                "fsdp",
                f"FSDP {label}parameter all-gather bwd, resharded units ({p_dtype}{over})",
                len(resharded),
                RECEIVED,
                0,
                0,
                gather_bwd,
                gather_bwd,
            )
        )
        trained_note = ", trained parameters only" if split is not None and split.any_frozen else ""
        rows.append(
            CommRow(
                "fsdp",
                f"FSDP {label}gradient reduce-scatter (fp32{over}{trained_note})",
                len(reduced),
                RECEIVED,
                0,
                0,
                reduce,
                reduce,
            )
        )
        if R > 1:
            replicas = sum(_ring_allreduce(math.ceil(u.trained / u.group) * _F32, R) for u in reduced)
            rows.append(
                CommRow(
                    "fsdp",
                    f"HSDP {label}gradient all-reduce across replicas (fp32, ring)",
                    len(units),
                    RECEIVED,
                    0,
                    0,
                    replicas,
                    replicas,
                )
            )
    return CommEstimate(cp=cp, shard_group=S, dp_replicate=R, tokens_per_rank=batch * tokens, rows=rows, ep=ep)
