"""Meta-device models: plans of meta models, sharded initialisation (fsdpfn.init_shards) against
its one-process twin (fsdpfn.init_full), bitwise on every world size, strategy, HSDP and unit
choice; a training step after it; the ranks-agree checks; and the memory bound, counted."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdpfn
from fsdpfn import comm, testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=29, seq_len=8, width=12, depth=2, heads=2, bias=True)  # 29 rows: uneven on 2, 3, 4
SEED, LR, PER_RANK = 7, 0.1, 2


class Model(nn.Module):
    """The test GPT plus a parameter with fewer rows than ranks and a 0-d one."""

    def __init__(self, cfg=CFG):
        super().__init__()
        self.gpt = GPT(cfg)
        self.small = nn.Parameter(torch.empty(2, 5))
        self.scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.small, std=0.1)
        nn.init.uniform_(self.scale, 0.5, 1.5)

    def forward(self, tokens):
        return self.gpt(tokens) * self.scale + self.small.sum()


def _meta_model(cfg=CFG) -> Model:
    with torch.device("meta"):
        return Model(cfg)


def _linear_units(name, module):
    return isinstance(module, nn.Linear)


UNITS = {"default": None, "list": ["gpt.blocks.0", "gpt.blocks.1.fc", "gpt.embed"], "linear": _linear_units}


def _mesh(shape):
    return testing.mesh(shape, ("replicate", "shard") if len(shape) == 2 else None)


def _batch(world):
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, CFG.vocab_size, (world * PER_RANK, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, params, x, y):
    logits = torch.func.functional_call(model, params, (x,))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _sgd_step(model, plan, params, x, y):
    grads = torch.func.grad(lambda ps: _loss(model, fsdpfn.unshard(ps, plan), x, y))(params)
    return {n: p - LR * grads[n] for n, p in params.items()}


# ---------------------------------------------------------------------------------------------
# Plans of meta models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", [(1,), (3,), (4,), (2, 2)])
@pytest.mark.parametrize("units", ["default", "list", "linear"])
def test_plan_of_meta_model_has_the_materialised_fingerprint(mesh, units):
    torch.manual_seed(0)
    real = Model()
    kwargs = dict(units=UNITS[units], strategy={"*": "zero3", "<root>": "zero2"})
    assert fsdpfn.plan(_meta_model(), mesh, **kwargs) == fsdpfn.plan(real, mesh, **kwargs)
    assert fsdpfn.plan(_meta_model(), mesh, **kwargs).fingerprint == fsdpfn.plan(real, mesh, **kwargs).fingerprint


def test_plan_of_meta_model_with_tied_weights():
    cfg = GPTConfig(vocab_size=29, seq_len=8, width=12, depth=2, heads=2, tie_embeddings=True)
    with torch.device("meta"):
        meta = GPT(cfg)
    assert fsdpfn.plan(meta, (2,)).fingerprint == fsdpfn.plan(GPT(cfg), (2,)).fingerprint
    assert "head.weight" not in fsdpfn.plan(meta, (2,)).param_names


# ---------------------------------------------------------------------------------------------
# The one-process twin
# ---------------------------------------------------------------------------------------------


def test_init_full_is_deterministic_and_depends_on_seed_and_path():
    a, b = fsdpfn.init_full(_meta_model(), seed=SEED), fsdpfn.init_full(_meta_model(), seed=SEED)
    assert list(a) == [n for n, _ in Model().named_parameters()]
    assert all(torch.equal(a[n], b[n]) for n in a)
    c = fsdpfn.init_full(_meta_model(), seed=SEED + 1)
    assert not torch.equal(a["gpt.blocks.0.fc.weight"], c["gpt.blocks.0.fc.weight"])
    # Same module type, same shape, other path: other values.
    assert not torch.equal(a["gpt.blocks.0.fc.weight"], a["gpt.blocks.1.fc.weight"])
    # The initialiser's distributions: Linear's kaiming-uniform bound, LayerNorm's ones, ours.
    bound = 1 / math.sqrt(CFG.width)
    assert a["gpt.blocks.0.fc.weight"].abs().max() <= bound and a["gpt.blocks.0.fc.weight"].std() > bound / 3
    assert torch.equal(a["gpt.norm.weight"], torch.ones(CFG.width))
    assert 0.5 <= a["scale"].item() <= 1.5


def test_init_full_of_a_real_model_leaves_it_alone():
    torch.manual_seed(0)
    real = Model()
    before = {n: p.detach().clone() for n, p in real.named_parameters()}
    full = fsdpfn.init_full(real, seed=SEED)
    assert all(torch.equal(p, before[n]) for n, p in real.named_parameters())
    expected = fsdpfn.init_full(_meta_model(), seed=SEED)
    assert all(torch.equal(full[n], expected[n]) for n in expected)


def test_init_full_does_not_move_the_callers_generator():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    fsdpfn.init_full(_meta_model(), seed=SEED)
    assert torch.equal(torch.rand(4), expected)


def test_init_full_materialises_a_meta_model_with_load_state_dict():
    model = _meta_model()
    full = fsdpfn.init_full(model, seed=SEED)
    model.load_state_dict(full, assign=True)
    x, _ = _batch(1)
    assert model(x).shape == (PER_RANK, CFG.seq_len, CFG.vocab_size)


def _my_init(module, name):
    torch.nn.init.normal_(getattr(module, name), std=0.05)


def _my_param_init(path, tensor):
    tensor.uniform_(-0.1, 0.1) if tensor.dim() else tensor.fill_(1.0)


def test_custom_initialisers():
    default = fsdpfn.init_full(_meta_model(), seed=SEED)
    by_module = fsdpfn.init_full(_meta_model(), seed=SEED, init=_my_init)
    by_param = fsdpfn.init_full(_meta_model(), seed=SEED, param_init=_my_param_init)
    w = "gpt.blocks.0.fc.weight"
    assert not torch.equal(default[w], by_module[w]) and not torch.equal(by_module[w], by_param[w])
    assert by_param[w].abs().max() <= 0.1 and by_param["scale"].item() == 1.0
    assert torch.equal(
        by_module["gpt.norm.weight"], fsdpfn.init_full(_meta_model(), seed=SEED, init=_my_init)["gpt.norm.weight"]
    )


# ---------------------------------------------------------------------------------------------
# Sharded init == the twin, bitwise; a step after it == the one-process step
# ---------------------------------------------------------------------------------------------


def _init_parity(rank, world, mesh_shape, strategy, units, how):
    model = _meta_model()
    plan = fsdpfn.plan(model, _mesh(mesh_shape), units=UNITS[units], strategy=strategy)
    kwargs = {"default": {}, "init": {"init": _my_init}, "param_init": {"param_init": _my_param_init}}[how]
    params = fsdpfn.init_shards(model, plan, seed=SEED, **kwargs)
    assert list(params) == list(plan.param_names)
    for n, p in params.items():
        assert p.placements == fsdpfn.transforms.placements(plan, n)
        start, stop = plan.unit_of(n).local_rows(n, fsdpfn.transforms.shard_rank(plan))
        assert p.to_local().shape[0:1] == ((stop - start,) if p.dim() else ())
    full = {n: comm.full_tensor(p) for n, p in params.items()}

    # One SGD step: against the one-process step (twin values, whole batch) and, bitwise,
    # against the same sharded step started from fsdpfn.shard of the twin (today's path).
    twin = fsdpfn.init_full(model, seed=SEED, **kwargs)
    x, y = _batch(world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    stepped = _sgd_step(model, plan, params, x[mine], y[mine])
    classic = _sgd_step(model, plan, fsdpfn.shard(twin, plan), x[mine], y[mine])
    ref_grads = torch.func.grad(lambda ps: _loss(model, ps, x, y))(twin)
    reference = {n: twin[n] - LR * ref_grads[n] for n in twin}
    bitwise = all(torch.equal(stepped[n].to_local(), classic[n].to_local()) for n in stepped)
    rel = max(((comm.full_tensor(stepped[n]) - reference[n]).norm() / reference[n].norm()).item() for n in reference)
    return full if rank == 0 else None, bitwise, rel


@pytest.mark.parametrize(
    "mesh_shape,strategy,units,how",
    [
        ((1,), "zero3", "default", "default"),
        ((2,), "zero3", "default", "default"),
        ((3,), "zero2", "default", "default"),
        ((4,), "zero3", "default", "default"),
        ((2, 2), "zero3", "default", "default"),
        ((2, 2), "zero2", "list", "default"),
        ((3,), "zero3", "list", "init"),
        ((4,), {"*": "zero3", "<root>": "replicate"}, "linear", "param_init"),
    ],
    ids=[
        "w1",
        "w2-zero3",
        "w3-zero2",
        "w4-zero3",
        "hsdp2x2",
        "hsdp2x2-zero2-units",
        "w3-units-init",
        "w4-linear-units-param-init",
    ],
)
def test_init_shards_equals_the_one_process_twin(run_on_ranks, mesh_shape, strategy, units, how):
    world = math.prod(mesh_shape)
    results = run_on_ranks(_init_parity, world, mesh_shape, strategy, units, how)
    full = results[0][0]
    kwargs = {"default": {}, "init": {"init": _my_init}, "param_init": {"param_init": _my_param_init}}[how]
    twin = fsdpfn.init_full(_meta_model(), seed=SEED, **kwargs)  # here, in the test process
    assert sorted(full) == sorted(twin)
    assert all(torch.equal(full[n], twin[n]) for n in twin), [n for n in twin if not torch.equal(full[n], twin[n])]
    # One step against one process: the same float32 arithmetic in another order. Each gradient
    # entry sums the batch's n = world * PER_RANK * seq_len token terms, in one GEMM there, per
    # rank then across ranks here: at most (n - 1) * 2^-24 * sum|terms| off on each side, 2n * 2^-24
    # of the gradient's norm when its terms do not cancel. The step adds LR * g, at most the
    # stepped parameters' norm (equal to it for the zero-initialised biases), so the parameters
    # differ by at most 2n * 2^-24 of their norm (7.6e-6 on 4 ranks). Measured with default, AVX2
    # and AVX512 kernels: at most 5.6e-7.
    for _, bitwise, rel in results:
        assert bitwise
        assert rel < 2 * (world * PER_RANK * CFG.seq_len) * 2.0**-24, rel


def _requires_grad_leaves(rank, world):
    model = _meta_model()
    plan = fsdpfn.plan(model, _mesh((world,)))
    params = fsdpfn.init_shards(model, plan, seed=SEED, requires_grad=True)
    x, y = _batch(world)
    _loss(
        model,
        fsdpfn.unshard(params, plan),
        x[rank * PER_RANK : (rank + 1) * PER_RANK],
        y[rank * PER_RANK : (rank + 1) * PER_RANK],
    ).backward()
    return all(p.is_leaf and p.grad is not None and p.grad.placements == p.placements for p in params.values())


def test_init_shards_requires_grad_gives_leaves_for_backward(run_on_ranks):
    assert all(run_on_ranks(_requires_grad_leaves, 2))


# ---------------------------------------------------------------------------------------------
# Ranks that disagree, and bad arguments
# ---------------------------------------------------------------------------------------------


def _disagree(rank, world, case):
    model = _meta_model()
    plan = fsdpfn.plan(model, _mesh((world,)))
    try:
        if case == "seed":
            fsdpfn.init_shards(model, plan, seed=rank)
        elif case == "rank-dependent":
            fsdpfn.init_shards(
                model, plan, param_init=lambda path, t: t.fill_(comm.rank() if path == "gpt.pos.weight" else 1.0)
            )
        elif case == "unseeded":
            fsdpfn.init_shards(
                model,
                plan,
                param_init=lambda path, t: t.copy_(
                    torch.rand(t.shape, generator=torch.Generator().manual_seed(comm.rank()))
                ),
            )
        elif case == "plan":
            other = fsdpfn.plan(model, _mesh((world,)), strategy="zero2" if rank else "zero3")
            fsdpfn.init_shards(model, other)
        elif case == "meta-shard":
            fsdpfn.shard(model, plan)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "seed",
            "ranks [1] have a different init seed and initialiser than rank 0: 'seed=1, reset_parameters' against 'seed=0, reset_parameters'",
        ),
        ("rank-dependent", "parameter 'gpt.pos.weight' differs between rank 0 and ranks [1]"),
        ("unseeded", "differs between rank 0 and ranks [1]"),
        ("plan", "ranks [1] built a different plan than rank 0"),
        ("meta-shard", "are on the meta device"),
    ],
)
def test_ranks_that_disagree_get_a_named_error(run_on_ranks, case, expected):
    for message in run_on_ranks(_disagree, 2, case):
        assert message is not None and expected in message, message


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.gain = nn.Parameter(torch.ones(4))


class _Copying(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))
        self.b = nn.Parameter(torch.ones(4))

    def reset_parameters(self):
        with torch.no_grad():
            self.a.normal_()
            self.b.copy_(self.a)


class _Rebinding(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def reset_parameters(self):
        self.w = nn.Parameter(torch.zeros(4))


def test_bad_arguments_are_named_before_any_collective():
    model = _meta_model()
    plan = fsdpfn.plan(model, (2,))  # unbound: a collective would fail differently
    with pytest.raises(
        ValueError, match=r"module '<root>' \(_NoReset\) owns parameter 'gain' but has no reset_parameters\(\)"
    ):
        with torch.device("meta"):
            fsdpfn.init_full(_NoReset())
    with pytest.raises(ValueError, match="not both"):
        fsdpfn.init_shards(model, plan, init=_my_init, param_init=_my_param_init)
    with pytest.raises(ValueError, match="seed must be an int"):
        fsdpfn.init_shards(model, plan, seed=1.5)
    with pytest.raises(ValueError, match="init must be a callable"):
        fsdpfn.init_shards(model, plan, init="normal")
    with pytest.raises(ValueError, match="is not a parameter of GPT"):
        fsdpfn.init_shards(GPT(CFG), plan)
    with pytest.raises(ValueError, match="device='meta'"):
        fsdpfn.init_full(model, device="meta")
    with pytest.raises(ValueError, match="this plan has no mesh"):
        fsdpfn.init_shards(model, plan)
    with pytest.raises(
        RuntimeError, match=r"initialising 'b' \(alone: the model's other parameters are on the meta device\)"
    ):
        with torch.device("meta"):
            fsdpfn.init_full(_Copying())
    with pytest.raises(ValueError, match="the initialiser replaced parameter 'w' instead of filling it in place"):
        with torch.device("meta"):
            fsdpfn.init_full(_Rebinding())


# ---------------------------------------------------------------------------------------------
# Memory: counted, not inferred
# ---------------------------------------------------------------------------------------------


class _AllocationCounter(TorchDispatchMode):
    """Every non-meta tensor storage created under the mode: the largest one, and the peak of
    the sum of those still alive (weak references to the storages)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.peak = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) not in (torch.Tensor, nn.Parameter) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self._live or self._live[key][0].expired():
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.largest = max(self.largest, storage.nbytes())
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out


def _memory(rank, world):
    cfg = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=4, heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = fsdpfn.plan(model, _mesh((world,)))
    unit_bytes = max(u.numel for u in plan.units) * 4
    param_bytes = max(p.numel for u in plan.units for p in u.params) * 4
    model_bytes = sum(u.numel for u in plan.units) * 4
    with _AllocationCounter() as meta_init:
        params = fsdpfn.init_shards(model, plan, seed=SEED)
    shard_bytes = sum(p.to_local().numel() for p in params.values()) * 4
    del params
    with _AllocationCounter() as full_path:  # today's path, for contrast: the counter sees it
        torch.manual_seed(0)
        fsdpfn.shard(GPT(cfg), plan)
    return dict(
        largest=meta_init.largest,
        peak=meta_init.peak,
        full_peak=full_path.peak,
        unit=unit_bytes,
        param=param_bytes,
        model=model_bytes,
        shards=shard_bytes,
    )


def test_sharded_init_allocates_at_most_one_unit_at_a_time(run_on_ranks):
    for m in run_on_ranks(_memory, 2):
        # The largest tensor created is one full parameter (the counter does see it), at most a unit.
        assert m["param"] <= m["largest"] <= m["unit"], m
        # Alive at once: this rank's shards plus at most one unit (plus the checks' small rows).
        assert m["peak"] <= m["shards"] + m["unit"], m
        # The same counter on today's path sees the whole model: the bound is not vacuous.
        assert m["full_peak"] >= m["model"] > m["shards"] + m["unit"], m
