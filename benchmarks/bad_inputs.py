"""A catalogue of mistakes a new user makes with tensor, expert, context and pipeline
parallelism, remat, Muon and compile, each run as written on 2 gloo ranks (4 for the meshes that
need them) and classified by what came out.

Every case builds what the user would (mostly ``GPT(GPTConfig(vocab_size=20, seq_len=8,
width=16, depth=2, heads=2))`` on a (dp, tp) = (1, 2) mesh with ``tp=GPT_TP_PLAN``), runs a step
as the user would, and compares what it computed with one process computing the same thing. The
class of a case is decided from the outcome alone:

  named     every rank raised, and each message contains the case's culprit (a parameter,
            module, pattern or argument the user wrote) and, where the case has one, the fix
  unnamed   an exception that does not name the culprit, or one that only some ranks raised (or
            a rank that never answered)
  correct   no error, and the result is within ``TOL`` of one process's
  silent    no error, and the result is not

Settings with no numbers to compare (a pattern, a label, a remat policy) have as result the
fraction of parameters or units whose setting differs from what the user asked for: 0 is
correct, anything else silent.

Usage:
  python benchmarks/bad_inputs.py               # every case, a minute or two on 2 cores
  python benchmarks/bad_inputs.py --case tp_second_instance --case remat_counter_full
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "tests")):  # the guard tests' models are reused, not copied
    if _path not in sys.path:
        sys.path.insert(0, _path)

import fsdpfn  # noqa: E402
from fsdpfn import optim, testing  # noqa: E402
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig  # noqa: E402
from fsdpfn.runtime import Runtime  # noqa: E402

CFG = GPTConfig(vocab_size=20, seq_len=8, width=16, depth=2, heads=2)
MESH = ((1, 2), ("dp", "tp"))

# [Note: the catalogue's tolerance]
# A correct run computes the one-process numbers with float32 sums in another order: the rowwise
# layers add tp partial sums of K <= 64 products, the data-parallel mean adds per-rank means.
# Reordering an n-term float32 sum moves it by at most n * 2^-24 of its terms' magnitude: 64 x
# 6e-8 = 4e-6 for an element in the worst case, ~1e-7 for a norm. Results are compared norm-wise
# (the largest ||got - want|| / ||want|| over the parameters), so 1e-5 passes every reordering
# and the silent cases are off by 1e-2 or more (a whole tp all-reduce missing, a Muon block
# scaled by another ratio, a setting ignored = 1).
TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    what: str
    run: Callable[[int, int], float]  # (rank, world) -> the relative error against one process
    culprit: str  # a name the user wrote: a named error contains it
    fix: str = ""  # and, when the message has a fix to give, this text of it
    test: str = ""  # the test that covers the case (tests/file.py::name)
    world: int = 2  # gloo ranks it runs on


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CFG, **kw))


def _batch(rows: int, step: int = 0):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _full(t):
    return fsdpfn.comm.full_tensor(t) if hasattr(t, "placements") else t


def _rel(got: dict, want: dict) -> float:
    """The largest norm-wise relative difference over the parameters (both trees whole)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(
        ((_full(got[n]).float() - want[n].float()).norm() / want[n].float().norm().clamp_min(1e-30)).item()
        for n in want
    )


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ref_grads(model, x, y, loss=_ce):
    return torch.func.grad(lambda ps: loss(torch.func.functional_call(model, ps, (x,)), y))(_params(model))


def _pure_grads(runner, plan, params, x, y, loss=_ce):
    return torch.func.grad(lambda ps: loss(torch.func.functional_call(runner, fsdpfn.unshard(ps, plan), (x,)), y))(
        params
    )


def _mismatch(got: dict, want: dict) -> float:
    """The fraction of keys whose setting differs from what was asked for."""
    keys = set(got) | set(want)
    return sum(got.get(k) != want.get(k) for k in keys) / max(len(keys), 1)


def _gpt_tp_step(make=None, tp=GPT_TP_PLAN, rows=4, **plan_kw) -> float:
    """A pure-loop step of the issue's setup against one process on the same batch."""
    make = make or _gpt
    model = make()
    plan = fsdpfn.plan(model, testing.mesh(*MESH), tp=tp, **plan_kw)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(rows)
    return _rel(_pure_grads(model, plan, params, x, y), _ref_grads(make(), x, y))


# ---- the silent ones ---------------------------------------------------------------------------


def tp_second_instance(rank, world):
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh(*MESH), tp=GPT_TP_PLAN)
    params, runner = fsdpfn.shard(model, plan), _gpt()  # the same class and weights, another instance
    x, y = _batch(4)
    return _rel(_pure_grads(runner, plan, params, x, y), _ref_grads(_gpt(), x, y))


def tp_state_dict(rank, world):
    plan = fsdpfn.plan(_gpt(), testing.mesh(*MESH), tp=GPT_TP_PLAN)
    pretrained = _gpt()  # weights loaded elsewhere, sharded from their state_dict
    params = fsdpfn.shard(pretrained.state_dict(), plan)
    x, y = _batch(4)
    return _rel(_pure_grads(pretrained, plan, params, x, y), _ref_grads(_gpt(), x, y))


def _fused(tp_style):
    from test_guards_tp_plan import FUSED_TP, _fused_model

    model = _fused_model()
    plan = fsdpfn.plan(model, testing.mesh(*MESH), tp={**FUSED_TP, "blocks.*.attn.qkv": tp_style})
    params = fsdpfn.shard(model, plan)
    x, y = _batch(4)
    return _rel(_pure_grads(model, plan, params, x, y), _ref_grads(_fused_model(), x, y))


def fused_qkv_colwise(rank, world):
    return _fused("colwise")


def fused_qkv_colwise_fused(rank, world):
    return _fused("colwise_fused:3")


def batch_by_global_rank(rank, world):
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh(*MESH), tp=GPT_TP_PLAN)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(4)
    mine = slice(2 * rank, 2 * rank + 2)  # the global rank, where dp_rank(plan) is 0 on both
    grads = _pure_grads(model, plan, params, x[mine], y[mine])
    return _rel(grads, _ref_grads(_gpt(), x[:2], y[:2]))


def _moe_net(layer):
    from test_guards_mesh_ep import Net

    torch.manual_seed(0)
    return Net(layer)


def _moe_step(layer, experts=None, mesh=((2, 1), ("ep", "edp"))) -> float:
    """One step of a net of two MoE blocks, each rank its own tokens, against one process on both."""
    from test_guards_mesh_ep import _tokens

    model = _moe_net(layer)
    plan = fsdpfn.plan(model, testing.mesh(*mesh), experts=experts)
    params = fsdpfn.shard(model, plan)
    me = fsdpfn.transforms.dp_rank(plan)
    grads = torch.func.grad(lambda ps: torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (_tokens(me),)))(
        params
    )
    ref = _moe_net(layer)
    n = 2  # every case's mesh spans both ranks, each a data-parallel rank of its own tokens
    want = torch.func.grad(lambda ps: sum(torch.func.functional_call(ref, ps, (_tokens(r),)) for r in range(n)) / n)(
        _params(ref)
    )
    return _rel(grads, want)


def moe_without_set_ep_group(rank, world):
    from test_guards_mesh_ep import DenseMoE

    return _moe_step(DenseMoE, ["blocks.*.moe.w1", "blocks.*.moe.w2"])


class _Plain(nn.Module):
    """The guard tests' remat net without its dropout layer: a block under test, a Linear after."""

    def __init__(self, block):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([block, nn.Linear(8, 8)])
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def _remat_step(kind, policy) -> float:
    from test_guards_patterns import BLOCKS

    def make():
        torch.manual_seed(0)
        return _Plain(BLOCKS[kind]())

    model = make()
    plan = fsdpfn.plan(model, testing.mesh((2,)), remat=policy)
    params = fsdpfn.shard(model, plan)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(4))
    me = slice(2 * fsdpfn.transforms.dp_rank(plan), 2 * fsdpfn.transforms.dp_rank(plan) + 2)
    grads = torch.func.grad(
        lambda ps: F.cross_entropy(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x[me],)), y[me])
    )(params)
    return _rel(grads, _ref_grads(make(), x, y, F.cross_entropy))


def remat_counter_full(rank, world):
    return _remat_step("counter", "full")


def remat_counter_save_dots(rank, world):
    return _remat_step("counter", "save_dots")


def remat_choice_full(rank, world):
    return _remat_step("choice", "full")


def remat_choice_save_dots(rank, world):
    return _remat_step("choice", "save_dots")


def _save_names_step(remat):
    """A step on 2 ranks under a ``save_names`` policy whose tag the model never uses: if it runs,
    the unit keeps nothing, i.e. runs as ``full``, not as asked (mismatch 1)."""
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh((2,)), remat=remat)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(2)
    _pure_grads(model, plan, params, x, y)
    return 1.0  # the step ran with a tag the model never uses: nothing kept, the setting ignored


def remat_save_names_typo(rank, world):
    return _save_names_step("save_names:atention")


def _unit_remats(remat, want) -> float:
    plan = fsdpfn.plan(_gpt(depth=8), testing.mesh((2,)), remat=remat)
    return _mismatch({u.label: u.remat for u in plan.units}, want)


def remat_pattern_matches_nothing(rank, world):
    return _unit_remats(
        {"blocks.9": "full"}, {"<root>": "none", **{f"blocks.{i}": "none" for i in range(8)}, "blocks.9": "full"}
    )


def remat_overlap_memory_page(rank, world):
    # The memory page's example, as its comment reads it: blocks 0-5 full, the others save_dots.
    return _unit_remats(
        {"blocks.[0-5]": "full", "blocks.*": "save_dots"},
        {"<root>": "none", **{f"blocks.{i}": "full" if i < 6 else "save_dots" for i in range(8)}},
    )


def remat_overlap_reversed(rank, world):
    return _unit_remats(
        {"blocks.*": "save_dots", "blocks.[0-5]": "full"},
        {"<root>": "none", **{f"blocks.{i}": "full" if i < 6 else "save_dots" for i in range(8)}},
    )


def _muon_blocks(blocks, meant) -> float:
    """Two Muon updates on a 2-rank data-parallel plan with ``blocks``, against one process with
    the blocks the user meant."""
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh((2,)))
    params, ref = fsdpfn.shard(model, plan), _params(model)
    kw = dict(lr=0.02, weight_decay=0.0, ns_dtype=torch.float32)
    opt, ref_opt = optim.muon(**kw, blocks=blocks), optim.muon(**kw, blocks=meant)
    state, ref_state = opt.init(params), ref_opt.init(ref)
    worst = 0.0
    for step in range(2):
        gen = torch.Generator().manual_seed(10 + step)
        g = {n: torch.randn(p.shape, generator=gen) for n, p in ref.items()}
        updates, state = opt.update(fsdpfn.shard(g, plan, check=False), state, params)
        want, ref_state = ref_opt.update(g, ref_state, ref)
        worst = max(worst, _rel(updates, want))
        params, ref = optim.apply_updates(params, updates), optim.apply_updates(ref, want)
    return worst


def muon_blocks_typo(rank, world):
    return _muon_blocks({"*qkv.wieght": 6}, {"*qkv.weight": 6})


def muon_blocks_overlap(rank, world):
    return _muon_blocks({"*qkv.weight": 6, "blocks.0.qkv.weight": 3}, {"blocks.0.qkv.weight": 3, "*qkv.weight": 6})


def tp_pattern_matches_nothing(rank, world):
    return _gpt_tp_step(tp={**GPT_TP_PLAN, "blocks.*.mlp": "colwise"})


def tp_overlap(rank, world):
    return _gpt_tp_step(tp={**GPT_TP_PLAN, "blocks.0.fc": "replicate", "blocks.0.out": "replicate"})


def offload_pattern_matches_nothing(rank, world):
    plan = fsdpfn.plan(_gpt(), testing.mesh((2,)), offload={"block.*": True})
    return _mismatch({u.label: u.offload for u in plan.units}, {"<root>": False, "blocks.0": True, "blocks.1": True})


def experts_pattern_matches_nothing(rank, world):
    from test_guards_mesh_ep import fsdpfn_moe

    return _moe_step(fsdpfn_moe, ["blocks.*.moe.experts.w9"])


def fp8_exclude_matches_nothing(rank, world):
    policy = fsdpfn.fp8.Float8GatherPolicy(exclude=["*.head.weight"])
    plan = fsdpfn.plan(
        _gpt(width=32), testing.mesh((2,)), mp=fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, fp8=policy)
    )
    return 1.0 if plan else 0.0  # accepted: the exclusion the user wrote applies to nothing


def muon_blockwise_tp(rank, world):
    from test_guards_muon import _blockwise_vs_blocks

    worst, _ = _blockwise_vs_blocks(rank, world, "original", None)
    return max(worst.values())


def _muon_default_labels(cls) -> float:
    """Which parameters ``optim.muon()`` gives Muon state, against the module rule: hidden
    matrices only, embeddings and the head on AdamW."""
    from test_guards_muon import HIDDEN

    torch.manual_seed(0)
    params = _params(cls())
    state = optim.muon(lr=0.02).init(params)
    got = {n: b is not None for n, b in state.inner_states["muon"][0].momentum_buffer.items()}
    return _mismatch(got, {n: n in HIDDEN for n in params})


def muon_labels_emb_classifier(rank, world):
    from test_guards_muon import Classifier

    return _muon_default_labels(Classifier)


def muon_labels_tok_emb_unembed(rank, world):
    from test_guards_muon import TokLM

    return _muon_default_labels(TokLM)


def muon_labels_tied_token_embedding(rank, world):
    from test_guards_muon import TiedLM

    return _muon_default_labels(TiedLM)


def ep_1d_mesh(rank, world):
    from test_guards_mesh_ep import fsdpfn_moe

    return _moe_step(fsdpfn_moe, mesh=((2,), ("ep",)))


def unequal_batches(rank, world):
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh((2,)))
    params = fsdpfn.shard(model, plan)
    x, y = _batch(5)
    mine = slice(0, 3) if rank == 0 else slice(3, 5)  # a loader without drop_last: 3 + 2 rows
    return _rel(_pure_grads(model, plan, params, x[mine], y[mine]), _ref_grads(_gpt(), x, y))


def _hf_llama(kv_heads=2, heads=4):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hf_tp_loss(tp, **kw) -> float:
    model = _hf_llama(**kw)
    tokens = torch.arange(2 * 9).view(2, 9) % 32
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref = _ce(_hf_llama(**kw)(x, use_cache=False).logits, y)
    plan = fsdpfn.plan(model, testing.mesh(*MESH), tp=tp)
    params = fsdpfn.shard(model, plan)
    logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,), {"use_cache": False}).logits
    return abs(_ce(logits, y).item() - ref.item()) / abs(ref.item())


def hf_gqa_q_without_kv(rank, world):
    from test_guards_tp_plan import HF_Q_ONLY

    return _hf_tp_loss(HF_Q_ONLY)


def hf_gqa_kv_heads_tp_does_not_divide(rank, world):
    from test_guards_tp_plan import HF_TP

    return _hf_tp_loss(HF_TP, kv_heads=1)


def mesh_smaller_than_world(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    model = _gpt()
    plan = fsdpfn.plan(model, init_device_mesh("cpu", (1,)))
    params = fsdpfn.shard(model, plan)
    x, y = _batch(4)
    mine = slice(2 * rank, 2 * rank + 2)
    return _rel(_pure_grads(model, plan, params, x[mine], y[mine]), _ref_grads(_gpt(), x, y))


# ---- the unnamed ones -------------------------------------------------------------------------


def heads_tp_does_not_divide(rank, world):
    return _gpt_tp_step(lambda: _gpt(width=18, heads=3))  # 54 qkv rows split in 2: 1.5 heads a rank


def colwise_without_rowwise(rank, world):
    return _gpt_tp_step(tp={**GPT_TP_PLAN, "blocks.*.out": "replicate"})


def plan_bound_to_another_mesh(rank, world):
    model = _gpt()
    plan = fsdpfn.plan(model, {"dp": 2, "tp": 2}, tp=GPT_TP_PLAN).bind(testing.mesh(*MESH))
    params = fsdpfn.shard(model, plan)
    x, y = _batch(4)
    return _rel(_pure_grads(model, plan, params, x, y), _ref_grads(_gpt(), x, y))


def router_as_expert_weight(rank, world):
    from test_guards_mesh_ep import fsdpfn_moe

    return _moe_step(fsdpfn_moe, ["blocks.*.moe.router.weight", "blocks.*.moe.experts.w*"])


def streamed_cuda_on_cpu(rank, world):
    params = _params(_gpt())
    grads = {n: torch.ones_like(p) for n, p in params.items()}
    opt = optim.streamed(optim.adamw(1e-3), device="cuda")
    updates, _ = opt.update(grads, opt.init(params), params)
    want, _ = optim.adamw(1e-3).update(grads, optim.adamw(1e-3).init(params), params)
    return _rel(updates, want)


def _compiled(how):
    import warnings

    warnings.simplefilter("ignore")  # dynamo's own warnings
    torch._dynamo.reset()
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh((2,)), remat="full" if how == "fsdpfn_remat" else None)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(2)

    def loss_fn(ps, x, y):
        return _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)

    if how == "fsdpfn_remat":
        grads, _ = fsdpfn.compile(loss_fn, backend="aot_eager")(params, x, y)
    else:
        grads = torch.compile(torch.func.grad(loss_fn), fullgraph=True, backend="aot_eager")(params, x, y)
    return _rel(grads, {n: _full(g) for n, g in torch.func.grad(loss_fn)(params, x, y).items()})


def compile_remat_plan(rank, world):
    return _compiled("fsdpfn_remat")


def compile_unequal_batches(rank, world, runtime=False):
    """11 under ``fsdpfn.compile(..., verify=False)``: the model's root hook runs traced there;
    ``runtime``: the model run by ``Runtime(..., verify=False).apply``."""
    import warnings

    warnings.simplefilter("ignore")  # dynamo's own warnings
    torch._dynamo.reset()
    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh((2,)))
    params = fsdpfn.shard(model, plan)
    x, y = _batch(5)
    mine = slice(0, 3) if rank == 0 else slice(3, 5)

    rt = Runtime(model, plan, verify=False)

    def loss_fn(ps, x, y):
        if runtime:
            return _ce(rt.apply(ps, x), y)
        return _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y)

    grads, _ = fsdpfn.compile(loss_fn, backend="aot_eager", verify=False)(params, x[mine], y[mine])
    return _rel(grads, _ref_grads(_gpt(), x, y))


def compile_runtime_unequal_batches(rank, world):
    return compile_unequal_batches(rank, world, runtime=True)


def compile_func_grad(rank, world):
    return _compiled("func_grad")


def tp_style_on_a_block(rank, world):
    return _gpt_tp_step(tp={"blocks.0": "colwise"})


def hf_model_output(rank, world):
    """The runtime on a Hugging Face model, whose output is a ModelOutput (a dict subclass)."""
    model = _hf_llama()
    plan = fsdpfn.plan(model, testing.mesh((2,)))
    params = fsdpfn.shard(model, plan)
    rt = Runtime(model, plan)
    tokens = torch.arange(4 * 9).view(4, 9) % 32
    mine = tokens[2 * rank : 2 * rank + 2]
    grads, _ = rt.value_and_grad(lambda ps: rt.apply(ps, mine, labels=mine, use_cache=False).loss)(params)
    ref = _hf_llama()
    want = torch.func.grad(
        lambda ps: torch.func.functional_call(ref, ps, (tokens,), {"labels": tokens, "use_cache": False}).loss
    )(_params(ref))
    return _rel(grads, want)


# ---- the ways of writing a model that the differential check covers (fsdpfn.verify) ----------------
# Each runs a first step as a user would (the pure loop with its verify_step line, or a runtime),
# so the check decides; the models are tests/test_verify.py's.


def _vnet_step(layout="sides", cut="unbind", mlp="module", tp=None, sdpa_blocks=()) -> float:
    """``Net`` of tests/test_verify.py on (dp, tp) = (1, 2): a runtime's first step against one process."""
    import test_verify as tv

    torch.manual_seed(0)
    model = tv.Net(layout, cut, mlp, sdpa_blocks)
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=tp or tv.TP)
    params = fsdpfn.shard(model, plan)
    rt = Runtime(model, plan)
    x, y = tv._batch(0), tv._batch(1)
    grads, _ = rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x), y))(params)
    torch.manual_seed(0)
    ref = tv.Net(layout, cut, mlp, sdpa_blocks)
    return _rel(grads, _ref_grads(ref, x, y))


def qkv_cut_by_unbind(rank, world):
    return _vnet_step(cut="unbind")


def qkv_cut_by_slicing(rank, world):
    return _vnet_step(cut="slice")


def qkv_cut_by_permute(rank, world):
    return _vnet_step(cut="permute")


def qkv_cut_by_transpose_chunk(rank, world):
    return _vnet_step(cut="transpose_chunk")


def head_major_qkv_colwise_fused(rank, world):
    import test_verify as tv

    return _vnet_step(layout="heads", tp={**tv.TP, "blocks.*.qkv": "colwise_fused:3"})


def rowwise_called_as_f_linear(rank, world):
    return _vnet_step(layout="heads", mlp="f_linear")


def colwise_called_as_dot_forward(rank, world):
    return _vnet_step(layout="heads", mlp="dot_forward")


def experts_without_w2(rank, world):
    import test_verify as tv

    answer = tv._ep_case(rank, world, ["blocks.*.moe.experts.w1"])
    if answer[0] != "ok":
        raise ValueError(answer[1])
    return answer[1]


def _cp_pure(sdpa_blocks=(), outside=False, ignored=False, global_rank_batch=False, one_dim=False) -> float:
    """``Net`` under cp (dp 1 x cp 2, or dp 2 x cp 2 on 4 ranks): the pure loop with its
    verify_step line, then a step, against one process on the whole batch."""
    import test_verify as tv

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = tv.Net("heads", "unbind", "module", sdpa_blocks)
    mesh = testing.mesh((world,), ("cp",)) if one_dim else testing.mesh((world // 2, 2), ("dp", "cp"))
    plan = fsdpfn.plan(model, mesh)
    params = fsdpfn.shard(model, plan)
    tokens = torch.randint(0, tv.VOCAB, (4, tv.SEQ + 1), generator=torch.Generator().manual_seed(7))
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    if ignored:
        y[:, : tv.SEQ // 4] = -100  # padding at the start: all on the first cp rank's chunk
    n = 4 // plan.dp_size
    index = torch.distributed.get_rank() if global_rank_batch else fsdpfn.transforms.dp_rank(plan)
    mine = slice(n * index % 4, n * index % 4 + n)
    xl, yl = fsdpfn.context_parallel_shard((x[mine], y[mine]), plan)

    def loss_fn(ps, x, y):
        return F.cross_entropy(
            torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)).flatten(0, 1),
            y.flatten(),
            ignore_index=-100,
        )

    if outside:  # a validation forward written outside the block
        with torch.no_grad():
            loss_fn(params, xl, yl)
    with fsdpfn.context_parallel(plan):
        fsdpfn.verify_step(loss_fn, params, xl, yl)
        grads = torch.func.grad(loss_fn)(params, xl, yl)
    torch.manual_seed(0)
    ref = tv.Net("heads", "unbind", "module", sdpa_blocks)
    return _rel(
        grads, _ref_grads(ref, x, y, loss=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=-100))
    )


def cp_one_block_on_sdpa(rank, world):
    return _cp_pure(sdpa_blocks=(1,))


def cp_forward_outside_its_block(rank, world):
    return _cp_pure(outside=True)


def cp_ignore_index_uneven(rank, world):
    return _cp_pure(ignored=True)


def dp_cp_batch_by_global_rank(rank, world):
    return _cp_pure(global_rank_batch=True)


def cp_on_a_1d_mesh(rank, world):
    return _cp_pure(one_dim=True)


def cp_attention_with_a_mask(rank, world):
    q = torch.randn(1, 2, 4, 8)
    fsdpfn.context_parallel_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool))
    return 0.0


def _pp_step(stage_fn=None, loss_fn=None, rows=None) -> float:
    """GPT on pp 2 x dp (1 or 2): a PipelineRuntime step, against one process on the whole batch."""
    import test_verify as tv
    from fsdpfn.runtime import PipelineRuntime

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = GPT(tv.PP_CFG)
    plan = fsdpfn.pipeline_plan(model, testing.mesh((2, world // 2), ("pp", "dp")), units=tv.PP_UNITS)
    stages = None
    if stage_fn is not None:

        def stages(s, units):
            return stage_fn(model.pipeline_stage(units), s)

    pipe = PipelineRuntime(model, plan, "1f1b", 2, loss_fn=loss_fn or _ce, stages=stages)
    params = pipe.shard(model)
    dp = plan.mesh.get_local_rank("dp")
    tokens = torch.randint(0, tv.VOCAB, (12, tv.SEQ + 1), generator=torch.Generator().manual_seed(5))
    sizes = rows or [12 // plan.dp_size] * plan.dp_size
    start = sum(sizes[:dp])
    mine = tokens[start : start + sizes[dp]]
    grads, _ = pipe.step(params, mine[:, :-1], mine[:, 1:])
    torch.manual_seed(0)
    want = _ref_grads(GPT(tv.PP_CFG), tokens[:, :-1], tokens[:, 1:])
    full = {n: _full(g) for n, g in grads.items() if g is not None}
    gathered = fsdpfn.comm.all_gather_object(full)
    merged = {n: g for part in gathered for n, g in part.items()}
    return _rel(merged, want)


class _Tupled(nn.Module):
    def __init__(self, inner: nn.Module, s: int):
        super().__init__()
        self.inner, self.s = inner, s

    def forward(self, x):
        out = self.inner(x)
        return (out,) if self.s == 0 else out  # as Hugging Face layers return (hidden,)


class _InPlace(nn.Module):
    def __init__(self, inner: nn.Module, s: int):
        super().__init__()
        self.inner, self.s = inner, s

    def forward(self, x):
        if self.s == 1:
            x *= 0.7
        return self.inner(x)


def pp_dp_unequal_rows(rank, world):
    return _pp_step(rows=[8, 4])


def pp_stage_returns_a_tuple(rank, world):
    return _pp_step(stage_fn=_Tupled)


def pp_loss_with_reduction_none(rank, world):
    return _pp_step(loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none"))


def pp_stage_writes_its_input_in_place(rank, world):
    return _pp_step(stage_fn=_InPlace)


def _have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


_S, _T, _M, _P, _R = (
    "tests/test_guards_step.py",
    "tests/test_guards_tp_plan.py",
    "tests/test_guards_muon.py",
    "tests/test_guards_patterns.py",
    "tests/test_guards_runtime_exit.py",
)
_E = "tests/test_guards_mesh_ep.py"
_V = "tests/test_verify.py"

CASES: list[Case] = [
    # The numbered silent cases.
    Case(
        "tp_second_instance",
        "1. functional_call on a second instance of the model",
        tp_second_instance,
        "'blocks.0.qkv'",
        "fsdpfn.apply_tp(model, plan)",
        f"{_S}::test_tp_weight_without_its_hooks_raises_on_every_rank",
    ),
    Case(
        "tp_state_dict",
        "1. shard(model.state_dict()) of another instance",
        tp_state_dict,
        "'blocks.0.qkv'",
        "fsdpfn.apply_tp(model, plan)",
        f"{_S}::test_tp_weight_without_its_hooks_raises_on_every_rank",
    ),
    Case(
        "fused_qkv_colwise",
        "2. a q|k|v-major fused qkv split 'colwise'",
        fused_qkv_colwise,
        "'blocks.0.attn.qkv'",
        "colwise_fused:3",
        f"{_T}::test_plain_colwise_on_a_fused_qkv_is_refused_on_every_rank",
    ),
    Case(
        "fused_qkv_colwise_fused",
        "2. the same split 'colwise_fused:3'",
        fused_qkv_colwise_fused,
        "'blocks.0.attn.qkv'",
        "",
        f"{_T}::test_fused_qkv_split_colwise_fused_trains_as_one_process",
    ),
    Case(
        "batch_by_global_rank",
        "3. tp peers' batches indexed by the global rank",
        batch_by_global_rank,
        "tensor-parallel peers",
        "dp_rank(plan)",
        f"{_S}::test_tp_peers_with_different_batches_raise",
    ),
    Case(
        "moe_without_set_ep_group",
        "4. a user's MoE layer without set_ep_group",
        moe_without_set_ep_group,
        "'blocks.0.moe.w1'",
        "set_ep_group",
        f"{_E}::test_bad_meshes_and_expert_layers_are_named_on_every_rank_before_any_collective",
    ),
    Case(
        "remat_counter_full",
        "5. remat='full' on a block with a call counter",
        remat_counter_full,
        "'blocks.0'",
        "",
        f"{_P}::test_a_recompute_that_computes_other_numbers_is_refused_in_the_pure_loop",
    ),
    Case(
        "remat_counter_save_dots",
        "5. remat='save_dots', the same block",
        remat_counter_save_dots,
        "'blocks.0'",
        "",
        f"{_P}::test_a_recompute_that_computes_other_numbers_is_refused_in_the_pure_loop",
    ),
    Case(
        "remat_choice_full",
        "5. remat='full' on a block with a Python random choice",
        remat_choice_full,
        "'blocks.0'",
        "",
        f"{_P}::test_a_recompute_that_computes_other_numbers_is_refused_in_the_pure_loop",
    ),
    Case(
        "remat_choice_save_dots",
        "5. remat='save_dots', the same block",
        remat_choice_save_dots,
        "'blocks.0'",
        "",
        f"{_P}::test_a_recompute_that_computes_other_numbers_is_refused_in_the_pure_loop",
    ),
    Case(
        "remat_save_names_typo",
        "6. remat='save_names:atention' (a tag never used)",
        remat_save_names_typo,
        "'atention'",
        "'attention'",
        f"{_P}::test_save_names_with_an_unused_tag_is_refused_at_the_first_forward",
    ),
    Case(
        "muon_blocks_typo",
        "6. muon(blocks={'*qkv.wieght': 6})",
        muon_blocks_typo,
        "'*qkv.wieght'",
        "did you mean",
        f"{_P}::test_muon_blocks_pattern_matching_nothing_is_refused_at_init",
    ),
    Case(
        "remat_overlap_memory_page",
        "7. remat={'blocks.[0-5]': 'full', 'blocks.*': 'save_dots'}",
        remat_overlap_memory_page,
        "'blocks.[0-5]'",
        "",
        f"{_P}::test_the_memory_page_remat_example_means_what_it_says",
    ),
    Case(
        "muon_blockwise_tp",
        "8. blockwise Muon under tp, the lr ratio of a piece",
        muon_blockwise_tp,
        "'fc.weight'",
        "",
        f"{_M}::test_blockwise_under_tp_scales_each_piece_by_its_own_ratio",
    ),
    Case(
        "muon_labels_emb_classifier",
        "9. muon() on a model with 'emb' and 'classifier'",
        muon_labels_emb_classifier,
        "'emb.weight'",
        "",
        f"{_M}::test_muon_default_name_rule_knows_common_embedding_and_head_names",
    ),
    Case(
        "muon_labels_tok_emb_unembed",
        "9. muon() on 'tok_emb' and an untied 'unembed'",
        muon_labels_tok_emb_unembed,
        "'tok_emb.weight'",
        "",
        f"{_M}::test_muon_default_name_rule_knows_common_embedding_and_head_names",
    ),
    Case(
        "muon_labels_tied_token_embedding",
        "9. muon() on a tied 'token_embedding' and a 'pos_table'",
        muon_labels_tied_token_embedding,
        "'pos_table'",
        "",
        f"{_M}::test_muon_default_name_rule_knows_common_embedding_and_head_names",
    ),
    Case(
        "ep_1d_mesh",
        "10. a 1-D mesh named 'ep'",
        ep_1d_mesh,
        "'ep'",
        "mesh_dim_names=('ep', 'edp')",
        f"{_E}::test_bad_meshes_and_expert_layers_are_named_on_every_rank_before_any_collective",
    ),
    Case(
        "unequal_batches",
        "11. per-rank batches of 3 and 2 rows",
        unequal_batches,
        "rank 0: 3, rank 1: 2",
        "drop_last=True",
        f"{_S}::test_unequal_dp_batches_raise",
    ),
    Case(
        "hf_gqa_q_without_kv",
        "12. HF Llama: q_proj split, k_proj/v_proj whole",
        hf_gqa_q_without_kv,
        "k_proj",
        "'model.layers.*.self_attn.k_proj'",
        f"{_T}::test_hf_gqa_q_split_without_k_and_v_is_named",
    ),
    Case(
        "hf_gqa_kv_heads_tp_does_not_divide",
        "12. HF Llama: 1 kv head on tp=2",
        hf_gqa_kv_heads_tp_does_not_divide,
        "num_key_value_heads = 1",
        "",
        f"{_T}::test_hf_gqa_kv_heads_tp_does_not_divide_are_named",
    ),
    Case(
        "mesh_smaller_than_world",
        "13. init_device_mesh('cpu', (1,)) in a 2-rank job",
        mesh_smaller_than_world,
        "world size 2",
        "init_device_mesh('cpu', (2,))",
        f"{_E}::test_bad_meshes_and_expert_layers_are_named_on_every_rank_before_any_collective",
    ),
    # The unnamed ones.
    Case(
        "heads_tp_does_not_divide",
        "U. 3 heads on tp=2",
        heads_tp_does_not_divide,
        "heads = 3",
        "",
        f"{_T}::test_head_counts_tp_does_not_divide_are_named",
    ),
    Case(
        "colwise_without_rowwise",
        "U. fc colwise, its partner out replicate",
        colwise_without_rowwise,
        "'blocks.0.fc'",
        "rowwise",
        f"{_T}::test_a_replicated_layer_fed_by_a_colwise_one_is_named",
    ),
    Case(
        "plan_bound_to_another_mesh",
        "U. a plan for (2, 2) bound to (1, 2)",
        plan_bound_to_another_mesh,
        "(2, 2)",
        "Build the plan again",
        f"{_T}::test_tp_layout_errors_reach_every_rank_before_any_collective",
    ),
    Case(
        "router_as_expert_weight",
        "U. the router listed as an expert weight",
        router_as_expert_weight,
        "'blocks.0.moe.router.weight'",
        "",
        f"{_E}::test_bad_meshes_and_expert_layers_are_named_on_every_rank_before_any_collective",
    ),
    Case(
        "streamed_cuda_on_cpu",
        "U. optim.streamed(device='cuda') on a CPU-only torch",
        streamed_cuda_on_cpu,
        "device='cuda'",
        "device='cpu'",
        f"{_M}::test_streamed_refuses_an_unavailable_device_when_built",
    ),
    Case(
        "compile_remat_plan",
        "U. fsdpfn.compile on a remat='full' plan",
        compile_remat_plan,
        "'blocks.0'",
        "fsdpfn.runtime.Runtime",
        f"{_R}::test_fsdpfn_compile_refuses_a_remat_plan_by_name",
    ),
    Case(
        "compile_unequal_batches",
        "U. fsdpfn.compile(loss_fn, verify=False) on per-rank batches of 3 and 2 rows",
        compile_unequal_batches,
        "rank 0: 3, rank 1: 2",
        "drop_last=True",
        f"{_S}::test_unequal_dp_batches_raise",
    ),
    Case(
        "compile_runtime_unequal_batches",
        "U. fsdpfn.compile on Runtime(verify=False).apply, per-rank batches of 3 and 2 rows",
        compile_runtime_unequal_batches,
        "rank 0: 3, rank 1: 2",
        "drop_last=True",
        f"{_S}::test_unequal_dp_batches_raise",
    ),
    Case(
        "compile_func_grad",
        "U. torch.compile(torch.func.grad(loss), fullgraph=True)",
        compile_func_grad,
        "torch.func.grad",
        "fsdpfn.compile(loss_fn)",
        f"{_R}::test_compiled_func_grad_names_fsdpfn_and_the_fix",
    ),
    Case(
        "tp_style_on_a_block",
        "U. tp={'blocks.0': 'colwise'} (the '{name}.*' message)",
        tp_style_on_a_block,
        "'blocks.0.*'",
        "",
        f"{_T}::test_a_style_matching_a_non_linear_names_the_pattern_formatted",
    ),
    # The runtime on a Hugging Face model.
    Case(
        "hf_model_output",
        "HF: rt.apply on LlamaForCausalLM (a ModelOutput)",
        hf_model_output,
        "ModelOutput",
        "",
        f"{_R}::test_runtime_on_a_hugging_face_model_matches_plain_torch",
    ),
    # Every other pattern argument: matching nothing, and overlapping.
    Case(
        "remat_pattern_matches_nothing",
        "P. remat={'blocks.9': 'full'} on 8 blocks",
        remat_pattern_matches_nothing,
        "'blocks.9'",
        "did you mean",
        f"{_P}::test_first_match_is_the_one_rule",
    ),
    Case(
        "remat_overlap_reversed",
        "P. remat={'blocks.*': ..., 'blocks.[0-5]': ...}",
        remat_overlap_reversed,
        "'blocks.[0-5]'",
        "",
        f"{_P}::test_the_memory_page_remat_example_means_what_it_says",
    ),
    Case(
        "muon_blocks_overlap",
        "P. muon(blocks={'*qkv.weight': 6, 'blocks.0.qkv.weight': 3})",
        muon_blocks_overlap,
        "'blocks.0.qkv.weight'",
        "",
        f"{_P}::test_muon_blocks_pattern_matching_nothing_is_refused_at_init",
    ),
    Case(
        "tp_pattern_matches_nothing",
        "P. tp={..., 'blocks.*.mlp': 'colwise'}",
        tp_pattern_matches_nothing,
        "'blocks.*.mlp'",
        "did you mean",
        "tests/test_mesh.py::test_bad_tp_input_is_named_on_every_rank_before_any_collective",
    ),
    Case(
        "tp_overlap",
        "P. tp={**GPT_TP_PLAN, 'blocks.0.fc': 'replicate', ...} (later, dead)",
        tp_overlap,
        "'blocks.0.fc'",
        "",
        f"{_P}::test_tp_first_match_wins_and_dead_patterns_are_refused",
    ),
    Case(
        "offload_pattern_matches_nothing",
        "P. offload={'block.*': True}",
        offload_pattern_matches_nothing,
        "'block.*'",
        "did you mean",
        "tests/test_offload.py::test_offload_per_unit_and_in_the_plan_json",
    ),
    Case(
        "experts_pattern_matches_nothing",
        "P. experts=['blocks.*.moe.experts.w9']",
        experts_pattern_matches_nothing,
        "'blocks.*.moe.experts.w9'",
        "did you mean",
        "tests/test_moe_plan.py::test_bad_expert_plans_are_named_on_every_rank_before_any_collective",
    ),
    Case(
        "fp8_exclude_matches_nothing",
        "P. Float8GatherPolicy(exclude=['*.head.weight'])",
        fp8_exclude_matches_nothing,
        "'*.head.weight'",
        "did you mean",
        "tests/test_fp8_gather.py::test_plan_time_errors_name_the_unit_parameter_or_setting",
    ),
    # Other ways of writing a model: the differential check decides (fsdpfn.verify).
    Case(
        "qkv_cut_by_unbind",
        "V. q|k|v qkv split 'colwise', cut by view(...).unbind",
        qkv_cut_by_unbind,
        "unit 'blocks.0'",
        "colwise_fused:k",
        f"{_V}::test_a_side_by_side_qkv_split_colwise_is_named_however_it_is_cut",
    ),
    Case(
        "qkv_cut_by_slicing",
        "V. the same, cut by o[..., :d]",
        qkv_cut_by_slicing,
        "unit 'blocks.0'",
        "colwise_fused:k",
        f"{_V}::test_a_side_by_side_qkv_split_colwise_is_named_however_it_is_cut",
    ),
    Case(
        "qkv_cut_by_permute",
        "V. the same, cut by reshape + permute",
        qkv_cut_by_permute,
        "unit 'blocks.0'",
        "colwise_fused:k",
        f"{_V}::test_a_side_by_side_qkv_split_colwise_is_named_however_it_is_cut",
    ),
    Case(
        "qkv_cut_by_transpose_chunk",
        "V. the same, cut by o.transpose(1, 2).chunk(3, 1)",
        qkv_cut_by_transpose_chunk,
        "unit 'blocks.0'",
        "colwise_fused:k",
        f"{_V}::test_a_side_by_side_qkv_split_colwise_is_named_however_it_is_cut",
    ),
    Case(
        "head_major_qkv_colwise_fused",
        "V. a head-major qkv planned 'colwise_fused:3'",
        head_major_qkv_colwise_fused,
        "unit 'blocks.0'",
        "plain 'colwise'",
        f"{_V}::test_a_head_major_qkv_planned_colwise_fused_is_named",
    ),
    Case(
        "rowwise_called_as_f_linear",
        "V. a rowwise layer called as F.linear(h, out.weight)",
        rowwise_called_as_f_linear,
        "unit 'blocks.0'",
        "call the module itself",
        f"{_V}::test_a_split_layer_called_around_its_module_is_named",
    ),
    Case(
        "colwise_called_as_dot_forward",
        "V. a colwise layer called as fc.forward(h)",
        colwise_called_as_dot_forward,
        "unit 'blocks.0'",
        "call the module itself",
        f"{_V}::test_a_split_layer_called_around_its_module_is_named",
    ),
    Case(
        "experts_without_w2",
        "V. experts=['blocks.*.moe.experts.w1'] without w2",
        experts_without_w2,
        "unit 'blocks.0'",
        "w1, w2",
        f"{_V}::test_experts_with_one_packed_weight_left_out_are_named",
    ),
    Case(
        "cp_one_block_on_sdpa",
        "V. cp: block 1 still on F.scaled_dot_product_attention",
        cp_one_block_on_sdpa,
        "unit 'blocks.1'",
        "context_parallel_attention",
        f"{_V}::test_cp_with_one_block_still_on_plain_sdpa_is_named",
    ),
    Case(
        "cp_forward_outside_its_block",
        "V. cp: a validation forward outside the context_parallel block",
        cp_forward_outside_its_block,
        "outside `with fsdpfn.context_parallel(plan):`",
        "context_parallel_shard",
        f"{_V}::test_a_cp_forward_outside_its_block_is_refused",
    ),
    Case(
        "cp_ignore_index_uneven",
        "V. cp: cross_entropy(ignore_index) with the padding on one cp rank",
        cp_ignore_index_uneven,
        "the loss the step trains differs",
        "grad_op='sum'",
        f"{_V}::test_a_mean_over_each_ranks_counted_tokens_is_named",
    ),
    Case(
        "dp_cp_batch_by_global_rank",
        "V. dp 2 x cp 2: the batch indexed by the global rank",
        dp_cp_batch_by_global_rank,
        "context-parallel peers",
        "dp_rank(plan)",
        f"{_V}::test_cp_peers_that_cut_different_batches_are_named",
        world=4,
    ),
    Case(
        "cp_on_a_1d_mesh",
        "V. cp on a 1-D mesh named ('cp',)",
        cp_on_a_1d_mesh,
        "1-D mesh named 'cp'",
        "mesh_dim_names=('dp', 'cp')",
        "tests/test_mesh.py::test_a_1d_mesh_of_another_parallelism_is_refused_with_the_mesh_to_build",
    ),
    Case(
        "cp_attention_with_a_mask",
        "V. context_parallel_attention(q, k, v, mask)",
        cp_attention_with_a_mask,
        "attn_mask",
        "",
        f"{_V}::test_a_mask_given_to_cp_attention_is_named",
    ),
    Case(
        "pp_dp_unequal_rows",
        "V. pp 2 x dp 2 with batches of 8 and 4 rows",
        pp_dp_unequal_rows,
        "batches of different sizes",
        "drop_last=True",
        f"{_V}::test_the_pipeline_checks_the_batch_on_every_rank",
        world=4,
    ),
    Case(
        "pp_stage_returns_a_tuple",
        "V. a pipeline stage returning (hidden,)",
        pp_stage_returns_a_tuple,
        "returned a tuple of 1",
        "layer(x)[0]",
        f"{_V}::test_a_pipeline_stage_or_loss_that_cannot_go_on_is_named",
    ),
    Case(
        "pp_loss_with_reduction_none",
        "V. a pipeline loss_fn with reduction='none'",
        pp_loss_with_reduction_none,
        "reduction='none'",
        ".mean()",
        f"{_V}::test_a_pipeline_stage_or_loss_that_cannot_go_on_is_named",
    ),
    Case(
        "pp_stage_writes_its_input_in_place",
        "V. a pipeline stage doing `h *= 0.7` on its input",
        pp_stage_writes_its_input_in_place,
        "modifies its input in place",
        "h = h * 0.7",
        f"{_V}::test_a_pipeline_stage_or_loss_that_cannot_go_on_is_named",
    ),
]
BY_ID = {c.id: c for c in CASES}
NEEDS_TRANSFORMERS = {"hf_gqa_q_without_kv", "hf_gqa_kv_heads_tp_does_not_divide", "hf_model_output"}


def _row(rank, world, case_id):
    """Runs one case on this rank: ``("ran", error, collectives)`` or ``("raised", text, collectives)``."""
    torch.set_num_threads(1)
    with fsdpfn.comm.count_collectives() as counter:
        try:
            err = float(BY_ID[case_id].run(rank, world))
            out: tuple = ("ran", err)
        except Exception as e:  # noqa: BLE001 - the catalogue classifies whatever comes out
            out = ("raised", f"{type(e).__name__}: {e}")
    return (*out, sum(counter.counts().values()))


def classify(case: Case, answers: list[tuple] | str) -> tuple[str, str]:
    """(class, what to print) from every rank's answer, or the RankError text of a run that failed."""
    if isinstance(answers, str):
        return "unnamed", answers.strip().splitlines()[0][:160]
    raised = [a for a in answers if a[0] == "raised"]
    if raised:
        lines = raised[0][1].strip().splitlines() or [raised[0][1]]
        # The line that names the culprit, if any (dynamo puts its own summary first).
        first = next((line for line in lines if case.culprit in line), lines[0])
        named = len(raised) == len(answers) and all(case.culprit in a[1] and case.fix in a[1] for a in raised)
        where = (
            ""
            if len(raised) == len(answers)
            else f" (only rank(s) {[i for i, a in enumerate(answers) if a[0] == 'raised']})"
        )
        # How many collectives ran before the error: 0 for what the plan sees when it is built,
        # the step's gathers for what only the forward shows.
        ran = max(a[2] for a in raised)
        return ("named" if named else "unnamed"), f"{first[:160]}{where} [{ran} collectives first]"
    worst = max(a[1] for a in answers)
    return ("correct" if worst <= TOL else "silent"), f"max relative error {worst:.3g}"


def run_cases(ids: list[str] | None = None, runner=None) -> list[tuple[Case, str, str]]:
    """Each case on its ranks (2, or the case's ``world``): ``[(case, class, detail)]``. ``runner`` is ``run_on_ranks`` (the
    tests pass theirs)."""
    runner = runner or testing.run_on_ranks
    rows = []
    for case in CASES if ids is None else [BY_ID[i] for i in ids]:
        if case.id in NEEDS_TRANSFORMERS and not _have_transformers():
            rows.append((case, "skipped", "transformers is not installed"))
            continue
        try:
            answers: list[tuple] | str = runner(_row, case.world, case.id, timeout=120)
        except Exception as e:  # noqa: BLE001 - a rank that died or never answered
            answers = f"{type(e).__name__}: {e}"
        rows.append((case, *classify(case, answers)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=[c.id for c in CASES], help="run only this case (repeatable)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    rows = run_cases(args.case)
    width = max(len(c.id) for c, _, _ in rows)
    for case, cls, detail in rows:
        print(f"{case.id:<{width}}  {cls:<8}  {case.what}\n{'':<{width}}  {'':<8}  {detail}")
    counts = {k: sum(cls == k for _, cls, _ in rows) for k in ("named", "unnamed", "correct", "silent", "skipped")}
    print(
        f"\n{len(rows)} cases in {time.monotonic() - t0:.0f} s: "
        + ", ".join(f"{n} {k}" for k, n in counts.items() if n or k != "skipped")
    )


if __name__ == "__main__":
    main()
