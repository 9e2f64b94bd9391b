"""Distributed optimizers against one process, step by step: Muon's "gather" and "owner"
Newton–Schulz layouts on 2, 3 and 4 ranks and on an HSDP mesh, with uneven and empty shards and
3-D leaves, bitwise in bf16 and fp32; the global norm across shards; and a small transformer
trained with muon under zero3.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.models import GPT, GPTConfig
from fsdpfn._rows import chunk_bounds

# Row counts chosen for uneven and empty shards on 2, 3 and 4 ranks (5 over 4 -> 2, 2, 1, 0;
# 3 over 4 -> 1, 1, 1, 0), tall and wide matrices, two of one shape (batched by the owner),
# a 3-D leaf (experts), and leaves Muon must leave to AdamW.
SHAPES = {
    "blocks.0.a.weight": (5, 7),
    "blocks.0.b.weight": (3, 10),
    "blocks.0.tall.weight": (12, 6),
    "blocks.0.wide1.weight": (6, 9),
    "blocks.0.wide2.weight": (6, 9),
    "blocks.0.experts": (5, 4, 6),
    "blocks.0.a.bias": (5,),
    "embed.weight": (11, 6),
    "scale": (),
}
STEPS = 3


def _full(seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _placements(mesh, ndim):
    inner = Shard(0) if ndim else Replicate()
    return (Replicate(), inner) if mesh.ndim == 2 else (inner,)


def _shard(full, mesh):
    world, rank = mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1)
    out = {}
    for n, t in full.items():
        local = t[slice(*chunk_bounds(t.shape[0], world, rank))] if t.dim() else t
        out[n] = DTensor.from_local(
            local.clone(), mesh, _placements(mesh, t.dim()), run_check=False, shape=t.shape, stride=t.stride()
        )
    return out


def _mesh(mesh_shape):
    return testing.mesh(mesh_shape, ("replicate", "shard") if len(mesh_shape) == 2 else None)


def _muon_parity(rank, world, layout, mesh_shape, ns_dtype, ns_method="standard"):
    mesh = _mesh(mesh_shape)

    def make():
        return optim.muon(
            lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype, layout=layout, adamw_lr=0.01, ns_method=ns_method
        )

    opt, ref_opt = make(), make()
    ref = _full(0)
    params = _shard(ref, mesh)
    state, ref_state = opt.init(params), ref_opt.init(ref)
    worst, bitwise, counts, flops, ref_flops = [], True, [], 0, 0
    for step in range(STEPS):
        grads_full = _full(100 + step)
        grads = _shard(grads_full, mesh)
        with fsdpfn.count_collectives() as counter, FlopCounterMode(display=False) as fc:
            updates, state = opt.update(grads, state, params)
        flops += fc.get_total_flops()
        counts.append(counter.counts())
        params = optim.apply_updates(params, updates)
        with FlopCounterMode(display=False) as fc:
            ref_updates, ref_state = ref_opt.update(grads_full, ref_state, ref)
        ref_flops += fc.get_total_flops()
        ref = optim.apply_updates(ref, ref_updates)
        for n in SHAPES:
            got = params[n].full_tensor()
            bitwise &= torch.equal(got, ref[n])
            worst.append(((got - ref[n]).norm() / ref[n].norm()).item())
    # Momentum is sharded like the parameters, never replicated.
    buf = {n: b for n, b in state.inner_states["muon"][0].momentum_buffer.items() if b is not None}
    assert sorted(buf) == sorted(n for n in SHAPES if optim.muon_labels(n, ref[n]) == "muon")
    adam = state.inner_states["adamw"]
    moments = [(n, b) for n, b in buf.items()] + [
        (n, m) for tree in (adam.mu, adam.nu) for n, m in tree.items() if m is not None
    ]
    assert len(moments) == len(SHAPES) + sum(1 for n in SHAPES if n not in buf)
    for n, b in moments:
        assert b.placements == params[n].placements, n
        assert b.to_local().shape == params[n].to_local().shape, n
    return dict(worst=max(worst), bitwise=bitwise, counts=counts, flops=flops, ref_flops=ref_flops)


CASES = [
    pytest.param("gather", (2,), id="gather-w2"),
    pytest.param("gather", (3,), id="gather-w3"),
    pytest.param("gather", (4,), id="gather-w4"),
    pytest.param("owner", (2,), id="owner-w2"),
    pytest.param("owner", (3,), id="owner-w3"),
    pytest.param("owner", (4,), id="owner-w4"),
    pytest.param("gather", (2, 2), id="gather-hsdp2x2"),
    pytest.param("owner", (2, 2), id="owner-hsdp2x2"),
]


@pytest.mark.parametrize("layout,mesh_shape", CASES)
def test_distributed_muon_equals_one_process_bf16(run_on_ranks, layout, mesh_shape):
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    results = run_on_ranks(_muon_parity, world, layout, mesh_shape, torch.bfloat16)
    shard_size = mesh_shape[-1]
    for r in results:
        # Same operations on the same bits (bf16 batched == per matrix on CPU): bitwise.
        assert r["bitwise"], r["worst"]
        kind = "all_to_all" if layout == "owner" else "all_gather"
        assert all(c == {kind: 2 if layout == "owner" else 1} for c in r["counts"]), r["counts"]
    one_process = results[0]["ref_flops"]
    total = sum(r["flops"] for r in results) / (world // shard_size)  # per replicate group
    assert total == (one_process if layout == "owner" else shard_size * one_process)


@pytest.mark.parametrize("layout,mesh_shape", [CASES[2], CASES[4], CASES[7]])
def test_distributed_muon_equals_one_process_fp32(run_on_ranks, layout, mesh_shape):
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    for r in run_on_ranks(_muon_parity, world, layout, mesh_shape, torch.float32):
        # A batch runs matrix by matrix on CPU (fsdpfn/optim/_newton_schulz.py, [Note: batches
        # on CPU]), so fp32 is bitwise too.
        assert r["bitwise"] and r["worst"] == 0.0, r["worst"]


@pytest.mark.parametrize("layout,mesh_shape", [CASES[0], CASES[4], CASES[5], CASES[7]])
def test_distributed_gram_muon_equals_one_process_gram_muon(run_on_ranks, layout, mesh_shape):
    # "gram" runs on the (3, 10) and tall (12, 6) matrices here, standard on the near-square ones.
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    shard_size = mesh_shape[-1]
    for dtype in (torch.bfloat16, torch.float32):
        results = run_on_ranks(_muon_parity, world, layout, mesh_shape, dtype, "gram")
        for r in results:
            assert r["bitwise"], (dtype, r["worst"])
        total = sum(r["flops"] for r in results) / (world // shard_size)
        assert total == (results[0]["ref_flops"] if layout == "owner" else shard_size * results[0]["ref_flops"])


def _norm_parity(rank, world, mesh_shape):
    mesh = _mesh(mesh_shape)
    full = _full(7)
    want = torch.sqrt(sum(t.double().square().sum() for t in full.values())).item()
    got = optim.global_norm(_shard(full, mesh)).item()
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(_shard(full, mesh), clip.init(None))
    after = optim.global_norm(clipped).item()
    return got, want, after


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["w3", "hsdp2x2"])
def test_global_norm_spans_shards_and_ranks(run_on_ranks, mesh_shape):
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    # got: a float32 sum of N squares (each rank's, then the all-reduce adds world partial sums);
    # positive terms do not cancel, so it is within (N + world) * 2^-24 of the float64 sum,
    # relatively; the square root halves that and rounds once. after: the norm of the clipped
    # leaves, exactly norm / (norm + 1e-6); the coefficient comes from the computed norm (that
    # error again), rounds twice (+, /), each leaf once (*), and the norm is taken again.
    u, n = 2.0**-24, sum(math.prod(s) for s in SHAPES.values())
    for got, want, after in run_on_ranks(_norm_parity, world, mesh_shape):
        assert got == pytest.approx(want, rel=(n + world + 2) * u / 2, abs=0)
        exact = want / (want + 1e-6)
        assert after == pytest.approx(exact, rel=(n + world + 2) * u + 3 * u, abs=0)


def _bad_placement(rank, world):
    from torch.distributed.tensor import Partial

    mesh = _mesh((world,))
    x = DTensor.from_local(torch.randn(4, 3), mesh, (Partial(),), run_check=False)
    opt = optim.scale_by_muon()
    with pytest.raises(NotImplementedError, match="'w'.*Partial"):
        opt.update({"w": x}, opt.init({"w": x}))
    # Columns split over the mesh (Shard(1)) are read as boxes like rows: the one-process bits.
    full = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    cols = DTensor.from_local(
        full[:, slice(*chunk_bounds(7, world, rank))].clone(),
        mesh,
        (Shard(1),),
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
    got = optim.orthogonalize([cols], ["w"], dtype=torch.float32)[0]
    return got.placements == (Shard(1),) and torch.equal(
        got.full_tensor(), optim.newton_schulz(full, dtype=torch.float32)
    )


def test_unsupported_placement_names_the_leaf(run_on_ranks):
    assert run_on_ranks(_bad_placement, 2) == [True, True]


# No biases: the key part of a qkv bias has an exactly-zero true gradient (softmax ignores a shift
# shared by all keys), so Adam would turn two runs' different rounding noise there into full
# lr-sized steps of random sign, which no rounding bound covers.
CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=2, heads=2, bias=False)


def _train(rank, world, steps):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params = fsdpfn.shard(model, plan)
    opt = optim.muon(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_dtype=torch.float32)
    state = opt.init(params)
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_state = opt.init(ref_params)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab_size, (2 * world, CFG.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    mine = slice(2 * rank, 2 * rank + 2)

    def loss(m, ps, xb, yb):
        return F.cross_entropy(torch.func.functional_call(m, ps, (xb,)).flatten(0, 1), yb.flatten())

    losses, ref_losses, sensitivity, moved = [], [], 0.0, {n: 0.0 for n in ref_params}
    for _ in range(steps):
        grads, value = torch.func.grad_and_value(lambda ps: loss(model, fsdpfn.unshard(ps, plan), x[mine], y[mine]))(
            params
        )
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        full_loss = torch.tensor([value.item()])
        torch.distributed.all_reduce(full_loss)
        losses.append(full_loss.item() / world)
        ref_grads, ref_value = torch.func.grad_and_value(lambda ps: loss(reference, ps, x, y))(ref_params)
        # How much the loss moves, relatively, when every parameter moves by a relative d: at most
        # d * sum_p |grad_p| |p| / loss (first order), at the parameters the loss was taken at.
        sensitivity = max(
            sensitivity,
            sum(ref_grads[n].norm().item() * p.norm().item() for n, p in ref_params.items()) / ref_value.item(),
        )
        ref_updates, ref_state = opt.update(ref_grads, ref_state, ref_params)
        ref_params = optim.apply_updates(ref_params, ref_updates)
        moved = {n: max(moved[n], ref_updates[n].norm().item()) for n in ref_params}
        ref_losses.append(ref_value.item())
    drift = {n: ((params[n].full_tensor() - p).norm() / p.norm()).item() for n, p in ref_params.items()}
    steps_vs_size = max(moved[n] / p.norm().item() for n, p in ref_params.items())
    return losses, ref_losses, drift, sensitivity, steps_vs_size


def test_muon_trains_a_small_transformer_under_zero3(run_on_ranks):
    world, steps = 2, 8
    losses, ref_losses, drift, sensitivity, steps_vs_size = run_on_ranks(_train, world, steps)[0]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.85 * losses[0], losses
    # Against one process: the same float32 arithmetic in another order. Each gradient entry sums
    # the batch's n = 2 * world * seq_len token terms in another order: 2n * 2^-24 of the gradient
    # when they do not cancel. Muon orthogonalises the momentum with the same bits on both sides
    # for the same input (test_distributed_muon_equals_one_process_fp32) and AdamW divides the
    # first moment by the root of the second: a relative error d of the gradient becomes at most
    # 2d of the update (first order). Every step's update is below the final parameters' size and
    # the steps add: drift <= steps * 2 * 2n * 2^-24 = 6.1e-5. The updates are in fact 0.034 of
    # the parameters: that leaves a factor of 30 for Muon's orthogonalisation, which can amplify
    # a relative error of its input. Measured with default, AVX2 and AVX512 kernels: 5.4e-7.
    assert steps_vs_size < 1.0, steps_vs_size
    n = 2 * world * CFG.seq_len
    drift_bound = steps * 2 * 2 * n * 2.0**-24
    assert max(drift.values()) < drift_bound, (drift, drift_bound)
    # The losses: a mean of n token losses in another order (2n * 2^-24), at parameters that differ
    # by the drift at most, which moves the loss by drift * sensitivity (see _train; 2.6 here).
    # Measured: 1.6e-7.
    assert losses == pytest.approx(ref_losses, rel=2 * n * 2.0**-24 + drift_bound * sensitivity, abs=0)
