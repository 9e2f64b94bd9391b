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
    assert first_match(["blocks.1", "blocks.*"], names, "remat", "unit") == {
        "blocks.1": "blocks.1",
        "blocks.0": "blocks.*",
        "blocks.2": "blocks.*",
    }
    with pytest.raises(
        ValueError,
        match=r"remat pattern 'blocks.1' matches only 'blocks.1', which the earlier pattern\(s\) 'blocks.\*'",
    ):
        first_match(["blocks.*", "blocks.1"], names, "remat", "unit")
    with pytest.raises(ValueError, match="remat pattern 'blocks.9' matches no unit; did you mean"):
        first_match(["blocks.9"], names, "remat", "unit")


def test_the_memory_page_remat_example_means_what_it_says():
    """Before: every block got save_dots (the later pattern overwrote the earlier)."""
    plan = fsdpfn.plan(GPT(CFG), (2,), remat={"blocks.[0-5]": "full", "blocks.*": "save_dots"})
    assert _remats(plan) == {"<root>": "none", **{f"blocks.{i}": "full" if i < 6 else "save_dots" for i in range(8)}}
    with pytest.raises(
        ValueError, match=r"remat pattern 'blocks.\[0-5\]' matches only 'blocks.0', .*'blocks.\*' already claim"
    ):
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
    with pytest.raises(
        ValueError,
        match=r"tp pattern 'blocks.0.fc' matches only 'blocks.0.fc', which the earlier pattern\(s\) 'blocks.\*.fc'",
    ):
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
    def mp(exclude):
        return fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, fp8=fsdpfn.fp8.Float8GatherPolicy(exclude=exclude))

    model = GPT(GPTConfig(vocab_size=20, seq_len=8, width=32, depth=2, heads=2))
    fsdpfn.plan(model, (2,), mp=mp(["blocks.0.fc.weight", "*.out.weight"]))
    with pytest.raises(ValueError, match="exclude=...\\) pattern 'blocks.0.out.weight' matches only"):
        fsdpfn.plan(model, (2,), mp=mp(["*.out.weight", "blocks.0.out.weight"]))


def _muon_params():
    return {
        "blocks.0.qkv.weight": torch.randn(12, 4),
        "blocks.0.proj.weight": torch.randn(4, 4),
        "blocks.0.fc.weight": torch.randn(8, 4),
        "embed.weight": torch.randn(10, 4),
    }


def test_muon_blocks_pattern_matching_nothing_is_refused_at_init():
    """Before: blocks={'*qkv.wieght': 6} updated whole matrices without a word."""
    params = _muon_params()
    opt = optim.muon(blocks={"*qkv.wieght": 6})
    with pytest.raises(
        ValueError,
        match=r"muon: blocks pattern '\*qkv.wieght' matches no parameter Muon updates; did you mean 'blocks.0.qkv.weight'",
    ):
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
            torch.func.grad(
                lambda ps: F.cross_entropy(
                    torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)).flatten(0, 1), x.flatten()
                )
            )(params)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("style", ["runtime", "func"])
def test_save_names_with_an_unused_tag_is_refused_at_the_first_forward(run_on_ranks, style):
    """Before: the misspelt tag kept nothing, so the unit ran as remat='full' without a word."""
    for msg in run_on_ranks(_save_names_typo, 2, style):
        assert msg is not None and "'atention'" in msg and "'attention', 'mlp_up'" in msg and "'blocks.0'" in msg, msg


# --- remat replays that differ -------------------------------------------------------------


class _Counted(torch.nn.Module):
    """A block whose forward depends on how often it ran: the same operators every call, only a
    Python scalar changes, so a recompute runs the same operator list on other numbers."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.fc(x)) * (1.0 + 0.5 * (self.calls % 2))


class _Rolled(torch.nn.Module):
    """A Python choice (not torch's generator) that permutes values: same operators, same sums."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.choice = __import__("random").Random(4)  # draws 1, then 2: the recompute rolls by another shift

    def forward(self, x):
        return torch.roll(torch.tanh(self.fc(x)), self.choice.randint(1, 3), dims=-1)


class _Net(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([block, torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3))])
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


BLOCKS = {"counter": _Counted, "choice": _Rolled}


def _replay_case(rank, world, kind, policy, style):
    """One step of ``kind``'s net under ``policy``: ``"ok"`` and the gradients, or the error."""
    torch.manual_seed(0)
    model = _Net(
        BLOCKS[kind]() if kind in BLOCKS else torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    )
    plan = fsdpfn.plan(model, testing.mesh((world,)) if world > 1 else (1,), remat=policy)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    torch.manual_seed(7)
    try:
        if style == "runtime":
            rt = Runtime(model, plan)
            params = fsdpfn.shard(model, plan, requires_grad=True)
            with rt.bind(params):
                F.cross_entropy(model(x), y).backward()
            return "ok", {n: g.full_tensor() for n, g in rt.grads(params).items()}
        params = {n: p.detach().clone().requires_grad_(style == "eager") for n, p in model.named_parameters()}
        fsdpfn.transforms.apply_remat(model, plan)
        loss = lambda ps: F.cross_entropy(torch.func.functional_call(model, ps, (x,)), y)  # noqa: E731
        if style == "func":
            return "ok", torch.func.grad(loss)(params)
        loss(params).backward()
        return "ok", {n: p.grad for n, p in params.items()}
    except fsdpfn.RematReplayError as e:
        return "error", str(e)


@pytest.mark.parametrize("policy", ["full", "save_dots"])
@pytest.mark.parametrize("kind", ["counter", "choice"])
@pytest.mark.parametrize("style", ["func", "eager"])
def test_a_recompute_that_computes_other_numbers_is_refused_in_the_pure_loop(kind, policy, style):
    """Before: wrong gradients without a word (the counter's under full: off by a factor 1.5 or
    2; under save_dots the kept matmul hid nothing downstream). Now the first operator whose
    recomputed output differs from the forward's is named."""
    what, got = _replay_case(0, 1, kind, policy, style)
    assert what == "error", got
    op = "mul" if kind == "counter" else "roll"
    assert "unit 'blocks.0'" in got and f"aten.{op}" in got, got


@pytest.mark.parametrize("policy", ["full", "save_dots"])
@pytest.mark.parametrize("kind", ["counter", "choice"])
def test_a_recompute_that_computes_other_numbers_is_refused_in_the_runtime(run_on_ranks, kind, policy):
    for what, got in run_on_ranks(_replay_case, 2, kind, policy, "runtime"):
        assert what == "error" and "unit 'blocks.0'" in got, got


@pytest.mark.parametrize("policy", ["full", "save_dots"])
@pytest.mark.parametrize("style", ["func", "eager"])
def test_a_faithful_replay_with_dropout_passes_the_check(policy, style):
    """Dropout replays from the restored generator state: checked op by op, and accepted; the
    gradients are bitwise those without remat."""
    what, got = _replay_case(0, 1, "dropout", policy, style)
    _, plain = _replay_case(0, 1, "dropout", None, style)
    assert what == "ok", got
    assert all(torch.equal(got[n], plain[n]) for n in plain)


def test_compile_refuses_remat_units(run_on_ranks):
    for msg in run_on_ranks(_compile_remat, 2):
        assert "CompileUnsupportedError" in msg and "'blocks.0' (remat=" in msg, msg


def _compile_remat(rank, world):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, testing.mesh((world,)), remat={"blocks.0": "full"})
    params = fsdpfn.shard(model, plan)
    x = torch.randint(0, 20, (2, 8))
    try:
        fsdpfn.compile(
            lambda ps: F.cross_entropy(
                torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)).flatten(0, 1), x.flatten()
            ),
            backend="aot_eager",
        )(params)
    except Exception as e:  # noqa: BLE001  (dynamo may wrap it; the message must still name the unit)
        return f"{type(e).__name__}: {e}"
    return "compiled"


def test_muon_blocks_are_not_checked_against_a_tree_with_no_muon_leaf():
    """TorchOptimizer's recommended split gives the AdamW group a muon of its own, with the same
    blocks= and no Muon leaf: nothing to cut, nothing refused."""
    optim.muon(blocks={"*qkv.weight": 6}).init({"embed.weight": torch.zeros(10, 4), "norm.weight": torch.zeros(4)})
