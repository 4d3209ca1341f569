"""The export without a gather (genolong.train.export) against today's gathered export, on 2 gloo ranks.

One pair of spawned processes runs both cases:

- a wide 4-layer model (32 routed experts: ~40 MiB fp32, the largest tensor 8 MiB) under expert
  parallelism 2 folded into FSDP2 over the two ranks, written with 4 MiB shards: the files equal
  bitwise those of the reference path (:func:`genolong.train.finetune._full_model` gathers the whole
  model to rank 0, which writes it with ``save_pretrained``), and rank 0's peak RSS grows by at most
  one output shard + the largest tensor while the sharded export runs (VmHWM, reset before it
  through ``/proc/self/clear_refs``), where the gathered path grows by the whole model. The ranks
  run with glibc's mmap threshold at 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so that a freed tensor
  leaves the process at once and the RSS follows the live tensors (with the suite's kept-freed heap,
  genolong.allocator, the peak would also hold what fragmentation keeps);
- a 3-layer `tiny` model with LoRA adapters on the attention projections and the routed experts,
  sharded by FSDP2: the merged export and the PEFT adapter equal the reference's bitwise.

And in one process: the same functions on an unsharded model equal ``save_pretrained`` bitwise.
End to end, ``genolong export`` of a 2-rank LoRA run's step checkpoint equals the export the run
wrote: tests/integration/test_lora_distributed.py (its finetune run, cp 2 x ep 2).
"""

from __future__ import annotations

import filecmp
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from genolong.config import ParallelSection
from genolong.config.schema import LoraSection
from genolong.model import PRESETS, GenoLM
from genolong.model.lora import apply_lora, save_adapter
from genolong.parallel import parallelize
from genolong.parallel.mesh import build_mesh, ep_size
from genolong.train.export import ExportStats, export_adapter, export_model
from genolong.train.finetune import _full_model, _merged_export
from tests.helpers import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

#: ~40 MiB fp32 in 4 layers; the largest tensor, a routed experts' gate_up_proj [32, 256, 256], 8 MiB
_WIDE = PRESETS["tiny"].replace(
    num_hidden_layers=4,
    hidden_size=256,
    pattern="KDDD",
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    n_routed_experts=32,
    moe_intermediate_size=128,
    intermediate_size=512,
)
_SHARD = 4 * 2**20  # max_shard_bytes of the wide export: 11 files
_TINY = PRESETS["tiny"].replace(num_hidden_layers=3, pattern="KDD", mlp_layer_types=("dense", "sparse", "sparse"))
_LORA = LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0, routed_experts=True)
_MiB = 2**20


def _kib(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _peak_increase(work) -> tuple[object, int]:
    """``work()``'s result and the process's peak RSS above its RSS before it (the peak reset first)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    result = work()
    return result, _kib("VmHWM") - before


def _same_files(a: Path, b: Path) -> list[str]:
    """The files of two directories, asserted equal byte for byte; their names."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()), (a, b)
    for name in names:
        # exact: the same bytes on disk (the files, not arithmetic)
        assert filecmp.cmp(a / name, b / name, shallow=False), f"{a / name} differs from {b / name}"
    return names


def _worker(rank: int, world: int, folder: str) -> None:
    out = Path(folder)
    # the wide model under EP 2 folded into FSDP2 over the two ranks
    torch.manual_seed(0)
    model = GenoLM(_WIDE)
    mesh = build_mesh(
        ParallelSection(accelerator="cpu", devices=world, dp_shard=world, cp=1, ep=world), world_size=world
    )
    parallelize(model, mesh=mesh, ep=ep_size(mesh))
    stats = ExportStats(files=[])
    _, sharded_peak = _peak_increase(lambda: export_model(model, out / "sharded", max_shard_bytes=_SHARD, stats=stats))

    def gathered() -> None:
        full = _full_model(model)
        if rank == 0:
            assert full is not None
            full.save_pretrained(out / "gathered", max_shard_bytes=_SHARD)
        dist.barrier()

    _, gathered_peak = _peak_increase(gathered)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "sharded_peak": sharded_peak,
                "gathered_peak": gathered_peak,
                "files": stats.files,
                "bytes": stats.bytes_written,
            }
        )
    )
    # LoRA under FSDP2: the merged export and the adapter
    torch.manual_seed(1)
    adapted = GenoLM(_TINY)
    apply_lora(adapted, _LORA)
    with torch.no_grad():  # non-zero B, as after training
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    parallelize(
        adapted,
        mesh=build_mesh(ParallelSection(accelerator="cpu", devices=world, dp_shard=world, cp=1), world_size=world),
    )
    export_adapter(adapted, out / "adapter", _LORA)
    export_model(adapted, out / "merged", lora=_LORA, merged=True, max_shard_bytes=2**18)
    full = _full_model(adapted, _LORA)
    if rank == 0:
        assert full is not None
        save_adapter(full, out / "adapter-ref")
        _merged_export(full).save_pretrained(out / "merged-ref", max_shard_bytes=2**18)


@pytest.mark.distributed
def test_sharded_export_equals_gathered_within_one_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """See the module docstring (2 ranks, one spawn)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # read by the spawned ranks' glibc
    run_ranks(_worker, 2, tmp_path, str(tmp_path), timeout=240)
    names = _same_files(tmp_path / "sharded", tmp_path / "gathered")
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 4, names  # several shards, so that both ranks write some
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(ranks[0]["files"] + ranks[1]["files"]) == sorted(shards) and ranks[1]["files"], ranks
    torch.manual_seed(0)
    state = GenoLM(_WIDE).state_dict()
    whole = sum(t.nbytes for t in state.values())
    largest = max(t.nbytes for t in state.values())
    bound = _SHARD + largest
    print(
        f"rank 0 peak RSS increase: sharded {ranks[0]['sharded_peak'] / _MiB:.1f} MiB (bound {bound / _MiB:.1f}), "
        f"gathered {ranks[0]['gathered_peak'] / _MiB:.1f} MiB; model {whole / _MiB:.1f} MiB"
    )
    assert ranks[0]["sharded_peak"] <= bound, (ranks[0], bound)
    assert ranks[1]["sharded_peak"] <= bound, (ranks[1], bound)
    # the measurement can see a whole model: the gathered path's rank 0 holds one
    assert ranks[0]["gathered_peak"] >= 0.9 * whole, (ranks[0], whole)
    _same_files(tmp_path / "merged", tmp_path / "merged-ref")
    _same_files(tmp_path / "adapter", tmp_path / "adapter-ref")


def test_unsharded_export_equals_save_pretrained(tmp_path: Path) -> None:
    """One process, no mesh: the model, the merged LoRA model and the adapter, as the reference writes them."""
    torch.manual_seed(0)
    model = GenoLM(_TINY)
    model.save_pretrained(tmp_path / "ref", max_shard_bytes=2**18)
    export_model(model, tmp_path / "new", max_shard_bytes=2**18)
    assert len(_same_files(tmp_path / "ref", tmp_path / "new")) > 4
    apply_lora(model, _LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    export_adapter(model, tmp_path / "adapter", _LORA)
    export_model(model, tmp_path / "merged", lora=_LORA, merged=True)
    full = _full_model(model, _LORA)
    assert full is not None
    save_adapter(full, tmp_path / "adapter-ref")
    _merged_export(full).save_pretrained(tmp_path / "merged-ref")
    _same_files(tmp_path / "adapter", tmp_path / "adapter-ref")
    _same_files(tmp_path / "merged", tmp_path / "merged-ref")
    # the live model keeps its adapters (the merge works on gathered copies)
    assert any(".lora_A." in n for n, _ in model.named_parameters())


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    """A non-empty directory that is no export is named and left alone."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep")
    torch.manual_seed(0)
    with pytest.raises(Exception, match="refusing to replace .*notes"):
        export_model(GenoLM(_TINY), tmp_path / "notes")
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep"
    assert os.listdir(tmp_path) == ["notes"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``genolong ARGS`` in a child process (one torch thread); asserts it succeeded."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "genolong.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run
