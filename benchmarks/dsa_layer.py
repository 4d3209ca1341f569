#!/usr/bin/env python
"""Time and peak memory of one DSA layer (``DSAMixer``) forward+backward against T, on CPU.

The layer is the first DSA layer of a preset (default ``small``: NoPE MLA with 4 heads, a KPool
lightning indexer of 4 heads x 32 over 16-token pools, top-k 512 tokens plus the query's
incomplete pool), seeded weights, float32, batch 1. One run: ``out, _ = mixer(x)`` for a random
``x [1, T, hidden]``, then ``(out * dout).sum().backward()`` into ``x`` and every parameter.

Every run is a fresh child process: it builds the layer, runs a warm-up at 1,024 tokens, records
``ru_maxrss`` (the high-water mark so far), runs the timed forward+backward at T and records
``ru_maxrss`` again; "peak delta" is what the run at T added (inputs, activations, gradients,
the ``[T, topk]`` indices, working sets). The lengths alternate within each of ``--repeats``
rounds; medians of wall time, of process CPU time (one thread: the work done, less disturbed by
other jobs on a shared machine) and of the peak are reported. Linear growth shows as a constant
"per token" column; a ``[T, T]`` fp32 score matrix (``4 T^2`` bytes) is shown for scale.

The lightning indexer itself scores every query against every earlier pool, ``T * T / P`` work
(memory stays linear: keys are scored in blocks with a running top-k); at these lengths the
sparse attention over the selected ``topk`` keys per query, linear in T, dominates.

Target (issue 3): memory linear in T (and time: the whole-model target is <= 9x for 8x tokens).

Example::

    python benchmarks/dsa_layer.py --threads 1                 # T = 4k, 8k, 16k, 32k, 64k
    python benchmarks/dsa_layer.py --lengths 2048,4096 --repeats 1 --json /tmp/dsa_layer.json

Prints a table and writes JSON (default benchmarks/results/dsa_layer.json).
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
from _bench import environment, marginal_slope, median_row, peak_rss_bytes, sweep_arguments, sweep_fresh, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "dsa_layer.json"
WARMUP_T = 1024


def worker(a: argparse.Namespace) -> dict:
    """One timed DSAMixer forward+backward at length ``a.T`` in this (fresh) process."""
    import torch

    from genolong.model import PRESETS, DSAMixer
    from genolong.model.config import INDEXED_ATTENTION

    peak = peak_rss_bytes
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = PRESETS[a.preset]
    assert config.layer_types is not None and config.indexer_types is not None
    layer_idx = next(
        i
        for i, (lt, it) in enumerate(zip(config.layer_types, config.indexer_types))
        if lt == INDEXED_ATTENTION and it == "full"
    )
    mixer = DSAMixer(config, layer_idx)
    gen = torch.Generator().manual_seed(1)

    def run(T: int) -> tuple[float, float, int]:
        x = torch.randn(1, T, config.hidden_size, generator=gen, requires_grad=True)
        dout = torch.randn(1, T, config.hidden_size, generator=gen)
        mixer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out, _ = mixer(x)
        t1 = time.perf_counter()
        (out * dout).sum().backward()
        t2 = time.perf_counter()
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())
        return t1 - t0, t2 - t1, x.numel() * 4 * 3  # x, dout, x.grad

    run(WARMUP_T)
    base = peak()
    c0 = time.process_time()
    fwd, bwd, io_bytes = run(a.T)
    cpu = time.process_time() - c0
    end = peak()
    return {
        "T": a.T,
        "layer_idx": layer_idx,
        "fwd_s": fwd,
        "bwd_s": bwd,
        "total_s": fwd + bwd,
        "cpu_s": cpu,
        "base_peak_bytes": base,
        "peak_bytes": end,
        "peak_delta_bytes": end - base,
        "io_bytes": io_bytes,
        "dense_scores_bytes": 4 * a.T * a.T,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sweep_arguments(p, "4096,8192,16384,32768,65536", DEFAULT_JSON)
    p.add_argument("--repeats", type=int, default=3, help="rounds over all lengths (fresh process each)")
    p.add_argument("--preset", default="small")
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0

    from genolong.model import PRESETS

    c = PRESETS[a.preset]
    lengths = [int(x) for x in a.lengths.split(",") if x]
    print(
        f"DSAMixer ({a.preset}: {c.num_attention_heads} heads, qk {c.qk_head_dim}, v {c.v_head_dim}, indexer "
        f"{c.index_n_heads}x{c.index_head_dim}, pools of {c.index_kpool}, topk {c.index_topk}) fwd+bwd on CPU, "
        f"fp32, {a.threads} threads, {a.repeats} rounds; load {os.getloadavg()}",
        flush=True,
    )

    def done(i: int, T: int, run: dict, runs: dict[int, list[dict]]) -> None:
        print(
            f"  round {i + 1}: T={T:>6} fwd+bwd {run['total_s']:7.2f} s (cpu {run['cpu_s']:.2f}), "
            f"peak delta {run['peak_delta_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )

    runs, _ = sweep_fresh(__file__, lengths, [f"--threads={a.threads}", f"--preset={a.preset}"], a.repeats, done=done)

    rows: list[dict] = []
    print(
        f"{'T':>7} {'fwd s':>7} {'bwd s':>7} {'total s':>8} {'cpu s':>7} {'cpu us/tok':>10} {'dpeak MiB':>9} "
        f"{'dpeak KB/tok':>12} {'slope KB/tok':>12} {'TxT fp32 MiB':>12}"
    )
    for T in lengths:
        row = median_row(T, runs[T], ("fwd_s", "bwd_s", "total_s", "cpu_s", "peak_bytes", "peak_delta_bytes"))
        row["dense_scores_bytes"] = 4 * T * T
        row["cpu_us_per_token"] = 1e6 * row["cpu_s"] / T
        row["peak_delta_bytes_per_token"] = row["peak_delta_bytes"] / T
        row["slope_bytes_per_token"] = marginal_slope(rows, row, "peak_delta_bytes")
        row["time_growth_vs_first"] = row["total_s"] / (rows[0]["total_s"] if rows else row["total_s"])
        row["cpu_growth_vs_first"] = row["cpu_s"] / (rows[0]["cpu_s"] if rows else row["cpu_s"])
        rows.append(row)
        slope = "-" if row["slope_bytes_per_token"] is None else f"{row['slope_bytes_per_token'] / 1e3:.1f}"
        print(
            f"{T:>7} {row['fwd_s']:>7.2f} {row['bwd_s']:>7.2f} {row['total_s']:>8.2f} {row['cpu_s']:>7.2f} "
            f"{row['cpu_us_per_token']:>10.0f} {row['peak_delta_bytes'] / 2**20:>9.0f} "
            f"{row['peak_delta_bytes_per_token'] / 1e3:>12.1f} {slope:>12} {row['dense_scores_bytes'] / 2**20:>12.0f}"
        )
    first, last = rows[0], rows[-1]
    print(
        f"{last['T']}/{first['T']}: {last['T'] / first['T']:.0f}x tokens, time {last['total_s'] / first['total_s']:.2f}x "
        f"(cpu {last['cpu_s'] / first['cpu_s']:.2f}x), peak delta {last['peak_delta_bytes'] / first['peak_delta_bytes']:.2f}x"
    )
    out = {
        "benchmark": "dsa_layer",
        "command": "dsa_layer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **environment("date"),
        "target": "peak memory linear in T",
        "config": {
            "preset": a.preset,
            "hf_config": c.to_hf_dict(),
            "batch": 1,
            "dtype": "float32",
            "threads": a.threads,
            "repeats": a.repeats,
            "warmup_tokens": WARMUP_T,
        },
        "machine": environment("cpus", "platform", "python", "torch", "loadavg_at_end"),
        "rows": rows,
    }
    write_json(a.json, out)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
