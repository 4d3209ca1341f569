"""The log-prob gap: training path vs step-by-step decode path, per token, by preceding context.

``genolong check-logprobs`` answers "does the model the trainer optimises give the same
probabilities as the inference path?" (the reference work measured 0.04-0.07 against vLLM from
128k to 1M tokens). For the first tiles of an evaluation split (:class:`~genolong.data.windows.EvalTiles`
of ``context`` tokens) it scores every counted target twice, on the same tokens:

- training path: :meth:`GenoLM.token_nll <genolong.model.lm.GenoLM.token_nll>` (chunked KDA,
  blockwise DSA top-k, chunked logits), ``log p = -nll``;
- decode path: :class:`~genolong.model.decode.Decoder` stepping one token at a time from an empty
  state (recurrent KDA, DSA latent and KPool caches), i.e.
  :func:`~genolong.model.decode.sequence_log_probs` with ``prefill=0``, gathered step by step so that
  a text-LLM vocabulary never needs a ``[B, T, V]`` tensor.

``|log p_train - log p_decode|`` is reported by bucket of offset (the target's preceding context in
its tile; the buckets of :func:`~genolong.evaluation.stats.bucket_edges`): mean, max and token count,
plus an overall row. Only counted targets enter (A, C, G, T in either case; never N, padding or
specials). Both paths run in the dtype of the model's parameters, so loading the checkpoint in fp32
or bf16 gives the two figures the issue asks for.

What to expect (fp32): float rounding only, a mean of ~3e-7 and a max of ~1e-6 nats on the ``tiny``
preset. A DSA top-k selection whose boundary ties within rounding may pick a different pool in the
two paths and move that token by ~1e-2 (see :mod:`genolong.model.decode`); that is a property of
top-k, visible here as a rare large max in an otherwise tiny mean.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..config import kernel_multiple
from ..data.alphabet import N
from ..data.windows import EvalTiles, SplitLike
from ..errors import InputError
from ..files import replace_dir, writing
from ..model.decode import Decoder
from ..model.lm import GenoLM
from ..model.loss import model_inputs
from ..model.vocab import VocabMap
from .bootstrap import bucket_edges, bucket_labels, format_bases
from .distributed import ScoringGroup, assemble_nll, gather_to_writer, share_nll, unsharded
from .plots import OKABE_ITO
from .score import kernel_backend_meta

__all__ = ["LogprobGap", "check_logprobs", "decode_target_logprobs", "gap_figure", "TABLE_COLUMNS", "FP32_MEAN_BOUND"]

#: Columns of :meth:`LogprobGap.table` (and logprob_gap.csv), in order.
TABLE_COLUMNS = ["bucket", "lo", "hi", "tokens", "mean_abs_diff", "max_abs_diff"]

#: The issue's bound on the fp32 mean |log-prob difference| on ``tiny`` (nats); drawn on the figure.
FP32_MEAN_BOUND = 1e-5

_FORMAT = "genolong-logprob-gap/1"
# Okabe & Ito (2008) colour-blind-safe palette: blue, vermillion, and grey for the bound
_BLUE, _VERMILLION, _GREY = OKABE_ITO[0], OKABE_ITO[1], "#999999"


@dataclass
class LogprobGap:
    """Per-token log-probs of the two paths and their absolute difference; see :func:`check_logprobs`.

    Attributes:
        tile: ``[N]`` int64, the target's tile index in ``EvalTiles(split, context)``.
        offset: ``[N]`` int64, the target's position in its tile (= its preceding context, ``1 .. L - 1``).
        train_logprob: ``[N]`` float32, ``log p`` by the training path (nats).
        decode_logprob: ``[N]`` float32, ``log p`` by the decode path (nats).
        abs_diff: ``[N]`` float64, ``|train_logprob - decode_logprob|`` (nats).
        context: tile length ``L``.
        dtype: the model's parameter dtype, e.g. ``"float32"``.
        label: display name of the checkpoint (may be empty).
        edges: ``[K + 1]`` int64 bucket edges of offset.
        tiles: number of tiles scored.
        extra: free metadata (timings, threads, device, genolong version, ...), JSON-serialisable.
    """

    tile: np.ndarray
    offset: np.ndarray
    train_logprob: np.ndarray
    decode_logprob: np.ndarray
    abs_diff: np.ndarray
    context: int
    dtype: str
    label: str
    edges: np.ndarray
    tiles: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """N, the counted targets compared."""
        return int(self.abs_diff.size)

    def table(self) -> pd.DataFrame:
        """Mean and max ``|diff|`` by offset bucket, then an ``"all"`` row.

        Returns:
            DataFrame with :data:`TABLE_COLUMNS`: ``bucket`` (label, e.g. ``"<1k"``), ``lo``/``hi``
            (offsets ``[lo, hi)``), ``tokens``, ``mean_abs_diff`` and ``max_abs_diff`` (nats; NaN
            for a bucket without tokens). One row per bucket of :attr:`edges`, the overall row last.
        """
        rows = []
        edges = np.asarray(self.edges, dtype=np.int64)
        for label, lo, hi in zip(bucket_labels(edges), edges[:-1], edges[1:]):
            rows.append(_row(label, int(lo), int(hi), self.abs_diff[(self.offset >= lo) & (self.offset < hi)]))
        rows.append(_row("all", int(edges[0]), int(edges[-1]), self.abs_diff))
        return pd.DataFrame(rows, columns=TABLE_COLUMNS)

    def meta(self) -> dict[str, Any]:
        """The run's description (JSON-serialisable): format, label, context, dtype, edges, tiles, tokens, extras."""
        return {
            "format": _FORMAT,
            "label": self.label,
            "context": int(self.context),
            "dtype": self.dtype,
            "bucket_edges": [int(e) for e in self.edges],
            "tiles": int(self.tiles),
            "tokens": self.tokens,
            **self.extra,
        }

    def frame(self) -> pd.DataFrame:
        """The per-token arrays as a DataFrame (columns tile, offset, train_logprob, decode_logprob, abs_diff)."""
        return pd.DataFrame(
            {
                "tile": self.tile.astype(np.int64),
                "offset": self.offset.astype(np.int64),
                "train_logprob": self.train_logprob.astype(np.float32),
                "decode_logprob": self.decode_logprob.astype(np.float32),
                "abs_diff": self.abs_diff.astype(np.float64),
            }
        )

    def save(self, out: str | os.PathLike[str]) -> dict[str, Path]:
        """Write the results to directory ``out``, atomically.

        Files: ``logprob_gap.csv`` (:meth:`table`), ``logprob_gap.json`` (``{"meta": ..., "table": [...]}``,
        NaN as null), ``tokens.parquet`` (:meth:`frame`), ``logprob_gap.png`` and ``logprob_gap.pdf``
        (:func:`gap_figure`). Everything is built in a temporary directory beside ``out`` and checked;
        only then is it renamed to ``out``, replacing an existing ``out`` (the caller decides whether
        replacing is allowed, e.g. a ``--force`` flag). On any error ``out`` is left as it was.

        Returns:
            ``{"csv", "json", "tokens", "png", "pdf"}`` -> final paths under ``out``.
        """
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        names = {
            "csv": "logprob_gap.csv",
            "json": "logprob_gap.json",
            "tokens": "tokens.parquet",
            "png": "logprob_gap.png",
            "pdf": "logprob_gap.pdf",
        }
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            with writing(out, work=work):
                table = self.table()
                table.to_csv(work / names["csv"], index=False)
                doc = {"meta": self.meta(), "table": _records(table)}
                (work / names["json"]).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
                self.frame().to_parquet(work / names["tokens"], index=False)
                fig, _ = gap_figure(table, title=self.title())
                fig.savefig(work / names["png"], dpi=150)
                fig.savefig(work / names["pdf"])
                _verify(work, names, len(table), self.tokens)
                replace_dir(work, out)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return {key: out / name for key, name in names.items()}

    def title(self) -> str:
        """Figure title: label, context and dtype."""
        who = f"{self.label}, " if self.label else ""
        return f"log-prob gap, training vs decode path ({who}L = {format_bases(self.context)}, {self.dtype})"


def _row(label: str, lo: int, hi: int, diff: np.ndarray) -> dict[str, Any]:
    n = int(diff.size)
    return {
        "bucket": label,
        "lo": lo,
        "hi": hi,
        "tokens": n,
        "mean_abs_diff": float(diff.mean()) if n else math.nan,
        "max_abs_diff": float(diff.max()) if n else math.nan,
    }


def _records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """Table rows as JSON-ready dicts (NaN -> None, numpy scalars -> Python)."""
    rows = []
    for rec in table.to_dict(orient="records"):
        rows.append(
            {
                k: (None if isinstance(v, float) and math.isnan(v) else v.item() if hasattr(v, "item") else v)
                for k, v in rec.items()
            }
        )
    return rows


def _verify(work: Path, names: dict[str, str], rows: int, tokens: int) -> None:
    """Check what :meth:`LogprobGap.save` wrote before it is renamed into place."""
    if len(pd.read_csv(work / names["csv"])) != rows:
        raise RuntimeError("logprob_gap.csv did not round-trip")
    if len(pd.read_parquet(work / names["tokens"])) != tokens:
        raise RuntimeError("tokens.parquet did not round-trip")
    if (work / names["png"]).read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise RuntimeError("logprob_gap.png is not a PNG file")
    if (work / names["pdf"]).read_bytes()[:5] != b"%PDF-":
        raise RuntimeError("logprob_gap.pdf is not a PDF file")


def gap_figure(table: pd.DataFrame, title: str = "", bound: float | None = FP32_MEAN_BOUND) -> tuple[Any, pd.DataFrame]:
    """Mean and max ``|log-prob difference|`` per offset bucket, log y axis.

    Drawn only from a bucket table (:meth:`LogprobGap.table`, or ``logprob_gap.csv`` read back), on
    a :class:`matplotlib.figure.Figure` with the Agg canvas (no pyplot state). Buckets without tokens
    are not drawn (their values are NaN); zeros cannot be drawn on a log axis and are left out too.

    Args:
        table: the bucket table; the ``"all"`` row goes into the legend text, not the series.
        title: figure title (default none).
        bound: a horizontal reference line (default :data:`FP32_MEAN_BOUND`, the fp32 bound on the
            mean; None: no line).

    Returns:
        ``(figure, plotted)``: ``plotted`` holds the rows drawn (the bucket rows, ``"all"`` excluded),
        columns :data:`TABLE_COLUMNS`; series ``"mean |diff|"`` and ``"max |diff|"`` are its
        ``mean_abs_diff`` and ``max_abs_diff`` at x = 0, 1, ... (bucket order).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    missing = [c for c in TABLE_COLUMNS if c not in table.columns]
    if missing:
        raise InputError(f"the log-prob gap table lacks columns {missing}; pass LogprobGap.table() or logprob_gap.csv")
    plotted = table[table["bucket"] != "all"][TABLE_COLUMNS].reset_index(drop=True)
    overall = table[table["bucket"] == "all"]
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = np.arange(len(plotted))
    for column, name, colour, marker in (
        ("mean_abs_diff", "mean |diff|", _BLUE, "o"),
        ("max_abs_diff", "max |diff|", _VERMILLION, "s"),
    ):
        y = plotted[column].to_numpy(dtype=np.float64)
        ax.plot(x, np.where(y > 0, y, np.nan), color=colour, marker=marker, label=name, gid=column)
    if bound is not None:
        ax.axhline(
            bound, color=_GREY, linestyle="--", linewidth=1, label=f"fp32 bound on the mean ({bound:g})", gid="bound"
        )
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{b}\n({n:,} tok)" for b, n in zip(plotted["bucket"], plotted["tokens"])])
    ax.set_xlabel("preceding context of the target (bases in its tile)")
    ax.set_ylabel("|log p(train) - log p(decode)| (nats)")
    if len(overall):
        row = overall.iloc[0]
        ax.plot(
            [],
            [],
            " ",
            label=f"all: mean {row['mean_abs_diff']:.2e}, max {row['max_abs_diff']:.2e} ({int(row['tokens']):,} tok)",
        )
    # below the axes: inside, it would hide points or the bound line
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.24), ncol=2, frameon=False)
    ax.margins(x=0.08)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize="medium")
    return fig, plotted


def decode_target_logprobs(model: GenoLM, input_ids: torch.Tensor, progress: Any = None) -> torch.Tensor:
    """Log-prob of each next token by the step path: ``input_ids [B, T] -> [B, T - 1]`` float32.

    Equal to :func:`genolong.model.decode.sequence_log_probs` with ``prefill=0`` (the same steps
    from the same empty state), but the target's entry is gathered after every step, so memory is
    ``O(B * vocab)`` rather than ``O(B * T * vocab)`` (at 128k tokens and GLM-5.3-Flash's 154,880-id
    vocabulary the full tensor would take 80 GB per sequence).

    Args:
        model: the model.
        input_ids: ``[B, T]`` model ids, ``T >= 2``.
        progress: an object with ``update(n)`` (a tqdm bar), called once per step; default none.
    """
    b, t = input_ids.shape
    dec = Decoder(model)
    dec.init_state(b, capacity=t)
    ids = input_ids.to(dec.device, torch.long)
    out = torch.empty(b, t - 1, dtype=torch.float32, device=dec.device)
    for i in range(t - 1):
        lp = dec.step(ids[:, i])  # [B, V] fp32
        out[:, i] = lp.gather(1, ids[:, i + 1, None])[:, 0]
        if progress is not None:
            progress.update(1)
    return out


def check_logprobs(
    model: GenoLM,
    split: SplitLike,
    context: int,
    max_tiles: int | None = 1,
    first_bucket: int = 1024,
    vocab: VocabMap | None = None,
    progress: bool | None = False,
    *,
    batch_size: int = 8,
    label: str = "",
    group: ScoringGroup | None = None,
) -> LogprobGap | None:
    """Score the first tiles of ``split`` by the training and the decode path and compare per token.

    Tiles are ``EvalTiles(split, context)`` in order (every segment cut into consecutive tiles of
    ``context`` tokens, the last one of a segment shorter). Up to ``batch_size`` tiles go through
    both paths together; a shorter tile is padded on the right with N, which changes nothing before
    it (every layer is causal) and whose targets are not counted. The model runs in its own
    parameter dtype and device, in eval mode (restored afterwards) and without gradients.

    Args:
        model: the model (fp32 or bf16 parameters, as loaded).
        split: an evaluation split (``GenomeStore.open(path).split("eval")`` or any :class:`SplitLike`).
        context: tile length ``L`` (>= 2).
        max_tiles: score only the first ``max_tiles`` tiles (>= 1; default 1; None: every tile).
            The decode path costs one step per token, ~20-40 ms for the ``tiny``/``small`` presets on
            one CPU thread, so a tile of 1M tokens takes hours.
        first_bucket: upper edge of the first offset bucket (default 1024).
        vocab: the checkpoint's ids of the bases (a text LLM); default None: nucleotide ids.
        progress: a tqdm bar over decode steps on stderr (True; None: when stderr is a terminal;
            default False).
        batch_size: tiles per batch (default 8; a step costs about the same for 1 or 8 sequences).
        label: display name of the checkpoint, kept in the metadata and the figure title.
        group: a multi-process job (:class:`~genolong.evaluation.distributed.ScoringGroup`; every
            rank calls this): each data-parallel group takes ``batch_size`` tiles per round, its
            context-parallel ranks run their slices of the training path, and the decode path runs
            on the whole model (all-gathered for it: :func:`~genolong.evaluation.distributed.unsharded`),
            every rank of a CP group stepping the same tiles; global rank 0 gathers the arrays.
            Default None: one process.

    Returns:
        :class:`LogprobGap` over all counted targets (non-N bases, either case) of the scored tiles
        (None on the ranks other than global rank 0).

    Raises:
        InputError: ``context < 2``, ``max_tiles < 1``, ``batch_size < 1``, ``first_bucket < 2``, a
            model that is not a :class:`GenoLM`, or a split without tiles.
    """
    if not isinstance(model, GenoLM):
        raise InputError(f"check_logprobs needs a genolong GenoLM model; got {type(model).__name__}")
    if isinstance(context, bool) or int(context) != context or context < 2:
        raise InputError(f"--context must be an integer >= 2 (one input and one target per tile); got {context}")
    if max_tiles is not None and (isinstance(max_tiles, bool) or int(max_tiles) != max_tiles or max_tiles < 1):
        raise InputError(f"--max-tiles must be an integer >= 1 (or None for every tile); got {max_tiles}")
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise InputError(f"batch_size must be an integer >= 1; got {batch_size}")
    context = int(context)
    edges = bucket_edges(context, first_bucket)
    tiles = EvalTiles(split, context)
    n_tiles = len(tiles) if max_tiles is None else min(int(max_tiles), len(tiles))
    if n_tiles == 0:
        raise InputError(f"split {getattr(split, 'name', '?')!r} has no tiles to score; check the store's eval split")
    group = group or ScoringGroup()
    if group.distributed and getattr(group.parallel, "ep", 1) > 1:
        raise InputError(
            "check-logprobs steps the decode path token by token on each rank; with parallel.ep > 1 the "
            "experts' all-to-all would need every rank in step: run it with parallel.ep: 1"
        )
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    multiple = kernel_multiple(model.config, group.cp_size)
    per_round = int(batch_size) * group.dp_size

    def share_of(first: int) -> list[int]:
        lo = first + group.dp_rank * int(batch_size)
        return list(range(lo, min(lo + int(batch_size), n_tiles)))

    steps = sum(
        int(tiles.tiles["length"].iloc[i]) - 1 for first in range(0, n_tiles, per_round) for i in share_of(first)
    )
    bar = _progress_bar(progress, steps) if group.is_writer else None
    parts: list[tuple[np.ndarray, ...]] = []
    seconds = {"train": 0.0, "decode": 0.0}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, n_tiles, per_round):
                mine = share_of(first)
                batch = [tiles[i] for i in mine]
                width = max((tile.length for tile in batch), default=0)
                tokens = np.full((max(len(batch), 1), max(width, 2)), N, dtype=np.int64)  # padding: N, never counted
                for row, tile in enumerate(batch):
                    tokens[row, : tile.length] = tile.tokens
                tok = torch.from_numpy(tokens).to(device)
                start = time.perf_counter()
                nll = None
                if group.cp_size > 1:
                    nll = share_nll(model, tokens, group, multiple, vocab)  # this rank's slice [B, n]
                elif batch and width >= 2 or group.distributed:  # a forward all the same: FSDP gathers are collective
                    nll = model.token_nll(tok, vocab=vocab).float().cpu().numpy()  # [B, T - 1], NaN = not counted
                seconds["train"] += time.perf_counter() - start
                decoded = None
                # the decoder calls the layers' parts directly: whole weights, gathered by every rank
                # (a collective) whether or not it has tiles this round
                with unsharded(model):
                    if batch and width >= 2:
                        start = time.perf_counter()
                        ids = model_inputs(tok) if vocab is None else vocab.to_model(tok)
                        decoded = decode_target_logprobs(model, ids, bar).cpu().numpy()  # [B, T - 1]
                        seconds["decode"] += time.perf_counter() - start
                share = (mine if batch and width >= 2 else [], group.cp_rank, nll, decoded)
                shares = gather_to_writer(share, group)
                if shares is None:
                    continue
                for d in range(group.dp_size):  # the dp groups' tiles follow one another
                    ranks = sorted(
                        (s for s in shares if s[0] and s[0][0] == first + d * int(batch_size)), key=lambda s: s[1]
                    )
                    if not ranks:
                        continue
                    ids_d = ranks[0][0]
                    lengths = np.array([tiles.tiles["length"].iloc[i] for i in ids_d], dtype=np.int64)
                    w = int(lengths.max())
                    train = assemble_nll([s[2] for s in ranks], w)[: len(ids_d)]  # [B, w - 1]
                    dec = ranks[0][3][: len(ids_d), : w - 1]
                    offset = np.arange(1, w)  # target t + 1 of entry t
                    counted = ~np.isnan(train) & (offset[None] < lengths[:, None])
                    rows, cols = counted.nonzero()
                    parts.append(
                        (
                            np.asarray(ids_d, dtype=np.int64)[rows],
                            (cols + 1).astype(np.int64),
                            -train[rows, cols],
                            dec[rows, cols],
                        )
                    )
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    if not group.is_writer:
        return None

    def cat(i: int, dt: type) -> np.ndarray:
        return np.concatenate([p[i] for p in parts]).astype(dt) if parts else np.zeros(0, dtype=dt)

    train_lp, decode_lp = cat(2, np.float32), cat(3, np.float32)
    from genolong import __version__

    return LogprobGap(
        tile=cat(0, np.int64),
        offset=cat(1, np.int64),
        train_logprob=train_lp,
        decode_logprob=decode_lp,
        abs_diff=np.abs(train_lp.astype(np.float64) - decode_lp.astype(np.float64)),
        context=context,
        dtype=str(dtype).removeprefix("torch."),
        label=label,
        edges=edges,
        tiles=n_tiles,
        extra={
            "split": str(getattr(split, "name", "")),
            "device": str(device),
            "threads": torch.get_num_threads(),
            "batch_size": int(batch_size),
            "train_seconds": seconds["train"],
            "decode_seconds": seconds["decode"],
            "genolong_version": __version__,
            "parallel": group.layout(),
            **kernel_backend_meta(model),
        },
    )


def _progress_bar(enabled: bool | None, total: int) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="decode path", unit="step", file=sys.stderr)
