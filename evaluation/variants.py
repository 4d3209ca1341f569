"""``genolong variants``' runner: score variants at one or more contexts, resumably, and write the tables.

For each context of ``contexts`` the variants are grouped into prefix-sharing blocks on a fixed grid
of the genome (:func:`~genolong.evaluation.variant_score.plan_blocks`: a variant's block, and so its
scores, depend on its position alone; the rule is ``meta.json``'s ``layout``) and scored block by block
(:func:`~genolong.evaluation.variant_score.score_block`). Work happens in ``.<out>.partial`` next
to ``out``: each finished block is committed as one parquet part written atomically
(:func:`genolong.files.replace_file`), so a killed run, rerun with the same settings, resumes at
the next block and ends with the same tables, bit for bit. When every block is scored the parts
become the result and the directory is renamed to ``out``:

- ``scores.tsv`` / ``scores.parquet``: one row per variant per context (columns in
  :data:`COLUMNS`; ``pos`` is the normalised 1-based position, as a VCF writes it; ``llr`` is
  ``logp_alt - logp_ref``, or with ``strands="both"`` the mean of ``llr_forward`` and
  ``llr_reverse``; ``logp_*`` are then the forward strand's);
- ``meta.json``: what was scored (``meta``, the model's signature, contexts, window, strands,
  counts) and the time it took;
- ``context_effect.tsv`` (two or more contexts): per variant the LLR at the shortest and the
  longest context, their difference and whether the sign flips; its summary is in ``meta.json``.

Several processes (``score_variants(group=...)``, :mod:`genolong.evaluation.distributed`; the CLI's
``--recipe R`` / ``--set parallel.KEY=VALUE``) run the same loop: the blocks not yet committed are
dealt to the data-parallel groups a round of ``dp`` at a time, each rank streams its block through
the whole model (FSDP2's shards gathered on every rank for the loop), global rank 0 gathers the
scores and commits the round's parts. Without context parallelism the tables equal the
one-process ones bit for bit. A context-parallel group of ``C`` ranks runs its block's reference
prefix split ``C`` ways (:func:`~genolong.parallel.cp_prefill.cp_prefill`), every rank ending with
the whole stream state, then each rank scores every ``C``-th variant of the block: equal to the
one-process scores up to float rounding. The layout is in the settings (``parallel``), so a
resumed run must keep it. Expert parallelism is refused (:func:`check_layout`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..config import kernel_multiple
from ..errors import InputError
from ..files import replace_dir, replace_file, writes_output
from ..model.stream import check_segment_tokens
from ..model.vocab import VocabMap
from ..parallel.context import apply_context_parallel
from ..parallel.mesh import cp_group
from ..signals import SignalFlag
from .distributed import (
    ScoringGroup,
    broadcast_from_writer,
    gather_to_writer,
    raise_on_every_rank,
    stop_if_signalled,
    tile_rounds,
    unsharded,
)
from .score import _progress, kernel_backend_meta, model_signature
from .variant_score import (
    DEFAULT_WINDOW,
    STRANDS,
    AlleleScores,
    Block,
    ReferenceLike,
    layout_rule,
    plan_blocks,
    score_block,
    score_variants_streamed,
)
from .vcf import Variant

__all__ = ["COLUMNS", "check_layout", "score_variants", "context_effect"]

#: Columns of ``scores.tsv`` / ``scores.parquet`` (``llr_forward`` and ``llr_reverse`` only with ``strands="both"``).
COLUMNS = (
    "contig",
    "input_pos",
    "id",
    "input_ref",
    "input_alt",
    "record",
    "allele",
    "pos",
    "ref",
    "alt",
    "context",
    "context_used",
    "window",
    "logp_ref",
    "logp_alt",
    "llr",
    "llr_forward",
    "llr_reverse",
)

_SETTINGS = "settings.json"
_TIMING = "timing.json"
_PARTS = "parts"


def _partial_dir(out: Path) -> Path:
    """The unfinished result directory of ``out``: committed blocks, resumed by the next run."""
    return out.with_name(f".{out.name}.partial")


def _variants_digest(variants: Sequence[Variant]) -> str:
    """Identity of the scored variants (a resumed run must score the same list)."""
    h = hashlib.sha256()
    for v in variants:
        h.update(f"{v.contig}\t{v.pos}\t{v.ref}\t{v.alt}\t{v.record}\t{v.allele}\n".encode())
    return h.hexdigest()


def _block_rows(
    variants: Sequence[Variant],
    indices: Sequence[int],
    context: int,
    forward: Sequence[AlleleScores],
    reverse: Sequence[AlleleScores] | None,
) -> pd.DataFrame:
    """One block's rows (columns :data:`COLUMNS`, the strand ones only with ``reverse``)."""
    rows: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for j, i in enumerate(indices):
        v, f = variants[i], forward[j]
        for name, value in (
            ("contig", v.contig),
            ("input_pos", v.input_pos),
            ("id", v.id),
            ("input_ref", v.input_ref),
            ("input_alt", v.input_alt),
            ("record", v.record),
            ("allele", v.allele),
            ("pos", v.pos + 1),
            ("ref", v.ref),
            ("alt", v.alt),
            ("context", context),
            ("context_used", f.context_used),
            ("window", f.window),
            ("logp_ref", f.logp_ref),
            ("logp_alt", f.logp_alt),
        ):
            rows[name].append(value)
        if reverse is None:
            rows["llr"].append(f.llr)
        else:
            r = reverse[j]
            rows["llr_forward"].append(f.llr)
            rows["llr_reverse"].append(r.llr)
            rows["llr"].append(0.5 * (f.llr + r.llr))
    if reverse is None:
        del rows["llr_forward"], rows["llr_reverse"]
    table = pd.DataFrame(rows)
    return table.astype(
        {
            "input_pos": "int64",
            "record": "int64",
            "allele": "int64",
            "pos": "int64",
            "context": "int64",
            "context_used": "int64",
            "window": "int64",
        }
    )


def context_effect(table: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """How much each variant's LLR moves from the shortest to the longest context of ``table``.

    Args:
        table: ``scores`` rows of two or more contexts.

    Returns:
        ``(per variant: contig, pos, id, ref, alt, record, allele, llr_short, llr_long, delta =
        llr_long - llr_short, sign_flip; summary: contexts, variants, mean / median / max |delta|,
        sign flips, Pearson correlation of the two LLRs)``.
    """
    short, long_ = int(table["context"].min()), int(table["context"].max())
    keys = ["contig", "pos", "id", "ref", "alt", "record", "allele"]
    a = table[table["context"] == short].set_index(["record", "allele"])
    b = table[table["context"] == long_].set_index(["record", "allele"])
    per = a[[k for k in keys if k not in ("record", "allele")]].copy()
    per["llr_short"] = a["llr"]
    per["llr_long"] = b["llr"].reindex(a.index)
    per["delta"] = per["llr_long"] - per["llr_short"]
    per["sign_flip"] = np.sign(per["llr_long"]) * np.sign(per["llr_short"]) < 0
    per = per.reset_index()[keys + ["llr_short", "llr_long", "delta", "sign_flip"]]
    d = per["delta"].abs()
    corr = float(np.corrcoef(per["llr_short"], per["llr_long"])[0, 1]) if len(per) > 1 else math.nan
    summary = {
        "context_short": short,
        "context_long": long_,
        "variants": int(len(per)),
        "mean_abs_delta": float(d.mean()) if len(d) else math.nan,
        "median_abs_delta": float(d.median()) if len(d) else math.nan,
        "max_abs_delta": float(d.max()) if len(d) else math.nan,
        "sign_flips": int(per["sign_flip"].sum()),
        "pearson_llr_short_long": None if math.isnan(corr) else corr,
    }
    return per, summary


def _check_settings(work: Path, settings: Mapping[str, Any]) -> None:
    """Resume ``work`` only with the settings it was begun with (else one line naming the difference)."""
    saved = json.loads((work / _SETTINGS).read_text())
    if saved != settings:
        keys = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        raise InputError(
            f"{work} holds an unfinished variant scoring with other settings ({', '.join(keys)}): "
            f"rerun with the same ones to resume it, or delete {work} to start afresh"
        )


def check_layout(ep: int, world: int) -> None:
    """The layouts variant scoring runs on: each rank streams through the whole model.

    The rank's share of a block runs in a :class:`~genolong.model.stream.PrefillStream`, which
    calls the layers' parts directly, every rank a different number of times: a ``dp_shard`` group
    gathers the whole model on every rank (:func:`~genolong.evaluation.distributed.unsharded`), a
    CP group splits only the block's long prefix (its own collectives,
    :func:`~genolong.parallel.cp_prefill.cp_prefill`). Expert parallelism would send every token
    to other ranks' experts, every rank in step: not done here.

    Args:
        ep: ``parallel.ep``.
        world: processes in the job.

    Raises:
        InputError: ``ep > 1`` on several processes (one line naming the fix).
    """
    if ep > 1 and world > 1:
        raise InputError(
            "genolong variants streams each block on its own ranks; with parallel.ep > 1 the experts' "
            f"all-to-all would need every rank in step: run it with parallel.ep: 1 (got {ep})"
        )


def _open_work(work: Path, settings: Mapping[str, Any]) -> tuple[set[tuple[int, int]], dict[str, float]]:
    """Resume ``work`` (its settings checked) or begin it; returns the committed ``(context, block)``
    parts and the timing so far. A temporary file of an uncommitted part is removed."""
    parts = work / _PARTS
    if (work / _SETTINGS).is_file():
        _check_settings(work, settings)
    else:
        if work.exists():
            shutil.rmtree(work)
        parts.mkdir(parents=True)
        replace_file(work / _SETTINGS, lambda tmp: tmp.write_text(json.dumps(settings, indent=1)))
    done = set()
    for entry in parts.iterdir():
        m = re.fullmatch(r"part-(\d{3})-(\d{6})\.parquet", entry.name)
        if m is None:
            entry.unlink()
        else:
            done.add((int(m.group(1)), int(m.group(2))))
    timing = json.loads((work / _TIMING).read_text()) if (work / _TIMING).is_file() else {"seconds": 0.0}
    return done, timing


def _score_unit(
    model: torch.nn.Module,
    reference: ReferenceLike,
    variants: Sequence[Variant],
    block: Block,
    context: int,
    window: int,
    strands: str,
    span: int | None,
    segment_tokens: int,
    vocab: VocabMap | None,
    cp_group: Any = None,
) -> tuple[list[AlleleScores | None], list[AlleleScores | None] | None]:
    """One block's scores: its variants on the plus strand, and with ``strands="both"`` on the minus
    strand too (planned again on mirrored coordinates, from the same variants). With ``cp_group``
    this rank's share (None for the other ranks' variants, :func:`score_block`)."""
    forward = score_block(model, reference, variants, block, window, segment_tokens, vocab, cp_group=cp_group)
    reverse: list[AlleleScores | None] | None = None
    if strands == "both":
        mine = [variants[i] for i in block.indices]
        reverse = [None] * len(mine)
        for rblock, scores in score_variants_streamed(
            model, reference, mine, context, window, "reverse", span, segment_tokens, vocab, cp_group=cp_group
        ):
            for j, s in zip(rblock.indices, scores):
                if s is not None:
                    reverse[j] = s
    return forward, reverse


def _merge(shares: Sequence[list[AlleleScores | None] | None]) -> list[AlleleScores] | None:
    """The scores of one block from its CP ranks' shares (each variant scored by exactly one)."""
    if shares[0] is None:
        return None
    merged = [next(s[j] for s in shares if s is not None and s[j] is not None) for j in range(len(shares[0]))]
    return merged  # type: ignore[return-value]


@writes_output("out", work=_partial_dir)
def score_variants(
    model: torch.nn.Module,
    reference: ReferenceLike,
    variants: Sequence[Variant],
    out: str | os.PathLike[str],
    contexts: Sequence[int],
    window: int = DEFAULT_WINDOW,
    strands: str = "forward",
    span: int | None = None,
    segment_tokens: int = 65536,
    vocab: VocabMap | None = None,
    meta: Mapping[str, Any] | None = None,
    finish: Callable[[Path, pd.DataFrame], None] | None = None,
    progress: bool | None = None,
    force: bool = False,
    group: ScoringGroup | None = None,
) -> pd.DataFrame | None:
    """Score every variant at every context and write ``out`` (see the module docstring).

    Args:
        model: a GenoLM (its device and dtype are used as they are; put in eval mode here); in a
            multi-process job the model on ``group``'s mesh
            (:func:`~genolong.evaluation.distributed.load_scoring_model`).
        reference: the reference (``vcf.Reference`` or any
            :class:`~genolong.evaluation.variant_score.ReferenceLike`).
        variants: normalised variants (any order; ``record``/``allele`` identify them).
        out: result directory (must not exist unless ``force``).
        contexts: context lengths ``L`` (each >= 1; distinct).
        window: reference bases scored after each variant (default 128).
        strands: ``"forward"`` (default) or ``"both"`` (plus and minus strand averaged).
        span: the block grid's cell in bases (default None: each context ``L``; 0: each variant
            exactly ``L``; :func:`~genolong.evaluation.variant_score.plan_blocks`). A variant's
            scores depend on its own position only, not on the other variants.
        segment_tokens: prefill segment (default 65536).
        vocab: base ids -> model ids (default None: nucleotide ids).
        meta: plain data for ``meta.json`` (checkpoint, reference, VCF...); part of the settings a
            resumed run is checked against.
        finish: ``finish(work_dir, table)`` called with the complete table before the rename (e.g.
            to write an annotated VCF into the result); default None.
        progress: a progress bar (default: on a terminal).
        force: replace an existing ``out`` (default False).
        group: the multi-process job (:class:`~genolong.evaluation.distributed.ScoringGroup`; every
            rank calls this with the same arguments): the blocks not yet committed, in order, are
            dealt to the data-parallel groups a round of ``dp`` at a time (block ``i`` of the round
            to dp rank ``i mod dp``), each rank streams its block through the whole model (gathered
            on every rank for the loop: :func:`~genolong.evaluation.distributed.unsharded`), global
            rank 0 gathers the scores and commits the round's parts. With ``parallel.cp > 1`` a CP
            group splits its block's prefix and then its variants (``score_block(cp_group=...)``;
            the model's own CP forms, installed by the loader, are removed for the loop and put
            back). Only ``parallel.ep: 1`` (:func:`check_layout`). The scores equal the
            one-process ones bit for bit at ``cp`` 1 (the same ops on the same weights, block by
            block), to float rounding at ``cp > 1``; the layout is in the settings
            (``parallel``), so a resumed run must keep it. Default None: one process.

    Returns:
        The ``scores`` table (ordered by context as given, then record and allele); None on the
        ranks other than global rank 0.

    Raises:
        InputError: ``out`` exists (without ``force``); bad contexts, window, strands or span; a
            ``.<out>.partial`` of other settings; a variant whose REF differs from the reference;
            a layout :func:`check_layout` refuses.
        Stopped: a stop signal (SIGTERM, SIGUSR1: :data:`~genolong.signals.DEFAULT_STOP_SIGNALS`) arrived;
            the committed blocks stay for a rerun (the CLI: one line, status 75).
    """
    group = group or ScoringGroup()
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    contexts = [int(c) for c in contexts]
    if not contexts or min(contexts) < 1 or len(set(contexts)) != len(contexts):
        raise InputError(f"--contexts must be distinct positive lengths (e.g. 1024,8192), got {contexts}")
    if strands not in STRANDS:
        raise InputError(f"--strands must be one of {', '.join(STRANDS)}, got {strands!r}")
    if window < 0:
        raise InputError(f"--window must be >= 0 bases, got {window}")
    check_segment_tokens(segment_tokens)
    check_layout(group.layout()["ep"], group.world)
    settings = {
        # the reference file when it is one (vcf.Reference), else what it is
        "checkpoint": "(in memory)",
        "reference": (
            str(Path(reference.path).resolve())
            if getattr(reference, "path", None) is not None
            else f"(in memory: {type(reference).__name__})"
        ),
        **{k: v for k, v in (meta or {}).items()},
        "model_signature": model_signature(model),
        **kernel_backend_meta(model),
        "contexts": contexts,
        "window": int(window),
        "strands": strands,
        "span": None if span is None else int(span),
        "layout": layout_rule(None, span),
        "segment_tokens": int(segment_tokens),
        "variants": len(variants),
        "variants_sha256": _variants_digest(variants),
        # the scores do not depend on it (whole blocks on whole models), but the model signature of
        # a sharded model may (sums over shards), and a resumed run keeps its layout as evaluate's does
        "parallel": group.layout(),
    }
    work = _partial_dir(out)
    parts = work / _PARTS
    plans = [plan_blocks(variants, c, span) for c in contexts]
    names = [(k, b) for k, blocks in enumerate(plans) for b in range(len(blocks))]
    opened: tuple[list[tuple[int, int]], int] | str | None = None
    timing = {"seconds": 0.0}
    if group.is_writer:
        try:
            done, timing = _open_work(work, settings)
            opened = ([n for n in names if n not in done], len(done))
        except InputError as error:
            if not group.distributed:
                raise
            opened = str(error)
    opened = broadcast_from_writer(opened, group)
    raise_on_every_rank(opened if isinstance(opened, str) else None, group)
    assert isinstance(opened, tuple)
    todo, n_done = opened

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    bar = (
        _progress(len(names), n_done, progress, out.name, command="variants", unit="block") if group.is_writer else None
    )
    stop = SignalFlag()
    stop.install()
    # a CP group splits each block's prefix by its own collectives (cp_prefill); the streams run
    # on the layers as one process's: the model's CP forms are removed for the loop
    cp = cp_group(group.mesh) if group.cp_size > 1 else None
    installed = next(
        (m.self_attn.cp_group for m in model.layers if getattr(m.self_attn, "cp_group", None) is not None), None
    )
    if installed is not None:
        apply_context_parallel(model, None)
    try:
        if group.distributed:
            # FSDP2 takes the first unit to run forward as its root: the whole model's, before the
            # stream calls the token embedding's unit alone (every rank, a collective)
            with torch.no_grad():
                model(torch.zeros(1, kernel_multiple(model.config, 1), dtype=torch.long, device=device))
        # the stream calls the layers' parts directly, each rank as often as its block needs: the
        # whole model on every rank for the loop (a collective; nothing happens without FSDP2)
        with unsharded(model):
            for round_ in tile_rounds(0, len(todo), group.dp_size):
                # a stop signal (preemption, a time limit): every rank leaves here, after the last committed round
                stop_if_signalled(stop, n_done, len(names), work, device, group, unit="blocks")
                began = time.perf_counter()
                mine = round_[group.dp_rank] if group.dp_rank < len(round_) else None  # None: idle this round
                share: tuple[int, int, Any, Any] | str | None = None
                if mine is not None:
                    k, b = todo[mine]
                    try:
                        share = (
                            k,
                            b,
                            *_score_unit(
                                model,
                                reference,
                                variants,
                                plans[k][b],
                                contexts[k],
                                window,
                                strands,
                                span,
                                segment_tokens,
                                vocab,
                                cp,
                            ),
                        )
                    except InputError as error:  # a bad variant: every rank stops, with its message
                        if not group.distributed:
                            raise
                        share = str(error)
                shares = gather_to_writer(share, group)
                error = None
                if shares is not None:
                    error = next((s for s in shares if isinstance(s, str)), None)
                    if error is None:
                        # the round is committed at once, one part per block: a kill leaves whole blocks
                        for k, b in sorted({(sh[0], sh[1]) for sh in shares if sh is not None}):
                            ranks = [sh for sh in shares if sh is not None and (sh[0], sh[1]) == (k, b)]
                            forward = _merge([sh[2] for sh in ranks])
                            assert forward is not None
                            rows = _block_rows(
                                variants, plans[k][b].indices, contexts[k], forward, _merge([sh[3] for sh in ranks])
                            )
                            replace_file(
                                parts / f"part-{k:03d}-{b:06d}.parquet", lambda tmp: rows.to_parquet(tmp, index=False)
                            )
                        timing["seconds"] += time.perf_counter() - began
                        replace_file(work / _TIMING, lambda tmp: tmp.write_text(json.dumps(timing)))
                        if bar is not None:
                            bar.update(len(round_))
                raise_on_every_rank(error, group)
                n_done += len(round_)
    finally:
        stop.restore()
        if installed is not None:
            apply_context_parallel(model, installed)
        model.train(was_training)
        if bar is not None:
            bar.close()
    if not group.is_writer:
        return None

    frames = [pd.read_parquet(parts / f"part-{k:03d}-{b:06d}.parquet") for k, b in names]
    table = (
        pd.concat(frames, ignore_index=True)
        if frames
        else _block_rows(variants, [], 0, [], None if strands == "forward" else [])
    )
    order = {c: i for i, c in enumerate(contexts)}
    table = (
        table.assign(_k=table["context"].map(order))
        .sort_values(["_k", "record", "allele"], kind="stable")
        .drop(columns="_k")
        .reset_index(drop=True)
    )
    table.to_parquet(work / "scores.parquet", index=False)
    table.to_csv(work / "scores.tsv", sep="\t", index=False, float_format="%.17g")
    result_meta: dict[str, Any] = {
        "format": "genolong-variants/1",
        **settings,
        "blocks": [len(p) for p in plans],
        "rows": int(len(table)),
        "seconds": timing["seconds"],
        "variants_per_second": (len(variants) * len(contexts) / timing["seconds"] if timing["seconds"] > 0 else None),
    }
    if len(contexts) > 1:
        per, summary = context_effect(table)
        per.to_csv(work / "context_effect.tsv", sep="\t", index=False, float_format="%.17g")
        result_meta["context_effect"] = summary
    (work / "meta.json").write_text(json.dumps(result_meta, indent=1))
    shutil.rmtree(parts)
    (work / _SETTINGS).unlink()
    (work / _TIMING).unlink(missing_ok=True)
    if finish is not None:
        finish(work, table)
    replace_dir(work, out)
    return table
