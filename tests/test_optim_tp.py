"""Muon on tensor-parallel meshes, (dp, tp) = (2, 2) on 4 gloo ranks and (replicate, shard, tp) =
(2, 2, 2) on 8, against one process step by step.

The leaves are what ``fsdpfn.shard`` makes of a small model under a tp plan: a colwise weight
(tp rows, dp rows cut from each tp slice: ``_StridedShard``), a rowwise weight (tp columns, dp
rows), a weight tp leaves whole (replicated over tp, dp rows), a colwise weight orthogonalised
per head, and a batch of expert matrices (dp over the batch, replicated over tp), with row counts
that split unevenly over dp. Assembling a block from its pieces copies bits and Newton–Schulz
casts to its dtype first, so the owner and duplicated layouts give exactly the one-process
update (fp32 and bf16; on CPU a batch runs matrix by matrix, fsdpfn/optim/_newton_schulz.py,
[Note: batches on CPU]). The owner layout's Newton–Schulz FLOPs summed over the ranks of one
replicate group equal one process's, counted with FlopCounterMode.
"""

import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, testing

TP = {
    "col": "colwise",
    "row": "rowwise",
    "qkv": "colwise",
    "whole": "replicate",
}  # every Linear of the root split or marked
BLOCKS = {"qkv.weight": 4}  # 4 heads of 3 rows; tp = 2 gives each tp rank 2 whole heads


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.col = nn.Linear(6, 10, bias=False)  # (10, 6): tp rows 5 each, over dp 3 + 2
        self.row = nn.Linear(10, 7, bias=False)  # (7, 10): tp columns 5 each, rows over dp 4 + 3
        self.whole = nn.Linear(7, 5, bias=False)  # (5, 7): replicated over tp, rows 3 + 2
        self.qkv = nn.Linear(4, 12, bias=False)  # (12, 4): heads of 3 rows cut by dp
        self.experts = nn.Parameter(torch.randn(5, 4, 6))  # 3 + 2 experts over dp, whole over tp
        self.norm = nn.LayerNorm(6)  # AdamW


def _plan(mesh_shape, names, tp=TP):
    torch.manual_seed(0)
    model = Net()
    return model, fsdpfn.plan(model, testing.mesh(mesh_shape, names), tp=tp)


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _muon(layout, dtype):
    return optim.muon(
        lr=0.05,
        weight_decay=0.1,
        adamw_lr=0.01,
        ns_dtype=dtype,
        layout=layout,
        blocks=BLOCKS,
        labels=lambda n, p: "muon" if p.dim() >= 2 else "adamw",
    )


def _parity(rank, world, mesh_shape, names, layout, dtype, steps=2):
    model, plan = _plan(mesh_shape, names)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = fsdpfn.shard(model, plan)
    opt, ref_opt = _muon(layout, dtype), _muon(layout, dtype)
    state, ref_state = opt.init(params), ref_opt.init(ref)
    bitwise, counts, flops, ref_flops = {}, [], 0, 0
    for step in range(steps):
        g = _grads(model, 100 + step)
        grads = fsdpfn.shard(g, plan, check=False)
        with fsdpfn.count_collectives() as counter, FlopCounterMode(display=False) as fc:
            updates, state = opt.update(grads, state, params)
        flops += fc.get_total_flops()
        counts.append(counter.counts())
        params = optim.apply_updates(params, updates)
        with FlopCounterMode(display=False) as fc:
            ref_updates, ref_state = ref_opt.update(g, ref_state, ref)
        ref_flops += fc.get_total_flops()
        ref = optim.apply_updates(ref, ref_updates)
        for n in ref:
            bitwise[n] = bitwise.get(n, True) and torch.equal(params[n].full_tensor(), ref[n])
    placements = {
        n: tuple(type(p).__name__ for p in params[n].placements) for n in ("col.weight", "row.weight", "whole.weight")
    }
    return dict(bitwise=bitwise, counts=counts, flops=flops, ref_flops=ref_flops, placements=placements)


MESHES = [
    pytest.param((2, 2), ("dp", "tp"), id="dp2xtp2"),
    pytest.param((2, 2, 2), ("replicate", "shard", "tp"), id="rep2xshard2xtp2"),
]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
@pytest.mark.parametrize("layout", ["owner", "duplicated"])
def test_muon_on_tp_meshes_equals_one_process_bitwise(run_on_ranks, mesh_shape, names, layout):
    world = math.prod(mesh_shape)
    replicas = world // (mesh_shape[-2] * mesh_shape[-1])  # HSDP replicate groups compute the same thing
    work = world // replicas
    for dtype in (torch.float32, torch.bfloat16):
        results = run_on_ranks(_parity, world, mesh_shape, names, layout, dtype)
        for r in results:
            assert all(r["bitwise"].values()), (str(dtype), r["bitwise"])
            kind = {"owner": "all_to_all", "duplicated": "all_gather"}[layout]
            assert all(c == {kind: 2 if layout == "owner" else 1} for c in r["counts"]), r["counts"]
        # The layouts these leaves have: strided dp rows in tp slices, dp rows x tp columns, dp rows.
        assert results[0]["placements"] == {
            "col.weight": (*("Replicate",) * (replicas > 1), "_StridedShard", "Shard"),
            "row.weight": (*("Replicate",) * (replicas > 1), "Shard", "Shard"),
            "whole.weight": (*("Replicate",) * (replicas > 1), "Shard", "Replicate"),
        }
        total = sum(r["flops"] for r in results) / replicas
        one = results[0]["ref_flops"]
        # owner: every block orthogonalised once per replicate group; duplicated: on every rank.
        assert total == (one if layout == "owner" else work * one), (total, one)


# ---------------------------------------------------------------------------------------------
# blockwise: each tensor-parallel piece alone (mesh-dependent by design)
# ---------------------------------------------------------------------------------------------


def _pieces_reference(full: torch.Tensor, tp_dim: int | None, tp: int, spec, dtype) -> torch.Tensor:
    """Newton–Schulz of each tp piece of ``full`` alone (of each of the user's blocks inside
    it), in one process, each block by itself."""
    m = max(spec[0], tp if tp_dim == 0 else 1)
    n = max(spec[1], tp if tp_dim == 1 else 1)
    rows = [r.split(full.shape[1] // n, 1) for r in full.split(full.shape[0] // m, 0)]
    return torch.cat([torch.cat([optim.newton_schulz(b, dtype=dtype) for b in r], 1) for r in rows], 0)


def _blockwise(rank, world, dtype):
    model, plan = _plan((2, 2), ("dp", "tp"))
    g = _grads(model, 7)
    grads = fsdpfn.shard(g, plan, check=False)
    names = ["col.weight", "row.weight", "whole.weight", "qkv.weight"]
    specs = [(1, 1), (1, 1), (1, 1), (4, 1)]
    got = optim.orthogonalize([grads[n] for n in names], names, layout="blockwise", dtype=dtype, blocks=specs)
    tp_dims = {"col.weight": 0, "row.weight": 1, "whole.weight": None, "qkv.weight": 0}
    ok = {}
    for n, s, o in zip(names, specs, got):
        want = _pieces_reference(g[n], tp_dims[n], 2, s, dtype)
        ok[n] = o.placements == grads[n].placements and torch.equal(o.full_tensor(), want)
    # blocks that cut across the tp pieces: 3 row blocks of qkv over tp = 2, named, before any collective
    with fsdpfn.count_collectives() as counter:
        try:
            optim.orthogonalize([grads["qkv.weight"]], ["qkv.weight"], layout="blockwise", blocks=[(3, 1)])
            error = ""
        except ValueError as e:
            error = str(e)
    return ok, error, counter.counts()


def test_blockwise_equals_the_per_piece_reference(run_on_ranks):
    for dtype in (torch.float32, torch.bfloat16):
        for ok, error, counts in run_on_ranks(_blockwise, 4, dtype):
            assert all(ok.values()), (str(dtype), ok)
            assert "'qkv.weight'" in error and "cut across its 2 tensor-parallel pieces" in error, error
            assert counts == {}, counts


def _heads_local(rank, world):
    """tp = 4, dp = 1: each rank holds its 3-row heads whole, so per-head Muon moves nothing. (qkv is
    colwise_gather, placed as colwise, needing no rowwise partner; the other Linears stay whole.)"""
    model, plan = _plan(
        (1, 4), ("dp", "tp"), {"qkv": "colwise_gather", "col": "replicate", "row": "replicate", "whole": "replicate"}
    )
    g = _grads(model, 9)
    x = fsdpfn.shard(g, plan, check=False)["qkv.weight"]
    with fsdpfn.count_collectives() as counter:
        o = optim.orthogonalize([x], ["qkv.weight"], dtype=torch.float32, blocks=[(4, 1)])[0]
    want = torch.cat([optim.newton_schulz(b, dtype=torch.float32) for b in g["qkv.weight"].split(3)])
    return counter.counts(), torch.equal(o.full_tensor(), want)


def test_heads_that_divide_over_tp_stay_local(run_on_ranks):
    assert run_on_ranks(_heads_local, 4) == [({}, True)] * 4


def test_strided_shard_with_a_wrong_split_factor_is_named(run_on_ranks):
    assert run_on_ranks(_bad_strided, 4) == ["ok"] * 4


def _bad_strided(rank, world):
    mesh = testing.mesh((2, 2), ("dp", "tp"))
    x = DTensor.from_local(
        torch.zeros(2, 4),
        mesh,
        (_StridedShard(0, split_factor=3), Shard(0)),
        run_check=False,
        shape=torch.Size((8, 4)),
        stride=(4, 1),
    )
    try:
        optim.orthogonalize([x], ["w"])
    except NotImplementedError as e:
        return "ok" if "'w'" in str(e) and "split_factor" in str(e) else str(e)
    return "no error"


def _buckets(rank, world):
    """The pipelined owner layout on (dp, tp): 3 buckets give the bits of 1, in 6 all-to-alls."""
    model, plan = _plan((2, 2), ("dp", "tp"))
    g = _grads(model, 11)
    grads = fsdpfn.shard(g, plan, check=False)
    names = [n for n in grads if grads[n].dim() >= 2]
    specs = [(4, 1) if n == "qkv.weight" else (1, 1) for n in names]
    out = {}
    for b in (1, 3):
        with fsdpfn.count_collectives() as counter, optim.record_pipeline() as rec:
            got = optim.orthogonalize([grads[n] for n in names], names, dtype=torch.float32, blocks=specs, buckets=b)
        out[b] = ([o.full_tensor() for o in got], counter.counts(), rec.overlapped())
    same = all(torch.equal(a, c) for a, c in zip(out[1][0], out[3][0]))
    return same, out[1][1], out[3][1], out[3][2]


def test_buckets_on_a_tp_mesh_give_the_bits_of_one_bucket(run_on_ranks):
    for same, one, three, overlapped in run_on_ranks(_buckets, 4):
        assert same and one == {"all_to_all": 2} and three == {"all_to_all": 6} and overlapped >= 3, (
            one,
            three,
            overlapped,
        )


def _full_tensor_after_a_work_group(rank, world):
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdpfn.optim._layout import work_group

    mesh = testing.mesh((2, 2), ("dp", "tp"))
    wg = work_group(mesh, (0, 1))  # the group Muon forms over both dims of a (dp, tp) mesh
    x = torch.arange(29 * 5, dtype=torch.float32).view(29, 5)
    d = distribute_tensor(x, mesh, (Shard(0), Shard(0)))  # uneven along both dims
    return wg.size, torch.equal(d.full_tensor(), x)


def test_the_muon_work_group_leaves_the_users_mesh_alone(run_on_ranks):
    """torch 2.13 gathers nested uneven Shard(0) wrongly on a mesh with a flattened dim; the
    group Muon needs over (dp, tp) is made without flattening the user's mesh."""
    assert run_on_ranks(_full_tensor_after_a_work_group, 4) == [(4, True)] * 4
