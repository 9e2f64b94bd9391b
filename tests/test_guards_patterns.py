"""Pattern arguments (``tp``, ``remat``, ``offload``, ``experts``, fp8 ``exclude``, Muon's
``blocks``) follow one rule: the first pattern that matches a name wins, and a pattern that
matches nothing, or only names earlier patterns claimed, is refused by name. A
``save_names:`` policy naming a tag the model never uses is refused at the unit's first
forward, on every rank, instead of silently running as ``full``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn._patterns import first_match
from fsdpfn.models import GPT, GPTConfig, MoE, MoEConfig
from fsdpfn.runtime import Runtime

CFG = GPTConfig(vocab_size=20, seq_len=8, width=16, depth=8, heads=2)


def _remats(plan):
    return {u.label: u.remat for u in plan.units}


def test_first_match_is_the_one_rule():
    names = ["blocks.0", "blocks.1", "blocks.2"]
    assert first_match(["blocks.1", "blocks.*"], names, "remat", "unit") == {"blocks.1": "blocks.1", "blocks.0": "blocks.*", "blocks.2": "blocks.*"}
    with pytest.raises(ValueError, match=r"remat pattern 'blocks.1' matches only 'blocks.1', which the earlier pattern\(s\) 'blocks.\*'"):
        first_match(["blocks.*", "blocks.1"], names, "remat", "unit")
    with pytest.raises(ValueError, match="remat pattern 'blocks.9' matches no unit; did you mean"):
        first_match(["blocks.9"], names, "remat", "unit")


def test_the_memory_page_remat_example_means_what_it_says():
    """Before: every block got save_dots (the later pattern overwrote the earlier)."""
    plan = fsdpfn.plan(GPT(CFG), (2,), remat={"blocks.[0-5]": "full", "blocks.*": "save_dots"})
    assert _remats(plan) == {"<root>": "none", **{f"blocks.{i}": "full" if i < 6 else "save_dots" for i in range(8)}}
    with pytest.raises(ValueError, match=r"remat pattern 'blocks.\[0-5\]' matches only 'blocks.0', .*'blocks.\*' already claim"):
        fsdpfn.plan(GPT(CFG), (2,), remat={"blocks.*": "save_dots", "blocks.[0-5]": "full"})


def test_offload_first_match_wins_and_dead_patterns_are_refused():
    plan = fsdpfn.plan(GPT(CFG), (2,), offload={"blocks.0": False, "blocks.*": True})
    assert [u.offload for u in plan.units] == [False, False] + [True] * 7
    with pytest.raises(ValueError, match="offload pattern 'blocks.0' matches only"):
        fsdpfn.plan(GPT(CFG), (2,), offload={"blocks.*": True, "blocks.0": False})


TP = {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def test_tp_first_match_wins_and_dead_patterns_are_refused():
    """Before: overlapping patterns with different styles were refused, with the same style
    accepted whatever their order; now the first wins, so 'replicate' can carve out one module."""
    model = GPT(GPTConfig(vocab_size=20, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp={"blocks.0.fc": "replicate", "blocks.0.out": "replicate", **TP})
    assert plan.param("blocks.0.fc.weight").tp == "replicate" and plan.param("blocks.1.fc.weight").tp == "shard0"
    with pytest.raises(ValueError, match=r"tp pattern 'blocks.0.fc' matches only 'blocks.0.fc', which the earlier pattern\(s\) 'blocks.\*.fc'"):
        fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp={**TP, "blocks.0.fc": "replicate"})


def _moe_model():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE(MoEConfig(width=8, hidden=12, experts=4, top_k=2))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    return Net()


def test_experts_dead_patterns_are_refused():
    model = _moe_model()
    plan = fsdpfn.plan(model, {"ep": 2, "edp": 1}, experts={"blocks.0.moe.experts.w*": 2, "blocks.*.moe.experts.w*": 1})
    assert {u.label: u.top_k for u in plan.units if u.experts} == {"blocks.0.moe.experts": 2, "blocks.1.moe.experts": 1}
    with pytest.raises(ValueError, match="experts pattern 'blocks.0.moe.experts.w1' matches only"):
        fsdpfn.plan(model, {"ep": 2, "edp": 1}, experts=["blocks.*.moe.experts.w*", "blocks.0.moe.experts.w1"])


def test_fp8_exclude_dead_patterns_are_refused():
    mp = lambda exclude: fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, fp8=fsdpfn.fp8.Float8GatherPolicy(exclude=exclude))  # noqa: E731
    model = GPT(GPTConfig(vocab_size=20, seq_len=8, width=32, depth=2, heads=2))
    fsdpfn.plan(model, (2,), mp=mp(["blocks.0.fc.weight", "*.out.weight"]))
    with pytest.raises(ValueError, match="exclude=...\\) pattern 'blocks.0.out.weight' matches only"):
        fsdpfn.plan(model, (2,), mp=mp(["*.out.weight", "blocks.0.out.weight"]))


def _muon_params():
    return {"blocks.0.qkv.weight": torch.randn(12, 4), "blocks.0.proj.weight": torch.randn(4, 4), "blocks.0.fc.weight": torch.randn(8, 4),
            "embed.weight": torch.randn(10, 4)}


def test_muon_blocks_pattern_matching_nothing_is_refused_at_init():
    """Before: blocks={'*qkv.wieght': 6} updated whole matrices without a word."""
    params = _muon_params()
    opt = optim.muon(blocks={"*qkv.wieght": 6})
    with pytest.raises(ValueError, match=r"muon: blocks pattern '\*qkv.wieght' matches no parameter Muon updates; did you mean 'blocks.0.qkv.weight'"):
        opt.init(params)
    with pytest.raises(ValueError, match=r"blocks pattern 'blocks.0.qkv.weight' matches only .*'\*qkv.weight'"):
        optim.muon(blocks={"*qkv.weight": 6, "blocks.0.qkv.weight": 3}).init(params)
    # A pattern that only matches a leaf AdamW updates never applies either.
    with pytest.raises(ValueError, match="'embed.weight' matches no parameter Muon updates"):
        optim.muon(blocks={"embed.weight": 2}).init(params)
    optim.muon(blocks={"*qkv.weight": 6, "*proj.weight": (1, 2)}).init(params)
    with pytest.raises(ValueError, match=r"scale_by_muon: blocks pattern '\*qkv.wieght' matches no parameter"):
        optim.scale_by_muon(blocks={"*qkv.wieght": 6}).init(params)


def _save_names_typo(rank, world, style):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, testing.mesh((world,)), remat="save_names:atention")
    x = torch.randint(0, 20, (2, 8))
    try:
        if style == "runtime":
            rt = Runtime(model, plan)
            params = fsdpfn.shard(model, plan, requires_grad=True)
            with rt.bind(params):
                F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        else:
            params = fsdpfn.shard(model, plan)
            torch.func.grad(lambda ps: F.cross_entropy(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)).flatten(0, 1),
                                                        x.flatten()))(params)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("style", ["runtime", "func"])
def test_save_names_with_an_unused_tag_is_refused_at_the_first_forward(run_on_ranks, style):
    """Before: the misspelt tag kept nothing, so the unit ran as remat='full' without a word."""
    for msg in run_on_ranks(_save_names_typo, 2, style):
        assert msg is not None and "'atention'" in msg and "'attention', 'mlp_up'" in msg and "'blocks.0'" in msg, msg
