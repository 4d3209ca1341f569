"""Communication per training step (``genolong.plan.comm``): the CP rows are the per-call formulas
summed over the layers, the FSDP units are the model's modules, the EP all-to-all bytes follow the
interface convention, and the 1m plan's rows are counted by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from genolong.config import load_recipe
from genolong.errors import InputError
from genolong.model import PRESETS, GenoLM
from genolong.plan import format_plan, plan
from tests.helpers import ROOT
from tests.plan_helpers import plan_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _cp_calls_by_hand(preset: str, t_local: int, cp: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """KDA payload and DSA received bytes of one step, layer by layer from the per-call formulas."""
    from genolong.kernels.kda.cp import conv_halo_comm_bytes, cp_kda_comm_bytes
    from genolong.parallel.cp_dsa import cp_dsa_comm_bytes

    cfg = PRESETS[preset]
    e = torch.empty((), dtype=dtype).element_size()
    out = {"kda_fwd": 0, "kda_bwd": 0, "dsa_fwd": 0, "dsa_bwd": 0}
    for layer_type, indexer in zip(cfg.layer_types, cfg.indexer_types):
        if layer_type == "linear_attention":
            state = cp_kda_comm_bytes(1, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim, cp)
            halo = conv_halo_comm_bytes(
                1, 3 * cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_conv_kernel_dim, cp, dtype
            )
            out["kda_fwd"] += state["forward"] + halo["forward"]
            out["kda_bwd"] += state["backward"] + halo["backward"]
        else:
            dsa = cp_dsa_comm_bytes(cfg, 1, t_local, cp, full_indexer=indexer == "full", dtype_bytes=e)
            out["dsa_fwd"] += dsa["forward"]
            out["dsa_bwd"] += dsa["backward"]
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_comm_cp_rows_are_the_per_call_formulas_summed_over_layers(cp: int) -> None:
    """The plan's KDA (payload) and DSA (received) totals equal the per-call formulas summed over
    tiny's layers (5 KDA, 2 full-indexer DSA, 1 shared-indexer DSA), at two lengths; KDA is constant
    in T, DSA linear; a shared-indexer layer moves less than a full one."""
    from genolong.plan import PAYLOAD, RECEIVED, comm_estimate

    totals = {}
    for T in (1024, 2048):
        est = comm_estimate(PRESETS["tiny"], T // cp, cp)
        hand = _cp_calls_by_hand("tiny", T // cp, cp)
        assert est.part_total("kda") == hand["kda_fwd"] + hand["kda_bwd"] > 0
        assert est.part_total("dsa") == hand["dsa_fwd"] + hand["dsa_bwd"] > 0
        assert {r.convention for r in est.rows if r.part == "kda"} == {PAYLOAD}
        assert {r.convention for r in est.rows if r.part == "dsa"} == {RECEIVED}
        assert est.part_total("fsdp") == 0  # no shard group given
        full, shared = [r for r in est.rows if r.part == "dsa"]
        assert (full.layers, shared.layers) == (2, 1) and 0 < shared.forward < full.forward / 2
        totals[T] = est
    assert totals[2048].part_total("kda") == totals[1024].part_total("kda")
    assert totals[2048].part_total("dsa") == 2 * totals[1024].part_total("dsa")
    # ring wire bytes: an all-gather sends W - 1 times the piece, an all-reduce 2 (W - 1) / W the buffer
    state = next(r for r in totals[1024].rows if r.name.startswith("KDA state"))
    assert state.wire == (cp - 1) * state.forward + 2 * (cp - 1) * state.backward // cp


def test_comm_is_zero_without_cp_and_doubles_forward_under_recompute() -> None:
    from genolong.plan import comm_estimate

    single = comm_estimate(PRESETS["tiny"], 2048, 1)
    assert all(r.total == 0 and r.wire == 0 for r in single.rows)
    hand = _cp_calls_by_hand("tiny", 512, 4)
    full = comm_estimate(PRESETS["tiny"], 512, 4, recompute="full")
    assert full.part_total("kda") == 2 * hand["kda_fwd"] + hand["kda_bwd"]
    assert full.part_total("dsa") == 2 * hand["dsa_fwd"] + hand["dsa_bwd"]
    dsa_only = comm_estimate(PRESETS["tiny"], 512, 4, recompute="selective", recompute_modules=("dsa",))
    assert dsa_only.part_total("kda") == hand["kda_fwd"] + hand["kda_bwd"]
    assert dsa_only.part_total("dsa") == 2 * hand["dsa_fwd"] + hand["dsa_bwd"]
    # bf16 compute: the halo rows and the DSA latent halve, the fp32 KDA states do not
    bf16 = comm_estimate(PRESETS["tiny"], 512, 4, dtype_bytes=2)
    hand16 = _cp_calls_by_hand("tiny", 512, 4, torch.bfloat16)
    assert bf16.part_total("kda") == hand16["kda_fwd"] + hand16["kda_bwd"]
    assert bf16.part_total("dsa") == (hand["dsa_fwd"] + hand["dsa_bwd"]) // 2
    with pytest.raises(InputError, match="tokens"):
        comm_estimate(PRESETS["tiny"], 0, 2)
    with pytest.raises(InputError, match="cp"):
        comm_estimate(PRESETS["tiny"], 512, 0)


def test_comm_fsdp_rows_against_the_model_modules(tmp_path: Path) -> None:
    """FSDP2 units are the real model's embedding, blocks and root (final norm + LM head); per
    unit of n parameters over S ranks each rank receives (S - 1) ceil(n / S) elements per
    all-gather / reduce-scatter."""
    from genolong.plan import fsdp_unit_groups, fsdp_units

    model = GenoLM(PRESETS["tiny"])
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    embedding = model.embed_tokens.weight.numel()
    root = sum(p.numel() for p in model.parameters()) - sum(blocks) - embedding
    assert fsdp_units(PRESETS["tiny"]) == blocks + [root + embedding]
    assert [u.params for u in fsdp_unit_groups(PRESETS["tiny"], 6)] == [embedding, *blocks, root]
    # bf16-mixed on cp 2 x dp_shard 3: S = 6, bf16 all-gathers, fp32 reduce-scatter
    p = plan(plan_recipe(tmp_path, parallel={"cp": 2, "devices": 6}, train={"precision": "bf16-mixed"}))
    S = 6
    rows = {r.name: r for r in p.comm.rows if r.part == "fsdp"}
    shard = [math.ceil(n / S) for n in [embedding, *blocks, root]]
    assert rows["FSDP parameter all-gather fwd (bf16)"].forward == sum((S - 1) * s * 2 for s in shard)
    # backward re-gathers the embedding and every block but the last (reshard_after_forward; the
    # root is not resharded)
    assert rows["FSDP parameter all-gather bwd, resharded units (bf16)"].backward == sum(
        (S - 1) * s * 2 for s in shard[:-2]
    )
    assert rows["FSDP gradient reduce-scatter (fp32)"].backward == sum((S - 1) * s * 4 for s in shard)
    assert p.comm.part_total("fsdp") == sum(r.total for r in rows.values())
    hand = _cp_calls_by_hand("tiny", 512, 2, torch.bfloat16)
    assert p.comm.part_total("kda") == hand["kda_fwd"] + hand["kda_bwd"]
    assert p.comm.part_total("dsa") == hand["dsa_fwd"] + hand["dsa_bwd"]
    # HSDP: 2 replicas of a 3-rank shard group add a ring all-reduce of the fp32 shards
    hsdp = plan(plan_recipe(tmp_path, parallel={"cp": 1, "devices": 6, "dp_replicate": 2}))
    shard3 = [math.ceil(n / 3) for n in [embedding, *blocks, root]]
    replica = next(r for r in hsdp.comm.rows if r.name.startswith("HSDP"))
    assert replica.backward == sum(2 * s * 4 // 2 for s in shard3)
    assert hsdp.comm.part_total("kda") == hsdp.comm.part_total("dsa") == 0
    # one GPU: nothing travels
    assert plan(plan_recipe(tmp_path)).comm.part_total("fsdp") == 0


def test_comm_in_the_1m_plan() -> None:
    """recipes/1m.yaml on 64 GPUs: bf16, chunked recompute, cp 8, T_local = 131,072, FSDP over 64,
    ep 8 (the experts units over 8 ranks), MoE chunks of 4,096 tokens."""
    from genolong.plan import fsdp_units, routed_expert_parameters

    recipe = load_recipe(ROOT / "recipes" / "1m.yaml")
    assert (recipe.parallel.ep, recipe.memory.moe_chunk_tokens, recipe.memory.recompute) == (8, 4096, "chunked")
    p = plan(recipe, gpus=64, gpu_mem_gib=180)
    state = 64 * 128 * (128 + 128) * 4  # B H K (K + V) fp32 = 8 MiB per KDA layer
    halo = 3 * 3 * 64 * 128 * 2  # kernel - 1 rows of q|k|v in bf16
    kda = 34 * (2 * state + 8 * state) + 34 * (2 * (8 + halo) + 8 * halo)  # forward twice (recompute)
    dsa = 11 * 3 * 7 * 131072 * (512 + 128 // 16) * 2  # all-gather fwd, again in recompute, reduce-scatter
    assert p.comm.part_total("kda") == kda and p.comm.part_total("dsa") == dsa
    # EP: 42 MoE layers x 32 chunks; per chunk dispatch + combine 7/8 x 4096 x 8 x 4096 x bf16 each
    # and the row counts forward, the data pair again in backward and in recompute
    pair = 2 * 7 * 4096 * 8 * 4096 * 2 // 8
    ep_fwd = 42 * 32 * (pair + 7 * 36 * 8)  # counts: 288/8 int64 rows per expert to each of the 7 other ranks
    assert p.comm.part_total("ep") == 2 * ep_fwd + 42 * 32 * pair
    # FSDP: the experts of each MoE layer (36 of 288 per rank) over 8 ranks, the rest over 64
    units = fsdp_units(p_cfg := _preset_cfg("glm-5.3-flash"))
    experts = routed_expert_parameters(p_cfg)
    moe = [t == "sparse" for t in p_cfg.mlp_layer_types]
    embedding = p_cfg.vocab_size * p_cfg.hidden_size  # its own unit, first; the root keeps the head and norm
    dense = [embedding] + [n - experts * s for n, s in zip(units[:-1], moe)] + [units[-1] - embedding]

    def recv(n: int, S: int, b: int) -> int:
        return (S - 1) * math.ceil(n / S) * b

    gather = sum(recv(n, 64, 2) for n in dense) + 42 * recv(experts // 8, 8, 2)
    gather_bwd = sum(recv(n, 64, 2) for n in dense[:-2]) + 41 * recv(experts // 8, 8, 2)
    reduce = sum(recv(n, 64, 4) for n in dense) + 42 * recv(experts // 8, 8, 4)
    fsdp = p.comm.part_total("fsdp")
    assert fsdp == gather + gather_bwd + reduce
    text = format_plan(p)
    assert "communication per rank per step" in text and "**KDA (CP) total**" in text and "**FSDP total**" in text
    assert "**EP all-to-all total**" in text and "ep 8 (36 experts per rank, experts sharded over 8)" in text
    as_json = json.loads(json.dumps(p.to_dict()))
    assert as_json["comm"]["totals"] == {"kda": kda, "dsa": dsa, "ep": p.comm.part_total("ep"), "fsdp": fsdp}
    assert as_json["comm"]["conventions"] == {"kda": "payload", "dsa": "received", "ep": "sent", "fsdp": "received"}


def _preset_cfg(name: str):  # type: ignore[no-untyped-def]
    from genolong.model import ModelConfig

    return ModelConfig.from_preset(name)


def test_ep_comm_bytes_is_the_interface_convention() -> None:
    """Per MoE layer per chunk of c tokens: dispatch and combine (ep - 1) c k H a / ep each
    forward, the data pair again backward, and E/ep int64 row counts to each other rank per
    dispatch; nothing without EP."""
    from genolong.plan import ep_comm_bytes

    cfg = PRESETS["tiny"]
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    k, H = cfg.num_experts_per_tok, cfg.hidden_size
    assert n_moe > 0
    for ep, tokens, chunk, a in ((2, 1024, None, 4), (4, 1000, 256, 2), (4, 1024, 256, 4)):
        sizes = [min(chunk or tokens, tokens - s) for s in range(0, tokens, chunk or tokens)]
        data = sum((ep - 1) * c * k * H * a // ep for c in sizes)
        got = ep_comm_bytes(cfg, tokens, ep, chunk, a)
        splits = len(sizes) * (ep - 1) * (cfg.n_routed_experts // ep) * 8
        assert got == {
            "forward": n_moe * 2 * data,
            "backward": n_moe * 2 * data,
            "splits": n_moe * splits,
        }  # exact: byte counts
    assert ep_comm_bytes(cfg, 1024, 1, None, 4) == {"forward": 0, "backward": 0, "splits": 0}  # exact: byte counts
    with pytest.raises(InputError, match="ep"):
        ep_comm_bytes(cfg, 1024, 0, None, 4)


def test_fsdp_units_under_ep_against_the_model() -> None:
    """Each MoE block's routed experts are their own FSDP unit: E / ep experts over S / ep ranks;
    the rest of the block over S; the parameters per rank are those without EP."""
    from genolong.plan import fsdp_unit_groups

    cfg = PRESETS["tiny"]
    model = GenoLM(cfg)
    units = fsdp_unit_groups(cfg, 8, 2)
    for i, layer in enumerate(model.layers):
        block = [u for u in units if u.layer == i]
        if cfg.mlp_layer_types[i] == "sparse":
            experts = sum(p.numel() for p in layer.mlp.experts.parameters())
            assert [(u.kind, u.params, u.group) for u in block] == [
                ("block", sum(p.numel() for p in layer.parameters()) - experts, 8),
                ("experts", experts // 2, 4),
            ]
        else:
            assert [(u.kind, u.group) for u in block] == [("block", 8)]
    assert units[-1].kind == "root"
    # every rank holds 1/S of each unit's parameters: E/ep experts over S/ep ranks is E/S of them
    total = sum(p.numel() for p in model.parameters())
    assert abs(sum(u.params / u.group for u in units) - total / 8) < len(units)
