"""Guards on the mesh and on expert parallelism: what a plan refuses by name, on every rank and
before any collective, because running it would give wrong gradients or an error that names
nothing (2 gloo ranks):

- a layer whose expert weights are split over ``ep`` but that never dispatches its tokens over
  ``ep`` (no ``set_ep_group``): each rank ran its half of the experts as if they were all of them
  (gradients 50-110% off one process, no error);
- a router (an ``nn.Linear``) listed as an expert weight: a shape error deep in the forward;
- a 1-D mesh named ``"ep"``: plain sharding, the expert settings ignored without a word;
- a mesh smaller than the world (``init_device_mesh("cpu", (1,))`` on 2 ranks): ``IndexError``
  on rank 1 while rank 0 trained alone on its half of the data.

And the other side of the first guard: a user's own layer that dispatches over ``ep`` (the one
docs/tour/experts.md builds) trains like one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn import comm as C
from fsdpfn import testing
from fsdpfn.models import Experts, MoE, MoEConfig
from _refusals import refusals

W, H, E = 8, 12, 4


class DenseMoE(nn.Module):
    """A mixture of experts that runs every expert it is given on every token, and has no
    ``set_ep_group``: under ep it would mix this rank's experts with the router's global ids."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(W, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, W) * W**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, W, H) * H**-0.5)

    def forward(self, x):
        probs = F.softmax(self.router(x), -1)
        y = 0
        for e in range(self.w1.shape[0]):
            y = y + probs[:, e : e + 1] * (F.gelu(x @ self.w1[e].T) @ self.w2[e].T)
        return y


class Top1MoE(DenseMoE):
    """The same weights, top-1 routed, with tokens dispatched over the ep group (the layer
    docs/tour/experts.md writes): each rank holds experts ``[r E/ep, (r+1) E/ep)``."""

    def __init__(self):
        super().__init__()
        self.set_ep_group(None)

    def set_ep_group(self, group):
        self.group = group
        self.ep = C.group_size(group) if group is not None else 1
        self.local = E // self.ep

    def forward(self, x):
        probs = F.softmax(self.router(x), -1)
        weight, expert = probs.max(-1)
        order = torch.sort(expert, stable=True).indices
        per_expert = torch.bincount(expert, minlength=E).tolist()
        send = [sum(per_expert[r * self.local : (r + 1) * self.local]) for r in range(self.ep)]
        got = C.ep_counts(per_expert, self.group) if self.ep > 1 else per_expert
        recv = [sum(got[s * self.local : (s + 1) * self.local]) for s in range(self.ep)]
        rows = x[order]
        inbox = C.ep_all_to_all(rows, send, recv, self.group) if self.ep > 1 else rows
        outs, start = [], 0
        for s in range(self.ep):  # rows arrive by source rank, then by local expert
            for e in range(self.local):
                n = got[s * self.local + e]
                h = inbox[start : start + n]
                outs.append(F.gelu(h @ self.w1[e].T) @ self.w2[e].T)
                start += n
        outbox = torch.cat(outs)
        back = C.ep_all_to_all(outbox, recv, send, self.group) if self.ep > 1 else outbox
        y = torch.zeros_like(x).index_copy(0, order, back)
        return y * weight.unsqueeze(-1)


class BareExperts(nn.Module):
    """fsdpfn's packed experts without the MoE layer that routes and dispatches to them."""

    def __init__(self):
        super().__init__()
        self.experts = Experts(E, W, H)

    def forward(self, x):
        return self.experts(x, [[x.shape[0]] + [0] * (E - 1)])


def fsdpfn_moe():
    return MoE(MoEConfig(width=W, hidden=H, experts=E, top_k=2))


class Block(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.moe = layer()

    def forward(self, h):
        out = self.moe(self.norm(h))
        return h + (out[0] if isinstance(out, tuple) else out)


class Net(nn.Module):
    def __init__(self, layer=DenseMoE):
        super().__init__()
        self.blocks = nn.ModuleList([Block(layer) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return (x**2).mean()


def _net(layer):
    torch.manual_seed(0)
    return Net(layer)


def _tokens(r):
    return torch.randn(16, W, generator=torch.Generator().manual_seed(r))


# ---- refused by name, on every rank, before any collective -----------------------------------


def _refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    ep = testing.mesh((2, 1), ("ep", "edp"))
    small = init_device_mesh("cpu", (1,))  # rank 1 is not in it
    cases = {
        "no_dispatch": lambda: fsdpfn.plan(_net(DenseMoE), ep, experts=["blocks.*.moe.w1", "blocks.*.moe.w2"]),
        "no_dispatch_default": lambda: fsdpfn.plan(_net(BareExperts), ep),
        "router": lambda: fsdpfn.plan(
            _net(fsdpfn_moe), ep, experts=["blocks.*.moe.router.weight", "blocks.*.moe.experts.w*"]
        ),
        "router_star": lambda: fsdpfn.plan(_net(fsdpfn_moe), ep, experts=["blocks.*.moe.*"]),
        "one_d_ep": lambda: fsdpfn.plan(_net(fsdpfn_moe), testing.mesh((2,), ("ep",))),
        "one_d_ep_shape": lambda: fsdpfn.plan(_net(fsdpfn_moe), {"ep": 2}),
        "small_mesh": lambda: fsdpfn.plan(_net(fsdpfn_moe), small),
        "small_mesh_bind": lambda: fsdpfn.plan(_net(fsdpfn_moe), (1,)).bind(small),
        "dispatching": lambda: fsdpfn.plan(_net(Top1MoE), ep, experts=["blocks.*.moe.w1", "blocks.*.moe.w2"]),
    }
    return refusals(cases)


def test_bad_meshes_and_expert_layers_are_named_on_every_rank_before_any_collective(run_on_ranks):
    for out in run_on_ranks(_refusals, 2):
        assert out["collectives"] == 0, out
        # A layer that never dispatches: named, with what it must implement and where to read.
        msg = out["no_dispatch"]
        assert msg.startswith("ValueError") and "'blocks.0.moe.w1'" in msg and "'blocks.0.moe' (DenseMoE)" in msg, msg
        assert "set_ep_group" in msg and "docs/tour/experts.md" in msg, msg
        msg = out["no_dispatch_default"]
        assert "'blocks.0.moe.experts.w1'" in msg and "set_ep_group" in msg, msg
        # The router is one matrix every token goes through, not a packed expert weight.
        for key in ("router", "router_star"):
            msg = out[key]
            assert msg.startswith("ValueError") and "'blocks.0.moe.router.weight'" in msg and "nn.Linear" in msg, msg
            assert "router" in msg and "packed" in msg, msg
        # A 1-D mesh named "ep": told to add the expert data-parallel axis.
        for key in ("one_d_ep", "one_d_ep_shape"):
            msg = out[key]
            assert (
                msg.startswith("ValueError") and "1-D mesh named 'ep'" in msg and "mesh_dim_names=('ep', 'edp')" in msg
            ), msg
        # A mesh smaller than the world: refused on both ranks (rank 0 is in it, rank 1 is not).
        for key in ("small_mesh", "small_mesh_bind"):
            msg = out[key]
            assert msg.startswith("ValueError") and "1 rank" in msg and "world size 2" in msg, msg
            assert "init_device_mesh('cpu', (2,))" in msg, msg
        assert out["dispatching"] == "no error", out


# ---- a user's own dispatching layer trains like one process ----------------------------------


def _user_layer_step(rank, world):
    """Three SGD steps of a model of :class:`Top1MoE` layers on (ep, edp) = (2, 1), beside one
    process on both ranks' batches."""
    model = _net(Top1MoE)
    plan = fsdpfn.plan(model, testing.mesh((2, 1), ("ep", "edp")), experts=["blocks.*.moe.w1", "blocks.*.moe.w2"])
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = fsdpfn.shard(model, plan)
    ref_model = _net(Top1MoE)  # never pointed at the ep group
    me = fsdpfn.transforms.dp_rank(plan)
    for step in range(3):
        x = _tokens(10 * step + me)
        grads = torch.func.grad(lambda ps: torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)))(params)
        params = {n: p - 0.1 * grads[n] for n, p in params.items()}
        want = torch.func.grad(
            lambda ps: (
                sum(torch.func.functional_call(ref_model, ps, (_tokens(10 * step + r),)) for r in range(world)) / world
            )
        )(ref)
        ref = {n: p - 0.1 * want[n] for n, p in ref.items()}
    local = plan.param("blocks.0.moe.w1").local_shape
    return local, {n: ((params[n].full_tensor() - ref[n]).norm() / ref[n].norm()).item() for n in ref}


def test_a_users_dispatching_layer_trains_like_one_process(run_on_ranks):
    # The same products in both runs; what differs is which rows share a matmul and the order of
    # fp32 sums of <= 32 terms of size ~1 (and the gradient mean over 2 ranks): ~1e-7 relative.
    for local, errors in run_on_ranks(_user_layer_step, 2):
        assert local == (2, H, W)
        assert max(errors.values()) < 1e-6, errors


# ---- a model instance never given the ep group -------------------------------------------------


def _second_instance(rank, world):
    """Sharded for one instance, run on another (or after sharding a state_dict): fsdpfn's MoE
    on the second one was never pointed at the ep group."""
    model = _net(fsdpfn_moe)
    plan = fsdpfn.plan(model, testing.mesh((2, 1), ("ep", "edp")))
    params = fsdpfn.shard(model.state_dict(), plan)  # a dict: no model to point at the group
    other = _net(fsdpfn_moe)
    full = fsdpfn.unshard(params, plan)
    try:
        torch.func.functional_call(other, full, (_tokens(rank),))
        before = "no error"
    except ValueError as e:
        before = str(e)
    fsdpfn.apply_tp(other, plan)  # the fix the message gives
    loss = torch.func.functional_call(other, full, (_tokens(rank),))
    return before, bool(torch.isfinite(loss))


def test_an_instance_never_given_the_ep_group_is_named(run_on_ranks):
    for before, ran in run_on_ranks(_second_instance, 2):
        assert "never given the ep group" in before and "fsdpfn.apply_tp(model, plan)" in before, before
        assert ran


# ---- the same rules without ranks (abstract meshes) ---------------------------------------------


class Biased(Top1MoE):
    """Top1MoE with one more parameter, not packed per expert."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(E, 1))
        self.bias = nn.Parameter(torch.zeros(2 * E, W))


class Gated(Biased):
    """The same, its packed experts declared."""

    expert_params = ("w1", "w2")


def test_expert_weights_of_one_layer_must_pack_the_same_experts():
    with pytest.raises(
        ValueError, match=r"'blocks.0.moe.w1' \(4, 12, 8\) and 'blocks.0.moe.bias' \(8, 8\) .* pack 4 and 8"
    ):
        fsdpfn.plan(_net(Biased), {"ep": 2, "edp": 1}, experts=["blocks.*.moe.w1", "blocks.*.moe.bias"])


def test_a_parameter_its_layer_does_not_declare_is_refused():
    with pytest.raises(ValueError, match=r"'blocks.0.moe.scale'.* expert_params = \('w1', 'w2'\), without 'scale'"):
        fsdpfn.plan(_net(Gated), {"ep": 2, "edp": 1}, experts=["blocks.*.moe.w*", "blocks.*.moe.scale"])


@pytest.mark.parametrize("shape,axes", [({"ep": 4}, None), ({"experts": 4}, {"experts": "ep"})], ids=["named", "axes"])
def test_a_1d_ep_mesh_is_refused_with_the_2d_mesh_to_build(shape, axes):
    with pytest.raises(
        ValueError,
        match=r"1-D mesh named '(ep|experts)' of 4 ranks.*\(4, 1\), mesh_dim_names=\('(ep|experts)', 'edp'\)",
    ):
        fsdpfn.MeshAxes.from_shape(shape, axes)
    assert fsdpfn.MeshAxes.from_shape({"ep": 4, "edp": 1}).ep_size == 4  # the fix
    assert fsdpfn.MeshAxes.from_names((4,), ("data",)).roles == (
        fsdpfn.Role.SHARD,
    )  # other names: still the shard axis


def test_fsdpfn_moe_and_a_dispatching_layer_pass_the_guards():
    assert fsdpfn.plan(_net(fsdpfn_moe), {"ep": 2, "edp": 2}).param("blocks.0.moe.experts.w1").local_shape == (2, H, W)
    plan = fsdpfn.plan(_net(Top1MoE), {"ep": 2, "edp": 1}, experts={"blocks.*.moe.w1": 1, "blocks.*.moe.w2": 1})
    assert [u.label for u in plan.units] == ["blocks.0", "blocks.0.moe", "blocks.1", "blocks.1.moe"]
    assert plan.unit_of("blocks.0.moe.router.weight").name == "blocks.0"  # the router stays dense


class Scalar(Top1MoE):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.0))


def test_a_0d_expert_weight_is_refused():
    with pytest.raises(ValueError, match=r"'blocks.0.moe.temperature' is 0-d"):
        fsdpfn.plan(_net(Scalar), {"ep": 2, "edp": 1}, experts=["blocks.*.moe.temperature"])
