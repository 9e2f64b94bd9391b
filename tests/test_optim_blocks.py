"""Muon, second round: blocks inside a matrix (per head, per expert) and the pipelined owner
layout, against a one-process per-block reference on 2, 3 and 4 ranks and an HSDP mesh, with
block boundaries cutting across uneven and empty shards; buckets bitwise equal to one bucket,
and the overlap counted; the spectral learning-rate rule."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn._rows import chunk_bounds
from fsdpfn.optim._blocks import merge_blocks, split_blocks

# Rows chosen so that block boundaries cut across shards on 2, 3 and 4 ranks (12 rows in blocks
# of 2 over 4 ranks: 3 rows each; 10 rows in blocks of 2: shards 3, 3, 3, 1; 3 rows over 4:
# one rank empty), column blocks on uneven rows (7 over 4: 2, 2, 2, 1), a grid, a whole matrix
# beside them, a 3-D leaf cut per matrix, and leaves Muon leaves to AdamW.
SHAPES = {
    "blocks.0.attn.qkv.weight": (12, 8),
    "blocks.0.attn.proj.weight": (7, 8),
    "blocks.0.moe.packed.weight": (10, 6),
    "blocks.0.grid.weight": (6, 9),
    "blocks.0.tiny.weight": (3, 4),
    "blocks.0.whole.weight": (5, 7),
    "blocks.0.experts": (5, 4, 6),
    "blocks.0.attn.qkv.bias": (12,),
    "embed.weight": (11, 6),
}
BLOCKS = {
    "*qkv.weight": 6,  # 2 heads x (q, k, v)
    "*proj.weight": (1, 4),  # 4 heads' column blocks
    "*packed.weight": 5,  # 5 experts of 2 x 6
    "*grid.weight": (2, 3),
    "*tiny.weight": 3,
    "*experts": (2, 1),
}
SPECS = {
    n: next((s if isinstance(s, tuple) else (s, 1) for p, s in BLOCKS.items() if n.endswith(p[1:])), (1, 1))
    for n in SHAPES
}


def _full(seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _shard(full, mesh):
    world, rank = mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1)
    out = {}
    for n, t in full.items():
        local = t[slice(*chunk_bounds(t.shape[0], world, rank))]
        placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
        out[n] = DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    return out


def _mesh(mesh_shape):
    return testing.mesh(mesh_shape, ("replicate", "shard") if len(mesh_shape) == 2 else None)


def per_block_reference(x, spec, dtype):
    """One process, one block at a time: ``newton_schulz`` of each block alone, put back."""
    m, n = spec
    *batch, rows, cols = x.shape
    out = torch.empty(x.shape, dtype=dtype)
    br, bc = rows // m, cols // n
    for a in range(m):
        for b in range(n):
            r, c = slice(a * br, (a + 1) * br), slice(b * bc, (b + 1) * bc)
            for idx in [()] if not batch else [(i,) for i in range(batch[0])]:
                out[idx + (r, c)] = optim.newton_schulz(x[idx + (r, c)], dtype=dtype)
    return out


def test_split_and_merge_blocks_round_trip_row_major():
    x = torch.arange(2 * 6 * 4.0).view(2, 6, 4)
    blocks = split_blocks(x, (3, 2))
    assert blocks.shape == (12, 2, 2)
    assert (
        torch.equal(blocks[1], x[0, 0:2, 2:4])
        and torch.equal(blocks[2], x[0, 2:4, 0:2])
        and torch.equal(blocks[6], x[1, 0:2, 0:2])
    )
    assert torch.equal(merge_blocks(blocks, (3, 2), x.shape), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_a_batch_gives_each_matrix_its_bits_alone(dtype, method):
    # What the owner layout's buckets rely on: whatever else is in a batch, a matrix gets the
    # same bits (and the bits of a call on it alone, 2-D).
    x = torch.randn(6, 6, 16, generator=torch.Generator().manual_seed(1))
    whole = optim.newton_schulz(x, dtype=dtype, method=method)
    for i in range(6):
        assert torch.equal(whole[i], optim.newton_schulz(x[i], dtype=dtype, method=method))
    assert torch.equal(whole[2:5], optim.newton_schulz(x[2:5], dtype=dtype, method=method))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_process_blocks_equal_the_per_block_reference(dtype):
    full = _full(0)
    names = [n for n in SHAPES if full[n].dim() >= 2 and not n.startswith("embed")]
    got = optim.orthogonalize([full[n] for n in names], names, dtype=dtype, blocks=[SPECS[n] for n in names])
    for n, o in zip(names, got):
        assert torch.equal(o, per_block_reference(full[n], SPECS[n], dtype)), n


def test_block_specs_are_checked_when_built_and_at_init():
    with pytest.raises(ValueError, match=r"blocks\['\*qkv'\]=0 is invalid"):
        optim.muon(blocks={"*qkv": 0})
    with pytest.raises(ValueError, match="blocks must be None, a dict"):
        optim.scale_by_muon(blocks=3)
    with pytest.raises(ValueError, match="buckets=0 is invalid"):
        optim.muon(buckets=0)
    opt = optim.muon(blocks={"w": 3})
    with pytest.raises(ValueError, match=r"'w' of shape \(8, 4\) cannot be cut into 3 x 1 blocks"):
        opt.init({"w": torch.zeros(8, 4)})
    bad_fn = optim.scale_by_muon(blocks=lambda name, p: "heads")
    with pytest.raises(ValueError, match=r"blocks\('w'\)='heads' is invalid"):
        bad_fn.init({"w": torch.zeros(8, 4)})
    assert optim.head_blocks(4) == {"*qkv.weight": (12, 1), "*proj.weight": (1, 4)}


def test_muon_with_blocks_is_momentum_then_per_block_ns_then_per_block_lr():
    full, grads = _full(0), [_full(10 + i) for i in range(2)]
    names = [n for n in SHAPES if n.startswith("blocks") and full[n].dim() >= 2]
    params = {n: full[n] for n in names}
    lr, wd, mom = 0.05, 0.1, 0.95
    opt = optim.chain(
        optim.scale_by_muon(ns_dtype=torch.float32, blocks=BLOCKS),
        optim.scale_by_muon_lr(lr, wd, "spectral_norm", blocks=BLOCKS),
    )
    state = opt.init(params)
    ref, bufs = dict(params), {n: torch.zeros_like(p) for n, p in params.items()}
    sizes = {n: torch.zeros_like(p) for n, p in params.items()}
    for g in grads:
        updates, state = opt.update({n: g[n] for n in names}, state, params)
        params = optim.apply_updates(params, updates)
        for n in names:
            bufs[n] = bufs[n].lerp(g[n], 1 - mom)
            o = per_block_reference(g[n].lerp(bufs[n], mom), SPECS[n], torch.float32)
            rows, cols = o.shape[-2] // SPECS[n][0], o.shape[-1] // SPECS[n][1]
            new = ref[n] + (o * (-lr * math.sqrt(rows / cols)) - lr * wd * ref[n])
            sizes[n] += ref[n].abs() + new.abs() + (new - ref[n]).abs()
            ref[n] = new
    # Momentum and the per-block Newton–Schulz are the same operations (bitwise: the test above);
    # the step is rounded differently where our decay is fused on vectorised CPUs: each side
    # rounds alr * O, lr * wd, its product with p, the difference and p + update, each by at most
    # 2^-24 of its value: 2 * |p_t+1| + 4 * |alr * O| + 6 * lr * wd * |p_t| in all per step, at
    # most 4 * 2^-24 * (|p_t| + |p_t+1| + |step|) as |alr * O| <= |step| + lr * wd * |p_t|. O depends
    # on the gradients only: nothing grows.
    for n in names:
        err, bound = (params[n] - ref[n]).abs(), 4 * 2.0**-24 * sizes[n]
        assert (err <= bound).all(), f"{n}: {(err / bound).max():.3g}x the rounding bound"


def test_spectral_norm_rule_is_sqrt_fan_out_over_fan_in_without_clamp():
    ones = {"wide": torch.ones(2, 8), "tall": torch.ones(8, 2), "sq": torch.ones(4, 4)}
    got = {}
    for rule in ("original", "match_rms_adamw", "spectral_norm"):
        opt = optim.scale_by_muon_lr(1.0, adjust_lr_fn=rule)
        got[rule] = {n: -u[0, 0].item() for n, u in opt.update(ones, opt.init(None))[0].items()}
    assert got["spectral_norm"] == pytest.approx({"wide": 0.5, "tall": 2.0, "sq": 1.0})
    assert got["original"] == pytest.approx({"wide": 1.0, "tall": 2.0, "sq": 1.0})  # clamped at 1
    assert got["match_rms_adamw"] == pytest.approx({"wide": 0.2 * 8**0.5, "tall": 0.2 * 8**0.5, "sq": 0.4})
    # With blocks the rule reads the block's shape: 4 column blocks of a 2 x 8 matrix are 2 x 2.
    opt = optim.scale_by_muon_lr(1.0, adjust_lr_fn="spectral_norm", blocks={"wide": (1, 4)})
    assert opt.update({"wide": torch.ones(2, 8)}, opt.init(None))[0]["wide"][0, 0].item() == pytest.approx(-1.0)


def test_owner_balancing_counts_blocks():
    flops = optim.newton_schulz_flops
    # One 24 x 8 matrix as 8 heads over 4 ranks: each rank holds 2 heads whole and keeps them
    # (no communication), not the whole matrix on one rank.
    s = optim.owner_schedule([(24, 8)], 4, flops, specs=[(8, 1)], buckets=1)
    assert s.owners == (0, 0, 1, 1, 2, 2, 3, 3) and s.kept == tuple(range(8)) and s.buckets == ()
    assert len(set(s.loads)) == 1
    whole = optim.owner_schedule([(24, 8)], 4, flops, buckets=1)
    assert whole.loads.count(0) == 3 and whole.kept == ()
    # 24 rows over 3 ranks (8 each) in heads of 3 rows: heads 2 and 5 straddle two ranks and
    # travel; the others stay where they are.
    s3 = optim.owner_schedule([(24, 8)], 3, flops, specs=[(8, 1)], buckets=1)
    assert s3.kept == (0, 1, 3, 4, 6, 7) and s3.buckets == ((2, 5),)
    # Buckets cut every owner's work in about equal parts, keeping the owners.
    s1 = optim.owner_schedule([(24, 8)] * 8, 4, flops, buckets=1)
    s2 = optim.owner_schedule([(24, 8)] * 8, 4, flops, buckets=2)
    assert s2.owners == s1.owners and len(s2.buckets) == 2
    for bucket in s2.buckets:
        assert sorted(s2.owners[j] for j in bucket) == [0, 1, 2, 3]
    # The automatic choice: one bucket for small models, up to 4 once a rank sends >= 4 MiB each.
    assert len(optim.owner_schedule([(64, 64)] * 8, 2, flops).buckets) == 1
    big = optim.owner_schedule([(1024, 1024)] * 16, 2, flops, itemsize=4)
    assert len(big.buckets) == 4


@pytest.mark.parametrize(
    "sizes, placements",
    [
        ((3,), (Shard(0),)),  # rows chunked, uneven
        ((2, 2), (Replicate(), Shard(0))),  # HSDP: replicas send by block number
        ((2, 3), (Shard(0), Shard(1))),  # dp rows x tp columns
        ((2, 2), (Shard(0), Shard(0))),  # dp rows inside tp rows
    ],
)
def test_bucket_totals_are_every_ranks_bucket_splits_summed(sizes, placements):
    # The simulator costs every rank's all-to-alls from bucket_totals; the optimizer packs with
    # bucket_splits. Both walk the same pieces, so the totals are exact sums, rank by rank.
    import itertools

    coords = [dict(enumerate(c)) for c in itertools.product(*(range(n) for n in sizes))]
    shapes = [(12, 18), (30, 6), (7, 12), (2, 6, 6)]
    specs = [(3, 1), (1, 1), (1, 1), (1, 1)]
    held = [optim.leaf_holdings(s, placements, sizes, coords) for s in shapes]
    w = len(coords)
    sched = optim.owner_schedule(shapes, w, optim.newton_schulz_flops, specs=specs, buckets=2, held=held)
    assert sched.buckets, "the case must send something"
    totals = optim.bucket_totals(sched)
    per_rank = [optim.bucket_splits(sched, q) for q in range(w)]
    assert len(totals) == len(sched.buckets)
    for k, pair in enumerate(totals):
        for way, t in enumerate(pair):
            for q in range(w):
                ins, outs = per_rank[q][k][way]
                assert (t.sent[q], t.received[q], t.kept[q], t.peers[q]) == (
                    sum(ins),
                    sum(outs),
                    ins[q],
                    sum(1 for x in ins if x),
                )
                assert outs[q] == ins[q]
            assert sum(t.sent) == sum(t.received)


# ---------------------------------------------------------------------------------------------
# Distributed: per-block parity, pipelined == unpipelined, the overlap counted
# ---------------------------------------------------------------------------------------------


def _parity(rank, world, mesh_shape, layout, buckets_list, dtypes):
    mesh = _mesh(mesh_shape)
    full = _full(0)
    names = [n for n in SHAPES if full[n].dim() >= 2 and not n.startswith("embed")]
    sharded = _shard(full, mesh)
    out = []
    for dtype in dtypes:
        ref = {n: per_block_reference(full[n], SPECS[n], dtype) for n in names}
        with FlopCounterMode(display=False) as fc:
            optim.orthogonalize([full[n] for n in names], names, dtype=dtype, blocks=[SPECS[n] for n in names])
        one_process = fc.get_total_flops()
        per_buckets = {}
        for buckets in buckets_list:
            with (
                fsdpfn.count_collectives() as counter,
                FlopCounterMode(display=False) as fc,
                optim.record_pipeline() as rec,
            ):
                got = optim.orthogonalize(
                    [sharded[n] for n in names],
                    names,
                    layout=layout,
                    dtype=dtype,
                    blocks=[SPECS[n] for n in names],
                    buckets=buckets,
                )
            fulls = {n: g.full_tensor() for n, g in zip(names, got)}
            per_buckets[buckets] = dict(
                bitwise={n: torch.equal(fulls[n], ref[n]) for n in names},
                placements=all(g.placements == sharded[n].placements for n, g in zip(names, got)),
                counts=counter.counts(),
                flops=fc.get_total_flops(),
                in_flight=[(b.bucket, b.in_flight) for b in rec.buckets],
                fulls=fulls,
            )
        same = {
            b: all(torch.equal(r["fulls"][n], per_buckets[buckets_list[0]]["fulls"][n]) for n in names)
            for b, r in per_buckets.items()
        }
        for r in per_buckets.values():
            del r["fulls"]
        out.append(dict(dtype=str(dtype), one_process=one_process, runs=per_buckets, same_as_first=same))
    return out


CASES = [
    pytest.param((2,), "owner", id="owner-w2"),
    pytest.param((3,), "owner", id="owner-w3"),
    pytest.param((4,), "owner", id="owner-w4"),
    pytest.param((2, 2), "owner", id="owner-hsdp2x2"),
    pytest.param((3,), "gather", id="gather-w3"),
    pytest.param((2, 2), "gather", id="gather-hsdp2x2"),
]


@pytest.mark.parametrize("mesh_shape,layout", CASES)
def test_blocks_equal_the_one_process_per_block_reference(run_on_ranks, mesh_shape, layout):
    world = math.prod(mesh_shape)
    shard = mesh_shape[-1]
    buckets_list = (1, 3) if layout == "owner" else (None,)
    results = run_on_ranks(_parity, world, mesh_shape, layout, buckets_list, (torch.float32, torch.bfloat16))
    for per_dtype in zip(*results):
        for r in per_dtype:
            assert all(r["same_as_first"].values()), r["same_as_first"]  # 3 buckets == 1 bucket, bitwise
            for b, run in r["runs"].items():
                # Matrix by matrix on CPU, so bitwise in fp32 too.
                assert all(run["bitwise"].values()), (r["dtype"], b, run["bitwise"])
                assert run["placements"]
                n = 1 if b is None else b
                assert run["counts"] == ({"all_to_all": 2 * n} if layout == "owner" else {"all_gather": 1}), run[
                    "counts"
                ]
        one = per_dtype[0]["one_process"]
        for b in per_dtype[0]["runs"]:
            total = sum(r["runs"][b]["flops"] for r in per_dtype) / (world // shard)  # per replicate group
            assert total == (one if layout == "owner" else shard * one), (b, total, one)


def _pipeline_record(rank, world):
    mesh = _mesh((world,))
    full = _full(0)
    names = [n for n in SHAPES if full[n].dim() >= 2 and not n.startswith("embed")]
    sharded = _shard(full, mesh)
    with optim.record_pipeline() as rec:
        optim.orthogonalize(
            [sharded[n] for n in names], names, dtype=torch.float32, blocks=[SPECS[n] for n in names], buckets=3
        )
    return [(b.bucket, b.in_flight, b.blocks > 0) for b in rec.buckets], rec.overlapped()


def test_pipeline_has_the_next_buckets_rows_and_the_last_results_in_flight_while_computing(run_on_ranks):
    results = run_on_ranks(_pipeline_record, 2)
    for buckets, overlapped in results:
        assert [(b, flying) for b, flying, _ in buckets] == [
            ("local", ("out 0/3",)),  # the 3-D leaf and the blocks held whole, under the first all-to-all
            ("0/3", ("out 1/3",)),
            ("1/3", ("out 2/3", "back 0/3")),
            ("2/3", ("back 1/3",)),
        ]
        assert buckets[0][2] and overlapped == 4
    # Every bucket orthogonalises something on some rank (a rank may own nothing in one).
    assert all(any(r[0][i][2] for r in results) for i in range(4))


def _muon_steps(rank, world, mesh_shape, buckets):
    mesh = _mesh(mesh_shape)
    ref, params = _full(0), _shard(_full(0), mesh)

    def make():
        return optim.muon(
            lr=0.05,
            weight_decay=0.1,
            adamw_lr=0.01,
            ns_dtype=torch.bfloat16,
            adjust_lr_fn="spectral_norm",
            blocks=BLOCKS,
            buckets=buckets,
        )

    opt, ref_opt = make(), make()
    state, ref_state = opt.init(params), ref_opt.init(ref)
    bitwise = True
    for step in range(2):
        g = _full(100 + step)
        updates, state = opt.update(_shard(g, mesh), state, params)
        params = optim.apply_updates(params, updates)
        ref_updates, ref_state = ref_opt.update(g, ref_state, ref)
        ref = optim.apply_updates(ref, ref_updates)
        bitwise &= all(torch.equal(params[n].full_tensor(), ref[n]) for n in SHAPES)
    return bitwise


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["w3", "hsdp2x2"])
def test_muon_with_head_blocks_and_buckets_equals_one_process_step_by_step(run_on_ranks, mesh_shape):
    assert all(run_on_ranks(_muon_steps, math.prod(mesh_shape), mesh_shape, 2))


def test_the_demo_flag_muon_blocks_heads_gives_per_head_muon():
    import importlib.util
    import pathlib
    import sys

    from fsdpfn.models import GPT, GPTConfig

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_for_test", path)
    demo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = demo  # its dataclasses look themselves up there
    spec.loader.exec_module(demo)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, width=16, depth=1, heads=2))
    params = {n: torch.zeros_like(p) for n, p in model.named_parameters()}  # no weight decay term
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    updates = {}
    for flag in ("none", "heads"):
        opt = demo.make_optimizer(demo.parse_args(["--heads", "2", "--warmup", "0", "--muon-blocks", flag]))
        updates[flag] = opt.update(grads, opt.init(params), params)[0]
    qkv = "blocks.0.qkv.weight"
    # Each of the 6 head blocks of qkv (8 x 16) is orthogonalised on its own: its singular values
    # are Newton–Schulz's (about 0.7-1.2) times lr 0.02 (ratio 1 for an 8 x 16 block).
    s = torch.linalg.svdvals(updates["heads"][qkv].view(6, 8, 16)) / 0.02
    assert ((s > 0.5) & (s < 1.5)).all(), s
    assert not torch.allclose(updates["none"][qkv], updates["heads"][qkv])
    assert torch.equal(updates["none"]["blocks.0.fc.weight"], updates["heads"]["blocks.0.fc.weight"])
