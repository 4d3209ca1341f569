#!/usr/bin/env python
"""CPU forward+backward time of the KDA token mixers, side by side in one run.

Compared: our chunked form ``genolong.kernels.kda.chunk_kda`` (chunk 64), fla's pure-torch
``naive_chunk_kda`` (chunk 64; fla-core) and our token-by-token ``recurrent_kda``.
Shapes: B=1, H=4, K=V=64, float32, L2-normalised q and k, g in [-1, 0], beta in (0, 1); the
loss is ``(o * do).sum()`` for a fixed random ``do`` and backward reaches q, k, v, g, beta.

The recurrent form costs the same per token at every T, so by default it is timed on
``--recurrent-tokens`` (2048) tokens and extrapolated linearly to each T (marked "extrap." in the
table and ``"extrapolated": true`` in the JSON). fla's naive chunk form is slow; it is timed up to
``--fla-max-t`` (16384), once per length above 4096. Denormal floats are flushed to zero unless
``--keep-denormals``. Each other measurement is the median of ``--repeats`` (3) runs after one
warm-up at a short length; the machine may be shared, so the load averages go into the JSON. On a
shared machine use ``--threads 1``: OpenMP threads spin against other processes and inflate times.

Targets (issue): ours >= 1.0x fla's naive chunk speed; ours >= 20x the recurrent form at 16k.

Example::

    python benchmarks/kda_cpu.py                              # T = 4k, 8k, 16k, 32k, 64k
    python benchmarks/kda_cpu.py --lengths 4096,8192 --repeats 1 --json /tmp/kda.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from genolong.kernels.kda import chunk_kda, recurrent_kda

sys.path.append(str(Path(__file__).resolve().parent))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

B, H, K, V = 1, 4, 64, 64


def make_inputs(T: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)], do


def time_fwd_bwd(fn, T: int, repeats: int) -> dict[str, float]:
    xs, do = make_inputs(T)
    fwd, tot = [], []
    for _ in range(repeats):
        for x in xs:
            x.grad = None
        t0 = time.perf_counter()
        o, _ = fn(*xs)
        t1 = time.perf_counter()
        (o * do).sum().backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        tot.append(t2 - t0)
    return {"fwd_s": statistics.median(fwd), "fwd_bwd_s": statistics.median(tot)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536", help="comma-separated T values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fla-max-t", type=int, default=16384, help="largest T for fla's naive chunk form")
    ap.add_argument(
        "--recurrent-tokens",
        type=int,
        default=2048,
        help="tokens to time the recurrent form on (extrapolated linearly); 0 = time every T fully",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument(
        "--keep-denormals",
        action="store_true",
        help="do not flush denormal floats to zero (by default they are flushed: strongly decayed "
        "states and gradients otherwise fall into the denormal range, which makes some runs of "
        "every form 10-50x slower on x86 CPUs, the recurrent form most)",
    )
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "kda_cpu.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    flush = not args.keep_denormals and torch.set_flush_denormal(True)
    lengths = [int(x) for x in args.lengths.split(",") if x]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fla.ops.kda.naive import naive_chunk_kda
    except Exception as exc:  # fla is an optional oracle
        print(f"fla not importable ({exc}); skipping its column", file=sys.stderr)
        naive_chunk_kda = None

    # warm-up (lazy init, allocator) at a short length
    for fn in (chunk_kda, recurrent_kda, naive_chunk_kda):
        if fn is not None:
            time_fwd_bwd(fn, 256, 1)

    rec_base = None
    if args.recurrent_tokens:
        r = time_fwd_bwd(recurrent_kda, args.recurrent_tokens, max(1, min(args.repeats, 2)))
        rec_base = {kk: vv / args.recurrent_tokens for kk, vv in r.items()}

    rows = []
    for T in lengths:
        row: dict = {"T": T, "tokens": B * T}
        row["ours_chunk"] = time_fwd_bwd(chunk_kda, T, args.repeats)
        if naive_chunk_kda is not None and T <= args.fla_max_t:
            row["fla_naive_chunk"] = time_fwd_bwd(naive_chunk_kda, T, 1 if T > 4096 else args.repeats)
        if rec_base is not None:
            row["recurrent"] = {kk: vv * T for kk, vv in rec_base.items()}
            row["recurrent"]["extrapolated"] = True
            row["recurrent"]["timed_tokens"] = args.recurrent_tokens
        else:
            row["recurrent"] = time_fwd_bwd(recurrent_kda, T, 1) | {"extrapolated": False}
        ours = row["ours_chunk"]["fwd_bwd_s"]
        row["ours_tokens_per_s"] = B * T / ours
        if "fla_naive_chunk" in row:
            row["speedup_vs_fla_naive_chunk"] = row["fla_naive_chunk"]["fwd_bwd_s"] / ours
        row["speedup_vs_recurrent"] = row["recurrent"]["fwd_bwd_s"] / ours
        rows.append(row)
        fla_s = f"{row['fla_naive_chunk']['fwd_bwd_s']:9.2f}" if "fla_naive_chunk" in row else f"{'-':>9}"
        fla_r = f"{row['speedup_vs_fla_naive_chunk']:8.1f}x" if "fla_naive_chunk" in row else f"{'-':>9}"
        ext = " extrap." if row["recurrent"]["extrapolated"] else ""
        if len(rows) == 1:
            print(
                f"KDA fwd+bwd on CPU, B={B} H={H} K={K} V={V} float32, {torch.get_num_threads()} threads (seconds, median)"
            )
            print(
                f"{'T':>7} {'ours fwd':>9} {'ours f+b':>9} {'tok/s':>8} {'fla f+b':>9} {'vs fla':>9} {'rec f+b':>9} {'vs rec':>8}"
            )
        print(
            f"{T:>7} {row['ours_chunk']['fwd_s']:9.3f} {ours:9.3f} {row['ours_tokens_per_s']:8.0f} {fla_s} {fla_r} "
            f"{row['recurrent']['fwd_bwd_s']:9.2f} {row['speedup_vs_recurrent']:7.1f}x{ext}",
            flush=True,
        )

    out = {
        "benchmark": "kda_cpu",
        "command": "kda_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **environment("time"),
        "shapes": {"B": B, "H": H, "K": K, "V": V, "dtype": "float32", "chunk_size": 64},
        "targets": {"vs_fla_naive_chunk": ">= 1.0x", "vs_recurrent_at_16k": ">= 20x"},
        "recurrent_extrapolated_from_tokens": args.recurrent_tokens or None,
        "results": rows,
        "flush_denormal": bool(flush),
        "machine": environment("cpus", "threads", "loadavg", "platform", "python", "torch"),
    }
    path = write_json(args.json, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
