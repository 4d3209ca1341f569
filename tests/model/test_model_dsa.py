"""The DSA mixer against transformers' Glm5NextTextAttention (fp32, forward, selection and every gradient)."""

from __future__ import annotations

import pytest
import torch

from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS, ModelConfig
from genolong.model.dsa import DSAMixer
from tests.helpers import run_transformers

# Layers 2 (full, followed by a shared layer) and 3 (shared) of the tiny preset's KKDDKKKD.
# 16 indexer heads with positive weights make exact ties (all-ReLU-zero pool scores) at the top-k
# boundary unlikely; inputs are redrawn until _boundary_margin shows none, and the tests assert it.
_CONFIGS = {
    # topk 64 / kpool 8: T=63 has 7 complete pools (all selected), T=130 has 16 (8 selected)
    "tiny": PRESETS["tiny"].replace(index_n_heads=16),
    # topk 16 / kpool 4: 4 pools selected out of 15 (T=63) or 32 (T=130)
    "sparse": PRESETS["tiny"].replace(index_n_heads=16, index_topk=16, index_kpool=4),
    "sparse-bias": PRESETS["tiny"].replace(index_n_heads=16, index_topk=16, index_kpool=4, attention_bias=True),
    # no tail: rows t < P - 1 select nothing. genolong outputs 0 there, as transformers' SDPA path
    # does (its eager path averages v over all T positions, future ones included), so this one is
    # compared with transformers under attn_implementation="sdpa"
    "no-tail": PRESETS["tiny"].replace(
        index_n_heads=16, index_topk=16, index_kpool=4, index_kpool_always_select_tail=False
    ),
}
_SDPA = {"no-tail"}
_LENGTHS = (63, 130)
_FULL, _SHARED = 2, 3

_HF_SCRIPT = r"""
import sys
import torch
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next import modeling_glm5_next as m
in_path, out_path = sys.argv[1], sys.argv[2]
payload = torch.load(in_path, weights_only=True)
result = {}
for name, entry in payload.items():
    c = Glm5NextTextConfig(**entry["config"])
    c._attn_implementation = entry["attn"]
    modules = {}
    for layer, state in entry["states"].items():
        modules[layer] = m.Glm5NextTextAttention(c, layer_idx=layer)
        modules[layer].load_state_dict(state, strict=True)
    runs = []
    for inputs in entry["runs"]:
        run, prev = {}, None
        for layer, module in modules.items():
            x = inputs[layer]["x"].clone().requires_grad_(True)
            mask = torch.ones(x.shape[:2], dtype=torch.bool)
            out, _, idx = module(x, mask, prev_topk_indices=prev)
            module.zero_grad()
            (out * inputs[layer]["probe"]).sum().backward()
            run[layer] = {"out": out.detach(), "grad_x": x.grad,
                          "indices": None if idx is None else idx.detach().clone(),
                          "grads": {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None},
                          "no_grad": [k for k, p in module.named_parameters() if p.grad is None]}
            prev = idx
        runs.append(run)
    result[name] = runs
torch.save(result, out_path)
"""

_MARGIN = 1e-4  # smallest relative score gap at the pool top-k boundary the inputs may have


def _make_inputs(config: ModelConfig, seed: int = 0) -> dict:
    """Weights (normal 0.3, positive head weights) and inputs (the full layer's redrawn until no
    near-tie sits at any row's top-k boundary) for the full and the shared layer."""
    torch.manual_seed(seed)
    states, mixers = {}, {}
    for layer in (_FULL, _SHARED):
        mixer = DSAMixer(config, layer)
        with torch.no_grad():
            for p in mixer.parameters():
                p.normal_(0, 0.3)
            if mixer.indexer is not None:
                mixer.indexer.weights_proj.weight.abs_()  # with x > 0: positive head weights
        mixers[layer] = mixer
        states[layer] = {k: v.detach().clone() for k, v in mixer.state_dict().items()}
    runs = []
    for t in _LENGTHS:
        for _ in range(100):
            x = torch.randn(2, t, config.hidden_size).abs()
            if _boundary_margin(mixers[_FULL], x) > _MARGIN:
                break
        else:
            raise AssertionError(f"no tie-free input found for T={t}")
        xs = torch.randn(2, t, config.hidden_size)
        runs.append(
            {
                _FULL: {"x": x, "probe": torch.randn(2, t, config.hidden_size)},
                _SHARED: {"x": xs, "probe": torch.randn(2, t, config.hidden_size)},
            }
        )
    return {"config": config.to_hf_dict(), "states": states, "runs": runs}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("hf")
    inputs = {name: _make_inputs(config) for name, config in _CONFIGS.items()}
    for name, entry in inputs.items():
        entry["attn"] = "sdpa" if name in _SDPA else "eager"
    torch.save(inputs, folder / "in.pt")
    run_transformers(_HF_SCRIPT, str(folder / "in.pt"), str(folder / "out.pt"))
    outputs = torch.load(folder / "out.pt", weights_only=True)
    for name, entry in inputs.items():
        for run, out in zip(entry["runs"], outputs[name]):
            for layer in run:
                run[layer].update(out[layer])
    return inputs


def _run(mixer: DSAMixer, data: dict, prev: torch.Tensor | None = None) -> tuple[dict, torch.Tensor | None]:
    x = data["x"].clone().requires_grad_(True)
    out, indices = mixer(x, prev)
    (out * data["probe"]).sum().backward()
    grads = {k: p.grad for k, p in mixer.named_parameters() if p.grad is not None}
    no_grad = [k for k, p in mixer.named_parameters() if p.grad is None]
    return {"out": out.detach(), "x": x.grad, **grads, "no_grad": no_grad}, indices


def _index_sets(indices: torch.Tensor) -> list[list[int]]:
    """Each row's selected positions as a sorted list (transformers and genolong order/pad differently)."""
    flat = indices.long().reshape(-1, indices.shape[-1])
    return [sorted(v for v in row.tolist() if v >= 0) for row in flat]


def _boundary_margin(mixer: DSAMixer, x: torch.Tensor) -> float:
    """Smallest relative gap, over the rows that must choose, between the last kept and the first
    dropped pool score (dense float64 scores from the mixer's own indexer projections; test only;
    1.0 when no row has to choose). A clear gap means no tie at the boundary, so torch.topk and
    genolong's lowest-position rule select the same pools.
    """
    assert mixer.indexer is not None
    with torch.no_grad():
        q_resid = mixer.q_a_layernorm(mixer.q_a_proj(x))
        q_idx, k_pool, w = mixer.indexer.project(x, q_resid)
        z = torch.einsum("bthd,bjd->bthj", q_idx.double(), k_pool.double()) * mixer.indexer.softmax_scale
        s = torch.einsum("bth,bthj->btj", w.double(), z.relu())  # [B, T, NP]
    p, keep = mixer.indexer.index_kpool, mixer.indexer.index_topk // mixer.indexer.index_kpool
    worst = 1.0
    for t in range(x.shape[1]):
        visible = (t + 1) // p
        if visible <= keep:
            continue
        row = s[:, t, :visible].sort(dim=-1, descending=True).values
        margin = (row[:, keep - 1] - row[:, keep]) / row[:, 0].abs().clamp(min=1e-30)
        worst = min(worst, float(margin.min()))
    return worst


@pytest.mark.parametrize("name", list(_CONFIGS))
@pytest.mark.parametrize("run", range(len(_LENGTHS)))
def test_full_dsa_layer_matches_transformers(reference: dict, name: str, run: int) -> None:
    """Same weights (loaded by checkpoint name), same input: same selection, output and gradients.

    The selection runs without gradient in both, so the indexer parameters get none.
    """
    config = _CONFIGS[name]
    ref = reference[name]
    data = ref["runs"][run][_FULL]
    mixer = DSAMixer(config, _FULL)
    mixer.load_state_dict(ref["states"][_FULL], strict=True)
    margin = _boundary_margin(mixer, data["x"])
    assert margin > _MARGIN, f"pool scores (nearly) tie at the top-k boundary: relative margin {margin:.2e}"
    ours, indices = _run(mixer, data)
    assert indices is not None and data["indices"] is not None  # layer 3 is shared: both hand indices on
    width = config.index_topk + (config.index_kpool - 1 if config.index_kpool_always_select_tail else 0)
    assert indices.shape == data["indices"].shape == (2, data["x"].shape[1], width)
    assert _index_sets(indices) == _index_sets(data["indices"])
    hf = {"out": data["out"], "x": data["grad_x"], **data["grads"]}
    assert sorted(ours.pop("no_grad")) == sorted(data["no_grad"])
    assert all(k.startswith("indexer.") for k in data["no_grad"]) and data["no_grad"]
    assert set(hf) == set(ours)
    for key in hf:
        assert rms_ratio(hf[key], ours[key]) < 1e-5, key


@pytest.mark.parametrize("name", list(_CONFIGS))
@pytest.mark.parametrize("run", range(len(_LENGTHS)))
def test_shared_dsa_layer_matches_transformers(reference: dict, name: str, run: int) -> None:
    """A full layer then a shared one: genolong's shared layer, given genolong's full layer's
    indices, matches transformers' shared layer given transformers' indices."""
    config = _CONFIGS[name]
    ref = reference[name]
    full = DSAMixer(config, _FULL)
    full.load_state_dict(ref["states"][_FULL], strict=True)
    with torch.no_grad():
        _, indices = full(ref["runs"][run][_FULL]["x"])
    data = ref["runs"][run][_SHARED]
    shared = DSAMixer(config, _SHARED)
    assert shared.indexer is None and not shared.returns_indices
    shared.load_state_dict(ref["states"][_SHARED], strict=True)
    ours, nxt = _run(shared, data, indices)
    assert nxt is None and data["indices"] is None
    assert ours.pop("no_grad") == [] == data["no_grad"]
    hf = {"out": data["out"], "x": data["grad_x"], **data["grads"]}
    assert set(hf) == set(ours)
    for key in hf:
        assert rms_ratio(hf[key], ours[key]) < 1e-5, key


def test_shared_layer_without_indices_raises() -> None:
    mixer = DSAMixer(PRESETS["tiny"], _SHARED)
    with pytest.raises(ValueError, match="shared"):
        mixer(torch.randn(1, 9, PRESETS["tiny"].hidden_size))


def test_indices_returned_only_before_a_shared_layer() -> None:
    config = PRESETS["tiny"]  # KKDDKKKD, layer 3 shared
    assert DSAMixer(config, 2).returns_indices
    assert not DSAMixer(config, 7).returns_indices  # last layer: transformers clamps to itself
    torch.manual_seed(0)
    out, indices = DSAMixer(config, 7)(torch.randn(1, 20, config.hidden_size))
    assert indices is None and out.shape == (1, 20, config.hidden_size)


def test_selection_is_causal_and_sized() -> None:
    """Every selected position is <= its query; each row holds min(visible pools, topk/P) pools
    plus its tail, so no row is empty and the query sees itself unless it closes a pool."""
    config = PRESETS["tiny"].replace(index_topk=16, index_kpool=4)
    torch.manual_seed(1)
    mixer = DSAMixer(config, 2)
    assert mixer.indexer is not None
    t = 41
    x = torch.randn(2, t, config.hidden_size)
    indices = mixer.indexer(x, mixer.q_a_layernorm(mixer.q_a_proj(x)))
    assert indices.shape == (2, t, 16 + 3) and not indices.requires_grad
    pos = torch.arange(t)[None, :, None]
    assert bool(((indices <= pos) | (indices < 0)).all())
    for b in range(2):
        for q in range(t):
            row = set(v for v in indices[b, q].tolist() if v >= 0)
            assert len(row) == 4 * min((q + 1) // 4, 4) + (q + 1) % 4
            if (q + 1) % 4:
                assert q in row


def test_bf16_runs_and_tracks_fp32() -> None:
    """bf16 weights and input: forward and backward run, and the output stays near fp32's."""
    config = PRESETS["tiny"].replace(index_topk=16, index_kpool=4)
    torch.manual_seed(2)
    mixer = DSAMixer(config, 2)
    x = torch.randn(1, 37, config.hidden_size)
    want, _ = mixer(x)
    mixer = mixer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    got, indices = mixer(xb)
    got.float().square().sum().backward()
    assert got.dtype == torch.bfloat16 and indices is not None and xb.grad is not None
    assert rms_ratio(want, got) < 5e-2


def test_indexer_kl_trains_only_the_indexer() -> None:
    """With ``indexer_kl`` on, a training forward leaves the sparse-stage KL on each full-indexer
    layer; its gradient reaches that layer's indexer parameters and nothing else, and it is not
    computed without gradients (evaluation, decoding)."""
    from genolong.model import PRESETS, GenoLM
    from genolong.model.dsa import DSAMixer

    torch.manual_seed(5)
    model = GenoLM(PRESETS["tiny"])
    mixers = [m for m in model.modules() if isinstance(m, DSAMixer)]
    full = [m for m in mixers if m.indexer is not None]
    assert len(full) == 2 and len(mixers) == 3
    for m in full:
        m.indexer_kl = True
    tokens = torch.randint(1, 5, (1, 211))  # 26 pools of 8 > 64 / 8 selected: sparse
    with torch.no_grad():
        model.loss(tokens)
    assert all(m.last_indexer_kl is None for m in full)
    model.loss(tokens)
    kls = [m.last_indexer_kl for m in full]
    assert all(kl is not None and float(kl.detach()) > 0 for kl in kls)
    torch.stack(kls).sum().backward()
    for name, p in model.named_parameters():
        touched = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert touched == (".indexer." in name), name


@pytest.mark.parametrize("t", [63, 517])
def test_absorbed_latent_attention_equals_expanded(t: int) -> None:
    """The default (kv_b_proj absorbed, attention over the kv latent) equals the plain expanded
    form forward and in every gradient to 1e-5 (the sparse-attention kernel computes in float32,
    so only float32 rounding differs)."""
    torch.manual_seed(t)
    config = PRESETS["tiny"].replace(index_topk=16, index_kpool=4)
    mixer = DSAMixer(config, layer_idx=2)
    x = torch.randn(2, t, config.hidden_size)
    results = []
    for absorb in (True, False):
        mixer.absorb = absorb
        mixer.zero_grad()
        out, indices = mixer(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert rms_ratio(b, a) < 1e-5
    assert ga.keys() == gb.keys() and "kv_b_proj.weight" in ga
    for name in ga:
        assert rms_ratio(gb[name], ga[name]) < 1e-5, name
