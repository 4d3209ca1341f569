"""`genolong variants` as a multi-process job on CPU (gloo), against the one-process run of the
same model (`tiny`, seeded) on real human DNA (hg38 chr16, ``tests/data``):

- two processes started by Lightning (``--set parallel.devices=2``: dp_shard 2, so each rank
  gathers the whole model for its blocks), SIGKILLed (the whole job) once blocks are committed,
  then resumed by the same command: ``scores.parquet``, ``scores.tsv``, ``context_effect.tsv``
  and the annotated VCF's records equal the one-process run's byte for byte (each block is
  streamed through the same weights by the same ops, under one thread per process);
- the resumed run is left an odd number of blocks, so one rank is idle in its last round and
  must still take part in the round's collectives (the run ends instead of hanging);
- context parallelism (two ranks spawned here, gloo): each block's 256-token prefix runs split over
  the pair in two stretches, then each rank scores half the block's variants; equal to the one-process streamed
  scores to 1e-5 nats; a bad variant found inside the loop and a resume with other settings found
  by the writer alone end both ranks with the one-line error;
- the layouts it refuses (expert parallelism) fail in one line before any process starts.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pysam
import pytest
import torch

from genolong.cli import main
from genolong.model import PRESETS, GenoLM
from tests.helpers import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

FASTA = Path(__file__).resolve().parents[1] / "data" / "hg38_chr16_186964-397118.softmasked.fa.gz"
_ENV = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# 13 SNVs 1,200 bases apart, an insertion 150 bases after the 7th and a deletion 10 after that: at
# context 96 and 256 (grid cells of 96 and 256 bases) the insertion and the deletion share a cell
# and the 7th SNV is in the one before, 14 blocks each, so 28 blocks dealt to 2 ranks
_SNVS = [1_500 + 1_200 * i for i in range(13)]
_CLOSE = (_SNVS[6] + 150, _SNVS[6] + 160)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A tiny random model, a chr16-only FASTA (its first base genomic position 1) and a VCF; the
    ``variants`` arguments that score it at contexts 96 and 256."""
    root = tmp_path_factory.mktemp("variants_dist")
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(root / "model")
    with gzip.open(FASTA, "rt") as handle:
        seq = "".join(line.strip() for line in handle if not line.startswith(">"))[:20_000]
    with gzip.open(root / "chr16.fa.gz", "wt") as handle:
        handle.write(">chr16\n" + "\n".join(seq[i : i + 60] for i in range(0, len(seq), 60)) + "\n")
    up = seq.upper()
    records = [(p, up[p - 1], "C" if up[p - 1] != "C" else "G") for p in _SNVS]
    ins, dele = _CLOSE
    records += [(ins, up[ins - 1], up[ins - 1] + "GA"), (dele, up[dele - 1 : dele + 2], up[dele - 1])]
    lines = [
        "##fileformat=VCFv4.2",
        f"##contig=<ID=chr16,length={len(seq)}>",
        "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO",
    ]
    lines += [f"chr16\t{p}\tv{p}\t{ref}\t{alt}\t.\tPASS\t." for p, ref, alt in sorted(records)]
    (root / "calls.vcf").write_text("\n".join(lines) + "\n")
    args = [
        "variants",
        str(root / "model"),
        "--vcf",
        str(root / "calls.vcf"),
        "--fasta",
        str(root / "chr16.fa.gz"),
        "--contexts",
        "96,256",
        "--window",
        "16",
        "--segment-tokens",
        "64",
        "--quiet",
    ]
    return root, args


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "genolong.cli", *args]


_TWO = ["--set", "parallel.accelerator=cpu", "--set", "parallel.devices=2"]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_score_as_one_and_resume_after_a_kill(inputs: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, args = inputs
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "meta.json").read_text())
    assert one["blocks"] == [14, 14]  # the VCF makes the 28 blocks the comment above counts on

    # the whole job killed once blocks are committed: started by Lightning, its ranks in the session
    # of the first, so one killpg reaches them all
    out = tmp_path / "two"
    parts = tmp_path / ".two.partial" / "parts"
    proc = subprocess.Popen(
        _command([*args, "--out", str(out), *_TWO]),
        env=_ENV,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and proc.poll() is None:
        if parts.is_dir() and len(list(parts.glob("part-*.parquet"))) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the scoring ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # nothing half-written under the result name
    committed = sorted(parts.glob("part-*.parquet"))
    assert 2 <= len(committed) < 28
    if (28 - len(committed)) % 2 == 0:  # leave an odd number: one rank idle in the resumed run's last round
        committed[-1].unlink()
    run = subprocess.run(
        _command([*args, "--out", str(out), *_TWO]), env=_ENV, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("genolong variants:") == 1  # rank 0 alone prints

    for name in ("scores.parquet", "scores.tsv", "context_effect.tsv", "rejects.tsv"):
        # exact: the same blocks through the same weights by the same ops, one thread per process
        assert (out / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    with (
        pysam.VariantFile(str(out / "scored.vcf.gz")) as a,
        pysam.VariantFile(str(tmp_path / "one" / "scored.vcf.gz")) as b,
    ):
        assert [str(r) for r in a] == [str(r) for r in b]
    two = json.loads((out / "meta.json").read_text())
    assert two["parallel"] == {"world": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "ep": 1}
    assert one["parallel"]["world"] == 1 and two["blocks"] == one["blocks"] and two["rows"] == one["rows"] == 30


def test_refused_layouts_and_a_missing_fasta_are_one_line_before_any_process_starts(
    inputs: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, args = inputs
    cases = {
        ("--set", "parallel.devices=2", "--set", "parallel.ep=2"): "run it with parallel.ep: 1 (got 2)",
        ("--set", "parallel.cp=x"): "parallel.cp must be an integer",
        # the FASTA is read before Lightning starts the second process: one line, not one per rank
        (
            "--fasta",
            str(root / "missing.fa.gz"),
            "--set",
            "parallel.accelerator=cpu",
            "--set",
            "parallel.devices=2",
        ): "missing.fa.gz: no such file",
    }
    for extra, message in cases.items():
        started = time.monotonic()
        assert main([*args, "--out", str(tmp_path / "x"), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert time.monotonic() - started < 20  # refused before any process starts (or a model loads)
    assert not any(tmp_path.iterdir())


def _score_with_context_parallelism(rank: int, world: int, root: Path, out: Path) -> None:
    """One rank of a cp 2 job: the model sharded as ``load_scoring_model`` shards it (context
    parallelism installed, FSDP2 over the CP ranks), both strands at context 256."""
    from genolong.config import ParallelSection
    from genolong.evaluation.distributed import ScoringGroup, shard_for_scoring
    from genolong.evaluation.variants import score_variants
    from genolong.evaluation.vcf import Reference, read_variants
    from genolong.parallel.mesh import build_mesh

    parallel = ParallelSection(accelerator="cpu", devices=world, cp=world)
    group = ScoringGroup(build_mesh(parallel, world_size=world), parallel)
    model = shard_for_scoring(GenoLM.from_pretrained(root / "model").eval(), group)
    with Reference.open(root / "chr16.fa.gz") as reference:
        variants = read_variants(root / "calls.vcf", reference).variants
        score_variants(
            model,
            reference,
            variants,
            out,
            [256],
            window=16,
            strands="both",
            segment_tokens=64,
            progress=False,
            group=group,
        )
    assert all(m.self_attn.cp_group is not None for m in model.layers)  # the model's own CP forms are back

    # a failure inside the loop (a REF that is not the reference's, found by both ranks while the
    # round's block is scored) and one on the writer alone (a resumed run of other settings) end
    # every rank with the same one-line error, none left waiting in a collective
    import dataclasses

    from genolong.errors import InputError

    wrong = dataclasses.replace(variants[4], ref="C" if variants[4].ref != "C" else "G")
    bad = [*variants[:4], wrong, *variants[5:]]
    with Reference.open(root / "chr16.fa.gz") as reference:
        with pytest.raises(InputError, match="differs from the reference"):
            score_variants(
                model,
                reference,
                bad,
                out.parent / "bad",
                [256],
                window=16,
                segment_tokens=64,
                progress=False,
                group=group,
            )
        with pytest.raises(InputError, match="other settings .*window"):
            score_variants(
                model,
                reference,
                bad,
                out.parent / "bad",
                [256],
                window=8,
                segment_tokens=64,
                progress=False,
                group=group,
            )


@pytest.mark.distributed
def test_a_context_parallel_group_splits_each_prefix_and_scores_as_one_process(
    inputs: tuple[Path, list[str]], tmp_path: Path
) -> None:
    # cp 2: the reference before a block's first variant, cut to whole multiples of 128 tokens
    # (kernel_multiple(tiny, 2): 2 x 64-token KDA chunks), runs split over the two ranks in
    # stretches of 2 x 64 (--segment-tokens 64; cp_prefill twice per block: the second from the
    # stream the first left); each rank then streams on alone with its half of the block's variants
    from genolong.evaluation.variants import score_variants
    from genolong.evaluation.vcf import Reference, read_variants

    root, _ = inputs
    run_ranks(_score_with_context_parallelism, 2, tmp_path, root, tmp_path / "cp2", timeout=240)
    with Reference.open(root / "chr16.fa.gz") as reference:
        variants = read_variants(root / "calls.vcf", reference).variants
        one = score_variants(
            GenoLM.from_pretrained(root / "model").eval(),
            reference,
            variants,
            tmp_path / "one",
            [256],
            window=16,
            strands="both",
            segment_tokens=64,
            progress=False,
        )
    two = pd.read_parquet(tmp_path / "cp2" / "scores.parquet")
    scores = ["logp_ref", "logp_alt", "llr", "llr_forward", "llr_reverse"]
    pd.testing.assert_frame_equal(two.drop(columns=scores), one.drop(columns=scores))  # exact: what was scored
    assert (one["context_used"] >= 256).all()  # every block ran a 256-token prefix on the CP pair
    for column in scores:
        # the fold hands each slice its KDA state by another product order than one sequential pass
        # (as under CP training): float32 rounding of per-token NLL summed over <= 19 targets (2e-6 seen)
        np.testing.assert_allclose(two[column], one[column], rtol=0, atol=1e-5, err_msg=column)
    meta = json.loads((tmp_path / "cp2" / "meta.json").read_text())
    assert meta["parallel"] == {"world": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "ep": 1}
