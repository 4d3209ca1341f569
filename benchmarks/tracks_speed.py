#!/usr/bin/env python
"""Time of ``genolong tracks`` on results of the quickstart's size, against reading their per-token table.

The quickstart scores ``DEFAULT_EVAL_TILES`` (8) held-out chr22 tiles of its recipe's eval context
(8,192) per model. This script prepares the bundled sample, evaluates a random ``tiny`` model on
those tiles twice (full context, and with the context cut at 1,024, as the quickstart's tuned and
tuned-cut runs; the model does not change the tracks' cost), then times in fresh processes,
interleaved (baseline, one, two, baseline, ...) because the machine is shared:

- ``read``: the baseline, a fresh python reading the per-token table of one result into pandas
  (pyarrow, all columns), which every consumer of the table pays;
- ``one``: ``genolong tracks A`` (loss bigWig + bedGraph + chrom.sizes);
- ``two``: ``genolong tracks A B`` (both losses and B - A: six track files).

and the same three in this process with every module already imported (``work``: what the
commands do beyond starting Python and importing pandas, pyarrow, zarr and pyBigWig).
Medians of ``--repeats`` runs and the ratios to the baseline are printed and written as JSON
(default benchmarks/results/tracks_speed.json).

Example::

    python benchmarks/tracks_speed.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, run_fresh, write_json  # noqa: E402

_READ = (
    "import sys, pathlib, pyarrow as pa, pyarrow.parquet as pq\n"
    "parts = sorted(pathlib.Path(sys.argv[1], 'tokens').glob('part-*.parquet'))\n"
    "frame = pa.concat_tables([pq.read_table(p) for p in parts]).to_pandas()\n"
    "print(len(frame))"
)


def _results(work: Path, tiles: int, context: int, cut: int) -> tuple[Path, Path]:
    """The sample store and two evaluate results of a random tiny model (full, cut) under ``work``."""
    import torch

    from genolong.cli import main
    from genolong.model import PRESETS, GenoLM
    from genolong.quickstart import prepare_sample

    prepare_sample(work / "store", progress=False)
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(work / "model")
    common = [
        str(work / "model"),
        "--store",
        str(work / "store"),
        "--context",
        str(context),
        "--max-tiles",
        str(tiles),
        "--quiet",
        "--force",
    ]
    assert main(["evaluate", *common, "--label", "full", "--out", str(work / "full")]) == 0
    assert (
        main(["evaluate", *common, "--label", f"cut {cut}", "--context-cut", str(cut), "--out", str(work / "cut")]) == 0
    )
    return work / "full", work / "cut"


def _in_process(full: Path, cut: Path, work: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of the three measurements in this process, modules imported (interleaved repeats)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from genolong.evaluation.results import EvalResult
    from genolong.evaluation.tracks import tracks_for_results, write_tracks

    def read() -> None:
        pa.concat_tables([pq.read_table(p) for p in sorted((full / "tokens").glob("part-*.parquet"))]).to_pandas()

    def tracks(dirs: list[Path], out: Path) -> None:
        found, sizes, source = tracks_for_results([EvalResult.load(d) for d in dirs])
        write_tracks(out, found, sizes, source)

    jobs = {
        "read": read,
        "one": lambda: tracks([full], work / "in-one"),
        "two": lambda: tracks([full, cut], work / "in-two"),
    }
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(repeats):
        for key, job in jobs.items():
            began = time.perf_counter()
            job()
            times[key].append(time.perf_counter() - began)
    return times


def main() -> None:
    from genolong.defaults import DEFAULT_EVAL_TILES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiles", type=int, default=DEFAULT_EVAL_TILES, help="tiles per result (default: the quickstart's)"
    )
    parser.add_argument(
        "--context", type=int, default=8192, help="tile length (default: the quickstart's eval context)"
    )
    parser.add_argument(
        "--cut", type=int, default=1024, help="the second result's context cut (default: the base's context)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "tracks_speed.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tracks-speed-") as tmp:
        work = Path(tmp)
        full, cut = _results(work, args.tiles, args.context, args.cut)
        commands = {
            "read": [sys.executable, "-c", _READ, str(full)],
            "one": [sys.executable, "-m", "genolong.cli", "tracks", str(full), "--out", str(work / "one"), "--force"],
            "two": [
                sys.executable,
                "-m",
                "genolong.cli",
                "tracks",
                str(full),
                str(cut),
                "--out",
                str(work / "two"),
                "--force",
            ],
        }
        times: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(args.repeats):
            for key, cmd in commands.items():
                times[key].append(run_fresh(cmd).check().wall_s)
        tokens = int(run_fresh(commands["read"]).check().output.split()[-1])
        work_s = _in_process(full, cut, work, args.repeats)
        sizes = {p.name: p.stat().st_size for p in sorted((work / "two").iterdir())}
    median = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        ("read the per-token table (baseline)", "read"),
        ("genolong tracks A", "one"),
        ("genolong tracks A B", "two"),
    ]
    print(
        f"{args.tiles} tiles of {args.context:,}: {tokens:,} scored bases per result; median of {args.repeats} fresh runs"
    )
    work_median = {k: statistics.median(v) for k, v in work_s.items()}
    print(f"| {'what':<36} | wall s | x baseline | work s (imported) | x baseline |")
    print(f"|{'-' * 38}|--------|------------|-------------------|------------|")
    for title, key in rows:
        print(
            f"| {title:<36} | {median[key]:6.2f} | {median[key] / median['read']:10.2f} | "
            f"{work_median[key]:17.3f} | {work_median[key] / work_median['read']:10.2f} |"
        )
    doc = {
        "environment": environment(),
        "command": "python benchmarks/tracks_speed.py " + " ".join(sys.argv[1:]),
        "tiles": args.tiles,
        "context": args.context,
        "cut": args.cut,
        "tokens_per_result": tokens,
        "repeats": args.repeats,
        "wall_s": times,
        "median_s": median,
        "ratio_to_read": {k: median[k] / median["read"] for k in ("one", "two")},
        "work_s": work_s,
        "work_median_s": work_median,
        "work_ratio_to_read": {k: work_median[k] / work_median["read"] for k in ("one", "two")},
        "file_bytes": sizes,
    }
    print(f"written {write_json(args.out, doc)}")


if __name__ == "__main__":
    main()
