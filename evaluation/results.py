"""The result of one ``genolong evaluate`` run: aggregates of per-token NLL, saved as a directory.

Layout of a result directory (format ``genolong-eval/1``; written by ``genolong evaluate``, see :mod:`genolong.evaluation.score`):

- ``meta.json``: run description (label, checkpoint, store, split, context, context_cut,
  bucket_edges, tiles, tokens, nll_sum, fingerprint; ``routing``: per MoE layer the load per
  expert over the scored tiles, load max/mean, dead experts, router entropy; free extras);
- ``tiles.parquet``: one row per tile: tile, contig, start, length;
- ``tile_buckets.parquet``: dense ``W * K`` rows, tile-major: tile, bucket, tokens, nll_sum;
- ``positions.parquet``: ``L`` rows: offset, tokens, nll_sum (row 0 always has 0 tokens);
- ``tile_buckets_softmask.parquet``: dense ``W * K * 2`` rows, tile-major then bucket: tile,
  bucket, softmask (bool: the target base is lower case in the FASTA), tokens, nll_sum; the two
  rows of a (tile, bucket) add up to its ``tile_buckets.parquet`` row (the split behind
  ``--by softmask``; results written before it existed lack the file and load without the split);
- ``buckets.csv``: the bucket table (:meth:`EvalResult.bucket_table` with its defaults).

The per-(tile, bucket) sums are all the block bootstrap needs, and the per-offset sums are all the
per-position plot needs, so neither needs the (optional, large) per-token table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from .bootstrap import SOFTMASK_CLASSES, bucket_labels, bucket_table_from_arrays, split_bucket_table_from_arrays

__all__ = ["FORMAT", "BY_CHOICES", "EvalResult", "check_by"]

FORMAT = "genolong-eval/1"

_REQUIRED_META = (
    "format",
    "label",
    "checkpoint",
    "store",
    "split",
    "context",
    "context_cut",
    "bucket_edges",
    "tiles",
    "tokens",
    "nll_sum",
    "fingerprint",
)
_TILE_COLUMNS = ["tile", "contig", "start", "length"]
_FIX = "run `genolong evaluate CHECKPOINT --store DIR --out {path}` first"
_SPLIT_FILE = "tile_buckets_softmask.parquet"
#: the values of ``--by``: a bucket table or comparison pooled over all bases (None) or split by soft-masking
BY_CHOICES = ("softmask",)


def _json_default(value: Any) -> Any:
    """Let ``json`` write numpy scalars and arrays (meta values often come from numpy)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"meta value of type {type(value).__name__} is not JSON serialisable")


@dataclass(eq=False)
class EvalResult:
    """Aggregated NLL of one evaluation run over ``W`` tiles of ``L`` tokens and ``K`` offset buckets.

    Attributes:
        meta: the ``meta.json`` object (the keys listed above plus free extras).
        tiles: one row per tile: ``tile`` (int64, 0..W-1), ``contig`` (str), ``start`` (int64,
            genomic 0-based start), ``length`` (int64 tokens).
        tile_tokens: ``[W, K]`` int64 counted targets of each tile in each bucket.
        tile_nll: ``[W, K]`` float64 summed NLL (nats) of those targets.
        position_tokens: ``[L]`` int64 counted targets at each offset, summed over tiles.
        position_nll: ``[L]`` float64 summed NLL (nats) at each offset.
        source: directory the result was loaded from (None when built in memory); used in messages.
        softmask_tokens: ``[W, K, 2]`` int64 counted targets of each tile and bucket by soft-mask
            class (last axis: 0 unmasked, 1 soft-masked), adding up to ``tile_tokens``; None for a
            result written before the split was kept (everything but ``--by softmask`` works).
        softmask_nll: ``[W, K, 2]`` float64 summed NLL of those targets, adding up to ``tile_nll``
            (``genolong evaluate`` computes ``tile_nll`` as this sum, so it adds up exactly).

    Construction checks that the pieces agree with each other and raises :class:`InputError`
    otherwise.
    """

    meta: dict[str, Any]
    tiles: pd.DataFrame
    tile_tokens: np.ndarray
    tile_nll: np.ndarray
    position_tokens: np.ndarray
    position_nll: np.ndarray
    source: Path | None = field(default=None, repr=False)
    softmask_tokens: np.ndarray | None = field(default=None, repr=False)
    softmask_nll: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tile_tokens = np.asarray(self.tile_tokens, dtype=np.int64)
        self.tile_nll = np.asarray(self.tile_nll, dtype=np.float64)
        self.position_tokens = np.asarray(self.position_tokens, dtype=np.int64)
        self.position_nll = np.asarray(self.position_nll, dtype=np.float64)
        if (self.softmask_tokens is None) != (self.softmask_nll is None):
            raise self._fail("the soft-mask split needs both its token counts and its NLL sums")
        if self.softmask_tokens is not None:
            self.softmask_tokens = np.asarray(self.softmask_tokens, dtype=np.int64)
            self.softmask_nll = np.asarray(self.softmask_nll, dtype=np.float64)
        self._validate()
        self._validate_split()

    # ------------------------------------------------------------------ validation

    def _fail(self, problem: str) -> InputError:
        where = f"evaluation result {self.source}" if self.source is not None else "evaluation result"
        path = self.source if self.source is not None else "DIR"
        return InputError(f"{where}: {problem}; {_FIX.format(path=path)}")

    def _validate(self) -> None:
        meta = self.meta
        if not isinstance(meta, dict):
            raise self._fail("meta must be a JSON object")
        if meta.get("format") != FORMAT:
            raise self._fail(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
        missing = [k for k in _REQUIRED_META if k not in meta]
        if missing:
            raise self._fail(f"meta.json lacks {', '.join(missing)}")
        try:
            edges = np.asarray(meta["bucket_edges"], dtype=np.int64)
            context = int(meta["context"])
            n_tiles = int(meta["tiles"])
        except (TypeError, ValueError) as exc:
            raise self._fail(f"meta context/tiles/bucket_edges are not integers ({exc})") from None
        if edges.ndim != 1 or len(edges) < 2 or edges[0] < 1 or (np.diff(edges) <= 0).any() or edges[-1] > context:
            raise self._fail(
                f"bucket_edges {meta['bucket_edges']} are not strictly increasing offsets in [1, {context}]"
            )
        if n_tiles < 1:
            raise self._fail("it has no tiles (the split is shorter than 2 bases?)")
        k = len(edges) - 1
        if list(self.tiles.columns[:4]) != _TILE_COLUMNS or len(self.tiles.columns) != 4:
            raise self._fail(f"tiles table has columns {list(self.tiles.columns)}, expected {_TILE_COLUMNS}")
        if len(self.tiles) != n_tiles:
            raise self._fail(f"tiles table has {len(self.tiles)} rows but meta says {n_tiles} tiles")
        self.tiles = pd.DataFrame(
            {
                "tile": self.tiles["tile"].to_numpy(dtype=np.int64),
                "contig": self.tiles["contig"].astype(str),
                "start": self.tiles["start"].to_numpy(dtype=np.int64),
                "length": self.tiles["length"].to_numpy(dtype=np.int64),
            }
        )
        if not np.array_equal(self.tiles["tile"].to_numpy(), np.arange(n_tiles)):
            raise self._fail("tiles table column tile is not 0..W-1 in order")
        if self.tile_tokens.shape != (n_tiles, k) or self.tile_nll.shape != (n_tiles, k):
            raise self._fail(
                f"tile arrays have shapes {self.tile_tokens.shape} and {self.tile_nll.shape}, "
                f"expected ({n_tiles}, {k}) for {n_tiles} tiles and {k} buckets"
            )
        if self.position_tokens.shape != (context,) or self.position_nll.shape != (context,):
            raise self._fail(
                f"position arrays have shapes {self.position_tokens.shape} and {self.position_nll.shape}, "
                f"expected ({context},)"
            )
        if (self.tile_tokens < 0).any() or (self.position_tokens < 0).any():
            raise self._fail("token counts are negative")
        if self.position_tokens[0] != 0:
            raise self._fail("offset 0 has counted tokens (a tile's first base is never a target)")
        if (self.tiles["length"].to_numpy() > context).any():
            raise self._fail(f"a tile is longer than the context {context}")
        total = int(self.tile_tokens.sum())
        if total != int(meta["tokens"]) or total != int(self.position_tokens.sum()):
            raise self._fail(
                f"token totals disagree (tiles {total}, positions {int(self.position_tokens.sum())}, "
                f"meta {meta['tokens']})"
            )
        # the per-offset and per-tile tables are two sums of the same tokens: bucket by bucket
        by_offset = np.add.reduceat(self.position_tokens[edges[0] : edges[-1]], edges[:-1] - edges[0])
        if not np.array_equal(by_offset, self.tile_tokens.sum(axis=0)) or self.position_tokens[edges[-1] :].any():
            raise self._fail("per-offset and per-tile token counts disagree bucket by bucket")
        nll_tiles, nll_pos = float(self.tile_nll.sum()), float(self.position_nll.sum())
        scale = max(1.0, abs(float(meta["nll_sum"])))
        if abs(nll_tiles - float(meta["nll_sum"])) > 1e-6 * scale or abs(nll_pos - nll_tiles) > 1e-6 * scale:
            raise self._fail(f"NLL totals disagree (tiles {nll_tiles}, positions {nll_pos}, meta {meta['nll_sum']})")

    def _validate_split(self) -> None:
        if self.softmask_tokens is None:
            return
        w, k = self.tile_tokens.shape
        want = (w, k, len(SOFTMASK_CLASSES))
        if self.softmask_tokens.shape != want or self.softmask_nll.shape != want:
            raise self._fail(
                f"soft-mask split arrays have shapes {self.softmask_tokens.shape} and "
                f"{self.softmask_nll.shape}, expected {want}"
            )
        if (self.softmask_tokens < 0).any() or not np.array_equal(self.softmask_tokens.sum(axis=2), self.tile_tokens):
            raise self._fail("the soft-mask split's token counts do not add up to the per-tile counts")
        # evaluate writes tile_nll as the sum of the two classes (equal bit for bit); a result built
        # another way may differ by float rounding, a damaged one by more
        total = self.softmask_nll.sum(axis=2)
        scale = max(1.0, float(np.abs(self.tile_nll).max(initial=0.0)))
        if np.abs(total - self.tile_nll).max(initial=0.0) > 1e-9 * scale:
            raise self._fail("the soft-mask split's NLL sums do not add up to the per-tile sums")

    # ------------------------------------------------------------------ properties

    @property
    def has_softmask(self) -> bool:
        """Whether the result keeps the soft-mask split (results written before it did not)."""
        return self.softmask_tokens is not None

    def require_softmask(self) -> None:
        """Raise :class:`InputError` (one line, naming the fix) unless the result keeps the soft-mask split."""
        if not self.has_softmask:
            where = f"evaluation result {self.source}" if self.source is not None else f"evaluation result {self.label}"
            path = self.source if self.source is not None else "DIR"
            raise InputError(
                f"{where} has no soft-mask split (no {_SPLIT_FILE}: written by an older genolong), so "
                f"--by softmask cannot split it; re-run `genolong evaluate` (--out {path} --force) for it"
            )

    @property
    def edges(self) -> np.ndarray:
        """``[K + 1]`` int64 bucket edges (bucket ``i`` = offsets ``[edges[i], edges[i + 1])``)."""
        return np.asarray(self.meta["bucket_edges"], dtype=np.int64)

    @property
    def labels(self) -> list[str]:
        """The ``K`` bucket labels ("<1k", "1k-2k", ...)."""
        return bucket_labels(self.edges)

    @property
    def label(self) -> str:
        """Display name of the run (legends, tables)."""
        return str(self.meta["label"])

    @property
    def context(self) -> int:
        """Tile length ``L`` in tokens."""
        return int(self.meta["context"])

    @property
    def context_cut(self) -> int | None:
        """Visible-context limit ``C`` of a ``--context-cut`` run; None for a full-context run."""
        cut = self.meta.get("context_cut")
        return None if cut is None else int(cut)

    @property
    def fingerprint(self) -> str:
        """sha256 hex of the scored token set (equal fingerprints = same tiles and targets)."""
        return str(self.meta["fingerprint"])

    @property
    def n_tiles(self) -> int:
        """Number of tiles ``W``."""
        return int(self.tile_tokens.shape[0])

    @property
    def tokens(self) -> int:
        """Counted targets over all tiles."""
        return int(self.tile_tokens.sum())

    @property
    def mean_nll(self) -> float:
        """Mean NLL over all counted targets, nats per base (NaN without tokens)."""
        total = self.tokens
        return float(self.tile_nll.sum()) / total if total else math.nan

    # ------------------------------------------------------------------ tables

    def bucket_table(
        self, n_boot: int = 2000, seed: int = 0, level: float = 0.95, by: str | None = None
    ) -> pd.DataFrame:
        """Per-bucket and overall tokens, mean NLL and block-bootstrap CI (see ``bootstrap.bucket_table_from_arrays``).

        Columns: ``bucket, lo, hi, tokens, nats, ci_lo, ci_hi, bits, bits_ci_lo, bits_ci_hi``;
        the ``K`` buckets then ``"all"``. With ``by="softmask"`` a ``softmask`` column first and
        the rows of the unmasked then of the soft-masked bases
        (``bootstrap.split_bucket_table_from_arrays``; :class:`InputError` for a result without
        the split).
        """
        if by is None:
            return bucket_table_from_arrays(self.tile_tokens, self.tile_nll, self.edges, n_boot, seed, level)
        check_by(by)
        self.require_softmask()
        return split_bucket_table_from_arrays(self.softmask_tokens, self.softmask_nll, self.edges, n_boot, seed, level)

    def position_curve(self, bins_per_octave: int = 8) -> pd.DataFrame:
        """Per-position loss smoothed over log-spaced offset bins (the per-position plot's series).

        Bin edges are ``round(2 ** (k / bins_per_octave))`` for ``k = 0, 1, ...`` (duplicates
        dropped) up to ``L``; bin ``[lo, hi)`` pools every counted target at those offsets over all
        tiles, so its loss is a ratio of sums.

        Args:
            bins_per_octave: bins per doubling of the offset (default 8).

        Returns:
            DataFrame with one row per bin: ``lo`` (first offset), ``hi`` (exclusive), ``offset_mid``
            (geometric mean of the first and last offset, float), ``tokens`` (int64) and ``nats``
            (mean NLL, NaN for a bin without tokens).
        """
        if int(bins_per_octave) < 1:
            raise InputError(f"bins_per_octave must be at least 1, got {bins_per_octave}")
        length = self.context
        steps = int(math.ceil(bins_per_octave * math.log2(length))) + 1
        edges = np.unique(np.rint(2.0 ** (np.arange(steps + 1) / bins_per_octave)).astype(np.int64))
        edges = np.append(edges[edges < length], length)
        tokens = np.add.reduceat(self.position_tokens[1:], edges[:-1] - 1)
        nll = np.add.reduceat(self.position_nll[1:], edges[:-1] - 1)
        nats = np.full(len(tokens), np.nan)
        np.divide(nll, tokens, out=nats, where=tokens > 0)
        lo, hi = edges[:-1], edges[1:]
        return pd.DataFrame(
            {
                "lo": lo,
                "hi": hi,
                "offset_mid": np.sqrt(lo * (hi - 1).astype(np.float64)),
                "tokens": tokens.astype(np.int64),
                "nats": nats,
            }
        )

    # ------------------------------------------------------------------ files

    def save(self, directory: Path) -> None:
        """Write the result files into the existing ``directory`` (the caller renames it into place).

        Writes meta.json, tiles.parquet, tile_buckets.parquet, positions.parquet and buckets.csv
        (the bucket table with its defaults: 2000 resamples, seed 0, level 0.95).
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise InputError(
                f"cannot save the evaluation result: {directory} is not an existing directory; create it first"
            )
        w, k = self.tile_tokens.shape
        (directory / "meta.json").write_text(json.dumps(self.meta, indent=2, default=_json_default) + "\n")
        pq.write_table(
            pa.table(
                {
                    "tile": pa.array(self.tiles["tile"].to_numpy(), pa.int64()),
                    "contig": pa.array(self.tiles["contig"].astype(str).tolist(), pa.string()),
                    "start": pa.array(self.tiles["start"].to_numpy(), pa.int64()),
                    "length": pa.array(self.tiles["length"].to_numpy(), pa.int64()),
                }
            ),
            directory / "tiles.parquet",
        )
        pq.write_table(
            pa.table(
                {
                    "tile": pa.array(np.repeat(np.arange(w, dtype=np.int64), k), pa.int64()),
                    "bucket": pa.array(np.tile(np.arange(k, dtype=np.int64), w), pa.int64()),
                    "tokens": pa.array(self.tile_tokens.ravel(), pa.int64()),
                    "nll_sum": pa.array(self.tile_nll.ravel(), pa.float64()),
                }
            ),
            directory / "tile_buckets.parquet",
        )
        pq.write_table(
            pa.table(
                {
                    "offset": pa.array(np.arange(self.context, dtype=np.int64), pa.int64()),
                    "tokens": pa.array(self.position_tokens, pa.int64()),
                    "nll_sum": pa.array(self.position_nll, pa.float64()),
                }
            ),
            directory / "positions.parquet",
        )
        if self.has_softmask:
            pq.write_table(
                pa.table(
                    {
                        "tile": pa.array(np.repeat(np.arange(w, dtype=np.int64), 2 * k), pa.int64()),
                        "bucket": pa.array(np.tile(np.repeat(np.arange(k, dtype=np.int64), 2), w), pa.int64()),
                        "softmask": pa.array(np.tile(np.array([False, True]), w * k), pa.bool_()),
                        "tokens": pa.array(self.softmask_tokens.ravel(), pa.int64()),
                        "nll_sum": pa.array(self.softmask_nll.ravel(), pa.float64()),
                    }
                ),
                directory / _SPLIT_FILE,
            )
        self.bucket_table().to_csv(directory / "buckets.csv", index=False)

    @classmethod
    def load(cls, directory: Path | str) -> EvalResult:
        """Read and validate a result directory written by :meth:`save`.

        Raises:
            InputError: one line naming the directory and the fix when it is missing, has no
                meta.json, has another format, lacks a table, or its pieces disagree.
        """
        directory = Path(directory)
        fix = _FIX.format(path=directory)
        if not directory.is_dir():
            raise InputError(f"evaluation result {directory} does not exist; {fix}")
        meta_path = directory / "meta.json"
        if not meta_path.is_file():
            raise InputError(f"{directory} is not an evaluation result (no meta.json); {fix}")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise InputError(f"{meta_path} is not readable JSON ({exc}); {fix}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise InputError(f"{meta_path} has format {got!r}, expected {FORMAT!r}; {fix}")

        def read(name: str, columns: list[str]) -> pd.DataFrame:
            path = directory / name
            if not path.is_file():
                raise InputError(f"evaluation result {directory} lacks {name}; {fix}")
            try:
                table = pq.read_table(path)
            except (OSError, pa.ArrowException) as exc:
                raise InputError(f"{path} is not a readable parquet file ({exc}); {fix}") from None
            absent = [c for c in columns if c not in table.column_names]
            if absent:
                raise InputError(f"{path} lacks column(s) {', '.join(absent)}; {fix}")
            return table.select(columns).to_pandas()

        tiles = read("tiles.parquet", _TILE_COLUMNS)
        cells = read("tile_buckets.parquet", ["tile", "bucket", "tokens", "nll_sum"])
        positions = read("positions.parquet", ["offset", "tokens", "nll_sum"])
        try:
            w, k = int(meta["tiles"]), len(meta["bucket_edges"]) - 1
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{meta_path} lacks valid tiles/bucket_edges; {fix}") from None
        cells = cells.sort_values(["tile", "bucket"], kind="stable")
        if (
            len(cells) != w * k
            or not np.array_equal(cells["tile"].to_numpy(), np.repeat(np.arange(w), k))
            or not np.array_equal(cells["bucket"].to_numpy(), np.tile(np.arange(k), w))
        ):
            raise InputError(
                f"{directory / 'tile_buckets.parquet'} is not the dense {w} tiles x {k} buckets table; {fix}"
            )
        positions = positions.sort_values("offset", kind="stable")
        if not np.array_equal(positions["offset"].to_numpy(), np.arange(len(positions))):
            raise InputError(f"{directory / 'positions.parquet'} offsets are not 0..L-1; {fix}")
        split_tokens = split_nll = None
        if (directory / _SPLIT_FILE).is_file():  # absent from results written before the split was kept
            split = read(_SPLIT_FILE, ["tile", "bucket", "softmask", "tokens", "nll_sum"])
            split = split.sort_values(["tile", "bucket", "softmask"], kind="stable")
            if (
                len(split) != 2 * w * k
                or not np.array_equal(split["tile"].to_numpy(), np.repeat(np.arange(w), 2 * k))
                or not np.array_equal(split["bucket"].to_numpy(), np.tile(np.repeat(np.arange(k), 2), w))
                or not np.array_equal(split["softmask"].to_numpy(bool), np.tile([False, True], w * k))
            ):
                raise InputError(
                    f"{directory / _SPLIT_FILE} is not the dense {w} tiles x {k} buckets x 2 "
                    f"soft-mask classes table; {fix}"
                )
            split_tokens = split["tokens"].to_numpy(np.int64).reshape(w, k, 2)
            split_nll = split["nll_sum"].to_numpy(np.float64).reshape(w, k, 2)
        return cls(
            meta=meta,
            tiles=tiles,
            tile_tokens=cells["tokens"].to_numpy(np.int64).reshape(w, k),
            tile_nll=cells["nll_sum"].to_numpy(np.float64).reshape(w, k),
            position_tokens=positions["tokens"].to_numpy(np.int64),
            position_nll=positions["nll_sum"].to_numpy(np.float64),
            source=directory,
            softmask_tokens=split_tokens,
            softmask_nll=split_nll,
        )


def check_by(by: str | None) -> None:
    """Raise :class:`InputError` unless ``by`` is None or one of :data:`BY_CHOICES`."""
    if by is not None and by not in BY_CHOICES:
        raise InputError(f"--by {by!r} is not a known split; use one of {', '.join(BY_CHOICES)} (or leave it out)")
