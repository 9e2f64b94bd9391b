"""Placements as data (``fsdpfn/_plan/placements.py``): a ``ParamSpec`` carries one placement per
model-parallel axis, and every figure the tp/ep flags used to feed is derived from them.

The references below are the flag ladders the placements replaced, copied from fsdpfn as it was
before (``ParamSpec.local_shape``, ``transforms._dtensor._placements``, ``transforms.tp_slice``,
``transforms._local.local_index``); every plan of a grid (dp x tp both mesh orders, HSDP x tp,
fused q|k|v, ep x edp with and without a replicate axis, replicate units) must give exactly what
they gave. Then: the compatibility words build and read back the same placements, plan JSON is
unchanged, and a placement kind written in this file alone is cut, boxed and placed without
editing fsdpfn.
"""

from __future__ import annotations

import dataclasses
import json
from typing import cast

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdpfn
from fsdpfn import transforms
from fsdpfn._plan import placements as P
from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn._plan.placements import AxisPlacement, Partial, Placement, Replicate, Shard, StridedShard
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig, MoE, MoEConfig
from fsdpfn.transforms._local import local_index

FUSED = {**GPT_TP_PLAN, "blocks.*.qkv": "colwise_fused:3"}


class _Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.moe = MoE(cfg)
        self.fc = nn.Linear(cfg.width, cfg.width)


class _MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = MoEConfig(width=8, hidden=12, experts=4, top_k=2)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(2)])


def _gpt(bias=True):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=32, seq_len=8, width=24, depth=2, heads=6, bias=bias)
        if bias
        else GPTConfig(vocab_size=32, seq_len=8, width=24, depth=2, heads=6)
    )


def _plans():
    """Abstract plans covering every placement the builder makes."""
    gpt = _gpt()
    moe = _MoENet()
    replicated_blocks = {"*": "replicate", "<root>": "zero3"}
    return {
        "dp x tp": fsdpfn.plan(gpt, {"dp": 2, "tp": 3}, tp=GPT_TP_PLAN),
        "tp x dp": fsdpfn.plan(gpt, {"tp": 3, "dp": 2}, tp=GPT_TP_PLAN),
        "hsdp x tp": fsdpfn.plan(
            gpt, {"replicate": 2, "shard": 2, "tp": 3}, tp=GPT_TP_PLAN, strategy={"*": "zero3", "blocks.1": "zero2"}
        ),
        "tp, replicate units": fsdpfn.plan(gpt, {"dp": 2, "tp": 3}, tp=GPT_TP_PLAN, strategy=replicated_blocks),
        "fused, dp 1": fsdpfn.plan(gpt, {"dp": 1, "tp": 3}, tp=FUSED),
        "fused, tp 1": fsdpfn.plan(gpt, {"dp": 2, "tp": 1}, tp=FUSED),
        "fused, replicate units": fsdpfn.plan(gpt, {"dp": 2, "tp": 3}, tp=FUSED, strategy=replicated_blocks),
        "ep x edp": fsdpfn.plan(moe, {"ep": 2, "edp": 2}),
        "edp x ep": fsdpfn.plan(moe, {"edp": 2, "ep": 2}),
        "replicate x ep x edp": fsdpfn.plan(moe, {"replicate": 2, "ep": 2, "edp": 2}),
        "ep 4": fsdpfn.plan(moe, {"ep": 4, "edp": 1}),
        "hsdp": fsdpfn.plan(gpt, (2, 3)),
        "1-D": fsdpfn.plan(gpt, (4,)),
    }


PLANS = _plans()


# ---- the flag ladders, as they were ---------------------------------------------------------------


def _old_local_shape(spec):
    if spec.expert:
        return (spec.shape[0] // spec.ep_size, *spec.shape[1:])
    d = spec.tp_dim
    if d is None:
        return spec.shape
    return tuple(s // spec.tp_size if i == d else s for i, s in enumerate(spec.shape))


def _old_placements(plan, name):
    unit = plan.unit_of(name)
    spec = unit.param(name)
    axes = plan.axes
    if axes.dim(Role.EP) is not None and not unit.experts:
        dense = (DShard(0) if unit.slots[name].sharded else DReplicate(),)
        return (DReplicate(), *dense) if axes.hsdp else dense
    out: list = []
    for d, role in enumerate(axes.roles):
        if role is Role.SHARD:
            if not unit.slots[name].sharded or (spec.tp_stride > 1 and axes.shard_size == 1):
                out.append(DReplicate())
            elif spec.tp_dim == 0 and axes.tp_size > 1 and cast(int, axes.dim(Role.TP)) > d:
                out.append(_StridedShard(0, split_factor=axes.tp_size))
            elif spec.expert and axes.ep_size > 1 and cast(int, axes.dim(Role.EP)) > d:
                out.append(_StridedShard(0, split_factor=axes.ep_size))
            else:
                out.append(DShard(0))
        elif role is Role.TP and spec.tp_stride > 1:
            out.append(_StridedShard(0, split_factor=spec.tp_stride))
        elif role is Role.TP and spec.tp_dim is not None:
            out.append(DShard(spec.tp_dim))
        elif role is Role.EP and spec.expert:
            out.append(DShard(0))
        else:
            out.append(DReplicate())
    return tuple(out)


def _old_tp_slice(spec, full, rank):
    if spec.expert:
        n = spec.local_shape[0]
        return full.narrow(0, rank * n, n)
    d = spec.tp_dim
    if d is None:
        return full
    n = spec.local_shape[d]
    if spec.tp_stride > 1:
        k = spec.tp_stride
        parts = full.reshape(k, spec.tp_size, n // k, *full.shape[1:])
        return parts[:, rank].reshape(n, *full.shape[1:])
    return full.narrow(d, rank * n, n)


def _old_local_index(plan, name, rank, tp):
    spec = plan.param(name)
    if not spec.shape:
        return ()
    start, stop = plan.unit_of(name).local_rows(name, rank)
    if spec.expert:
        n = spec.local_shape[0]
        return (slice(tp * n + start, tp * n + stop),)
    d = spec.tp_dim
    if d is None:
        return (slice(start, stop),)
    if spec.tp_stride > 1:
        return None
    n = spec.local_shape[d]
    if d == 0:
        return (slice(tp * n + start, tp * n + stop),)
    return (slice(start, stop), *(slice(None),) * (d - 1), slice(tp * n, (tp + 1) * n))


def _old_unit_shard_size(plan, unit):
    return plan.axes.shard_size if unit.experts else plan.axes.dense_shard_size


# ---- every plan: the same as the ladders -----------------------------------------------------------


@pytest.mark.parametrize("key", list(PLANS))
def test_placements_derive_what_the_flags_gave(key):
    plan = PLANS[key]
    model_axis = max(plan.tp_size, plan.ep_size)
    checked = set()
    for unit in plan.units:
        assert unit.shard_size == _old_unit_shard_size(plan, unit)
        flattened = len(P.unit_row_roles(unit, plan.axes)) > 1
        assert flattened == (plan.axes.dim(Role.EP) is not None and not unit.experts)
        for spec in unit.params:
            assert spec.local_shape == _old_local_shape(spec), spec
            assert transforms.placements(plan, spec.name) == _old_placements(plan, spec.name), spec
            full = torch.arange(spec.global_numel, dtype=torch.float32).reshape(spec.shape)
            for t in range(model_axis):
                assert torch.equal(transforms.tp_slice(plan, spec.name, full, t), _old_tp_slice(spec, full, t)), (
                    spec,
                    t,
                )
                for r in range(unit.shard_size):
                    want = _old_local_index(plan, spec.name, r, t)
                    if want is None:
                        with pytest.raises(
                            NotImplementedError, match="is split colwise_fused:3: each tp rank holds 3 slices"
                        ):
                            local_index(plan, spec.name, rank=r, tp=t)
                    else:
                        assert local_index(plan, spec.name, rank=r, tp=t) == want, (spec, r, t)
            # The gradient is summed over every data-parallel axis that does not split it.
            want_reduce = {r for r in plan.axes.roles if r.is_data_parallel} - ({Role.EP} if spec.expert else set())
            assert set(P.reduce_roles(spec, plan.axes)) == want_reduce
            checked.add(
                type(P.placement_of(spec, Role.TP)).__name__ + "/" + type(P.placement_of(spec, Role.EP)).__name__
            )
    if key == "dp x tp":
        assert checked >= {"Shard/Replicate", "Partial/Replicate", "Replicate/Replicate"}
    if key.startswith("ep"):
        assert checked == {"Replicate/Shard", "Replicate/Replicate"}
    if key.startswith("fused"):
        assert "StridedShard/Replicate" in checked


def test_json_is_what_earlier_versions_wrote_and_reads_back_equal():
    for key, plan in PLANS.items():
        d = plan.to_dict()
        for u in d["units"]:
            for p in u["params"]:
                spec = plan.param(p["name"])
                # the words formats 3 and 4 wrote, only where not the default
                assert p.get("tp", "replicate") == spec.tp and p.get("tp_stride", 1) == spec.tp_stride
                assert p.get("expert", False) == spec.expert
        again = fsdpfn.Plan.from_json(plan.to_json())
        assert again == plan and again.fingerprint == plan.fingerprint, key
        assert [p.placements for u in again.units for p in u.params] == [
            p.placements for u in plan.units for p in u.params
        ]


def test_the_old_words_build_the_placements_and_read_back():
    f32 = torch.float32
    cases = [
        (dict(), (), ("replicate", 1, 1, None, False, 1)),
        (dict(tp="shard0", tp_size=2), (AxisPlacement("tp", 2, Shard(0)),), ("shard0", 2, 1, 0, False, 1)),
        (dict(tp="shard1", tp_size=3), (AxisPlacement("tp", 3, Shard(1)),), ("shard1", 3, 1, 1, False, 1)),
        (dict(tp="partial", tp_size=2), (AxisPlacement("tp", 2, Partial()),), ("partial", 2, 1, None, False, 1)),
        (dict(tp="replicate", tp_size=2), (AxisPlacement("tp", 2, Replicate()),), ("replicate", 2, 1, None, False, 1)),
        (
            dict(tp="shard0", tp_size=2, tp_stride=3),
            (AxisPlacement("tp", 2, StridedShard(0, 3)),),
            ("shard0", 2, 3, 0, False, 1),
        ),
        (dict(expert=True, ep_size=2), (AxisPlacement("ep", 2, Shard(0)),), ("replicate", 1, 1, None, True, 2)),
        (dict(expert=False, ep_size=2), (AxisPlacement("ep", 2, Replicate()),), ("replicate", 1, 1, None, False, 2)),
        (dict(expert=True), (AxisPlacement("ep", 1, Shard(0)),), ("replicate", 1, 1, None, True, 1)),
    ]
    for words, placements, read in cases:
        spec = fsdpfn.ParamSpec("w", (12, 6), f32, **words)
        assert spec.placements == placements, words
        assert (spec.tp, spec.tp_size, spec.tp_stride, spec.tp_dim, spec.expert, spec.ep_size) == read, words
        assert spec == fsdpfn.ParamSpec("w", (12, 6), f32, placements=placements)
        assert spec == dataclasses.replace(spec) and hash(spec) == hash(dataclasses.replace(spec))
    # positional, as fsdpfn.plan used to build them
    assert fsdpfn.ParamSpec("w", (12, 6), f32, "shard0", 2, False, 1, 3).placements == (
        AxisPlacement("tp", 2, StridedShard(0, 3)),
    )
    # the words are read-only
    with pytest.raises(AttributeError):
        fsdpfn.ParamSpec("w", (12, 6), f32).tp = "shard0"  # type: ignore[misc]


def test_placements_are_validated_with_the_old_messages():
    f32 = torch.float32
    with pytest.raises(ValueError, match="has 5 along dim 0, which does not divide over tp=2 ranks"):
        fsdpfn.ParamSpec("w", (5, 4), f32, tp="shard0", tp_size=2)
    with pytest.raises(ValueError, match=r"packs 6 experts \(dim 0 of \(6, 2\)\), which do not divide over ep=4"):
        fsdpfn.ParamSpec("w", (6, 2), f32, expert=True, ep_size=4)
    with pytest.raises(ValueError, match="which do not make 3 fused parts of equal size"):
        fsdpfn.ParamSpec("w", (8, 2), f32, tp="shard0", tp_size=2, tp_stride=3)
    with pytest.raises(ValueError, match="unknown tensor-parallel placement 'shard2'"):
        fsdpfn.ParamSpec("w", (6, 2), f32, tp="shard2")
    with pytest.raises(ValueError, match="tp_stride=2 needs tp='shard0'"):
        fsdpfn.ParamSpec("w", (6, 2), f32, tp="shard1", tp_stride=2)
    with pytest.raises(NotImplementedError, match="experts split over both ep and tp"):
        fsdpfn.ParamSpec("w", (4, 4), f32, tp="shard1", tp_size=2, expert=True, ep_size=2)
    with pytest.raises(ValueError, match="not both"):
        fsdpfn.ParamSpec("w", (4, 4), f32, tp="shard0", placements=())
    with pytest.raises(ValueError, match="two placements on axis 'tp'"):
        fsdpfn.ParamSpec(
            "w", (4, 4), f32, placements=[AxisPlacement("tp", 2, Shard(0)), AxisPlacement("tp", 2, Shard(1))]
        )
    with pytest.raises(ValueError, match="data-parallel axes are its unit's"):
        AxisPlacement("shard", 2, Shard(0))


# ---- a placement kind written here alone -----------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class Interleaved(Placement):
    """Rows dealt round-robin: rank ``r`` of ``n`` holds rows ``r, r + n, r + 2n, ...`` (a
    load-balanced sequence split, as context parallelism deals causal chunks)."""

    @property
    def is_split(self) -> bool:
        return True

    @property
    def dim(self) -> int | None:
        return 0

    def local_shape(self, shape, size):
        return (shape[0] // size, *shape[1:])

    def part(self, full, size, index):
        return full[index::size]

    def offsets(self, shape, size, index):
        return None  # not one box

    def check(self, name, shape, axis, size):
        if not shape or shape[0] % size:
            raise ValueError(f"{name!r}: {shape} does not deal over {axis.value}={size}")


def test_a_new_placement_kind_is_cut_boxed_and_placed_without_editing_fsdpfn():
    spec = fsdpfn.ParamSpec("seq", (8, 3), torch.float32, placements=[AxisPlacement("tp", 2, Interleaved())])
    full = torch.arange(24.0).reshape(8, 3)
    assert spec.local_shape == (4, 3) and spec.rows == 4 and spec.numel == 12
    assert P.local_part(spec, full, {Role.TP: 1}).tolist() == full[1::2].tolist()
    assert P.local_box(spec, (0, 4), {Role.TP: 1}) is None  # builders by box refuse it
    assert P.split_roles(spec) == (Role.TP,) and P.reduce_roles(spec, MeshAxes.from_shape({"dp": 2, "tp": 2})) == (
        Role.SHARD,
    )
    # data-parallel rows are cut from the part a later mesh dim splits along dim 0
    assert P.dtensor_placements(spec, MeshAxes.from_shape({"dp": 2, "tp": 2}), True)[0] == _StridedShard(
        0, split_factor=2
    )
    with pytest.raises(ValueError, match="does not deal over tp=2"):
        fsdpfn.ParamSpec("seq", (7, 3), torch.float32, placements=[AxisPlacement("tp", 2, Interleaved())])
    unit = fsdpfn.Unit("", "zero3", (spec,), 2)
    assert unit.shard_numel == 2 * 3 and json.dumps(unit.local_rows("seq", 1)) == "[2, 4]"
