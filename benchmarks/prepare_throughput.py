#!/usr/bin/env python
"""Throughput of ``genolong prepare`` against the floor of merely reading the same chromosomes.

For each input the floor and ``genolong prepare`` run side by side, interleaved (floor, prepare,
floor, prepare, ...) because the machine is shared and noisy; the medians and their ratio
prepare/floor are reported (target: <= 1.5). Everything runs in subprocesses and is timed as wall
time in this process.

Floors:

- plain gzip (no index): ``gzip -dc FILE > /dev/null``. Also timed, for information only:
  python-isal decompressing the whole file in 16 MiB reads (a faster, stricter reference).
- indexed input (bgzip or plain text + ``.fai``): a fresh Python process that opens
  ``pysam.FastaFile(FILE)`` and fetches every requested chromosome into memory.

Default inputs: a synthetic hg38-like genome of ``--mbp`` (500) Mbp generated into ``--scratch``
if missing (benchmarks/make_synthetic_genome.py; hg38 layout: chr1, chr2 and a truncated chr3),
as plain gzip and as bgzip + .fai + .gzi (train = every chromosome but the held-out one; eval = chr22 if present, else the last), and
the bundled real human sample in data/sample/ when it exists. ``--input PATH`` (repeatable) with
``--train``/``--eval`` replaces the defaults.

Example::

    python benchmarks/prepare_throughput.py                   # defaults, 3 repeats
    python benchmarks/prepare_throughput.py --input hg38.fa.gz --train chr1,chr2 --eval chr22

Prints a table and writes JSON (default benchmarks/results/prepare_throughput.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from make_synthetic_genome import generate  # noqa: E402

DEFAULT_SCRATCH = Path("/tmp/genolong-bench")
DEFAULT_JSON = HERE / "results" / "prepare_throughput.json"
FASTA_SUFFIXES = (".fa", ".fasta", ".fna", ".fa.gz", ".fasta.gz", ".fna.gz", ".fa.bgz", ".fasta.bgz")

PYSAM_FLOOR = (
    "import sys, time, pysam\n"
    "t = time.perf_counter()\n"
    "f = pysam.FastaFile(sys.argv[1])\n"
    "n = sum(len(f.fetch(name)) for name in sys.argv[2:])\n"
    "print(n, time.perf_counter() - t)\n"
)
ISAL_FLOOR = (
    "import sys, time\n"
    "from isal import igzip\n"
    "t = time.perf_counter(); n = 0\n"
    "with igzip.open(sys.argv[1], 'rb') as fh:\n"
    "    while b := fh.read(1 << 24):\n"
    "        n += len(b)\n"
    "print(n, time.perf_counter() - t)\n"
)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass
class Input:
    """One FASTA to benchmark and the chromosomes to prepare from it."""

    label: str
    path: Path
    train: list[str]
    eval: list[str]
    kind: str = ""  # gzip | bgzip | plain
    indexed: bool = False
    file_bytes: int = 0
    record_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def requested(self) -> list[str]:
        """Record names (as in the file) of the requested chromosomes."""
        want = set(self.train + self.eval)
        return [r for r in self.record_lengths if r in want or chrom_of(r) in want]

    @property
    def requested_bases(self) -> int:
        return sum(self.record_lengths[n] for n in self.requested)


def chrom_of(record: str) -> str:
    """``chr3:42000000-44000000`` (a samtools region, as in data/sample) -> ``chr3``; else unchanged."""
    m = re.fullmatch(r"(.+):[\d,]+-[\d,]+", record)
    return m.group(1) if m else record


def default_split(records: list[str]) -> tuple[list[str], list[str]]:
    """Train = every chromosome but the held-out one; eval = chr22 if present, else the last."""
    chroms = list(dict.fromkeys(chrom_of(r) for r in records))
    if len(chroms) < 2:
        return chroms, []
    ev = [c for c in chroms if c in ("chr22", "22")] or chroms[-1:]
    return [c for c in chroms if c not in ev], ev


def file_kind(path: Path) -> str:
    """gzip, bgzip or plain, from the first bytes (BGZF has the 'BC' extra subfield)."""
    with open(path, "rb") as fh:
        head = fh.read(18)
    if head[:2] != b"\x1f\x8b":
        return "plain"
    if len(head) >= 16 and head[3] & 4 and head[12:14] == b"BC":
        return "bgzip"
    return "gzip"


def read_fai(path: Path) -> dict[str, int] | None:
    fai = Path(str(path) + ".fai")
    if not fai.exists():
        return None
    out = {}
    for line in fai.read_text().splitlines():
        if line.strip():
            name, length = line.split("\t")[:2]
            out[name] = int(length)
    return out


def scan_fasta(path: Path) -> dict[str, int]:
    """Record names and lengths of a (gzip or plain) FASTA, streamed in 16 MiB pieces."""
    from isal import igzip

    opener = igzip.open if file_kind(path) != "plain" else open
    records: dict[str, int] = {}
    name, length, carry = None, 0, b""
    with opener(path, "rb") as fh:
        while True:
            chunk = fh.read(1 << 24)
            buf = carry + chunk
            if not chunk:  # EOF: the rest is one last (possibly unterminated) line
                buf, carry = (buf + b"\n" if buf else b""), b""
            else:
                cut = buf.rfind(b"\n") + 1  # whole lines only; the tail waits for more
                buf, carry = buf[:cut], buf[cut:]
            pos = 0
            while pos < len(buf):
                if buf.startswith(b">", pos):
                    h = pos
                else:
                    h = buf.find(b"\n>", pos)
                    h = h + 1 if h >= 0 else -1
                end = len(buf) if h < 0 else h
                if name is not None:
                    seg = buf[pos:end]
                    length += len(seg) - seg.count(b"\n") - seg.count(b"\r")
                if h < 0:
                    break
                nl = buf.find(b"\n", h)
                if name is not None:
                    records[name] = length
                fields = buf[h + 1 : nl].split()
                name, length = (fields[0].decode() if fields else ""), 0
                pos = nl + 1
            if not chunk:
                break
    if name is not None:
        records[name] = length
    return records


def describe(inp: Input) -> Input:
    """Fill kind, index presence, size and record lengths."""
    inp.kind = file_kind(inp.path)
    fai = read_fai(inp.path)
    gzi_ok = inp.kind != "bgzip" or Path(str(inp.path) + ".gzi").exists()
    inp.indexed = fai is not None and inp.kind in ("bgzip", "plain") and gzi_ok
    inp.file_bytes = inp.path.stat().st_size
    inp.record_lengths = fai if fai is not None else scan_fasta(inp.path)
    found = {chrom_of(r) for r in inp.requested} | set(inp.requested)
    missing = [n for n in inp.train + inp.eval if n not in found]
    if missing:
        raise SystemExit(
            f"{inp.path}: no record named {', '.join(missing)} (has {', '.join(list(inp.record_lengths)[:30])})"
        )
    return inp


def synthetic(scratch: Path, mbp: float, seed: int, fmt: str) -> Path:
    """The synthetic genome in ``scratch`` (generated once; reused while its summary exists)."""
    ext = {"gzip": ".fa.gz", "bgzip": ".bgz.fa.gz", "plain": ".fa"}[fmt]
    path = scratch / f"synthetic_{mbp:g}mbp_seed{seed}{ext}"
    summary = Path(str(path) + ".json")
    if path.exists() and summary.exists():
        return path
    print(f"generating {path} ...", flush=True)
    info = generate(path, mbp=mbp, seed=seed, fmt=fmt)
    summary.write_text(json.dumps(info, indent=2) + "\n")
    return path


def sample_inputs() -> list[Input]:
    """The bundled real sample(s) in data/sample/ (records named like ``chr3:42000000-44000000``)."""
    sample_dir = REPO / "data" / "sample"
    if not sample_dir.is_dir():
        return []
    out = []
    for path in sorted(sample_dir.iterdir()):
        if path.is_file() and path.name.endswith(FASTA_SUFFIXES):
            records = list(read_fai(path) or scan_fasta(path))
            if records:
                tr, ev = default_split(records)
                out.append(Input(f"sample {path.name}", path, tr, ev))
    return out


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_bin() -> str | None:
    path = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    if path is None:
        return None
    probe = subprocess.run([path, "-f", "%M", "true"], capture_output=True, text=True)
    return path if probe.returncode == 0 else None  # a shell builtin-only system has no GNU time


def timed(cmd: list[str], stdout=subprocess.DEVNULL, env=None) -> dict:
    """Run ``cmd``; return wall seconds, return code, max RSS (KiB, via GNU time) and output tail."""
    tb = time_bin()
    rss_file = None
    full = list(cmd)
    if tb:
        fd, rss_file = tempfile.mkstemp(prefix="genolong-bench-rss-")
        os.close(fd)
        full = [tb, "-f", "%M %U %S", "-o", rss_file] + full
    t0 = time.perf_counter()
    proc = subprocess.run(full, stdout=stdout, stderr=subprocess.PIPE, env=env)
    wall = time.perf_counter() - t0
    rss = cpu = None
    if rss_file:
        try:
            text = Path(rss_file).read_text().strip().splitlines()
            fields = text[-1].split() if text else []
            if len(fields) == 3:
                rss, cpu = int(fields[0]), float(fields[1]) + float(fields[2])
        except ValueError:
            pass
        finally:
            os.unlink(rss_file)
    out = proc.stdout.decode(errors="replace") if isinstance(proc.stdout, bytes) else ""
    return {
        "seconds": wall,
        "rc": proc.returncode,
        "max_rss_kib": rss,
        "cpu_seconds": cpu,
        "stdout": out[-2000:],
        "stderr": proc.stderr.decode(errors="replace")[-3000:],
    }


def genolong_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "genolong"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("genolong")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from genolong.cli import main; sys.exit(main())"]


def prepare_cmd(inp: Input, out: Path, extra: list[str]) -> list[str]:
    cmd = genolong_cmd() + ["prepare", str(inp.path), "--out", str(out), "--force"]
    if inp.train:
        cmd += ["--train", ",".join(inp.train)]
    if inp.eval:
        cmd += ["--eval", ",".join(inp.eval)]
    return cmd + extra


def floor_cmd(inp: Input) -> tuple[str, list[str]]:
    if inp.indexed:
        return "pysam.FastaFile.fetch", [sys.executable, "-c", PYSAM_FLOOR, str(inp.path)] + inp.requested
    if inp.kind == "plain":
        return "cat > /dev/null", ["cat", str(inp.path)]
    return "gzip -dc > /dev/null", ["gzip", "-dc", str(inp.path)]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_input(inp: Input, repeats: int, scratch: Path, extra: list[str], keep: bool) -> dict:
    """Interleave floor and prepare ``repeats`` times; return the per-input result dict."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", inp.label)
    store = scratch / f"store-{safe}"
    floor_name, fcmd = floor_cmd(inp)
    pcmd = prepare_cmd(inp, store, extra)
    print(
        f"\n== {inp.label}: {inp.path} ({inp.kind}{', indexed' if inp.indexed else ''}, "
        f"{inp.file_bytes / 1e6:.1f} MB; train {','.join(inp.train) or '-'} eval {','.join(inp.eval) or '-'})",
        flush=True,
    )
    print(f"   floor:   {floor_name}")
    print(f"   prepare: {' '.join(pcmd)}", flush=True)
    subprocess.run(["cat", str(inp.path)], stdout=subprocess.DEVNULL)  # page cache warm for both sides
    floors, prepares, isal, rss, pairs, cpu, floor_cpu = [], [], [], [], [], [], []
    errors = []
    for i in range(repeats):
        f = timed(fcmd)
        if f["rc"] != 0:
            errors.append(f"floor rc={f['rc']}: {f['stderr'].strip()[-500:]}")
            break
        floors.append(f["seconds"])
        if f["cpu_seconds"] is not None:
            floor_cpu.append(f["cpu_seconds"])
        p = timed(pcmd, stdout=subprocess.PIPE)
        status = "ok" if p["rc"] == 0 else f"FAILED rc={p['rc']}"
        mem = "" if p["max_rss_kib"] is None else f", max RSS {p['max_rss_kib'] / 1024:.0f} MiB"
        if p["cpu_seconds"] is not None:
            mem += f", CPU {p['cpu_seconds']:.2f} s = {p['cpu_seconds'] / p['seconds']:.2f} cores"
        fcpu = "" if f["cpu_seconds"] is None else f" (CPU {f['cpu_seconds']:.2f} s)"
        print(
            f"   repeat {i + 1}: floor {f['seconds']:.2f} s{fcpu}, prepare {p['seconds']:.2f} s ({status}{mem})",
            flush=True,
        )
        if p["rc"] != 0:
            errors.append(f"prepare rc={p['rc']}: {p['stderr'].strip()[-1500:]}")
            print("   " + p["stderr"].strip().replace("\n", "\n   ")[-1500:])
            break
        prepares.append(p["seconds"])
        if p["cpu_seconds"] is not None:
            cpu.append(p["cpu_seconds"])
        pairs.append(p["seconds"] / f["seconds"])
        if p["max_rss_kib"] is not None:
            rss.append(p["max_rss_kib"])
        if not inp.indexed and inp.kind == "gzip":
            g = timed([sys.executable, "-c", ISAL_FLOOR, str(inp.path)])
            if g["rc"] == 0:
                isal.append(g["seconds"])
    store_bytes = dir_bytes(store) if store.exists() and prepares else None
    last_stdout = p["stdout"] if prepares else ""
    if store.exists() and not keep:
        shutil.rmtree(store, ignore_errors=True)
    fm, pm = median(floors), median(prepares)
    bases = inp.requested_bases
    res = {
        "label": inp.label,
        "path": str(inp.path),
        "format": inp.kind,
        "indexed": inp.indexed,
        "file_bytes": inp.file_bytes,
        "records": inp.record_lengths,
        "train": inp.train,
        "eval": inp.eval,
        "requested_bases": bases,
        "floor": floor_name,
        "floor_cmd": fcmd if not inp.indexed else fcmd[:2] + ["<script>"] + fcmd[3:],
        "prepare_cmd": pcmd,
        "floor_seconds": floors,
        "prepare_seconds": prepares,
        "isal_read_seconds": isal,
        "floor_median_s": fm,
        "prepare_median_s": pm,
        "isal_read_median_s": median(isal),
        "ratio": (pm / fm) if (fm and pm) else None,
        "ratio_pairwise_median": median(pairs),
        "floor_mb_per_s": inp.file_bytes / 1e6 / fm if fm else None,
        "prepare_mb_per_s": inp.file_bytes / 1e6 / pm if pm else None,
        "floor_mbp_per_s": bases / 1e6 / fm if fm else None,
        "prepare_mbp_per_s": bases / 1e6 / pm if pm else None,
        "prepare_max_rss_mib": max(rss) / 1024 if rss else None,
        "prepare_cpu_seconds": cpu,
        # CPU seconds (user + sys, all threads) of both sides: on a loaded shared machine their ratio
        # is steadier than the wall-time one, though prepare's threads overlap on an idle machine
        "floor_cpu_seconds": floor_cpu,
        "ratio_cpu": (median(cpu) / median(floor_cpu)) if (cpu and floor_cpu) else None,
        "prepare_cores_used_median": median([c / w for c, w in zip(cpu, prepares)]),
        "store_bytes": store_bytes,
        "store_bits_per_base": 8 * store_bytes / bases if store_bytes and bases else None,
        "prepare_stdout_tail": last_stdout[-1500:],
        "errors": errors,
    }
    return res


def profile_prepare(inp: Input, scratch: Path, extra: list[str], top: int = 25) -> str:
    """One extra prepare under cProfile (main thread only); return the top of the report."""
    store = scratch / "store-profile"
    prof = scratch / "prepare.prof"
    args = prepare_cmd(inp, store, extra)[len(genolong_cmd()) :]
    code = (
        "import cProfile, sys\n"
        "from genolong.cli import main\n"
        f"sys.argv = ['genolong'] + {args!r}\n"
        f"cProfile.run('main()', {str(prof)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    import io
    import pstats

    buf = io.StringIO()
    if prof.exists():
        st = pstats.Stats(str(prof), stream=buf)
        st.sort_stats("tottime").print_stats(top)
        st.sort_stats("cumulative").print_stats(top)
    shutil.rmtree(store, ignore_errors=True)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    def version(mod: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(mod)
        except Exception:
            return None

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gz = subprocess.run(["gzip", "--version"], capture_output=True, text=True).stdout.splitlines()
    git = {}
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--", "genolong"], capture_output=True)
        if head.returncode == 0:
            import hashlib

            git = {
                "commit": head.stdout.strip(),
                "genolong_uncommitted_diff_sha256": hashlib.sha256(diff.stdout).hexdigest() if diff.stdout else None,
            }
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: version(m) for m in ("genolong", "numpy", "zarr", "numcodecs", "isal", "pysam", "pyfaidx")},
        "gzip": gz[0] if gz else None,
        "git": git,
        "loadavg_at_start": os.getloadavg(),
    }


def print_table(results: list[dict]) -> None:
    cols = [
        ("input", 34, "s"),
        ("format", 9, "s"),
        ("Mbp", 7, ".1f"),
        ("MB", 7, ".1f"),
        ("floor s", 8, ".2f"),
        ("prep s", 8, ".2f"),
        ("ratio", 6, ".2f"),
        ("floor MB/s", 10, ".1f"),
        ("prep MB/s", 9, ".1f"),
        ("prep Mbp/s", 10, ".1f"),
        ("RSS MiB", 8, ".0f"),
        ("isal s", 7, ".2f"),
        ("CPU ratio", 9, ".2f"),
    ]

    def cell(x, width: int, spec: str) -> str:
        if x is None:
            return "-".rjust(width)
        return format(x, f"<{width}{spec}") if spec == "s" else format(x, f">{width}{spec}")

    head = " ".join(name.ljust(w) if spec == "s" else name.rjust(w) for name, w, spec in cols)
    print("\n" + head)
    print("-" * len(head))
    for r in results:
        vals = [
            r["label"][:34],
            r["format"] + ("+fai" if r["indexed"] else ""),
            r["requested_bases"] / 1e6,
            r["file_bytes"] / 1e6,
            r["floor_median_s"],
            r["prepare_median_s"],
            r["ratio"],
            r["floor_mb_per_s"],
            r["prepare_mb_per_s"],
            r["prepare_mbp_per_s"],
            r["prepare_max_rss_mib"],
            r["isal_read_median_s"],
            r.get("ratio_cpu"),
        ]
        print(" ".join(cell(v, w, spec) for v, (_, w, spec) in zip(vals, cols)))
        for e in r["errors"]:
            print(f"   ERROR: {e.splitlines()[-1] if e.splitlines() else e}")
    print(
        "ratio = median(prepare) / median(floor); target <= 1.5. MB/s counts the input file's bytes, "
        "Mbp/s the requested chromosomes;\nRSS: prepare's peak (GNU time); isal s: python-isal reading the whole "
        "gzip file (a stricter reference, not the floor);\nCPU ratio: median CPU seconds (user + sys, all threads) of prepare over the floor's."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--input", action="append", type=Path, default=[], help="FASTA to benchmark (repeatable); replaces the defaults"
    )
    p.add_argument(
        "--train",
        default=None,
        help="comma-separated train chromosomes for --input (default: all but the held-out one)",
    )
    p.add_argument(
        "--eval",
        default=None,
        help="comma-separated eval chromosomes for --input (default: chr22 if present, else the last record)",
    )
    p.add_argument("--mbp", type=float, default=500.0, help="size of the synthetic genome (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scratch", type=Path, default=DEFAULT_SCRATCH, help=f"scratch directory (default {DEFAULT_SCRATCH})"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-synthetic", action="store_true", help="skip the synthetic inputs")
    p.add_argument("--no-bgzip", action="store_true", help="skip the synthetic bgzip input")
    p.add_argument("--no-sample", action="store_true", help="skip data/sample/")
    p.add_argument(
        "--prepare-arg", action="append", default=[], help="extra argument for genolong prepare (repeatable)"
    )
    p.add_argument(
        "--profile", action="store_true", help="also run one prepare per input under cProfile and print the top"
    )
    p.add_argument("--keep-stores", action="store_true", help="keep the prepared stores in --scratch")
    p.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"results JSON (default {DEFAULT_JSON.relative_to(REPO)})"
    )
    a = p.parse_args(argv)
    a.scratch.mkdir(parents=True, exist_ok=True)
    split = lambda s: [x for x in s.split(",") if x] if s else []  # noqa: E731

    inputs: list[Input] = []
    if a.input:
        for path in a.input:
            if not path.exists():
                p.error(f"--input {path}: no such file")
            tr, ev = default_split(list(read_fai(path) or scan_fasta(path)))
            tr = split(a.train) if a.train is not None else tr
            ev = split(a.eval) if a.eval is not None else ev
            inputs.append(Input(path.name, path.resolve(), tr, ev))
    else:
        if not a.no_synthetic:
            for fmt in ("gzip",) + (() if a.no_bgzip else ("bgzip",)):
                path = synthetic(a.scratch, a.mbp, a.seed, fmt)
                tr, ev = default_split(list(read_fai(path) or scan_fasta(path)))
                inputs.append(Input(f"synthetic {a.mbp:g} Mbp {fmt}", path, tr, ev))
        if not a.no_sample:
            inputs += sample_inputs()
    if not inputs:
        p.error("nothing to benchmark")
    for inp in inputs:
        describe(inp)

    info = machine()
    print(f"machine: {info['nproc']} cores ({info['cpu']}), python {info['python']}, load {info['loadavg_at_start']}")
    results, profiles = [], {}
    for inp in inputs:
        results.append(run_input(inp, a.repeats, a.scratch, a.prepare_arg, a.keep_stores))
        if a.profile and not results[-1]["errors"]:
            profiles[inp.label] = profile_prepare(inp, a.scratch, a.prepare_arg)
            print(profiles[inp.label])
    info["loadavg_at_end"] = os.getloadavg()
    print_table(results)

    doc = {
        "benchmark": "prepare_throughput",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": info,
        "repeats": a.repeats,
        "target_ratio": 1.5,
        "results": results,
    }
    if profiles:
        doc["profiles"] = profiles
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
