"""Plain-text and Markdown renderings of the evaluation tables (terminal output and REPORT.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ..files import replace_file

__all__ = [
    "format_bucket_table",
    "format_compare_table",
    "format_gap_table",
    "format_probe_table",
    "format_routing_table",
    "markdown_table",
    "softmask_name",
    "write_table",
]


def write_table(table: pd.DataFrame, path: Path) -> None:
    """Write ``table`` as CSV to ``path`` (parent created), through a temporary name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda tmp: table.to_csv(tmp, index=False))


def _num(value: float, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub-flavoured Markdown table (also readable as plain text)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def softmask_name(softmask: bool) -> str:
    """How the tables name a soft-mask class: "soft-masked" (lower case: repeats) or "unmasked"."""
    return "soft-masked" if bool(softmask) else "unmasked"


def _split(table: pd.DataFrame, rows: list[list[str]], header: list[str]) -> tuple[list[list[str]], list[str]]:
    """Prefix a "bases" column when ``table`` is split by soft-masking (has a ``softmask`` column)."""
    if "softmask" not in table.columns:
        return rows, header
    return [[softmask_name(m), *row] for m, row in zip(table["softmask"], rows)], ["bases", *header]


def format_bucket_table(table: pd.DataFrame) -> str:
    """The bucket table (``EvalResult.bucket_table()``, pooled or ``by="softmask"``) as Markdown:
    tokens, nats and bits per base with their 95% block-bootstrap intervals."""
    rows = [
        [
            str(r.bucket),
            f"{int(r.tokens):,}",
            _num(r.nats, 4),
            f"[{_num(r.ci_lo, 4)}, {_num(r.ci_hi, 4)}]",
            _num(r.bits, 4),
        ]
        for r in table.itertuples()
    ]
    return markdown_table(*_split(table, rows, ["preceding bases", "tokens", "nats/base", "95% CI", "bits/base"]))


def format_compare_table(table: pd.DataFrame, a: str, b: str) -> str:
    """A ``compare`` table (pooled or ``by="softmask"``) as Markdown: both means, the change B - A
    with its paired 95% CI, the relative change, and whether the CI excludes zero."""
    rows = [
        [
            str(r.bucket),
            f"{int(r.tokens):,}",
            _num(r.a_nats, 4),
            _num(r.b_nats, 4),
            f"{_num(r.diff, 4)} [{_num(r.diff_ci_lo, 4)}, {_num(r.diff_ci_hi, 4)}]",
            f"{_num(r.rel_pct, 2)}% [{_num(r.rel_ci_lo, 2)}, {_num(r.rel_ci_hi, 2)}]",
            "yes" if bool(r.supported) else "no",
        ]
        for r in table.itertuples()
    ]
    return markdown_table(
        *_split(
            table,
            rows,
            [
                "preceding bases",
                "tokens",
                f"{a} nats",
                f"{b} nats",
                "B - A (95% CI)",
                "change (95% CI)",
                "CI excludes 0",
            ],
        )
    )


def format_gap_table(gap: pd.DataFrame) -> str:
    """The soft-mask gap table (``stats.compare_softmask``'s second) as Markdown: each class's
    relative change and their difference (soft-masked - unmasked, percentage points) with its paired
    95% CI, and whether that CI excludes zero."""
    rows = [
        [
            str(r.bucket),
            f"{int(r.unmasked_tokens):,}",
            f"{int(r.masked_tokens):,}",
            f"{_num(r.unmasked_rel_pct, 2)}% [{_num(r.unmasked_rel_ci_lo, 2)}, {_num(r.unmasked_rel_ci_hi, 2)}]",
            f"{_num(r.masked_rel_pct, 2)}% [{_num(r.masked_rel_ci_lo, 2)}, {_num(r.masked_rel_ci_hi, 2)}]",
            f"{_num(r.gap_pct, 2)} [{_num(r.gap_ci_lo, 2)}, {_num(r.gap_ci_hi, 2)}]",
            "yes" if bool(r.supported) else "no",
        ]
        for r in gap.itertuples()
    ]
    return markdown_table(
        rows,
        [
            "preceding bases",
            "unmasked tokens",
            "soft-masked tokens",
            "change, unmasked (95% CI)",
            "change, soft-masked (95% CI)",
            "soft-masked - unmasked, points (95% CI)",
            "CI excludes 0",
        ],
    )


def format_routing_table(routing: list[dict]) -> str:
    """An evaluation's routing statistics (``meta.json``'s ``routing``, one entry per MoE layer)
    as Markdown: load max/mean (1.0 balanced), dead experts, the busiest expert's share of the
    tokens and the mean router entropy (nats)."""
    rows = [
        [
            str(r["layer"]),
            _num(r["load_max_over_mean"], 2),
            f"{r['dead_experts']} of {len(r['load'])}",
            f"{100 * r['top_expert_share']:.0f}%",
            _num(r["router_entropy"], 3),
        ]
        for r in routing
    ]
    return markdown_table(
        rows, ["MoE layer", "load max/mean", "dead experts", "busiest expert's tokens", "router entropy"]
    )


def format_probe_table(table: pd.DataFrame) -> str:
    """A probe table (``ProbeResult.table()``) as Markdown: per distance, the loss on the copy with
    the source in view and with the view cut below the distance (bases the cut view shows), the drop
    cut - full with its paired 95% CI, and whether the CI excludes zero."""
    rows = [
        [
            f"{int(r.distance):,}",
            str(int(r.tiles)),
            f"{int(r.tokens):,}",
            _num(r.full_nats, 4),
            f"{_num(r.cut_nats, 4)} ({int(r.cut_context_lo):,}-{int(r.cut_context_hi):,})",
            f"{_num(r.drop, 4)} [{_num(r.drop_ci_lo, 4)}, {_num(r.drop_ci_hi, 4)}]",
            "yes" if bool(r.supported) else "no",
        ]
        for r in table.itertuples()
    ]
    return markdown_table(
        rows,
        [
            "distance d",
            "tiles",
            "copy bases",
            "full view nats",
            "cut view nats (bases seen)",
            "drop = cut - full (95% CI)",
            "CI excludes 0",
        ],
    )
