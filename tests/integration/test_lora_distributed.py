"""LoRA under expert parallelism, context parallelism and FSDP2 on gloo: one SGD step of a 3-layer
`tiny` model with adapters on every attention projection and on the routed experts, under
(a) EP 2 (each rank 2 of the 4 experts of each MoE layer and their adapters, FSDP2 over the two
ranks), (b) CP 2 (each rank half of each window) and (c) FSDP2 over 2 ranks (each rank one
window), equals the same step in one process:

- the loss, every adapter gradient (gathered whole) and the adapters after the step, to
  RMS(ref - x) / RMS(ref) < 1e-5: the ranks' partial sums meet in FSDP2's reduce-scatter (and
  CP's state exchanges, EP's all-to-alls), so the float sums run in another order than in one
  process; the float64 run says how far apart two valid fp32 orders may be, and a tensor whose
  fp32-vs-float64 gap is larger than 1e-5 may sit within twice that gap (as in
  tests/parallel/test_fsdp_cp.py);
- every frozen base weight unchanged on every rank (exact: the optimiser never sees them);
- the adapter directory written from the distributed model (the full-state gather of
  :func:`genolong.train.finetune._full_model`, then :func:`save_adapter`) holds exactly the
  gathered adapters, in the layout one process writes (the same keys and shapes), and loads
  onto a fresh base as the trained model.

The three layouts run in one pair of spawned processes (a spawn costs more than the step). A whole
``genolong finetune`` of a LoRA recipe on two ranks (cp 2, ep 2) against one process is the slow
test at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file
from torch.distributed.tensor import Shard

from genolong.config import ParallelSection
from genolong.config.schema import LoraSection
from genolong.data.windows import context_parallel_bounds
from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS, GenoLM
from genolong.model.lora import ADAPTER_WEIGHTS, adapter_parameters, apply_lora, load_adapter, save_adapter
from genolong.parallel import parallelize
from genolong.parallel.mesh import build_mesh, cp_rank, cp_size, dp_rank, ep_size
from genolong.train import read_step_log
from genolong.train.finetune import _full_model
from tests.helpers import assert_bitwise_equal, run_ranks
from tests.integration.test_finetune_distributed import _finetune
from tests.integration.test_finetune_distributed import _recipe as _finetune_recipe
from tests.train.test_export_sharded import _cli, _same_files

# bitwise comparisons (the frozen weights, the written adapter): one torch thread
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.distributed]

_TOL = 1e-5
_LR = 0.5
# tiny's geometry cut to three layers (KDA + dense, DSA + MoE, DSA + MoE); 16 index heads keep
# exact top-k ties out of the pooled scores (see tests/model/test_model_dsa.py)
_CONFIG = PRESETS["tiny"].replace(
    num_hidden_layers=3, pattern="KDD", mlp_layer_types=("dense", "sparse", "sparse"), index_n_heads=16
)
_LORA = LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0, routed_experts=True)
_TOKENS = 144  # per window: CP slices of 72, a multiple of the key pool (8), not of the KDA chunk (64)

# the parallel section of each layout (2 ranks); EP 2 folds into the two FSDP2 ranks
_LAYOUTS = {
    "ep2": {"dp_shard": 2, "cp": 1, "ep": 2},
    "cp2": {"dp_shard": 1, "cp": 2},
    "fsdp2": {"dp_shard": 2, "cp": 1},
}


def _adapted(state: dict[str, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32) -> GenoLM:
    """The 3-layer model with adapters; ``state`` (an adapted state dict) loaded when given."""
    torch.manual_seed(0)
    model = GenoLM(_CONFIG)
    apply_lora(model, _LORA)
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype)


def _case(windows: int) -> dict:
    """Start weights with non-zero B (as after some training: with B = 0 no gradient reaches A)
    and the windows."""
    model = _adapted()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in adapter_parameters(model).items():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    tokens = torch.randint(1, 5, (windows, _TOKENS), generator=generator)
    tokens[0, 17:23] = 5  # an N run: not a target, so the windows count differently
    return {"state": model.state_dict(), "tokens": tokens}


def _reference(case: dict, dtype: torch.dtype) -> dict:
    """One process: the loss of all the windows, the adapters' gradients and values after an SGD step."""
    model = _adapted(case["state"], dtype)
    nll, weight = model.loss(case["tokens"])
    loss = nll / weight
    loss.backward()
    trained = adapter_parameters(model)
    # the indexers' adapters get none: the NLL does not reach them (the indexer KL trains them)
    grads = {n: p.grad.float() for n, p in trained.items() if p.grad is not None}
    torch.optim.SGD(trained.values(), lr=_LR).step()
    return {"loss": float(loss.detach()), "grads": grads, "after": {n: p.detach().float() for n, p in trained.items()}}


def _layout_step(rank: int, world: int, folder: Path, layout: str) -> None:
    """One layout's step on this rank (see the module docstring); its results in ``folder``."""
    case = torch.load(folder / "case.pt", weights_only=True)
    mesh = build_mesh(ParallelSection(accelerator="cpu", devices=world, **_LAYOUTS[layout]), world_size=world)
    model = _adapted(case["state"])
    parallelize(model, mesh=mesh, ep=ep_size(mesh))
    params = dict(model.named_parameters())
    trained = adapter_parameters(model)
    frozen = {n: p.full_tensor() for n, p in params.items() if n not in trained}
    placements = {n: p.placements for n, p in trained.items() if ".experts." in n}
    tokens = case["tokens"][dp_rank(mesh) : dp_rank(mesh) + 1]
    lo, hi = context_parallel_bounds(tokens.shape[1], cp_rank(mesh), cp_size(mesh))
    nll, weight = model.loss(tokens[:, lo:hi], next_tokens=tokens[:, hi : hi + 1] if hi < tokens.shape[1] else None)
    total = torch.stack([nll.detach(), weight.detach()])
    dist.all_reduce(total)
    (nll / total[1]).backward()
    no_base_grads = all(p.grad is None for n, p in params.items() if n not in trained)
    grads = {n: p.grad.full_tensor() for n, p in trained.items() if p.grad is not None}
    torch.optim.SGD(trained.values(), lr=_LR).step()
    after = {n: p.full_tensor() for n, p in trained.items()}
    # every rank: the frozen base weights as they were (gathered whole from their shards)
    unchanged = no_base_grads and all(
        torch.equal(p.full_tensor(), frozen[n]) for n, p in params.items() if n not in trained
    )
    full = _full_model(model, _LORA)  # the export's gather: a collective, the copy on rank 0
    if rank == 0:
        assert full is not None
        save_adapter(full, folder / "adapter")
    torch.save(
        {
            "loss": float(total[0] / total[1]),
            "grads": grads,
            "after": after,
            "unchanged": unchanged,
            "placements": placements,
        },
        folder / f"rank{rank}.pt",
    )


def _worker(rank: int, world: int, folder: str) -> None:
    for layout in _LAYOUTS:  # one pair of processes for the three layouts (spawning costs more than a step)
        _layout_step(rank, world, Path(folder) / layout, layout)


def _within(errors: dict[str, float], rounding: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The tensors above 1e-5 and above twice their fp32-vs-float64 gap (see the module docstring)."""
    return {n: (e, rounding[n]) for n, e in errors.items() if e >= max(_TOL, 2 * rounding[n])}


def _check_layout(folder: Path, case: dict, layout: str) -> None:
    """One layout's two ranks against the one-process step (see the module docstring)."""
    ref, wide = _reference(case, torch.float32), _reference(case, torch.float64)
    rounding = {n: rms_ratio(wide["grads"][n], g) for n, g in ref["grads"].items()}
    worst = {}
    for r in range(2):
        out = torch.load(folder / f"rank{r}.pt", weights_only=False)
        assert out["unchanged"], f"{layout}, rank {r}: a frozen base weight changed or got a gradient"
        assert abs(out["loss"] - ref["loss"]) <= _TOL * abs(ref["loss"]), (layout, out["loss"], ref["loss"])
        assert out["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) > 0, layout
        errors = {n: rms_ratio(g, out["grads"][n]) for n, g in ref["grads"].items()}
        assert not _within(errors, rounding), (layout, _within(errors, rounding))
        # the adapters after the step (those without a gradient exactly as they were)
        moved = {n: rms_ratio(ref["after"][n], out["after"][n]) for n in ref["grads"]}
        assert max(moved.values()) < _TOL, (layout, moved)
        assert all(torch.equal(out["after"][n], case["state"][n]) for n in ref["after"] if n not in ref["grads"]), (
            layout
        )
        worst[r] = (
            f"gradient {max(errors.values()):.1e}, adapter {max(moved.values()):.1e}, "
            f"loss {abs(out['loss'] - ref['loss']) / abs(ref['loss']):.1e}"
        )
        if layout == "ep2":
            # the routed experts' adapters are sharded with their experts: Shard(0) over "ep"
            assert len(out["placements"]) == 8 and all(p[-1] == Shard(0) for p in out["placements"].values()), out[
                "placements"
            ]
    print(f"{layout}: worst relative errors per rank: {worst}")
    # the written adapter: PEFT's keys and shapes as one process writes them, holding exactly the
    # gathered adapters
    after = torch.load(folder / "rank0.pt", weights_only=False)["after"]
    one = _adapted(case["state"])
    save_adapter(one, folder / "one-adapter")
    written, expected = (
        load_file(folder / "adapter" / ADAPTER_WEIGHTS),
        load_file(folder / "one-adapter" / ADAPTER_WEIGHTS),
    )
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in expected.items()}, layout
    torch.manual_seed(0)
    fresh = GenoLM(_CONFIG)
    load_adapter(fresh, folder / "adapter")
    assert_bitwise_equal(adapter_parameters(fresh), after, f"the adapter written by rank 0 ({layout})")


def test_lora_step_under_ep_cp_fsdp_equals_one_process(tmp_path: Path) -> None:
    """The three layouts of the module docstring, each one SGD step on 2 ranks (one spawn for all)."""
    cases = {}
    for layout in _LAYOUTS:
        cases[layout] = _case(1 if layout == "cp2" else 2)
        (tmp_path / layout).mkdir()
        torch.save(cases[layout], tmp_path / layout / "case.pt")
    run_ranks(_worker, 2, tmp_path, str(tmp_path), timeout=240)
    for layout, case in cases.items():
        _check_layout(tmp_path / layout, case, layout)


@pytest.mark.slow
def test_lora_finetune_on_two_ranks_with_cp_and_ep_writes_the_one_process_adapter(
    sample_store: Path, tmp_path: Path
) -> None:
    """``genolong finetune`` of a LoRA recipe (attention and routed experts) as one process and as
    two (cp 2, ep 2, FSDP2; Lightning starts the second): the same step losses (1e-5: another
    summation order), runs/NAME/adapter/ from the two ranks holds the adapters of the one-process
    run (their moves from the start to 1e-3 of the move: AdamW divides each entry by its own
    gradient's scale, so near-zero entries differ more than the losses, as in
    tests/integration/test_finetune_distributed.py), and its export is the base with that adapter merged."""
    lora = {"targets": ["layers.*.self_attn.*"], "rank": 4, "alpha": 8.0, "routed_experts": True}
    logs = {}
    for name, parallel in (("one", {"devices": 1}), ("cp2ep2", {"devices": 2, "cp": 2, "ep": 2})):
        path = _finetune_recipe(tmp_path, sample_store, name, parallel)
        recipe = yaml.safe_load(path.read_text())
        recipe["model"]["lora"] = lora
        recipe["train"].update(max_steps=2, warmup_steps=1)
        recipe["eval"]["every_n_steps"] = 0
        path.write_text(yaml.safe_dump(recipe))
        _finetune(path)
        logs[name] = read_step_log(tmp_path / "runs" / name / "logs" / "steps.jsonl")
    for step in (1, 2):
        one, two = logs["one"][step]["train/loss"], logs["cp2ep2"][step]["train/loss"]
        assert abs(one - two) <= _TOL * abs(one), (step, one, two)

    def adapted(directory: Path | None) -> GenoLM:
        torch.manual_seed(3)  # the recipe's seed: finetune's base, then its adapters' start
        model = GenoLM(PRESETS["tiny"])
        if directory is None:
            apply_lora(model, LoraSection(**lora))
        else:
            load_adapter(model, directory)
        return model

    start = adapter_parameters(adapted(None))
    one = adapter_parameters(adapted(tmp_path / "runs" / "one" / "adapter"))
    two_model = adapted(tmp_path / "runs" / "cp2ep2" / "adapter")
    two = adapter_parameters(two_model)
    assert one.keys() == two.keys() == start.keys()
    moves = {n: rms_ratio(one[n] - start[n], two[n] - start[n]) for n in start if not torch.equal(one[n], start[n])}
    assert any(".experts." in n for n in moves) and max(moves.values()) < 1e-3, moves
    print(
        f"finetune cp 2 x ep 2: worst adapter move {max(moves.values()):.1e}, losses "
        f"{[(logs['one'][s]['train/loss'], logs['cp2ep2'][s]['train/loss']) for s in (1, 2)]}"
    )
    merged = GenoLM.from_pretrained(tmp_path / "runs" / "cp2ep2" / "export")
    tokens = torch.randint(1, 5, (1, 96), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        # fp32 rounding of the merge: W + s B A rounded once where the adapter model adds two products
        torch.testing.assert_close(merged(tokens), two_model(tokens), rtol=1e-5, atol=1e-5)
    # `genolong export` of the two-rank run's step checkpoint (sharded, DCP) in one process, the
    # trained state restored as --resume restores it: the adapter and the merged export the run
    # wrote at its end (each rank its shards, genolong.train.export), file for file
    run = tmp_path / "runs" / "cp2ep2"
    out = _cli("export", str(run), cwd=tmp_path).stdout
    assert out.count("genolong export: step0000002.ckpt of cp2ep2 ->") == 1, out
    _same_files(run / "exports" / "step0000002" / "export", run / "export")
    _same_files(run / "exports" / "step0000002" / "adapter", run / "adapter")
