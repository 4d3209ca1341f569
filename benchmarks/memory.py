#!/usr/bin/env python
"""Saved-activation bytes, peak RSS and step time of the memory techniques, side by side, on CPU.

For the ``small`` preset at each length T (default 8k, 16k, 32k, 64k tokens, batch 1), one
forward + backward of ``GenoLM.loss`` (mean NLL over the next-base targets) per technique:

- none: the plain model;
- selective: recompute of the default module kinds (``genolong.parallel.DEFAULT_SELECTIVE``);
- full: recompute of every block;
- offload: CPU activation offload of every saved tensor of at least ``--offload-min-bytes``;
- full+offload: both.

The techniques run interleaved in one process (none, selective, full, ..., then again for
``--repeats`` rounds), each on its own model (same seed, same weights), so load changes on a shared
machine hit all of them alike; the table shows the fastest round. Memory figures come from
:class:`genolong.memory.ActivationMeter` (deterministic): ``resident`` = peak saved-activation
bytes left on the device (on CPU: not offloaded), ``offloaded`` = peak bytes in the host pool;
``peak RSS`` is the process high-water mark during the step (reset before it through
``/proc/self/clear_refs``) and ``+RSS`` its rise over the RSS at the step's start.

A (technique, T) whose RSS, extrapolated linearly from its previous length, would not fit in 70%
of the machine's available memory is skipped and marked so (``none`` at 64k would need about
43 GB of saved activations: more than this machine has). The extrapolation is conservative: in
one process running all five techniques the RSS rise carries heap fragmentation from the larger
ones; ``--modes full,full+offload --lengths 65536 --no-flat`` measures the long lengths alone.

A second table checks the claim "full recompute + offload keeps device-resident saved
activations flat in the number of layers": the small preset cut or repeated to 4, 8 and 16 layers
(pattern KKDD, layer 3 a shared-indexer DSA layer) at ``--flat-T`` tokens.

On CPU, offload copies into separate host tensors and back (see genolong/parallel/offload.py):
resident bytes drop, RSS does not (host and "device" are the same RAM), and the step time includes
the copies. The default threshold here is 64 KiB, not the library's 1 MiB: genolong's torch KDA
reference saves per-64-token-chunk tensors of 64 KiB on this preset, which a 1 MiB threshold
would leave on the device (fla's GPU kernel saves whole-sequence tensors instead).

Example::

    python benchmarks/memory.py                                  # 8k..64k, 2 rounds, 1 thread
    python benchmarks/memory.py --lengths 8192,16384 --repeats 1

Prints the tables and writes JSON (default benchmarks/results/memory.json) after every length.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from genolong.memory import ActivationMeter
from genolong.model import PRESETS, GenoLM, ModelConfig
from genolong.parallel import DEFAULT_SELECTIVE, parallelize

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, mem_available_bytes, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "memory.json"
MODES = ("none", "selective", "full", "offload", "full+offload")
GiB = 2**30


def techniques(mode: str, min_bytes: int) -> dict[str, Any]:
    """parallelize() keyword arguments of a benchmark mode."""
    return {
        "none": {},
        "selective": {"recompute": "selective", "recompute_modules": DEFAULT_SELECTIVE},
        "full": {"recompute": "full"},
        "offload": {"offload": True, "offload_min_bytes": min_bytes},
        "full+offload": {"recompute": "full", "offload": True, "offload_min_bytes": min_bytes},
    }[mode]


def layered(config: ModelConfig, n: int) -> ModelConfig:
    """``config`` with ``n`` layers (a multiple of 4) repeating its first four (KKDD, layer 3 shared)."""
    return config.replace(
        num_hidden_layers=n,
        layer_types=config.layer_types[:4] * (n // 4),
        mlp_layer_types=("dense",) + ("sparse",) * (n - 1),
        indexer_types=config.indexer_types[:4] * (n // 4),
    )


def _trim() -> None:
    """Give freed heap memory back to the OS so RSS starts each step from what is in use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def step(model: GenoLM, tokens: torch.Tensor) -> dict[str, Any]:
    """One metered forward+backward; returns seconds and memory figures (bytes)."""
    model.zero_grad(set_to_none=True)
    _trim()
    rss0 = _rss()
    t0 = time.perf_counter()
    with ActivationMeter(model) as meter:
        nll, weight = model.loss(tokens)
        (nll / weight).backward()
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "loss": (nll / weight).item(),
        "resident_bytes": meter.peak_resident_bytes,
        "offloaded_bytes": meter.peak_offloaded_bytes,
        "layer_resident_bytes": [layer.resident_bytes for layer in meter.layers],
        "layer_offloaded_bytes": [layer.offloaded_bytes for layer in meter.layers],
        "outside_bytes": meter.outside.resident_bytes,
        "peak_rss_bytes": meter.peak_rss_bytes,
        "rss_start_bytes": rss0,
        "rss_rise_bytes": (meter.peak_rss_bytes or 0) - rss0,
        "rss_peak_reset": meter.rss_peak_reset,
    }


def run_lengths(a: argparse.Namespace, out: dict[str, Any]) -> None:
    config = PRESETS[a.preset]
    models = {}
    for mode in a.modes:
        torch.manual_seed(0)
        models[mode] = parallelize(GenoLM(config), **techniques(mode, a.offload_min_bytes))
    last: dict[str, tuple[int, int]] = {}  # mode -> (T, rss rise) of its last completed length
    for T in a.lengths:
        tokens = torch.randint(1, 6, (1, T), generator=torch.Generator().manual_seed(T))
        rows: dict[str, dict[str, Any]] = {}
        for r in range(a.repeats if T <= a.repeat_max_T else 1):
            for mode in a.modes:
                if mode in rows and rows[mode].get("skipped"):
                    continue
                if mode not in rows and mode in last:
                    t_prev, rise = last[mode]
                    need, avail = rise * T / t_prev, mem_available_bytes()
                    if need > 0.7 * avail:
                        rows[mode] = {
                            "skipped": f"needs ~{need / GiB:.1f} GiB (extrapolated), {avail / GiB:.1f} GiB available"
                        }
                        print(f"T={T} {mode}: skipped, {rows[mode]['skipped']}", flush=True)
                        continue
                res = step(models[mode], tokens)
                print(
                    f"T={T} round {r} {mode}: {res['seconds']:.1f} s, resident {res['resident_bytes'] / GiB:.3f} GiB, "
                    f"offloaded {res['offloaded_bytes'] / GiB:.3f} GiB, +RSS {res['rss_rise_bytes'] / GiB:.2f} GiB, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if mode in rows:
                    rows[mode]["all_seconds"].append(res["seconds"])
                    rows[mode]["seconds"] = min(rows[mode]["all_seconds"])
                else:
                    res["all_seconds"] = [res["seconds"]]
                    rows[mode] = res
                    last[mode] = (T, res["rss_rise_bytes"])
        base = rows.get("none")
        for row in rows.values():
            if base and not base.get("skipped") and not row.get("skipped"):
                row["time_vs_none"] = row["seconds"] / base["seconds"]
                row["resident_vs_none"] = row["resident_bytes"] / base["resident_bytes"]
        out["lengths"][str(T)] = rows
        write(a, out)


def run_flat(a: argparse.Namespace, out: dict[str, Any]) -> None:
    tokens = torch.randint(1, 6, (1, a.flat_T), generator=torch.Generator().manual_seed(1))
    for mode in ("none", "full+offload"):
        for n in a.flat_layers:
            torch.manual_seed(0)
            model = parallelize(GenoLM(layered(PRESETS[a.preset], n)), **techniques(mode, a.offload_min_bytes))
            res = step(model, tokens)
            out["flat"].setdefault(mode, {})[str(n)] = {
                k: res[k] for k in ("resident_bytes", "offloaded_bytes", "seconds")
            }
            print(
                f"flat T={a.flat_T} {mode} layers={n}: resident {res['resident_bytes'] / 2**20:.1f} MiB, "
                f"offloaded {res['offloaded_bytes'] / 2**20:.1f} MiB",
                flush=True,
            )
            del model
    write(a, out)


def write(a: argparse.Namespace, out: dict[str, Any]) -> None:
    out["machine"].update(environment("loadavg_at_write"))
    write_json(a.json, out, indent=2)


def table(out: dict[str, Any]) -> str:
    """Markdown tables of the results."""
    lines = [
        "| T | technique | resident saved (GiB) | offloaded (GiB) | peak RSS (GiB) | +RSS (GiB) | step (s) "
        "| resident / none | time / none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for T, rows in out["lengths"].items():
        for mode, row in rows.items():
            if row.get("skipped"):
                lines.append(f"| {int(T) // 1024}k | {mode} | skipped: {row['skipped']} | | | | | | |")
                continue
            ratio = lambda k: f"{row[k]:.2f}" if k in row else "-"  # noqa: E731
            lines.append(
                f"| {int(T) // 1024}k | {mode} | {row['resident_bytes'] / GiB:.3f} | {row['offloaded_bytes'] / GiB:.3f} "
                f"| {row['peak_rss_bytes'] / GiB:.2f} | {row['rss_rise_bytes'] / GiB:.2f} | {row['seconds']:.1f} "
                f"| {ratio('resident_vs_none')} | {ratio('time_vs_none')} |"
            )
    if out["flat"]:
        lines += [
            "",
            f"Flatness in layers at T = {out['config']['flat_T']}: peak resident saved bytes (MiB)",
            "",
            "| technique | " + " | ".join(f"{n} layers" for n in out["config"]["flat_layers"]) + " |",
            "|---|" + "---|" * len(out["config"]["flat_layers"]),
        ]
        for mode, by_n in out["flat"].items():
            lines.append(
                f"| {mode} | "
                + " | ".join(
                    f"{by_n[str(n)]['resident_bytes'] / 2**20:.1f}"
                    for n in out["config"]["flat_layers"]
                    if str(n) in by_n
                )
                + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--lengths", default="8192,16384,32768,65536")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--repeat-max-T", type=int, default=16384, help="longer lengths run one round (default 16384)")
    p.add_argument("--offload-min-bytes", type=int, default=64 * 1024)
    p.add_argument("--flat-T", type=int, default=2048)
    p.add_argument("--flat-layers", default="4,8,16")
    p.add_argument("--no-flat", action="store_true", help="skip the layer-count table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.modes = [m for m in a.modes.split(",")]
    a.flat_layers = [int(x) for x in a.flat_layers.split(",")]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    torch.set_num_threads(a.threads)
    out: dict[str, Any] = {
        **environment("date"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": environment("nproc", "platform", "python", "torch", "loadavg_at_start", "mem_available_bytes"),
        "config": {
            "preset": a.preset,
            "modes": a.modes,
            "repeats": a.repeats,
            "repeat_max_T": a.repeat_max_T,
            "offload_min_bytes": a.offload_min_bytes,
            "selective_modules": list(DEFAULT_SELECTIVE),
            "threads": a.threads,
            "flat_T": a.flat_T,
            "flat_layers": a.flat_layers,
            "batch": 1,
        },
        "lengths": {},
        "flat": {},
    }
    if not a.no_flat:
        run_flat(a, out)
    run_lengths(a, out)
    print(table(out))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
