#!/usr/bin/env python
"""Log-prob gap between the training path and the step-by-step decode path, fp32 and bf16.

The correctness claim behind ``genolong check-logprobs``: per-token ``log p`` of the next base by
the training path (``GenoLM.token_nll``: chunked KDA, blockwise DSA top-k) and by the decode path
(``genolong.model.decode``: recurrent KDA state, DSA latent and KPool caches, one token per step)
on the same tokens. The reference work reports 0.04-0.07 against vLLM from 128k to 1M tokens; the
issue's bound is a mean of at most 1e-5 nats in fp32 on ``tiny``.

Models: ``tiny`` (random init, seed 0) and the bundled small base checkpoint
(``genolong.quickstart.bundled_base()``), each loaded in float32 and in bfloat16 (both paths run in
the parameters' dtype). Data: the first ``--max-tiles`` (1) tile of ``--context`` (2048) tokens of
the held-out chr22 of the bundled human sample, prepared into the scratch directory. Buckets of
preceding context start at ``--first-bucket`` (256). The decode path costs one step per token
(~25-40 ms for these models on one thread), so a run of 4 x 2048 tokens takes about 4-6 minutes.

Each run's result directory (table, per-token parquet, PNG/PDF figure) is written to
``<scratch>/logprob_gap/<model>-<dtype>/``.

Example::

    python benchmarks/logprob_gap.py --threads 1      # writes benchmarks/results/logprob_gap.json
    python benchmarks/logprob_gap.py --models tiny --dtypes float32 --context 1024 --json /tmp/gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from genolong.data.store import GenomeStore
from genolong.evaluation.logprobs import check_logprobs
from genolong.model import GenoLM, ModelConfig
from genolong.quickstart import bundled_base, prepare_sample

sys.path.append(str(Path(__file__).resolve().parent))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(name: str, dtype: torch.dtype) -> GenoLM:
    """``tiny`` at random init (seed 0) or the bundled base checkpoint, in ``dtype``, eval mode."""
    if name == "tiny":
        torch.manual_seed(0)
        return GenoLM(ModelConfig.from_preset("tiny")).to(dtype).eval()
    if name == "bundled":
        return GenoLM.from_pretrained(bundled_base(), dtype=dtype).eval()
    raise SystemExit(f"unknown model {name!r}: use tiny or bundled")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,bundled", help="comma-separated: tiny, bundled")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    ap.add_argument("--context", type=int, default=2048, help="tile length L (tokens)")
    ap.add_argument("--max-tiles", type=int, default=1)
    ap.add_argument("--first-bucket", type=int, default=256, help="upper edge of the first offset bucket")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--scratch", default="/tmp/genolong-bench", help="prepared sample store and result dirs")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "logprob_gap.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    scratch = Path(args.scratch)
    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}: use float32 or bfloat16")

    started = time.perf_counter()
    store_dir = scratch / "logprob_gap_sample"
    prepared = prepare_sample(store_dir, progress=False)
    split = GenomeStore.open(prepared.path).split("eval")
    print(
        f"eval split: {', '.join(sorted(set(split.segments['contig'])))}; {len(split.segments)} segments; "
        f"tiles of {args.context} tokens, first {args.max_tiles}; {torch.get_num_threads()} threads",
        flush=True,
    )

    runs = []
    header = f"{'model':>8} {'dtype':>9} {'bucket':>10} {'tokens':>7} {'mean |diff|':>12} {'max |diff|':>11}"
    print(header)
    for name in models:
        for dname in dtypes:
            model = load_model(name, DTYPES[dname])
            t0 = time.perf_counter()
            gap = check_logprobs(
                model,
                split,
                args.context,
                max_tiles=args.max_tiles,
                first_bucket=args.first_bucket,
                label=f"{name} {dname}",
            )
            seconds = time.perf_counter() - t0
            out_dir = scratch / "logprob_gap" / f"{name}-{dname}"
            paths = gap.save(out_dir)
            table = gap.table()
            for _, row in table.iterrows():
                print(
                    f"{name:>8} {dname:>9} {row['bucket']:>10} {int(row['tokens']):>7} "
                    f"{row['mean_abs_diff']:12.3e} {row['max_abs_diff']:11.3e}",
                    flush=True,
                )
            runs.append(
                {
                    "model": name,
                    "checkpoint": "random init, seed 0" if name == "tiny" else str(bundled_base()),
                    "dtype": dname,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "context": args.context,
                    "tiles": gap.tiles,
                    "tokens": gap.tokens,
                    "seconds": seconds,
                    "decode_seconds": gap.extra["decode_seconds"],
                    "train_seconds": gap.extra["train_seconds"],
                    "decode_ms_per_step": 1000 * gap.extra["decode_seconds"] / max(1, gap.tiles * (args.context - 1)),
                    "bucket_edges": [int(e) for e in gap.edges],
                    "table": json.loads(table.to_json(orient="records")),
                    "figure": str(paths["png"]),
                }
            )
            del model

    out = {
        "benchmark": "logprob_gap",
        "command": "logprob_gap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **environment("time"),
        "data": {"store": str(prepared.path), "split": "eval", "contigs": sorted(set(split.segments["contig"]))},
        "targets": {"float32_tiny_mean_abs_diff": "<= 1e-5 nats", "reference_vs_vllm": "0.04-0.07 (128k-1M)"},
        "results": runs,
        "total_seconds": time.perf_counter() - started,
        "machine": environment("cpus", "threads", "loadavg", "platform", "python", "torch"),
    }
    path = write_json(args.json, out)
    print(f"wrote {path} ({out['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
