"""The runtime on a Hugging Face model (its ``ModelOutput``, a ``dict`` subclass, flows through
the runtime like any tensor tree), the clean end of a job (:func:`fsdpfn.launch.shutdown`), the
gloo work kept alive past a step holding no gathered parameters, and ``fsdpfn.compile``'s
refusals of what it cannot trace."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import fsdpfn
from fsdpfn import comm, testing
from fsdpfn._tree import flatten, unflatten
from fsdpfn.runtime import Runtime

U32 = 2.0**-24  # float32's unit roundoff


# ---------------------------------------------------------------------------------------------
# Mapping outputs: every mapping class is flattened, whatever its type
# ---------------------------------------------------------------------------------------------


class _Out(collections.OrderedDict):
    pass


@dataclasses.dataclass
class _DataOut(collections.OrderedDict):
    logits: torch.Tensor
    aux: torch.Tensor

    def __post_init__(self):
        for f in dataclasses.fields(self):
            self[f.name] = getattr(self, f.name)


class _Unbuildable(dict):
    def __init__(self, a, b):
        super().__init__(a=a, b=b)


def test_dict_subclasses_flatten_to_their_tensors_and_rebuild_in_their_class():
    x, y = torch.ones(2), torch.zeros(3)
    for tree, cls in [(_Out(b=x, a=y), _Out), (_DataOut(x, y), _DataOut), ({"k": [_Out(b=x, a=y)]}, dict)]:
        leaves, spec = flatten(tree)
        assert all(isinstance(t, torch.Tensor) for t in leaves) and len(leaves) == 2
        back = unflatten(spec, [t + 1 for t in leaves])
        assert type(back) is cls
    assert list(unflatten(*reversed(flatten(_Out(b=x, a=y))))) == ["b", "a"]  # its own key order
    leaves, spec = flatten(_Unbuildable(x, y))
    with pytest.raises(ValueError, match=r"cannot rebuild a .*_Unbuildable.*Return a plain dict"):
        unflatten(spec, leaves)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _tokens():
    return torch.randint(0, 61, (4, 9), generator=torch.Generator().manual_seed(1))


def _hf_runtime_grads(rank, world, style):
    model = _tiny_llama()
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    rt = Runtime(model, plan)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    x = _tokens()[rows]
    if style == "func":  # HF computes the loss inside the model: it reaches us in out.loss
        grads, loss = rt.value_and_grad(lambda ps: rt.apply(ps, x, labels=x, use_cache=False).loss)(params)
    else:  # model(...) as written for plain torch, returning the ModelOutput with its cache
        with rt.bind(params):
            out = model(x, labels=x)
            out.loss.backward()
        grads, loss = rt.grads(params), out.loss
    assert type(out if style == "eager" else loss).__name__ in ("CausalLMOutputWithPast", "Tensor")
    return {n: comm.full_tensor(g) for n, g in grads.items()}, loss.item(), [u.name for u in plan.units]


@pytest.mark.parametrize("style", ["func", "eager"])
def test_runtime_on_a_hugging_face_model_matches_plain_torch(run_on_ranks, style):
    model = _tiny_llama()
    x = _tokens()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        model(x, labels=x, use_cache=False).loss.backward()
    finally:
        torch.set_num_threads(threads)
    expected = {n: p.grad for n, p in model.named_parameters()}
    for grads, _, units in run_on_ranks(_hf_runtime_grads, 2, style):
        assert units == ["", "model.layers.0", "model.layers.1"]  # the decoder layers are units
        assert sorted(grads) == sorted(expected)
        # Each rank's loss is the mean over its 2 x 8 tokens; the runtime averages the 2 ranks'
        # gradients: the one-process mean over 32 tokens in another summation order. Reordering an
        # n-term sum moves it by at most 2 n U32 of its terms' size (n = 32 tokens), which does not
        # exceed 2 n U32 of the gradient's largest entry when the terms do not cancel; we allow 4x.
        for n, g in expected.items():
            err = ((grads[n] - g).abs().max() / g.abs().max()).item()
            assert err <= 4 * 2 * 32 * U32, (n, err)


# ---------------------------------------------------------------------------------------------
# torch.compile: what fsdpfn cannot compile is refused by name, saying what to do instead
# ---------------------------------------------------------------------------------------------


def _gpt_setup(world, remat=None):
    import torch.nn.functional as F

    from fsdpfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, testing.mesh((world,)), remat=remat)
    params = fsdpfn.shard(model, plan)

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    return params, loss_fn, x[:, :-1], x[:, 1:]


def _compile_error(rank, world, case, fullgraph):
    import warnings

    warnings.simplefilter("ignore")  # dynamo's own warnings
    torch._dynamo.reset()
    params, loss_fn, x, y = _gpt_setup(world, remat={"blocks.1": "full"} if case == "remat" else None)
    try:
        if case == "remat":
            got, _ = fsdpfn.compile(loss_fn, fullgraph=fullgraph, backend="aot_eager")(params, x, y)
        else:
            got = torch.compile(torch.func.grad(loss_fn), fullgraph=fullgraph, backend="aot_eager")(params, x, y)
    except Exception as e:  # noqa: BLE001 - the test reads which error it is
        return type(e).__name__, str(e)
    want = torch.func.grad(loss_fn)(params, x, y)
    return "ran", all(torch.equal(got[n].to_local(), want[n].to_local()) for n in want)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_fsdpfn_compile_refuses_a_remat_plan_by_name(run_on_ranks, fullgraph):
    for kind, message in run_on_ranks(_compile_error, 2, "remat", fullgraph, timeout=900):
        assert kind == "CompileUnsupportedError", (kind, message[:2000])
        assert "'blocks.1' (remat='full')" in message, message
        assert "fsdpfn.runtime.Runtime" in message, message  # what to do instead


def test_compiled_func_grad_names_fsdpfn_and_the_fix(run_on_ranks):
    for kind, message in run_on_ranks(_compile_error, 2, "func_grad", True, timeout=900):
        # The user called torch.compile, so dynamo's exception type reaches them; its text must
        # carry fsdpfn's refusal and what to write instead.
        assert "CompileUnsupportedError" in message and "torch.func.grad" in message, (kind, message[:2000])
        assert "step = fsdpfn.compile(loss_fn)" in message, message


# ---------------------------------------------------------------------------------------------
# The gloo work kept alive after its wait holds no gathered parameters
# ---------------------------------------------------------------------------------------------


def _gather_buffers_after_steps(rank, world):
    import torch.nn.functional as F

    from fsdpfn.comm import _collectives

    from fsdpfn.models import GPT, GPTConfig

    _, _, x, y = _gpt_setup(world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, width=16, depth=2, heads=2))
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    params = fsdpfn.shard(model, plan)
    rt = Runtime(model, plan)
    received = []
    original = comm.all_gather

    def spy(output, input, group=None, **kwargs):
        received.append(output)
        return original(output, input, group, **kwargs)

    comm.all_gather = spy  # what the runtime's gathers call (fsdpfn.comm.all_gather)
    try:
        with torch.no_grad():  # forward only: the step's last collective is a gather
            rt.apply(params, x)
        kept_after_forward = len(_collectives._last_gloo_work)
        rt.value_and_grad(lambda ps: F.cross_entropy(rt.apply(ps, x).flatten(0, 1), y.flatten()))(params)
    finally:
        comm.all_gather = original
    unit_bytes = {u.name: sum(p.numel for p in u.params) * 4 for u in plan.units}
    return kept_after_forward, [t.untyped_storage().nbytes() for t in received], max(unit_bytes.values())


def test_the_kept_gloo_work_holds_no_gathered_parameters(run_on_ranks):
    for kept, sizes, largest_unit in run_on_ranks(_gather_buffers_after_steps, 2):
        assert kept == 1  # the last finished gloo work is still referenced (see [Note: the last gloo work])
        assert len(sizes) >= 3 and largest_unit > 0
        # Every gather's receive buffer (a unit's full parameters, flat) is emptied once unpacked,
        # the last one's included: what the kept work references holds no bytes.
        assert sizes == [0] * len(sizes), sizes


# ---------------------------------------------------------------------------------------------
# fsdpfn.launch.shutdown: a clean exit after success only
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def exits(monkeypatch):
    from fsdpfn import launch as launch_mod

    calls = []
    monkeypatch.setattr(launch_mod, "_gloo_threads", lambda: 2)  # as in a rank whose gloo threads outlive the group
    monkeypatch.setattr(launch_mod, "_exit_now", lambda: calls.append("exit"))
    return calls


def test_shutdown_exits_after_success_only(exits, monkeypatch):
    from fsdpfn.comm import _collectives
    from fsdpfn.launch import shutdown

    shutdown(exit=False)
    assert exits == []
    try:
        raise ValueError("a failed step")
    except ValueError:
        shutdown()  # an exception is being handled: the failure keeps its exit code
    assert exits == []
    monkeypatch.setitem(_collectives._health, "ok", False)
    shutdown()  # after a failed collective
    assert exits == []
    monkeypatch.setitem(_collectives._health, "ok", True)
    shutdown()
    assert exits == ["exit"]


def test_shutdown_does_nothing_without_gloo_threads(monkeypatch):
    from fsdpfn import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_exit_now", lambda: pytest.fail("exited"))
    assert launch_mod._gloo_threads() == 0  # this process (pytest's) never ran a gloo group
    launch_mod.shutdown()


@pytest.mark.e2e
def test_a_spawned_job_ending_with_torch_collectives_exits_0():
    """The user's own torch.multiprocessing.spawn, each rank ending with shutdown() after a runtime
    step and torch's own collectives last (DTensor.full_tensor, dist.all_reduce): mp.spawn raises if
    a rank's exit code is not 0. benchmarks/exit_stress.py runs this and the other ways N times."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "exit_stress.py"), "--job", "spawn"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
