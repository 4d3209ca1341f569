"""No silent slow path (issue 45 item 4): ``kernel_backend: auto`` on a CUDA machine runs the GPU
kernels or stops with one line naming ``pip install 'genolong[gpu]'``; ``genolong plan`` says
what runs on the machine it runs on, in the words the run logs.

The machine is simulated on this CPU one by replacing the probes: CUDA (the registry's
``_cuda_available`` and :func:`genolong.kernels.probe.cuda_here`) and the installed versions of
Triton and fla-core (:func:`genolong.kernels.probe.package_version`); genolong's Triton modules
are stand-ins (CUDA tensors never reach them here).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from genolong.errors import InputError
from genolong.kernels import backends, probe
from genolong.kernels.backends import get_backend
from genolong.plan import format_plan, plan
from tests.plan_helpers import plan_recipe

_MODULES = {
    "triton_attention": "sparse_attention_triton",
    "triton_topk": "kpool_topk_triton",
    "triton_kpool": ("kpool_keys_triton", "kpool_indexer_kl_loss_triton"),
}
_INSTALLED = probe.package_version  # this machine's answer, for the packages a test leaves alone


def _machine(monkeypatch: pytest.MonkeyPatch, cuda: bool, versions: dict[str, str | None]) -> None:
    """Pretend to be a machine with (or without) CUDA and these package versions (None: not
    installed; unnamed packages as installed here); genolong's Triton DSA modules import."""
    monkeypatch.setattr(backends, "_LOADED", {})
    monkeypatch.setattr(backends, "_cuda_available", lambda: cuda)
    monkeypatch.setattr(probe, "cuda_here", lambda: cuda)

    def version(*names: str) -> str | None:
        return versions[names[0]] if names[0] in versions else _INSTALLED(*names)

    monkeypatch.setattr(probe, "package_version", version)
    for module, functions in _MODULES.items():
        fake = types.ModuleType(f"genolong.kernels.dsa.{module}")
        for function in (functions,) if isinstance(functions, str) else functions:
            setattr(fake, function, lambda *a, **k: None)
        monkeypatch.setitem(sys.modules, f"genolong.kernels.dsa.{module}", fake)


@pytest.mark.parametrize(
    "versions, cause",
    [
        ({"fla-core": None}, "fla-core is not installed"),
        ({"triton": "3.3.0"}, "Triton 3.3.0 is older than 3.6.0"),
        ({"fla-core": "0.5.0"}, "fla-core 0.5.0 is older than 0.5.2"),
    ],
)
def test_auto_on_cuda_without_the_gpu_kernels_refuses(
    monkeypatch: pytest.MonkeyPatch, versions: dict[str, str | None], cause: str
) -> None:
    _machine(monkeypatch, cuda=True, versions=versions)
    with pytest.raises(InputError) as err:
        get_backend("auto")
    line = str(err.value)
    assert "\n" not in line and cause in line
    assert "pip install 'genolong[gpu]'" in line and "kernel_backend: torch" in line
    # asked for by name, the torch reference runs (the recipe says so)
    assert get_backend("torch").impls["chunk_kda"] == "torch"
    # the probe (what the plan prints) refuses with the run's line
    assert probe.describe_here("auto") == f"backend 'auto': refused: {line}"


def test_old_triton_refuses_the_triton_backend_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton DSA kernels import with an old Triton and fail to compile mid-run: refused at load."""
    _machine(monkeypatch, cuda=True, versions={"triton": "3.4.1"})
    with pytest.raises(
        InputError,
        match=r"'triton' cannot load here \(Triton 3.4.1 is older than 3.6.0; "
        r"pip install 'genolong\[gpu\]'\)",
    ) as err:
        get_backend("triton")
    assert "\n" not in str(err.value)
    assert probe.kernels_here("triton")[2] is not None


def test_auto_on_cuda_with_the_gpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton and fla-core installed (fla's real adapter, loaded from the installed fla-core):
    auto is triton with fla's KDA, and the probe names the same implementations."""
    _machine(monkeypatch, cuda=True, versions={})
    loaded = get_backend("auto")
    assert loaded.name == "triton"
    assert loaded.impls["chunk_kda_gated"] == "fla-core" and loaded.impls["kpool_topk"] == "genolong-triton"
    line = probe.kernel_line("auto", loaded.name, loaded.impls["chunk_kda_gated"], loaded.impls["kpool_topk"])
    assert line == "backend 'auto' -> 'triton': KDA fla-core, DSA genolong-triton"
    assert probe.describe_here("auto") == line


def test_plan_prints_the_kernels_of_this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    recipe = plan_recipe(
        tmp_path, model={"preset": "tiny", "overrides": {"kernel_backend": "auto"}}, parallel={"accelerator": "gpu"}
    )
    _machine(monkeypatch, cuda=False, versions={})
    text = format_plan(plan(recipe, gpus=1))
    assert "kernels counted: backend 'auto' -> KDA fla-core, DSA genolong-triton (on a CUDA machine" in text
    assert "kernels on this machine: backend 'auto' -> 'torch': KDA torch, DSA torch (no CUDA here)" in text
    _machine(monkeypatch, cuda=True, versions={"fla-core": None})
    p = plan(recipe, gpus=1)
    assert p.kernels_here.startswith("backend 'auto': refused: kernel_backend 'auto' on this CUDA machine")
    assert f"kernels on this machine: {p.kernels_here}" in format_plan(p)
    _machine(monkeypatch, cuda=True, versions={})
    assert plan(recipe, gpus=1).kernels_here == "backend 'auto' -> 'triton': KDA fla-core, DSA genolong-triton"


def test_finetune_stops_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sample_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`genolong finetune` with auto on CUDA without fla-core: exit 2, one line, nothing written;
    the same recipe with kernel_backend torch passes that point (logs its kernels line)."""
    from genolong.cli import main
    from genolong.train.finetune import _kernels

    monkeypatch.setenv("GENOLONG_MALLOC", "system")
    recipe: dict[str, Any] = {
        "name": "gpu-run",
        "model": {"preset": "tiny", "overrides": {"kernel_backend": "auto"}},
        "data": {"store": str(sample_store), "context": 256},
        "train": {"max_steps": 1},
        "checkpoint": {"dir": str(tmp_path / "runs" / "checkpoints")},
        "logging": {"dir": str(tmp_path / "runs" / "logs"), "progress_bar": False, "tensorboard": False},
        "parallel": {"accelerator": "cpu"},
    }
    path = tmp_path / "gpu-run.yaml"
    path.write_text(yaml.safe_dump(recipe))
    _machine(monkeypatch, cuda=True, versions={"fla-core": None})
    assert main(["finetune", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "genolong finetune: error: kernel_backend 'auto' on this CUDA machine" in err[0]
    assert "pip install 'genolong[gpu]'" in err[0] and not (tmp_path / "runs").exists()
    from genolong.config import load_recipe

    # asked for explicitly, torch is what runs (a CPU recipe's tensors take the reference anyway)
    chosen = load_recipe(path, ["model.overrides.kernel_backend=torch"])
    assert _kernels(chosen, "torch") == "backend 'torch': KDA torch, DSA torch"
