"""One interpreter protocol for every step machine (see [Note: one interpreter protocol] in
``fsdpfn/_plan/interpret.py``): the executor, the pipeline runtime, the simulator and the
pipeline timing engine each take their vocabulary's op kinds through the one table of handlers,
bound when they are built; a missing handler is refused there, naming the kind; ``reset_step``
starts a step from nothing the last one left.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn._plan.interpret import FSDP_ACTIONS, HANDLERS, PIPELINE_ACTIONS, StepInterpreter, bind_handlers
from fsdpfn._plan.schedule import OpKind, schedule
from fsdpfn._plan.steps import step_ops
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import PipelineRuntime
from fsdpfn.runtime._executor import Executor
from fsdpfn.sim._pipeline_times import _Clocks
from fsdpfn.sim._simulate import _Builder

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = GPTConfig(vocab_size=32, width=16, depth=2, heads=2, seq_len=8)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(rows: int, seed: int):
    t = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def test_every_action_kind_has_one_handler_and_no_event_has_one():
    assert set(HANDLERS) == set(FSDP_ACTIONS) | set(PIPELINE_ACTIONS)
    assert not any(k.is_event for k in FSDP_ACTIONS)
    assert all(not k.is_event for k in OpKind if k in HANDLERS)
    assert set(FSDP_ACTIONS) == {k for k in OpKind if not k.is_event}


def _pipeline(schedule="gpipe", cls=PipelineRuntime, micro_batches=2, **kw):
    """Two stages on one pp rank."""
    model = _model()
    plan = fsdpfn.pipeline_plan(model, testing.mesh((1, 1), ("pp", "dp")), units=UNITS, stages=2)
    return model, cls(model, plan, schedule, micro_batches=micro_batches, loss_fn=kw.pop("loss_fn", _ce), **kw)


def _bound(rank, world):
    """The vocabulary each step machine of a rank binds."""
    model, pipe = _pipeline()
    rt = fsdpfn.runtime.Runtime(model, fsdpfn.plan(model, testing.mesh((1,))))
    out = {}
    for name, obj, handlers in (
        ("executor", rt._ex, rt._ex.handlers),
        ("pipeline runtime", pipe, pipe._handlers),
        ("a stage's executor", pipe._ex[0], pipe._ex[0].handlers),
    ):
        out[name] = (isinstance(obj, StepInterpreter), sorted(k.value for k in handlers))
    return out


def test_every_interpreter_binds_its_vocabulary(run_on_ranks):
    fsdp = sorted(k.value for k in FSDP_ACTIONS)
    pipeline = sorted(k.value for k in PIPELINE_ACTIONS)
    (got,) = run_on_ranks(_bound, 1)
    assert got == {
        "executor": (True, fsdp),
        "pipeline runtime": (True, pipeline),
        "a stage's executor": (True, fsdp),
    }
    # The simulator's and the timing engine's (no process group: an unbound plan).
    model = _model()
    plan = fsdpfn.plan(model, {"dp": 2})
    x, _ = _batch(2, 0)
    builder = _Builder(plan, fsdpfn.sim.profile(model, plan, x), fsdpfn.sim.H100_SXM, 0)
    ps = fsdpfn.pipeline_schedule(fsdpfn.Stages((("a",), ("b",)), 2), "zero_bubble", 4)
    clocks = _Clocks(ps, {}, hop=(0.0,), accumulate=(0.0, 0.0), start=(0.0, 0.0))
    assert isinstance(builder, StepInterpreter) and sorted(k.value for k in builder.handlers) == fsdp
    assert isinstance(clocks, StepInterpreter) and sorted(k.value for k in clocks.handlers) == pipeline


class _NoCopyOut(Executor):
    _copy_out = None  # an interpreter that forgot one kind of its vocabulary


def test_an_interpreter_without_a_handler_is_refused_when_built():
    model = _model()
    plan = fsdpfn.plan(model, {"dp": 2})
    with pytest.raises(TypeError, match=r"_NoCopyOut cannot interpret op kind 'copy_out': it has no method _copy_out"):
        _NoCopyOut(plan, schedule(plan))

    class Partial:
        def _gather(self, op):
            pass

    with pytest.raises(TypeError) as info:
        bind_handlers(Partial(), PIPELINE_ACTIONS)
    for kind in PIPELINE_ACTIONS:  # every missing kind is named at once
        assert f"'{kind.value}'" in str(info.value)


class _NoRecvGrad(PipelineRuntime):
    _recv_grad = None


def _pipeline_without_recv_grad(rank, world):
    try:
        _pipeline(cls=_NoRecvGrad)
    except TypeError as e:
        return str(e)
    return None


def test_a_pipeline_runtime_without_a_handler_is_refused_when_built(run_on_ranks):
    (err,) = run_on_ranks(_pipeline_without_recv_grad, 1)
    assert err == "_NoRecvGrad cannot interpret op kind 'recv_grad': it has no method _recv_grad", err


# ---- one table: no module maps op kinds to methods of its own ----------------------------------


def dispatch_tables(source: str) -> list[tuple[int, str]]:
    """``(line, key)`` of each dict entry that maps an op kind (``OpKind.X``, ``PipeKind.X``) to a
    method (``self.name``): a dispatch table of its own."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (
                    isinstance(key, ast.Attribute)
                    and isinstance(key.value, ast.Name)
                    and key.value.id in ("OpKind", "PipeKind")
                    and isinstance(value, ast.Attribute)
                    and isinstance(value.value, ast.Name)
                    and value.value.id == "self"
                ):
                    out.append((key.lineno, ast.unparse(key)))
    return out


def test_no_module_keeps_a_dispatch_table_of_its_own():
    found = {
        str(p.relative_to(ROOT)): dispatch_tables(p.read_text())
        for p in sorted((ROOT / "fsdpfn").rglob("*.py"))
        if p.name != "interpret.py"
    }
    assert {f: t for f, t in found.items() if t} == {}


def test_the_scan_sees_a_dispatch_table():
    """What the executor, the pipeline runtime and the simulator each held before."""
    source = "actions = {OpKind.GATHER: self._gather, OpKind.WAIT: self.wait}\nrun = {PipeKind.SEND_ACT: self._send}\n"
    assert dispatch_tables(source) == [(1, "OpKind.GATHER"), (1, "OpKind.WAIT"), (2, "PipeKind.SEND_ACT")]
    assert dispatch_tables("cost = {PipeKind.STAGE_FORWARD: forward}") == []  # a value table, not dispatch


# ---- reset_step: nothing of one step reaches the next --------------------------------------------


class _Boom(Exception):
    pass


def _after_a_failed_step(rank, world):
    """A pipelined step that fails in its third micro-batch's loss (the first two have run their
    backward by then: one's gradients kept summed, the other's waiting to be added), then a step:
    its gradients and loss against a fresh runtime's, bitwise."""
    calls = [0]

    def flaky(logits, y):
        calls[0] += 1
        if calls[0] == 3:
            raise _Boom("the loss of micro-batch 2")
        return _ce(logits, y)

    x, y = _batch(6, 1)
    model, pipe = _pipeline("interleaved_1f1b", loss_fn=flaky, verify=False, micro_batches=3)
    params = pipe.shard(model)
    try:
        pipe.step(params, x, y)
    except _Boom:
        pass
    grads, loss = pipe.step(params, x, y)
    model, fresh = _pipeline("interleaved_1f1b", verify=False, micro_batches=3)
    ref, ref_loss = fresh.step(fresh.shard(model), x, y)
    return torch.equal(loss, ref_loss) and all(torch.equal(grads[n].to_local(), ref[n].to_local()) for n in ref)


def test_a_step_after_a_failed_one_starts_from_nothing(run_on_ranks):
    assert run_on_ranks(_after_a_failed_step, 1) == [True]


def test_the_simulator_reset_makes_the_same_tasks():
    model = _model()
    plan = fsdpfn.plan(model, {"dp": 2})
    x, _ = _batch(2, 0)
    wl = fsdpfn.sim.profile(model, plan, x)
    ops = step_ops(plan, schedule(plan), micro_batches=2, tokens=wl.tokens)
    builder = _Builder(plan, wl, fsdpfn.sim.H100_SXM, 0)
    builder.step(ops)
    first = [(t.stream, t.kind, t.unit, t.nbytes) for t in builder.tasks]
    builder.reset_step()
    builder.step(ops)
    assert [(t.stream, t.kind, t.unit, t.nbytes) for t in builder.tasks] == first and first
