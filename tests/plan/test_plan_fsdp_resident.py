"""The planner's FSDP2 resident terms against what a rank holds (issue 45 item 6).

At the end of the forward, before backward starts, the gathered parameters of a 2-rank gloo run
are the root unit (final norm, LM head) and every unit of the last block, as
:func:`genolong.plan.train.fsdp_resident_bytes` counts them, within the planner tests' 10%:
bf16-mixed (the KEEP_FP32 modules gathered in fp32) without and with EP 2, and fp32 with EP 2
(the last block's experts unit too). Measured: the storages of the parameters of every unit
FSDP2 holds unsharded (its parameter groups' state; FSDP2 pads each shard to a whole row, so a
storage can exceed its parameter by up to a row per rank). Also: the pinned host pool against
the offloader's own buffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from genolong.config import ParallelSection
from genolong.model import PRESETS, GenoLM
from genolong.parallel import parallelize
from genolong.parallel.mesh import build_mesh
from genolong.plan.params import parameter_split
from genolong.plan.train import fsdp_resident_bytes
from tests.helpers import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

_CONFIG = PRESETS["tiny"]
TOLERANCE = 0.10
CASES = [(1, torch.bfloat16), (2, torch.bfloat16), (2, None)]  # (ep, param_dtype)


def _gathered_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages of the parameters FSDP2 holds gathered right now: every
    unit whose parameter group is unsharded (its parameters may still be DTensors over the EP
    dimension, so the type alone does not tell)."""
    from torch.distributed.fsdp import FSDPModule

    storages: dict[int, int] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if not group.is_unsharded:
                continue
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.unsharded_param
                local = param.to_local() if isinstance(param, DTensor) else param
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _worker(rank: int, world: int, folder: str) -> None:
    measured = []
    for ep, dtype in CASES:
        mesh = build_mesh(ParallelSection(accelerator="cpu", devices=world, dp_shard=world, ep=ep), world_size=world)
        torch.manual_seed(0)
        model = parallelize(
            GenoLM(_CONFIG),
            mesh=mesh,
            ep=ep,
            param_dtype=dtype,
            reduce_dtype=torch.float32 if dtype is not None else None,
        )
        seen: list[int] = []
        model.register_forward_hook(lambda module, args, out: seen.append(_gathered_bytes(module)))
        ids = torch.randint(1, 6, (1, 64), generator=torch.Generator().manual_seed(rank))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):  # bf16-mixed: as Lightning runs it
            nll, weight = model.loss(ids)
        (nll / weight).backward()
        dist.barrier()
        measured.append(seen[0])
    torch.save(measured, Path(folder) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_root_and_last_block_stay_gathered_as_planned(tmp_path: Path) -> None:
    run_ranks(_worker, 2, tmp_path, str(tmp_path))
    split = parameter_split(_CONFIG)
    for rank in range(2):
        measured = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for (ep, dtype), got in zip(CASES, measured, strict=True):
            terms = fsdp_resident_bytes(_CONFIG, 2, ep, split, 2 if dtype == torch.bfloat16 else 4)
            predicted = terms["root"] + terms["last block"]
            assert terms["root"] > 0 and terms["last block"] > 0
            print(f"rank {rank} ep {ep} {dtype}: planned {predicted} B, gathered {got} B")
            assert abs(predicted - got) / got < TOLERANCE, (ep, dtype, predicted, got)


def test_pinned_pool_is_the_offloaders_power_of_two_buffers() -> None:
    """The plan's pinned host pool (each offloaded buffer rounded up to a power of two, as torch's
    caching host allocator reserves pinned memory) against the offloader's own tally of the same
    rounding over the buffers it really made, within 10%, at a length (T = 384) where the rounding
    shows (the pool is above the offloaded bytes)."""
    from genolong.parallel.offload import offloader_of
    from genolong.plan import activation_estimate

    tokens = 384
    torch.manual_seed(0)
    model = parallelize(GenoLM(_CONFIG), recompute="full", offload=True, offload_min_bytes=0)
    ids = torch.randint(1, 6, (1, tokens), generator=torch.Generator().manual_seed(1))
    nll, weight = model.loss(ids)
    (nll / weight).backward()
    offloader = offloader_of(model)
    assert offloader is not None
    est = activation_estimate(_CONFIG, tokens, recompute="full", offload=True, offload_min_bytes=0, indexer_kl=False)
    assert est.pinned_pool_bytes > est.peak_offloaded_bytes  # 384 tokens: buffers of 3 x 2^k bytes
    assert offloader.peak_pinned_bytes > offloader.peak_host_bytes
    assert abs(est.pinned_pool_bytes - offloader.peak_pinned_bytes) / offloader.peak_pinned_bytes < TOLERANCE, (
        est.pinned_pool_bytes,
        offloader.peak_pinned_bytes,
    )
