"""The plan: unit selection, layout, validation, serialisation and cost (one process)."""

import json

import pytest
import torch
from torch import nn

import fsdpfn
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=3, heads=2)


def test_default_units_are_modulelist_children_plus_root():
    plan = fsdpfn.plan(GPT(CFG), (2,))
    assert [u.name for u in plan.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert {p.name for p in plan.unit("").params} == {
        "embed.weight",
        "pos.weight",
        "norm.weight",
        "norm.bias",
        "head.weight",
    }
    assert plan.unit_of("blocks.1.fc.weight").name == "blocks.1"
    assert sorted(plan.param_names) == sorted(n for n, _ in GPT(CFG).named_parameters())


def test_explicit_and_callable_units_deepest_unit_owns():
    model = GPT(CFG)
    plan = fsdpfn.plan(model, (2,), units=["blocks", "blocks.1.fc"])
    assert plan.unit_of("blocks.1.fc.weight").name == "blocks.1.fc"
    assert plan.unit_of("blocks.1.out.weight").name == "blocks"
    assert plan.unit_of("head.weight").name == ""
    by_type = fsdpfn.plan(model, (2,), units=lambda name, mod: isinstance(mod, nn.LayerNorm))
    assert by_type.unit_of("blocks.0.norm1.weight").name == "blocks.0.norm1"
    assert by_type.unit_of("blocks.0.fc.weight").name == ""


def test_layout_follows_torch_chunk_with_padding_and_empty_shards():
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(5, 3))
    model.s = nn.Parameter(torch.zeros(()))
    plan = fsdpfn.plan(model, (4,))
    (unit,) = plan.units
    rows = [unit.local_rows("w", r) for r in range(4)]
    assert rows == [(0, 2), (2, 4), (4, 5), (5, 5)]  # 2, 2, 1, 0 like torch.chunk
    assert [c.shape[0] for c in torch.zeros(5, 3).chunk(4)] == [2, 2, 1]
    slot_w, slot_s = unit.slots["w"], unit.slots["s"]
    assert slot_w.sharded and slot_w.size == 6 and slot_w.offset == 0
    assert not slot_s.sharded and slot_s.offset == 6  # the 0-d parameter rides only in the reduce tail
    assert unit.shard_numel == 6 and unit.reduce_numel == 7
    assert [unit.padding(r) for r in range(4)] == [0, 0, 3, 6]


def test_json_round_trip_and_fingerprint():
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = fsdpfn.plan(GPT(CFG), (2, 3), strategy={"*": "zero3", "<root>": "zero2"}, mp=mp)
    again = fsdpfn.Plan.from_json(plan.to_json())
    assert again == plan and again.fingerprint == plan.fingerprint
    assert json.loads(plan.to_json())["mesh"]["dim_names"] == ["replicate", "shard"]
    other = fsdpfn.plan(GPT(CFG), (2, 3), strategy="zero3", mp=mp)
    assert other != plan and other.fingerprint != plan.fingerprint
    assert plan.unit("").strategy == "zero2" and plan.unit("blocks.0").strategy == "zero3"


def test_str_is_a_table_with_every_unit():
    plan = fsdpfn.plan(GPT(CFG), (4,))
    text = str(plan)
    assert "unit" in text and "padding/rank" in text and plan.fingerprint in text
    for name in ("<root>", "blocks.0", "blocks.2", "total"):
        assert name in text


@pytest.mark.parametrize("w", [2, 4, 8])
def test_cost_matches_theory(w):
    # width 32 and vocab 64: every dim-0 divisible by w, so there is no padding and the
    # bytes are exactly the textbook 3 Psi (W-1)/W for zero3, 2 Psi (W-1)/W otherwise.
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, width=32, depth=2, heads=2))
    psi = sum(p.numel() * 4 for p in model.parameters())
    zero3 = fsdpfn.plan(model, (w,), strategy="zero3").cost(reshard_after_forward=True)
    assert zero3.wire_bytes == pytest.approx(3 * psi * (w - 1) / w)
    assert zero3.collectives["all_gather"].calls == 2 * 3 and zero3.collectives["reduce_scatter"].calls == 3
    runtime_default = fsdpfn.plan(model, (w,), strategy="zero3").cost()  # the root is gathered once
    root_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert runtime_default.collectives["all_gather"].calls == 2 * 2 + 1
    assert runtime_default.wire_bytes == pytest.approx((3 * psi - root_bytes) * (w - 1) / w)
    pure = fsdpfn.plan(model, (w,), strategy="zero3").cost(reshard_after_forward=False)
    assert pure.wire_bytes == pytest.approx(2 * psi * (w - 1) / w)
    for s in ("zero1", "zero2", "replicate"):
        assert fsdpfn.plan(model, (w,), strategy=s).cost().wire_bytes == pytest.approx(2 * psi * (w - 1) / w)
    mem = zero3.memory
    assert mem["params"] == psi // w and mem["grads"] == psi // w
    assert fsdpfn.plan(model, (w,), strategy="zero1").cost().memory["grads"] == psi


def test_cost_bf16_params_halve_gather_bytes():
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, width=32, depth=2, heads=2))
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = fsdpfn.plan(model, (2,)).cost()
    bf16 = fsdpfn.plan(model, (2,), mp=mp).cost()
    assert bf16.collectives["all_gather"].wire_bytes == fp32.collectives["all_gather"].wire_bytes / 2
    assert bf16.collectives["reduce_scatter"].wire_bytes == fp32.collectives["reduce_scatter"].wire_bytes


# ---- bad input: ValueError naming what is wrong and how to fix it ---------------------------


def test_unit_naming_no_module():
    with pytest.raises(ValueError, match=r"unit 'blocks\.7' names no module.*did you mean"):
        fsdpfn.plan(GPT(CFG), (2,), units=["blocks.7"])


def test_parameter_claimed_by_two_units():
    model = GPT(GPTConfig(vocab_size=37, seq_len=8, width=20, depth=1, heads=2, tie_embeddings=True))
    with pytest.raises(ValueError, match=r"'head.weight' is the same tensor as 'embed.weight'.*claimed by two units"):
        fsdpfn.plan(model, (2,), units=["head"])
    # Tied weights in one unit are fine: the tensor is sharded once, under its first name.
    plan = fsdpfn.plan(model, (2,))
    assert "embed.weight" in plan.param_names and "head.weight" not in plan.param_names


def test_unknown_strategy():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero4'.*replicate, zero1, zero2, zero3"):
        fsdpfn.plan(GPT(CFG), (2,), strategy="zero4")
    with pytest.raises(ValueError, match=r"unknown strategy 'fsdp' for unit 'blocks.0'"):
        fsdpfn.plan(GPT(CFG), (2,), strategy={"blocks.0": "fsdp"})
    with pytest.raises(ValueError, match=r"strategy names unit 'blocks.9'"):
        fsdpfn.plan(GPT(CFG), (2,), strategy={"blocks.9": "zero2"})


def test_units_given_twice_or_as_string():
    with pytest.raises(ValueError, match="more than once"):
        fsdpfn.plan(GPT(CFG), (2,), units=["blocks.0", "blocks.0"])
    with pytest.raises(ValueError, match=r"use \['blocks'\]"):
        fsdpfn.plan(GPT(CFG), (2,), units="blocks")


def test_mixed_dtypes_in_one_unit_need_param_dtype():
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(4))
    model.b = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"mixes parameter dtypes \(a: float32, b: bfloat16\)"):
        fsdpfn.plan(model, (2,))
    assert fsdpfn.plan(model, (2,), mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16)).units


def test_bad_meshes():
    with pytest.raises(ValueError, match="3-D mesh needs dim names"):
        fsdpfn.plan(GPT(CFG), (2, 2, 2))
    with pytest.raises(ValueError, match="mesh axis 'model' has no role.*axes="):
        fsdpfn.plan(GPT(CFG), {"dp": 2, "model": 2})
    with pytest.raises(ValueError, match="has an expert-parallel axis, but GPT has no expert weights"):
        fsdpfn.plan(GPT(CFG), {"dp": 2, "ep": 2})
    with pytest.raises(ValueError, match="tuple of positive ints"):
        fsdpfn.plan(GPT(CFG), (0,))


def test_unbound_plan_cannot_execute():
    plan = fsdpfn.plan(GPT(CFG), (1,))
    with pytest.raises(ValueError, match=r"no mesh.*plan.bind\(mesh\)"):
        fsdpfn.shard(GPT(CFG), plan)
