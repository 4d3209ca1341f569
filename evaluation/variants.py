"""``genolong variants``' runner: score variants at one or more contexts, resumably, and write the tables.

For each context of ``contexts`` the variants are grouped into prefix-sharing blocks
(:func:`~genolong.evaluation.variant_score.plan_blocks`) and scored block by block
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

from ..errors import InputError, Stopped
from ..files import replace_dir, replace_file, writes_output
from ..model.stream import check_segment_tokens
from ..model.vocab import VocabMap
from ..signals import SignalFlag
from .score import _progress, kernel_backend_meta, model_signature
from .variant_score import DEFAULT_WINDOW, STRANDS, AlleleScores, ReferenceLike, plan_blocks, score_block, score_variants_streamed
from .vcf import Variant

__all__ = ["COLUMNS", "score_variants", "context_effect"]

#: Columns of ``scores.tsv`` / ``scores.parquet`` (``llr_forward`` and ``llr_reverse`` only with ``strands="both"``).
COLUMNS = ("contig", "input_pos", "id", "input_ref", "input_alt", "record", "allele", "pos", "ref", "alt", "context",
           "context_used", "window", "logp_ref", "logp_alt", "llr", "llr_forward", "llr_reverse")

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


def _block_rows(variants: Sequence[Variant], indices: Sequence[int], context: int,
                forward: Sequence[AlleleScores], reverse: Sequence[AlleleScores] | None) -> pd.DataFrame:
    """One block's rows (columns :data:`COLUMNS`, the strand ones only with ``reverse``)."""
    rows: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for j, i in enumerate(indices):
        v, f = variants[i], forward[j]
        for name, value in (("contig", v.contig), ("input_pos", v.input_pos), ("id", v.id), ("input_ref", v.input_ref),
                            ("input_alt", v.input_alt), ("record", v.record), ("allele", v.allele), ("pos", v.pos + 1),
                            ("ref", v.ref), ("alt", v.alt), ("context", context), ("context_used", f.context_used),
                            ("window", f.window), ("logp_ref", f.logp_ref), ("logp_alt", f.logp_alt)):
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
    return table.astype({"input_pos": "int64", "record": "int64", "allele": "int64", "pos": "int64",
                         "context": "int64", "context_used": "int64", "window": "int64"})


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
    summary = {"context_short": short, "context_long": long_, "variants": int(len(per)),
               "mean_abs_delta": float(d.mean()) if len(d) else math.nan,
               "median_abs_delta": float(d.median()) if len(d) else math.nan,
               "max_abs_delta": float(d.max()) if len(d) else math.nan,
               "sign_flips": int(per["sign_flip"].sum()),
               "pearson_llr_short_long": None if math.isnan(corr) else corr}
    return per, summary


def _check_settings(work: Path, settings: Mapping[str, Any]) -> None:
    """Resume ``work`` only with the settings it was begun with (else one line naming the difference)."""
    saved = json.loads((work / _SETTINGS).read_text())
    if saved != settings:
        keys = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        raise InputError(f"{work} holds an unfinished variant scoring with other settings ({', '.join(keys)}): "
                         f"rerun with the same ones to resume it, or delete {work} to start afresh")


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
) -> pd.DataFrame:
    """Score every variant at every context and write ``out`` (see the module docstring).

    Args:
        model: a GenoLM (its device and dtype are used as they are; put in eval mode here).
        reference: the reference (``vcf.Reference`` or any
            :class:`~genolong.evaluation.variant_score.ReferenceLike`).
        variants: normalised variants (any order; ``record``/``allele`` identify them).
        out: result directory (must not exist unless ``force``).
        contexts: context lengths ``L`` (each >= 1; distinct).
        window: reference bases scored after each variant (default 128).
        strands: ``"forward"`` (default) or ``"both"`` (plus and minus strand averaged).
        span: block span (default None: each context ``L``).
        segment_tokens: prefill segment (default 65536).
        vocab: base ids -> model ids (default None: nucleotide ids).
        meta: plain data for ``meta.json`` (checkpoint, reference, VCF...); part of the settings a
            resumed run is checked against.
        finish: ``finish(work_dir, table)`` called with the complete table before the rename (e.g.
            to write an annotated VCF into the result); default None.
        progress: a progress bar (default: on a terminal).
        force: replace an existing ``out`` (default False).

    Returns:
        The ``scores`` table (ordered by context as given, then record and allele).

    Raises:
        InputError: ``out`` exists (without ``force``); bad contexts, window, strands or span; a
            ``.<out>.partial`` of other settings; a variant whose REF differs from the reference.
        Stopped: a stop signal (SIGTERM, SIGINT...) arrived; the committed blocks stay for a rerun.
    """
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
    settings = {
        "checkpoint": "(in memory)", "reference": "(in memory)",
        **{k: v for k, v in (meta or {}).items()},
        "model_signature": model_signature(model),
        **kernel_backend_meta(model),
        "contexts": contexts, "window": int(window), "strands": strands,
        "span": None if span is None else int(span), "segment_tokens": int(segment_tokens),
        "variants": len(variants), "variants_sha256": _variants_digest(variants),
    }
    work = _partial_dir(out)
    parts = work / _PARTS
    if (work / _SETTINGS).is_file():
        _check_settings(work, settings)
    else:
        if work.exists():
            shutil.rmtree(work)
        parts.mkdir(parents=True)
        replace_file(work / _SETTINGS, lambda tmp: tmp.write_text(json.dumps(settings, indent=1)))
    plans = [plan_blocks(variants, c, span) for c in contexts]
    names = [(k, b) for k, blocks in enumerate(plans) for b in range(len(blocks))]
    done = set()
    for entry in parts.iterdir():  # a temporary file of an uncommitted part: removed
        m = re.fullmatch(r"part-(\d{3})-(\d{6})\.parquet", entry.name)
        if m is None:
            entry.unlink()
        else:
            done.add((int(m.group(1)), int(m.group(2))))
    timing = json.loads((work / _TIMING).read_text()) if (work / _TIMING).is_file() else {"seconds": 0.0}

    was_training = model.training
    model.eval()
    bar = _progress(len(names), len(done), progress, out.name, command="variants", unit="block")
    stop = SignalFlag()
    stop.install()
    try:
        for k, b in names:
            if (k, b) in done:
                continue
            got = stop.local()
            if got:
                raise Stopped(f"stopped by {SignalFlag.names(got)} after {len(done)} of {len(names)} blocks; they are "
                              f"kept in {work}, where the same command resumes")
            began = time.perf_counter()
            block = plans[k][b]
            forward = score_block(model, reference, variants, block, window, segment_tokens, vocab)
            reverse = None
            if strands == "both":
                mine = [variants[i] for i in block.indices]
                reverse = [None] * len(mine)
                for rblock, scores in score_variants_streamed(model, reference, mine, contexts[k], window, "reverse",
                                                              span, segment_tokens, vocab):
                    for j, s in zip(rblock.indices, scores):
                        reverse[j] = s
            rows = _block_rows(variants, block.indices, contexts[k], forward, reverse)
            replace_file(parts / f"part-{k:03d}-{b:06d}.parquet", lambda tmp: rows.to_parquet(tmp, index=False))
            done.add((k, b))
            timing["seconds"] += time.perf_counter() - began
            replace_file(work / _TIMING, lambda tmp: tmp.write_text(json.dumps(timing)))
            if bar is not None:
                bar.update(1)
    finally:
        stop.restore()
        model.train(was_training)
        if bar is not None:
            bar.close()

    frames = [pd.read_parquet(parts / f"part-{k:03d}-{b:06d}.parquet") for k, b in names]
    table = pd.concat(frames, ignore_index=True) if frames else _block_rows(variants, [], 0, [], None if strands == "forward" else [])
    order = {c: i for i, c in enumerate(contexts)}
    table = (table.assign(_k=table["context"].map(order)).sort_values(["_k", "record", "allele"], kind="stable")
             .drop(columns="_k").reset_index(drop=True))
    table.to_parquet(work / "scores.parquet", index=False)
    table.to_csv(work / "scores.tsv", sep="\t", index=False, float_format="%.17g")
    result_meta: dict[str, Any] = {"format": "genolong-variants/1", **settings,
                                   "blocks": [len(p) for p in plans], "rows": int(len(table)),
                                   "seconds": timing["seconds"],
                                   "variants_per_second": (len(variants) * len(contexts) / timing["seconds"]
                                                           if timing["seconds"] > 0 else None)}
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
