"""The DSA attention half in query segments (``genolong.parallel.chunked_dsa``, for
``memory.recompute: chunked``) and the layering of the model (it imports nothing from
``genolong.parallel``; context parallelism is installed onto the plain DSA mixer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import genolong.model
from genolong.errors import InputError
from genolong.memory import ActivationMeter
from genolong.model import PRESETS, GenoLM, ModelConfig
from genolong.model.mhc import merge_streams
from genolong.parallel import apply_recompute
from genolong.parallel.chunked_dsa import _keys_chunk, _query_segment, dsa_attention_half
from genolong.parallel.context import apply_context_parallel, is_context_parallel
from tests.helpers import assert_bitwise_equal, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL_DIR = Path(genolong.model.__file__).parent
# layers 2 (full indexer, returns its indices) and 3 (shared: reuses them) of the tiny preset; 16
# index heads keep exact top-k ties away (the segmented and whole selections score the same
# numbers anyway, so ties would break the same way)
CONFIGS = {
    "tiny": PRESETS["tiny"].replace(index_n_heads=16),  # topk 64 / kpool 8
    "sparse": PRESETS["tiny"].replace(index_n_heads=16, index_topk=16, index_kpool=4),  # 4 of up to 50 pools
}
FULL, SHARED = 2, 3
# gradients and the indexer KL: the segmented half sums the same per-token terms in another order
# (per segment, then over segments; the keys' gradient of each segment's attention is added by
# autograd; the KL is sum_s KL_s * n_s / n instead of one running sum): float32 rounding, measured
# at most 1e-6 of each tensor's largest magnitude on these cases
GRAD_TOL = 1e-5
KL_TOL = 1e-6


def _imported_modules(source: str, package: str = "genolong.model") -> list[str]:
    """Absolute names of every module a source file of ``package`` imports (top level or inside
    functions; ``from X import y`` also names ``X.y``, which may be a module)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _parallel_imports(source: str) -> list[str]:
    return [m for m in _imported_modules(source) if m == "genolong.parallel" or m.startswith("genolong.parallel.")]


def test_model_imports_nothing_from_parallel() -> None:
    files = sorted(MODEL_DIR.glob("*.py"))
    assert len(files) >= 10 and any(f.name == "dsa.py" for f in files)
    offenders = {f.name: _parallel_imports(f.read_text()) for f in files}
    assert not any(offenders.values()), f"genolong.model modules import genolong.parallel: {offenders}"
    # the scan catches each spelling (today's dsa.py had the first, inside a method)
    for line in (
        "def f():\n    from ..parallel.cp_dsa import cp_dsa_forward",
        "from .. import parallel",
        "import genolong.parallel.context",
        "from genolong.parallel import parallelize",
    ):
        assert _parallel_imports(line), line
    assert not _parallel_imports("from ..kernels.kda.cp import conv_halo")  # kernels are not parallel


# ----------------------------------------------------------------------------- the segmented half


def _blocks(config: ModelConfig, seed: int = 0) -> GenoLM:
    torch.manual_seed(seed)
    model = GenoLM(config)
    with torch.no_grad():  # move off the init (zero KPool ape, unit gate...) so every term counts
        for layer in (FULL, SHARED):
            for p in model.layers[layer].parameters():
                p.add_(torch.randn_like(p) * 0.1)
    model.layers[FULL].self_attn.indexer_kl = True
    return model


def plain_half(block: nn.Module, streams: torch.Tensor, prev: torch.Tensor | None):
    """The reference: attn_hc -> input_layernorm -> self_attn -> merge_streams (Block.forward's first half)."""
    post, comb, x = block.attn_hc(streams)
    x, indices = block.self_attn(block.input_layernorm(x), prev)
    return merge_streams(post, comb, x, streams), indices


def _probe(streams: torch.Tensor) -> torch.Tensor:
    """The output weights of the loss: ``[B, T, m, H]``, a fixed function of the shape."""
    return torch.linspace(-1, 1, streams.numel()).view_as(streams)


def _run(model: GenoLM, streams: torch.Tensor, chunk: int | None, probe: torch.Tensor | None = None) -> dict:
    """The full then the shared layer's half (segmented when ``chunk``), backward of a probe-weighted
    sum of the outputs plus the indexer KL; returns outputs, indices, KL, loss and every gradient."""
    model.zero_grad(set_to_none=True)
    streams = streams.clone().requires_grad_(True)
    half = plain_half if chunk is None else (lambda b, s, p: dsa_attention_half(b, s, p, chunk))
    out2, indices = half(model.layers[FULL], streams, None)
    out3, none = half(model.layers[SHARED], out2, indices)
    assert none is None
    kl = model.layers[FULL].self_attn.last_indexer_kl
    probe = _probe(streams) if probe is None else probe
    loss = (out3 * probe).sum() + kl
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {
        "out": out3.detach(),
        "indices": indices,
        "kl": kl.detach(),
        "loss": loss.detach(),
        "grads": {"streams": streams.grad, **grads},
    }


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
    assert err <= tol, f"{what}: max |diff| / max |ref| = {err:.2e} > {tol}"


@pytest.mark.parametrize(
    "name,t,chunk",
    [
        ("tiny", 120, 16),  # T a multiple of the pool (8), not of the segment
        ("tiny", 123, 32),  # odd length: an incomplete last pool, a short last segment
        ("tiny", 64, 64),  # one segment
        ("tiny", 40, 64),  # shorter than a segment
        ("tiny", 72, 8),  # segments of one pool
        ("sparse", 202, 12),  # 4-token pools, 4 of up to 50 selected; 17 segments
    ],
)
def test_segmented_half_equals_plain_half(name: str, t: int, chunk: int) -> None:
    config = CONFIGS[name]
    model = _blocks(config)
    torch.manual_seed(1)
    streams = torch.randn(2, t, config.hc_mult, config.hidden_size)
    ref, got = _run(model, streams, None), _run(model, streams, chunk)
    # per query the arithmetic is the whole half's: outputs bitwise, selections exactly
    assert_bitwise_equal(got["out"], ref["out"], "segmented half outputs")
    assert torch.equal(got["indices"], ref["indices"])  # exact: ints
    assert (ref["indices"] >= 0).sum() > 0
    _assert_close(got["kl"], ref["kl"], KL_TOL, "indexer KL")
    assert ref["kl"] > 0
    _assert_close(got["loss"], ref["loss"], KL_TOL, "loss")
    assert got["grads"].keys() == ref["grads"].keys()
    names = set(ref["grads"])
    assert {
        "layers.2.self_attn.indexer.wk.weight",
        "layers.2.self_attn.indexer.wq_b.weight",
        "layers.2.attn_hc.fn",
        "layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "streams",
    } <= names
    for key in names:
        _assert_close(got["grads"][key], ref["grads"][key], GRAD_TOL, f"gradient of {key}")


def test_expanded_form_and_no_grad() -> None:
    """absorb False (expanded keys) segments the same way; without autograd the plain half runs."""
    config = CONFIGS["tiny"]
    model = _blocks(config)
    for layer in (FULL, SHARED):
        model.layers[layer].self_attn.absorb = False
    torch.manual_seed(2)
    streams = torch.randn(1, 56, config.hc_mult, config.hidden_size)
    ref, got = _run(model, streams, None), _run(model, streams, 24)
    # not bitwise: each segment expands the keys of positions [0, end) through kv_b_proj, a matmul
    # of another shape than the whole half's [0, T) (the BLAS picks kernels by shape): ~1e-6
    _assert_close(got["out"], ref["out"], GRAD_TOL, "segmented half outputs (expanded)")
    assert torch.equal(got["indices"], ref["indices"])  # exact: ints
    for key in ref["grads"]:
        _assert_close(got["grads"][key], ref["grads"][key], GRAD_TOL, f"gradient of {key} (expanded)")
    with torch.no_grad():
        out, idx = dsa_attention_half(model.layers[FULL], streams, None, 24)
        want, want_idx = plain_half(model.layers[FULL], streams, None)
    assert_bitwise_equal(out, want, "no-grad half")
    assert torch.equal(idx, want_idx)  # exact: ints


def test_bad_inputs() -> None:
    model = _blocks(CONFIGS["tiny"])
    streams = torch.randn(1, 32, 4, CONFIGS["tiny"].hidden_size)
    with pytest.raises(InputError, match="multiple of index_kpool"):
        dsa_attention_half(model.layers[FULL], streams, None, 12)
    with pytest.raises(InputError, match="positive integer"):
        dsa_attention_half(model.layers[FULL], streams, None, 0)
    with pytest.raises(InputError, match="DSA mixer"):
        dsa_attention_half(model.layers[0], streams, None, 16)
    with pytest.raises(InputError, match="prev_indices"):
        dsa_attention_half(model.layers[SHARED], streams, None, 16)


class _SegmentedBlockForward:
    """A Block forward whose DSA attention half is :func:`dsa_attention_half` (the feed-forward half
    and KDA blocks as Block.forward), installed as an instance attribute as the chunked recompute
    framework does; for the whole-model check only."""

    def __init__(self, block: nn.Module, chunk: int):
        self.block, self.chunk = block, chunk

    def __call__(self, streams: torch.Tensor, prev: torch.Tensor | None = None):
        block = self.block
        streams, indices = dsa_attention_half(block, streams, prev, self.chunk)
        post, comb, x = block.ffn_hc(streams)
        x = block.mlp(block.post_attention_layernorm(x))
        return merge_streams(post, comb, x, streams), indices


@pytest.mark.parametrize("offload", [False, True])
def test_whole_model_with_segmented_dsa_halves(offload: bool) -> None:
    """The tiny GenoLM (KDA, full and shared DSA layers, MoE, mHC) with every DSA block's attention
    half segmented (and activation offload on): loss, indexer KLs and every gradient as the plain
    model's (tolerances as above), and the DSA layers keep less."""
    from genolong.parallel.offload import apply_offload

    config = CONFIGS["tiny"]
    torch.manual_seed(4)
    tokens = torch.randint(1, 9, (2, 100))

    def step(model: GenoLM) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor], ActivationMeter]:
        for block in model.layers:
            if block.layer_type == "indexed_attention" and block.self_attn.indexer is not None:
                block.self_attn.indexer_kl = True
        with ActivationMeter(model) as meter:
            nll, weight = model.loss(tokens)
            kls = [
                b.self_attn.last_indexer_kl
                for b in model.layers
                if b.layer_type == "indexed_attention" and b.self_attn.indexer is not None
            ]
            loss = nll / weight + sum(kls)
            loss.backward()
        return loss.detach(), [k.detach() for k in kls], {n: p.grad for n, p in model.named_parameters()}, meter

    torch.manual_seed(5)
    plain = GenoLM(config)
    torch.manual_seed(5)
    model = GenoLM(config)
    dsa = [i for i, b in enumerate(model.layers) if b.layer_type == "indexed_attention"]
    assert len(dsa) == 3 and model.layers[3].self_attn.indexer is None
    for i in dsa:
        model.layers[i].forward = _SegmentedBlockForward(model.layers[i], 24)
    if offload:
        apply_offload(model, 0)
    loss0, kls0, grads0, _ = step(plain)
    loss, kls, grads, meter = step(model)
    _assert_close(loss, loss0, KL_TOL, "loss")
    for kl, kl0 in zip(kls, kls0):
        _assert_close(kl, kl0, KL_TOL, "indexer KL")
    assert grads.keys() == grads0.keys()
    for key in grads0:
        _assert_close(grads[key], grads0[key], GRAD_TOL, f"gradient of {key}")
    if not offload:  # a DSA layer's attention half now keeps its streams and keys only: less than before
        meter0 = step(plain)[3]
        for i in dsa:
            assert meter.layers[i].resident_bytes < meter0.layers[i].resident_bytes


def test_kl_kernel_query_offset() -> None:
    """kpool_indexer_kl_loss(q_offset=s) of queries [s, T) over the keys of [0, T): with the mean of
    [0, s) weighted by the counts it gives the whole mean, and its gradients (float64: 1e-12)."""
    from genolong.kernels.dsa import kpool_indexer_kl_loss

    g = torch.Generator().manual_seed(0)
    b, t, p, kp, s = 2, 97, 4, 3, 44
    q = torch.randn(b, t, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, 1, 16, generator=g, dtype=torch.float64)
    q_idx = torch.randn(b, t, 3, 8, generator=g, dtype=torch.float64).requires_grad_()
    k_pool = torch.randn(b, t // p, 8, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(b, t, 3, generator=g, dtype=torch.float64).requires_grad_()
    limit = (torch.arange(t) + 1) // p  # pools eligible for query t: 0 .. limit - 1
    pools = torch.where(
        torch.rand(b, t, kp, generator=g) < 0.8, (torch.rand(b, t, kp, generator=g) * limit[None, :, None]).long(), -1
    )
    pools = torch.where(limit[None, :, None] > 0, pools, -1)

    def counted(rows: torch.Tensor, q0: int) -> int:
        tq = torch.arange(q0, q0 + rows.shape[1])
        return int(((rows >= 0) & ((rows + 1) * p - 1 <= tq[None, :, None])).any(-1).sum())

    whole = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w, pools, p, tail=True)
    head = kpool_indexer_kl_loss(q[:, :s], k[:, :s], q_idx[:, :s], k_pool[:, : s // p], w[:, :s], pools[:, :s], p)
    tail = kpool_indexer_kl_loss(q[:, s:], k, q_idx[:, s:], k_pool, w[:, s:], pools[:, s:], p, q_offset=s)
    n0, n1 = counted(pools[:, :s], 0), counted(pools[:, s:], s)
    assert n0 > 0 and n1 > 0
    split = (head * n0 + tail * n1) / (n0 + n1)
    _assert_close(split, whole, 1e-12, "KL of two query ranges")
    for gx, gw in zip(torch.autograd.grad(split, (q_idx, k_pool, w)), torch.autograd.grad(whole, (q_idx, k_pool, w))):
        _assert_close(gx, gw, 1e-12, "KL gradient of two query ranges")
    with pytest.raises(InputError, match="q_offset"):
        kpool_indexer_kl_loss(q[:, s:], k[:, s:], q_idx[:, s:], k_pool, w[:, s:], pools[:, s:], p, q_offset=s)


# ----------------------------------------------------------------------------- what autograd keeps


def test_meter_keeps_streams_and_keys_only() -> None:
    """After the forward autograd holds the block input streams, the kv latent and the pooled index
    keys (plus a few scalars of the KL sum); nothing else, whatever T."""
    config = CONFIGS["tiny"]
    model = _blocks(config)
    b, chunk = 2, 16
    for t in (64, 128):
        streams = torch.randn(b, t, config.hc_mult, config.hidden_size, requires_grad=True)
        n_seg = -(-t // chunk)
        with ActivationMeter(model) as meter:
            out, indices = dsa_attention_half(model.layers[FULL], streams, None, chunk)
            kept = meter.resident_bytes
            keys = b * t * config.kv_lora_rank * 4 + b * (t // config.index_kpool) * config.index_head_dim * 4
            expected = streams.numel() * 4 + keys
            # the KL sum: per segment its float32 count (saved by the multiplication), then the divisor
            assert expected <= kept <= expected + 8 * (n_seg + 2), (t, kept, expected)
            (out.sum() + model.layers[FULL].self_attn.last_indexer_kl).backward()
        assert meter.resident_bytes == 0
        # the unsegmented half keeps several times more, growing with T
        with ActivationMeter(model) as meter:
            plain = plain_half(model.layers[FULL], streams, None)  # kept alive: its graph holds what the meter counts
            assert meter.resident_bytes > 4 * expected
            del plain


def _rebuilt_bytes(fn, model: nn.Module, *args) -> int:
    """Peak bytes autograd saves while ``fn(*args)`` runs without a checkpoint: what the
    checkpoint rebuilds (and holds) during that segment's backward."""
    with ActivationMeter(model) as meter:
        result = fn(*args)
        peak = meter.peak_resident_bytes
    del result
    return peak


def test_rebuilt_region_bounded_by_chunk() -> None:
    """One segment's rebuild keeps the same bytes at T = 128 and 512 apart from the keys it reads
    (a view of the whole latent and pooled keys: their storage is counted, and live anyway)."""
    config = CONFIGS["tiny"]
    model = _blocks(config)
    mixer = model.layers[FULL].self_attn
    b, chunk = 2, 32
    rebuilt, keys_rebuilt = {}, {}
    for t in (128, 512):
        streams = torch.randn(b, chunk, config.hc_mult, config.hidden_size)  # the last segment's own rows
        latent = torch.randn(b, t, config.kv_lora_rank, requires_grad=True)
        pooled = torch.randn(b, t // config.index_kpool, config.index_head_dim, requires_grad=True)
        key_bytes = (latent.numel() + pooled.numel()) * 4
        seg = _rebuilt_bytes(
            _query_segment,
            model,
            model.layers[FULL],
            streams.requires_grad_(True),
            latent,
            pooled,
            None,
            t - chunk,
            True,
        )
        rebuilt[t] = seg - key_bytes - streams.numel() * 4
        keys_rebuilt[t] = _rebuilt_bytes(_keys_chunk, model, model.layers[FULL], streams, True)
    assert rebuilt[128] == rebuilt[512] > 0, rebuilt
    assert keys_rebuilt[128] == keys_rebuilt[512] > 0, keys_rebuilt
    assert mixer.indexer is not None


# ----------------------------------------------------------------------------- context parallelism


def test_apply_context_parallel_installs_and_removes_the_forward() -> None:
    model = _blocks(CONFIGS["tiny"])
    mixer = model.layers[FULL].self_attn
    apply_context_parallel(model, object())  # any group object: nothing runs
    assert is_context_parallel(mixer) and mixer.cp_group is not None
    apply_context_parallel(model, None)
    assert not is_context_parallel(mixer) and mixer.cp_group is None and "forward" not in mixer.__dict__
    apply_recompute(model, "selective", ("dsa",))
    with pytest.raises(InputError, match="apply context parallelism first"):
        apply_context_parallel(model, object())


def _cp_rank(rank: int, world: int, case: dict) -> None:
    torch.set_num_threads(1)
    config = CONFIGS["tiny"]
    model = _blocks(config)
    model.load_state_dict(case["state"])
    ref = case["ref"]
    apply_context_parallel(model, dist.group.WORLD)
    t = case["streams"].shape[1] // world
    sl = slice(rank * t, (rank + 1) * t)
    got = _run(model, case["streams"][:, sl], case["chunk"], _probe(case["streams"])[:, sl])
    _assert_close(got["out"], ref["out"][:, sl], 1e-5, "CP segmented outputs")
    assert torch.equal(got["indices"], ref["indices"][:, sl])  # exact: ints (global positions)
    kl = got["kl"].clone()
    dist.all_reduce(kl)  # the shares sum to the one-process KL
    _assert_close(kl, ref["kl"], KL_TOL, "CP indexer KL")
    _assert_close(got["grads"]["streams"], ref["grads"]["streams"][:, sl], GRAD_TOL, "CP streams gradient")
    for key, grad in got["grads"].items():
        if key != "streams":
            dist.all_reduce(grad)
            _assert_close(grad, ref["grads"][key], GRAD_TOL, f"CP gradient of {key}")
    assert got["grads"].keys() == ref["grads"].keys()
    # kept under CP: the slice's streams and the gathered keys of positions [0, end) (not re-gathered)
    streams = case["streams"][:, sl].clone().requires_grad_(True)
    b, end, chunk = streams.shape[0], (rank + 1) * t, case["chunk"]
    with ActivationMeter(model) as meter:
        out, _ = dsa_attention_half(model.layers[FULL], streams, None, chunk)
        kept = meter.resident_bytes
        expected = (
            streams.numel() * 4 + b * end * (config.kv_lora_rank + config.index_head_dim // config.index_kpool) * 4
        )
        assert expected <= kept <= expected + 8 * (-(-t // chunk) + 2), (rank, kept, expected)
        (out.sum() + model.layers[FULL].self_attn.last_indexer_kl).backward()


def test_cp2_segmented_half_equals_one_process(tmp_path: Path) -> None:
    """CP = 2 (gloo): each rank's segmented half on its 96-token slice (segments of 40: not a
    divisor) equals the one-process whole half's rows; KL shares and parameter gradients summed over
    the ranks equal the one-process ones (tolerance as the CP layer's: GRAD_TOL); autograd keeps the
    gathered keys of positions [0, end) on each rank."""
    config = CONFIGS["tiny"]
    model = _blocks(config)
    torch.manual_seed(3)
    streams = torch.randn(2, 192, config.hc_mult, config.hidden_size)
    ref = _run(model, streams, None)
    case = {"state": model.state_dict(), "streams": streams, "chunk": 40, "ref": ref}
    run_ranks(_cp_rank, 2, tmp_path, case, timeout=120)
