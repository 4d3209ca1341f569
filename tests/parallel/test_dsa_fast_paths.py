"""The DSA fast paths at every query offset, in a training step.

Context parallelism (every rank but the first holds queries at ``q_offset > 0``) and chunked
recompute (every query segment but a rank's first) used to send the KPool top-k and the indexer KL
to the torch engines (``causal_topk``, the blockwise torch KL) whatever the backend. Here a step of
the `tiny` GenoLM (KDA, full and shared DSA layers, MoE, mHC) on 2 gloo ranks with chunked
recompute, the indexer KL on, runs with the ``triton`` backend (genolong's Triton DSA kernels, in
Triton's interpreter on CPU: :func:`tests.helpers.register_interpreted_triton`) and with the
``torch`` backend: the triton step calls no torch DSA engine (counted), the torch step does, and
the two steps agree: the same selections (exactly), the loss to 1e-6 relative and every parameter
gradient to RMS ratio 1e-5, except for tensors whose valid torch steps are further apart than
that (fp32 against float64, or against recompute segments of 16 tokens: another summation order
of the DSA keys' gradients; the mHC ``scale`` and ``base`` gradients, small sums of large terms):
those within twice the larger gap (the rule of tests/parallel/test_cp_model.py, whose other order is KDA's;
the kernels sum in other orders than the torch ops).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from genolong.kernels.backends import dispatch_counts
from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS, GenoLM
from genolong.model.dsa import DSAIndexer
from genolong.parallel import apply_recompute
from genolong.parallel.context import apply_context_parallel
from tests.helpers import TorchDSAEngineCalls, register_interpreted_triton, run_ranks

_GRAD_TOL = 1e-5
_LOSS_TOL = 1e-6
# 16 index heads keep exact top-k ties out of the pooled scores (see tests/model/test_model_dsa.py)
_CONFIG = PRESETS["tiny"].replace(index_n_heads=16)
_T_LOCAL = 40  # tokens per rank: a multiple of the pool (8), not of the segment
_CHUNK = 24  # recompute segments of 24 and 16 tokens: rank 1's start at 40 and 64


def _step(
    backend: str, case: dict, rank: int, world: int, dtype: torch.dtype = torch.float32, chunk: int = _CHUNK
) -> dict:
    """One forward + backward of this rank's slice under CP and chunked recompute; the parameter
    gradients summed over the ranks, the loss, every selection the indexers made and the calls."""
    torch.manual_seed(0)
    model = GenoLM(_CONFIG.replace(kernel_backend=backend))
    model.load_state_dict(case["state"])
    model.to(dtype)
    indexers = [b.self_attn for b in model.layers if b.layer_type == "indexed_attention" and b.self_attn.indexer]
    for mixer in indexers:
        mixer.indexer_kl = True
    selections: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, DSAIndexer):
            module.register_forward_hook(lambda m, args, out: selections.append(out.clone()))
    apply_context_parallel(model, dist.group.WORLD)
    apply_recompute(model, "chunked", chunk_tokens=chunk)
    tokens = case["tokens"]
    lo, hi = rank * _T_LOCAL, (rank + 1) * _T_LOCAL
    before = dispatch_counts()
    with TorchDSAEngineCalls() as engines:
        nll, weight = model.loss(tokens[:, lo:hi], next_tokens=tokens[:, hi : hi + 1] if rank + 1 < world else None)
        total = weight.detach().clone()
        dist.all_reduce(total)
        loss = nll / total + sum(m.last_indexer_kl for m in indexers)
        loss.backward()
    after = dispatch_counts()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    kernels = {
        op: {impl: n - before.get(op, {}).get(impl, 0) for impl, n in counts.items()} for op, counts in after.items()
    }
    return {"loss": summed, "grads": grads, "selections": selections, "engines": engines.calls, "kernels": kernels}


def _worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    register_interpreted_triton()
    case = torch.load(Path(folder) / "case.pt", weights_only=True)
    out = {backend: _step(backend, case, rank, world) for backend in ("torch", "triton")}
    out["torch64"] = _step("torch", case, rank, world, torch.float64)
    out["torch_seg16"] = _step("torch", case, rank, world, chunk=16)
    torch.save(out, Path(folder) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_cp2_chunked_step_runs_the_triton_kernels_at_every_offset(tmp_path: Path) -> None:
    world = 2
    torch.manual_seed(7)
    case = {"state": GenoLM(_CONFIG).state_dict(), "tokens": torch.randint(1, 5, (1, world * _T_LOCAL))}
    torch.save(case, tmp_path / "case.pt")
    run_ranks(_worker, world, tmp_path, str(tmp_path), timeout=600)
    for rank in range(world):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        ref, got, wide, other = out["torch"], out["triton"], out["torch64"], out["torch_seg16"]
        # the torch backend runs the torch engines at every offset (the counter sees them) ...
        assert all(n > 0 for n in ref["engines"].values()), ref["engines"]
        # ... the triton backend never: top-k, KL and attention are its kernels on both ranks,
        # in every segment, forward and recompute
        assert got["engines"] == {"causal_topk": 0, "kl_block": 0, "attention_block": 0}, got["engines"]
        selections = len(got["selections"])
        assert selections >= 2 * 2 * 2  # 2 full indexer layers x 2 segments x (forward, recompute)
        for op in ("kpool_topk", "kpool_indexer_kl_loss", "sparse_attention", "kpool_keys"):
            assert got["kernels"][op].get("torch", 0) == 0 and got["kernels"][op]["genolong-triton"] > 0, op
        assert got["kernels"]["kpool_topk"]["genolong-triton"] == selections
        # the same step: selections exactly, loss and gradients to float rounding
        assert len(ref["selections"]) == selections
        for a, b in zip(got["selections"], ref["selections"]):
            assert torch.equal(a, b)  # exact: int positions
        assert abs(float(got["loss"]) - float(ref["loss"])) <= _LOSS_TOL * abs(float(ref["loss"]))
        assert got["grads"].keys() == ref["grads"].keys()
        rounding = {
            n: max(rms_ratio(wide["grads"][n], g), rms_ratio(other["grads"][n], g)) for n, g in ref["grads"].items()
        }
        errors = {n: rms_ratio(g, got["grads"][n]) for n, g in ref["grads"].items()}
        over = {n: (e, rounding[n]) for n, e in errors.items() if e >= max(_GRAD_TOL, 2 * rounding[n])}
        assert not over, over
        # the exception is rare: nearly every tensor meets 1e-5 outright
        assert sum(e < _GRAD_TOL for e in errors.values()) >= 0.97 * len(errors)
