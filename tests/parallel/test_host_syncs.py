"""Device-to-host syncs per training step (``genolong.memory.host_syncs``): the counter itself, the
MoE experts' grouped matmul against its loop, and a step whose sync count does not grow with T,
the number of MoE chunks or KDA chunks.

On CPU every read of a tensor counts (an upper bound of a GPU step's syncs; see the module doc).
``torch._grouped_mm`` has a CPU implementation in the pinned torch, so the grouped experts are
compared with the loop here too (fp32); on a GPU the model takes the grouped path only for bf16 on
compute capability 9.0+ (``grouped_mm_supported``, False on CPU: checked), which this machine
cannot run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from genolong.memory.host_syncs import HostSyncCounter
from genolong.model import PRESETS, GenoLM
from genolong.model import moe as moe_module
from genolong.model.config import layer_types_from_pattern
from genolong.model.moe import MoE, expert_counts, experts_grouped, experts_loop, grouped_mm_supported
from genolong.parallel import apply_recompute
from genolong.parallel.expert import apply_expert_parallel
from genolong.parallel.mesh import build_mesh, ep_mesh
from tests.helpers import assert_bitwise_equal, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

# KDA and MoE layers only (the torch DSA engine is the sync-heavy reference; the DSA kernels are
# counted in tests/parallel/test_dsa_fast_paths.py): 4 layers, 3 MoE, 4 experts top-2, mHC
_CONFIG = PRESETS["tiny"].replace(
    num_hidden_layers=4,
    layer_types=layer_types_from_pattern("KKKK", 4),
    mlp_layer_types=("dense",) + ("sparse",) * 3,
    indexer_types=None,
)


def test_counter_counts_each_kind_of_read_and_restores_tensor_methods() -> None:
    t = torch.tensor([1, 2, 3])
    methods = (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy)
    with HostSyncCounter(sites=True) as syncs:
        t[0].item(), int(t[1]), bool(t[0] > 0), float(t.sum())
        t.tolist(), t.cpu(), t.numpy()
        t.nonzero(), t[t > 1], torch.unique(t), torch.bincount(t)
        torch.repeat_interleave(torch.arange(3), t)
        torch.repeat_interleave(torch.arange(3), t, output_size=6)  # size given: no read
        t.sum() + 1, t.argsort(), expert_counts(t, 4)  # no read
    assert dict(syncs.counts) == {
        "item": 4,
        "tolist": 1,
        "cpu": 1,
        "numpy": 1,
        "nonzero": 1,
        "index_bool": 1,
        "unique": 1,
        "bincount": 1,
        "repeat_interleave": 1,
    }
    assert syncs.total == 12 and all(site.startswith("test_host_syncs.py") is False for _, site in syncs.by_site)
    assert (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy) == methods
    with HostSyncCounter("cuda") as gpu:  # reads of host tensors are free on a GPU
        t[0].item(), t.tolist(), t.nonzero()
    assert gpu.total == 0


def test_expert_counts_equal_bincount() -> None:
    flat = torch.randint(0, 7, (300,))
    assert torch.equal(expert_counts(flat, 9), torch.bincount(flat, minlength=9))  # exact: ints


def test_grouped_experts_equal_the_loop_forward_and_backward() -> None:
    """The grouped matmul against the per-expert loop (the reference), fp32 on CPU: an expert with
    no rows, dropped rows past the last group (zeros), outputs and the three gradients to fp32
    rounding; CPU tensors do not take the grouped path in the model."""
    g = torch.Generator().manual_seed(0)
    E, H, I, R = 4, 16, 8, 23
    counts = [6, 0, 9, 5]  # 20 rows, 3 dropped after them
    rows = torch.randn(R, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    probe = torch.randn(R, H, generator=g)
    results = []
    for grouped in (True, False):
        x, wg, wd = (t.clone().requires_grad_(True) for t in (rows, gate_up, down))
        if grouped:
            y = experts_grouped(x, torch.tensor(counts), wg, wd, 7.0)
        else:
            y = experts_loop(x, counts, lambda name, e: (wg if name == "gate_up_proj" else wd)[e], 7.0)
        (y * probe).sum().backward()
        results.append((y.detach(), x.grad, wg.grad, wd.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(results[0][0][20:].abs().max()) == 0.0 and float(results[0][2][1].abs().max()) == 0.0
    assert not grouped_mm_supported(rows, gate_up, down)  # CPU: the loop


def test_moe_forward_takes_the_grouped_path_when_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch: with the grouped matmul reported available the MoE runs it (and reads no row
    count back), giving the loop's output to fp32 rounding."""
    torch.manual_seed(1)
    moe = MoE(PRESETS["tiny"], chunk_tokens=16)
    x = torch.randn(1, 40, PRESETS["tiny"].hidden_size)
    with HostSyncCounter() as loop_syncs:
        ref = moe(x)
    calls = []
    real = moe_module.experts_grouped

    def grouped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda *a: True)
    monkeypatch.setattr(moe_module, "experts_grouped", grouped)
    with HostSyncCounter() as grouped_syncs:
        got = moe(x)
    assert len(calls) == 3  # one per chunk
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert loop_syncs.total == 1 and grouped_syncs.total == 0  # one read for all chunks; none grouped


def _step_syncs(t: int, moe_chunk: int, recompute: str = "full") -> tuple[int, torch.Tensor]:
    torch.manual_seed(2)
    model = GenoLM(_CONFIG)
    for m in model.modules():
        if isinstance(m, MoE):
            m.chunk_tokens = moe_chunk
    apply_recompute(model, recompute, chunk_tokens=1 << 14)
    tokens = torch.randint(1, 5, (1, t))
    with HostSyncCounter() as syncs:
        nll, weight = model.loss(tokens)
        (nll / weight).backward()
    return syncs.total, nll.detach()


def test_step_syncs_do_not_grow_with_t_moe_chunks_or_kda_chunks() -> None:
    """A KDA + MoE step (forward, full recompute, backward) at T = 96 and 4 x 96, MoE chunks of 16
    (6 and 24 chunks) and 48 tokens, KDA chunks of 64: the same count, one read per MoE call
    (forward and recompute: 2 per MoE layer) and nothing else. Chunking changes no result."""
    n_moe = 3
    counts = {(t, c): _step_syncs(t, c) for t in (96, 384) for c in (16, 48)}
    assert {n for n, _ in counts.values()} == {2 * n_moe}, counts
    assert_bitwise_equal(counts[96, 16][1], counts[96, 48][1], "loss with other MoE chunks")


def _ep_rank(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    from genolong.config import ParallelSection

    mesh = build_mesh(ParallelSection(accelerator="cpu", devices=world, ep=world, dp_shard=world), world_size=world)
    out = {}
    for t, chunk in ((48, 16), (192, 16), (192, 64)):
        torch.manual_seed(3)
        model = GenoLM(_CONFIG)
        for m in model.modules():
            if isinstance(m, MoE):
                m.chunk_tokens = chunk
        apply_expert_parallel(model, ep_mesh(mesh))
        tokens = torch.randint(1, 5, (1, t + 16 * rank))  # unequal token counts: 1 or 2 more chunks
        with HostSyncCounter() as syncs:
            nll, weight = model.loss(tokens)
            (nll / weight).backward()
        out[t, chunk] = syncs.total
    dist.barrier()
    torch.save(out, Path(folder) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_expert_parallel_split_sizes_travel_once_per_layer(tmp_path: Path) -> None:
    """EP = 2 (gloo), 3 MoE layers, ranks with unequal token counts: the split sizes are read back
    in at most two transfers per layer call (the first chunk's exchange, then the others'), so
    the count is the same at 3 to 13 chunks per call."""
    run_ranks(_ep_rank, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(set(out.values())) == 1 and set(out.values()) <= {2 * 3}, out
