"""`genolong evaluate`, `probe` and `check-logprobs` with `--adapter DIR`: a base model plus a PEFT
LoRA adapter, merged in memory (genolong.evaluation.checkpoint.merge_adapter).

Oracles: the merged export as `genolong finetune` writes it (`merge_lora` of the adapted model,
saved as a plain checkpoint) scored by the same command; the adapted model with separate adapters
(`load_adapter`, `LoraLinear`'s forward); and the base alone, which the adapter must change (so the
tests fail if `--adapter` were ignored). The adapter covers every kind genolong writes: attention
projections, the routed experts (batched per-expert factors) and a module saved whole (`norm`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from genolong.cli import main
from genolong.evaluation.checkpoint import load_eval_model, merge_adapter
from genolong.evaluation.probe import ProbeResult
from genolong.evaluation.results import EvalResult
from genolong.evaluation.score import read_tokens
from genolong.model import PRESETS, GenoLM
from genolong.model.lora import (
    ADAPTER_CONFIG,
    LoraSettings,
    adapter_parameters,
    apply_lora,
    load_adapter,
    merge_lora,
    save_adapter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: attention projections of every layer, the routed experts and a module trained in full
_LORA = LoraSettings(
    rank=4, alpha=8.0, targets=("layers.*.self_attn.*",), routed_experts=True, modules_to_save=("norm",)
)
_EVAL = ["--context", "256", "--max-tiles", "2", "--first-bucket", "64", "--quiet"]


def _adapted(hidden_size: int | None = None) -> GenoLM:
    """The seeded tiny base with trained-looking adapters (non-zero B, a changed ``norm``)."""
    torch.manual_seed(0)
    config = PRESETS["tiny"] if hidden_size is None else PRESETS["tiny"].replace(hidden_size=hidden_size)
    model = GenoLM(config).eval()
    apply_lora(model, _LORA)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``base/`` (tiny, seeded), ``runs/lora/adapter/`` (genolong's PEFT files) and
    ``runs/lora/export/`` (the adapters merged, as finetune exports them) under one directory."""
    root = tmp_path_factory.mktemp("adapter_cli")
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(root / "base")
    adapted = _adapted()
    save_adapter(adapted, root / "runs" / "lora" / "adapter", base_model_name_or_path=str(root / "base"))
    merge_lora(copy.deepcopy(adapted)).save_pretrained(root / "runs" / "lora" / "export")
    return root


def test_merge_adapter_equals_the_export_and_the_adapter_model(models: Path) -> None:
    """The base loaded with ``adapter=``: weights bitwise the merged export's (the same float32
    sum W + s B A, rounded once, as finetune's merge); logits equal the adapted model with separate
    adapters to fp32 rounding (W x + s B (A x) sums in another order than (W + s B A) x), and not
    the base's."""
    merged, _ = load_eval_model(models / "base", adapter=models / "runs" / "lora" / "adapter")
    export, _ = load_eval_model(models / "runs" / "lora" / "export")
    for (name, a), (_, b) in zip(merged.state_dict().items(), export.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    base, _ = load_eval_model(models / "base")
    separate = copy.deepcopy(base)
    load_adapter(separate, models / "runs" / "lora" / "adapter")
    ids = torch.randint(0, 4, (1, 257), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want, plain = merged.logits(merged(ids)), separate.logits(separate(ids)), base.logits(base(ids))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2  # the adapter changed the model
    # a refused adapter leaves the model as it was: checked on a meta copy before any weight changes
    before = {k: v.clone() for k, v in base.state_dict().items()}
    (models / "bad").mkdir(exist_ok=True)
    config = json.loads((models / "runs" / "lora" / "adapter" / ADAPTER_CONFIG).read_text())
    (models / "bad" / ADAPTER_CONFIG).write_text(json.dumps(config))
    with pytest.raises(Exception, match="adapter_model.safetensors"):
        merge_adapter(base, models / "bad")
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())


def test_evaluate_with_adapter_equals_the_merged_export(models: Path, sample_store: Path, tmp_path: Path) -> None:
    """evaluate BASE --adapter DIR: per-token NLL equal to evaluating the merged export (bitwise
    here: the merged weights are the export's bit for bit, see above; the tolerance 1e-6 relative
    allows only fp32 rounding), different from the base's; the adapter recorded in meta.json and in
    the default name."""
    common = ["--store", str(sample_store), *_EVAL]
    adapter = models / "runs" / "lora" / "adapter"
    assert (
        main(["evaluate", str(models / "base"), "--adapter", str(adapter), "--out", str(tmp_path / "a"), *common]) == 0
    )
    assert main(["evaluate", str(models / "runs" / "lora" / "export"), "--out", str(tmp_path / "m"), *common]) == 0
    assert main(["evaluate", str(models / "base"), "--out", str(tmp_path / "b"), *common]) == 0
    a, m, b = (read_tokens(tmp_path / x)["nll"].to_numpy() for x in "amb")
    np.testing.assert_allclose(a, m, rtol=1e-6, atol=0)
    assert np.abs(a - b).mean() > 1e-3
    meta = EvalResult.load(tmp_path / "a").meta
    assert meta["adapter"] == str(adapter.resolve()) and meta["checkpoint"] == str((models / "base").resolve())
    assert meta["label"] == "base+lora" and "adapter" not in EvalResult.load(tmp_path / "b").meta


def test_probe_and_check_logprobs_with_adapter(models: Path, sample_store: Path, tmp_path: Path) -> None:
    """probe and check-logprobs with --adapter: the same numbers as the merged export (to fp32
    rounding, 1e-6 relative), not the base's; the adapter in their metadata."""
    adapter = models / "runs" / "lora" / "adapter"
    runs = {
        "a": [str(models / "base"), "--adapter", str(adapter)],
        "m": [str(models / "runs" / "lora" / "export")],
        "b": [str(models / "base")],
    }
    for key, model in runs.items():
        assert (
            main(
                [
                    "probe",
                    *model,
                    "--store",
                    str(sample_store),
                    "--context",
                    "256",
                    "--repeat-bases",
                    "20",
                    "--distances",
                    "32,128",
                    "--max-tiles",
                    "2",
                    "--quiet",
                    "--out",
                    str(tmp_path / f"p{key}"),
                ]
            )
            == 0
        )
    a, m, b = (ProbeResult.load(tmp_path / f"p{x}") for x in "amb")
    np.testing.assert_allclose(a.tile_full, m.tile_full, rtol=1e-6)
    np.testing.assert_allclose(a.tile_cut, m.tile_cut, rtol=1e-6)
    assert np.abs(a.tile_full - b.tile_full).max() > 1e-2
    assert a.meta["adapter"] == str(adapter.resolve()) and a.label == "base+lora"
    for key, model in runs.items():
        assert (
            main(
                [
                    "check-logprobs",
                    *model,
                    "--store",
                    str(sample_store),
                    "--context",
                    "96",
                    "--first-bucket",
                    "32",
                    "--quiet",
                    "--out",
                    str(tmp_path / f"g{key}"),
                ]
            )
            == 0
        )
    a, m, b = (pd.read_parquet(tmp_path / f"g{x}" / "tokens.parquet") for x in "amb")
    for column in ("train_logprob", "decode_logprob"):
        np.testing.assert_allclose(a[column], m[column], rtol=1e-6, atol=1e-7)
    assert np.abs(a["train_logprob"] - b["train_logprob"]).max() > 1e-2
    assert a["abs_diff"].mean() <= 1e-5  # the decode path of the merged model agrees with its training path
    meta = json.loads((tmp_path / "ga" / "logprob_gap.json").read_text())["meta"]
    assert meta["adapter"] == str(adapter.resolve()) and meta["checkpoint"] == str((models / "base").resolve())


def _bad_adapters(models: Path, root: Path) -> list[tuple[str, list[str], str]]:
    """(what, the CHECKPOINT and --adapter arguments, the error's words) for each refused input."""
    adapter = models / "runs" / "lora" / "adapter"
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    (root / "empty").mkdir()
    # a module this base lacks
    missing = root / "missing-module"
    missing.mkdir()
    (missing / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    (missing / ADAPTER_CONFIG).write_text(
        json.dumps({**config, "target_modules": ["model.language_model.layers.9.self_attn.q_proj"]})
    )
    # an adapter trained on another geometry (hidden 96): its factors' shapes do not fit
    save_adapter(_adapted(hidden_size=96), root / "other-geometry")
    # a damaged weights file (truncated), named by genolong's checksum manifest
    damaged = root / "damaged"
    damaged.mkdir()
    for f in adapter.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    (damaged / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes()[:-100])
    # a LoRA run's own checkpoint: its export already holds the adapters
    run = root / "runs" / "lora"
    (run / "export").mkdir(parents=True)
    for f in (models / "runs" / "lora" / "export").iterdir():
        (run / "export" / f.name).write_bytes(f.read_bytes())
    (run / "recipe.yaml").write_text("model:\n  preset: tiny\n  lora:\n    rank: 4\n")
    base = str(models / "base")
    return [
        ("no such directory", [base, "--adapter", str(root / "nowhere")], "no such directory"),
        ("no config", [base, "--adapter", str(root / "empty")], f"no {ADAPTER_CONFIG} in it"),
        (
            "a module the base lacks",
            [base, "--adapter", str(missing)],
            "'layers.9.self_attn.q_proj', which this base model does not have",
        ),
        (
            "another geometry",
            [base, "--adapter", str(root / "other-geometry")],
            "this base needs (4, 64); the adapter was trained on another model",
        ),
        ("a damaged file", [base, "--adapter", str(damaged)], "adapter_model.safetensors is damaged"),
        ("a LoRA run's checkpoint", [str(run), "--adapter", str(adapter)], "belongs to a LoRA fine-tune run"),
        (
            "a LoRA run's export",
            [str(run / "export"), "--adapter", str(adapter)],
            "give the base model the adapter was trained on",
        ),
    ]


def _error_line(stderr: str) -> str:
    """The one error line of a refused command (genolong's log lines, e.g. the base's loading, may
    come before it when the adapter is checked against the loaded base)."""
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr
    return errors[0]


def test_bad_adapters_are_one_line_errors_and_write_nothing(
    models: Path, sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = _bad_adapters(models, tmp_path)
    for what, model, words in cases:
        out = tmp_path / "out"
        assert main(["evaluate", *model, "--store", str(sample_store), *_EVAL, "--out", str(out)]) == 2, what
        err = _error_line(capsys.readouterr().err)
        assert words in err and ("--adapter" in err or "damaged" in what), (what, err)
        assert not out.exists() and not list(tmp_path.glob(".out*")), what
    # the same checks in the other two commands
    for command, extra in (
        ("probe", ["--context", "256", "--max-tiles", "1"]),
        ("check-logprobs", ["--context", "96"]),
    ):
        for what, model, words in (cases[1], cases[3]):
            assert (
                main([command, *model, "--store", str(sample_store), "--quiet", "--out", str(tmp_path / "out"), *extra])
                == 2
            )
            err = _error_line(capsys.readouterr().err)
            assert words in err, (command, what, err)
            assert not (tmp_path / "out").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_multi_process_evaluation_merges_the_adapter_into_each_shard(
    models: Path, sample_store: Path, tmp_path: Path
) -> None:
    """evaluate BASE --adapter DIR on 2 processes (FSDP2 dp_shard 2: every weight, the routed
    experts' included, split over the ranks; each rank merges its own rows) equals the one-process
    run to 1e-5 relative (as the other multi-process evaluations: another summation order)."""
    common = ["--store", str(sample_store), *_EVAL, "--adapter", str(models / "runs" / "lora" / "adapter")]
    assert main(["evaluate", str(models / "base"), *common, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "genolong.cli",
            "evaluate",
            str(models / "base"),
            *common,
            "--out",
            str(tmp_path / "two"),
            "--set",
            "parallel.accelerator=cpu",
            "--set",
            "parallel.devices=2",
            "--set",
            "parallel.dp_shard=2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    one, two = read_tokens(tmp_path / "one"), read_tokens(tmp_path / "two")
    np.testing.assert_allclose(two["nll"], one["nll"], rtol=1e-5, atol=0)
    assert (one["position"].to_numpy() == two["position"].to_numpy()).all()
    meta = EvalResult.load(tmp_path / "two").meta
    assert meta["parallel"]["dp_shard"] == 2 and meta["adapter"] == str(
        (models / "runs" / "lora" / "adapter").resolve()
    )
