"""Context parallelism for the DSA layer (gloo, CP = 2 and 4 processes, fp32).

A full-indexer layer (2, indexer KL on) and the shared layer after it (3) of the ``tiny`` preset,
fed the full layer's indices, run on one contiguous slice per rank through
:func:`genolong.parallel.cp_dsa.cp_dsa_forward`, absorbed and expanded. The concatenated outputs,
the selected indices (exactly), the input gradients, the indexer KL and the parameter gradients
(summed over the ranks) must equal the single-process layers on the whole sequence, and the bytes
through the collectives must equal :func:`~genolong.parallel.cp_dsa.cp_dsa_comm_bytes`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from genolong.errors import InputError
from genolong.kernels.dsa import sparse_attention
from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS
from genolong.model.dsa import DSAMixer
from genolong.parallel.cp_dsa import cp_dsa_comm_bytes, cp_dsa_forward
from tests.helpers import run_ranks
from tests.model.test_model_dsa import _boundary_margin

# 16 indexer heads with positive weights and positive inputs keep exact (ReLU-zero) ties away from
# the top-k boundary; inputs are redrawn until _boundary_margin shows no near-tie (as test_model_dsa)
_CONFIG = PRESETS["tiny"].replace(index_n_heads=16)  # topk 64 / kpool 8: 8 of up to 24 pools
_FULL, _SHARED = 2, 3
_B = 2
_MARGIN = 1e-4
_TOL = 1e-5
_TIMEOUT_S = 90  # whole spawn; the process group times out a stuck collective after 60 s


def _mixers(states: dict | None = None) -> dict[int, DSAMixer]:
    """Layers 2 (full, returns indices) and 3 (shared): random normal(0, 0.3) weights with
    positive index-head weights, or the given state dicts."""
    mixers = {layer: DSAMixer(_CONFIG, layer) for layer in (_FULL, _SHARED)}
    for layer, mixer in mixers.items():
        if states is not None:
            mixer.load_state_dict(states[layer], strict=True)
            continue
        with torch.no_grad():
            for p in mixer.parameters():
                p.normal_(0, 0.3)
            if mixer.indexer is not None:
                mixer.indexer.weights_proj.weight.abs_()
    return mixers


def _run_pair(mixers: dict[int, DSAMixer], case: dict, sl: slice, forward) -> dict:
    """Full layer (indexer KL on) then shared layer on rows ``sl`` of the case through
    ``forward(mixer, x, prev)``, backward of ``sum(out * probe) + indexer KL``; returns outputs,
    indices, the KL and the input gradients."""
    x = case["x"][:, sl].clone().requires_grad_(True)
    xs = case["xs"][:, sl].clone().requires_grad_(True)
    mixers[_FULL].indexer_kl = True
    out_f, indices = forward(mixers[_FULL], x, None)
    kl = mixers[_FULL].last_indexer_kl
    out_s, nothing = forward(mixers[_SHARED], xs, indices)
    assert indices is not None and nothing is None and kl is not None
    ((out_f * case["probe"][:, sl]).sum() + (out_s * case["probe_s"][:, sl]).sum() + kl).backward()
    return {
        "out": out_f.detach(),
        "out_s": out_s.detach(),
        "indices": indices,
        "kl": kl.detach(),
        "x": x.grad,
        "xs": xs.grad,
    }


def _param_grads(mixers: dict[int, DSAMixer]) -> dict[str, torch.Tensor]:
    return {
        f"{layer}.{k}": p.grad for layer, m in mixers.items() for k, p in m.named_parameters() if p.grad is not None
    }


def _make_case(total: int, seed: int) -> dict:
    """Weights, tie-free inputs and the single-process reference (absorbed and expanded forms)."""
    torch.manual_seed(seed)
    mixers = _mixers()
    for _ in range(100):
        x = torch.randn(_B, total, _CONFIG.hidden_size).abs()
        if _boundary_margin(mixers[_FULL], x) > _MARGIN:
            break
    else:
        raise AssertionError(f"no tie-free input found for T={total}")
    case = {
        "states": {layer: {k: v.detach().clone() for k, v in m.state_dict().items()} for layer, m in mixers.items()},
        "x": x,
        "xs": torch.randn(_B, total, _CONFIG.hidden_size),
        "probe": torch.randn(_B, total, _CONFIG.hidden_size),
        "probe_s": torch.randn(_B, total, _CONFIG.hidden_size),
    }
    ref = {}
    for absorb in (True, False):
        mixers = _mixers(case["states"])
        for m in mixers.values():
            m.absorb = absorb
        run = _run_pair(mixers, case, slice(None), lambda m, x, prev: m(x, prev))
        run["grads"] = _param_grads(mixers)
        ref[absorb] = run
    return {"case": case, "ref": ref}


class _ByteCounter:
    """Counts the bytes this rank receives from other ranks through ``all_gather`` and ``scatter``
    (gloo's reduce-scatter emulation in the all-gather backward) by wrapping torch.distributed."""

    def __init__(self, rank: int):
        self.rank, self.bytes = rank, 0
        self._all_gather, self._scatter = dist.all_gather, dist.scatter

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            self.bytes += sum(t.numel() * t.element_size() for i, t in enumerate(tensor_list) if i != self.rank)
            return self._all_gather(tensor_list, tensor, group=group, async_op=async_op)

        def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, **kw):
            if src != self.rank:
                self.bytes += tensor.numel() * tensor.element_size()
            return self._scatter(tensor, scatter_list, src, group=group, async_op=async_op, **kw)

        dist.all_gather, dist.scatter = all_gather, scatter

    def take(self) -> int:
        n, self.bytes = self.bytes, 0
        return n

    def close(self) -> None:
        dist.all_gather, dist.scatter = self._all_gather, self._scatter


def _worker(rank: int, world: int, folder: str) -> None:
    """One CP rank: both forms (absorbed, expanded) on its slice; writes ``rank{r}.pt``."""
    case = torch.load(Path(folder) / "case.pt", weights_only=True)
    t = case["x"].shape[1] // world
    sl = slice(rank * t, (rank + 1) * t)
    results = {}
    for absorb in (True, False):
        mixers = _mixers(case["states"])
        for m in mixers.values():
            m.absorb = absorb
        counter = _ByteCounter(rank)
        sizes = []

        def forward(mixer, x, prev):
            out = cp_dsa_forward(mixer, x, None, prev_indices=prev)
            sizes.append(counter.take())
            return out

        try:
            run = _run_pair(mixers, case, sl, forward)
            sizes.append(counter.take())  # the backward
        finally:
            counter.close()
        grads = _param_grads(mixers)
        for g in [*grads.values(), run["kl"]]:  # this rank's shares -> the totals
            dist.all_reduce(g)
        run.update(grads=grads, bytes=sizes)
        results[absorb] = run
    torch.save(results, Path(folder) / f"rank{rank}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("world,t_local", [(2, 96), (4, 48)])
def test_cp_dsa_equals_single_process(tmp_path: Path, world: int, t_local: int) -> None:
    """Per rank a multiple of the pool (8) but not of 64; 24 pools in all, 8 selected: sparse,
    and ranks > 0 select pools of earlier ranks."""
    made = _make_case(world * t_local, seed=world)
    torch.save(made["case"], tmp_path / "case.pt")
    run_ranks(_worker, world, tmp_path, str(tmp_path), timeout=_TIMEOUT_S)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for absorb in (True, False):
        ref = made["ref"][absorb]
        runs = [r[absorb] for r in ranks]
        # selection: the same global positions in every row (the margin keeps boundary ties out;
        # rows are sorted because two kept pools whose scores differ by rounding may swap places)
        got_idx = torch.cat([r["indices"] for r in runs], dim=1)
        assert got_idx.shape == ref["indices"].shape
        # exact: indices
        assert torch.equal(got_idx.sort(-1).values, ref["indices"].sort(-1).values), f"absorb={absorb}: indices differ"
        for key in ("out", "out_s", "x", "xs"):
            got = torch.cat([r[key] for r in runs], dim=1)
            assert rms_ratio(ref[key], got) < _TOL, (absorb, key)
        for r in runs:
            assert r["grads"].keys() == ref["grads"].keys()
            for key, g in ref["grads"].items():
                assert rms_ratio(g, r["grads"][key]) < _TOL, (absorb, key)
            # the indexer KL shares sum to the single-process loss
            assert abs(float(r["kl"]) - float(ref["kl"])) < _TOL * float(ref["kl"]), (absorb, r["kl"], ref["kl"])
        # the indexer learns through the KL (its pooled keys cross ranks), the rest through the output
        assert {"2.indexer.wk.weight", "2.indexer.index_kpool_compress_gate", "2.kv_b_proj.weight"} <= ref[
            "grads"
        ].keys()
        full = cp_dsa_comm_bytes(_CONFIG, _B, t_local, world, full_indexer=True)
        shared = cp_dsa_comm_bytes(_CONFIG, _B, t_local, world, full_indexer=False)
        for r in runs:
            assert r["bytes"] == [full["forward"], shared["forward"], full["backward"] + shared["backward"]]


@pytest.mark.parametrize("heads", [(1, 1), (2, 4)])
def test_sparse_attention_with_a_query_offset_equals_rows_of_the_full_kernel(heads: tuple[int, int]) -> None:
    """Queries ``[start, end)`` over keys ``[0, end)`` give the rows of sparse_attention on the
    whole sequence, and their gradients (q rows, and the k/v gradient they cause)."""
    hk, h = heads  # key heads, query heads
    torch.manual_seed(hk)
    b, t, d, dv, k_sel, start, end = 2, 70, 8, 6, 12, 24, 53
    q = torch.randn(b, t, h, d, requires_grad=True)
    k = torch.randn(b, t, hk, d, requires_grad=True)
    v = torch.randn(b, t, hk, dv, requires_grad=True)
    pos = torch.arange(t)[None, :, None]
    indices = torch.randint(0, t, (b, t, k_sel))
    indices = torch.where(indices <= pos, indices, -1)  # some future, some empty slots: -1
    indices[:, :, -1] = t - 1  # a future key in every row: must be ignored (rows < t - 1)
    probe = torch.randn(b, end - start, h, dv)
    ref = sparse_attention(q, k, v, indices, query_block=16)[:, start:end]
    ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    qs = q[:, start:end].detach().clone().requires_grad_(True)
    ks = k[:, :end].detach().clone().requires_grad_(True)
    vs = v[:, :end].detach().clone().requires_grad_(True)
    # rows keep their future entries (up to t - 1 >= end): ignored, and never read out of range
    got = sparse_attention(qs, ks, vs, indices[:, start:end], query_block=16, q_offset=start)
    got_grads = torch.autograd.grad((got * probe).sum(), (qs, ks, vs))
    assert rms_ratio(ref, got) < _TOL
    assert rms_ratio(ref_grads[0][:, start:end], got_grads[0]) < _TOL
    assert rms_ratio(ref_grads[1][:, :end], got_grads[1]) < _TOL and float(ref_grads[1][:, end:].abs().max()) == 0
    assert rms_ratio(ref_grads[2][:, :end], got_grads[2]) < _TOL


def test_cp_dsa_rejects_bad_input_before_any_collective() -> None:
    """Errors that need no process group: a slice that splits a pool, a shared layer without
    indices, no process group; and the kernel's: keys that do not cover the offset queries."""
    full, shared = DSAMixer(_CONFIG, _FULL), DSAMixer(_CONFIG, _SHARED)
    with pytest.raises(InputError, match="multiple of index_kpool"):
        cp_dsa_forward(full, torch.randn(1, 20, _CONFIG.hidden_size))
    with pytest.raises(InputError, match="shared"):
        cp_dsa_forward(shared, torch.randn(1, 16, _CONFIG.hidden_size))
    with pytest.raises(InputError, match="prev_indices"):
        cp_dsa_forward(
            shared, torch.randn(1, 16, _CONFIG.hidden_size), prev_indices=torch.zeros(1, 8, 4, dtype=torch.long)
        )
    with pytest.raises(InputError, match="process group"):
        cp_dsa_forward(full, torch.randn(1, 16, _CONFIG.hidden_size))
    with pytest.raises(ValueError, match="cover positions"):
        sparse_attention(
            torch.randn(1, 4, 2, 8),
            torch.randn(1, 6, 1, 8),
            torch.randn(1, 6, 1, 8),
            torch.zeros(1, 4, 3, dtype=torch.long),
            q_offset=3,
        )
