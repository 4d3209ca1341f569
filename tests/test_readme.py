"""The README stays a short front page, and the README's and the docs' links lead somewhere.

The README is what a newcomer reads first (and PyPI shows): under 12 KB, its first screen says
what genolong is and shows the two set-up commands as written, the quickstart figure with a
one-sentence caption, the command table and the links, and CI (``.ci/run``) runs its test command
verbatim and builds the docs strictly. Every percentage and ratio the README and the docs quote
is a row of BENCHMARKS.md's claims table, which opens that page (<= 40 KB). Every relative link in
README.md and docs/*.md names a file of the repository (``mkdocs build --strict`` checks the
anchors and the API reference's cross-references; this needs no docs extra).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "BENCHMARKS.md"
#: "BENCHMARKS.md as a results page (<= 40 KB)", issue 48
MAX_BENCHMARKS_BYTES = 40_000
#: "under 12 KB", in bytes as stored
MAX_README_BYTES = 12_000
#: a screen of a terminal or of a repository page
FIRST_SCREEN_LINES = 30
SETUP_COMMANDS = (
    "pip install -q torch==2.13.0 -e . && genolong quickstart",
    "pip install -q -e '.[test]' && python -m pytest -q",
)
FIGURE = "docs/quickstart-relative-change.png"

_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_SNIPPET = re.compile(r"^--8<--\s+\"([^\"]+)\"\s*$", re.MULTILINE)


def relative_links(markdown: str) -> list[str]:
    """The relative link targets of ``markdown`` (inline links, images, reference definitions),
    each without its ``#anchor``; code blocks and code spans hold no links, and URLs with a scheme
    (``https:``, ``mailto:``) and same-page anchors are not relative."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    targets = _INLINE_LINK.findall(text) + _REFERENCE_DEFINITION.findall(text)
    found = []
    for target in targets:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        found.append(target.split("#", 1)[0])
    return found


def broken_links(path: Path) -> list[str]:
    """Relative links of the Markdown file ``path`` whose target is not a file or directory
    (resolved against the file's directory), and included snippets (``--8<-- "FILE:..."``,
    resolved against the repository root as mkdocs.yml's ``base_path`` says) that do not exist."""
    text = path.read_text()
    broken = [t for t in relative_links(text) if not (path.parent / t).exists()]
    included = [s.split(":", 1)[0] for s in _SNIPPET.findall(text)]
    broken += [name for name in included if not (ROOT / name).is_file()]
    return broken


def setup_block(readme: str) -> list[str]:
    """The lines of the README's first code block, which must stand on its first screen (the
    ``## Set up`` section further down explains the two commands)."""
    first = "\n".join(readme.splitlines()[:FIRST_SCREEN_LINES])
    block = re.search(r"^```[a-z]*\n(.*?)^```", first, re.MULTILINE | re.DOTALL)
    assert block is not None, "no code block on the README's first screen"
    assert "\n## Set up" in readme, "the README keeps its ## Set up section"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_is_under_12_kb() -> None:
    size = len(README.read_bytes())
    assert size < MAX_README_BYTES, f"README.md is {size:,} bytes; move detail to docs/ (limit {MAX_README_BYTES:,})"


def test_first_screen_says_what_it_is_and_shows_the_figure_and_the_command_table() -> None:
    first = README.read_text().splitlines()[:FIRST_SCREEN_LINES]
    paragraphs = [p for p in "\n".join(first).split("\n\n") if p.strip()]
    assert paragraphs[0] == "# genolong"
    opening = " ".join(paragraphs[1].split())  # what it is, in the first lines under the title
    assert "DNA language models" in opening and "context" in opening, opening
    figures = [line for line in first if line.startswith("![") and f"]({FIGURE})" in line]
    assert len(figures) == 1, f"the first screen shows {FIGURE} once"
    assert (ROOT / FIGURE).read_bytes().startswith(b"\x89PNG")
    caption = first[first.index(figures[0]) + 2]
    assert caption.startswith("*From `genolong quickstart`"), "the figure keeps its caption"
    # one sentence: the intervals live in docs/index.md and BENCHMARKS.md, not under the figure
    assert caption.endswith(".*") and ". " not in caption and not re.search(r"\d\.\d+%", caption), caption
    links = [line for line in first if line.startswith("[Documentation](docs/index.md)")]
    assert len(links) == 1 and "(BENCHMARKS.md)" in links[0], "the first screen links the docs and the benchmarks"
    assert "| command | what it does |" in first
    rows = {line.split("|")[1].strip() for line in first if line.startswith("| `genolong")}
    for command in (
        "quickstart",
        "prepare",
        "plan",
        "finetune",
        "evaluate",
        "compare",
        "probe",
        "check-logprobs",
        "recipe schema",
    ):
        assert any(row.startswith(f"`genolong {command}") for row in rows), f"no row for genolong {command}"


def test_the_two_set_up_commands_and_ci_runs_the_test_command_verbatim() -> None:
    lines = setup_block(README.read_text())
    assert tuple(lines) == SETUP_COMMANDS
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [line for line in ci if line and not line.startswith("#")]
    assert lines[1] in runs, ".ci/run must run the README's test command as written"


def test_ci_builds_the_docs_strictly() -> None:
    """``.ci/run`` installs the docs extra and runs ``mkdocs build --strict``, never with
    ``--quiet``: mkdocs then drops its warnings before strict mode counts them (a broken link
    passed)."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [line for line in ci if line and not line.startswith("#")]
    assert "pip install -q -e '.[docs]'" in runs
    builds = [line for line in runs if "mkdocs build" in line]
    assert len(builds) == 1 and "--strict" in builds[0].split(), builds
    assert not {"--quiet", "-q"} & set(builds[0].split()), builds[0]


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path: Path) -> None:
    assert broken_links(path) == []


def test_link_finder_sees_links_and_ignores_code(tmp_path: Path) -> None:
    """The link checks above can fail: the finder reports a missing target and skips what is not
    a link."""
    (tmp_path / "here.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](here.md#anchor) ![figure](missing.png) [ext](https://example.org/x.md) [top](#top)\n"
        "`[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n\n"
        '[ref]: gone.md\n--8<-- "no-such-file.md:3:"\n'
    )
    assert relative_links(page.read_text()) == ["here.md", "missing.png", "gone.md"]
    assert broken_links(page) == ["missing.png", "gone.md", "no-such-file.md"]


# -- every quoted figure is a row of BENCHMARKS.md's claims table ----------------------------------

#: a percentage or a ratio ("1.20%", "-0.43%", "68x", "0.29x"); the sign is not part of the figure
_FIGURE = re.compile(r"(?<![\w.])[-+]?(\d[\d,]*(?:\.\d+)?(?:%|x))(?![\w%])")
#: a paragraph of the docs that cites a measurement
_CITES = re.compile(r"BENCHMARKS\.md|benchmarks\.md|benchmarks/\w+\.py")
#: figures that are not measurements of genolong, with the reason
NOT_MEASURED = {
    "95%": "the confidence level of an interval",
    "4.8%": "the published reference result genolong reproduces (GLM-5.3-Flash, 80 steps)",
}
#: pages that quote no claim of their own: the page that includes BENCHMARKS.md, the version
#: checks (dated notes, not claims) and the generated import map
NOT_CLAIMS = {"benchmarks.md", "contributing.md", "architecture.md"}


def claims_table(text: str) -> list[dict[str, str]]:
    """The rows of the table under ``## Claims`` in BENCHMARKS.md's text, as dicts by column."""
    section = text.split("\n## Claims\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip().strip("|").split("|")))) for line in lines[2:]]


def quoted_figures(markdown: str, every_paragraph: bool) -> set[str]:
    """The percentages and ratios of ``markdown``'s prose (code blocks left out), unsigned: of every
    paragraph (the README) or of the paragraphs that cite a benchmark (the docs)."""
    found: set[str] = set()
    for paragraph in _FENCE.sub("", markdown).split("\n\n"):
        if every_paragraph or _CITES.search(paragraph):
            found |= set(_FIGURE.findall(paragraph))
    return found - set(NOT_MEASURED)


def untraced(pages: dict[str, tuple[str, bool]], benchmarks: str) -> list[str]:
    """``"PAGE: FIGURE"`` for each figure quoted by ``pages`` (name -> (text, every paragraph?))
    that no row of the claims table shows in its figure column."""
    table = {f for row in claims_table(benchmarks) for f in _FIGURE.findall(row["figure"])}
    return [
        f"{name}: {figure}"
        for name, (text, every) in pages.items()
        for figure in sorted(quoted_figures(text, every))
        if figure not in table
    ]


def test_benchmarks_opens_with_the_claims_table_and_stays_under_40_kb() -> None:
    text = BENCHMARKS.read_text()
    size = len(text.encode())
    assert size <= MAX_BENCHMARKS_BYTES, f"BENCHMARKS.md is {size:,} bytes (limit {MAX_BENCHMARKS_BYTES:,})"
    assert [line for line in text.splitlines() if line.startswith("## ")][0] == "## Claims"
    rows = claims_table(text)
    assert rows and list(rows[0]) == ["claim", "figure", "baseline", "command", "date"]
    for row in rows:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
        assert row["command"].startswith("`") and row["figure"], row


def test_every_figure_the_readme_and_docs_quote_is_in_the_claims_table() -> None:
    pages = {"README.md": (README.read_text(), True)}
    pages |= {f"docs/{p.name}": (p.read_text(), False) for p in sorted(DOCS.glob("*.md")) if p.name not in NOT_CLAIMS}
    assert untraced(pages, BENCHMARKS.read_text()) == []


def test_the_trace_finds_a_figure_missing_from_the_table() -> None:
    """The check can fail: a README figure absent from the table is reported, a docs paragraph
    without a citation is not read, the sign and the confidence level do not count."""
    benchmarks = (
        "# B\n\n## Claims\n\n| claim | figure | baseline | command | date |\n|---|---|---|---|---|\n"
        "| a | 1.20%, 68x | b | `c` | 2026-12-07 |\n\n## Prepare\n\n| 9.9x |\n"
    )
    readme = "loss -1.20% [95% CI 0.9, 1.4], 68x less CPU, 3.7x less memory, 9.9x\n"
    docs = "quiet 5.5x\n\nloud 2.5% ([B](benchmarks.md#x)) and +1.20%\n"
    assert untraced({"README.md": (readme, True), "docs/x.md": (docs, False)}, benchmarks) == [
        "README.md: 3.7x",
        "README.md: 9.9x",
        "docs/x.md: 2.5%",
    ]


# -- the spread figures the README, the docs and the quickstart's REPORT quote are the benchmark's -----

SPREAD_JSON = ROOT / "benchmarks" / "results" / "heldout_spread.json"


def spread_figures(doc: dict, comparison: str | None = None) -> dict[str, str]:
    """The phrases the pages quote from ``benchmarks/heldout_spread.py``'s JSON ``doc``: what the context
    beyond the cut is worth (the gain, ``-(full - cut)``) in ``comparison`` (default: the JSON's headline,
    the fine-tuned model's), pooled over the regions with its interval, the range across regions, and the
    quickstart's own region (chr22) alone."""
    comparison = comparison or doc["headline"]
    pooled = doc["pooled"][comparison]
    last = next(iter(doc["regions"].values()))["buckets"][-1]
    out = {}
    for key, bucket in (("all", "all"), ("last", last)):
        p = pooled["buckets"][bucket]
        low, high = sorted(-x for x in pooled["range"][bucket])
        out[f"pooled {key}"] = f"{-p['change_pct']:.2f}% [95% CI {-p['ci'][1]:.2f}, {-p['ci'][0]:.2f}]"
        out[f"range {key}"] = f"{low:.2f}% to {high:.2f}%"
    chr22 = next(r for r in doc["rows"] if r["region"] == "chr22" and r["comparison"] == comparison)
    out["chr22 all"] = f"{-chr22['buckets']['all']['change_pct']:.2f}%"
    return out


def test_the_pages_quote_the_spread_benchmark_as_committed() -> None:
    """README.md and docs/index.md state the pooled full-vs-cut figure (the JSON's ``headline`` comparison) with its interval, the range across
    regions and the chr22 figure exactly as benchmarks/results/heldout_spread.json has them, and the
    quickstart's REPORT cites the same numbers (genolong.quickstart.SPREAD_FULL_VS_CUT)."""
    import json

    from genolong.quickstart import SPREAD_FULL_VS_CUT, _spread_context

    doc = json.loads(SPREAD_JSON.read_text())
    figures = spread_figures(doc)
    report = _spread_context()  # the REPORT's line: the pooled figures, the ranges and chr22's spread figure
    assert not [v for v in figures.values() if v not in report], report
    for page in (README, DOCS / "index.md"):
        text = " ".join(page.read_text().split())
        missing = [f"{k}: {v}" for k, v in figures.items() if v not in text]
        assert not missing, f"{page.name} does not quote the spread benchmark's figures {missing}"
    # the docs also give the base read with the same keys (the fine-tune's starting point), pooled
    if doc["headline"] != "base-read: full - cut" and "base-read: full - cut" in doc["pooled"]:
        base_read = spread_figures(doc, "base-read: full - cut")
        text = " ".join((DOCS / "index.md").read_text().split())
        assert base_read["pooled all"] in text and base_read["pooled last"] in text, base_read
    assert SPREAD_FULL_VS_CUT["comparison"] == doc["headline"]
    pooled = doc["pooled"][doc["headline"]]
    last = next(iter(doc["regions"].values()))["buckets"][-1]
    for bucket in ("all", last):
        p = pooled["buckets"][bucket]
        want = (p["change_pct"], *p["ci"], *pooled["range"][bucket])
        assert SPREAD_FULL_VS_CUT[bucket] == pytest.approx(tuple(round(x, 2) for x in want), abs=1e-9), bucket
    by_region = {
        r["region"]: round(r["buckets"]["all"]["change_pct"], 2)
        for r in doc["rows"]
        if r["comparison"] == doc["headline"]
    }
    assert SPREAD_FULL_VS_CUT["regions"] == pytest.approx(by_region, abs=1e-9)


def test_spread_figures_follow_the_json() -> None:
    """The check can fail: the phrases change with the JSON's numbers (gain = -(full - cut))."""
    doc = {
        "regions": {"r": {"buckets": ["<1k", "4k-8k"]}},
        "headline": "tuned: full - cut",
        "pooled": {
            "tuned: full - cut": {
                "buckets": {
                    "all": {"change_pct": -0.5, "ci": [-0.9, -0.1]},
                    "4k-8k": {"change_pct": -1.0, "ci": [-2.0, 0.25]},
                },
                "range": {"all": [-1.25, 0.5], "4k-8k": [-2.0, -0.5]},
            }
        },
        "rows": [{"region": "chr22", "comparison": "tuned: full - cut", "buckets": {"all": {"change_pct": -1.06}}}],
    }
    assert spread_figures(doc) == {
        "pooled all": "0.50% [95% CI 0.10, 0.90]",
        "range all": "-0.50% to 1.25%",
        "pooled last": "1.00% [95% CI -0.25, 2.00]",
        "range last": "0.50% to 2.00%",
        "chr22 all": "1.06%",
    }
