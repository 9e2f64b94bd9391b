"""A tensor-parallel style is one row of ``fsdpfn/_plan/tp_styles.py``: the plan builder, the
layout rules, the op list, the runtime's hooks, the checks and the simulator's profile read the
row's fields, never the style's name.

The proof: every row copied under a new name (``"my_rowwise"`` is ``"rowwise"``'s row, renamed)
gives a plan with the same placements, the same collectives on the op list and in the
simulator, the same layout errors, and, trained on 2 ranks, the same numbers bitwise and the
same collectives counted as the plan with the table's own names. Bitwise, because both plans
run the same operators on the same values in the same order. A reader that still compared
names (``style == "rowwise"``) would miss the renamed row and fail here.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import pathlib

import pytest
import torch

import fsdpfn
from fsdpfn import testing
from fsdpfn._plan import tp_styles
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import Runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = GPTConfig(vocab_size=32, seq_len=8, width=16, depth=2, heads=4, bias=True)
# Every style of the table once: qkv colwise, proj rowwise, fc gathered back (so out is whole,
# marked replicate), the embedding over its vocabulary, the head's logits split for the loss.
STYLES = {
    **GPT_TP_PLAN,
    "blocks.*.fc": "colwise_gather",
    "blocks.*.out": "replicate",
    "embed": "vocab",
    "head": "colwise_loss",
}
RENAMED = {k: v if v == "replicate" else f"my_{v}" for k, v in STYLES.items()}


@contextlib.contextmanager
def renamed_rows():
    """The table with each row also under ``my_<name>`` (the same fields)."""
    table = tp_styles._BY_NAME
    saved = dict(table)
    table.update({f"my_{n}": dataclasses.replace(row, name=f"my_{n}") for n, row in saved.items()})
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def test_every_style_of_the_table_is_used_here():
    assert {v for v in STYLES.values() if v != "replicate"} == set(tp_styles.style_names())


def _listed(plan):
    key = lambda c: (c.phase, c.kind, c.group_size, c.nbytes, str(c.dtype), c.tag)  # noqa: E731
    return [key(c) for c in fsdpfn.step_collectives(plan, tokens=2 * CFG.seq_len)]


def test_a_renamed_row_gives_the_same_plan_op_list_and_profile():
    model = GPT(CFG)
    mesh = {"dp": 2, "tp": 2}
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    plan = fsdpfn.plan(model, mesh, tp=STYLES)
    with renamed_rows():
        renamed = fsdpfn.plan(model, mesh, tp=RENAMED)
        assert dict(renamed.tp) == {n: f"my_{s}" for n, s in plan.tp}
        assert {n: renamed.param(n).placements for n in renamed.param_names} == {
            n: plan.param(n).placements for n in plan.param_names
        }
        assert _listed(renamed) == _listed(plan)
        assert any(t[1] == "all_gather" and t[-1] == "blocks.0.fc" for t in _listed(plan))  # every kind is there
        assert {t[-1] for t in _listed(plan)} >= {"embed", "head", "blocks.0.proj", "vocab_max", "vocab_sum"}
        assert renamed.cost() == plan.cost()
        got = fsdpfn.sim.profile(model, renamed, x)
        want = fsdpfn.sim.profile(model, plan, x)
        assert [(op, w.flops, w.bytes) for op, w in got.work] == [(op, w.flops, w.bytes) for op, w in want.work]


@pytest.mark.parametrize(
    "bad",
    [
        {"blocks.*.qkv": "colwise", "blocks.*.proj": "colwise", "blocks.*.fc": "colwise", "blocks.*.out": "colwise"},
        {"blocks.*.qkv": "rowwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "rowwise", "blocks.*.out": "rowwise"},
        {"blocks.*.qkv": "colwise"},
        {"blocks.*.fc": "vocab"},
        {"embed": "colwise"},
    ],
    ids=["no-rowwise-partner", "no-colwise-partner", "half-split", "vocab-on-a-linear", "colwise-on-an-embedding"],
)
def test_a_renamed_row_is_refused_by_the_same_rules(bad):
    def error(tp):
        with pytest.raises((ValueError, NotImplementedError)) as e:
            fsdpfn.plan(GPT(CFG), {"dp": 1, "tp": 2}, tp=tp)
        return type(e.value), str(e.value)

    want = error(bad)
    with renamed_rows():
        kind, text = error({k: f"my_{v}" for k, v in bad.items()})
    assert (kind, text.replace("my_", "")) == want


def _train(rank, world, steps=2):
    """Both plans trained ``steps`` SGD steps by the runtime: their parameters and the
    collectives each step counted."""
    mesh = testing.mesh((1, 2), ("dp", "tp"))
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen) for _ in range(steps)]
    out = []
    with renamed_rows():
        for tp in (STYLES, RENAMED):
            torch.manual_seed(0)
            model = GPT(CFG)
            plan = fsdpfn.plan(model, mesh, tp=tp)
            params = fsdpfn.shard(model, plan, requires_grad=True)
            rt = Runtime(model, plan)
            opt = fsdpfn.optim.sgd(0.2)
            state = opt.init(params)
            counted = []
            for b in batches:
                with fsdpfn.count_collectives() as ctr, rt.bind(params):
                    fsdpfn.vocab_parallel_cross_entropy(model(b[:, :-1]), b[:, 1:], plan).backward()
                counted.append([(c.kind, c.group_size, c.nbytes, str(c.dtype), c.tag) for c in ctr.calls])
                with torch.no_grad():
                    updates, state = opt.update(rt.grads(params), state, params)
                    params = fsdpfn.optim.apply_updates(params, updates)
                params = {n: p.detach().requires_grad_() for n, p in params.items()}
            out.append(({n: p.to_local().detach().clone() for n, p in params.items()}, counted))
    return out


def test_a_renamed_row_trains_bitwise_alike_with_the_same_collectives(run_on_ranks):
    for (want, want_calls), (got, got_calls) in run_on_ranks(_train, 2):
        assert got_calls == want_calls
        assert {"all_gather", "all_reduce"} <= {c[0] for step in got_calls for c in step}
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def _style_names_in_code(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each string constant outside docstrings that is a style's name."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names = set(tp_styles.style_names())
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and id(node) not in docs
        and isinstance(node.value, str)
        and (node.value in names or node.value.startswith(tp_styles.TP_FUSED_PREFIX))
    ]


def test_no_reader_names_a_style():
    """Only the table names the styles; the models' ready-made ``tp=`` dicts are users of it."""
    table = ROOT / "fsdpfn/_plan/tp_styles.py"
    found = {
        str(p.relative_to(ROOT)): hits
        for p in sorted((ROOT / "fsdpfn").rglob("*.py"))
        if p != table and "models" not in p.parts and (hits := _style_names_in_code(p.read_text(encoding="utf-8")))
    }
    assert not found, found


def test_the_scan_sees_a_name_in_code_and_not_in_a_docstring():
    source = '''
def f(style):
    """A "rowwise" layer in a docstring is not a branch."""
    return style == "rowwise" or style.startswith("colwise_fused:")
'''
    assert _style_names_in_code(source) == [(4, "rowwise"), (4, "colwise_fused:")]
