"""Activation checkpointing (``fsdpfn.plan(..., remat=...)``) in the runtime and the pure loop: a
unit keeps only its inputs (and, under a selective policy, the results it names) in forward and
recomputes the rest in backward on the parameters the schedule gathers for backward. Same
arithmetic in the same order, so results are bitwise those of the run without it; random ops
replay; the recompute adds no gather; saved activations shrink; kept results are not recomputed
(their FLOPs are counted)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import Runtime

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=3, heads=4)
PER_RANK = 2


class DropoutMLP(nn.Module):
    """Blocks with dropout, so a recompute must replay the same random mask."""

    def __init__(self, width=16, depth=2):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.3), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def _data(step, world, model_kind):
    gen = torch.Generator().manual_seed(100 + step)
    if model_kind == "gpt":
        tokens = torch.randint(0, CFG.vocab_size, (world * PER_RANK, CFG.seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(world * PER_RANK, 5, 8, generator=gen), torch.randint(0, 3, (world * PER_RANK, 5), generator=gen)


def _train(rank, world, strategy, style, remat, model_kind, steps=5):
    torch.manual_seed(0)
    model = GPT(CFG) if model_kind == "gpt" else DropoutMLP()
    model.train()
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy, remat=remat)
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    gathers, recomputed = [], []
    torch.manual_seed(1234 + rank)  # dropout masks: the same stream with and without remat
    for step in range(steps):
        x, y = _data(step, world, model_kind)
        with fsdpfn.comm.count_collectives() as counter:
            if style == "func":
                g, _ = rt.value_and_grad(
                    lambda ps: F.cross_entropy(rt.apply(ps, x[mine]).flatten(0, 1), y[mine].flatten())
                )(params)
            else:
                with rt.bind(params):
                    F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
                g = rt.grads(params)
        gathers.append(counter.counts().get("all_gather", 0))
        recomputed.append(list(rt.last_step.recomputed))
        with torch.no_grad():
            params = {n: (p - 0.2 * g[n]).detach().requires_grad_(style == "eager") for n, p in params.items()}
    return {n: p._local_tensor for n, p in params.items()}, gathers, recomputed


POLICIES = ["full", "save_dots", "save_names:attention,mlp_up"]


@functools.cache
def _plain(strategy, style, model_kind):
    return testing.run_on_ranks(_train, 2, strategy, style, None, model_kind)


def _check_same_run(plain, remat, strategy, model_kind):
    units = [f"blocks.{i}" for i in reversed(range(CFG.depth if model_kind == "gpt" else 2))]
    for (p0, g0, r0), (p1, g1, r1) in zip(plain, remat):
        assert all(torch.equal(p0[n], p1[n]) for n in p0)
        assert g1 == g0  # the recompute reuses the backward gather: not one all-gather more
        if strategy == "zero3":  # reshard after forward: each block gathered once in forward, once in backward
            assert g1 == [2 * len(units) + 1] * len(g1), g1
        assert all(r == [] for r in r0) and all(r == units for r in r1), r1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("style", ["func", "eager"])
@pytest.mark.parametrize("strategy", ["replicate", "zero1", "zero2", "zero3"])
def test_remat_is_bitwise_the_run_without_it(run_on_ranks, strategy, style, policy):
    remat = run_on_ranks(_train, 2, strategy, style, policy, "gpt")
    _check_same_run(_plain(strategy, style, "gpt"), remat, strategy, "gpt")


@pytest.mark.parametrize("policy", ["full", "save_dots"])
@pytest.mark.parametrize("style", ["func", "eager"])
def test_remat_replays_dropout(run_on_ranks, style, policy):
    remat = run_on_ranks(_train, 2, "zero3", style, policy, "dropout")
    _check_same_run(_plain("zero3", style, "dropout"), remat, "zero3", "dropout")


def test_remat_policy_per_unit_and_refused_on_the_root():
    plan = fsdpfn.plan(GPT(CFG), (2,), remat={"blocks.[02]": "full"})
    assert [u.remat for u in plan.units] == ["none", "full", "none", "full"]
    assert fsdpfn.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="remat pattern 'layers.*' matches no unit"):
        fsdpfn.plan(GPT(CFG), (2,), remat={"layers.*": "full"})
    plan = fsdpfn.plan(GPT(CFG), (2,), remat={"blocks.0": "save_dots", "blocks.1": "save_names:attention"})
    assert [u.remat for u in plan.units][1:3] == ["save_dots", "save_names:attention"]
    assert fsdpfn.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="names no tensor"):
        fsdpfn.plan(GPT(CFG), (2,), remat="save_names:")
    with pytest.raises(ValueError, match="unknown remat policy 'some'"):
        fsdpfn.plan(GPT(CFG), (2,), remat="some")
    with pytest.raises(ValueError, match="root unit cannot be rematerialised"):
        fsdpfn.plan(GPT(CFG), (2,), remat={"<root>": "full"})


def _saved_bytes(rank, world, remat):
    """Bytes held for backward after one forward (eager style): what autograd saves, counted
    with saved-tensor hooks, each storage once, plus what rematerialised units keep (their
    inputs and kept results, reported by the runtime)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=29, seq_len=64, width=32, depth=4, heads=4)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((world,)), remat=remat)
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=True)
    x = torch.randint(0, 29, (2, 64))
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t

    with rt.bind(params), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    kept = dict(rt.last_step.kept_bytes)
    loss.backward()
    return total[0], kept, cfg


def test_remat_keeps_only_unit_inputs_and_what_the_policy_names(run_on_ranks):
    """Without remat every block's activations stay saved until backward; with full remat, a
    block keeps one input (its residual stream) and the rest saved is the root's (embedding,
    final norm, head): at least 3x less on this model. save_dots keeps exactly the matmul and
    attention outputs on top."""
    (plain, none_kept, cfg), _ = run_on_ranks(_saved_bytes, 2, None)
    (root, full_kept, _), _ = run_on_ranks(_saved_bytes, 2, "full")
    tokens, width, heads = 2 * cfg.seq_len, cfg.width, cfg.heads
    unit_input = tokens * width * 4  # one (batch, seq, width) fp32 activation
    assert none_kept == {} and full_kept == {f"blocks.{i}": unit_input for i in range(cfg.depth)}
    assert plain / (root + sum(full_kept.values())) >= 3, (plain, root, full_kept)
    # qkv (3 widths), attention output (1) and logsumexp (one per head), proj (1), fc (4), out (1)
    (root_dots, dots_kept, _), _ = run_on_ranks(_saved_bytes, 2, "save_dots")
    assert root_dots == root
    assert dots_kept == {f"blocks.{i}": unit_input + tokens * (10 * width + heads) * 4 for i in range(cfg.depth)}
    assert plain > root + sum(dots_kept.values())


def _pure(rank, world, remat, style, model_kind, steps=3):
    """The pure loop (``functional_call`` over ``fsdpfn.unshard``), ``torch.func.grad`` or
    ``loss.backward()``, with the unit forwards wrapped by ``fsdpfn.shard``."""
    torch.manual_seed(0)
    model = GPT(CFG) if model_kind == "gpt" else DropoutMLP()
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3", remat=remat)
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.manual_seed(99 + rank)
    for step in range(steps):
        x, y = _data(step, world, model_kind)

        def loss_fn(ps):
            out = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x[mine],))
            return F.cross_entropy(out.flatten(0, 1), y[mine].flatten())

        if style == "func":
            g = torch.func.grad(loss_fn)(params)
        else:
            loss_fn(params).backward()
            g = {n: p.grad for n, p in params.items()}
        with torch.no_grad():
            params = {n: (p - 0.2 * g[n]).detach().requires_grad_(style == "eager") for n, p in params.items()}
    return {n: p._local_tensor for n, p in params.items()}


@pytest.mark.parametrize("style", ["func", "eager"])
@pytest.mark.parametrize(
    "model_kind, policy", [("gpt", p) for p in POLICIES] + [("dropout", "full"), ("dropout", "save_dots")]
)
def test_remat_in_the_pure_loop_is_bitwise_the_run_without_it(run_on_ranks, style, model_kind, policy):
    plain = run_on_ranks(_pure, 2, None, style, model_kind)
    remat = run_on_ranks(_pure, 2, policy, style, model_kind)
    for p0, p1 in zip(plain, remat):
        assert all(torch.equal(p0[n], p1[n]) for n in p0), [n for n in p0 if not torch.equal(p0[n], p1[n])]


def test_the_remat_wrapper_really_recomputes():
    """A counter inside a unit's forward: one call per forward without remat, two (forward and
    recompute) with it, in one process."""
    calls = []
    torch.manual_seed(0)
    model = DropoutMLP()
    model.blocks[0][0].register_forward_hook(lambda *a: calls.append(1))
    x, y = _data(0, 1, "dropout")
    for remat, expected in ((None, 1), ("full", 2)):
        calls.clear()
        plan = fsdpfn.plan(model, (1,), remat=remat)
        fsdpfn.transforms.apply_remat(model, plan)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.func.grad(
            lambda ps: F.cross_entropy(torch.func.functional_call(model, ps, (x,)).flatten(0, 1), y.flatten())
        )(params)
        assert len(calls) == expected, (remat, calls)


def _recompute_flops(rank, world, remat):
    """The runtime's counts of one step, and the simulator's profile of the same micro-batch."""
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)), remat=remat)
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=True)
    x, y = _data(0, world, "gpt")
    with rt.bind(params):
        F.cross_entropy(model(x[:PER_RANK]).flatten(0, 1), y[:PER_RANK].flatten()).backward()
    wl = fsdpfn.sim.profile(
        model, plan, x[:PER_RANK], loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), y[:PER_RANK].flatten())
    )
    predicted = (
        {u: wl.recompute(u).flops for u in rt.last_step.recompute_flops},
        {u: wl.activation(u) for u in rt.last_step.kept_bytes},
    )
    return dict(rt.last_step.recompute_flops), dict(rt.last_step.kept_bytes), predicted


@pytest.mark.parametrize("policy", POLICIES)
def test_kept_results_are_not_recomputed(run_on_ranks, policy):
    """The recompute's matmul FLOPs, counted by the runtime, against a block's by hand:
    full recomputes all, save_dots none, save_names:attention,mlp_up all but attention and fc."""
    t, c, h = PER_RANK * CFG.seq_len, CFG.width, CFG.heads
    mm = {"qkv": 2 * t * c * 3 * c, "proj": 2 * t * c * c, "fc": 2 * t * c * 4 * c, "out": 2 * t * 4 * c * c}
    attention = 4 * PER_RANK * h * CFG.seq_len * CFG.seq_len * (c // h) * 0.5  # causal: half the blocks
    expected = {
        "full": sum(mm.values()) + attention,
        "save_dots": 0.0,
        "save_names:attention,mlp_up": mm["qkv"] + mm["proj"] + mm["out"],
    }[policy]
    got, kept, (sim_flops, sim_kept) = run_on_ranks(_recompute_flops, 2, policy)[0]
    assert got == {f"blocks.{i}": expected for i in range(CFG.depth)}, (got, expected)
    # The simulator costs the plan's policy from its profile: the same FLOPs and kept bytes.
    assert sim_flops == got and sim_kept == kept, (sim_flops, sim_kept, kept)


class _Branchy(nn.Module):
    """A block whose forward depends on how often it ran: a recompute takes the other branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.fc(x)
        return self.fc(h) if self.calls % 2 else h * 2


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).mul_(2)


@pytest.mark.parametrize("style", ["func", "eager"])
def test_a_selective_recompute_that_diverges_is_refused(style):
    """A kept result is handed back only where the recompute calls the same operator on the
    same shapes; a block that does otherwise, or modifies a kept result in place, gets a named
    error, not a wrong gradient."""
    for block, match in ((_Branchy(), "did not call|arguments shaped"), (_InPlace(), "modified in place")):
        model = nn.Sequential(nn.ModuleList([block]))
        model.forward = lambda x, m=model: m[0][0](x)
        plan = fsdpfn.plan(model, (1,), remat="save_dots")
        fsdpfn.transforms.apply_remat(model, plan)
        params = {n: p.detach().clone().requires_grad_(style == "eager") for n, p in model.named_parameters()}
        x = torch.randn(3, 4)

        def loss(ps):
            return torch.func.functional_call(model, ps, (x,)).sum()

        with pytest.raises(fsdpfn.RematReplayError, match=match):
            torch.func.grad(loss)(params) if style == "func" else loss(params).backward()


def test_register_remat_policy():
    aten = torch.ops.aten
    fsdpfn.register_remat_policy("test_keep_addmm", lambda op: op is aten.addmm.default)
    plan = fsdpfn.plan(GPT(CFG), (2,), remat="test_keep_addmm")
    assert {u.remat for u in plan.units if u.name} == {"test_keep_addmm"}
    with pytest.raises(ValueError, match="cannot name a policy"):
        fsdpfn.register_remat_policy("full", lambda op: True)
    with pytest.raises(TypeError, match="must be callable"):
        fsdpfn.register_remat_policy("x", 3)


def _tp_remat_runtime(rank, world, remat):
    from fsdpfn.models import GPT_TP_PLAN

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, width=32, depth=2, heads=4))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = fsdpfn.plan(model, mesh, tp=GPT_TP_PLAN, remat={"blocks.*": remat})
    params = fsdpfn.shard(model, plan, requires_grad=True)
    rt = Runtime(model, plan)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with rt.bind(params):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    return {n: p.grad.to_local().clone() for n, p in params.items()}


def test_tp_with_full_remat_on_the_runtime_replays_its_collectives(run_on_ranks):
    """The recompute replays the tp all-reduces; the replay check used to fingerprint their
    outputs while the async gloo work was still writing them and raised on one rank. The
    gradients are the ones without remat, bit for bit (the same operators in the same order)."""
    full = run_on_ranks(_tp_remat_runtime, 2, "full")
    none = run_on_ranks(_tp_remat_runtime, 2, "none")
    for got, want in zip(full, none):
        assert all(torch.equal(got[n], want[n]) for n in want)
