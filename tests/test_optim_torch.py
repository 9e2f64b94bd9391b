"""optim.TorchOptimizer, the torch.optim face: step by step against the functional form (one
process with torch lr schedulers; 2 gloo ranks with loss.backward() through fsdpfn.unshard,
per-head Muon and pipelined buckets), hyperparameter changes rebuild the transform, and
state_dict() saved on 2 ranks loads into 3 ranks (fsdpfn.checkpoint and plain DCP) and goes on
bitwise like the uninterrupted run."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn._rows import chunk_bounds
from fsdpfn.models import GPT, GPTConfig

SHAPES = {
    "blocks.0.fc.weight": (8, 6),
    "blocks.0.qkv.weight": (12, 6),
    "blocks.0.fc.bias": (8,),
    "embed.weight": (5, 6),
}


def _tree(seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _groups(params):
    """The recommended split: Muon's matrices in one group, the rest (AdamW inside muon) in
    another, each with its own lr for the schedulers to drive."""
    hidden = {n: p for n, p in params.items() if optim.muon_labels(n, p) == "muon"}
    rest = {n: p for n, p in params.items() if n not in hidden}
    return [{"params": hidden, "lr": 0.05}, {"params": rest, "lr": 0.01}]


def _replay(values):
    """A schedule giving the lr a scheduler set for each step (0 before the first, when built)."""
    return lambda count: values[count] if count < len(values) else 0.0


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=[0.1, 0.02], total_steps=6, cycle_momentum=False
    ),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_face_with_a_scheduler_equals_the_functional_form_step_by_step(name):
    steps = 5
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _tree(0).items()}
    kw = dict(weight_decay=0.1, ns_dtype=torch.float32, blocks={"*qkv.weight": 6}, adjust_lr_fn="spectral_norm")
    opt = optim.TorchOptimizer(_groups(params), optim.muon, **kw)
    sched = SCHEDULERS[name](opt)
    lrs = [[], []]
    # The functional form: one muon per group, its lr a schedule replaying what the scheduler set.
    ref_groups = [{n: p.detach().clone() for n, p in g["params"].items()} for g in _groups(params)]
    ref_opts = [optim.muon(lr=_replay(lrs[i]), **kw) for i in range(2)]
    ref_states = [o.init(g) for o, g in zip(ref_opts, ref_groups)]
    for step in range(steps):
        grads = _tree(100 + step)
        for n, p in params.items():
            p.grad = grads[n].clone()
        for i, g in enumerate(opt.param_groups):
            lrs[i].append(g["lr"])
        opt.step()
        sched.step()
        for i, (o, g) in enumerate(zip(ref_opts, ref_groups)):
            u, ref_states[i] = o.update({n: grads[n] for n in g}, ref_states[i], g)
            ref_groups[i] = optim.apply_updates(g, u)
        for g in ref_groups:
            for n, want in g.items():
                assert torch.equal(params[n].detach(), want), (name, step, n)
    assert len(set(lrs[0])) > 1, lrs  # the scheduler did move the learning rate


def test_changing_another_hyperparameter_rebuilds_the_transform_and_keeps_the_state():
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _tree(0).items()}
    opt = optim.TorchOptimizer(params, optim.muon, lr=0.02, momentum=0.95, ns_dtype=torch.float32)
    ref = {n: p.detach().clone() for n, p in params.items()}
    ref_opt = optim.muon(lr=0.02, momentum=0.95, ns_dtype=torch.float32)
    state = ref_opt.init(ref)
    for step in range(4):
        if step == 2:
            opt.param_groups[0]["momentum"] = 0.5
            ref_opt = optim.muon(lr=0.02, momentum=0.5, ns_dtype=torch.float32)
        grads = _tree(100 + step)
        for n, p in params.items():
            p.grad = grads[n]
        opt.step()
        u, state = ref_opt.update(grads, state, ref)
        ref = optim.apply_updates(ref, u)
    assert all(torch.equal(params[n].detach(), ref[n]) for n in ref)
    opt.param_groups[0]["momentum"] = 1.5
    with pytest.raises(ValueError, match="momentum=1.5 is invalid"):
        opt.step()


def test_errors_name_what_is_wrong():
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _tree(0).items()}
    with pytest.raises(ValueError, match="lr=-1 is invalid"):
        optim.TorchOptimizer(params, optim.muon, lr=-1)
    with pytest.raises(ValueError, match="pass its factory instead"):
        optim.TorchOptimizer(params, optim.adamw(1e-3), lr=1e-3)
    opt = optim.TorchOptimizer(params, optim.adamw, lr=1e-3)
    params["embed.weight"].grad = torch.ones(5, 6)
    with pytest.raises(ValueError, match=r"parameters \['blocks.0.fc.weight'"):
        opt.step()
    for p in params.values():
        p.grad = None
    opt.step()  # no gradients at all: skipped, as torch.optim does
    sd = opt.state_dict()
    sd["state"]["0"]["mu/embed.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"state 'mu/embed.weight' is Tensor \(3,\)"):
        opt.load_state_dict(sd)
    # A built transform runs too (no hyperparameters: nothing for a scheduler to drive).
    fixed = optim.TorchOptimizer(params, optim.sgd(0.1))
    for p in params.values():
        p.grad = torch.ones_like(p)
    before = params["embed.weight"].detach().clone()
    fixed.step()
    assert torch.equal(params["embed.weight"].detach(), before - 0.1)


# ---------------------------------------------------------------------------------------------
# Distributed: loss.backward() through unshard, against the pure loop
# ---------------------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=2, heads=2, bias=False)
KW = dict(weight_decay=0.01, ns_dtype=torch.float32, blocks=optim.head_blocks(CFG.heads), buckets=2)


def _loss(model, full, x, y):
    return F.cross_entropy(torch.func.functional_call(model, full, (x,)).flatten(0, 1), y.flatten())


def _imperative_vs_pure(rank, world, steps):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params = fsdpfn.shard(model, plan, requires_grad=True)
    opt = optim.TorchOptimizer(_groups(params), optim.muon, **KW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    lrs = [[], []]
    pure = {n: p.detach() for n, p in fsdpfn.shard(model, plan).items()}
    ref_opts = [optim.muon(lr=_replay(lrs[i]), **KW) for i in range(2)]
    ref_groups = [{n: pure[n] for n in g["params"]} for g in _groups(pure)]
    ref_states = [o.init(g) for o, g in zip(ref_opts, ref_groups)]
    gen = torch.Generator().manual_seed(5)
    same = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2 * world, CFG.seq_len + 1), generator=gen)
        x, y = tokens[2 * rank : 2 * rank + 2, :-1], tokens[2 * rank : 2 * rank + 2, 1:]
        for i, g in enumerate(opt.param_groups):
            lrs[i].append(g["lr"])
        opt.zero_grad()
        _loss(model, fsdpfn.unshard(params, plan), x, y).backward()
        opt.step()
        sched.step()
        everything = {n: p for g in ref_groups for n, p in g.items()}
        grads = torch.func.grad(lambda ps: _loss(model, fsdpfn.unshard(ps, plan), x, y))(everything)
        for i, o in enumerate(ref_opts):
            u, ref_states[i] = o.update({n: grads[n] for n in ref_groups[i]}, ref_states[i], ref_groups[i])
            ref_groups[i] = optim.apply_updates(ref_groups[i], u)
        same.append(all(torch.equal(params[n].to_local(), g[n].to_local()) for g in ref_groups for n in g))
    return same, [p.grad.placements for p in params.values()] == [p.placements for p in params.values()]


def test_imperative_loop_with_the_torch_face_equals_the_pure_loop_on_two_ranks(run_on_ranks):
    for same, placements in run_on_ranks(_imperative_vs_pure, 2, 4):
        assert same == [True] * 4
        assert placements


def _plain_grad_of_a_sharded_param(rank, world):
    mesh = testing.mesh((world,))
    p = DTensor.from_local(torch.zeros(4, 4), mesh, (Shard(0),), run_check=False).requires_grad_(True)
    opt = optim.TorchOptimizer({"w": p}, optim.muon, lr=0.1)
    p.grad = torch.ones(8, 4)  # torch accepts it: a full-size plain tensor
    with pytest.raises(ValueError, match=r"gradient of 'w' is a Tensor \(8, 4\)"):
        opt.step()
    return True


def test_a_gradient_placed_unlike_its_parameter_is_refused_on_every_rank(run_on_ranks):
    # Orthogonalising a plain gradient of a sharded parameter would treat each rank's rows as
    # the whole matrix: a wrong update, silently.
    assert run_on_ranks(_plain_grad_of_a_sharded_param, 2) == [True, True]


# ---------------------------------------------------------------------------------------------
# state_dict: saved on 2 ranks, loaded on 3 (fsdpfn.checkpoint and plain DCP)
# ---------------------------------------------------------------------------------------------


def _sharded(full, mesh):
    world, rank = mesh.size(0), mesh.get_local_rank(0)
    return {
        n: DTensor.from_local(
            t[slice(*chunk_bounds(t.shape[0], world, rank))].clone(),
            mesh,
            (Shard(0),),
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
        for n, t in full.items()
    }


def _make(mesh, params_full):
    params = {n: p.requires_grad_(True) for n, p in _sharded(params_full, mesh).items()}
    # SHAPES has a qkv but no output projection: head_blocks' '*proj.weight' would match nothing
    # (refused), so only the qkv entry, which is all that applied.
    opt = optim.TorchOptimizer(_groups(params), optim.muon, **{**KW, "blocks": {"*qkv.weight": 3 * CFG.heads}})
    return params, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)


def _run(params, opt, sched, mesh, steps):
    for step in steps:
        for n, g in _sharded(_tree(100 + step), mesh).items():
            params[n].grad = g
        opt.step()
        sched.step()


def _full_state(opt):
    return {
        "state": {
            g: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in s.items()}
            for g, s in opt.state_dict()["state"].items()
        },
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _save_then_go_on(rank, world, root):
    from fsdpfn import checkpoint

    mesh = testing.mesh((world,))
    params, opt, sched = _make(mesh, _tree(0))
    _run(params, opt, sched, mesh, range(2))
    checkpoint.save(
        root + "/fsdpfn", {"optim": opt.state_dict(), "sched": sched.state_dict(), "params": params, "step": 2}
    )
    torch.distributed.checkpoint.save(
        {"optim": opt.state_dict(), "sched": sched.state_dict()}, checkpoint_id=root + "/dcp"
    )
    saved = _full_state(opt)
    _run(params, opt, sched, mesh, range(2, 4))
    return saved, {n: p.detach().full_tensor() for n, p in params.items()}


def _load_then_go_on(rank, world, root, how):
    from fsdpfn import checkpoint

    mesh = testing.mesh((world,))
    params, opt, sched = _make(mesh, {n: torch.zeros(s) for n, s in SHAPES.items()})
    if how == "fsdpfn":
        loaded = checkpoint.load(
            root + "/fsdpfn", {"optim": opt.state_dict(), "sched": sched.state_dict(), "params": params, "step": 0}
        )
        with torch.no_grad():
            for n, p in params.items():
                p.to_local().copy_(loaded["params"][n].to_local())
        opt.load_state_dict(loaded["optim"])
        sched.load_state_dict(loaded["sched"])
    else:
        sd = {"optim": opt.state_dict(), "sched": sched.state_dict()}
        torch.distributed.checkpoint.load(sd, checkpoint_id=root + "/dcp")
        opt.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])
        loaded_params = checkpoint.load(root + "/fsdpfn", {"params": params})["params"]
        with torch.no_grad():
            for n, p in params.items():
                p.to_local().copy_(loaded_params[n].to_local())
    got = _full_state(opt)
    _run(params, opt, sched, mesh, range(2, 4))
    return (
        got,
        {n: p.detach().full_tensor() for n, p in params.items()},
        [p.to_local().shape[0] for p in params.values()],
    )


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_state_dict_saved_on_two_ranks_loads_on_three_and_goes_on_bitwise(run_on_ranks, tmp_path):
    root = str(tmp_path)
    saved, straight = run_on_ranks(_save_then_go_on, 2, root)[0]
    for how in ("fsdpfn", "dcp"):
        got, resumed, rows = run_on_ranks(_load_then_go_on, 3, root, how)[0]
        assert rows == [3, 4, 3, 2]  # really resharded: 8, 12, 8, 5 rows over 3 ranks
        assert _equal(got, saved), how
        for n in straight:
            assert torch.equal(resumed[n], straight[n]), (how, n)
