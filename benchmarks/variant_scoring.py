"""Variant scoring: the streamed engine (prefix once per block) against the brute force (two full forwards per variant).

The bundled base (``data/sample/base``, the ``small`` preset, fp32, loaded as ``genolong
evaluate`` loads a checkpoint) scores random SNVs and indels (70% SNVs, 15% insertions and 15%
deletions of 1-5 bases; seeded) placed in a region of real human DNA from the bundled sample
(default chr22:20,000,001-21,000,000 of GRCh37; ``--contig`` picks another sample contig, e.g.
the 2 Mb ``chr3:42000000-44000000`` for a 1M context). The region starts ``context`` bases into
the contig, so every variant has its full context. Each run is its own child process (``--child``)
so that its peak RSS (``os.wait4``) is its own:

- streamed: :func:`genolong.evaluation.variant_score.score_variants_streamed` over every variant
  (the reference prefix once per block, then the ref and alt windows per variant);
- brute force: :func:`genolong.evaluation.variant_score.brute_force_llr` (per allele one one-shot
  forward of the whole haplotype, exactly ``L`` bases of context plus the allele and the window:
  the naive scorer's ``2 (L + window)`` tokens) on a seeded subsample of ``--brute`` of the scored
  variants, side by side in the same script. Since issue 46 the streamed blocks lie on a fixed
  grid (:func:`~genolong.evaluation.variant_score.plan_blocks`), so a streamed variant reads
  ``L`` to ``2L - 1`` bases (its ``context_used``, a function of its position) and its LLR is
  not the naive one's: only the costs are compared here (the tests compare the engine with the
  oracle from the same start, bitwise).

``--tokens-only`` runs no model: the plan's token counts, streamed against naive, at each context.

The ratio is (brute seconds per variant) / (streamed seconds per variant), wall and CPU (the
steadier figure on a shared machine). ``--brute 0`` runs the streamed child only (throughput and
peak RSS); ``--contexts`` adds streamed-only rows at other contexts. ``--spread-blocks N`` scores N
blocks evenly spaced over the plan (``--max-blocks N``: the first N; ``--blocks 1,3``: those);
``--span`` bounds a block's extent (a small one keeps a 1M block's prefix near ``L``). The children print a ``progress``
line per block or brute-force variant into their logs (``--logs DIR`` keeps them), so a run cut
short still shows what it measured; the JSON has the per-block and per-variant times.

Usage (the default run takes minutes on 2 cores; the issue's runs are the next three)::

    python benchmarks/variant_scoring.py
    python benchmarks/variant_scoring.py --context 65536 --variants 1000 --region-bases 1000000 --brute 8 \
        --threads 1 --concurrent --json benchmarks/results/variant_scoring_65k.json
    python benchmarks/variant_scoring.py --context 8192 --variants 1000 --region-bases 1000000 --spread-blocks 33 \
        --brute 0 --threads 1 --json benchmarks/results/variant_scoring_8k.json
    python benchmarks/variant_scoring.py --contig chr3:42000000-44000000 --context 1048576 --variants 1000 \
        --region-bases 950000 --span 32768 --max-blocks 1 --brute 0 --threads 1 \
        --json benchmarks/results/variant_scoring_1m.json

Prints a table and writes JSON (default benchmarks/results/variant_scoring.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.append(str(HERE))  # benchmarks/_bench.py
from _bench import Fresh, FreshRun, environment, run_fresh, wait_any, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "variant_scoring.json"
GiB = 1 << 30


class _Reference:
    """One contig of a bgzipped FASTA in memory (the ``vcf.Reference`` duck type the scorer reads)."""

    def __init__(self, fasta: str, contig: str):
        import pysam

        from genolong.data.alphabet import encode

        with pysam.FastaFile(fasta) as f:
            self.seq = {contig: encode(f.fetch(contig))}
        self.names = [contig]

    def length(self, contig: str) -> int:
        return len(self.seq[contig])

    def tokens(self, contig: str, start: int, end: int) -> np.ndarray:
        return self.seq[contig][start:end].copy()


def random_variants(ref: _Reference, contig: str, start: int, end: int, n: int, seed: int) -> list[Any]:
    """``n`` seeded SNVs / insertions / deletions with ``pos`` in ``[start, end)`` and no N in REF."""
    from genolong.data.alphabet import decode
    from genolong.evaluation.vcf import Variant

    rng = np.random.default_rng(seed)
    out: list[Any] = []
    while len(out) < n:
        pos = int(rng.integers(start, end))
        kind = rng.choice(["snv", "ins", "del"], p=[0.7, 0.15, 0.15])
        size = int(rng.integers(1, 6))
        r = decode(ref.tokens(contig, pos, pos + (size + 1 if kind == "del" else 1))).upper()
        if "N" in r:
            continue
        if kind == "snv":
            alt = str(rng.choice([b for b in "ACGT" if b != r]))
        elif kind == "ins":
            alt = r + "".join(rng.choice(list("ACGT"), size))
        else:
            alt = r[0]
        out.append(Variant(contig, pos, r, alt, len(out), 1, f"v{len(out)}", pos + 1, r, alt))
    return out


def _select(blocks: list[Any], args: argparse.Namespace) -> list[Any]:
    """The blocks measured: all, those listed in ``--blocks`` (indices into the plan), the first
    ``--max-blocks`` or ``--spread-blocks`` evenly spaced over the plan."""
    if args.blocks:  # e.g. the blocks an earlier --spread-blocks run left out
        return [blocks[int(i)] for i in args.blocks.split(",") if int(i) < len(blocks)]
    if args.max_blocks:  # the first blocks of the whole plan: the variants' density and the blocks are the full run's
        return blocks[: args.max_blocks]
    if args.spread_blocks and args.spread_blocks < len(blocks):  # over the whole region: not only its start
        keep = sorted({int(round(x)) for x in np.linspace(0, len(blocks) - 1, args.spread_blocks)})
        return [blocks[i] for i in keep]
    return blocks


def _progress(doc: dict[str, Any]) -> None:
    """One line per finished block or variant on stderr: a run cut short still leaves its figures in its log."""
    print("progress " + json.dumps(doc), file=sys.stderr, flush=True)


def child(args: argparse.Namespace) -> None:
    """One measured run: print one JSON line (and a ``progress`` line on stderr per block or variant)."""
    import torch

    from genolong.allocator import keep_freed_memory
    from genolong.evaluation.checkpoint import load_eval_model
    from genolong.evaluation.variant_score import brute_force_llr, plan_blocks, score_block

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    model, vocab = load_eval_model(args.checkpoint)
    ref = _Reference(args.fasta, args.contig)
    start = args.context
    end = min(start + args.region_bases, ref.length(args.contig) - 1)
    variants = random_variants(ref, args.contig, start, end, args.variants, args.seed)
    plan = plan_blocks(variants, args.context, args.span or None)
    blocks = _select(plan, args)
    chosen = sorted(i for b in blocks for i in b.indices)
    began, cpu = time.perf_counter(), time.process_time()
    if args.child == "streamed":
        llr: dict[int, float] = {}
        per_block = []
        for block in blocks:
            t, c = time.perf_counter(), time.process_time()
            scores = score_block(model, ref, variants, block, args.window, args.segment_tokens, vocab)
            llr.update({i: s.llr for i, s in zip(block.indices, scores)})
            per_block.append(
                {
                    "block": plan.index(block),
                    "start": block.start,
                    "variants": len(block.indices),
                    "prefix_tokens": max(variants[i].pos for i in block.indices) - block.start,
                    "seconds": time.perf_counter() - t,
                    "cpu_seconds": time.process_time() - c,
                }
            )
            _progress({**per_block[-1], "llr": {str(i): s.llr for i, s in zip(block.indices, scores)}})
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
        print(
            json.dumps(
                {
                    "seconds": seconds,
                    "cpu_seconds": cpu,
                    "variants": len(chosen),
                    "blocks": len(blocks),
                    "plan_blocks": len(plan),
                    "prefix_tokens": sum(b["prefix_tokens"] for b in per_block),
                    "per_block": per_block,
                    "llr": {str(i): llr[i] for i in chosen},
                }
            )
        )
    else:
        # the naive scorer: per allele one one-shot forward of exactly L bases before the variant,
        # the allele and the window (2 (L + window) tokens). The streamed score of the same variant
        # reads its grid cell's context_used (L to 2L - 1 bases, issue 46), so the two LLRs are not
        # compared here: tests/evaluation/test_variant_score.py compares the engine with this oracle from the
        # same start, bitwise.
        pick = sorted(
            np.random.default_rng(args.seed + 1).choice(chosen, min(args.brute, len(chosen)), replace=False).tolist()
        )
        llr_list, per_variant = [], []
        for i in pick:
            t, c = time.perf_counter(), time.process_time()
            start = max(0, variants[i].pos - args.context)
            llr_list.append(brute_force_llr(model, ref, variants[i], start, args.window, vocab).llr)
            per_variant.append(
                {
                    "variant": i,
                    "tokens": variants[i].pos - start,
                    "seconds": time.perf_counter() - t,
                    "cpu_seconds": time.process_time() - c,
                    "llr": llr_list[-1],
                }
            )
            _progress(per_variant[-1])
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
        print(
            json.dumps(
                {
                    "seconds": seconds,
                    "cpu_seconds": cpu,
                    "variants": len(pick),
                    "picked": pick,
                    "llr": llr_list,
                    "per_variant": per_variant,
                }
            )
        )


def token_model(args: argparse.Namespace, context: int) -> dict[str, Any]:
    """Tokens the streamed engine and the naive scorer run for the run's variants at ``context``
    (no model: the plan alone). Streamed: per block its prefix (to the last whole 64-token chunk
    before its last variant) plus per variant two branches of the 0-63 bases to the variant, the
    allele and the window; naive: per variant two forwards of ``L`` + allele + window."""
    from genolong.evaluation.variant_score import plan_blocks

    ref = _Reference(args.fasta, args.contig)
    start = args.context
    end = min(start + args.region_bases, ref.length(args.contig) - 1)
    variants = random_variants(ref, args.contig, start, end, args.variants, args.seed)
    plan = plan_blocks(variants, context, args.span or None)
    n = ref.length(args.contig)
    prefix = branch = naive = 0
    for b in plan:
        last = max(variants[i].pos for i in b.indices)
        prefix += (last - b.start) // 64 * 64
        for i in b.indices:
            v = variants[i]
            w = min(args.window, n - v.end)
            lead = (v.pos - b.start) % 64
            branch += 2 * lead + len(v.ref) + len(v.alt) + 2 * w
            naive += 2 * min(context, v.pos) + len(v.ref) + len(v.alt) + 2 * w
    return {
        "context": context,
        "variants": len(variants),
        "blocks": len(plan),
        "prefix_tokens": prefix,
        "branch_tokens": branch,
        "streamed_tokens": prefix + branch,
        "naive_tokens": naive,
        "ratio": naive / (prefix + branch),
    }


def _command(args: argparse.Namespace, kind: str, context: int) -> list[str]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--context",
        context,
        "--variants",
        args.variants,
        "--region-bases",
        args.region_bases,
        "--brute",
        args.brute,
        "--contig",
        args.contig,
        "--fasta",
        args.fasta,
        "--checkpoint",
        args.checkpoint,
        "--window",
        args.window,
        "--segment-tokens",
        args.segment_tokens,
        "--seed",
        args.seed,
        "--threads",
        args.threads,
        "--max-blocks",
        args.max_blocks,
        "--spread-blocks",
        args.spread_blocks,
        "--span",
        args.span,
        "--blocks",
        args.blocks,
    ]
    return [str(c) for c in cmd]


def _figures(run: FreshRun, kind: str, context: int) -> dict[str, Any]:
    doc = run.check().last_json()
    doc.update({"kind": kind, "context": context, "peak_rss_bytes": run.peak_rss_bytes, "wall_s": run.wall_s})
    return doc


def _logs(args: argparse.Namespace) -> Path:
    """Where the children write (``--logs``, kept: their per-block progress; default a temporary folder)."""
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        return Path(args.logs)
    return Path(tempfile.mkdtemp(prefix="variant_scoring-"))


def measure(args: argparse.Namespace, kind: str, context: int) -> dict[str, Any]:
    """One child run to its end: its printed figures, peak RSS and wall time."""
    log = _logs(args) / f"{kind}-{context}.log"
    return _figures(run_fresh(_command(args, kind, context), cwd=ROOT, log=log), kind, context)


def measure_both(args: argparse.Namespace, context: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The streamed and the brute-force child: one after the other, or (``--concurrent``) at once."""
    if not args.concurrent:
        return measure(args, "streamed", context), measure(args, "brute", context)
    logs = _logs(args)
    started = [
        Fresh.start(_command(args, k, context), cwd=ROOT, log=logs / f"{k}-{context}.log", kind=k)
        for k in ("streamed", "brute")
    ]
    got = {child.extra["kind"]: _figures(run, child.extra["kind"], context) for child, run in wait_any(started)}
    return got["streamed"], got["brute"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--context", type=int, default=2048, help="context of the streamed-vs-brute comparison (default 2048)"
    )
    p.add_argument("--contexts", default="", help="more contexts for streamed-only throughput rows, e.g. 8192,1048576")
    p.add_argument("--variants", type=int, default=40, help="random variants (default 40)")
    p.add_argument("--region-bases", type=int, default=20000, help="the region the variants lie in (default 20,000)")
    p.add_argument(
        "--brute", type=int, default=3, help="variants the brute force scores (default 3; 0: the streamed run only)"
    )
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--segment-tokens", type=int, default=16384)
    p.add_argument("--contig", default="chr22:20000001-21000000")
    p.add_argument("--fasta", default=str(ROOT / "data" / "sample" / "sample.fa.gz"))
    p.add_argument("--checkpoint", default=str(ROOT / "data" / "sample" / "base"))
    p.add_argument(
        "--max-blocks",
        type=int,
        default=0,
        help="score only the first N blocks of the plan (and brute-force variants of those); 0: all",
    )
    p.add_argument(
        "--spread-blocks",
        type=int,
        default=0,
        help="score only N blocks evenly spaced over the plan (first and last included); 0: all",
    )
    p.add_argument(
        "--blocks", default="", help="score only these blocks of the plan, e.g. 1,3,5 (indices from 0); default: all"
    )
    p.add_argument(
        "--span",
        type=int,
        default=0,
        help="block span in bases (plan_blocks; default 0: the context); "
        "a small span keeps a 1M block's prefix near 1M",
    )
    p.add_argument(
        "--logs",
        default="",
        help="a folder for the children's logs (kept: a progress line per block); default temporary",
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="run the streamed and the brute-force child at the same time (a busy machine: the same load)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=str(DEFAULT_JSON))
    p.add_argument(
        "--tokens-only",
        action="store_true",
        help="print the plan's token counts (streamed vs naive) at --context and --contexts; run no model",
    )
    p.add_argument("--child", choices=["streamed", "brute"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    doc: dict[str, Any] = {
        "environment": environment(),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "runs": [],
    }
    if args.tokens_only:  # the plan's token counts, no model run
        contexts = [args.context] + [int(x) for x in args.contexts.split(",") if x]
        doc["token_model"] = [token_model(args, c) for c in contexts]
        write_json(args.json, doc)
        print("| context | variants | blocks | prefix tokens | branch tokens | streamed | naive | naive / streamed |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for t in doc["token_model"]:
            print(
                f"| {t['context']:,} | {t['variants']:,} | {t['blocks']:,} | {t['prefix_tokens']:,} | "
                f"{t['branch_tokens']:,} | {t['streamed_tokens']:,} | {t['naive_tokens']:,} | {t['ratio']:.1f}x |"
            )
        return
    if args.brute:
        streamed, brute = measure_both(args, args.context)
        doc["runs"] += [streamed, brute]
        per_s = streamed["seconds"] / streamed["variants"]
        per_b = brute["seconds"] / brute["variants"]
        cpu_s = streamed["cpu_seconds"] / streamed["variants"]
        cpu_b = brute["cpu_seconds"] / brute["variants"]
        doc["comparison"] = {
            "context": args.context,
            "streamed_s_per_variant": per_s,
            "brute_s_per_variant": per_b,
            "ratio": per_b / per_s,
            "streamed_cpu_s_per_variant": cpu_s,
            "brute_cpu_s_per_variant": cpu_b,
            "cpu_ratio": cpu_b / cpu_s,
        }
    else:  # throughput only
        doc["runs"].append(measure(args, "streamed", args.context))
    write_json(args.json, doc)
    for c in [int(x) for x in args.contexts.split(",") if x]:
        doc["runs"].append(measure(args, "streamed", c))
        write_json(args.json, doc)
    print(
        "| context | run | variants | blocks | prefix tokens | wall s | CPU s | CPU s / variant | variants / CPU s "
        "| variants / wall s | peak RSS |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in doc["runs"]:
        print(
            f"| {r['context']:,} | {r['kind']} | {r['variants']} | {r.get('blocks', '')} | "
            f"{r.get('prefix_tokens', '')} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | "
            f"{r['cpu_seconds'] / r['variants']:.3f} | {r['variants'] / r['cpu_seconds']:.3f} | "
            f"{r['variants'] / r['seconds']:.3f} | {r['peak_rss_bytes'] / GiB:.2f} GiB |"
        )
    if "comparison" not in doc:
        return
    c = doc["comparison"]
    print(
        f"\nat context {c['context']:,}: brute force / streamed time per variant = {c['ratio']:.1f}x (wall), "
        f"{c['cpu_ratio']:.1f}x (CPU)"
    )


if __name__ == "__main__":
    main()
