"""Context-parallel KDA and the short-conv halo (genolong.kernels.kda.cp) against one process.

Each case splits sequences into contiguous slices over 2 or 4 gloo processes; the concatenated
outputs and every input gradient (from a random upstream gradient) must equal single-process
:func:`chunk_kda` on the whole sequence, on slice lengths that are not multiples of the chunk size
(shorter than a chunk, shorter than the conv halo, empty).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from genolong.config import ParallelSection
from genolong.kernels.kda import chunk_kda, recurrent_kda
from genolong.kernels.kda.cp import (
    comm_meter,
    conv_halo,
    conv_halo_comm_bytes,
    cp_chunk_kda,
    cp_kda_comm_bytes,
)
from genolong.kernels.testing import rms_ratio
from genolong.parallel.mesh import build_mesh, cp_group, cp_rank, dp_rank
from tests.helpers import assert_bitwise_equal, run_ranks

# test_single_process_paths compares cp_chunk_kda without a group with chunk_kda bit for bit:
# one torch thread (issue 13); the ranks of run_ranks have one thread each anyway
pytestmark = pytest.mark.usefixtures("one_thread")

B, H, K, V, C, KERNEL = 2, 2, 16, 16, 8, 4
NAMES = ("q", "k", "v", "g", "beta")


def _kda_inputs(T: int, dtype: torch.dtype, gate: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    f = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    # "mild": slow decay (about -0.02 per step), so that the state from earlier ranks still matters
    # at the end of a slice (the fold and its backward are exercised); "lowerbound": the layer's
    # strongest gate (down to -5 per step), earlier ranks' state fades within a few tokens
    g = -5 * torch.sigmoid(f) if gate == "lowerbound" else F.logsigmoid(f + 4)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    return {n: x.to(dtype) for n, x in zip(NAMES + ("do",), (q, k, v, g, beta, do))}


def _make_group_case(
    lengths: list[int], halo_lengths: list[int], dtype: torch.dtype, gate: str, seed: int
) -> dict[str, Any]:
    """Inputs for one CP group and the single-process reference outputs and gradients."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    inp = _kda_inputs(T, dtype, gate, gen)
    leaves = {n: inp[n].clone().requires_grad_(True) for n in NAMES}
    o, _ = chunk_kda(*(leaves[n] for n in NAMES))
    (o * inp["do"]).sum().backward()
    ref = {"o": o.detach(), **{f"d{n}": leaves[n].grad for n in NAMES}}

    # halo: x [B, Tx, C]; rank r gets rows start_r - (KERNEL - 1) .. start_r - 1 (zeros before 0)
    h = KERNEL - 1
    x = torch.randn(B, sum(halo_lengths), C, generator=gen, dtype=torch.float64).to(dtype)
    dh = torch.randn(len(halo_lengths), B, h, C, generator=gen, dtype=torch.float64).to(dtype)
    xl = x.clone().requires_grad_(True)
    padded = F.pad(xl, (0, 0, h, 0))
    starts = [sum(halo_lengths[:r]) for r in range(len(halo_lengths))]
    halos = torch.stack([padded[:, s : s + h] for s in starts])  # [W, B, h, C]
    (halos * dh).sum().backward()
    return {
        "lengths": lengths,
        "inp": inp,
        "ref": ref,
        "halo_lengths": halo_lengths,
        "x": x,
        "dh": dh,
        "halo_ref": halos.detach(),
        "dx_ref": xl.grad,
    }


def _recurrent_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token-by-token reference as a ``kda_fn`` (it has no chunks)."""
    return recurrent_kda(q, k, v, g, beta, **kw)


def _run_slice(case: dict[str, Any], r: int, group: dist.ProcessGroup, out: Path, kda_fn: Any = None) -> None:
    """Rank ``r`` of ``group`` computes its slices, checks the metered bytes, saves its results."""
    W = dist.get_world_size(group)
    lo = sum(case["lengths"][:r])
    hi = lo + case["lengths"][r]
    inp = case["inp"]
    leaves = {n: inp[n][:, lo:hi].clone().requires_grad_(True) for n in NAMES}
    with comm_meter() as kda_bytes:
        o = cp_chunk_kda(*(leaves[n] for n in NAMES), group=group, kda_fn=kda_fn)
        (o * inp["do"][:, lo:hi]).sum().backward()
    expect = cp_kda_comm_bytes(B, H, K, V, W, dtype=inp["q"].dtype)
    assert kda_bytes == {"all_gather": expect["forward"], "all_reduce": expect["backward"]}, (kda_bytes, expect)

    lo = sum(case["halo_lengths"][:r])
    x = case["x"][:, lo : lo + case["halo_lengths"][r]].clone().requires_grad_(True)
    with comm_meter() as halo_bytes:
        halo = conv_halo(x, KERNEL, group)
        (halo * case["dh"][r]).sum().backward()
    expect = conv_halo_comm_bytes(B, C, KERNEL, W, dtype=x.dtype)
    assert halo_bytes == {"all_gather": expect["forward"], "all_reduce": expect["backward"]}, (halo_bytes, expect)
    torch.save({"o": o.detach(), **{f"d{n}": leaves[n].grad for n in NAMES}, "halo": halo.detach(), "dx": x.grad}, out)


def _world_worker(rank: int, world: int, case_file: str) -> None:
    case = torch.load(case_file, weights_only=False)
    _run_slice(case, rank, dist.group.WORLD, Path(case_file).with_name(f"out_{rank}.pt"))


def _mesh_worker(rank: int, world: int, case_file: str) -> None:
    # a 2 x 2 (dp_shard x cp) mesh: each data-parallel index is its own CP group with its own data
    cases = torch.load(case_file, weights_only=False)
    mesh = build_mesh(ParallelSection(accelerator="cpu", devices=world, cp=2))
    group = cp_group(mesh)
    assert group is not None
    d, r = dp_rank(mesh), cp_rank(mesh)
    # group 0 runs its local slices through another KDA op (the recurrent reference) via kda_fn
    _run_slice(
        cases[d], r, group, Path(case_file).with_name(f"out_{d}_{r}.pt"), kda_fn=_recurrent_fn if d == 0 else None
    )


def _check(case: dict[str, Any], outs: list[dict[str, torch.Tensor]], tol: float) -> None:
    for key in ("o",) + tuple(f"d{n}" for n in NAMES):
        got = torch.cat([o[key] for o in outs], dim=1)
        assert got.dtype == case["ref"][key].dtype and got.shape == case["ref"][key].shape, key
        err = rms_ratio(case["ref"][key], got)
        assert err < tol, f"{key}: RMS ratio {err:.2e} >= {tol:.0e}"
    # the halo is a copy: exact; its gradient sums at most a few upstream rows
    assert torch.equal(torch.stack([o["halo"] for o in outs]), case["halo_ref"])  # exact: copied rows
    torch.testing.assert_close(torch.cat([o["dx"] for o in outs], dim=1), case["dx_ref"], rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("lengths", "halo_lengths", "gate"),
    [
        ([75, 75], [75, 75], "mild"),  # CP = 2, 150 tokens: 75 = 64 + 11 per rank
        ([37, 37, 37, 37], [5, 1, 0, 7], "mild"),  # CP = 4: slices shorter than a chunk; halo over 2 ranks, empty slice
    ],
    ids=["cp2", "cp4"],
)
def test_cp_kda_matches_single_process(tmp_path: Path, lengths: list[int], halo_lengths: list[int], gate: str) -> None:
    case = _make_group_case(lengths, halo_lengths, torch.float32, gate, seed=len(lengths))
    torch.save(case, tmp_path / "case.pt")
    run_ranks(_world_worker, len(lengths), tmp_path, str(tmp_path / "case.pt"))
    outs = [torch.load(tmp_path / f"out_{r}.pt") for r in range(len(lengths))]
    _check(case, outs, tol=1e-5)


@pytest.mark.distributed
def test_cp_kda_on_mesh_subgroups_float64(tmp_path: Path) -> None:
    # two CP groups of a 2 x 2 mesh run different sequences at once, with uneven slices: one of
    # 2 tokens (shorter than the halo) and one empty; group 0's local op is recurrent_kda
    cases = [
        _make_group_case([70, 2], [70, 2], torch.float64, "mild", seed=10),
        _make_group_case([0, 9], [0, 9], torch.float64, "lowerbound", seed=11),
    ]
    torch.save(cases, tmp_path / "case.pt")
    run_ranks(_mesh_worker, 4, tmp_path, str(tmp_path / "case.pt"))
    for d, case in enumerate(cases):
        _check(case, [torch.load(tmp_path / f"out_{d}_{r}.pt") for r in range(2)], tol=1e-12)


def test_single_process_paths() -> None:
    # group None: plain chunk_kda and a zero halo, no process group needed
    case = _make_group_case([50], [50], torch.float32, "mild", seed=3)
    inp = case["inp"]
    o = cp_chunk_kda(*(inp[n] for n in NAMES))
    assert_bitwise_equal(o, case["ref"]["o"], "cp_chunk_kda without a group against chunk_kda")
    assert torch.equal(conv_halo(case["x"], KERNEL), torch.zeros(B, KERNEL - 1, C))  # exact: zeros
    assert conv_halo(case["x"], 1).shape == (B, 0, C)
    with pytest.raises(ValueError, match="kernel must be an integer >= 1"):
        conv_halo(case["x"], 0)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T_local, C\]"):
        conv_halo(case["x"][0], KERNEL)
    assert cp_kda_comm_bytes(B, H, K, V, 1) == {"forward": 0, "backward": 0}
    assert cp_kda_comm_bytes(1, 32, 128, 128, 8) == {"forward": 32 * 128 * 256 * 4, "backward": 8 * 32 * 128 * 256 * 4}
    assert cp_kda_comm_bytes(1, 1, 2, 2, 2, dtype=torch.float64)["forward"] == 2 * 4 * 8
    assert conv_halo_comm_bytes(2, 10, 4, 4, dtype=torch.bfloat16) == {
        "forward": 8 + 2 * 3 * 10 * 2,
        "backward": 4 * 2 * 3 * 10 * 2,
    }
