"""``genolong quickstart``: the whole story on the bundled real human sample, on a CPU.

1. Prepare the bundled sample genome (GRCh37/hg19 slices of chr1, chr3, chr4 and chr5 for
   training, chr22:20-21 Mb held out) into ``OUT/genome``.
2. Measure the bundled base model (the ``small`` preset trained at 1k context by
   ``recipes/sample-base.yaml``, in ``data/sample/base``) on held-out chr22 tiles at long context.
3. Fine-tune it at long context with ``recipes/quickstart.yaml`` (outputs in ``OUT/runs/quickstart``).
4. Measure the fine-tuned model on the same tiles and print both.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from importlib.resources import as_file, files
from pathlib import Path

from .data.prepare import PrepareResult, format_summary, prepare_genome
from .data.store import GenomeStore
from .errors import GenolongError

__all__ = ["SAMPLE_TRAIN", "SAMPLE_EVAL", "bundled_base", "quickstart_recipe", "sample_fasta", "run_quickstart"]

SAMPLE_TRAIN = ("chr1", "chr3", "chr4", "chr5")
SAMPLE_EVAL = ("chr22",)


def sample_fasta() -> Path:
    """Path of the bundled sample genome (bgzip FASTA with .fai and .gzi beside it)."""
    resource = files("genolong.bundled.sample") / "sample.fa.gz"
    with as_file(resource) as path:  # a real file for both editable and wheel installs
        return Path(path)


def bundled_base() -> Path:
    """The bundled base checkpoint directory (``data/sample/base``: config.json + safetensors)."""
    return Path(str(files("genolong.bundled.sample") / "base"))


def quickstart_recipe() -> Path:
    """The shipped ``recipes/quickstart.yaml``."""
    return Path(str(files("genolong.recipes") / "quickstart.yaml"))


def prepare_sample(out: Path, progress: bool | None = None) -> PrepareResult:
    """Prepare the bundled sample into ``out`` (replacing an earlier quickstart store there)."""
    return prepare_genome([sample_fasta()], out, train=SAMPLE_TRAIN, eval=SAMPLE_EVAL, force=True, progress=progress)


def run_quickstart(out: Path = Path("genolong-quickstart"), progress: bool | None = None,
                   overrides: Sequence[str] = (), train: bool = True) -> GenomeStore:
    """Run the quickstart into directory ``out``; returns the prepared store.

    Args:
        out: working directory; the store goes to ``out/genome``, the run to ``out/runs/quickstart``
            (replaced on every quickstart).
        progress: show progress bars (default: on a terminal).
        overrides: ``--set`` items for ``recipes/quickstart.yaml`` (e.g. ``train.max_steps=2``).
        train: fine-tune and compare (default True); False stops after preparing the store.

    Raises:
        GenolongError: the bundled base model is missing, or a bad override.
    """
    out.mkdir(parents=True, exist_ok=True)
    print(f"genolong quickstart: preparing the bundled human sample {sample_fasta().name} -> {out / 'genome'}")
    result = prepare_sample(out / "genome", progress=progress)
    print(format_summary(result))
    store = GenomeStore.open(result.path)
    for split in store:
        lengths = split.segment_lengths
        print(f"{split.name}: {split.n_tokens:,} tokens in {len(lengths)} segments (longest {int(lengths.max()):,})")
    if train:
        _finetune_and_compare(out, store, overrides, progress)
    return store


def _finetune_and_compare(out: Path, store: GenomeStore, overrides: Sequence[str], progress: bool | None) -> None:
    from .config import load_recipe
    from .evaluation.heldout import heldout_loss
    from .model.lm import GenoLM
    from .train.finetune import run

    base = bundled_base()
    if not (base / "config.json").is_file():
        raise GenolongError(
            f"the bundled base model is missing ({base}); reinstall genolong, or train it with "
            "`genolong finetune recipes/sample-base.yaml` and copy runs/sample-base/export there"
        )
    run_dir = out.resolve() / "runs" / "quickstart"
    settings = [
        f"model.checkpoint={base}",
        f"data.store={out.resolve() / 'genome'}",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        f"logging.dir={run_dir / 'logs'}",
        *([] if progress is None else [f"logging.progress_bar={str(bool(progress)).lower()}"]),
        *overrides,
    ]
    recipe = load_recipe(quickstart_recipe(), settings)
    shutil.rmtree(run_dir, ignore_errors=True)
    tiles = recipe.eval.max_tiles
    heldout = store.split(recipe.data.eval_split or "eval")
    context = recipe.eval_context
    print(f"\ngenolong quickstart: held-out loss of the base model ({base.name}, trained at 1k context) on "
          f"{tiles} chr22 tiles of {context:,} tokens")
    before = heldout_loss(GenoLM.from_pretrained(base), heldout, context, tiles, recipe.model.softmask_weight)
    print(f"genolong quickstart: fine-tuning at {recipe.data.context:,} tokens for {recipe.train.max_steps} steps "
          f"({recipe.memory.recompute} recompute) -> {run_dir}")
    trained = run(recipe)
    assert trained.export is not None
    after = heldout_loss(GenoLM.from_pretrained(trained.export), heldout, context, tiles, recipe.model.softmask_weight)
    change = 100.0 * (after.nats - before.nats) / before.nats
    print(f"\nheld-out chr22, {int(after.tokens):,} bases in {after.tiles} tiles of {context:,}:")
    print(f"  base        {before.nats:.4f} nats/base  {before.bits_per_base:.4f} bits/base")
    print(f"  fine-tuned  {after.nats:.4f} nats/base  {after.bits_per_base:.4f} bits/base  ({change:+.2f}%)")
    print(f"logs: {trained.paths.logs}; fine-tuned model: {trained.export}")
