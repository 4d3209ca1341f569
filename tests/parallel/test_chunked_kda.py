"""The KDA attention half in token segments with carried state (genolong.parallel.chunked_kda).

Against the plain attention half (``attn_hc -> input_layernorm -> self_attn -> merge_streams`` on the
whole sequence in one piece):

- one process: outputs and loss bit for bit (segments start on KDA chunk boundaries: every op
  computes each row alike, the chunk recurrence walks the same chunks from the same state); every
  gradient (parameters and streams) to RMS(ref - x) / RMS(ref) < 2e-6, float32 rounding of the same
  sums in another grouping (a parameter gradient is a sum of per-segment sums; the carried state's
  and halo's gradients meet the in-segment ones in another order). The unsegmented half with KDA
  chunks of 32 instead of 64, an equally valid summation order, is up to 1.6e-6 from the reference;
  with one segment every gradient is bitwise equal;
- context parallelism (2 gloo ranks): the segmented half of each rank's slice against the
  one-process plain half, to 1e-5 (tests/parallel/test_cp_model.py's bound: the fold reaches a token's state
  by another product order);
- the activation meter: autograd keeps the streams (the segments' input views) plus one halo and one
  state per segment boundary, to the byte; the tensors rebuilt in backward peak at one segment's
  worth, the same at T = 256 and T = 512.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from genolong.errors import InputError
from genolong.kernels.backends import get_backend
from genolong.kernels.kda.fla_backend import make_fla_chunk_kda, make_fla_chunk_kda_gated
from genolong.kernels.testing import rms_ratio
from genolong.memory import ActivationMeter
from genolong.model import PRESETS, ModelConfig
from genolong.model.config import INDEXED_ATTENTION
from genolong.model.lm import Block
from genolong.model.mhc import merge_streams
from genolong.parallel.chunked_kda import kda_attention_half, segment_bounds
from tests.helpers import assert_bitwise_equal, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

_GRAD_TOL = 2e-6  # float32 rounding of the same sums in another grouping (see the module docstring)
_CP_TOL = 1e-5  # the context-parallel fold's other product order (tests/parallel/test_cp_model.py)
TINY = PRESETS["tiny"]


def _block(config: ModelConfig = TINY, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    layer = next(i for i, kind in enumerate(config.layer_types or ()) if kind != INDEXED_ATTENTION)
    return Block(config, layer)


def plain_half(block: Block, streams: torch.Tensor) -> torch.Tensor:
    """The unsegmented attention half, as ``Block.forward`` runs it."""
    post, comb, x = block.attn_hc(streams)
    x = block.input_layernorm(x)
    return merge_streams(post, comb, block.self_attn(x), streams)


def _inputs(config: ModelConfig, B: int, T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(B, T, config.hc_mult, config.hidden_size, generator=gen)
    probe = torch.randn(B, T, config.hc_mult, config.hidden_size, generator=gen)
    return streams, probe


def _step(block: Block, fn: Any, streams: torch.Tensor, probe: torch.Tensor) -> dict[str, Any]:
    """Forward, a loss ``sum(out * probe)``, backward: output, loss and every gradient (streams too)."""
    block.zero_grad(set_to_none=True)
    leaf = streams.clone().requires_grad_(True)
    out = fn(block, leaf)
    loss = (out * probe).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    grads["streams"] = leaf.grad
    return {"out": out.detach(), "loss": loss.detach(), "grads": grads}


def _segmented(chunk_tokens: int) -> Any:
    return lambda block, streams: kda_attention_half(block, streams, chunk_tokens)


@pytest.mark.parametrize(
    "preset,B,T,chunk",
    [
        ("tiny", 1, 320, 64),  # one KDA chunk per segment
        ("tiny", 2, 320, 128),  # a few chunks; 320 = 2 x 128 + 64 (T not a multiple)
        ("tiny", 1, 320, 192),  # 192 + 128
        ("tiny", 2, 320, 1024),  # larger than T: one segment
        ("small", 1, 256, 128),
        ("tiny-softplus", 1, 320, 128),  # the gate without a lower bound
    ],
)
def test_segmented_half_equals_the_plain_half(preset: str, B: int, T: int, chunk: int) -> None:
    config = TINY.replace(linear_lower_bound=None) if preset == "tiny-softplus" else PRESETS[preset]
    block = _block(config)
    streams, probe = _inputs(config, B, T)
    ref = _step(block, lambda b, s: plain_half(b, s), streams, probe)
    got = _step(block, _segmented(chunk), streams, probe)
    assert_bitwise_equal(got["out"], ref["out"], f"the segmented half's output (chunk {chunk})")
    assert_bitwise_equal(got["loss"], ref["loss"], f"the segmented half's loss (chunk {chunk})")
    assert got["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) == 18
    if chunk >= T:  # one segment: the same operations throughout
        assert_bitwise_equal(got["grads"], ref["grads"], "the gradients with one segment")
        return
    errors = {n: rms_ratio(g, got["grads"][n]) for n, g in ref["grads"].items()}
    over = {n: e for n, e in errors.items() if not e < _GRAD_TOL}
    assert not over, over


def test_segmented_half_without_grad_and_its_bounds() -> None:
    block = _block()
    streams, _ = _inputs(TINY, 1, 192)
    with torch.no_grad():
        ref = plain_half(block, streams)
        got = kda_attention_half(block, streams, 64)
    assert_bitwise_equal(got, ref, "the segmented half under no_grad")
    assert segment_bounds(320, 128) == [(0, 128), (128, 256), (256, 320)]
    assert segment_bounds(0, 64) == []


def test_bad_inputs_are_one_line_errors() -> None:
    block = _block()
    streams, _ = _inputs(TINY, 1, 64)
    with pytest.raises(InputError, match="recompute_chunk_tokens must be a positive integer"):
        kda_attention_half(block, streams, 0)
    with pytest.raises(InputError, match=r"streams \[B, T, m, H\]"):
        kda_attention_half(block, streams[0], 64)
    torch.manual_seed(0)
    dsa = Block(TINY, TINY.layer_types.index(INDEXED_ATTENTION))  # type: ignore[union-attr]
    with pytest.raises(InputError, match="self_attn is a KDAMixer"):
        kda_attention_half(dsa, streams, 64)


def _naive_fla_kernel(**kw: Any) -> Any:
    """fla's chunk_kda keywords onto fla's pure-torch naive recurrent op (CPU), gate and beta as fla
    applies them in the kernel (its own torch references)."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    kw.pop("chunk_size")
    if kw.pop("use_gate_in_kernel", False):
        A_log, dt_bias, lower_bound = kw.pop("A_log"), kw.pop("dt_bias"), kw.pop("lower_bound")
        kw.pop("safe_gate")
        kw["g"] = (
            naive_kda_gate(kw["g"], A_log, dt_bias)
            if lower_bound is None
            else naive_kda_lowerbound_gate(kw["g"], A_log, dt_bias, lower_bound)
        )
    if kw.pop("use_beta_sigmoid_in_kernel", False):
        kw["beta"] = torch.sigmoid(kw["beta"])
    return naive_recurrent_kda(**kw)


def test_segmented_half_through_the_fla_backend_interface() -> None:
    """The fla adapter (bound to fla's naive op on CPU) carries ``initial_state`` / the final state
    across segments: the segmented half equals the plain half through the same adapter to float32
    rounding (the naive op's own per-token order, 1e-6; 3e-7 for this adapter in test_backends)."""
    import dataclasses

    block = _block()
    torch_backend = get_backend("torch")
    block.self_attn.kernels = dataclasses.replace(
        torch_backend,
        name="fla-naive",
        chunk_kda=make_fla_chunk_kda(kernel=_naive_fla_kernel),
        chunk_kda_gated=make_fla_chunk_kda_gated(kernel=_naive_fla_kernel),
    )
    streams, probe = _inputs(TINY, 1, 192)
    ref = _step(block, lambda b, s: plain_half(b, s), streams, probe)
    got = _step(block, _segmented(64), streams, probe)
    assert rms_ratio(ref["out"], got["out"]) < 1e-6
    errors = {n: rms_ratio(g, got["grads"][n]) for n, g in ref["grads"].items()}
    assert all(e < 1e-5 for e in errors.values()), errors
    # and with the torch reference to the fla op's own distance from it (test_backends: 1e-5)
    block.self_attn.kernels = torch_backend
    torch_ref = _step(block, lambda b, s: plain_half(b, s), streams, probe)
    assert rms_ratio(torch_ref["out"], got["out"]) < 1e-5


# -- what autograd keeps, and what backward rebuilds -------------------------------------------------


class _RebuiltBytes:
    """Live bytes of the tensors a checkpoint's recomputation saves (per storage), and their peak.

    Test instrumentation: torch.utils.checkpoint's recomputation packs every tensor it rebuilds through
    its ``_recomputation_hook``; a subclass installed with monkeypatch counts them on the way (storages
    in ``exclude``, the streams the segments are views of and the parameters, are not new memory).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live: dict[int, list[int]] = {}  # storage -> [bytes]
        self.bytes = self.peak = 0
        self.exclude: set[int] = set()
        tracker, original = self, torch_checkpoint._recomputation_hook

        class Counting(original):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                inner = self.pack_hook

                def pack(x: torch.Tensor) -> Any:
                    tracker.add(x)
                    return inner(x)

                self.pack_hook = pack

        monkeypatch.setattr(torch_checkpoint, "_recomputation_hook", Counting)

    def add(self, x: torch.Tensor) -> None:
        storage = x.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or key in self.live or isinstance(x, torch.nn.Parameter):
            return
        # the storage, not the tensor: the recomputation keeps a detached alias of what was packed
        self.live[key] = [storage.nbytes()]
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.bytes -= self.live.pop(key)[0]


def _metered(block: Block, fn: Any, T: int | torch.Tensor, rebuilt: _RebuiltBytes) -> tuple[int, int]:
    """(bytes autograd keeps after forward, peak rebuilt bytes in backward) of one step on ``T``
    random tokens (one sequence) or on the given streams."""
    streams = _inputs(TINY, 1, T)[0] if isinstance(T, int) else T.clone()
    streams.requires_grad_(True)
    rebuilt.exclude = {t.untyped_storage().data_ptr() for t in (streams, *block.parameters())}
    rebuilt.peak = 0
    with ActivationMeter(block) as meter:
        out = fn(block, streams)
        kept = meter.resident_bytes
        out.sum().backward()
    assert meter.resident_bytes == 0
    return kept, rebuilt.peak


def _plain_saved_bytes(block: Block, streams: torch.Tensor, final_state: bool = False) -> int:
    """What the plain (unsegmented, not recomputed) half saves for backward beyond its input; with
    ``final_state`` the KDA mixer also returns its state after the last token and the graph uses
    it, as a segment's state feeds the next segment (without it a one-chunk half computes no
    state transition)."""
    leaf = streams.clone().requires_grad_(True)
    with ActivationMeter(block) as meter:
        if final_state:
            post, comb, x = block.attn_hc(leaf)
            o, state = block.self_attn(block.input_layernorm(x), output_final_state=True)
            out = merge_streams(post, comb, o, leaf).sum() + state.sum()
        else:
            out = plain_half(block, leaf)  # kept alive: the graph holds what the meter counts
        saved = meter.resident_bytes - leaf.numel() * leaf.element_size()
        out.sum().backward()
    return saved


def test_meter_keeps_segment_inputs_and_rebuilds_one_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _block()
    rebuilt = _RebuiltBytes(monkeypatch)
    mixer = block.self_attn
    qkv = mixer.num_heads * mixer.head_dim
    halo = (mixer.conv1d.weight.shape[-1] - 1) * 3 * qkv * 4  # [1, 3, 192] fp32
    state = mixer.num_heads * mixer.head_dim * mixer.head_dim * 4  # [1, 4, 16, 16] fp32
    per_token = TINY.hc_mult * TINY.hidden_size * 4  # the streams
    peaks = {}
    for T in (256, 512):
        kept, peaks[T] = _metered(block, _segmented(64), T, rebuilt)
        assert kept == T * per_token + (T // 64 - 1) * (halo + state)
    # backward rebuilds one 64-token segment at a time: the same peak at either length, about what
    # the plain half saves for 64 tokens with the state transition to the next segment (a few
    # tensors go before the last come)
    assert peaks[256] == peaks[512]
    plain64 = _plain_saved_bytes(block, _inputs(TINY, 1, 64)[0], final_state=True)
    assert 0.95 * plain64 < peaks[512] < 1.05 * plain64, (peaks[512], plain64)
    kept, peak128 = _metered(block, _segmented(128), 512, rebuilt)
    assert kept == 512 * per_token + 3 * (halo + state) and peak128 > peaks[512]
    # the whole half under one checkpoint keeps the streams only, but rebuilds all of it at once
    whole = {
        T: _metered(block, lambda b, s: torch_checkpoint.checkpoint(plain_half, b, s, use_reentrant=False), T, rebuilt)
        for T in (256, 512)
    }
    assert whole[256][0] == 256 * per_token and whole[512][1] > 1.9 * whole[256][1] > 3 * peaks[256]


# -- context parallelism -----------------------------------------------------------------------------

_CP_T, _CP_CHUNK = 384, 128  # 192 tokens per rank on 2 ranks: segments of 128 and 64


def _cp_worker(rank: int, world: int, folder: str) -> None:
    case = torch.load(Path(folder) / "case.pt", weights_only=True)
    block = _block()
    block.load_state_dict(case["state"])
    block.self_attn.cp_group = dist.group.WORLD
    t = _CP_T // world
    rows = slice(rank * t, (rank + 1) * t)
    result = _step(block, _segmented(_CP_CHUNK), case["streams"][:, rows], case["probe"][:, rows])
    for name, g in result["grads"].items():
        if name != "streams":
            dist.all_reduce(g)  # this rank's share -> the total
    # what autograd keeps, and the peak of what backward rebuilds (a second step, metered)
    patch = pytest.MonkeyPatch()
    rebuilt = _RebuiltBytes(patch)
    result["kept"], result["rebuilt"] = _metered(block, _segmented(_CP_CHUNK), case["streams"][:, rows], rebuilt)
    patch.undo()
    torch.save(result, Path(folder) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_segmented_half_under_context_parallelism_equals_one_process(tmp_path: Path) -> None:
    block = _block()
    streams, probe = _inputs(TINY, 2, _CP_T)
    torch.save({"state": block.state_dict(), "streams": streams, "probe": probe}, tmp_path / "case.pt")
    ref = _step(block, lambda b, s: plain_half(b, s), streams, probe)
    # what the first rank leaves (state, halo) matters on the second, far beyond the tolerance: its
    # slice alone (zero state, zero halo) is off by more than 10x the bound
    alone = _step(block, lambda b, s: plain_half(b, s), streams[:, _CP_T // 2 :], probe[:, _CP_T // 2 :])
    assert rms_ratio(ref["out"][:, _CP_T // 2 :], alone["out"]) > 10 * _CP_TOL
    run_ranks(_cp_worker, 2, tmp_path, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert rms_ratio(ref["out"], torch.cat([r["out"] for r in ranks], dim=1)) < _CP_TOL
    d_streams = torch.cat([r["grads"].pop("streams") for r in ranks], dim=1)
    assert rms_ratio(ref["grads"].pop("streams"), d_streams) < _CP_TOL
    for r in ranks:
        errors = {n: rms_ratio(g, r["grads"][n]) for n, g in ref["grads"].items()}
        over = {n: e for n, e in errors.items() if not e < _CP_TOL}
        assert not over, over

    # kept per rank: the streams; per segment its halo and the state pass 2 starts it from; per
    # segment but the first the pass-1 map it starts from; the fold's gathered maps (one per rank)
    mixer, B, t, segments = block.self_attn, 2, _CP_T // 2, 2
    h = mixer.conv1d.weight.shape[-1] - 1
    halo = B * h * 3 * mixer.num_heads * mixer.head_dim * 4
    state = B * mixer.num_heads * mixer.head_dim * mixer.head_dim * 4
    affine_map = 2 * state  # [B, heads, dk, dv + dk]
    streams_bytes = B * t * TINY.hc_mult * TINY.hidden_size * 4
    expected = streams_bytes + segments * (halo + state) + (segments - 1) * affine_map + 2 * affine_map
    assert [r["kept"] for r in ranks] == [expected, expected]
    # rebuilt: one segment of 128 tokens at a time, what the plain half saves for 128 of the tokens,
    # plus a copy of the segment's streams (with B > 1 a segment is not contiguous, and the
    # merge's matmul saves a contiguous copy of it; the plain half's streams are the input itself)
    plain = _plain_saved_bytes(block, streams[:, :_CP_CHUNK]) + B * _CP_CHUNK * TINY.hc_mult * TINY.hidden_size * 4
    assert all(0.95 * plain < r["rebuilt"] < 1.05 * plain for r in ranks), ([r["rebuilt"] for r in ranks], plain)
