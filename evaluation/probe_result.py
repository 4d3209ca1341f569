"""The result of ``genolong probe``: :class:`ProbeResult`, its table, and its result directory.

What a probe measured over ``W`` tiles and ``D`` distances (the counted copy targets and the summed
NLL of both views, ``[W, D]`` each), the per-distance table with block-bootstrap intervals
(:meth:`ProbeResult.table`), and the result directory (format ``genolong-probe/1``, see
:mod:`genolong.evaluation.probe`) it is saved to and loaded from. Torch-free: ``genolong plot`` and
:mod:`genolong.evaluation.plots` read results without the model; :mod:`genolong.evaluation.probe`
(the scoring loop) writes them and re-exports these names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from .bootstrap import block_bootstrap, paired_bootstrap
from .results import _json_default  # meta.json's numpy-aware encoder, as for EvalResult

__all__ = ["PROBE_COLUMNS", "PROBE_FORMAT", "ProbeResult"]

PROBE_FORMAT = "genolong-probe/1"
_FIX = "run `genolong probe CHECKPOINT --store DIR --out {path}` first"

#: Columns of :meth:`ProbeResult.table` (``probe.csv``): one row per distance.
PROBE_COLUMNS = [
    "distance",
    "tiles",
    "tokens",
    "cut_context_lo",
    "cut_context_hi",
    "full_nats",
    "full_ci_lo",
    "full_ci_hi",
    "cut_nats",
    "cut_ci_lo",
    "cut_ci_hi",
    "drop",
    "drop_ci_lo",
    "drop_ci_hi",
    "rel_drop_pct",
    "supported",
]

_TILE_COLUMNS = ["tile", "contig", "start", "length", "eval_tile"]
_REQUIRED_META = ("format", "label", "checkpoint", "store", "split", "context", "repeat_bases", "distances", "tiles")


@dataclass(eq=False)
class ProbeResult:
    """A probe over ``W`` tiles and ``D`` distances.

    Attributes:
        meta: the ``meta.json`` object (settings, label, checkpoint, store, split, tiles, seconds...).
        tiles: one row per probed tile: ``tile`` (0..W-1), ``contig``, ``start`` (genomic), ``length``,
            ``eval_tile`` (its index among the split's :class:`~genolong.data.windows.EvalTiles`).
        tile_tokens: ``[W, D]`` int64 counted copy targets.
        tile_full: ``[W, D]`` float64 summed NLL (nats), full view.
        tile_cut: ``[W, D]`` float64 summed NLL (nats), cut view.
        source: the directory it was loaded from (None in memory).
    """

    meta: dict[str, Any]
    tiles: pd.DataFrame
    tile_tokens: np.ndarray
    tile_full: np.ndarray
    tile_cut: np.ndarray
    source: Path | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tile_tokens = np.asarray(self.tile_tokens, dtype=np.int64)
        self.tile_full = np.asarray(self.tile_full, dtype=np.float64)
        self.tile_cut = np.asarray(self.tile_cut, dtype=np.float64)
        where = f"probe result {self.source}" if self.source is not None else "probe result"
        fix = _FIX.format(path=self.source if self.source is not None else "DIR")
        missing = [k for k in _REQUIRED_META if k not in self.meta]
        if self.meta.get("format") != PROBE_FORMAT or missing:
            raise InputError(
                f"{where}: not a {PROBE_FORMAT} result (format {self.meta.get('format')!r}, missing {missing}); {fix}"
            )
        shape = (int(self.meta["tiles"]), len(self.meta["distances"]))
        if (
            any(x.shape != shape for x in (self.tile_tokens, self.tile_full, self.tile_cut))
            or len(self.tiles) != shape[0]
        ):
            raise InputError(
                f"{where}: arrays {self.tile_tokens.shape}, {self.tile_full.shape}, {self.tile_cut.shape} and "
                f"{len(self.tiles)} tile rows do not match {shape[0]} tiles x {shape[1]} distances; {fix}"
            )

    @property
    def label(self) -> str:
        """Display name."""
        return str(self.meta["label"])

    @property
    def distances(self) -> np.ndarray:
        """``[D]`` int64 distances."""
        return np.asarray(self.meta["distances"], dtype=np.int64)

    @property
    def repeat_bases(self) -> int:
        """``m``, bases per copy."""
        return int(self.meta["repeat_bases"])

    def table(self, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
        """Per distance: mean loss on the copy in both views with block-bootstrap intervals, and the
        drop ``cut - full`` with its paired interval over tiles (same resamples for both views).

        Args:
            n_boot, seed, level: bootstrap replicates (2000), seed (0) and coverage (0.95).

        Returns:
            DataFrame with :data:`PROBE_COLUMNS`: ``distance``, ``tiles`` (with counted targets),
            ``tokens``, ``cut_context_lo`` / ``_hi`` (bases the cut view shows the copy's first and
            last target: ``d - m``, ``d - 1``), ``full_nats`` / ``cut_nats`` with ``_ci_lo`` /
            ``_ci_hi``, ``drop`` (nats) with ``drop_ci_lo`` / ``drop_ci_hi``, ``rel_drop_pct``
            (``100 (1 - full / cut)``) and ``supported`` (the drop's interval excludes 0).
        """
        t, full, cut = self.tile_tokens, self.tile_full, self.tile_cut
        f_mean, f_lo, f_hi = block_bootstrap(t, full, n_boot, seed, level)
        c_mean, c_lo, c_hi = block_bootstrap(t, cut, n_boot, seed, level)
        ci = paired_bootstrap(t, full, t, cut, n_boot, seed, level)  # diff = cut - full: the drop
        d, m = self.distances, self.repeat_bases
        with np.errstate(invalid="ignore"):
            supported = (ci.diff_lo > 0) | (ci.diff_hi < 0)
            rel = 100.0 * (1.0 - f_mean / c_mean)
        table = pd.DataFrame(
            {
                "distance": d,
                "tiles": (t > 0).sum(axis=0).astype(np.int64),
                "tokens": t.sum(axis=0).astype(np.int64),
                "cut_context_lo": d - m,
                "cut_context_hi": d - 1,
                "full_nats": f_mean,
                "full_ci_lo": f_lo,
                "full_ci_hi": f_hi,
                "cut_nats": c_mean,
                "cut_ci_lo": c_lo,
                "cut_ci_hi": c_hi,
                "drop": ci.diff,
                "drop_ci_lo": ci.diff_lo,
                "drop_ci_hi": ci.diff_hi,
                "rel_drop_pct": rel,
                "supported": supported,
            }
        )
        return table[PROBE_COLUMNS]

    def save(self, directory: Path) -> None:
        """Write meta.json, tiles.parquet, probe_tiles.parquet, probe.csv and probe.json into the
        existing ``directory`` (the table with its defaults: 2000 resamples, seed 0, level 0.95)."""
        directory = Path(directory)
        w, k = self.tile_tokens.shape
        (directory / "meta.json").write_text(json.dumps(self.meta, indent=2, default=_json_default) + "\n")
        pq.write_table(
            pa.table(
                {
                    "tile": pa.array(self.tiles["tile"].to_numpy(), pa.int64()),
                    "contig": pa.array(self.tiles["contig"].astype(str).tolist(), pa.string()),
                    "start": pa.array(self.tiles["start"].to_numpy(), pa.int64()),
                    "length": pa.array(self.tiles["length"].to_numpy(), pa.int64()),
                    "eval_tile": pa.array(self.tiles["eval_tile"].to_numpy(), pa.int64()),
                }
            ),
            directory / "tiles.parquet",
        )
        pq.write_table(
            pa.table(
                {
                    "tile": pa.array(np.repeat(np.arange(w, dtype=np.int64), k), pa.int64()),
                    "distance": pa.array(np.tile(self.distances, w), pa.int64()),
                    "tokens": pa.array(self.tile_tokens.ravel(), pa.int64()),
                    "full_nll": pa.array(self.tile_full.ravel(), pa.float64()),
                    "cut_nll": pa.array(self.tile_cut.ravel(), pa.float64()),
                }
            ),
            directory / "probe_tiles.parquet",
        )
        table = self.table()
        table.to_csv(directory / "probe.csv", index=False)
        rows = [
            {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in row.items()}
            for row in table.to_dict(orient="records")
        ]
        (directory / "probe.json").write_text(
            json.dumps(
                {"label": self.label, "repeat_bases": self.repeat_bases, "context": self.meta["context"], "rows": rows},
                indent=1,
                default=_json_default,
            )
            + "\n"
        )

    @classmethod
    def load(cls, directory: Path | str) -> ProbeResult:
        """Read a result directory written by :meth:`save`.

        Raises:
            InputError: one line naming the directory and the fix when it is missing or damaged.
        """
        directory = Path(directory)
        fix = _FIX.format(path=directory)
        meta_path = directory / "meta.json"
        if not meta_path.is_file():
            raise InputError(f"{directory} is not a probe result (no meta.json); {fix}")
        try:
            meta = json.loads(meta_path.read_text())
            tiles = pq.read_table(directory / "tiles.parquet").to_pandas()
            cells = pq.read_table(directory / "probe_tiles.parquet").to_pandas()
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputError(f"probe result {directory} is not readable ({exc}); {fix}") from None
        if not isinstance(meta, dict) or meta.get("format") != PROBE_FORMAT:
            raise InputError(f"{meta_path} is not a {PROBE_FORMAT} result; {fix}")
        w, k = int(meta["tiles"]), len(meta["distances"])
        cells = cells.sort_values(["tile", "distance"], kind="stable")
        if len(cells) != w * k or not np.array_equal(cells["tile"].to_numpy(), np.repeat(np.arange(w), k)):
            raise InputError(
                f"{directory / 'probe_tiles.parquet'} is not the dense {w} tiles x {k} distances table; {fix}"
            )
        return cls(
            meta=meta,
            tiles=tiles[_TILE_COLUMNS],
            tile_tokens=cells["tokens"].to_numpy(np.int64).reshape(w, k),
            tile_full=cells["full_nll"].to_numpy(np.float64).reshape(w, k),
            tile_cut=cells["cut_nll"].to_numpy(np.float64).reshape(w, k),
            source=directory,
        )
