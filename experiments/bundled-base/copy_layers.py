#!/usr/bin/env python
"""Which layers copy: a model's copy gain with each layer's token mixer silenced in turn.

``experiments/bundled-base/copy_emergence.py`` measures whether a model copies (the copy gain of doubled
held-out windows ``[S | S]`` against ``[R | S]``); this asks where. For a saved model (a
``--save`` directory of copy_emergence, a run's ``export/`` or the bundled base) it scores the copy
gain at each ``--halves`` length ``H`` on the same held-out chr22 pairs, first intact, then with
one layer's mixer (KDA or DSA: ``layers[i].self_attn``) contributing nothing, layer by layer: the
mixer's output is zeroed by a forward hook, so the residual streams and the feed-forward network
of that layer still run. A layer whose silencing removes the gain is one the copying needs. This
matters for issue 29: a KDA layer's delta-rule memory is a fixed-size state with a learned decay,
DSA's attention reads every selected key exactly, and only the second can recall a copy thousands
of bases back in a model this small.

Usage::

    python experiments/bundled-base/copy_emergence.py --steps 800 --save /tmp/copy   # the H = 32 copy model
    python experiments/bundled-base/copy_layers.py /tmp/copy/h32 --halves 32,128

Prints a table and writes JSON (default experiments/bundled-base/results/copy_layers.json).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import environment, sample_store, write_json  # noqa: E402
from copy_emergence import copy_gain, heldout_pairs, silence_output  # noqa: E402

DEFAULT_JSON = HERE / "results" / "copy_layers.json"


def silenced_gains(model: Any, pairs: Any, length: int) -> list[dict[str, Any]]:
    """The copy gain of ``model`` at halves of ``length`` intact (``layer`` None) and with each
    layer's mixer output zeroed in turn (``layer`` i, ``mixer`` its type), on the same ``pairs``
    (:func:`copy_emergence.heldout_pairs`). Each row: :func:`copy_emergence.copy_gain`'s figures."""
    rows = [{"layer": None, "mixer": None, **copy_gain(model, pairs, length)}]
    for i, block in enumerate(model.layers):
        hook = block.self_attn.register_forward_hook(silence_output)
        try:
            rows.append({"layer": i, "mixer": model.config.layer_types[i], **copy_gain(model, pairs, length)})
        finally:
            hook.remove()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a model directory (config.json + safetensors)")
    p.add_argument("--halves", default="32,128", help="copy lengths H, comma-separated (default %(default)s)")
    p.add_argument("--tiles", type=int, default=32, help="held-out tiles of 2H per length (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="the sample store (default: prepare the bundled sample in a temporary directory)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    halves = [int(h) for h in args.halves.split(",")]

    import torch

    from genolong.model import GenoLM

    torch.set_num_threads(args.threads)
    model = GenoLM.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        store = sample_store(args.store, Path(tmp))
        results = {str(h): silenced_gains(model, heldout_pairs(store, h, args.tiles), h) for h in halves}
    print(
        f"{args.model}: copy gain on {args.tiles} held-out chr22 tiles per H, with one layer's mixer silenced "
        "(nats per base, 95% CI)"
    )
    print(f"{'silenced':>22} " + " ".join(f"{'H=' + str(h):>26}" for h in halves))
    for k, row in enumerate(results[str(halves[0])]):
        name = "none" if row["layer"] is None else f"{row['layer']} {row['mixer']}"
        cells = [results[str(h)][k] for h in halves]
        print(f"{name:>22} " + " ".join(f"{c['gain']:+.4f} [{c['gain_lo']:+.4f}, {c['gain_hi']:+.4f}]" for c in cells))
    write_json(
        args.json,
        {
            "environment": environment(),
            "model": str(args.model),
            "tiles": args.tiles,
            "halves": halves,
            "gains": results,
        },
    )


if __name__ == "__main__":
    main()
