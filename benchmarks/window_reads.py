"""How many random training windows per second a genome store delivers.

Reads seeded random windows (default 1,000,000 tokens, reverse complement with probability 0.5)
from the train split of an existing store, the way training does:

* ``TrainWindows.window`` in one process (numpy uint8 tokens: read, decompress, reverse complement),
* ``TrainWindowDataset`` items in one process (the same plus the torch.long ``[L]`` tensor),
* a ``DataLoader`` over ``TrainWindowDataset`` with ``--workers`` worker processes (default 2),
  batch size 1 (first batch, i.e. worker start-up, timed separately).

It builds nothing: pass a store made by ``genolong prepare`` (e.g.
``genolong prepare data/sample/*.fa* --out genome``). Target: >= 50 windows/s on 2 cores.

Usage::

    python benchmarks/window_reads.py STORE [--length 1000000] [--count 200] [--workers 2]
        [--split train] [--shrink-to-fit] [--json benchmarks/results/window_reads.json]

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import DataLoader

from genolong.data.datamodule import TrainWindowDataset, collate_windows, window_to_item
from genolong.data.store import GenomeStore
from genolong.data.windows import TrainWindows
from genolong.errors import GenolongError

sys.path.append(str(Path(__file__).resolve().parent))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "window_reads.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("store", type=Path, help="store directory made by `genolong prepare` (nothing is built here)")
    p.add_argument("--split", default="train", help="split to read (default: train)")
    p.add_argument("--length", type=int, default=1_000_000, help="window length in tokens (default: 1,000,000)")
    p.add_argument(
        "--shrink-to-fit",
        action="store_true",
        help="if no segment holds --length tokens, use the longest segment's length instead of failing",
    )
    p.add_argument("--count", type=int, default=200, help="windows per measurement (default: 200)")
    p.add_argument("--warmup", type=int, default=5, help="windows read before timing (default: 5)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default: 2)")
    p.add_argument("--rc-prob", type=float, default=0.5, help="reverse-complement probability (default: 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write results (default: {DEFAULT_JSON})")
    return p.parse_args(argv)


def row(mode: str, count: int, seconds: float, length: int, **extra: Any) -> dict[str, Any]:
    return {
        "mode": mode,
        "windows": count,
        "seconds": round(seconds, 4),
        "windows_per_s": round(count / seconds, 2),
        "mtokens_per_s": round(count * length / seconds / 1e6, 2),
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # reading is the work here; torch threads only compete with workers
    try:
        store = GenomeStore.open(args.store, verify=False)
        split = store.split(args.split)
        longest = int(split.segment_lengths.max()) if len(split.segments) else 0
        length = args.length
        shrunk = False
        if args.shrink_to_fit and 0 < longest < length:
            length, shrunk = longest, True
        windows = TrainWindows(split, length, seed=args.seed, rc_prob=args.rc_prob)
    except GenolongError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(windows.describe())
    if shrunk:
        print(f"note: no segment holds {args.length:,} tokens; measuring the longest that fits, {length:,}")

    results = []
    total = args.warmup + args.count
    for i in range(args.warmup):
        windows.window(i)
    t0 = time.perf_counter()
    for i in range(args.warmup, total):
        windows.window(i)
    results.append(row("TrainWindows.window, 1 process (uint8)", args.count, time.perf_counter() - t0, length))

    t0 = time.perf_counter()
    for i in range(total, total + args.count):
        window_to_item(windows.window(i))
    results.append(row("dataset items, 1 process (torch.long)", args.count, time.perf_counter() - t0, length))

    if args.workers > 0:
        windows.position = 2 * total  # fresh windows, not the ones just read (page cache aside)
        loader = DataLoader(
            TrainWindowDataset(windows, 1), batch_size=1, num_workers=args.workers, collate_fn=collate_windows
        )  # as GenomeDataModule.train_dataloader
        iterator = iter(loader)
        t0 = time.perf_counter()
        first = next(iterator)
        startup = time.perf_counter() - t0
        assert first["tokens"].shape == (1, length)
        for _ in range(args.warmup):
            next(iterator)
        t0 = time.perf_counter()
        for _ in range(args.count):
            next(iterator)
        seconds = time.perf_counter() - t0
        del iterator
        results.append(
            row(
                f"DataLoader, {args.workers} workers (torch.long)",
                args.count,
                seconds,
                length,
                first_batch_s=round(startup, 3),
            )
        )

    width = max(len(r["mode"]) for r in results)
    print(
        f"\nstore {args.store} split {args.split!r}, window length {length:,} tokens"
        f"{' (shrunk to the longest segment)' if shrunk else ''}, {os.cpu_count()} CPUs"
    )
    print(f"{'mode':<{width}}  {'windows':>7}  {'seconds':>8}  {'windows/s':>9}  {'Mtokens/s':>9}")
    for r in results:
        print(
            f"{r['mode']:<{width}}  {r['windows']:>7}  {r['seconds']:>8.2f}  {r['windows_per_s']:>9.1f}  {r['mtokens_per_s']:>9.1f}"
        )
    if "first_batch_s" in results[-1]:
        print(f"(DataLoader first batch, incl. worker start-up: {results[-1]['first_batch_s']:.2f} s)")

    report = {
        "benchmark": "window_reads",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        **environment("time"),
        "store": str(args.store),
        "split": args.split,
        "requested_length": args.length,
        "length": length,
        "shrunk_to_longest_segment": shrunk,
        "longest_segment": longest,
        "split_tokens": split.n_tokens,
        "segments": len(split.segments),
        "rc_prob": args.rc_prob,
        "seed": args.seed,
        "target_windows_per_s": 50,
        "results": results,
        "machine": {
            **environment("cpus", "platform", "python"),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "zarr": zarr.__version__,
        },
    }
    write_json(args.json, report, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
