"""``genolong quickstart``: the whole story on the bundled real human sample, on a CPU.

Today it prepares the bundled sample genome (GRCh37/hg19 slices of chr1, chr3, chr4 and chr5 for
training, chr22:20-21 Mb held out) and prints its summary; training and evaluation join it as
they land.
"""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

from .data.prepare import PrepareResult, format_summary, prepare_genome
from .data.store import GenomeStore

__all__ = ["SAMPLE_TRAIN", "SAMPLE_EVAL", "sample_fasta", "run_quickstart"]

SAMPLE_TRAIN = ("chr1", "chr3", "chr4", "chr5")
SAMPLE_EVAL = ("chr22",)


def sample_fasta() -> Path:
    """Path of the bundled sample genome (bgzip FASTA with .fai and .gzi beside it)."""
    resource = files("genolong.bundled.sample") / "sample.fa.gz"
    with as_file(resource) as path:  # a real file for both editable and wheel installs
        return Path(path)


def prepare_sample(out: Path, progress: bool | None = None) -> PrepareResult:
    """Prepare the bundled sample into ``out`` (replacing an earlier quickstart store there)."""
    return prepare_genome([sample_fasta()], out, train=SAMPLE_TRAIN, eval=SAMPLE_EVAL, force=True, progress=progress)


def run_quickstart(out: Path = Path("genolong-quickstart"), progress: bool | None = None) -> GenomeStore:
    """Run the quickstart into directory ``out``; returns the prepared store.

    Args:
        out: working directory; the store goes to ``out/genome``.
        progress: show progress bars (default: on a terminal).
    """
    out.mkdir(parents=True, exist_ok=True)
    print(f"genolong quickstart: preparing the bundled human sample {sample_fasta().name} -> {out / 'genome'}")
    result = prepare_sample(out / "genome", progress=progress)
    print(format_summary(result))
    store = GenomeStore.open(result.path)
    for split in store:
        lengths = split.segment_lengths
        print(f"{split.name}: {split.n_tokens:,} tokens in {len(lengths)} segments (longest {int(lengths.max()):,})")
    return store
