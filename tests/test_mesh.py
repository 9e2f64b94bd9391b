"""Named mesh axes and their roles: parsing, what is derived from them, the plan's JSON across
formats, and bad tensor-parallel input refused by name on every rank before any collective."""

from __future__ import annotations

import json
import re
import os

import pytest
import torch

import fsdpfn
from fsdpfn import MeshAxes, Role, testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from _refusals import refusals

CFG = GPTConfig(vocab_size=64, width=32, depth=2, heads=4)
DATA = os.path.join(os.path.dirname(__file__), "data", "plans_format1_2.json")


# ---- MeshAxes ------------------------------------------------------------------------------


def test_roles_from_conventional_names_and_sizes_derived():
    axes = MeshAxes.from_shape({"replicate": 2, "shard": 3, "tp": 4})
    assert axes.roles == (Role.REPLICATE, Role.SHARD, Role.TP)
    assert (axes.shard_size, axes.replicate_size, axes.tp_size, axes.dp_size, axes.world_size) == (3, 2, 4, 6, 24)
    assert axes.hsdp and not axes.legacy
    assert MeshAxes.from_shape((8,)).roles == (Role.SHARD,) and MeshAxes.from_shape((8,)).legacy
    assert MeshAxes.from_shape((2, 4)).roles == (Role.REPLICATE, Role.SHARD)
    assert MeshAxes.from_shape({"dp": 2, "tp": 2}).dim(Role.TP) == 1


def test_a_1d_mesh_is_the_shard_axis_whatever_its_name():
    assert MeshAxes.from_names((4,), ("data",)).roles == (Role.SHARD,)


def test_custom_names_take_roles_from_axes():
    axes = MeshAxes.from_shape({"data": 2, "model": 2}, axes={"data": "shard", "model": "tp"})
    assert axes.roles == (Role.SHARD, Role.TP) and axes.tp_size == 2


@pytest.mark.parametrize(
    "shape,axes,error,match",
    [
        ({"dp": 2, "model": 2}, None, ValueError, "mesh axis 'model' has no role"),
        ({"dp": 2, "fsdp": 2}, None, ValueError, r"\['dp', 'fsdp'\] all have role 'shard'"),
        ({"tp": 2, "replicate": 2}, None, ValueError, "no data-parallel shard axis"),
        ({"dp": 2, "tp": 2}, {"tp": "pipeline"}, ValueError, "unknown role 'pipeline'"),
        ({"dp": 2, "tp": 2}, {"xp": "tp"}, ValueError, "names 'xp', which is not a mesh dim"),
        ({"ep": 2, "dp": 2, "tp": 2}, None, NotImplementedError, r"axis 'tp' \(tp\) cannot be combined"),
        (
            {"ep": 2, "replicate": 2, "edp": 2},
            None,
            NotImplementedError,
            r"replicate axis \('replicate'\) must be the first mesh dim",
        ),
        ((2, 2, 2), None, ValueError, "3-D mesh needs dim names"),
    ],
)
def test_bad_meshes_are_named(shape, axes, error, match):
    with pytest.raises(error, match=match):
        MeshAxes.from_shape(shape, axes)


# ---- plans over named axes -----------------------------------------------------------------


def test_tp_plan_places_every_parameter():
    plan = fsdpfn.plan(GPT(CFG), {"dp": 2, "tp": 2}, tp=GPT_TP_PLAN)
    p = plan.param
    assert (p("blocks.0.qkv.weight").tp, p("blocks.0.qkv.weight").local_shape) == ("shard0", (48, 32))
    assert (p("blocks.0.qkv.bias").tp, p("blocks.0.qkv.bias").local_shape) == ("shard0", (48,))
    assert (p("blocks.0.proj.weight").tp, p("blocks.0.proj.weight").local_shape) == ("shard1", (32, 16))
    assert p("blocks.0.proj.bias").tp == "partial" and p("blocks.0.proj.bias").local_shape == (32,)
    assert p("blocks.1.out.weight").local_shape == (32, 64)
    assert p("embed.weight").tp == "replicate" and p("norm.weight").tp == "replicate"
    assert plan.tp_modules["blocks.1.fc"] == "colwise" and len(plan.tp) == 8
    # Units hold tp-local elements: blocks gather 1/tp of their matmul weights.
    dense = fsdpfn.plan(GPT(CFG), {"dp": 2, "tp": 2})
    assert plan.unit("blocks.0").numel < dense.unit("blocks.0").numel
    assert plan.dp_size == 2 and plan.world_size == 4 and plan.tp_size == 2


def test_plan_json_format_3_round_trips():
    plan = fsdpfn.plan(GPT(CFG), {"replicate": 2, "shard": 2, "tp": 2}, tp=GPT_TP_PLAN, strategy="zero2")
    d = json.loads(plan.to_json())
    assert d["format"] == 3 and d["mesh"]["roles"] == ["replicate", "shard", "tp"]
    back = fsdpfn.Plan.from_json(plan.to_json())
    assert back == plan and back.fingerprint == plan.fingerprint
    assert back.param("blocks.0.proj.weight").local_shape == (32, 16)


def test_plans_written_before_named_axes_load_with_the_same_fingerprint():
    """Format 1 and 2 files (1-D and HSDP, with and without FP8) from before named axes."""
    with open(DATA) as f:
        saved = json.load(f)
    for name, entry in saved.items():
        plan = fsdpfn.Plan.from_json(json.dumps(entry["json"]))
        assert plan.fingerprint == entry["fingerprint"], name
        assert json.loads(plan.to_json()) == entry["json"], name  # written back unchanged
    fresh = fsdpfn.plan(GPT(GPTConfig(vocab_size=64, width=32, depth=2)), (2, 4))
    assert fresh.fingerprint == saved["hsdp"]["fingerprint"] and fresh.hsdp


def test_strategy_is_an_enum_that_compares_as_its_name():
    plan = fsdpfn.plan(GPT(CFG), (2,), strategy={"*": "zero3", "<root>": "zero1"})
    assert plan.unit("").strategy == "zero1" and plan.unit("").strategy is fsdpfn.Strategy.ZERO1
    assert plan.unit("blocks.0").strategy.reshards_after_forward and not plan.unit("").strategy.reshards_after_forward
    assert f"{plan.unit('blocks.0').strategy}" == "zero3"


def test_a_model_parallelised_by_torch_is_refused_by_name(run_on_ranks):
    for msg in run_on_ranks(_parallelised, 2):
        assert "'fc.weight' is already a DTensor" in msg and "tp={" in msg


def _parallelised(rank, world):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(4, 4))
    mesh = testing.mesh((world,), ("tp",))
    parallelize_module(model, mesh, {"fc": ColwiseParallel()})
    try:
        fsdpfn.plan(model, testing.mesh((1, world), ("dp", "tp")))
    except ValueError as e:
        return str(e)
    return "no error"


# ---- bad tensor-parallel input: a named error on every rank, before any collective ----------


def _bad_tp(rank, world):
    mesh = testing.mesh((2, 2), ("dp", "tp"))
    model = GPT(CFG)
    cases = {
        "nothing": lambda: fsdpfn.plan(model, mesh, tp={"blocks.*.qkvv": "colwise"}),
        "divisible": lambda: fsdpfn.plan(
            GPT(GPTConfig(vocab_size=64, width=15, depth=1, heads=3)), mesh, tp={"blocks.*.qkv": "colwise"}
        ),
        "embedding": lambda: fsdpfn.plan(model, mesh, tp={"embed": "colwise"}),
        "style": lambda: fsdpfn.plan(model, mesh, tp={"blocks.*.fc": "diagonal"}),
        "not_linear": lambda: fsdpfn.plan(model, mesh, tp={"blocks.0": "colwise"}),
        "no_tp_axis": lambda: fsdpfn.plan(model, testing.mesh((4,)), tp=GPT_TP_PLAN),
        "no_role": lambda: fsdpfn.plan(model, testing.mesh((2, 2), ("data", "model"))),
        "fp8_width": lambda: fsdpfn.plan(
            GPT(GPTConfig(vocab_size=64, width=96, depth=1, heads=4)),
            mesh,
            tp={"blocks.*.proj": "rowwise", "blocks.*.qkv": "colwise"},
            mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, fp8="mxfp8"),
        ),
    }
    return refusals(cases)


def test_bad_tp_input_is_named_on_every_rank_before_any_collective(run_on_ranks):
    for out in run_on_ranks(_bad_tp, 4):
        assert out["collectives"] == 0
        assert "tp pattern 'blocks.*.qkvv' matches no module" in out["nothing"] and "did you mean" in out["nothing"]
        assert "'blocks.0.qkv.weight' has 45 along dim 0, which does not divide over tp=2" in out["divisible"], out[
            "divisible"
        ]
        assert out["embedding"].startswith("NotImplementedError") and "embedding 'embed'" in out["embedding"]
        assert "tp['blocks.*.fc'] = 'diagonal': unknown style" in out["style"]
        assert "matches 'blocks.0', a Block" in out["not_linear"]
        assert "has no tensor-parallel axis" in out["no_tp_axis"]
        assert "mesh axis 'data' has no role" in out["no_role"]
        assert (
            "'blocks.0.proj.weight' is split by columns over tp=2: its local width 48 is not a multiple"
            in out["fp8_width"]
        ), out["fp8_width"]


# ---- a 1-D mesh named for another parallelism ------------------------------------------------


@pytest.mark.parametrize(
    "name,role,mesh",
    [
        ("cp", None, "(1, 4), mesh_dim_names=('dp', 'cp')"),
        ("tp", None, "(1, 4), mesh_dim_names=('dp', 'tp')"),
        ("ep", None, "(4, 1), mesh_dim_names=('ep', 'edp')"),
        ("pp", None, "(4, 1), mesh_dim_names=('pp', 'dp')"),
        ("seq", "cp", "(1, 4), mesh_dim_names=('dp', 'seq')"),  # the role given by axes, not the name
    ],
)
def test_a_1d_mesh_of_another_parallelism_is_refused_with_the_mesh_to_build(name, role, mesh):
    # It used to shard plainly over the 4 ranks (a "cp" mesh: cp = 1, every rank reading whole
    # sequences), with no word to the user who asked for another parallelism.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(
        ValueError, match=rf"1-D mesh named '{name}' of 4 ranks .*{re.escape(mesh)}.*name the axis 'dp'"
    ):
        fsdpfn.plan(model, {name: 4}, axes={name: role} if role else None)


@pytest.mark.parametrize("name", ["dp", "shard", "replicate", "batch"])
def test_a_1d_data_parallel_mesh_shards_over_every_rank(name):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    plan = fsdpfn.plan(model, {name: 4}, axes={"batch": "shard"} if name == "batch" else None)
    assert plan.dp_size == 4
