"""Pipeline parallelism as plan data: the pp role, stages, and pipeline schedules as op lists."""

import json

import pytest

import fsdpfn
from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn._plan.encode import FORMAT_PP
from fsdpfn._plan.stages import Stages, split_stages
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=4, heads=2)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]


@pytest.fixture(scope="module")
def model():
    return GPT(CFG)


# ---- the pp role ----------------------------------------------------------------------------------


def test_pp_role_is_not_data_parallel():
    axes = MeshAxes.from_shape({"pp": 2, "dp": 2, "tp": 2})
    assert axes.roles == (Role.PP, Role.SHARD, Role.TP)
    assert (axes.pp_size, axes.dp_size, axes.grad_ranks, axes.world_size) == (2, 2, 2, 8)
    assert not Role.PP.is_data_parallel


def test_one_dimensional_pp_mesh_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"mesh_dim_names=\('pp', 'dp'\)"):
        MeshAxes.from_shape({"pp": 4})


# ---- stages ---------------------------------------------------------------------------------------


def test_balanced_split_by_parameter_count(model):
    plan = fsdpfn.plan(model, {"pp": 2, "dp": 1}, units=UNITS)
    assert plan.stages.units == (("embed", "pos", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "norm", "head"))
    assert plan.stages.rank_of(1) == 1 and plan.pp_size == 2


def test_balanced_split_minimises_the_heaviest_stage():
    units = [(n, [n + ".w"]) for n in "abcde"]
    # the only split with no stage heavier than 4; cutting after the first unit that reaches
    # half the total (greedily) would give a | bcde, 5
    st = split_stages(units, 2, numels={"a": 3, "b": 1, "c": 1, "d": 1, "e": 2})
    assert st.units == (("a", "b"), ("c", "d", "e"))
    st = split_stages(units, 2, 4, numels={"a": 1, "b": 1, "c": 1, "d": 1, "e": 4})
    assert max(sum({"a": 1, "b": 1, "c": 1, "d": 1, "e": 4}[u] for u in s) for s in st.units) == 4
    assert st.units[-1] == ("e",) and st.virtual == 2 and st.stages_of(0) == (0, 2)


def test_balanced_split_by_profile_costs(model):
    costs = {u: 1.0 for u in UNITS} | {"head": 10.0}
    plan = fsdpfn.plan(model, {"pp": 2, "dp": 1}, units=UNITS, stage_costs=costs)
    assert plan.stages.units[1] == ("head",)


def test_split_by_module_names_and_virtual_stages(model):
    split = [["embed", "pos", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "norm", "head"]]
    plan = fsdpfn.plan(model, {"pp": 2, "dp": 1}, units=UNITS, stages=split)
    assert plan.stages.units[0] == ("embed", "pos", "blocks.0") and plan.stages.virtual == 2
    assert plan.stages.stage_of("head") == 3 and plan.stages.rank_of(3) == 1


def test_stages_round_trip_through_json_with_a_format_bump(model):
    plan = fsdpfn.plan(model, {"pp": 2, "dp": 2}, units=UNITS, stages=4)
    d = json.loads(plan.to_json())
    assert d["format"] == FORMAT_PP and d["stages"]["pp_size"] == 2
    back = fsdpfn.Plan.from_json(plan.to_json())
    assert back == plan and back.stages == plan.stages and back.fingerprint == plan.fingerprint
    assert "pipeline stages" in str(plan)


def test_old_plans_still_load_unchanged(model):
    plan = fsdpfn.plan(model, (2,))
    d = json.loads(plan.to_json())
    assert d["format"] == 1 and "stages" not in d
    assert fsdpfn.Plan.from_json(plan.to_json()).stages is None


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"root unit holds \['embed.weight'"),
    ({"units": UNITS, "stages": [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "norm", "head"]]},
     r"parameter 'pos.weight' \(unit 'pos'\) matches no stage"),
    ({"stages": [["embed", "pos", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "norm", "head"]]},
     r"unit '<root>' has parameters in 2 stages \('embed.weight' in stage 0, 'norm.weight' in stage 1\)"),
    ({"units": UNITS, "stages": [["embed", "pos", "blocks.0.norm1", "blocks.0.qkv", "blocks.0.proj"],
                                 ["blocks.0.norm2", "blocks.0.fc", "blocks.0.out", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]]},
     r"unit 'blocks.0' has parameters in 2 stages .*put all of 'blocks.0' in one stage"),
    ({"units": UNITS, "stages": [["embed", "pos", "blocks"], ["blocks.3", "norm", "head"]]},
     r"parameter 'blocks.3.norm1.weight' matches prefixes of stages \[0, 1\]"),
    ({"units": UNITS, "stages": [["blocks.2", "embed", "pos"], ["blocks.0", "blocks.1", "blocks.3", "norm", "head"]]},
     r"stage 0 holds unit 'blocks.2', which runs after stage 1's unit 'blocks.0'"),
    ({"units": UNITS, "stages": [["embed", "pos", "blocks", "nothing"], ["norm", "head"]]}, r"stage 0's prefix 'nothing' names no parameter"),
    ({"units": UNITS, "stages": 3}, r"positive multiple of the pp size 2"),
    ({"units": UNITS, "stages": [["embed", "pos", "blocks", "norm", "head"]]}, r"lists 1 stages for 2 pp ranks"),
    ({"units": UNITS, "stages": 12}, r"12 stages need at least 12 units"),
])
def test_bad_splits_name_the_module_or_stage(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsdpfn.plan(model, {"pp": 2, "dp": 1}, **kwargs)


def test_stages_without_a_pp_axis_are_refused(model):
    with pytest.raises(ValueError, match="has no 'pp' axis"):
        fsdpfn.plan(model, (2,), units=UNITS, stages=2)


def test_stages_value_checks_itself():
    with pytest.raises(ValueError, match="unit 'a' is in stage 0 and stage 1"):
        Stages((("a",), ("a",)), 2)
    with pytest.raises(ValueError, match="3 stages over 2 pp ranks"):
        Stages((("a",), ("b",), ("c",)), 2)
