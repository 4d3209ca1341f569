#!/usr/bin/env python
"""Device-to-host syncs per training step and per layer, at two context lengths.

One forward + backward of ``GenoLM.loss`` of the `tiny` preset (KDA, full and shared DSA layers,
MoE, mHC; 16 index heads) on one window of T tokens, one process, ``memory.recompute: chunked``
(``--chunk`` tokens) and MoE token chunks of ``--moe-chunk`` tokens, counted by
:class:`genolong.memory.host_syncs.HostSyncCounter` on CPU (every read of a tensor counts: an upper
bound of a GPU step's syncs). Each sync is attributed to a layer kind by where it is issued (the
innermost genolong source line): DSA (the model's DSA code and ``kernels/dsa``), KDA
(``kernels/kda``, the KDA mixer), MoE (``moe.py``, ``expert.py``), other. Per layer = the kind's
syncs over its layers (DSA 3, KDA 5, MoE 7 in `tiny`).

The torch backend's DSA top-k and KL engines are the reference and read back per tile and per
query block (they grow with T); the ``triton`` backend's kernels do not (tests/parallel/test_dsa_fast_paths.py).

Example::

    OMP_NUM_THREADS=1 python benchmarks/host_syncs.py                      # T = 256 and 1024
    OMP_NUM_THREADS=1 python benchmarks/host_syncs.py --label before --json benchmarks/results/host_syncs_before.json

Prints a table and writes JSON (default benchmarks/results/host_syncs.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import Counter
from pathlib import Path

KINDS = {
    "dsa": (
        "dsa.py",
        "indexer.py",
        "kpool.py",
        "kpool_loss.py",
        "attention.py",
        "triton_attention.py",
        "triton_topk.py",
        "triton_kpool.py",
        "chunked_dsa.py",
        "cp_dsa.py",
    ),
    "kda": ("chunk.py", "kda.py", "cp.py", "chunked_kda.py", "fla_backend.py"),
    "moe": ("moe.py", "expert.py"),
}


def _kind(site: str) -> str:
    name = site.split(":")[0]
    return next((k for k, files in KINDS.items() if name in files), "other")


def measure(tokens: int, chunk: int, moe_chunk: int, grouped: bool = False, seed: int = 0) -> dict:
    """Syncs of one step at ``tokens``: total, by layer kind, per layer of each kind, by site.
    ``grouped``: the MoE experts take the grouped-matmul path (as on a CUDA GPU in bf16; the CPU
    build of torch has ``torch._grouped_mm`` too), else the per-expert loop (CPU's choice)."""
    import torch

    from genolong.model import moe as moe_module

    if grouped:
        if not hasattr(moe_module, "grouped_mm_supported"):
            raise SystemExit("host_syncs.py: --grouped needs the MoE grouped-matmul path (genolong.model.moe)")
        moe_module.grouped_mm_supported = lambda *a: True

    from genolong.memory.host_syncs import HostSyncCounter
    from genolong.model import PRESETS, GenoLM
    from genolong.model.moe import MoE
    from genolong.parallel import apply_recompute

    torch.manual_seed(seed)
    config = PRESETS["tiny"].replace(index_n_heads=16)
    model = GenoLM(config)
    for m in model.modules():
        if isinstance(m, MoE):
            m.chunk_tokens = moe_chunk
    apply_recompute(model, "chunked", chunk_tokens=chunk)
    ids = torch.randint(1, 5, (1, tokens))
    with HostSyncCounter(sites=True) as syncs:
        nll, weight = model.loss(ids)
        (nll / weight).backward()
    layers = {
        "dsa": sum(t == "indexed_attention" for t in config.layer_types),
        "kda": sum(t == "linear_attention" for t in config.layer_types),
        "moe": sum(t == "sparse" for t in config.mlp_layer_types),
    }
    by_kind: Counter[str] = Counter()
    for (_, site), n in syncs.by_site.items():
        by_kind[_kind(site)] += n
    return {
        "tokens": tokens,
        "moe_path": "grouped" if grouped else "loop",
        "total": syncs.total,
        "per_layer_all": syncs.total / config.num_hidden_layers,
        "by_kind": dict(by_kind),
        "per_layer": {k: by_kind.get(k, 0) / n for k, n in layers.items()},
        "by_site": {f"{kind} {site}": n for (kind, site), n in sorted(syncs.by_site.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="256,1024", help="two or more context lengths (default 256,1024)")
    p.add_argument("--chunk", type=int, default=256, help="recompute_chunk_tokens (default 256)")
    p.add_argument("--moe-chunk", type=int, default=64, help="MoE chunk_tokens (default 64)")
    p.add_argument(
        "--grouped",
        action="store_true",
        help="MoE experts as the grouped matmul (the GPU path; torch's CPU build has it), not the loop",
    )
    p.add_argument("--label", default="this tree", help="name of the code measured (e.g. before / after)")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "host_syncs.json")
    args = p.parse_args(argv)
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        print(f"host_syncs.py: --tokens must be comma-separated integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    if min(lengths) < 1 or args.chunk < 1 or args.moe_chunk < 1:
        print("host_syncs.py: --tokens, --chunk and --moe-chunk must be positive", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    rows = [measure(t, args.chunk, args.moe_chunk, args.grouped) for t in lengths]
    print(
        f"host syncs per step ({args.label}; tiny, torch backend, CPU, chunked recompute {args.chunk}, "
        f"MoE chunks {args.moe_chunk}, MoE {'grouped matmul' if args.grouped else 'loop'})"
    )
    print(f"{'T':>6} {'total':>6} {'/layer':>7} {'DSA/layer':>10} {'KDA/layer':>10} {'MoE/layer':>10} {'other':>6}")
    for r in rows:
        pl = r["per_layer"]
        print(
            f"{r['tokens']:>6} {r['total']:>6} {r['per_layer_all']:>7.1f} {pl['dsa']:>10.1f} {pl['kda']:>10.1f} "
            f"{pl['moe']:>10.1f} {r['by_kind'].get('other', 0):>6}"
        )
    out = {
        "label": args.label,
        "moe_path": "grouped" if args.grouped else "loop",
        "preset": "tiny",
        "backend": "torch",
        "device": "cpu",
        "recompute_chunk_tokens": args.chunk,
        "moe_chunk_tokens": args.moe_chunk,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
