"""fsdpfn.step_collectives, the one list of a step's collectives, against real steps: every
collective a runtime step (or the pure path) issues, as fsdpfn.comm.count_collectives records it,
equals the list call for call (kind, group size, bytes, dtype, tag, phase, micro-batch; in order
for the runtime) for every strategy, HSDP, FP8 gathers, tensor parallelism and accumulation;
plan.cost() and the simulator are its sums; zero1 accumulates locally and still matches one
process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import runtime, sim, testing
from fsdpfn._plan.steps import reduces_now, static_memory, step_collectives, totals
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import Runtime

# 29 vocabulary rows: uneven over 2 and 4 data-parallel ranks. Width 32 and 4 heads split over tp 2 and 4.
CFG = GPTConfig(vocab_size=29, seq_len=8, width=32, depth=2, heads=4)
PER_RANK = 2
MIXED = {"*": "zero3", "<root>": "zero2", "blocks.1": "replicate"}
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _batch(dp, micro, step=0, cfg=CFG):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (micro * dp * PER_RANK, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _slice(dp_rank, dp, m):
    """Rows of micro-batch ``m`` read by data-parallel rank ``dp_rank``."""
    start = (m * dp + dp_rank) * PER_RANK
    return slice(start, start + PER_RANK)


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@dataclasses.dataclass(frozen=True)
class Case:
    mesh: tuple
    names: tuple | None = None
    strategy: object = "zero3"
    fp8: str | None = None
    tp: bool = False
    micro: int = 1
    accumulate: str = "reduce"
    raf: bool | None = None
    prefetch: int = 1
    path: str = "runtime"  # or "pure": fsdpfn.unshard + loss.backward()

    def __str__(self):
        return "-".join(str(v) for v in dataclasses.astuple(self) if v not in (None, False, "reduce", "runtime", 1))


def _key(m, phase, kind, size, nbytes, dtype, tag):
    return (m, phase, kind, size, nbytes, str(dtype).removeprefix("torch."), tag)


def _counted_steps(rank, world, cases):
    """Each case: one step (its micro-batches), every collective counted per phase, beside the list."""
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = GPT(CFG)
        mesh = testing.mesh(case.mesh, case.names)
        mp = fsdpfn.MixedPrecision(**BF16, fp8=case.fp8) if case.fp8 else None
        plan = fsdpfn.plan(model, mesh, strategy=case.strategy, mp=mp, tp=GPT_TP_PLAN if case.tp else None)
        params = fsdpfn.shard(model, plan, requires_grad=True)
        dp, dp_rank = plan.dp_size, fsdpfn.transforms.dp_rank(plan)
        x, y = _batch(dp, case.micro)
        rt = (
            Runtime(model, plan, prefetch=case.prefetch, reshard_after_forward=case.raf, accumulate=case.accumulate)
            if case.path == "runtime"
            else None
        )
        counted = []
        for m in range(case.micro):
            s = _slice(dp_rank, dp, m)
            with rt.accumulating() if rt is not None and m < case.micro - 1 else _null():
                with fsdpfn.count_collectives() as fwd:
                    if rt is not None:
                        logits = rt.apply(params, x[s])
                    else:
                        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x[s],))
                loss = _ce(logits, y[s]) / case.micro
                with fsdpfn.count_collectives() as bwd:
                    loss.backward()
            for phase, counter in (("forward", fwd), ("backward", bwd)):
                counted += [_key(m, phase, c.kind, c.group_size, c.nbytes, c.dtype, c.tag) for c in counter.calls]
        tokens = PER_RANK * CFG.seq_len
        listed_calls = step_collectives(
            plan,
            schedule=rt.schedule if rt is not None else None,
            reshard_after_forward=False if rt is None else case.raf,
            micro_batches=case.micro,
            accumulate=case.accumulate,
            tokens=tokens,
        )
        listed = [_key(c.micro_batch, c.phase, c.kind, c.group_size, c.nbytes, c.dtype, c.tag) for c in listed_calls]
        if rt is None:  # the pure path gathers every unit before the model runs: compare as multisets
            counted, listed = sorted(counted, key=str), sorted(listed, key=str)
        cost = plan.cost(
            False if rt is None else case.raf,
            case.prefetch,
            tokens=tokens,
            micro_batches=case.micro,
            accumulate=case.accumulate,
        )
        by_kind = {}
        for k in counted:
            t = by_kind.setdefault(k[2], [0, 0, 0.0])
            t[0] += 1
            t[1] += k[4]
            t[2] += (2.0 if k[2] == "all_reduce" else 1.0) * (k[3] - 1) / k[3] * k[4]
        cost_ok = {k: (c.calls, c.nbytes) for k, c in cost.collectives.items()} == {
            k: (v[0], v[1]) for k, v in by_kind.items()
        } and all(math.isclose(cost.collectives[k].wire_bytes, v[2], rel_tol=1e-12) for k, v in by_kind.items())
        first_diff = next(((i, a, b) for i, (a, b) in enumerate(zip(counted, listed)) if a != b), None)
        out.append(
            dict(
                case=case,
                equal=counted == listed,
                lengths=(len(counted), len(listed)),
                first_diff=first_diff,
                cost_ok=cost_ok,
                tp_calls=sum(1 for k in counted if k[6].startswith("blocks.") and "." in k[6][7:]),
            )
        )
    return out


FLAT = [
    Case((4,), strategy="zero3"),
    Case((4,), strategy="zero3", raf=True, prefetch=2),
    Case((4,), strategy="zero3", raf=False, prefetch=0),
    Case((4,), strategy="zero2"),
    Case((4,), strategy="zero1"),
    Case((4,), strategy="replicate"),
    Case((4,), strategy=MIXED),
    Case((4,), strategy="zero3", path="pure"),
    Case((4,), strategy="zero1", micro=3),
    Case((4,), strategy="zero2", micro=3),
    Case((4,), strategy="zero3", micro=3, accumulate="local"),
    Case((4,), strategy="zero3", fp8="mxfp8"),
    Case((4,), strategy="zero2", fp8="tensorwise", micro=2),
]
HSDP = [
    Case((2, 2), ("replicate", "shard"), strategy="zero3"),
    Case((2, 2), ("replicate", "shard"), strategy="zero1", micro=2),
    Case((2, 2), ("replicate", "shard"), strategy="zero3", fp8="tensorwise", raf=True),
]
TP = [
    Case((2, 2), ("dp", "tp"), strategy="zero3", tp=True),
    Case((2, 2), ("dp", "tp"), strategy="zero2", tp=True, prefetch=0),
    Case((2, 2), ("dp", "tp"), strategy="zero3", tp=True, path="pure"),
    Case((2, 2), ("dp", "tp"), strategy="zero1", tp=True, micro=3),
    Case((2, 2), ("dp", "tp"), strategy="zero3", tp=True, fp8="tensorwise"),
    Case((1, 4), ("dp", "tp"), strategy="zero3", tp=True),
    Case((4, 1), ("dp", "tp"), strategy="zero3", tp=True),
]


@pytest.mark.parametrize("cases", [FLAT, HSDP, TP], ids=["flat", "hsdp", "tp"])
def test_a_real_step_issues_exactly_the_listed_collectives(run_on_ranks, cases):
    for rank, results in enumerate(run_on_ranks(_counted_steps, 4, cases)):
        for r in results:
            case = r["case"]
            assert r["equal"], (rank, str(case), r["lengths"], r["first_diff"])
            assert r["cost_ok"], (rank, str(case))  # plan.cost() is the list's sum
            # Tensor parallel: 2 forward + 2 backward activation all-reduces per block and micro-batch, counted.
            assert r["tp_calls"] == (4 * CFG.depth * case.micro if case.tp else 0), str(case)


# ---------------------------------------------------------------------------------------------
# zero1: one reduce per step, and the one-process gradient
# ---------------------------------------------------------------------------------------------


def _accumulated(rank, world, micro):
    """zero1 and zero2 over ``micro`` micro-batches (accumulate="reduce"); the gradient each
    returns in total, and the parts the one-process reference sums."""
    out = {}
    for strategy in ("zero1", "zero2"):
        torch.manual_seed(0)
        model = GPT(CFG)
        plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy)
        params = fsdpfn.shard(model, plan)
        rt = Runtime(model, plan)
        x, y = _batch(world, micro, step=7)
        total = None
        with fsdpfn.count_collectives() as counter:
            for m in range(micro):
                s = _slice(rank, world, m)
                with rt.accumulating() if m < micro - 1 else _null():
                    g, _ = rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x[s]), y[s]) / micro)(params)
                total = g if total is None else {n: total[n] + g[n] for n in g}
        listed = totals(step_collectives(plan, micro_batches=micro))
        out[strategy] = dict(
            reduces=counter.counts()["reduce_scatter"],
            listed=listed["reduce_scatter"].calls,
            units=len(plan.units),
            grads={n: t.full_tensor() for n, t in total.items()},
        )
    # One process: every (rank, micro-batch) part of the gradient, as a rank computes it.
    torch.manual_seed(0)
    model = GPT(CFG)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batch(world, micro, step=7)
    parts = [
        torch.func.grad(lambda ps: _ce(torch.func.functional_call(model, ps, (x[s],)), y[s]) / micro)(full)
        for m in range(micro)
        for s in [_slice(r, world, m) for r in range(world)]
    ]
    return out, parts


def test_zero1_reduces_once_per_step_and_matches_one_process(run_on_ranks):
    """zero1 sums its full gradients over the micro-batches and reduces once; zero2 reduces each.

    Tolerance: both totals are the sum of the same n = world x micro = 6 fp32 gradient parts
    (each rank's micro-batch gradient, which it computes exactly as one process does on that
    slice), times 1/world = 1/2 (exact), in two different orders. A sum of n floats in any order
    is within gamma_(n-1) * sum |part| of the exact sum (gamma_k = k u / (1 - k u), u = 2^-24;
    Higham, Accuracy and Stability, 4.2), elementwise. So each run is compared with the exact
    (float64) sum of the one-process parts within that bound.
    """
    world, micro = 2, 3
    results = run_on_ranks(_accumulated, world, micro)
    out, parts = results[0]
    for strategy, r in out.items():
        assert r["listed"] == r["reduces"], strategy
    assert out["zero1"]["reduces"] == out["zero1"]["units"]  # one per unit per step
    assert out["zero2"]["reduces"] == micro * out["zero2"]["units"]  # one per unit per micro-batch
    n = world * micro
    u = 2.0**-24
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    for name in parts[0]:
        exact = sum(p[name].double() for p in parts) / world
        bound = gamma * sum(p[name].double().abs() for p in parts) / world
        for strategy in ("zero1", "zero2"):
            got = out[strategy]["grads"][name].double()
            excess = ((got - exact).abs() - bound).max().item()
            assert excess <= 0.0, (strategy, name, excess)


# ---------------------------------------------------------------------------------------------
# The list without ranks: the default walk, plan.cost(), tensor-parallel sizes, the simulator
# ---------------------------------------------------------------------------------------------


def _meta_model(cfg=CFG):
    torch.manual_seed(0)
    with torch.device("meta"):
        return GPT(cfg)


def _strip(calls):
    return [dataclasses.replace(c, op=-1) for c in calls]


@pytest.mark.parametrize("mesh", [(4,), (2, 2), {"dp": 2, "tp": 2}], ids=["flat", "hsdp", "tp"])
@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "replicate", "mixed"])
def test_default_walk_equals_the_runtime_schedule(mesh, strategy):
    """Without a schedule the list follows the runtime's default schedule: in order with
    prefetch 0, the same calls with any prefetch (prefetch moves gathers earlier, adds none)."""
    plan = fsdpfn.plan(
        _meta_model(),
        mesh,
        strategy=MIXED if strategy == "mixed" else strategy,
        tp=GPT_TP_PLAN if isinstance(mesh, dict) else None,
    )
    for raf in (None, True, False):
        for micro, acc in ((1, "reduce"), (3, "reduce"), (3, "local")):
            kw = dict(micro_batches=micro, accumulate=acc, tokens=16)
            default = step_collectives(plan, reshard_after_forward=raf, **kw)
            assert _strip(step_collectives(plan, schedule=runtime.schedule(plan, 0, raf), **kw)) == list(default)
            for prefetch in (1, 2):
                walked = step_collectives(plan, schedule=runtime.schedule(plan, prefetch, raf), **kw)
                assert sorted(map(str, _strip(walked))) == sorted(map(str, default))


def test_tp_activation_bytes_and_smaller_gathers():
    """Per GPT block under GPT_TP_PLAN: proj and out (rowwise) all-reduce tokens x width in
    forward; qkv and fc (colwise) all-reduce their input's gradient, tokens x width, in backward.
    Without tokens they are listed with 0 bytes and the printout says so. Gathers carry the
    tp-local parameters: the split ones 1/tp of their size."""
    cfg = dataclasses.replace(CFG, vocab_size=32, bias=False)  # dims divide over dp: no padding
    model = _meta_model(cfg)
    tokens = 2 * 8
    for dp, tp in ((2, 2), (1, 4), (4, 1)):
        plan = fsdpfn.plan(model, {"dp": dp, "tp": tp}, tp=GPT_TP_PLAN)
        calls = step_collectives(plan, tokens=tokens)
        act = [c for c in calls if c.activation]
        assert len(act) == 4 * cfg.depth and {c.group_size for c in act} == {tp}
        assert all(c.nbytes == tokens * cfg.width * 4 and c.dtype == torch.float32 for c in act)
        assert {(c.phase, c.tag.rsplit(".", 1)[1]) for c in act} == {
            ("forward", "proj"),
            ("forward", "out"),
            ("backward", "qkv"),
            ("backward", "fc"),
        }
        assert all(c.wire_bytes == 2 * (tp - 1) / tp * c.nbytes for c in act)
        blind = plan.cost()
        assert "listed with 0 bytes" in str(blind) and "tokens" in str(blind)
        assert blind.collectives["all_reduce"].calls == 4 * cfg.depth and blind.collectives["all_reduce"].nbytes == 0
        assert plan.cost(tokens=tokens).collectives["all_reduce"].nbytes == 4 * cfg.depth * tokens * cfg.width * 4
        # Gathers: a block's split weights (and colwise biases) count 1/tp.
        split = {f"blocks.{i}.{m}.weight" for i in range(cfg.depth) for m in ("qkv", "proj", "fc", "out")}
        params = dict(model.named_parameters())
        want = sum((p.numel() // (tp if n in split else 1)) * 4 for n, p in params.items())
        gathered = sum(c.nbytes for c in calls if c.purpose == "gather" and c.phase == "forward")
        assert gathered == want, (dp, tp)


def test_cost_and_static_memory_are_the_lists_sums():
    plan = fsdpfn.plan(
        _meta_model(),
        (3,),
        strategy={"*": "zero3", "<root>": "zero2", "blocks.1": "zero1"},
        mp=fsdpfn.MixedPrecision(**BF16, fp8="tensorwise"),
    )
    for raf in (None, True, False):
        cost = plan.cost(raf, micro_batches=2)
        listed = totals(step_collectives(plan, reshard_after_forward=raf, micro_batches=2))
        assert {k: (c.calls, c.nbytes, c.wire_bytes) for k, c in cost.collectives.items()} == {
            k: (t.calls, t.nbytes, t.wire_bytes) for k, t in listed.items()
        }
        assert (
            cost.by(lambda c: c.purpose)["amax"].calls == cost.by(lambda c: c.purpose)["gather"].calls
        )  # one per FP8 gather
    mem = static_memory(plan)
    assert {k: plan.cost().memory[k] for k in mem} == mem
    zero1 = fsdpfn.plan(_meta_model(), (3,), strategy="zero1")
    assert static_memory(zero1)["grads"] == sum(p.numel * 4 for u in zero1.units for p in u.params)
    assert [reduces_now(u, last=False) for u in zero1.units] == [False] * len(zero1.units)
    with pytest.raises(ValueError, match="accumulate"):
        step_collectives(plan, accumulate="sum")
    with pytest.raises(ValueError, match="tokens"):
        plan.cost(tokens=-1)


HW = sim.Hardware(
    "test",
    {"float32": 1e11, "bfloat16": 1e11, "attention float32": 2e10, "attention bfloat16": 2e10},
    1e10,
    2**34,
    2,
    intra=sim.Link(2e-5, 1e9),
    inter=sim.Link(5e-5, 1e8),
    overlap=0.5,
    op_overhead=1e-6,
)


@pytest.mark.parametrize("kind", ["fp8", "tp", "tp-hsdp", "zero1-accumulate"])
def test_the_simulator_times_the_list(kind):
    """The simulator's traffic is plan.cost()'s, FP8 gathers and tensor-parallel activations
    (with the workload's tokens) included; tp collectives run on their own blocking stream."""
    model = _meta_model()
    x = torch.zeros(2, CFG.seq_len, dtype=torch.long, device="meta")
    mp = fsdpfn.MixedPrecision(**BF16, fp8="tensorwise") if kind == "fp8" else None
    mesh = {
        "fp8": (4,),
        "tp": {"dp": 2, "tp": 2},
        "tp-hsdp": {"replicate": 2, "shard": 2, "tp": 2},
        "zero1-accumulate": (4,),
    }[kind]
    plan = fsdpfn.plan(
        model,
        mesh,
        mp=mp,
        tp=GPT_TP_PLAN if kind.startswith("tp") else None,
        strategy="zero1" if kind == "zero1-accumulate" else "zero3",
    )
    wl = sim.profile(model, plan, x)
    assert wl.tokens == 2 * CFG.seq_len
    micro = 3 if kind == "zero1-accumulate" else 1
    for prefetch in (0, 1):
        r = sim.simulate(plan, runtime.schedule(plan, prefetch), wl, sim.AdamW(), HW, micro_batches=micro)
        cost = plan.cost(prefetch=prefetch, tokens=wl.tokens, micro_batches=micro)
        assert {k: (t.calls, t.nbytes) for k, t in r.traffic["step"].items()} == {
            k: (c.calls, c.nbytes) for k, c in cost.collectives.items()
        }
        assert r.memory["grads"] == cost.memory["grads"]
        tp_spans = [s for s in r.spans if s.stream == "tp"]
        assert len(tp_spans) == (4 * CFG.depth if kind.startswith("tp") else 0)
        if kind == "fp8":
            assert cost.by(lambda c: c.dtype)[torch.uint8].calls == cost.collectives["all_gather"].calls
        if kind == "zero1-accumulate":
            assert r.traffic["step"]["reduce_scatter"].calls == len(plan.units)
