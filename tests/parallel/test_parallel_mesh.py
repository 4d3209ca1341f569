"""genolong.parallel.mesh: size validation (pure) and a 4-process gloo (dp_shard x cp) mesh.

The multi-process launcher the distributed tests share is :func:`tests.helpers.run_ranks`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from genolong.config import ParallelSection
from genolong.errors import InputError
from genolong.parallel.mesh import (
    MESH_DIMS,
    build_mesh,
    cp_group,
    cp_rank,
    cp_size,
    dp_mesh,
    dp_rank,
    dp_size,
    fsdp_mesh,
    mesh_shape,
)
from tests.helpers import run_ranks

# ---------------------------------------------------------------------------------------------
# pure validation


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ((1, -1, 1, 1), (1, 1, 1)),
        ((2, -1, 1, 4), (1, 2, 2)),
        ((2, -1, 2, 8), (2, 2, 2)),
        ((4, 1, 1, 4), (1, 1, 4)),
        ((1, 3, 2, 6), (2, 3, 1)),
    ],
)
def test_mesh_shape_resolves_sizes(sizes: tuple[int, int, int, int], expected: tuple[int, int, int]) -> None:
    shape = mesh_shape(*sizes)
    assert list(shape) == list(MESH_DIMS)
    assert tuple(shape.values()) == expected


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ((3, -1, 1, 4), ["parallel.cp (3)", "does not divide the world size 4"]),
        ((2, -1, 3, 8), ["parallel.dp_replicate (3)", "= 6 does not divide"]),
        ((2, 3, 1, 4), ["= 6 but the world size is 4", "parallel.dp_shard: -1"]),
        ((0, -1, 1, 4), ["parallel.cp = 0", ">= 1"]),
        ((1, -1, 0, 4), ["parallel.dp_replicate = 0"]),
        ((1, 0, 1, 4), ["parallel.dp_shard = 0", "-1 for all ranks left"]),
        ((1, -2, 1, 4), ["parallel.dp_shard = -2"]),
        ((True, -1, 1, 4), ["parallel.cp = True"]),
        ((1, -1, 1, 0), ["world size = 0"]),
        ((2.0, -1, 1, 4), ["parallel.cp = 2.0"]),
    ],
)
def test_mesh_shape_rejects_bad_sizes(sizes: tuple[Any, ...], words: list[str]) -> None:
    with pytest.raises(InputError) as info:
        mesh_shape(*sizes)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_helpers_without_mesh() -> None:
    assert cp_group(None) is None
    assert (cp_rank(None), cp_size(None), dp_rank(None), dp_size(None)) == (0, 1, 0, 1)
    assert dp_mesh(None) is None and fsdp_mesh(None) is None


# ---------------------------------------------------------------------------------------------
# 4 processes: a 2 x 2 (dp_shard x cp) mesh


def _mesh_worker(rank: int, world: int) -> None:
    # the helpers must not rely on slicing flattened dims off the root mesh (deprecated in torch)
    warnings.filterwarnings("error", message="Slicing a flattened dim")
    p = ParallelSection(accelerator="cpu", devices=world, cp=2)
    mesh = build_mesh(p)
    assert mesh.mesh_dim_names == MESH_DIMS
    assert tuple(mesh.mesh.shape) == (1, 2, 2)
    # cp innermost: consecutive global ranks share a CP group
    assert list(mesh.get_coordinate()) == [0, rank // 2, rank % 2]
    assert (cp_rank(mesh), cp_size(mesh), dp_rank(mesh), dp_size(mesh)) == (rank % 2, 2, rank // 2, 2)
    group = cp_group(mesh)
    assert group is not None
    first = 2 * (rank // 2)
    assert dist.get_process_group_ranks(group) == [first, first + 1]
    assert dist.get_world_size(group) == 2 and dist.get_rank(group) == rank % 2
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=group)
    assert x.item() == 2 * first + 1
    # data parallel: the ranks with the same cp coordinate
    dp = dp_mesh(mesh)
    assert dp is not None and dp.mesh_dim_names == ("dp",)
    assert dp.size() == 2 and dp.get_local_rank() == rank // 2
    assert dist.get_process_group_ranks(dp.get_group()) == [rank % 2, rank % 2 + 2]
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=dp.get_group())
    assert y.item() == 2 * (rank % 2) + 2
    # FSDP2 shards over dp_shard x cp: all 4 ranks, 1-D without replicas
    fsdp = fsdp_mesh(mesh)
    assert fsdp is not None and fsdp.mesh_dim_names == ("dp_shard_cp",)
    assert fsdp.mesh.tolist() == [0, 1, 2, 3] and fsdp.get_local_rank() == rank

    # cp = 1: all ranks shard data; no CP group
    flat = build_mesh(ParallelSection(accelerator="cpu", devices=world))
    assert tuple(flat.mesh.shape) == (1, world, 1)
    assert cp_group(flat) is None and cp_size(flat) == 1 and dp_rank(flat) == rank and dp_size(flat) == world

    # HSDP: 2 replicas of 2 shards, no CP
    hsdp = build_mesh(ParallelSection(accelerator="cpu", devices=world, dp_replicate=2))
    assert tuple(hsdp.mesh.shape) == (2, 2, 1) and dp_rank(hsdp) == rank
    hsdp_fsdp = fsdp_mesh(hsdp)
    assert hsdp_fsdp is not None and hsdp_fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert hsdp_fsdp.mesh.tolist() == [[0, 1], [2, 3]]

    # a recipe for more processes than the job has
    try:
        build_mesh(ParallelSection(accelerator="cpu", devices=8, cp=2))
    except InputError as e:
        assert "needs 8 processes but the job runs 4" in str(e)
    else:
        raise AssertionError("build_mesh accepted a recipe for 8 processes in a 4-process job")


@pytest.mark.distributed
def test_mesh_2x2_four_processes(tmp_path: Path) -> None:
    run_ranks(_mesh_worker, 4, tmp_path)
