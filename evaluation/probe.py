"""``genolong probe``: planted-repeat recall, distance by distance, up to the full context.

Held-out loss mixes how well a model predicts DNA with whether it uses what lies far back. The
probe measures the second alone. On a held-out tile of ``L`` bases the last ``m`` bases (the
*copy*, ``m = repeat_bases``, default 100) are overwritten with the ``m`` bases that start ``d``
bases earlier (the *source*, a held-out segment of the same tile), for ``d`` in powers of two with
``m < d <= L - m``: every copied base then has its twin exactly ``d`` bases back. The copy's ``m``
targets are scored twice on one model:

- **full view**: the whole planted tile before each target is in view (``s + j`` bases for the
  copy's ``j``-th target, ``s = L - m``), the source included;
- **cut view**: the model restarted ``d - 1`` bases before the copy's end, i.e. the window
  ``[L - d, L)`` (the ``--context-cut`` machinery: exactly what
  :func:`~genolong.evaluation.score.score_tile` with ``context_cut = d - 1`` gives these targets
  when its span grid ends at the tile's end, see :func:`cut_view_span`). Target ``j`` sees
  ``d - m + j`` bases, always fewer than ``d``: no base of the source is in view.

The **drop** is ``cut - full`` (nats per base, mean over the copy's counted targets): how much the
source, ``d`` bases back, lowers the loss of its copy. A model that recalls at distance ``d`` has
a drop near the loss of the sequence itself (up to ~1.39 nats on random DNA); a model that cannot
reach back ``d`` has a drop near zero (what remains is what the ``d - m .. d - 1`` nearest bases
leave unexplained about the far context in general, small on natural DNA). Intervals: paired
block bootstrap over tiles (:func:`~genolong.evaluation.stats.paired_bootstrap`; tokens inside a
tile are dependent, both views resampled with the same tiles).

Structure: :func:`probe_tile` is one process's per-tile work, a pure function of (model, tile
tokens, :class:`ProbeSettings`) -> :class:`ProbeTileScores` (``[D]`` arrays); in a multi-process job
(``evaluate``'s launches and mesh, :mod:`genolong.evaluation.distributed`) each rank computes its
:func:`probe_share` of its data-parallel group's tile and the writer assembles them
(:func:`assemble_probe_shares`); :func:`probe` is the loop (tiles dealt a round at a time, commits
in ``.<out>.partial``, the result directory, written by one process).

Result directory (format ``genolong-probe/1``): ``meta.json`` (settings, tiles, distances, the
model signature, seconds), ``tiles.parquet`` (tile, contig, start, length, eval_tile: the index
in :class:`~genolong.data.windows.EvalTiles`), ``probe_tiles.parquet`` (dense ``W x D`` rows:
tile, distance, tokens, full_nll, cut_nll), ``probe.csv`` and ``probe.json`` (the table of
:meth:`ProbeResult.table`), ``probe.png`` / ``probe.pdf`` (the figure). :class:`ProbeResult`
lives in :mod:`genolong.evaluation.probe_result` (torch-free, read by the figures) and is
re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..data.windows import EvalTiles, SplitLike
from ..errors import InputError
from ..files import replace_dir, replace_file, writes_output
from ..model.loss import model_inputs, next_token_nll
from ..model.stream import PrefillStream, check_segment_tokens
from ..model.vocab import VocabMap
from ..signals import SignalFlag
from .distributed import ScoringGroup
from .probe_result import PROBE_COLUMNS, PROBE_FORMAT, ProbeResult  # the saved result (re-exported here)

__all__ = [
    "PROBE_FORMAT",
    "PROBE_COLUMNS",
    "ProbeSettings",
    "ProbeTileScores",
    "ProbeResult",
    "probe_distances",
    "plant_repeat",
    "cut_view_span",
    "probe_views",
    "probe_tile",
    "probe_share",
    "assemble_probe_shares",
    "probe",
]

log = logging.getLogger(__name__)

_STATE = "state.npz"
_SETTINGS = "settings.json"


def probe_distances(context: int, repeat_bases: int) -> list[int]:
    """The default distances for tiles of ``context`` bases and a copy of ``repeat_bases``: the
    powers of two ``d`` with ``repeat_bases < d <= context - repeat_bases`` (source and copy do not
    overlap, and the source lies inside the tile).

    Raises:
        InputError: no power of two fits (``context`` below about ``4 * repeat_bases``).
    """
    _check_repeat(repeat_bases)
    out, d = [], 2
    while d <= context - repeat_bases:
        if d > repeat_bases:
            out.append(d)
        d *= 2
    if not out:
        raise InputError(
            f"no power-of-two distance d with {repeat_bases} < d <= {context} - {repeat_bases} fits a tile of "
            f"--context {context}; raise --context or lower --repeat-bases"
        )
    return out


def _check_repeat(repeat_bases: int) -> None:
    if isinstance(repeat_bases, bool) or not isinstance(repeat_bases, (int, np.integer)) or repeat_bases < 1:
        raise InputError(f"--repeat-bases must be a positive number of bases (e.g. 100), got {repeat_bases!r}")


@dataclass(frozen=True)
class ProbeSettings:
    """What decides a probe's scores (a resumed run must use the same).

    Attributes:
        context: tile length ``L`` in bases.
        repeat_bases: ``m``, bases copied (default 100).
        distances: the distances ``d`` (default: :func:`probe_distances`); each ``m < d <= L - m``.
        chunk_size: LM-head rows per chunk (default 4096).
        segment_tokens: stream the full view's prefix and each cut window this many tokens at a
            time (:mod:`genolong.model.stream`); default None: one forward each.
    """

    context: int
    repeat_bases: int = 100
    distances: tuple[int, ...] = ()
    chunk_size: int = 4096
    segment_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_repeat(self.repeat_bases)
        check_segment_tokens(self.segment_tokens)
        if int(self.context) < 2 * self.repeat_bases + 2:
            raise InputError(
                f"--context {self.context} is too short for a copy of --repeat-bases {self.repeat_bases} "
                f"(needs at least {2 * self.repeat_bases + 2})"
            )
        distances = tuple(int(d) for d in self.distances) or tuple(probe_distances(self.context, self.repeat_bases))
        bad = [d for d in distances if not self.repeat_bases < d <= self.context - self.repeat_bases]
        if bad:
            raise InputError(
                f"--distances {bad} out of range: each must satisfy {self.repeat_bases} < d <= "
                f"{self.context - self.repeat_bases} (--repeat-bases < d <= --context - --repeat-bases)"
            )
        if len(set(distances)) != len(distances) or list(distances) != sorted(distances):
            raise InputError(f"--distances must be increasing and distinct, got {list(distances)}")
        object.__setattr__(self, "context", int(self.context))
        object.__setattr__(self, "distances", distances)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for ``settings.json`` / ``meta.json``)."""
        return {
            f.name: (list(getattr(self, f.name)) if f.name == "distances" else getattr(self, f.name))
            for f in fields(self)
        }


@dataclass(frozen=True)
class ProbeTileScores:
    """One tile's probe: per distance (``[D]``, in the order of ``ProbeSettings.distances``).

    Attributes:
        tokens: counted targets of the copy (int64; ``m`` unless the source has N bases).
        full_nll: summed NLL (nats, float64) of those targets with the source in view.
        cut_nll: summed NLL (nats, float64) of the same targets in the cut view.
    """

    tokens: np.ndarray
    full_nll: np.ndarray
    cut_nll: np.ndarray


def plant_repeat(tokens: np.ndarray, distance: int, repeat_bases: int) -> np.ndarray:
    """A copy of ``tokens [L]`` whose last ``m`` bases are replaced by the ``m`` bases starting
    ``distance`` bases before them: ``out[L - m + j] = tokens[L - m - d + j]`` (case kept)."""
    length, m, d = int(tokens.shape[0]), int(repeat_bases), int(distance)
    s = length - m
    if not (m < d <= s):
        raise InputError(f"distance {d} does not fit: need {m} < d <= {s} for a tile of {length} and a copy of {m}")
    out = np.array(tokens, copy=True)
    out[s:] = tokens[s - d : s - d + m]
    return out


def cut_view_span(length: int, distance: int) -> tuple[int, int]:
    """The cut view's window ``[start, length)`` of a planted tile: ``start = length - distance``
    (``distance`` tokens, so the copy's last target sees ``distance - 1`` bases).

    It is the last span of :func:`~genolong.data.windows.context_cut_spans` with ``cut = d - 1`` on
    the tile's tail ``[off, length)`` for ``off = (length - 1) % (d - 1)``: there the spans
    ``[k (d - 1), ...)`` end at the tile's end, so ``score_tile(tile[off:], context_cut=d - 1)``
    scores the copy exactly as this window does (tests/evaluation/test_probe.py checks it).
    """
    return int(length) - int(distance), int(length)


def _repeat_state(stream: PrefillStream, n: int) -> None:
    """Turn a batch-1 :class:`PrefillStream` into ``n`` identical rows (each continued with its own
    tokens afterwards): every carried tensor (KDA states and conv tails, DSA latents, pooled keys
    and pending rows) is repeated along its batch dimension."""
    for state in stream.layers:
        for f in fields(state):
            value = getattr(state, f.name)
            if isinstance(value, torch.Tensor):
                assert value.shape[0] == 1, f"{type(state).__name__}.{f.name} is not batch-1: {tuple(value.shape)}"
                setattr(state, f.name, value.expand(n, *value.shape[1:]).clone())


@torch.no_grad()
def probe_views(
    model: torch.nn.Module,
    tokens: np.ndarray,
    settings: ProbeSettings,
    vocab: VocabMap | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target NLL of the copy in both views, at every distance of ``settings``.

    The full views share the tile's first ``L - m`` bases, so the prefix runs once through a
    :class:`~genolong.model.stream.PrefillStream` and its carried state continues with the ``D``
    copies as one batch (per-token NLL equal to one forward of each planted tile up to float
    rounding; tests/evaluation/test_probe.py compares). Each cut view is one forward of its ``d``-token window
    (:func:`cut_view_span`). Work per tile: ``L + D m`` tokens (full) plus ``sum(d) < 2 L`` (cut).

    Args:
        model: a :class:`~genolong.model.lm.GenoLM` in eval mode.
        tokens: ``[L]`` uint8 store tokens of the tile (case kept), ``L = settings.context``.
        settings: repeat length, distances, chunking.
        vocab: base ids -> model ids (default None: nucleotide ids).
        device: where the model runs.

    Returns:
        ``(full, cut)``, each ``[D, m]`` float32 nats on the CPU: entry ``[i, j]`` is the NLL of the
        copy's ``j``-th base (tile position ``L - m + j``) at distance ``distances[i]``; NaN where
        the target does not count (N).

    Raises:
        InputError: the tile is not ``settings.context`` long.
    """
    length, m = int(tokens.shape[0]), settings.repeat_bases
    if length != settings.context:
        raise InputError(f"the probe needs tiles of exactly {settings.context} bases, got {length}")
    distances = settings.distances
    n_dist, s = len(distances), length - m
    planted = np.stack([plant_repeat(tokens, d, m) for d in distances])  # [D, L]
    ids = torch.from_numpy(planted).long().to(device)  # store tokens, case kept
    inputs = model_inputs(ids) if vocab is None else vocab.to_model(ids)
    head = model.lm_head.weight
    seg = settings.segment_tokens or s

    # full view: the prefix [0, s) is the same in every planted tile
    stream = PrefillStream(model, batch_size=1, capacity=length)
    last = None
    for a in range(0, s, seg):
        last = stream.extend(inputs[:1, a : min(a + seg, s)])
    assert last is not None
    rows = [last[:, -1:].expand(n_dist, 1, last.shape[-1])]  # [D, 1, H]: predicts the copy's first base
    if m > 1:
        _repeat_state(stream, n_dist)
        rows.append(stream.extend(inputs[:, s : length - 1]))  # [D, m - 1, H]: predict the copy's bases 1..m-1
    rows.append(torch.zeros_like(rows[0]))  # a dummy last row: next_token_nll scores rows [:-1]
    full = next_token_nll(torch.cat(rows, dim=1), head, ids[:, s - 1 :], settings.chunk_size, vocab)  # [D, m]

    # cut view: each planted tile restarted d - 1 bases before its end
    cut = torch.empty_like(full)
    for i, d in enumerate(distances):
        a, b = cut_view_span(length, d)
        cut[i] = model.token_nll(ids[i : i + 1, a:b], settings.chunk_size, vocab, settings.segment_tokens)[0, -m:]
    return full.cpu(), cut.cpu()


def probe_tile(
    model: torch.nn.Module,
    tokens: np.ndarray,
    settings: ProbeSettings,
    vocab: VocabMap | None = None,
    device: torch.device | str = "cpu",
) -> ProbeTileScores:
    """Probe one tile at every distance of ``settings``: :func:`probe_views` summed over the copy's
    counted targets. The per-tile unit of work of :func:`probe` (a pure function of its arguments,
    so tiles can be dealt to processes and their ``[D]`` arrays gathered).

    Args:
        model, tokens, settings, vocab, device: as :func:`probe_views`.

    Returns:
        :class:`ProbeTileScores` of ``[D]`` arrays.
    """
    full, cut = probe_views(model, tokens, settings, vocab, device)
    return _summed(full.double().numpy(), cut.double().numpy())


def _summed(full64: np.ndarray, cut64: np.ndarray) -> ProbeTileScores:
    """:class:`ProbeTileScores` of the copy's per-target NLL in both views (``[D, m]`` each, NaN:
    not counted)."""
    counted = ~np.isnan(full64)
    # NaN marks an uncounted target (N, padding): a property of the target, the same in both views
    assert np.array_equal(counted, ~np.isnan(cut64)), "full and cut views count different targets"  # exact: masks
    return ProbeTileScores(
        tokens=counted.sum(axis=1).astype(np.int64),
        full_nll=np.where(counted, full64, 0.0).sum(axis=1),
        cut_nll=np.where(counted, cut64, 0.0).sum(axis=1),
    )


@torch.no_grad()
def probe_share(
    model: torch.nn.Module,
    tokens: np.ndarray,
    settings: ProbeSettings,
    group: ScoringGroup,
    multiple: int,
    vocab: VocabMap | None = None,
    device: torch.device | str = "cpu",
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """This rank's share of one tile's probe in a multi-process job (the model sharded over
    ``group``'s mesh, context parallelism installed when ``group.cp_size > 1``).

    Every forward is collective (FSDP2 gathers, CP exchanges), so each view is one plain forward
    through :func:`~genolong.evaluation.distributed.share_nll`, the planted tiles one at a time:
    ``D`` full-length forwards for the full views (one process shares their prefix through a
    :class:`~genolong.model.stream.PrefillStream`, which does not run under FSDP2 or CP) and the
    ``D`` cut windows. :func:`assemble_probe_shares` puts a CP group's shares together on the
    writer. Arguments as :func:`probe_views`; ``multiple``: the padded length's unit
    (:func:`genolong.config.kernel_multiple` at the CP size).

    Returns:
        ``(full, cut)``: per distance, this CP rank's slice of the planted tile's (full) or the cut
        window's (cut) per-target NLL (:func:`~genolong.evaluation.distributed.share_nll`).
    """
    from .distributed import share_nll

    length = int(tokens.shape[0])
    if length != settings.context:
        raise InputError(f"the probe needs tiles of exactly {settings.context} bases, got {length}")
    full, cut = [], []
    for d in settings.distances:
        planted = plant_repeat(tokens, d, settings.repeat_bases)
        full.append(share_nll(model, planted, group, multiple, vocab, settings.chunk_size, device))
        a, b = cut_view_span(length, d)
        cut.append(share_nll(model, planted[a:b], group, multiple, vocab, settings.chunk_size, device))
    return full, cut


def assemble_probe_shares(
    shares: Sequence[tuple[list[np.ndarray], list[np.ndarray]]], settings: ProbeSettings
) -> ProbeTileScores:
    """One tile's :class:`ProbeTileScores` from its CP group's :func:`probe_share` results (in CP
    rank order; one share in a group of one)."""
    from .distributed import assemble_nll

    m, length = settings.repeat_bases, settings.context
    full = np.stack([assemble_nll([s[0][i] for s in shares], length)[-m:] for i in range(len(settings.distances))])
    cut = np.stack([assemble_nll([s[1][i] for s in shares], d)[-m:] for i, d in enumerate(settings.distances)])
    return _summed(full.astype(np.float64), cut.astype(np.float64))


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class _Running:
    """A probe's per-tile arrays, saved after every tile (``state.npz``)."""

    def __init__(self, n_tiles: int, n_dist: int):
        self.next_tile = 0
        self.tokens = np.zeros((n_tiles, n_dist), np.int64)
        self.full = np.zeros((n_tiles, n_dist), np.float64)
        self.cut = np.zeros((n_tiles, n_dist), np.float64)
        self.seconds = 0.0

    def add(self, i: int, scores: ProbeTileScores) -> None:
        """Record tile ``i``'s scores (the next tile in order)."""
        self.tokens[i], self.full[i], self.cut[i] = scores.tokens, scores.full_nll, scores.cut_nll
        self.next_tile = i + 1

    def save(self, path: Path) -> None:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(
                    f, next_tile=self.next_tile, tokens=self.tokens, full=self.full, cut=self.cut, seconds=self.seconds
                )

        replace_file(path, write)

    def load(self, path: Path) -> None:
        with np.load(path) as z:
            if z["tokens"].shape != self.tokens.shape:
                raise InputError(f"{path} does not match this probe; delete {path.parent} to start over")
            self.next_tile = int(z["next_tile"])
            self.tokens[:], self.full[:], self.cut[:] = z["tokens"], z["full"], z["cut"]
            self.seconds = float(z["seconds"])


# a full disk or a file-size limit: one error naming --out; the committed tiles stay for a rerun
@writes_output("out", work=lambda out: out.with_name(f".{out.name}.partial"))
def probe(
    model: torch.nn.Module,
    split: SplitLike,
    out: str | os.PathLike[str],
    context: int,
    repeat_bases: int = 100,
    distances: Sequence[int] | None = None,
    max_tiles: int | None = None,
    vocab: VocabMap | None = None,
    chunk_size: int = 4096,
    label: str | None = None,
    meta: Mapping[str, Any] | None = None,
    force: bool = False,
    progress: bool | None = None,
    segment_tokens: int | None = None,
    figure: bool = True,
    group: ScoringGroup | None = None,
) -> ProbeResult | None:
    """Probe the first ``max_tiles`` full-length tiles of ``context`` bases of ``split``; write ``out``.

    Tiles are :class:`~genolong.data.windows.EvalTiles` of ``context`` (those ``evaluate`` scores),
    the shorter last tile of a segment left out. After every tile its scores are committed to
    ``.<out>.partial/state.npz``, so a killed probe resumes at the next tile (with the same
    settings and weights) and ends with the same tables; the finished directory is renamed to ``out``.

    Args:
        model: the model (its device and dtype are used as they are).
        split: the held-out split.
        out: result directory (must not exist unless ``force``).
        context: tile length ``L``.
        repeat_bases: ``m``, bases copied (default 100).
        distances: the distances (default: powers of two with ``m < d <= L - m``).
        max_tiles: tiles probed (default None: every full-length tile).
        vocab: base ids -> model ids (default None: nucleotide ids).
        chunk_size: LM-head rows per chunk (default 4096).
        label: display name (default: ``out``'s name).
        meta: extra plain data for ``meta.json`` (checkpoint, store, split, dtype, device...).
        force: replace an existing ``out`` (default False).
        progress: show a progress bar (default: on a terminal).
        segment_tokens: stream forwards this many tokens at a time (default None: one forward each).
        figure: draw ``probe.png`` / ``probe.pdf`` into the result (default True).
        group: the multi-process job (:class:`~genolong.evaluation.distributed.ScoringGroup`; the
            model sharded over its mesh): tiles are dealt to its data-parallel groups a round at a
            time (:func:`probe_share` per rank), global rank 0 gathers, writes and commits after
            every round; default None: one process (:func:`probe_tile`).

    Returns:
        The result, as saved in ``out`` (None on every rank but the writer).

    Raises:
        InputError: ``out`` exists (without ``force``), bad settings, or no tile of ``context`` bases.
    """
    from ..config import kernel_multiple
    from ..model.lm import GenoLM
    from .distributed import broadcast_from_writer, gather_to_writer, stop_if_signalled, tile_rounds
    from .score import _progress, kernel_backend_meta, model_signature

    group = group or ScoringGroup()
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if max_tiles is not None and max_tiles < 1:
        raise InputError(f"--max-tiles must be at least 1, got {max_tiles}")
    if not isinstance(model, GenoLM):
        raise InputError(f"the probe runs a genolong GenoLM; got {type(model).__name__}")
    if group.distributed and segment_tokens is not None:
        raise InputError(
            "--segment-tokens streams in one process; a multi-process probe runs each view in one forward "
            "(context parallelism splits it): pass --segment-tokens 0"
        )
    settings = ProbeSettings(context, repeat_bases, tuple(distances or ()), chunk_size, segment_tokens)
    tiles = EvalTiles(split, context)
    full_length = np.flatnonzero(tiles.tiles["length"].to_numpy() == context)
    if full_length.size == 0:
        raise InputError(
            f"no tile of split {getattr(split, 'name', '?')!r} is {context:,} bases long (its segments are "
            "shorter); lower --context"
        )
    chosen = full_length if max_tiles is None else full_length[:max_tiles]
    run_settings = {
        "checkpoint": "(in memory)",
        "store": "(in memory)",
        "split": str(getattr(split, "name", "?")),
        **dict(meta or {}),
        "model_signature": model_signature(model),
        **kernel_backend_meta(model),
        **settings.to_dict(),
        "tiles": int(chosen.size),
        "eval_tiles": chosen.tolist(),
        # the full views are streamed in one process and plain forwards under CP / FSDP2: other roundings
        "parallel": group.layout(),
    }
    work = out.with_name(f".{out.name}.partial")
    running = _Running(int(chosen.size), len(settings.distances))
    state = work / _STATE
    if group.is_writer:
        if (
            (work / _SETTINGS).is_file()
            and json.loads((work / _SETTINGS).read_text()) == run_settings
            and state.is_file()
        ):
            running.load(state)
            log.info("resuming the probe in %s at tile %d of %d", work, running.next_tile, chosen.size)
        else:
            if work.exists():
                log.info("discarding an unfinished probe with other settings in %s", work)
                shutil.rmtree(work)
            work.mkdir(parents=True)
            replace_file(work / _SETTINGS, lambda tmp: tmp.write_text(json.dumps(run_settings, indent=1)))
    start = broadcast_from_writer(running.next_tile, group)
    multiple = kernel_multiple(model.config, group.cp_size)

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    bar = _progress(int(chosen.size), start, progress, label or out.name, command="probe") if group.is_writer else None
    stop = SignalFlag()
    stop.install()
    try:
        for round_ in tile_rounds(start, int(chosen.size), group.dp_size):
            # a stop signal (preemption, a time limit): every rank leaves here, after the last committed round
            stop_if_signalled(stop, round_[0], int(chosen.size), work, device, group)
            began = time.perf_counter()
            if not group.distributed:
                running.add(round_[0], probe_tile(model, tiles[int(chosen[round_[0]])].tokens, settings, vocab, device))
            else:
                mine = round_[group.dp_rank] if group.dp_rank < len(round_) else None
                # a rank without a tile in the last round runs the round's first one again (its forwards
                # are collectives the others wait for) and the writer drops it
                tokens = tiles[int(chosen[round_[0] if mine is None else mine])].tokens
                shares = gather_to_writer(
                    (mine, group.cp_rank, probe_share(model, tokens, settings, group, multiple, vocab, device)), group
                )
                if shares is None:
                    continue
                for i in round_:
                    running.add(
                        i,
                        assemble_probe_shares(
                            [s[2] for s in sorted((s for s in shares if s[0] == i), key=lambda s: s[1])], settings
                        ),
                    )
            # the round is committed at once: a kill leaves the state of the last whole round
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

    picked = tiles.tiles.iloc[chosen]
    # the probed bases: two probes with one fingerprint planted the same copies in the same tiles
    digest = hashlib.sha256(
        json.dumps(
            [
                picked["contig"].astype(str).tolist(),
                picked["start"].tolist(),
                settings.repeat_bases,
                list(settings.distances),
            ]
        ).encode()
    )
    result = ProbeResult(
        meta={
            "format": PROBE_FORMAT,
            "label": label or out.name,
            **run_settings,
            "tokens": int(running.tokens.sum()),
            "fingerprint": digest.hexdigest(),
            "seconds": running.seconds,
        },
        tiles=pd.DataFrame(
            {
                "tile": np.arange(chosen.size, dtype=np.int64),
                "contig": picked["contig"].astype(str).to_numpy(),
                "start": picked["start"].to_numpy(np.int64),
                "length": picked["length"].to_numpy(np.int64),
                "eval_tile": chosen.astype(np.int64),
            }
        ),
        tile_tokens=running.tokens,
        tile_full=running.full,
        tile_cut=running.cut,
    )
    result.save(work)
    if figure:
        from .plots import save_probe_figure

        save_probe_figure([result], work)
    state.unlink()
    (work / _SETTINGS).unlink()
    replace_dir(work, out)
    result.source = out
    return result
