"""Memory techniques (recompute, offload, MoE chunks) and the activation meter.

Every technique must leave the loss and every parameter gradient unchanged on the tiny preset
(T = 600 > index_topk * index_kpool, so the DSA selection is sparse), while the meter shows the
saving it promises.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from genolong.errors import InputError
from genolong.memory import ActivationMeter
from genolong.model import PRESETS, GenoLM, ModelConfig
from genolong.parallel import (
    ActivationOffloader,
    apply_recompute,
    is_recomputed,
    offloader_of,
    parallelize,
    remove_recompute,
)
from genolong.parallel.offload import apply_offload
from tests.helpers import assert_bitwise_equal

T = 600
TINY = PRESETS["tiny"]
assert T > TINY.index_topk * TINY.index_kpool


def _tokens(t: int = T, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, 6, (batch, t), generator=torch.Generator().manual_seed(1))


def _model(config: ModelConfig = TINY, **techniques: object) -> GenoLM:
    torch.manual_seed(0)
    return parallelize(GenoLM(config), **techniques)  # type: ignore[arg-type]


def _step(model: GenoLM, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], ActivationMeter]:
    """One metered forward+backward of the mean loss; returns loss, gradients and the meter."""
    with ActivationMeter(model) as meter:
        nll, weight = model.loss(tokens)
        loss = nll / weight
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, meter


TECHNIQUES: dict[str, dict[str, object]] = {
    **{
        f"selective-{kind}": {"recompute": "selective", "recompute_modules": (kind,)}
        for kind in ("kda", "dsa", "moe", "mlp", "hc")
    },
    "selective": {"recompute": "selective"},
    "full": {"recompute": "full"},
    "offload": {"offload": True, "offload_min_bytes": 0},
    "full+offload": {"recompute": "full", "offload": True, "offload_min_bytes": 0},
    "selective+offload": {"recompute": "selective", "offload": True, "offload_min_bytes": 0},
    "moe-chunks": {"moe_chunk_tokens": 100},
    "chunked": {"recompute": "chunked"},  # one chunk of 16384 tokens covers T
    "chunked+offload": {"recompute": "chunked", "recompute_chunk_tokens": 256, "offload": True, "offload_min_bytes": 0},
}
# same ops on the same values; not the MoE chunks and chunked recompute (other matmul shapes,
# gradients summed over chunks; the DSA segments take the keys' gradient through a separate keys
# phase, in another order even with one segment: tests/parallel/test_recompute_chunked.py compares the
# framework bitwise to the same chunked arithmetic and the segmented halves to fp32 rounding)
EXACT = {name for name in TECHNIQUES if name not in ("moe-chunks", "chunked", "chunked+offload")}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor], ActivationMeter]]:
    """Cache: technique name -> (loss, grads, meter); "none" is the baseline."""
    return {"none": _step(_model(), _tokens())}


def _run(runs: dict, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], ActivationMeter]:
    if name not in runs:
        runs[name] = _step(_model(**TECHNIQUES[name]), _tokens())
    return runs[name]


@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_technique_leaves_loss_and_gradients_unchanged(runs: dict, name: str) -> None:
    loss0, grads0, meter0 = runs["none"]
    loss, grads, meter = _run(runs, name)
    assert grads.keys() == grads0.keys() and len(grads) > 100
    if name in EXACT:
        assert_bitwise_equal(loss, loss0, f"the loss with {name}")
        bad = [n for n in grads0 if not torch.equal(grads[n], grads0[n])]
    else:  # MoE / feed-forward chunks: other matmul shapes, other float summation order
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0.0)
        bad = [n for n in grads0 if (grads[n] - grads0[n]).abs().max() > 1e-4 * grads0[n].abs().max() + 1e-12]
    assert not bad, f"{name}: gradients differ for {bad[:5]}"
    # every saved tensor was released by the end of backward
    assert meter.resident_bytes == 0 and meter.offloaded_bytes == 0
    assert meter0.peak_resident_bytes > 0


def test_meter_shows_each_saving(runs: dict) -> None:
    none = runs["none"][2].peak_resident_bytes
    for kind in ("kda", "dsa", "moe", "mlp", "hc"):
        assert _run(runs, f"selective-{kind}")[2].peak_resident_bytes < none, kind
    selective = _run(runs, "selective")[2].peak_resident_bytes
    full = _run(runs, "full")[2].peak_resident_bytes
    assert full < selective < none
    assert full < none / 10  # only block inputs (+ what the head and loss save)
    offload = _run(runs, "offload")[2]
    assert offload.peak_resident_bytes < none / 2 and offload.peak_offloaded_bytes > none / 2
    assert all(layer.offloaded_bytes > 0 for layer in offload.layers)
    full_off = _run(runs, "full+offload")[2]
    assert all(layer.resident_bytes == 0 for layer in full_off.layers)
    assert full_off.peak_resident_bytes < full


def test_meter_per_layer_attribution(runs: dict) -> None:
    meter = runs["none"][2]
    assert len(meter.layers) == TINY.num_hidden_layers
    per_layer = [layer.resident_bytes for layer in meter.layers]
    assert min(per_layer) > 0
    # the embedding saves nothing big; the head and the loss save the final hidden state
    assert 0 < meter.outside.resident_bytes < min(per_layer)
    # everything saved stays alive to the end of forward, except a few small temporaries
    total = sum(per_layer) + meter.outside.resident_bytes
    assert 0.99 * total <= meter.peak_resident_bytes <= total
    # full recompute: a layer keeps only its inputs, the [1, T, 4, 64] fp32 streams
    # (+ the [1, T, K] int64 indices the shared DSA layer 3 receives)
    full = _run(runs, "full")[2]
    streams = T * TINY.hc_mult * TINY.hidden_size * 4
    k = TINY.index_topk + TINY.index_kpool - 1
    assert [layer.resident_bytes for layer in full.layers] == [streams + (T * k * 8 if i == 3 else 0) for i in range(8)]
    # chunked keeps the same; with offload all of it moves
    assert [layer.resident_bytes for layer in _run(runs, "chunked")[2].layers] == [
        layer.resident_bytes for layer in full.layers
    ]
    chunked_off = _run(runs, "chunked+offload")[2]
    assert [layer.offloaded_bytes for layer in chunked_off.layers] == [layer.resident_bytes for layer in full.layers]
    assert all(layer.resident_bytes == 0 for layer in chunked_off.layers)


def test_full_offload_device_bytes_flat_in_layers() -> None:
    """Doubling the layers doubles the saved bytes without recompute, not with full + offload."""

    def config(n: int) -> ModelConfig:
        return TINY.replace(
            num_hidden_layers=n,
            layer_types=TINY.layer_types[:4] * (n // 4),
            mlp_layer_types=("dense",) + ("sparse",) * (n - 1),
            indexer_types=TINY.indexer_types[:4] * (n // 4),
        )

    tokens = _tokens(320)
    peaks = {}
    for n in (4, 8):
        for name, kw in (("none", {}), ("full+offload", TECHNIQUES["full+offload"])):
            _, _, meter = _step(_model(config(n), **kw), tokens)
            peaks[name, n] = meter.peak_resident_bytes
            if name == "full+offload":
                assert meter.peak_offloaded_bytes > 0 and all(layer.resident_bytes == 0 for layer in meter.layers)
    assert peaks["none", 8] > 1.7 * peaks["none", 4]
    assert peaks["full+offload", 8] == peaks["full+offload", 4]


def test_recompute_reproduces_the_dsa_indices_exactly() -> None:
    model = _model(recompute="full")
    seen: list[torch.Tensor] = []
    # layer 2 is a full DSA layer that passes its top-k to the shared layer 3
    assert model.layers[2].self_attn.returns_indices and model.layers[3].self_attn.shared
    model.layers[2].self_attn.register_forward_hook(lambda m, a, out: seen.append(out[1].clone()))
    nll, weight = model.loss(_tokens())
    assert len(seen) == 1
    (nll / weight).backward()
    assert len(seen) == 2  # the forward and the recomputation in backward
    assert torch.equal(seen[0], seen[1])  # exact: indices
    assert (seen[0] >= 0).sum(-1).max() < T  # a sparse selection, not every position


def test_offloader_copies_and_restores() -> None:
    model = _model(recompute="full", offload=True, offload_min_bytes=0)
    offloader = offloader_of(model)
    assert isinstance(offloader, ActivationOffloader)
    nll, weight = model.loss(_tokens())
    assert offloader.copies_to_host == TINY.num_hidden_layers + 1  # streams per layer, + indices of layer 3
    assert offloader.host_bytes > 0 and offloader.copies_to_device == 0
    (nll / weight).backward()
    assert offloader.copies_to_device == offloader.copies_to_host
    assert offloader.host_bytes == 0 and offloader.peak_host_bytes > 0
    # no gradient needed (evaluation): nothing offloaded, nothing recomputed
    with torch.no_grad():
        model.loss(_tokens())
    assert offloader.copies_to_host == TINY.num_hidden_layers + 1


def test_offload_pool_allocated_once_reused_and_released(caplog: pytest.LogCaptureFixture) -> None:
    """The host copies come from one pool (genolong.parallel.offload.HostPool): the first step's
    copies are allocated one by one and size it, the pool is allocated once at the second step and
    every copy of steps 2 and 3 comes out of it; the gradients equal the model's without offload
    bitwise (the copies are copies); release() gives it back and later copies are allocated alone.
    A pool sized up front (the planner's figure) is allocated at the first copy."""
    config = TINY.replace(num_hidden_layers=2)
    reference, model = _model(config), _model(config, offload=True, offload_min_bytes=0)
    offloader = offloader_of(model)
    assert offloader is not None
    tokens = _tokens(256)
    with caplog.at_level("INFO", logger="genolong"):
        for step in range(3):
            for m in (reference, model):
                m.zero_grad()
                nll, weight = m.loss(tokens)
                (nll / weight).backward()
            assert_bitwise_equal(
                {n: p.grad for n, p in model.named_parameters()},
                {n: p.grad for n, p in reference.named_parameters()},
                f"step {step + 1}'s gradients",
            )
            assert offloader.pool_allocations == (0 if step == 0 else 1)
            per_step = offloader.copies_to_host // (step + 1)
            # step 1: every copy alone; from step 2 on none (the pool holds a whole step's)
            assert offloader.unpooled_copies == per_step > 0, (step, offloader.unpooled_copies, per_step)
    assert offloader.pool is not None and offloader.pool.live == 0
    assert sum("activation offload pool" in r.getMessage() for r in caplog.records) == 1  # the time to pin, once
    offloader.release()
    assert offloader.pool is None
    nll, weight = model.loss(tokens)
    (nll / weight).backward()
    assert offloader.pool_allocations == 1 and offloader.unpooled_copies == 2 * per_step
    sized = _model(config, offload=True, offload_min_bytes=0, offload_pool_bytes=64 << 20)
    nll, weight = sized.loss(tokens)
    sized_offloader = offloader_of(sized)
    assert (
        sized_offloader is not None and sized_offloader.pool_allocations == 1 and sized_offloader.unpooled_copies == 0
    )
    assert sized_offloader.pool is not None and sized_offloader.pool.nbytes == 64 << 20


def test_offload_threshold_keeps_small_tensors_resident() -> None:
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                [
                    nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh()),
                    nn.Sequential(nn.Linear(8, 64, bias=False), nn.Tanh()),
                ]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[1](self.layers[0](x))

    model = Toy()
    offloader = apply_offload(model, min_bytes=1024)
    x = torch.randn(16, 8, requires_grad=True)
    with ActivationMeter(model) as meter:
        out = model(x)
        # layer 0 saves x and tanh's output (512 bytes each): resident; layer 1 saves its 512-byte
        # input (already counted) and a 4096-byte tanh output: offloaded
        assert [(m.resident_bytes, m.offloaded_bytes) for m in meter.layers] == [(1024, 0), (0, 4096)]
        assert offloader.host_bytes == 4096 and offloader.copies_to_host == 1
        out.square().sum().backward()
    assert meter.resident_bytes == 0 and meter.offloaded_bytes == 0 and offloader.host_bytes == 0
    offloader.detach()  # the same step without offload gives the same gradient
    grad = x.grad.clone()
    x.grad = None
    model(x).square().sum().backward()
    assert_bitwise_equal(x.grad, grad, "the gradient without offload")


def test_meter_counts_a_known_tensor_once() -> None:
    x = torch.randn(1000, requires_grad=True)  # 4000 bytes
    weight = nn.Parameter(torch.randn(10, 1000))
    with ActivationMeter() as meter:
        y = x.sin() + x.cos()  # both save x: one storage
        assert meter.resident_bytes == 4000
        z = F.linear(y, weight)  # saves y (4000 bytes) and the weight (a parameter: not counted)
        assert meter.resident_bytes == 8000
        view = x[10:20].exp()  # exp saves its output: a new 40-byte tensor
        assert meter.resident_bytes == 8040
        (z.sum() + view.sum()).backward()
        assert meter.resident_bytes == 0
    assert meter.peak_resident_bytes == 8040 and meter.offloaded_bytes == 0
    assert meter.peak_rss_bytes is not None and meter.peak_rss_bytes > 0


def test_meter_frees_a_graph_that_never_runs_backward() -> None:
    # exp saves its output; a packed object that held the output itself would close a cycle
    # through C++ (grad_fn -> saved variable -> packed -> output -> grad_fn) that gc cannot
    # break, so a branch the loss does not use kept its saved tensors for good (a training run at
    # 64 tokens per window grew by about 58 MB per step)
    x = torch.randn(1000, requires_grad=True)
    with ActivationMeter() as meter:
        for _ in range(3):
            unused = x.exp()  # 4,000 bytes saved, never differentiated
            assert meter.resident_bytes == 4000
            del unused
            assert meter.resident_bytes == 0
        used = x.exp()
        used.sum().backward()  # the saved output still serves backward
    assert torch.allclose(x.grad, x.detach().exp())  # d exp(x) / dx = exp(x): the saved output served backward
    assert meter.resident_bytes == 0 and meter.peak_resident_bytes == 4000


def test_meter_attributes_to_layers_and_excludes_parameters() -> None:
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh()) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)  # linear saves its input (the weight is not counted); tanh its output
            return x

    model = Toy()
    x = torch.randn(16, 8, requires_grad=True)
    with ActivationMeter(model) as meter:
        out = model(x).square()  # square saves the last tanh output: already counted in layer 1
        # layer 1's input is layer 0's output: counted once, in layer 0
        assert [layer.resident_bytes for layer in meter.layers] == [2 * 512, 512]
        assert meter.outside.resident_bytes == 0
        out.sum().backward()
    assert meter.resident_bytes == 0


def test_parallelize_keeps_names_and_applies_once() -> None:
    plain = GenoLM(TINY)
    model = parallelize(GenoLM(TINY), recompute="full", offload=True, moe_chunk_tokens=64)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(is_recomputed(block) for block in model.layers)
    assert all(m.chunk_tokens == 64 for m in model.modules() if hasattr(m, "chunk_tokens"))
    with pytest.raises(InputError, match="already applied"):
        apply_recompute(model, "full")
    with pytest.raises(InputError, match="already applied"):
        apply_offload(model)
    fresh = GenoLM(TINY)
    names = apply_recompute(fresh, "selective", ("dsa", "mlp"))
    assert names == ["layers.0.mlp", "layers.2.self_attn", "layers.3.self_attn", "layers.7.self_attn"]
    assert remove_recompute(fresh) == 4 and not any(is_recomputed(m) for m in fresh.modules())
    # selective without kinds: the defaults (both mixers and the hyper-connection weights)
    names = apply_recompute(fresh, "selective", ())
    assert names[:4] == ["layers.0.self_attn", "layers.0.attn_hc", "layers.0.ffn_hc", "layers.1.self_attn"]
    assert len(names) == 3 * TINY.num_hidden_layers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": torch.bfloat16}, "need a mesh"),
        ({"recompute": "ful"}, "did you mean 'full'"),
        ({"recompute": "selective", "recompute_modules": ("mo",)}, "did you mean 'moe'"),
        ({"moe_chunk_tokens": 0}, "moe_chunk_tokens"),
        ({"offload": True, "offload_min_bytes": -1}, "offload_min_bytes"),
    ],
)
def test_parallelize_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        parallelize(GenoLM(TINY), **kwargs)
    with pytest.raises(InputError, match="GenoLM"):
        parallelize(nn.Linear(2, 2))


def _hc_weights_saved_per_token(config: ModelConfig, bf16: bool) -> int:
    """Bytes per token one hyper-connection's weight computation keeps unless rebuilt in backward
    (see genolong.model.mhc): the normalised fp32 streams (+ the fp32 copy of bf16 streams), the
    rsqrt, the mixing logits, the pre/post sigmoids, the softmax and, per Sinkhorn division, its
    [m, m] numerator and [m] denominator, all fp32."""
    m, h = config.hc_mult, config.hidden_size
    return 4 * (
        m * h * (2 if bf16 else 1) + 1 + (2 + m) * m + 2 * m + m * m + (2 * config.hc_sinkhorn_iters - 1) * (m * m + m)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_weights_rebuilt_in_backward_bitwise(dtype: torch.dtype) -> None:
    """HyperConnection.recompute_weights (the default) against keeping the weight computation:
    the loss and every gradient bit for bit, and the meter's saving is exactly that computation's
    storages (in bf16 also the fp32 copy of each ``fn`` weight, a constant)."""
    from genolong.model.mhc import HyperConnection

    tokens = _tokens()
    runs = {}
    for rebuilt in (True, False):
        model = _model().to(dtype)
        hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
        assert all(hc.recompute_weights for hc in hcs)  # the default
        for hc in hcs:
            hc.recompute_weights = rebuilt
        runs[rebuilt] = _step(model, tokens)
    assert_bitwise_equal(runs[True][0], runs[False][0], f"the loss with the hc weights rebuilt ({dtype})")
    assert_bitwise_equal(runs[True][1], runs[False][1], f"the gradients with the hc weights rebuilt ({dtype})")
    n_hc = 2 * TINY.num_hidden_layers
    fn_copy = (2 + TINY.hc_mult) * TINY.hc_mult**2 * TINY.hidden_size * 4 if dtype == torch.bfloat16 else 0
    saved = n_hc * (T * _hc_weights_saved_per_token(TINY, dtype == torch.bfloat16) + fn_copy)
    assert runs[False][2].peak_resident_bytes - runs[True][2].peak_resident_bytes == saved
