#!/usr/bin/env python
"""The cost of the checksum manifest written with every checkpoint: time to hash vs time to write.

Two checkpoints are written the way genolong writes a one-process checkpoint (``torch.save`` to a
temporary name, fsync, rename; :class:`genolong.train.finetune.AtomicModelParallelStrategy`):

- ``tiny``: the tiny preset's weights plus two AdamW moments (a real ``step*.ckpt`` is this plus
  small loop state);
- ``large``: one float32 tensor of ``--large-gb`` GiB (default 1).

For each, the write (torch.save + fsync) is timed, then the file is hashed with CRC-32 (zlib, what
genolong writes) and with sha256 (hashlib), and :func:`genolong.integrity.write_manifest` and
:func:`genolong.integrity.check_weights` are timed end to end. Hashes read the file just written,
from the page cache (as the manifest writer does); ``--cold`` drops the page cache first (root
only), as a resume days later would read it. Each figure is the median of ``--repeats`` (3) runs;
the load averages go into the JSON (on a shared machine read them before comparing).

Example::

    python benchmarks/checkpoint_checksum.py                 # tiny + 1 GiB
    python benchmarks/checkpoint_checksum.py --large-gb 0.25 --repeats 1 --json /tmp/c.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from genolong.files import fsync
from genolong.integrity import check_weights, file_checksum, write_manifest
from genolong.model import PRESETS, GenoLM


def _timed(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (``before()`` untimed before each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _state(kind: str, large_gb: float) -> dict[str, object]:
    if kind == "tiny":
        torch.manual_seed(0)
        weights = GenoLM(PRESETS["tiny"]).state_dict()
        return {
            "state_dict": weights,
            "optimizer_states": [{k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in weights.items()}],
        }
    return {"state_dict": {"w": torch.ones(int(large_gb * 2**30) // 4)}}


def measure(kind: str, folder: Path, large_gb: float, repeats: int, cold: bool) -> dict[str, object]:
    """One checkpoint's write, hash and verify times."""
    held = {"state": _state(kind, large_gb)}  # dropped after the writes, before the hashing is timed
    path = folder / f"{kind}.ckpt"

    def write() -> None:
        tmp = path.with_name(path.name + ".tmp")
        torch.save(held["state"], tmp)
        fsync(tmp)
        os.replace(tmp, path)

    write_s = _timed(write, repeats)
    held.clear()
    before = _drop_caches if cold else None
    row: dict[str, object] = {"checkpoint": kind, "bytes": path.stat().st_size, "write_s": write_s}
    for algorithm in ("crc32", "sha256"):
        row[f"{algorithm}_s"] = _timed(lambda a=algorithm: file_checksum(path, a), repeats, before)  # type: ignore[misc]
    row["write_manifest_s"] = _timed(lambda: write_manifest(path), repeats, before)
    from genolong import integrity

    def verify() -> None:
        integrity._VERIFIED.clear()  # the check a fresh process does (it remembers passed checks)
        check_weights(path)

    row["check_weights_s"] = _timed(verify, repeats, before)
    for algorithm in ("crc32", "sha256"):
        row[f"{algorithm}_vs_write"] = row[f"{algorithm}_s"] / write_s  # type: ignore[operator]
        row[f"{algorithm}_gb_per_s"] = row["bytes"] / row[f"{algorithm}_s"] / 1e9  # type: ignore[operator]
    path.unlink()
    return row


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large-gb", type=float, default=1.0, help="size of the large checkpoint in GiB (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each hash (root only)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "checkpoint_checksum.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        rows = [measure(kind, Path(folder), args.large_gb, args.repeats, args.cold) for kind in ("tiny", "large")]
    print(
        f"{'checkpoint':>10} {'bytes':>15} {'write s':>8} {'crc32 s':>8} {'sha256 s':>8} {'crc32/write':>11} "
        f"{'sha256/write':>12} {'crc32 GB/s':>10} {'sha256 GB/s':>11} {'manifest s':>10} {'check s':>8}"
    )
    for r in rows:
        print(
            f"{r['checkpoint']:>10} {r['bytes']:>15,} {r['write_s']:>8.3f} {r['crc32_s']:>8.3f} {r['sha256_s']:>8.3f} "
            f"{r['crc32_vs_write']:>10.2f}x {r['sha256_vs_write']:>11.2f}x {r['crc32_gb_per_s']:>10.2f} "
            f"{r['sha256_gb_per_s']:>11.2f} {r['write_manifest_s']:>10.3f} {r['check_weights_s']:>8.3f}"
        )
    result = {
        "benchmark": "checkpoint_checksum",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "repeats": args.repeats,
        "cold_cache": args.cold,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
