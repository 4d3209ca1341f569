#!/usr/bin/env python
"""How many training tokens before a model learns to copy: the doubled-window task, side by side at two lengths.

Issue 29 asks for a bundled base that reads far back. The cheapest form of that skill is copying
(an "induction" circuit: find the earlier occurrence of the last few bases, read what came next).
This benchmark measures how fast the ``small`` preset acquires it on real human DNA when copying is
the whole reward: every training window is a doubled window ``[R | R']`` of ``2H`` bases, where
``R`` is ``H`` bases of the bundled sample's training split (either strand) and ``R'`` is ``R``
again with a share ``--divergence`` of its bases substituted (0: exact copies). A model that copies
predicts ``R'`` almost perfectly; one that does not sees ordinary DNA (~1.33 nats per base).

Each configuration (``--halves``: one ``H`` per run) trains in its own process, one torch thread,
side by side, with the same tokens per step (``--tokens-per-step``: ``batch = tokens / 2H``), the
same seed, optimiser (AdamW, 20 warm-up steps, constant learning rate) and steps. Every
``--eval-every`` steps it scores ``--eval-tiles`` held-out tiles of ``2H`` bases of the sample's
chr22 (no N) twice: as stored, ``[R | S]``, and doubled, ``[S | S]``; the copy gain is the mean
NLL of ``S`` after ``R`` minus after ``S`` (same bases at the same positions, only the preceding
half differs), in nats per base, with a paired 95% bootstrap interval over tiles. A gain near
the loss itself (~1.3) is a copying model; ~0 is none.

Usage (the defaults take about 40 minutes on 2 cores)::

    python experiments/bundled-base/copy_emergence.py
    python experiments/bundled-base/copy_emergence.py --halves 32,128 --steps 300 --divergence 0.05
    python experiments/bundled-base/copy_emergence.py --halves 32 --steps 800 --freeze 'layers.[01456].self_attn.*'

``--freeze GLOB`` keeps the matching parameters at their initial values; ``--silence 0,1,4,5,6``
zeroes those layers' token mixers for the whole run. With them the question becomes which copying
the other layers learn when the KDA layers cannot (``small``: a DSA induction circuit, see
LOG.md).

Prints a table and writes JSON (default experiments/bundled-base/results/copy_emergence.json).
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
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import Fresh, environment, sample_store, wait_any, write_json  # noqa: E402

from genolong.data.alphabet import BASE_MASK, A, T  # noqa: E402

DEFAULT_JSON = HERE / "results" / "copy_emergence.json"


def doubled(tokens: np.ndarray, half: int, divergence: float, rng: np.random.Generator) -> np.ndarray:
    """``tokens [>= 2 * half]`` uint8 store tokens -> ``[2 * half]``: the first ``half`` bases, then
    them again with each base substituted (by a uniformly drawn other A/C/G/T, case kept) with
    probability ``divergence``."""
    first = np.asarray(tokens[:half], dtype=np.uint8)
    copy = first.copy()
    hit = np.flatnonzero(rng.random(half) < divergence)
    if hit.size:
        base = copy[hit] & BASE_MASK
        shift = rng.integers(1, 4, hit.size).astype(np.uint8)  # 1-3 steps round A,C,G,T: another base
        new = np.where((base >= A) & (base <= T), (base - A + shift) % 4 + A, base).astype(np.uint8)
        copy[hit] = (copy[hit] & np.uint8(0xFF ^ BASE_MASK)) | new
    return np.concatenate([first, copy])


def heldout_pairs(store: Path, half: int, n_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """``n_tiles`` held-out chr22 tiles of ``2 * half`` bases with no N, spread evenly over the eval
    split: (stored ``[n, 2H]``, doubled-second-half ``[n, 2H]``) uint8."""
    from genolong.data.store import GenomeStore
    from genolong.data.windows import EvalTiles

    split = GenomeStore.open(store).split("eval")
    tokens = np.asarray(split.tokens[:])  # the whole split (1 MB for the sample): one read, not one per tile
    tiles = EvalTiles(split, 2 * half).tiles
    starts = tiles.offset.to_numpy()[tiles.length.to_numpy() == 2 * half]
    windows = tokens[starts[:, None] + np.arange(2 * half)]  # [n_whole, 2H]
    bases = windows & BASE_MASK
    clean = starts[np.all((bases >= A) & (bases <= T), axis=1)]
    pick = clean[np.linspace(0, len(clean) - 1, n_tiles).astype(np.int64)]
    stored = tokens[pick[:, None] + np.arange(2 * half)]
    second = stored[:, half:]
    return stored, np.concatenate([second, second], axis=1)


def silence_output(module: Any, inputs: Any, output: Any) -> Any:
    """A forward hook that zeroes a token mixer's output (``layers[i].self_attn``): the layer's
    residual stream and feed-forward network still run. A DSA mixer returns ``(out, selected
    indices)``; the indices are kept because a shared-indexer layer after it reads them."""
    if isinstance(output, tuple):
        return (output[0] * 0, *output[1:])
    return output * 0


def copy_gain(model: Any, pairs: tuple[np.ndarray, np.ndarray], length: int) -> dict[str, float]:
    """The paired copy gain of ``length``-base halves on held-out ``pairs`` (see the module docstring).

    Args:
        model: a :class:`~genolong.model.GenoLM`; scored in eval mode (left there: a training
            caller switches back).
        pairs: :func:`heldout_pairs`' ``(stored [n, 2H], doubled [n, 2H])`` uint8 tokens.
        length: ``H``.

    Returns:
        ``after_other`` and ``after_copy`` (mean NLL of the second half, nats per base), ``gain``
        (their difference) and its paired 95% bootstrap interval over tiles ``gain_lo``, ``gain_hi``.
    """
    import torch

    from genolong.evaluation.bootstrap import paired_bootstrap

    held, copy = pairs
    model.eval()
    targets = slice(length - 1, 2 * length - 1)  # token_nll[i] predicts token i + 1: the second half
    # token_nll runs without gradient; 8 tiles a forward
    a = torch.cat([model.token_nll(torch.from_numpy(copy[i : i + 8]).long()) for i in range(0, len(copy), 8)])
    b = torch.cat([model.token_nll(torch.from_numpy(held[i : i + 8]).long()) for i in range(0, len(held), 8)])
    a, b = a[:, targets].numpy().astype(np.float64), b[:, targets].numpy().astype(np.float64)
    counted = ~np.isnan(a) & ~np.isnan(b)
    tokens = counted.sum(1, keepdims=True).astype(np.float64)
    ci = paired_bootstrap(
        tokens,
        np.where(counted, a, 0).sum(1, keepdims=True),
        tokens,
        np.where(counted, b, 0).sum(1, keepdims=True),
        n_boot=2000,
        seed=0,
    )
    return {
        "after_other": float(ci.b_mean[0]),
        "after_copy": float(ci.a_mean[0]),
        "gain": float(ci.diff[0]),
        "gain_lo": float(ci.diff_lo[0]),
        "gain_hi": float(ci.diff_hi[0]),
    }


def worker(args: argparse.Namespace) -> None:
    """One configuration: train on doubled windows and print the copy-gain curve as a JSON line."""
    import torch

    from genolong.data.store import GenomeStore
    from genolong.data.windows import TrainWindows
    from genolong.model import GenoLM
    from genolong.model.config import PRESETS
    from genolong.train.module import freeze_parameters

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    half = args.half
    batch = max(1, args.tokens_per_step // (2 * half))
    model = GenoLM(PRESETS[args.preset]) if args.init == "fresh" else GenoLM.from_pretrained(args.init)
    if args.freeze:
        freeze_parameters(model, args.freeze)
    if any(not 0 <= i < len(model.layers) for i in args.silence):
        sys.exit(
            f"--silence {','.join(map(str, args.silence))}: the model has layers 0-{len(model.layers) - 1}; "
            "name the layers whose mixer to silence, e.g. 0,1,4,5,6"
        )
    for i in args.silence:  # for the whole run, training and scoring: the other layers must copy without them
        model.layers[i].self_attn.register_forward_hook(silence_output)
        model.layers[i].self_attn.requires_grad_(False)  # no gradient reaches it; nor should weight decay
    windows = TrainWindows(GenomeStore.open(args.store).split("train"), 2 * half, seed=args.seed, rc_prob=0.5)
    rng = np.random.default_rng([args.seed, half])
    stored, copied = heldout_pairs(args.store, half, args.eval_tiles)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))

    def evaluate(step: int, seconds: float) -> dict[str, Any]:
        row = {
            "half": half,
            "step": step,
            "tokens": step * batch * 2 * half,
            "train_s": round(seconds, 1),
            **copy_gain(model, (stored, copied), half),
        }
        model.train()
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    curve = [evaluate(0, 0.0)]
    seconds = 0.0
    for step in range(1, args.steps + 1):
        t0 = time.process_time()
        x = np.stack(
            [doubled(windows.window((step - 1) * batch + b).tokens, half, args.divergence, rng) for b in range(batch)]
        )
        nll, weight = model.loss(torch.from_numpy(x).long())
        optimizer.zero_grad(set_to_none=True)
        (nll / weight).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        seconds += time.process_time() - t0
        if step % args.eval_every == 0 or step == args.steps:
            curve.append(evaluate(step, seconds))
    # does the copying learned at H reach further back? the final model on longer (and shorter) halves
    reach = {}
    for length in args.reach:
        reach[str(length)] = copy_gain(model, heldout_pairs(args.store, length, args.reach_tiles), length)
        print(json.dumps({"half": half, "reach": length, **reach[str(length)]}), file=sys.stderr, flush=True)
    if args.save is not None:
        model.save_pretrained(args.save / f"h{half}")
    print(json.dumps({"half": half, "batch": batch, "curve": curve, "reach": reach}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--halves", default="32,128", help="copy lengths H, comma-separated: one run each (window 2H)")
    p.add_argument(
        "--tokens-per-step", type=int, default=1024, help="tokens per optimiser step in every run (default 1024)"
    )
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--divergence", type=float, default=0.0, help="share of the copy's bases substituted (default 0)")
    p.add_argument("--preset", default="small")
    p.add_argument("--init", default="fresh", help="'fresh' (default) or a checkpoint directory")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-tiles", type=int, default=64)
    p.add_argument(
        "--reach",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[32, 128, 512, 2048],
        help="after training, the copy gain at these halves H (comma-separated; default 32,128,512,2048)",
    )
    p.add_argument("--reach-tiles", type=int, default=16, help="held-out tiles per --reach length (default 16)")
    p.add_argument(
        "--freeze",
        action="append",
        default=[],
        help="train with the parameters matching this glob frozen (repeatable), e.g. 'layers.0.self_attn.*'",
    )
    p.add_argument(
        "--silence",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="layers whose token mixer is silenced (output zeroed) for the whole run, training and scoring, "
        "e.g. 0,1,4,5,6 (the KDA layers of small): which copying the others learn alone",
    )
    p.add_argument(
        "--save",
        type=Path,
        default=None,
        help="keep each run's final model here (DIR/hH, a checkpoint for genolong probe)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="the sample store (default: prepare the bundled sample in a temporary directory)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--half", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    halves = [int(h) for h in args.halves.split(",")]
    if any(h < 8 or (2 * h) % 64 for h in halves):
        sys.exit(
            f"--halves {args.halves}: each H must make a window 2H that is a multiple of 64 (the KDA chunk), e.g. 32,128"
        )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = sample_store(args.store, work)
        started = []
        for h in halves:
            cmd = [sys.executable, __file__, "--worker", "--half", str(h), "--store", str(store), *_forward(args)]
            started.append(Fresh.start(cmd, env=env, log=work / f"h{h}.log", half=h))
        results: dict[int, Any] = {}
        for child, figures in wait_any(started):
            figures.check()
            results[child.extra["half"]] = {
                **figures.last_json(),
                "cpu_s": figures.user_s + figures.system_s,
                "wall_s": figures.wall_s,
                "peak_rss_bytes": figures.peak_rss_bytes,
            }
    print(
        f"{args.preset} ({args.init}), {args.steps} steps of {args.tokens_per_step} tokens, lr {args.lr}, "
        f"copies diverged {args.divergence}"
        + (f", frozen {' '.join(args.freeze)}" if args.freeze else "")
        + (f", mixers of layers {','.join(map(str, args.silence))} silenced" if args.silence else "")
        + f"; copy gain on {args.eval_tiles} held-out chr22 tiles (nats per base, 95% CI)"
    )
    print(f"{'H':>5} {'batch':>5} {'step':>5} {'tokens':>9} {'after other':>11} {'after copy':>10}  gain [95% CI]")
    for h in halves:
        r = results[h]
        for row in r["curve"]:
            print(
                f"{h:>5} {r['batch']:>5} {row['step']:>5} {row['tokens']:>9,} {row['after_other']:>11.4f} "
                f"{row['after_copy']:>10.4f}  {row['gain']:+.4f} [{row['gain_lo']:+.4f}, {row['gain_hi']:+.4f}]"
            )
    print(f"reach: the final models' copy gain at other halves ({args.reach_tiles} held-out tiles each)")
    print(f"{'trained H':>9} " + " ".join(f"{'H=' + str(length):>26}" for length in args.reach))
    for h in halves:
        cells = [results[h]["reach"][str(length)] for length in args.reach]
        print(f"{h:>9} " + " ".join(f"{c['gain']:+.4f} [{c['gain_lo']:+.4f}, {c['gain_hi']:+.4f}]" for c in cells))
    write_json(
        args.json,
        {
            "environment": environment(),
            "preset": args.preset,
            "init": args.init,
            "steps": args.steps,
            "tokens_per_step": args.tokens_per_step,
            "lr": args.lr,
            "divergence": args.divergence,
            "seed": args.seed,
            "freeze": args.freeze,
            "silence": args.silence,
            "eval_tiles": args.eval_tiles,
            "reach_tiles": args.reach_tiles,
            "runs": {str(h): results[h] for h in halves},
        },
    )


def _forward(args: argparse.Namespace) -> list[str]:
    """The options every worker shares, as command-line arguments."""
    return [
        "--tokens-per-step",
        str(args.tokens_per_step),
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
        "--divergence",
        str(args.divergence),
        "--preset",
        args.preset,
        "--init",
        args.init,
        "--eval-every",
        str(args.eval_every),
        "--eval-tiles",
        str(args.eval_tiles),
        "--seed",
        str(args.seed),
        "--reach",
        ",".join(map(str, args.reach)),
        "--reach-tiles",
        str(args.reach_tiles),
        "--silence",
        ",".join(map(str, args.silence)),
        *(f"--freeze={g}" for g in args.freeze),
        *(["--save", str(args.save)] if args.save is not None else []),
    ]


if __name__ == "__main__":
    main()
