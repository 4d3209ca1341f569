"""Figures of evaluation results: per-position loss, bucket means with CIs, relative change.

Every figure is drawn only from the saved tables of :class:`~genolong.evaluation.results.EvalResult`
(per-offset sums, per-tile-and-bucket sums) and every function returns, with the figure, the
DataFrame of exactly the series it drew; :func:`plot_results` saves that table beside the figure as
CSV. Figures are plain :class:`matplotlib.figure.Figure` objects (Agg canvas, no pyplot), so
nothing leaks into a global figure registry and no display is needed.

Colours: the Okabe-Ito palette (distinguishable with the common colour-vision deficiencies).
Units: loss in nats per base (natural-log NLL of the next base), relative change in percent.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from ..errors import InputError
from ..files import replace_file
from .probe_result import ProbeResult
from .report import softmask_name
from .results import EvalResult, check_by
from .stats import check_comparable, compare, format_bases

__all__ = [
    "OKABE_ITO",
    "position_figure",
    "bucket_figure",
    "relative_change_figure",
    "plot_results",
    "probe_figure",
    "save_probe_figure",
]

log = logging.getLogger(__name__)

# Okabe & Ito (2008), ordered so that the first runs get the most distinct colours.
OKABE_ITO = ("#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")

_LOSS_UNITS = "loss (nats/base)"


def _colour(i: int) -> str:
    return OKABE_ITO[i % len(OKABE_ITO)]


def _figure(width: float = 7.0, height: float = 4.2) -> tuple[Figure, object]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # an explicit Agg canvas: savefig and rendering never touch pyplot
    return fig, fig.add_subplot()


def _run_names(results: Sequence[EvalResult]) -> list[str]:
    """Legend names: each run's label, made unique by a suffix when two runs share one."""
    names: list[str] = []
    for r in results:
        name, n = r.label, 2
        while name in names:
            name, n = f"{r.label} ({n})", n + 1
        names.append(name)
    return names


def _need(results: Sequence[EvalResult], at_least: int, what: str) -> None:
    if len(results) < at_least:
        raise InputError(
            f"{what} needs at least {at_least} evaluation result(s), got {len(results)}; pass more RESULT_DIR arguments"
        )


def position_figure(results: Sequence[EvalResult], bins_per_octave: int = 8) -> tuple[Figure, pd.DataFrame]:
    """Per-position loss vs preceding bases (log x), one line per run, smoothed over log-spaced bins.

    Args:
        results: the runs to overlay (legend = each run's label).
        bins_per_octave: offset bins per doubling (default 8; see ``EvalResult.position_curve``).

    Returns:
        ``(figure, series)``: ``series`` has one row per plotted point: ``run`` (legend name),
        ``lo``, ``hi``, ``offset_mid`` (x), ``tokens``, ``nats`` (y). Bins without tokens are
        not drawn and not listed.
    """
    _need(results, 1, "the per-position plot")
    fig, ax = _figure()
    parts = []
    for i, (r, name) in enumerate(zip(results, _run_names(results))):
        curve = r.position_curve(bins_per_octave)
        curve = curve[curve["tokens"] > 0].reset_index(drop=True)
        ax.plot(
            curve["offset_mid"].to_numpy(),
            curve["nats"].to_numpy(),
            color=_colour(i),
            lw=1.6,
            marker="o",
            ms=2.5,
            label=name,
        )
        parts.append(curve.assign(run=name))
    ax.set_xscale("log", base=2)
    # ticks at powers of two, written as lengths ("512", "1k", "1M")
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda v, _pos: format_bases(int(v)) if v >= 1 and float(v).is_integer() else "")
    )
    ax.set_xlabel("preceding bases in the tile (offset, log scale)")
    ax.set_ylabel(_LOSS_UNITS)
    ax.set_title("Per-position held-out loss vs preceding context")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", frameon=False)
    series = pd.concat(parts, ignore_index=True)[["run", "lo", "hi", "offset_mid", "tokens", "nats"]]
    return fig, series


def _bucket_key(bucket: str, lo: int, hi: int) -> tuple[int, int, str]:
    # every run's overall row shares the one "all" category, whatever its context
    return (-1, -1, "all") if bucket == "all" else (int(lo), int(hi), str(bucket))


def _bucket_axis(tables: Sequence[pd.DataFrame]) -> list[tuple[int, int, str]]:
    """Union of the bucket rows of several tables, ordered by offset range, then one "all"."""
    keys = {_bucket_key(b, lo, hi) for t in tables for b, lo, hi in zip(t["bucket"], t["lo"], t["hi"])}
    return sorted(k for k in keys if k[2] != "all") + [k for k in keys if k[2] == "all"]


def _dodge(n_runs: int, width: float = 0.6) -> np.ndarray:
    """Horizontal offsets that set ``n_runs`` series side by side inside one category."""
    if n_runs == 1:
        return np.zeros(1)
    return np.linspace(-width / 2, width / 2, n_runs)


def _panels(n: int, width: float, height: float = 4.2) -> tuple[Figure, list]:
    """A figure of ``n`` side-by-side panels sharing the y axis (one panel: as :func:`_figure`)."""
    if n == 1:
        fig, ax = _figure(width, height)
        return fig, [ax]
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, n, sharey=True))


def _by_class(tables: Sequence[pd.DataFrame], by: str | None) -> tuple[list[bool | None], list[list[pd.DataFrame]]]:
    """The panels of a figure: ``[None]`` and each table as it is (pooled), or ``[False, True]``
    and each split table's unmasked and soft-masked rows (``by="softmask"``)."""
    if by is None:
        return [None], [[t] for t in tables]
    panels: list[bool | None] = [False, True]
    return panels, [
        [t[t["softmask"] == m].drop(columns="softmask").reset_index(drop=True) for m in panels] for t in tables
    ]


def _category_axis(ax: object, axis: Sequence[tuple[int, int, str]]) -> None:
    ax.xaxis.set_major_locator(FixedLocator(np.arange(len(axis), dtype=float)))  # type: ignore[attr-defined]
    ax.xaxis.set_minor_locator(NullLocator())  # type: ignore[attr-defined]
    ax.set_xticklabels([b for _, _, b in axis])  # type: ignore[attr-defined]
    ax.set_xlim(-0.6, len(axis) - 0.4)  # type: ignore[attr-defined]
    ax.set_xlabel("preceding context (bases before the target in its tile)")  # type: ignore[attr-defined]
    ax.grid(True, axis="y", alpha=0.3)  # type: ignore[attr-defined]


def _finish(fig: Figure, axes: list, panels: Sequence[bool | None], title: str, n_series: int) -> None:
    """Titles and the one legend (below the axes, so that it never hides an interval)."""
    if panels == [None]:
        axes[0].set_title(title)
    else:
        fig.suptitle(title)
        for ax, m in zip(axes, panels):
            ax.set_title(f"{softmask_name(bool(m))} bases" + (" (lower case: repeats)" if m else ""))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(n_series, 2), frameon=False)


def bucket_figure(
    results: Sequence[EvalResult], n_boot: int = 2000, seed: int = 0, level: float = 0.95, by: str | None = None
) -> tuple[Figure, pd.DataFrame]:
    """Mean loss per preceding-context bucket (and overall) with block-bootstrap CIs, runs side by side.

    Args:
        results: the runs (buckets of runs with other contexts are merged by offset range).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and CI coverage (0.95).
        by: None (default): all bases pooled, one panel; ``"softmask"``: two panels, the unmasked
            and the soft-masked bases (``EvalResult.bucket_table(by="softmask")``).

    Returns:
        ``(figure, series)``: one row per drawn point: ``run``, (with ``by``: ``softmask``),
        ``bucket``, ``lo``, ``hi``, ``x`` (position on the axis), ``tokens``, ``nats`` (marker),
        ``ci_lo``, ``ci_hi`` (the vertical interval). Buckets without tokens are not drawn.
    """
    _need(results, 1, "the bucket plot")
    check_by(by)
    panels, tables = _by_class([r.bucket_table(n_boot, seed, level, by=by) for r in results], by)
    axis = _bucket_axis([t for ts in tables for t in ts])
    where = {key: j for j, key in enumerate(axis)}
    dodge = _dodge(len(results))
    fig, axes = _panels(len(panels), len(panels) * max(6.0, 1.1 * len(axis) + 2.0))
    parts = []
    for p, (ax, m) in enumerate(zip(axes, panels)):
        for i, (run_tables, name) in enumerate(zip(tables, _run_names(results))):
            t = run_tables[p]
            t = t[t["tokens"] > 0].copy()
            t["x"] = [where[_bucket_key(b, lo, hi)] + dodge[i] for b, lo, hi in zip(t["bucket"], t["lo"], t["hi"])]
            x = t["x"].to_numpy()
            ax.vlines(x, t["ci_lo"].to_numpy(), t["ci_hi"].to_numpy(), color=_colour(i), lw=1.6)
            ax.plot(x, t["nats"].to_numpy(), ls="none", marker="o", ms=5, color=_colour(i), label=name)
            parts.append(t.assign(run=name) if m is None else t.assign(run=name, softmask=m))
        _category_axis(ax, axis)
    axes[0].set_ylabel(_LOSS_UNITS)
    _finish(
        fig,
        axes,
        panels,
        f"Held-out loss by preceding context ({level:.0%} block-bootstrap CI over tiles)",
        len(results),
    )
    cols = ["run", *([] if by is None else ["softmask"]), "bucket", "lo", "hi", "x", "tokens", "nats", "ci_lo", "ci_hi"]
    return fig, pd.concat(parts, ignore_index=True)[cols]


def relative_change_figure(
    results: Sequence[EvalResult], n_boot: int = 2000, seed: int = 0, level: float = 0.95, by: str | None = None
) -> tuple[Figure, pd.DataFrame]:
    """Relative change of loss (%) of each later run vs the first, per bucket, with paired CIs.

    Negative = the later run has lower loss. The first run is the reference (e.g. the base model,
    or the ``--context-cut`` run of the same model).

    Args:
        results: reference first, then the runs compared with it (at least 2, all on the same token
            set; otherwise :class:`InputError` from :func:`~genolong.evaluation.stats.compare`).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and CI coverage (0.95).
        by: None (default): all bases pooled, one panel; ``"softmask"``: two panels, the unmasked
            and the soft-masked bases (``compare(by="softmask")``: one paired bootstrap for both).

    Returns:
        ``(figure, series)``: one row per drawn point: ``run``, ``reference``, (with ``by``:
        ``softmask``), ``bucket``, ``lo``, ``hi``, ``x``, ``tokens``, ``rel_pct`` (marker),
        ``rel_ci_lo``, ``rel_ci_hi`` (interval), ``supported``.
    """
    _need(results, 2, "the relative-change plot")
    check_by(by)
    names = _run_names(results)
    panels, tables = _by_class([compare(results[0], r, n_boot, seed, level, by=by) for r in results[1:]], by)
    first = tables[0][0]
    axis = [(int(lo), int(hi), str(b)) for b, lo, hi in zip(first["bucket"], first["lo"], first["hi"])]
    dodge = _dodge(len(tables))
    fig, axes = _panels(len(panels), len(panels) * max(6.0, 1.1 * len(axis) + 2.0))
    parts = []
    for p, (ax, m) in enumerate(zip(axes, panels)):
        ax.axhline(0.0, color="#000000", lw=0.8)
        for i, (run_tables, name) in enumerate(zip(tables, names[1:])):
            table = run_tables[p]
            t = table[table["tokens"] > 0].copy()
            t["x"] = np.flatnonzero(table["tokens"].to_numpy() > 0) + dodge[i]
            x = t["x"].to_numpy()
            colour = _colour(i + 1)  # the colour each run has in the other figures
            ax.vlines(x, t["rel_ci_lo"].to_numpy(), t["rel_ci_hi"].to_numpy(), color=colour, lw=1.6)
            ax.plot(
                x, t["rel_pct"].to_numpy(), ls="none", marker="o", ms=5, color=colour, label=f"{name} vs {names[0]}"
            )
            t = t.assign(run=name, reference=names[0])
            parts.append(t if m is None else t.assign(softmask=m))
        _category_axis(ax, axis)
    axes[0].set_ylabel("relative change in loss (%)")
    _finish(
        fig,
        axes,
        panels,
        f"Change in loss vs {names[0]}\n(paired {level:.0%} block-bootstrap CI; below 0 = lower loss)",
        len(tables),
    )
    cols = [
        "run",
        "reference",
        *([] if by is None else ["softmask"]),
        "bucket",
        "lo",
        "hi",
        "x",
        "tokens",
        "rel_pct",
        "rel_ci_lo",
        "rel_ci_hi",
        "supported",
    ]
    return fig, pd.concat(parts, ignore_index=True)[cols]


def _save(
    fig: Figure, series: pd.DataFrame, out: Path, stem: str, formats: Sequence[str], written: dict[str, Path]
) -> None:
    for fmt in formats:
        path = out / f"{stem}.{fmt}"
        # no creation date in the PDF, so that the same tables give the same bytes
        meta = {"CreationDate": None} if fmt == "pdf" else None
        replace_file(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=150, metadata=meta, bbox_inches="tight"))
        written[path.name] = path
    path = out / f"{stem}.csv"
    replace_file(path, lambda tmp: series.to_csv(tmp, index=False))
    written[path.name] = path


def plot_results(
    results: Sequence[EvalResult],
    out: Path,
    formats: Sequence[str] = ("png", "pdf"),
    n_boot: int = 2000,
    seed: int = 0,
    bins_per_octave: int = 8,
    by: str | None = None,
) -> dict[str, Path]:
    """Draw and save all figures of ``results`` into ``out`` (created if needed).

    Writes ``position_loss.{fmt}``, ``buckets.{fmt}`` (with ``by``: ``buckets_softmask.{fmt}``) and, when at least two runs are given,
    ``relative_change.{fmt}`` (later runs vs the first; a run whose token set differs from the
    first's is left out with one warning; the figure is skipped when none is comparable), each with
    a ``.csv`` of the exact series drawn. Each file is written to a temporary name and renamed, so
    nothing is half-written.

    Args:
        results: the runs; the first is the reference of the relative-change figure.
        out: output directory.
        formats: figure formats (default png and pdf; any format matplotlib's Agg canvas writes).
        n_boot, seed: bootstrap replicates (2000) and seed (0).
        bins_per_octave: smoothing of the per-position curve (default 8).
        by: ``"softmask"``: also ``buckets_softmask`` and ``relative_change_softmask`` (two panels:
            unmasked and soft-masked bases); every result must keep the split (else
            :class:`InputError` before anything is written). Default None.

    Returns:
        ``{file name: path}`` of every file written.
    """
    _need(results, 1, "genolong plot")
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    bad = [f for f in formats if f not in supported]
    if bad:
        raise InputError(f"unknown figure format(s) {', '.join(bad)}; use some of {', '.join(sorted(supported))}")
    check_by(by)
    if by is not None:
        for r in results:
            r.require_softmask()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    fig, series = position_figure(results, bins_per_octave)
    _save(fig, series, out, "position_loss", formats, written)
    fig, series = bucket_figure(results, n_boot, seed)
    _save(fig, series, out, "buckets", formats, written)
    if by is not None:
        fig, series = bucket_figure(results, n_boot, seed, by=by)
        _save(fig, series, out, f"buckets_{by}", formats, written)
    if len(results) >= 2:
        keep = [results[0]]
        for r in results[1:]:
            try:
                check_comparable(results[0], r)
            except InputError as exc:
                log.warning("relative-change figure leaves out %s: %s", r.label, exc)
            else:
                keep.append(r)
        if len(keep) >= 2:
            fig, series = relative_change_figure(keep, n_boot, seed)
            _save(fig, series, out, "relative_change", formats, written)
            if by is not None:
                fig, series = relative_change_figure(keep, n_boot, seed, by=by)
                _save(fig, series, out, f"relative_change_{by}", formats, written)
    return written


def probe_figure(
    results: Sequence[ProbeResult],
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    marks: Sequence[tuple[int, str]] = (),
) -> tuple[Figure, pd.DataFrame]:
    """The planted-repeat probe (``genolong probe``): loss on the copy by distance in both views
    (top), and the drop ``cut - full`` with its paired interval (bottom), one colour per run.

    Args:
        results: probe results (overlaid; e.g. the base and the fine-tuned model on the same tiles).
        n_boot, seed, level: bootstrap replicates (2000), seed (0) and CI coverage (0.95).
        marks: vertical reference lines ``(bases, text)``, e.g. ``[(1024, "base trained at 1k")]``.

    Returns:
        ``(figure, series)``: the rows of each run's :meth:`ProbeResult.table` with a ``run`` column
        (what was drawn: the means, intervals and drops).
    """
    _need(results, 1, "the probe figure")
    fig = Figure(figsize=(7.0, 6.0), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1.0, 1.0))
    names = _run_names(results)  # type: ignore[arg-type]  # only .label is read
    parts = []
    for i, (r, name) in enumerate(zip(results, names)):
        t = r.table(n_boot, seed, level)
        x = t["distance"].to_numpy(np.float64)
        colour = _colour(i)
        top.plot(x, t["full_nats"].to_numpy(), color=colour, marker="o", ms=4, lw=1.6, label=f"{name}: source in view")
        top.fill_between(x, t["full_ci_lo"].to_numpy(), t["full_ci_hi"].to_numpy(), color=colour, alpha=0.15, lw=0)
        top.plot(
            x, t["cut_nats"].to_numpy(), color=colour, marker="s", ms=4, lw=1.2, ls="--", label=f"{name}: cut below d"
        )
        drop = t["drop"].to_numpy()
        bottom.vlines(x, t["drop_ci_lo"].to_numpy(), t["drop_ci_hi"].to_numpy(), color=colour, lw=1.6)
        bottom.plot(x, drop, color=colour, marker="o", ms=5, lw=1.0, label=name)
        parts.append(t.assign(run=name))
    bottom.axhline(0.0, color="#000000", lw=0.8)
    for bases, text in marks:
        for ax in (top, bottom):
            ax.axvline(bases, color="#999999", lw=1.0, ls=":")
        top.annotate(
            text,
            (bases, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=8,
            color="#555555",
        )
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda v, _pos: format_bases(int(v)) if v >= 1 and float(v).is_integer() else "")
        )
        ax.grid(True, which="major", alpha=0.3)
    m = results[0].repeat_bases
    top.set_ylabel(f"loss on the {m}-base copy\n(nats/base)")
    top.set_title(f"Planted-repeat recall: a {m}-base copy d bases after its source ({level:.0%} CIs over tiles)")
    top.legend(loc="best", frameon=False, fontsize=8)
    bottom.set_ylabel("drop = cut - full (nats/base)\n(paired CI; > 0: recalled)")
    bottom.set_xlabel("distance d from the source to its copy (bases, log scale)")
    if len(results) > 1:
        bottom.legend(loc="best", frameon=False, fontsize=8)
    return fig, pd.concat(parts, ignore_index=True)


def save_probe_figure(
    results: Sequence[ProbeResult],
    out: Path,
    formats: Sequence[str] = ("png", "pdf"),
    n_boot: int = 2000,
    seed: int = 0,
    marks: Sequence[tuple[int, str]] = (),
    stem: str = "probe",
) -> dict[str, Path]:
    """Draw :func:`probe_figure` and save ``out/<stem>.{png,pdf}`` and ``out/<stem>_series.csv``
    (the series drawn), each through a temporary name; returns ``{file name: path}``."""
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    bad = [f for f in formats if f not in supported]
    if bad:
        raise InputError(f"unknown figure format(s) {', '.join(bad)}; use some of {', '.join(sorted(supported))}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    fig, series = probe_figure(results, n_boot, seed, marks=marks)
    for fmt in formats:
        path = out / f"{stem}.{fmt}"
        meta = {"CreationDate": None} if fmt == "pdf" else None  # same tables, same bytes
        replace_file(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=150, metadata=meta, bbox_inches="tight"))
        written[path.name] = path
    # not <stem>.csv: in a probe result directory probe.csv is the result's own table
    path = out / f"{stem}_series.csv"
    replace_file(path, lambda tmp: series.to_csv(tmp, index=False))
    written[path.name] = path
    return written
