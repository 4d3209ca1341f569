"""``genolong evaluate``: every held-out token's NLL with its preceding-context length.

The eval split is cut into tiles of ``L`` tokens (:class:`~genolong.data.windows.EvalTiles`: each
segment starts a tile, its last tile is shorter). The target at position ``t`` of a tile (``1 <= t
< len``) has *offset* ``t``: the bases before it in its tile, which is the preceding context a full
run gives the model. Targets that are N (or padding/special) are not scored.

``context_cut = C`` scores exactly the same targets but restarts the model every ``C`` inputs: the
inputs ``[kC, kC + C)`` of a tile run as one window ``tokens[kC : kC + C + 1]`` (windows overlap by
one token), so a target's visible *context* is ``1 .. C`` bases while its offset (and bucket) stay
those of the full run. On one model, full vs cut isolates what the context beyond ``C`` buys;
``C >= L - 1`` is the full run exactly.

Outputs (see :class:`genolong.evaluation.results.EvalResult`): per-tile x per-bucket sums, exact
per-offset sums, the bucket table with block-bootstrap CIs, and (``write_tokens``) the per-token table
as one parquet file per tile under ``tokens/``. Work happens in ``.<out>.partial`` next to ``out``;
after every tile its part file and the running sums are committed (written to a temporary name and
renamed), so a killed evaluation resumes at the next tile and ends with the same tables as an
uninterrupted one. The finished directory is renamed to ``out``.

Several processes (``evaluate(group=...)``, :mod:`genolong.evaluation.distributed`; the CLI's
``--recipe R`` / ``--set parallel.KEY=VALUE``) run the same loop: the tiles go to the data-parallel
groups a round of ``dp`` at a time, a context-parallel group scores slices of its tile, global
rank 0 gathers the per-tile NLL, writes the parts and commits the state once per round. The
tables equal the one-process ones up to float rounding (context parallelism sums in another
order); the layout is in the settings (``parallel``), so a resumed run must keep it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..config import kernel_multiple
from ..data.alphabet import BASE_MASK, SOFTMASK
from ..data.regions import Regions
from ..data.windows import EvalTiles, SplitLike, context_cut_spans
from ..errors import InputError
from ..files import replace_dir, replace_file, writes_output
from ..model.lm import GenoLM
from ..model.moe import RoutingStats, moe_layers, record_routing
from ..model.stream import check_segment_tokens
from ..model.vocab import VocabMap
from ..signals import SignalFlag
from .bootstrap import bucket_edges

# the checkpoint loaders moved to .checkpoint (below this module and .distributed); imported from here as before
from .checkpoint import load_eval_model, recipe_context, run_recipe, scoring_kernel_backend
from .distributed import (
    ScoringGroup,
    assemble_nll,
    broadcast_from_writer,
    gather_to_writer,
    padding_tile,
    share_nll,
    stop_if_signalled,
    tile_rounds,
)
from .results import EvalResult
from .tracks import chrom_sizes_from_contigs, write_result_tracks

__all__ = [
    "TOKEN_SCHEMA",
    "TileScores",
    "model_signature",
    "score_tile",
    "tile_nll",
    "tile_scores",
    "evaluate",
    "load_eval_model",
    "read_tokens",
    "recipe_context",
    "run_recipe",
    "scoring_kernel_backend",
    "kernel_backend_meta",
]

log = logging.getLogger(__name__)

#: Columns of the per-token table (``tokens/part-NNNNN.parquet``, one file per tile).
TOKEN_SCHEMA = pa.schema(
    [
        ("tile", pa.int32()),  # tile index (row of tiles.parquet)
        ("contig", pa.dictionary(pa.int32(), pa.string())),
        ("position", pa.int64()),  # 0-based genomic coordinate of the target base
        ("offset", pa.int32()),  # bases before it in its tile (bucket key)
        ("context", pa.int32()),  # bases the model saw (= offset unless context_cut)
        ("base", pa.uint8()),  # 1..4 = A, C, G, T
        ("softmask", pa.bool_()),  # lowercase (repeat-masked) in the FASTA
        ("nll", pa.float32()),  # nats
    ]
)
_ROW_GROUP = 1 << 20
_STATE = "state.npz"
_SETTINGS = "settings.json"


@dataclass(frozen=True)
class TileScores:
    """The scored targets of one tile (counted targets only), all ``[n]``.

    Attributes:
        offset: bases before the target in its tile (int64).
        context: bases the model saw (int64).
        base: target base id 1..4 (uint8).
        softmask: the target is soft-masked (bool).
        nll: NLL in nats (float32).
    """

    offset: np.ndarray
    context: np.ndarray
    base: np.ndarray
    softmask: np.ndarray
    nll: np.ndarray


@torch.no_grad()
def tile_nll(
    model: GenoLM,
    tokens: np.ndarray,
    context_cut: int | None = None,
    vocab: VocabMap | None = None,
    chunk_size: int = 4096,
    device: torch.device | str = "cpu",
    segment_tokens: int | None = None,
) -> np.ndarray:
    """Every target's NLL of one tile in one process: ``[T - 1]`` float32 nats (NaN: not counted);
    the arguments as :func:`score_tile`'s (a tile shorter than 2 tokens: ``[0]``, no forward)."""
    length = int(tokens.shape[0])
    if length < 2:
        return np.zeros(0, np.float32)
    ids = torch.from_numpy(np.ascontiguousarray(tokens)).long().to(device)[None]
    spans = context_cut_spans(length, context_cut)
    # the whole spans are one batch [n, C + 1] (one forward instead of n); a short last span alone
    whole = [(a, b) for a, b in spans if b - a == spans[0][1] - spans[0][0]]
    parts = [model.token_nll(torch.cat([ids[:, a:b] for a, b in whole]), chunk_size, vocab, segment_tokens).reshape(-1)]
    parts += [model.token_nll(ids[:, a:b], chunk_size, vocab, segment_tokens)[0] for a, b in spans[len(whole) :]]
    return torch.cat(parts).float().cpu().numpy()  # [T - 1]


def tile_scores(tokens: np.ndarray, nll: np.ndarray, context_cut: int | None = None) -> TileScores:
    """The counted targets of one tile from its per-target NLL.

    Args:
        tokens: ``[T]`` uint8 store tokens of the tile.
        nll: ``[T - 1]`` NLL of targets ``1 .. T - 1`` (NaN: not counted), from :func:`tile_nll` or
            assembled from context-parallel slices (:func:`genolong.evaluation.distributed.assemble_nll`).
        context_cut: the cut the NLL was scored with (sets ``context``); default None.
    """
    length = int(tokens.shape[0])
    if length < 2:
        return TileScores(*(np.zeros(0, dt) for dt in (np.int64, np.int64, np.uint8, bool, np.float32)))
    offset = np.arange(1, length, dtype=np.int64)
    context = offset if context_cut is None or context_cut >= length - 1 else (offset - 1) % context_cut + 1
    keep = ~np.isnan(nll)
    targets = tokens[1:]
    return TileScores(
        offset=offset[keep],
        context=context[keep],
        base=(targets & BASE_MASK)[keep].astype(np.uint8),
        softmask=((targets & SOFTMASK) > 0)[keep],
        nll=nll[keep].astype(np.float32),
    )


@torch.no_grad()
def score_tile(
    model: GenoLM,
    tokens: np.ndarray,
    context_cut: int | None = None,
    vocab: VocabMap | None = None,
    chunk_size: int = 4096,
    device: torch.device | str = "cpu",
    segment_tokens: int | None = None,
) -> TileScores:
    """Score one tile's targets.

    Args:
        model: the model (eval mode).
        tokens: ``[T]`` uint8 store tokens of the tile (case kept).
        context_cut: restart every this many inputs (see the module docstring); None: full context.
        vocab: base ids -> model ids (default None: nucleotide ids).
        chunk_size: LM-head rows per chunk.
        device: where the model runs.
        segment_tokens: stream each window (the tile, or each cut span) through the model this many
            tokens at a time, carrying the KDA states and DSA caches (:mod:`genolong.model.stream`;
            per-token NLL equal to the one-shot forward's up to float rounding); default None: one
            forward per window.
    """
    check_segment_tokens(segment_tokens)
    if int(tokens.shape[0]) < 2:
        return tile_scores(tokens, np.zeros(0, np.float32), context_cut)
    return tile_scores(
        tokens, tile_nll(model, tokens, context_cut, vocab, chunk_size, device, segment_tokens), context_cut
    )


def _tile_digest(contig: str, start: int, scores: TileScores) -> bytes:
    """Identity of a tile's scored tokens: where they are, their bases and offsets (not their NLL)."""
    h = hashlib.sha256(f"{contig}:{start}".encode())
    h.update(scores.offset.astype("<i8").tobytes())
    h.update(scores.base.tobytes())
    return h.digest()


@torch.no_grad()
def model_signature(model: torch.nn.Module) -> str:
    """A cheap identity of the weights: sha256 over each parameter's name, shape, dtype, sum and
    sum of squares (float64). A resumed evaluation must be of the same weights as its first part.

    A sharded model (DTensor parameters) gives the sums of its shards reduced over the mesh (a
    collective: every rank must call it), equal on every rank; they may differ from the
    one-process sums in the last bits (another summation order)."""
    from torch.distributed.tensor import DTensor

    def value(x: torch.Tensor) -> float:
        return float(x.full_tensor() if isinstance(x, DTensor) else x)

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        x = p.detach().double()
        h.update(f"{name}{tuple(p.shape)}{p.dtype}{value(x.sum()):.17g}{value(x.square().sum()):.17g}".encode())
    return h.hexdigest()


def _write_part(path: Path, tile: int, contig: str, start: int, scores: TileScores) -> None:
    n = scores.nll.shape[0]
    table = pa.table(
        {
            "tile": pa.array(np.full(n, tile, np.int32)),
            "contig": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([contig])),
            "position": pa.array(start + scores.offset),
            "offset": pa.array(scores.offset.astype(np.int32)),
            "context": pa.array(scores.context.astype(np.int32)),
            "base": pa.array(scores.base),
            "softmask": pa.array(scores.softmask),
            "nll": pa.array(scores.nll),
        },
        schema=TOKEN_SCHEMA,
    )
    replace_file(path, lambda tmp: pq.write_table(table, tmp, row_group_size=_ROW_GROUP, compression="zstd"))


def read_tokens(result_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """The per-token table of an evaluate result (all tiles, in tile order)."""
    parts = sorted((Path(result_dir) / "tokens").glob("part-*.parquet"))
    if not parts:
        raise InputError(f"{result_dir} has no per-token table (tokens/part-*.parquet); evaluate without --no-tokens")
    return pd.concat([pq.read_table(p).to_pandas() for p in parts], ignore_index=True)


class _Running:
    """Running sums of an evaluation, saved after every tile (``state.npz``); with ``n_moe``
    MoE layers of ``n_experts`` experts also the routing sums (per layer: rows per expert, router
    entropy summed over tokens, tokens). ``softmask_tokens``/``softmask_nll`` ``[W, K, 2]`` are the
    per-tile sums split by soft-mask class; ``tile_tokens``/``tile_nll`` are their sums over it."""

    def __init__(self, n_tiles: int, n_buckets: int, context: int, n_moe: int = 0, n_experts: int = 0):
        self.next_tile = 0
        self.routing_load = np.zeros((n_moe, n_experts), np.int64)
        self.routing_entropy = np.zeros(n_moe, np.float64)
        self.routing_tokens = np.zeros(n_moe, np.int64)
        self.tile_tokens = np.zeros((n_tiles, n_buckets), np.int64)
        self.tile_nll = np.zeros((n_tiles, n_buckets), np.float64)
        self.softmask_tokens = np.zeros((n_tiles, n_buckets, 2), np.int64)
        self.softmask_nll = np.zeros((n_tiles, n_buckets, 2), np.float64)
        self.position_tokens = np.zeros(context, np.int64)
        self.position_nll = np.zeros(context, np.float64)
        self.digests = np.zeros((n_tiles, 32), np.uint8)
        self.seconds = 0.0

    def save(self, path: Path) -> None:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(
                    f,
                    next_tile=self.next_tile,
                    tile_tokens=self.tile_tokens,
                    tile_nll=self.tile_nll,
                    position_tokens=self.position_tokens,
                    position_nll=self.position_nll,
                    digests=self.digests,
                    seconds=self.seconds,
                    routing_load=self.routing_load,
                    routing_entropy=self.routing_entropy,
                    routing_tokens=self.routing_tokens,
                    softmask_tokens=self.softmask_tokens,
                    softmask_nll=self.softmask_nll,
                )

        replace_file(path, write)

    def load(self, path: Path) -> None:
        with np.load(path) as z:
            if (
                z["tile_tokens"].shape != self.tile_tokens.shape
                or z["position_nll"].shape != self.position_nll.shape
                or "routing_load" not in z
                or z["routing_load"].shape != self.routing_load.shape
                or "softmask_tokens" not in z
            ):  # a state of an older genolong lacks the split
                raise InputError(f"{path} does not match this evaluation; delete {path.parent} to start over")
            self.next_tile = int(z["next_tile"])
            self.tile_tokens[:] = z["tile_tokens"]
            self.tile_nll[:] = z["tile_nll"]
            self.position_tokens[:] = z["position_tokens"]
            self.position_nll[:] = z["position_nll"]
            self.digests[:] = z["digests"]
            self.seconds = float(z["seconds"])
            self.routing_load[:] = z["routing_load"]
            self.routing_entropy[:] = z["routing_entropy"]
            self.routing_tokens[:] = z["routing_tokens"]
            self.softmask_tokens[:] = z["softmask_tokens"]
            self.softmask_nll[:] = z["softmask_nll"]

    def add_tile(self, i: int, scores: TileScores, edges: np.ndarray) -> None:
        """Set tile ``i``'s (tile, bucket, soft-mask class) sums from its scored targets and add
        them to the per-offset sums; the per-tile sums are those of the two classes (so the split
        adds up to them exactly, bit for bit)."""
        k = len(edges) - 1
        bucket = np.searchsorted(edges, scores.offset, side="right") - 1
        cell = 2 * bucket + scores.softmask.astype(np.int64)  # [bucket, class], class 1 = soft-masked
        nll64 = scores.nll.astype(np.float64)
        self.softmask_tokens[i] = np.bincount(cell, minlength=2 * k).reshape(k, 2)
        self.softmask_nll[i] = np.bincount(cell, weights=nll64, minlength=2 * k).reshape(k, 2)
        self.tile_tokens[i] = self.softmask_tokens[i].sum(axis=1)
        self.tile_nll[i] = self.softmask_nll[i, :, 0] + self.softmask_nll[i, :, 1]
        self.position_tokens += np.bincount(scores.offset, minlength=len(self.position_tokens))
        self.position_nll += np.bincount(scores.offset, weights=nll64, minlength=len(self.position_nll))

    def add_routing_arrays(self, load: np.ndarray, entropy: np.ndarray, tokens: np.ndarray) -> None:
        """Add one forward's routing statistics (:func:`_routing_arrays` of
        :func:`~genolong.model.moe.record_routing`'s totals)."""
        self.routing_load += load
        self.routing_entropy += entropy
        self.routing_tokens += tokens

    def routing_summary(self, layers: Sequence[int]) -> list[dict[str, Any]]:
        """Per MoE layer: ``layer`` (its index in the model), ``load_max_over_mean``,
        ``dead_experts``, ``router_entropy`` (mean nats per token), ``top_expert_share``, ``tokens``
        and the ``load`` (rows per expert) over the scored tiles."""
        out = []
        for j, layer in enumerate(layers):
            stats = RoutingStats(
                torch.from_numpy(self.routing_load[j]),
                torch.zeros((), dtype=torch.int64),
                torch.tensor(self.routing_entropy[j], dtype=torch.float64),
                int(self.routing_tokens[j]),
            )
            summary = stats.summary()
            out.append(
                {
                    "layer": int(layer),
                    "load_max_over_mean": summary["load_max_over_mean"],
                    "dead_experts": int((self.routing_load[j] == 0).sum()),
                    "router_entropy": summary["router_entropy"],
                    "top_expert_share": summary["top_expert_share"],
                    "tokens": int(self.routing_tokens[j]),
                    "load": self.routing_load[j].tolist(),
                }
            )
        return out


def _partial_dir(out: Path) -> Path:
    """The unfinished result directory of ``out``: committed tiles, resumed by the next run."""
    return out.with_name(f".{out.name}.partial")


# a full disk or a file-size limit: one error naming --out; the committed tiles stay for a rerun
@writes_output("out", work=_partial_dir)
def evaluate(
    model: GenoLM,
    split: SplitLike,
    out: str | os.PathLike[str],
    context: int,
    context_cut: int | None = None,
    max_tiles: int | None = None,
    first_bucket: int = 1024,
    write_tokens: bool = True,
    vocab: VocabMap | None = None,
    chunk_size: int = 4096,
    label: str | None = None,
    meta: Mapping[str, Any] | None = None,
    force: bool = False,
    progress: bool | None = None,
    segment_tokens: int | None = None,
    group: ScoringGroup | None = None,
    tracks: bool = False,
    regions: Regions | None = None,
) -> EvalResult | None:
    """Score the first ``max_tiles`` tiles of ``context`` tokens of ``split`` and write ``out``.

    Args:
        model: the model (its device and dtype are used as they are); in a multi-process job the
            model sharded over ``group``'s mesh
            (:func:`genolong.evaluation.distributed.shard_for_scoring`).
        split: the held-out split (``GenomeStore.open(path).split("eval")``).
        out: result directory (must not exist unless ``force``).
        context: tile length ``L`` (>= 2).
        context_cut: restart the model every this many inputs (default None: full context; not
            with context parallelism).
        max_tiles: tiles in order (default None: every tile of the split).
        first_bucket: upper edge of the first preceding-context bucket (default 1024).
        write_tokens: write the per-token table ``tokens/`` (default True).
        vocab: base ids -> model ids (default None: nucleotide ids).
        chunk_size: LM-head rows per chunk (default 4096).
        label: display name in tables and figures (default: ``out``'s name).
        meta: extra plain data for ``meta.json`` (checkpoint, store, split, dtype...); the settings
            that decide the scores must be in it for a resumed run to be checked against them.
        force: replace an existing ``out`` (default False).
        progress: show a progress bar (default: on a terminal).
        segment_tokens: stream each tile through the model this many tokens at a time (see
            :func:`score_tile`; recorded in the settings, so a resumed run must use the same);
            default None: one forward per tile (the only choice in a multi-process job).
        group: the multi-process job (:class:`~genolong.evaluation.distributed.ScoringGroup`):
            tile ``i`` is scored by data-parallel group ``i mod dp`` (a round of ``dp`` tiles at a
            time), a context-parallel group scores slices of its tile, global rank 0 gathers the
            per-tile arrays, writes, and commits the progress once per round; every rank must
            call this. Default None: one process. The layout is in the settings (``parallel``):
            a resumed run must use the same.
        tracks: also write the per-base loss as bigWig and bedGraph into ``out/tracks``
            (:mod:`genolong.evaluation.tracks`; needs ``write_tokens`` and a store split, whose
            contig records give the chromosome sizes); default False.
        regions: score only the tiles that share a base with these regions
            (:func:`genolong.data.regions.read_bed` against the split's contig ``name`` s; each
            tile whole, with its full context; ``max_tiles`` counts among them); recorded in the
            settings. Default None: every tile.

    Returns:
        The result, as saved in ``out`` (None on the ranks other than global rank 0).

    Raises:
        InputError: ``out`` exists (without ``force``), bad context / cut / tile count, streaming
            or a context cut where the job cannot do them.
    """
    group = group or ScoringGroup()
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if context_cut is not None and context_cut < 1:
        raise InputError(f"--context-cut must be at least 1 base, got {context_cut}")
    if max_tiles is not None and max_tiles < 1:
        raise InputError(f"--max-tiles must be at least 1, got {max_tiles}")
    check_segment_tokens(segment_tokens)
    sizes = _track_sizes(split, write_tokens) if tracks else None
    if group.distributed and segment_tokens is not None:
        raise InputError(
            "--segment-tokens streams a tile in one process; a multi-process evaluation runs each "
            "rank's share in one forward: pass --segment-tokens 0 (context parallelism splits the tile)"
        )
    if group.cp_size > 1 and context_cut is not None:
        raise InputError("--context-cut scores short windows one process can hold: evaluate it with parallel.cp: 1")
    edges = bucket_edges(context, first_bucket)
    tiles = EvalTiles(split, context)
    if regions is not None:
        frame = tiles.tiles
        tiles = tiles.select(
            regions.overlaps(
                frame["contig"].to_numpy(), frame["start"].to_numpy(), (frame["start"] + frame["length"]).to_numpy()
            )
        )
        if not len(tiles):
            raise InputError(
                f"--regions {regions.source}: no tile of the split holds a base of the regions (they "
                "fall in N gaps); give regions of the held-out chromosomes' sequence"
            )
    n_tiles = len(tiles) if max_tiles is None else min(max_tiles, len(tiles))
    settings = {
        # what the result is of; the CLI names real paths, a library caller may not have them
        "checkpoint": "(in memory)",
        "store": "(in memory)",
        "split": str(getattr(split, "name", "?")),
        **{k: v for k, v in (meta or {}).items()},
        "model_signature": model_signature(model),
        **kernel_backend_meta(model),  # GPU kernels and the torch reference differ by float rounding
        "context": int(context),
        "context_cut": None if context_cut is None else int(context_cut),
        "tiles": n_tiles,
        "bucket_edges": edges.tolist(),
        # which regions chose the tiles: a resumed run must use the same
        "regions": None
        if regions is None
        else {"path": regions.source, "bases": regions.bases, "sha256": regions.digest},
        "write_tokens": bool(write_tokens),
        "chunk_size": int(chunk_size),
        # streamed and one-shot scores differ by float rounding: a resumed run must not mix them
        "segment_tokens": None if segment_tokens is None else int(segment_tokens),
        # so do scores under another context-parallel split
        "parallel": group.layout(),
    }
    work = _partial_dir(out)
    moes = moe_layers(model)
    moe_names, moe_indices = [name for name, _, _ in moes], [index for _, index, _ in moes]
    n_experts = model.config.n_routed_experts if moe_names else 0
    running = _Running(n_tiles, len(edges) - 1, context, len(moe_names), n_experts)
    state = work / _STATE
    if group.is_writer:
        _open_work(work, settings, running)
    start = broadcast_from_writer(running.next_tile, group)
    multiple = kernel_multiple(model.config, group.cp_size)

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    bar = _progress(n_tiles, start, progress, label or out.name) if group.is_writer else None
    stop = SignalFlag()
    stop.install()
    try:
        for round_ in tile_rounds(start, n_tiles, group.dp_size):
            # a stop signal (preemption, a time limit): every rank leaves here, after the last committed round
            stop_if_signalled(stop, round_[0], n_tiles, work, device, group)
            began = time.perf_counter()
            mine = round_[group.dp_rank] if group.dp_rank < len(round_) else None
            tokens = tiles[mine].tokens if mine is not None else padding_tile(multiple)
            counted = mine is not None  # a padding forward's routing is not the tiles'
            with record_routing(model) as routing:
                if group.cp_size > 1:
                    # a short tile's padding rows are routed too (they are in its routing statistics)
                    nll = share_nll(model, tokens, group, multiple, vocab, chunk_size, device)
                elif group.distributed and tokens.shape[0] < 2:  # a forward all the same: FSDP gathers are collective
                    tile_nll(model, padding_tile(multiple), None, vocab, chunk_size, device)
                    nll, counted = np.zeros(0, np.float32), False
                else:
                    nll = tile_nll(model, tokens, context_cut, vocab, chunk_size, device, segment_tokens)
            routed = _routing_arrays(routing, moe_names, n_experts) if counted else None
            share = (mine, group.cp_rank, nll, routed)
            shares = gather_to_writer(share, group)
            if shares is None:
                continue
            for i in round_:
                tile = tiles[i]
                mine_i = sorted((s for s in shares if s[0] == i), key=lambda s: s[1])
                scores = tile_scores(tile.tokens, assemble_nll([s[2] for s in mine_i], tile.length), context_cut)
                for s in mine_i:
                    if s[3] is not None:
                        running.add_routing_arrays(*s[3])
                running.add_tile(i, scores, edges)
                running.digests[i] = np.frombuffer(_tile_digest(tile.contig, tile.start, scores), np.uint8)
                if write_tokens:
                    _write_part(work / "tokens" / f"part-{i:05d}.parquet", i, tile.contig, tile.start, scores)
            # the round is committed at once: a kill leaves the state of the last whole round
            running.next_tile = round_[-1] + 1
            running.seconds += time.perf_counter() - began
            running.save(state)
            if bar is not None:
                bar.update(len(round_))
    finally:
        stop.restore()
        model.train(was_training)
        if bar is not None:
            bar.close()
    if not group.is_writer:
        return None

    tokens_total = int(running.tile_tokens.sum())
    result = EvalResult(
        meta={
            "format": "genolong-eval/1",
            "label": label or out.name,
            **settings,
            "tokens": tokens_total,
            "nll_sum": float(running.tile_nll.sum()),
            "fingerprint": hashlib.sha256(running.digests.tobytes()).hexdigest(),
            "seconds": running.seconds,
            "tokens_per_second": tokens_total / running.seconds if running.seconds > 0 else None,
            "routing": running.routing_summary(moe_indices),
        },
        tiles=tiles.tiles.iloc[:n_tiles].reset_index(names="tile")[["tile", "contig", "start", "length"]],
        tile_tokens=running.tile_tokens,
        tile_nll=running.tile_nll,
        position_tokens=running.position_tokens,
        position_nll=running.position_nll,
        softmask_tokens=running.softmask_tokens,
        softmask_nll=running.softmask_nll,
    )
    result.save(work)
    if sizes is not None:  # before the state goes: a kill while writing them resumes here
        write_result_tracks(work, result, sizes)
    (work / _STATE).unlink()
    (work / _SETTINGS).unlink()
    if not write_tokens:
        (work / "tokens").rmdir()
    replace_dir(work, out)
    return result


def _track_sizes(split: SplitLike, write_tokens: bool) -> dict[str, int]:
    """The chromosome sizes ``evaluate(tracks=True)`` writes its tracks with (checked before scoring)."""
    if not write_tokens:
        raise InputError("--tracks are drawn from the per-token table: drop --no-tokens, or drop --tracks")
    contigs = getattr(split, "contigs", None)
    if contigs is None:
        raise InputError(
            "--tracks need the chromosome sizes of a genome store's split (GenomeStore.open(DIR).split(NAME)); "
            "evaluate such a split, or write the tracks later with `genolong tracks RESULT --chrom-sizes FILE`"
        )
    return chrom_sizes_from_contigs(contigs, f"split {getattr(split, 'name', '?')!r}")


def _open_work(work: Path, settings: Mapping[str, Any], running: _Running) -> None:
    """Resume the unfinished evaluation in ``work`` if it has the same ``settings`` (``running`` is
    loaded), else start it afresh; parts after the last committed state are removed."""
    state = work / _STATE
    if (work / _SETTINGS).is_file() and json.loads((work / _SETTINGS).read_text()) == settings and state.is_file():
        running.load(state)
        log.info("resuming the evaluation in %s at tile %d of %d", work, running.next_tile, len(running.tile_tokens))
    else:
        if work.exists():
            log.info("discarding an unfinished evaluation with other settings in %s", work)
            shutil.rmtree(work)
        (work / "tokens").mkdir(parents=True)
        replace_file(work / _SETTINGS, lambda tmp: tmp.write_text(json.dumps(settings, indent=1)))
    for entry in (work / "tokens").iterdir():  # a part (or its temporary file) after the last committed state
        part = re.fullmatch(r"part-(\d{5})\.parquet", entry.name)
        if part is None or int(part.group(1)) >= running.next_tile:
            entry.unlink()


def _routing_arrays(
    totals: Mapping[str, RoutingStats], names: Sequence[str], n_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One forward's routing statistics as arrays over the MoE layers ``names``: rows per expert
    ``[n, E]`` int64, router entropy summed over tokens ``[n]`` float64, tokens ``[n]`` int64."""
    load = np.zeros((len(names), n_experts), np.int64)
    entropy = np.zeros(len(names), np.float64)
    count = np.zeros(len(names), np.int64)
    for j, name in enumerate(names):
        if name in totals:
            load[j] = totals[name].load.cpu().numpy()
            entropy[j] = float(totals[name].entropy)
            count[j] = totals[name].tokens
    return load, entropy, count


def _progress(
    total: int, done: int, enabled: bool | None, desc: str, command: str = "evaluate", unit: str = "tile"
) -> Any:
    """A tqdm bar of ``total`` units starting at ``done`` (None when ``enabled`` is False, or None
    and stderr is not a terminal); ``evaluate``, ``probe`` and ``variants`` share it."""
    import sys

    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=f"{command} {desc}", unit=unit, leave=True)


def kernel_backend_meta(model: torch.nn.Module) -> dict[str, str]:
    """What a result records of the kernels that scored it: ``{"kernel_backend": the model's
    configured name (e.g. "auto"), "kernel_backend_resolved": the backend it runs here}``."""
    from ..kernels.backends import get_backend

    name = str(getattr(getattr(model, "config", None), "kernel_backend", "torch"))
    return {"kernel_backend": name, "kernel_backend_resolved": get_backend(name).name}
