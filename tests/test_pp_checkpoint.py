"""Checkpoints across pipeline degrees: parameters and AdamW state saved by the stages of a
(pp 2, dp 2) mesh load on a plan without pp (dp 4) and, saved there, on (pp 4, dp 1), equal
bitwise to one process at every hop.

Each stage's ranks hold only their stage's parameters, sharded with ``plan.stage_plan(s)``; a
checkpoint is the union of what every rank writes, by name, so a layout of other stages (or
none) reads back each parameter's slice. One AdamW step on fixed gradients makes the state
non-trivial; AdamW is elementwise, so the sharded step equals the one-process step bitwise
(``torch.equal``), as does every byte moved by save and load.
"""

from __future__ import annotations

import torch

import fsdpfn
from fsdpfn import checkpoint, optim, testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=29, seq_len=8, width=18, depth=4, heads=6, bias=True)  # 29 and 18: uneven shards
UNITS = ["embed", "pos"] + [f"blocks.{i}" for i in range(CFG.depth)] + ["norm", "head"]


def _model():
    torch.manual_seed(3)
    return GPT(CFG)


def _grads(model):
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _opt():
    return optim.adamw(lr=1e-2, weight_decay=0.1)


def _reference():
    """One AdamW step on the full tensors, in one process."""
    model = _model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _opt()
    state = opt.init(params)
    updates, state = opt.update(_grads(model), state, params)
    return optim.apply_updates(params, updates), state


def _layout(model, shape):
    """This rank's plan and its parameters: the stage plan of its stage on a pp mesh, else the plan."""
    if len(shape) == 2:
        pp = fsdpfn.pipeline_plan(model, testing.mesh(shape, ("pp", "dp")), units=UNITS)
        (stage,) = pp.stages.stages_of(pp.mesh.get_local_rank("pp"))
        plan = pp.stage_plan(stage)
    else:
        plan = fsdpfn.plan(model, testing.mesh(shape, ("dp",)), units=UNITS)
    own = {n: p for n, p in model.named_parameters() if n in plan.param_names}
    return plan, fsdpfn.shard(own, plan)


def _full(tree):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in tree.items()}


def _same(got_params, got_state, ref_params, ref_state, names) -> list[str]:
    """What differs from the reference (parameters, AdamW's step count and moments of this
    rank's parameters): [] when all are bitwise equal."""
    bad = [n for n, v in _full(got_params).items() if not torch.equal(v, ref_params[n])]
    if int(got_state.count) != int(ref_state.count):
        bad.append(f"count {got_state.count} != {ref_state.count}")
    for moment in ("mu", "nu"):
        mine = _full(getattr(got_state, moment))
        if sorted(mine) != sorted(names):
            bad.append(f"{moment} holds {sorted(mine)}")
        bad += [
            f"{moment} of {n}" for n in names if n in mine and not torch.equal(mine[n], getattr(ref_state, moment)[n])
        ]
    return bad


def _pp_round_trip(rank, world, root):
    ref_params, ref_state = _reference()
    model = _model()
    grads_full = _grads(model)
    results = {}
    # (pp 2, dp 2): one AdamW step per stage, saved
    plan, params = _layout(model, (2, 2))
    opt = _opt()
    state = opt.init(params)
    grads = fsdpfn.shard({n: grads_full[n] for n in plan.param_names}, plan)
    updates, state = opt.update(grads, state, params)
    params = optim.apply_updates(params, updates)
    results["pp2 x dp2 step"] = _same(params, state, ref_params, ref_state, plan.param_names)
    checkpoint.save(f"{root}/a", {"params": params, "opt": state}, plan, name="step_1")
    # into dp 4 (no pp): every parameter on every rank's shard
    plan1, tmpl = _layout(model, (4,))
    got = checkpoint.load(f"{root}/a", {"params": tmpl, "opt": opt.init(tmpl)}, plan1)
    results["pp2 -> pp1"] = _same(got["params"], got["opt"], ref_params, ref_state, plan1.param_names)
    checkpoint.save(f"{root}/b", got, plan1, name="step_1")
    # into (pp 4, dp 1): two units' worth of stage per rank
    plan4, tmpl4 = _layout(model, (4, 1))
    got4 = checkpoint.load(f"{root}/b", {"params": tmpl4, "opt": opt.init(tmpl4)}, plan4)
    results["pp1 -> pp4"] = _same(got4["params"], got4["opt"], ref_params, ref_state, plan4.param_names)
    results["stage params"] = sorted(plan4.param_names)
    return results


def test_checkpoints_move_between_pp_degrees_bitwise(run_on_ranks, tmp_path):
    root = str(tmp_path)
    out = run_on_ranks(_pp_round_trip, 4, root)
    for r, res in enumerate(out):
        for hop in ("pp2 x dp2 step", "pp2 -> pp1", "pp1 -> pp4"):
            assert res[hop] == [], f"rank {r}, {hop}: differs from one process in {res[hop]}"
    every = sorted(n for n, _ in GPT(CFG).named_parameters())
    assert sorted(n for res in out for n in res["stage params"]) == every  # pp 4: each parameter on one stage
