#!/usr/bin/env python
"""Peak memory of ``genolong prepare`` on one 250 Mbp chromosome (target: < 1.5 GB).

The input is a synthetic hg38-like FASTA (benchmarks/make_synthetic_genome.py) generated into
``--scratch`` if missing: ``chr1`` of ``--chrom-mbp`` (250) Mbp to train on, plus a small held-out
``chr22`` of ``--eval-mbp`` (1) Mbp, because ``genolong prepare`` requires a non-empty eval split
distinct from train. Plain gzip by default; ``--formats gzip,bgzip`` also measures the indexed
reader (bgzip + .fai + .gzi).

``genolong prepare`` runs in a subprocess under GNU ``time -v`` (the peak RSS of the largest
process, children included once waited for), while this process polls the whole process tree
every ``--interval`` seconds through /proc and records the peak of the summed RSS and PSS (worker
processes or threads included; polling can miss a spike shorter than the interval). A baseline
``genolong prepare --help`` shows what the imports alone cost.

Example::

    python benchmarks/prepare_memory.py
    python benchmarks/prepare_memory.py --formats gzip,bgzip --chrom-mbp 250

Prints a table and writes JSON (default benchmarks/results/prepare_memory.json).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _bench import environment, write_json  # noqa: E402
from make_synthetic_genome import generate  # noqa: E402
from prepare_throughput import dir_bytes, genolong_cmd, machine, time_bin  # noqa: E402

DEFAULT_SCRATCH = Path("/tmp/genolong-bench")
DEFAULT_JSON = HERE / "results" / "prepare_memory.json"
TARGET_BYTES = 1.5e9


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(root: int) -> list[int]:
    """``root`` and all its descendants (by /proc/*/stat parent links)."""
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _field_kib(path: str, key: bytes) -> int:
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def measure(cmd: list[str], interval: float) -> dict:
    """Run ``cmd`` under GNU time -v while polling its process tree; return the measurements."""
    tb = time_bin()
    fd, tv = tempfile.mkstemp(prefix="genolong-bench-timev-")
    os.close(fd)
    full = ([tb, "-v", "-o", tv] if tb else []) + cmd
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, stdout=out, stderr=err)
    peak_rss = peak_pss = samples = 0
    peak_procs = 1
    while proc.poll() is None:
        pids = tree(proc.pid)
        if tb:  # leave GNU time itself out
            pids = [p for p in pids if p != proc.pid]
        rss = sum(_field_kib(f"/proc/{p}/status", b"VmRSS:") for p in pids)
        pss = sum(_field_kib(f"/proc/{p}/smaps_rollup", b"Pss:") for p in pids)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        peak_procs = max(peak_procs, len(pids))
        samples += 1
        time.sleep(interval)
    wall = time.perf_counter() - t0
    out.seek(0)
    err.seek(0)
    res = {
        "cmd": cmd,
        "rc": proc.returncode,
        "wall_seconds": wall,
        "poll_samples": samples,
        "poll_peak_tree_rss_kib": peak_rss,
        "poll_peak_tree_pss_kib": peak_pss,
        "poll_peak_processes": peak_procs,
        "stdout_tail": out.read().decode(errors="replace")[-3000:],
        "stderr_tail": err.read().decode(errors="replace")[-3000:],
    }
    if tb:
        text = Path(tv).read_text()
        grab = lambda pat: m.group(1) if (m := re.search(pat, text)) else None  # noqa: E731
        rss = grab(r"Maximum resident set size \(kbytes\): (\d+)")
        res["time_v_max_rss_kib"] = int(rss) if rss else None
        res["user_seconds"] = float(grab(r"User time \(seconds\): ([\d.]+)") or "nan")
        res["system_seconds"] = float(grab(r"System time \(seconds\): ([\d.]+)") or "nan")
        res["cpu_percent"] = grab(r"Percent of CPU this job got: (\S+)")
        res["major_page_faults"] = int(grab(r"Major \(requiring I/O\) page faults: (\d+)") or 0)
    os.unlink(tv)
    return res


def peak_kib(r: dict) -> int:
    return max(r.get("time_v_max_rss_kib") or 0, r["poll_peak_tree_rss_kib"])


def synthetic(scratch: Path, chrom_mbp: float, eval_mbp: float, seed: int, fmt: str) -> Path:
    ext = {"gzip": ".fa.gz", "bgzip": ".bgz.fa.gz", "plain": ".fa"}[fmt]
    path = scratch / f"chr1_{chrom_mbp:g}mbp_chr22_{eval_mbp:g}mbp_seed{seed}{ext}"
    summary = Path(str(path) + ".json")
    if path.exists() and summary.exists():
        return path
    print(f"generating {path} ...", flush=True)
    info = generate(path, seed=seed, fmt=fmt, records=[("chr1", chrom_mbp), ("chr22", eval_mbp)])
    write_json(summary, info, indent=2)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--chrom-mbp", type=float, default=250.0, help="size of the train chromosome chr1 (default 250)")
    p.add_argument("--eval-mbp", type=float, default=1.0, help="size of the held-out chr22 (default 1)")
    p.add_argument("--formats", default="gzip", help="comma-separated: gzip, bgzip, plain (default gzip)")
    p.add_argument("--input", type=Path, default=None, help="measure this FASTA instead (with --train/--eval)")
    p.add_argument("--train", default="chr1")
    p.add_argument("--eval", default="chr22")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--interval", type=float, default=0.05, help="process-tree polling interval, seconds")
    p.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    p.add_argument(
        "--prepare-arg", action="append", default=[], help="extra argument for genolong prepare (repeatable)"
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    a.scratch.mkdir(parents=True, exist_ok=True)

    if a.input is not None:
        inputs = [("input", a.input)]
    else:
        fmts = [f for f in a.formats.split(",") if f]
        bad = [f for f in fmts if f not in ("gzip", "bgzip", "plain")]
        if bad:
            p.error(f"--formats: unknown {', '.join(bad)}; use gzip, bgzip or plain")
        inputs = [(f, synthetic(a.scratch, a.chrom_mbp, a.eval_mbp, a.seed, f)) for f in fmts]

    info = machine()
    print(f"machine: {info['nproc']} cores ({info['cpu']}), python {info['python']}, load {info['loadavg_at_start']}")
    base = measure(genolong_cmd() + ["prepare", "--help"], a.interval)
    print(f"baseline (genolong prepare --help): peak RSS {peak_kib(base) / 1024:.0f} MiB", flush=True)

    results = []
    for label, path in inputs:
        store = a.scratch / f"store-memory-{label}"
        cmd = (
            genolong_cmd()
            + ["prepare", str(path), "--out", str(store), "--force", "--train", a.train, "--eval", a.eval]
            + a.prepare_arg
        )
        for i in range(a.repeats):
            print(f"\n== {label}: {' '.join(cmd)}", flush=True)
            r = measure(cmd, a.interval)
            r.update(label=label, path=str(path), file_bytes=path.stat().st_size, repeat=i + 1)
            r["store_bytes"] = dir_bytes(store) if store.exists() and r["rc"] == 0 else None
            r["peak_rss_mib"] = peak_kib(r) / 1024
            r["pass"] = r["rc"] == 0 and peak_kib(r) * 1024 < TARGET_BYTES
            results.append(r)
            print(r["stdout_tail"].rstrip()[-1500:])
            if r["rc"] != 0:
                print("   FAILED: " + r["stderr_tail"].strip()[-1500:])
            shutil.rmtree(store, ignore_errors=True)

    head = (
        f"{'input':<8} {'file MB':>8} {'wall s':>7} {'CPU %':>6} {'time -v RSS MiB':>15} {'tree RSS MiB':>12} "
        f"{'tree PSS MiB':>12} {'procs':>5} {'< 1.5 GB':>8}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    mib = lambda k: "-" if not k else f"{k / 1024:.0f}"  # noqa: E731
    print(
        f"{'baseline':<8} {'':>8} {base['wall_seconds']:>7.2f} {base.get('cpu_percent') or '-':>6} "
        f"{mib(base.get('time_v_max_rss_kib')):>15} {mib(base['poll_peak_tree_rss_kib']):>12} "
        f"{mib(base['poll_peak_tree_pss_kib']):>12} {base['poll_peak_processes']:>5} {'':>8}"
    )
    for r in results:
        print(
            f"{r['label']:<8} {r['file_bytes'] / 1e6:>8.1f} {r['wall_seconds']:>7.2f} {r.get('cpu_percent') or '-':>6} "
            f"{mib(r.get('time_v_max_rss_kib')):>15} {mib(r['poll_peak_tree_rss_kib']):>12} "
            f"{mib(r['poll_peak_tree_pss_kib']):>12} {r['poll_peak_processes']:>5} "
            f"{('yes' if r['pass'] else 'NO' if r['rc'] == 0 else 'FAILED'):>8}"
        )
    print(
        f"baseline = genolong prepare --help (imports only). Target: peak RSS < 1.5 GB ({TARGET_BYTES / 2**20:,.0f} MiB); "
        f"tree RSS/PSS polled every {a.interval:g} s."
    )

    info.update(environment("loadavg_at_end"))
    doc = {
        "benchmark": "prepare_memory",
        **environment("date"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": info,
        "chrom_mbp": a.chrom_mbp,
        "eval_mbp": a.eval_mbp,
        "target_bytes": TARGET_BYTES,
        "baseline": base,
        "results": results,
    }
    write_json(a.json, doc, indent=2)
    print(f"wrote {a.json}")
    return 0 if results and all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
