#!/usr/bin/env python
"""Peak memory and time of one DSA forward+backward (indexer top-k + sparse attention) vs T, on CPU.

Each length runs in a fresh subprocess (``--worker``) that builds random inputs, records its peak
RSS so far (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: the high-water mark, inputs included),
then runs ``indexer_topk`` (no grad), ``sparse_attention`` forward, a backward into q, k, v, and
records the peak again. The difference is what the DSA call itself added; it should grow linearly
in T (the ``[B, T, topk]`` indices, the gradients and the blockwise working set), never as T*T.
A dense ``[T, T]`` float32 score matrix would need ``4 * T * T`` bytes (16 GiB at 64k). The
``slope`` column (bytes per added token between consecutive lengths) is constant when growth is
linear; ``bytes/T`` also carries the fixed working set and so falls with T.

Timings on a shared 2-core machine are noisy (OpenMP threads of two busy processes thrash): read
the load averages recorded in the JSON, or pass ``--threads 1``.

Example::

    python benchmarks/dsa_memory.py                       # T = 4k, 8k, 16k, 32k, 64k; topk 256
    python benchmarks/dsa_memory.py --lengths 4096,65536 --topk 2048

Prints a table and writes JSON (default benchmarks/results/dsa_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, marginal_slope, peak_rss_bytes, sweep_arguments, sweep_fresh, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "dsa_memory.json"


def worker(a: argparse.Namespace) -> dict:
    """One DSA forward+backward at length a.T; returns timings and peak-RSS figures (bytes)."""
    import torch

    from genolong.kernels.dsa import indexer_topk, sparse_attention

    peak = peak_rss_bytes
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, T = 1, a.T
    q_idx = torch.randn(B, T, a.hi, a.di)
    k_idx = torch.randn(B, T, a.di)
    w_idx = torch.rand(B, T, a.hi)
    q = torch.randn(B, T, a.h, a.d, requires_grad=True)
    k = torch.randn(B, T, a.hk, a.d, requires_grad=True)
    v = torch.randn(B, T, a.hk, a.dv, requires_grad=True)
    do = torch.randn(B, T, a.h, a.dv)
    base = peak()
    t0 = time.perf_counter()
    idx = indexer_topk(q_idx, k_idx, w_idx, a.topk, block_size=a.block_size, query_block=a.query_block)
    t1 = time.perf_counter()
    o = sparse_attention(q, k, v, idx, query_block=a.attn_block)
    t2 = time.perf_counter()
    o.backward(do)
    t3 = time.perf_counter()
    assert idx.shape == (B, T, a.topk) and q.grad is not None and torch.isfinite(q.grad).all()
    end = peak()
    return {
        "T": T,
        "base_peak_bytes": base,
        "peak_bytes": end,
        "dsa_peak_bytes": end - base,
        "indexer_s": t1 - t0,
        "attn_fwd_s": t2 - t1,
        "attn_bwd_s": t3 - t2,
        "total_s": t3 - t0,
        "dense_scores_bytes": 4 * T * T,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sweep_arguments(p, "4096,8192,16384,32768,65536", DEFAULT_JSON)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--hi", type=int, default=4, help="indexer heads (default 4)")
    p.add_argument("--di", type=int, default=32, help="indexer head dim (default 32)")
    p.add_argument("--h", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--hk", type=int, default=1, help="KV heads (default 1, MQA as absorbed MLA)")
    p.add_argument("--d", type=int, default=64, help="q/k head dim (default 64)")
    p.add_argument("--dv", type=int, default=32, help="v head dim (default 32)")
    p.add_argument("--block-size", type=int, default=2048, help="indexer key block")
    p.add_argument("--query-block", type=int, default=256, help="indexer query block")
    p.add_argument("--attn-block", type=int, default=64, help="sparse attention query block")
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0

    lengths = [int(x) for x in a.lengths.split(",") if x]
    common = [
        f"--topk={a.topk}",
        f"--hi={a.hi}",
        f"--di={a.di}",
        f"--h={a.h}",
        f"--hk={a.hk}",
        f"--d={a.d}",
        f"--dv={a.dv}",
        f"--block-size={a.block_size}",
        f"--query-block={a.query_block}",
        f"--attn-block={a.attn_block}",
        f"--threads={a.threads}",
    ]
    print(
        f"DSA fwd+bwd on CPU, {a.threads} threads, topk {a.topk}, indexer {a.hi}x{a.di}, "
        f"attention H={a.h} HK={a.hk} D={a.d} DV={a.dv}; load {os.getloadavg()}"
    )
    print(
        f"{'T':>7} {'DSA peak MiB':>12} {'bytes/T':>9} {'slope B/tok':>11} {'dense TxT MiB':>13} "
        f"{'indexer s':>9} {'fwd s':>7} {'bwd s':>7}"
    )
    runs, _ = sweep_fresh(__file__, lengths, common)
    rows: list[dict] = []
    for T in lengths:
        row = runs[T][0]
        row["bytes_per_T"] = row["dsa_peak_bytes"] / T
        row["slope_bytes_per_token"] = marginal_slope(rows, row, "dsa_peak_bytes")
        rows.append(row)
        slope = "-" if row["slope_bytes_per_token"] is None else f"{row['slope_bytes_per_token']:.0f}"
        print(
            f"{T:>7} {row['dsa_peak_bytes'] / 2**20:>12.1f} {row['bytes_per_T']:>9.0f} {slope:>11} "
            f"{row['dense_scores_bytes'] / 2**20:>13.0f} {row['indexer_s']:>9.2f} {row['attn_fwd_s']:>7.2f} "
            f"{row['attn_bwd_s']:>7.2f}",
            flush=True,
        )
    out = {
        "benchmark": "dsa_memory",
        **environment("date"),
        "machine": environment("nproc", "platform", "python", "loadavg_at_end"),
        "config": {k: v for k, v in vars(a).items() if k not in ("worker", "T", "json")},
        "rows": rows,
    }
    write_json(a.json, out, indent=2)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
