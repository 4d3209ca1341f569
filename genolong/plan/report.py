"""The text tables of ``genolong plan``: :func:`format_plan` (a training step: cluster and settings,
device memory per GPU by line item, saved activations by part, communication per rank per step,
pinned host memory, the verdict, the suggestion, the assumptions) and :func:`format_eval_plan`
(``--evaluate``: the same for a forward-only scoring pass, with the largest forward working set
tensor by tensor and the activation peak by phase).

Only formatting: every figure comes from :class:`~genolong.plan.train.Plan` or
:class:`~genolong.plan.evaluate.EvalPlan` (``--json`` prints their fields instead).
``tests/plan/test_plan_train.py``, ``tests/plan/test_plan_comm.py`` and ``tests/plan/test_plan_evaluate.py`` check
the tables' lines, and that the command's JSON is the plan's ``to_dict()``.
"""

from __future__ import annotations

import shlex

from ..units import format_bytes
from .evaluate import EvalPlan
from .train import TRANSIENTS, Plan

__all__ = ["format_eval_plan", "format_plan"]

#: the planner's kernel names -> what runs them, in the words of the backend registry's ``impls``
#: (and of the run's log line, :func:`genolong.kernels.probe.kernel_line`)
_IMPL = {"torch": "torch", "fla": "fla-core", "triton": "genolong-triton"}


def _cell(nbytes: float) -> str:
    """A table cell's bytes in the unit that fits (:func:`genolong.units.format_bytes`; ``0`` for nothing)."""
    return format_bytes(nbytes, zero="0")


def format_plan(plan: Plan) -> str:
    """The plan as a text table: cluster and settings, device memory per GPU by line item, the
    saved activations by part, communication per rank per step (KDA / DSA / FSDP), pinned host memory, the verdict, the suggestion and the assumptions."""
    p = plan
    lines = [
        f"plan: {p.recipe} -- {p.model}",
        f"cluster: {p.gpus} GPUs = {p.nodes} nodes x {min(p.gpus_per_node, p.gpus)}; mesh cp {p.cp} x dp_shard {p.dp_shard}"
        f" x dp_replicate {p.dp_replicate} (parameters sharded over {p.shard_group})"
        + (
            f"; ep {p.ep} ({p.experts_per_rank} experts per rank, experts sharded over {p.expert_shard_group})"
            if p.ep > 1
            else "; ep 1"
        ),
        f"per rank: {p.tokens_per_rank:,} tokens; {p.precision}; recompute {p.recompute}"
        + (f" ({', '.join(p.recompute_modules) or 'default'})" if p.recompute == "selective" else "")
        + (f" ({p.recompute_chunk_tokens:,} tokens)" if p.recompute == "chunked" else "")
        + f"; offload {'on' if p.offload else 'off'}; MoE chunk {p.moe_chunk_tokens or 'all'}; CE chunk {p.ce_chunk_tokens}",
        f"kernels counted: backend {p.kernel_backend!r} -> KDA {_IMPL[p.kda_kernel]}, DSA {_IMPL[p.dsa_kernel]}"
        + ("" if p.kda_kernel == "torch" and p.dsa_kernel == "torch" else " (on a CUDA machine with genolong[gpu])"),
        *([f"kernels on this machine: {p.kernels_here}"] if p.kernels_here else []),
        "",
        "| device memory per GPU | size |",
        "|---|---:|",
    ]
    for name, value in p.device.items():
        note = ""
        if name in TRANSIENTS:
            note = " (counted: largest transient)" if name == p.transient_peak else " (not counted: overlaps)"
        lines.append(f"| {name}{note} | {_cell(value)} |")
    lines.append(f"| **total (peak)** | **{_cell(p.device_total)}** of {_cell(p.gpu_mem)} |")
    n = p.tokens_per_rank
    lines += [
        "",
        "| activations by part, all layers | saved per token | saved | without recompute: per token | all |",
        "|---|---:|---:|---:|---:|",
    ]
    if p.ep > 1:
        lines.insert(len(lines) - 2, "(moe: the busiest EP rank, its routed-expert rows at the imbalance)")
    kinds = sorted(set(p.activations_by_kind) | set(p.plain_by_kind), key=lambda k: -p.plain_by_kind.get(k, 0))
    for kind in kinds:
        saved, plain = p.activations_by_kind.get(kind, 0), p.plain_by_kind.get(kind, 0)
        lines.append(f"| {kind} | {_cell(saved / n)} | {_cell(saved)} | {_cell(plain / n)} | {_cell(plain)} |")
    lines += [
        "",
        f"| communication per rank per step (cp {p.comm.cp}, "
        + (f"ep {p.comm.ep}, " if p.comm.ep > 1 else "")
        + f"FSDP over {p.comm.shard_group}"
        + (f" x {p.comm.dp_replicate} replicas" if p.comm.dp_replicate > 1 else "")
        + ") | layers | counts | forward | recompute | backward | step | ring wire |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in p.comm.rows:
        lines.append(
            f"| {r.name} | {r.layers} | {r.convention} | {_cell(r.forward)} | {_cell(r.recompute)} | "
            f"{_cell(r.backward)} | {_cell(r.total)} | {_cell(r.wire)} |"
        )
    for part, label in (("kda", "KDA (CP)"), ("dsa", "DSA (CP)"), ("ep", "EP all-to-all"), ("fsdp", "FSDP")):
        if part == "ep" and p.comm.ep == 1:
            continue
        lines.append(
            f"| **{label} total** | | | | | | **{_cell(p.comm.part_total(part))}** | "
            f"**{_cell(p.comm.part_wire(part))}** |"
        )
    host_budget = "" if p.host_mem is None else f" (budget {format_bytes(p.host_mem)} per node)"
    lines += [
        "",
        f"pinned host memory for offload: {format_bytes(p.host_per_gpu)} per GPU, {format_bytes(p.host_per_node)} per node{host_budget}",
        f"checkpoints: {format_bytes(p.checkpoint_bytes)} per save (trained parameters + AdamW state + routing biases"
        + ("; the frozen weights are read from the base again" if p.load_read_per_rank else "; every parameter")
        + "), "
        f"{format_bytes(p.checkpoint_disk_bytes)} on disk with keep_last {p.keep_last}"
        + (
            f"; at load each rank reads {format_bytes(p.load_read_per_rank)} of the base (its 1/{p.shard_group}, bf16)"
            if p.load_read_per_rank
            else ""
        ),
        f"verdict: {'FITS' if p.fits else 'DOES NOT FIT'} (device {'ok' if p.fits_device else 'over'}, host "
        f"{'ok' if p.fits_host else 'over'})",
    ]
    if not p.fits:
        if p.suggestion:
            lines.append(
                f"cheapest change that fits: {' '.join('--set ' + s if not s.startswith('--') else s for s in p.suggestion)}"
                f" -> {format_bytes(p.suggestion_total or 0)} per GPU"
            )
        else:
            lines.append(
                "no change tried fits (recompute, offload, expert parallelism, chunks, up to 8x CP, 4x GPUs): "
                "use larger GPUs or a shorter context"
            )
        if p.trainable_suggestion:
            # quoted: the globs and brackets are shell syntax
            lines.append(
                f"or train fewer parameters: {' '.join('--set ' + shlex.quote(s) for s in p.trainable_suggestion)}"
                f" -> {format_bytes(p.trainable_suggestion_total or 0)} per GPU"
            )
    lines += ["", "assumptions:"] + [f"- {a}" for a in p.assumptions]
    return "\n".join(lines)


def format_eval_plan(plan: EvalPlan) -> str:
    """The evaluation plan as text: cluster and settings, device memory per GPU by line item, the
    largest forward working set tensor by tensor, the activation peak by phase, host memory for
    loading, the verdict, the suggestion and the assumptions."""
    p = plan
    lines = [
        f"plan --evaluate: {p.recipe} -- {p.model}",
        f"cluster: {p.gpus} {'GPUs' if p.accelerator != 'cpu' else 'processes (CPU)'} = {p.nodes} nodes x "
        f"{min(p.gpus_per_node, p.gpus)}; mesh cp {p.cp} x dp_shard {p.dp_shard} x dp_replicate {p.dp_replicate} "
        f"(weights sharded over {p.shard_group}; tiles dealt to {p.dp_shard * p.dp_replicate} data-parallel groups)"
        + (
            f"; ep {p.ep} ({p.experts_per_rank} experts per rank, experts sharded over {p.expert_shard_group})"
            if p.ep > 1
            else "; ep 1"
        ),
        f"tile: {p.context:,} tokens; per rank {p.tokens_per_rank:,}"
        + (f", streamed {p.segment_tokens:,} at a time" if p.segment_tokens else "")
        + f"; {p.dtype}; MoE chunk {p.moe_chunk_tokens or 'all'}; forward only",
        f"kernels: backend {p.kernel_backend!r} -> KDA {p.kda_kernel}, DSA {p.dsa_kernel}",
        "",
        f"| {'device memory per GPU' if p.accelerator != 'cpu' else 'memory per process (CPU)'} (evaluation) | size |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {_cell(value)} |" for name, value in p.device.items()]
    lines.append(f"| **total (peak)** | **{_cell(p.device_total)}** of {_cell(p.gpu_mem)} |")
    lines += ["", f"| forward working set: {p.peak_phase} | size |", "|---|---:|"]
    # (a '|' inside a tensor's name, e.g. q|k|v, would split the markdown row)
    lines += [
        f"| {t.kind}: {t.name.replace('|', '/')} | {_cell(t.nbytes)} |"
        for t in sorted(p.working, key=lambda t: -t.nbytes)
    ]
    lines += ["", "| activation peak by phase (largest layer of each kind) | size |", "|---|---:|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in sorted(p.phase_bytes.items(), key=lambda kv: -kv[1])]
    budget = "" if p.host_mem is None else f" (budget {format_bytes(p.host_mem)} per node)"
    lines += ["", "| host memory per GPU (loading) | size |", "|---|---:|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in p.host.items()]
    lines += [
        f"| **total** | **{_cell(p.host_per_gpu)}** ({_cell(p.host_per_node)} per node{budget}) |",
        "",
        f"verdict: {'FITS' if p.fits else 'DOES NOT FIT'} (device {'ok' if p.fits_device else 'over'}, host "
        f"{'ok' if p.fits_host else 'over'})",
    ]
    if not p.fits:
        if p.suggestion:
            lines.append(
                f"first change that fits: {' '.join('--set ' + s if not s.startswith('--') else s for s in p.suggestion)}"
                f" -> {format_bytes(p.suggestion_total or 0)} per GPU"
            )
        else:
            lines.append(
                "no change tried fits (expert parallelism, MoE chunks, streaming, up to 8x CP, 4x GPUs): use larger GPUs, "
                "more of them or a shorter context"
            )
    lines += ["", "assumptions:"] + [f"- {a}" for a in p.assumptions]
    return "\n".join(lines)
