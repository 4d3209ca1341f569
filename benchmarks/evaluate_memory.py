"""Peak memory per rank of a multi-process `genolong evaluate` against the one-process run (CPU, gloo).

The model (the ``small`` preset widened, default hidden 1024: ~150M parameters, 0.6 GB in fp32) is
saved as an export directory; the same tiles are then scored

- in one process (the whole model, one tile at a time), and
- by 4 processes under torchrun, ``cp 2 x dp_shard 2`` (each rank: a quarter of the weights, read
  as its slices of the safetensors; a 2-tile round, each tile split over a CP pair; FSDP2
  all-gathers one block at a time),

each in its own child process(es), whose peak RSS (``ru_maxrss``) is recorded per rank. genolong's
one-process commands keep freed memory (:mod:`genolong.allocator`); a multi-process scoring run keeps
glibc's allocator (with the kept heap, FSDP2's per-block gather / free grew every rank back to 0.98x
the one-process peak above the imports: ``genolong.cli._shards_for_memory``). So the 4 ranks are
compared with the one-process run as a user gets it, and with a one-process run on glibc's
allocator too (``GENOLONG_MALLOC=system``: the same allocator on both sides). A child that
only imports torch, Lightning and genolong gives the interpreter's own share. Expected per rank: the baseline
plus the sharded quarter of the weights plus one block's gathered weights and one layer's forward
working set of half a tile. Prints a table and writes benchmarks/results/evaluate_memory.json.

    python benchmarks/evaluate_memory.py                       # hidden 1024, 2 tiles of 4096
    python benchmarks/evaluate_memory.py --hidden 256 --context 2048   # the quick version
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # benchmarks/_bench.py, also when a test imports this script
from _bench import peak_rss_bytes, run_fresh, write_json  # noqa: E402

_RESULTS = Path(__file__).resolve().parent / "results" / "evaluate_memory.json"


def _child(out: Path, argv: list[str]) -> int:
    """Run ``genolong ARGV`` (or only the imports, for ``ARGV = ["--imports-only"]``) and write this
    rank's peak RSS to ``out/rank<R>.json``."""
    import lightning  # noqa: F401  (what a multi-process run imports too)
    import torch  # noqa: F401

    import genolong.evaluation.distributed  # noqa: F401
    import genolong.evaluation.score  # noqa: F401
    from genolong.cli import main

    began = time.perf_counter()
    code = 0 if argv == ["--imports-only"] else main(argv)
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "peak_rss_bytes": peak_rss_bytes(), "seconds": time.perf_counter() - began})
    )
    return code


def _launch(out: Path, argv: list[str], nproc: int = 1, malloc: str | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    if malloc is not None:
        env["GENOLONG_MALLOC"] = malloc
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    run = run_fresh([*launcher, __file__, "--child", str(out), "--", *argv], env=env)
    if not run.ok:
        raise SystemExit(f"child failed ({run.returncode}): {run.output[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--hidden", type=int, default=1024, help="hidden size of the widened small preset (default: %(default)s)"
    )
    parser.add_argument("--context", type=int, default=4096, help="tile length (default: %(default)s)")
    parser.add_argument("--tiles", type=int, default=2, help="tiles scored (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=_RESULTS, help="JSON result (default: %(default)s)")
    args, rest = parser.parse_known_args()
    if args.child is not None:
        sys.exit(_child(args.child, rest[1:] if rest[:1] == ["--"] else rest))

    import torch

    from genolong.data.prepare import prepare_genome
    from genolong.model import PRESETS, GenoLM
    from genolong.quickstart import SAMPLE_EVAL, SAMPLE_TRAIN, sample_fasta

    h = args.hidden
    config = PRESETS["small"].replace(hidden_size=h, intermediate_size=3 * h, moe_intermediate_size=h // 2)
    with tempfile.TemporaryDirectory(prefix="evaluate-memory-") as tmp:
        tmp = Path(tmp)
        prepare_genome([sample_fasta()], tmp / "genome", train=SAMPLE_TRAIN, eval=SAMPLE_EVAL, progress=False)
        torch.manual_seed(0)
        model = GenoLM(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp / "model")
        del model
        common = [
            "evaluate",
            str(tmp / "model"),
            "--store",
            str(tmp / "genome"),
            "--context",
            str(args.context),
            "--max-tiles",
            str(args.tiles),
            "--quiet",
            "--no-tokens",
            "--segment-tokens",
            "0",
        ]
        four = ["--set", "parallel.accelerator=cpu", "--set", "parallel.devices=4", "--set", "parallel.cp=2"]
        runs: dict[str, list[dict]] = {"imports only": _launch(tmp / "r0", ["--imports-only"])}
        sums = {}
        # as a user runs them (one process: freed memory kept; 4 ranks: glibc's allocator), then one
        # process on glibc's allocator (GENOLONG_MALLOC=system), the same allocator as the ranks
        for name, nproc, extra, malloc in (
            ("1 process (kept freed memory)", 1, [], None),
            ("4 ranks, cp 2 x dp_shard 2 (glibc)", 4, four, None),
            ("1 process, GENOLONG_MALLOC=system (glibc)", 1, [], "system"),
        ):
            out = tmp / f"o{nproc}{malloc}"
            runs[name] = _launch(tmp / f"r{nproc}{malloc}", [*common, "--out", str(out), *extra], nproc, malloc)
            sums[name] = json.loads((out / "meta.json").read_text())["nll_sum"]
    gib = 2**30
    base = runs["imports only"][0]["peak_rss_bytes"]
    one_kept = runs["1 process (kept freed memory)"][0]["peak_rss_bytes"]
    one_glibc = runs["1 process, GENOLONG_MALLOC=system (glibc)"][0]["peak_rss_bytes"]
    rows = []
    for name, ranks in runs.items():
        peak = max(r["peak_rss_bytes"] for r in ranks)
        rows.append(
            {
                "run": name,
                "ranks": len(ranks),
                "peak_rss_gib_max_rank": peak / gib,
                "peak_rss_gib_per_rank": [r["peak_rss_bytes"] / gib for r in ranks],
                "above_imports_gib": (peak - base) / gib,
                "above_imports_ratio_to_one_process": (peak - base) / (one_kept - base),
                "above_imports_ratio_to_one_process_glibc": (peak - base) / (one_glibc - base),
                "seconds": max(r["seconds"] for r in ranks),
                "nll_sum": sums.get(name),
            }
        )
    print(
        f"model: small preset at hidden {h}: {params / 1e6:.1f}M parameters ({params * 4 / gib:.2f} GiB fp32); "
        f"{args.tiles} tiles of {args.context:,}; peak RSS above the imports' against one process's"
    )
    print("| run | ranks | peak RSS (GiB, max rank) | above imports (GiB) | / 1 process | / 1 process on glibc | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['ranks']} | {r['peak_rss_gib_max_rank']:.3f} | {r['above_imports_gib']:.3f} | "
            f"{r['above_imports_ratio_to_one_process']:.2f} | {r['above_imports_ratio_to_one_process_glibc']:.2f} | "
            f"{r['seconds']:.0f} |"
        )
    sums = [r["nll_sum"] for r in rows if r["nll_sum"] is not None]
    print(
        f"nll_sum of the runs: {', '.join(f'{x:.6f}' for x in sums)} (max relative spread {(max(sums) - min(sums)) / max(sums):.1e})"
    )
    write_json(
        args.out,
        {
            "hidden": h,
            "parameters": params,
            "context": args.context,
            "tiles": args.tiles,
            "rows": rows,
            "command": " ".join(["python", "benchmarks/evaluate_memory.py", *sys.argv[1:]]),
        },
    )
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
