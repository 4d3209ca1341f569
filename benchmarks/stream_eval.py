"""Scoring one long tile in one process: the one-shot forward vs the streamed (chunked prefill) one.

The bundled base (``data/sample/base``, the ``small`` preset, fp32) scores one tile of ``T`` tokens
of the quickstart store with :func:`genolong.evaluation.score.score_tile` (what ``genolong
evaluate`` runs per tile), once in one forward and once streamed through
the model ``S`` tokens at a time (:mod:`genolong.model.stream`). Each run is its own child process
(``--child``), so its peak RSS (the child's ``ru_maxrss``, from ``os.wait4``) is its own; children
allocate as the genolong commands do (``keep_freed_memory``). The tile is the start of the split's
longest segment: the eval split's (509,431 tokens) up to that length, the train split's (2 Mb
segments) beyond it. Both runs of a length are side by side; the streamed run's per-token NLL is
compared with the one-shot run's (max |diff|).

Usage (prepare the store first: ``genolong quickstart --prepare-only --out /tmp/qs``)::

    python benchmarks/stream_eval.py --store /tmp/qs/genome --lengths 65536,262144 --segment-tokens 16384,65536 \
        --stream-only 1048576

``--concurrent`` starts a length's runs at the same time (for a busy machine: the peak RSS of each
child is its own either way; the times then include the contention, the same for both).

Prints a table and writes JSON (default benchmarks/results/stream_eval.json) after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import Fresh, environment, wait_any, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "stream_eval.json"
DEFAULT_BASE = HERE.parent / "data" / "sample" / "base"
GiB = 1 << 30


def _tile(store: str, tokens: int) -> tuple[str, str, int, np.ndarray]:
    """(split, contig, start, tokens [T] uint8): the first ``tokens`` of the longest segment of the
    eval split if it is long enough, else of the train split."""
    from genolong.data.store import GenomeStore

    st = GenomeStore.open(store)
    for name in ("eval", "train"):
        split = st.split(name)
        lengths = split.segment_lengths
        i = int(np.argmax(lengths))
        if lengths[i] >= tokens:
            row = split.segments.iloc[i]
            off = int(row["offset"])
            return name, str(row["contig"]), int(row["start"]), np.asarray(split.tokens[off : off + tokens])
    raise SystemExit(f"no segment of {tokens:,} tokens in {store}'s eval or train split")


def child(a: argparse.Namespace) -> None:
    """One run: load the base, score the tile, print a JSON line; save the NLL to ``a.nll_out``."""
    from genolong.allocator import keep_freed_memory

    keep_freed_memory()  # as every genolong command that runs a model does, before torch allocates
    import torch

    from genolong.evaluation.score import score_tile
    from genolong.model.lm import GenoLM

    torch.set_num_threads(a.threads)
    split, contig, start, tokens = _tile(a.store, a.tokens)
    model = GenoLM.from_pretrained(a.base, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    scores = score_tile(model, tokens, segment_tokens=a.segment or None)
    seconds = time.perf_counter() - t0
    if a.nll_out:
        np.save(a.nll_out, scores.nll)
    print(
        json.dumps(
            {
                "score_s": seconds,
                "split": split,
                "contig": contig,
                "start": start,
                "scored": int(scores.nll.shape[0]),
                "mean_nll": float(scores.nll.astype(np.float64).mean()),
            }
        )
    )


def _start(a: argparse.Namespace, tokens: int, segment_tokens: int, nll_out: str, log: Path) -> dict[str, Any]:
    """Start one child (its output to ``log``); :func:`_finish` collects it."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--store",
        a.store,
        "--base",
        str(a.base),
        "--tokens",
        str(tokens),
        "--segment",
        str(segment_tokens),
        "--threads",
        str(a.threads),
        "--nll-out",
        nll_out,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    return {"fresh": Fresh.start(cmd, env=env, log=log), "segment_tokens": segment_tokens}


def _finish(jobs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Wait for the children, in the order they end; each one's figures plus its own peak RSS
    (``ru_maxrss``, ``os.wait4``) and wall time."""
    names = {id(job["fresh"]): name for name, job in jobs.items()}
    done = {}
    for fresh, run in wait_any(job["fresh"] for job in jobs.values()):
        name = names[id(fresh)]
        result = run.check().last_json()  # a failed child (e.g. -9: the OOM killer) ends the benchmark
        result.update(
            wall_s=run.wall_s, peak_rss_bytes=run.peak_rss_bytes, segment_tokens=jobs[name]["segment_tokens"] or None
        )
        done[name] = result
    return done


def _table(doc: dict[str, Any]) -> str:
    lines = [
        f"{'T':>9} {'run':>18} {'peak RSS GiB':>12} {'score s':>8} {'wall s':>7} {'RSS / one-shot':>14} "
        f"{'time / one-shot':>15} {'max |dNLL|':>10}"
    ]
    for t, row in doc["lengths"].items():
        base = row.get("one-shot")
        for name, r in row.items():
            if not isinstance(r, dict) or "peak_rss_bytes" not in r:
                continue
            rss = f"{r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}" if base else "-"
            tim = f"{r['score_s'] / base['score_s']:.2f}" if base else "-"
            diff = f"{r['max_abs_nll_diff']:.1e}" if "max_abs_nll_diff" in r else "-"
            lines.append(
                f"{int(t):>9,} {name:>18} {r['peak_rss_bytes'] / GiB:>12.2f} {r['score_s']:>8.1f} "
                f"{r['wall_s']:>7.1f} {rss:>14} {tim:>15} {diff:>10}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store", required=True, help="the quickstart's genome store (genolong quickstart --prepare-only)"
    )
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE, help="model directory (default: the bundled base)")
    parser.add_argument("--lengths", default="65536,262144", help="tile lengths run both ways, comma-separated")
    parser.add_argument("--stream-only", default="", help="tile lengths run streamed only (e.g. 1048576)")
    parser.add_argument(
        "--segment-tokens",
        default="16384,65536",
        help="the streamed runs' segments, comma-separated; a length runs the largest one shorter than "
        "it (--stream-only lengths: the largest) (default 16384,65536)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run (default 2)")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="start a length's runs at the same time (each child's peak RSS is still its own; both "
        "see the same contention, their times include it): for a busy machine",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--segment", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nll-out", default="", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        child(a)
        return
    doc: dict[str, Any] = {
        "benchmark": "stream_eval",
        **environment("date"),
        "command": " ".join(sys.argv),
        **environment("machine", "cpus"),
        "base": str(a.base),
        "dtype": "float32",
        "threads": a.threads,
        "segment_tokens": a.segment_tokens,
        **environment("load_average_at_start"),
        "lengths": {},
    }
    plan = [(int(t), True) for t in a.lengths.split(",") if t] + [
        (int(t), False) for t in a.stream_only.split(",") if t
    ]
    segments = sorted(int(s) for s in a.segment_tokens.split(",") if s)
    with tempfile.TemporaryDirectory() as tmp:
        for tokens, both in plan:
            row: dict[str, Any] = {}
            doc["lengths"][str(tokens)] = row
            runs = [("one-shot", 0)] if both else []
            for seg in ([s for s in segments if s < tokens][-1:] or segments[:1]) if both else segments[-1:]:
                runs.append((f"streamed S={seg:,}", seg))
            jobs: dict[str, dict[str, Any]] = {}
            for name, seg in runs:
                jobs[name] = _start(a, tokens, seg, f"{tmp}/{seg}.npy", Path(tmp) / f"{seg}.log")
                if not a.concurrent:
                    row.update(_finish({name: jobs.pop(name)}))
            row.update(_finish(jobs))
            row = {name: row[name] for name, _ in runs}  # table order
            doc["lengths"][str(tokens)] = row
            doc.setdefault("concurrent", {})[str(tokens)] = bool(a.concurrent and len(runs) > 1)
            if both:
                ref = np.load(f"{tmp}/0.npy").astype(np.float64)
                for name, seg in runs[1:]:
                    row[name]["max_abs_nll_diff"] = float(np.abs(np.load(f"{tmp}/{seg}.npy") - ref).max())
            for name, _ in runs:
                r = row[name]
                print(
                    f"T {tokens:>9,} {name:>14}: peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB, score {r['score_s']:.1f} s, "
                    f"mean NLL {r['mean_nll']:.6f}",
                    flush=True,
                )
            doc.update(environment("load_average_at_end"))
            write_json(a.json, doc)
    print(_table(doc))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
