"""Creating, loading and saving shards on (dp, tp) meshes: meta init and safetensors into a
tensor-parallel plan, checkpoints resharded across tensor-parallel degrees, full tensors of
strided placements, and the global norm and non-finite skip over data and tensor parallel axes.

Everything but the norm moves bytes and does no arithmetic, so it is compared bitwise
(``torch.equal``) with the one-process values.

The model is uneven on purpose: width 18 and 6 heads give a qkv weight of 54 rows, 27 per tp
rank on tp = 2, cut 14/13 over two data-parallel ranks: the ``_StridedShard`` rows of
different ranks have different lengths. The 29-row vocabulary splits 15/14 and 8/7/7/7; the
rowwise ``out`` weight (18 x 72) is split by columns over tp and by rows 9/9 or 5/5/5/3 over dp.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.multiprocessing.reductions import StorageWeakRef

import fsdpfn
from fsdpfn import checkpoint, comm, testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.transforms._local import local_index

CFG = GPTConfig(vocab_size=29, seq_len=8, width=18, depth=1, heads=6, bias=True)
SEED = 5
NAMES = {2: ("dp", "tp"), 3: ("replicate", "shard", "tp")}
TP_WEIGHTS = ("blocks.0.qkv.weight", "blocks.0.fc.weight", "blocks.0.proj.weight", "blocks.0.out.weight")


def _mesh(shape):
    return testing.mesh(shape, NAMES[len(shape)])


def _plan(model, shape, strategy="zero3"):
    return fsdpfn.plan(model, _mesh(shape), strategy=strategy, tp=GPT_TP_PLAN)


def _full_model():
    torch.manual_seed(0)
    return GPT(CFG)


def _meta_model():
    with torch.device("meta"):
        return GPT(CFG)


def _hooked(model, plan) -> list[str]:
    """The modules carrying the plan's tensor-parallel hooks."""
    return sorted(n for n, m in model.named_modules() if getattr(m, "_fsdpfn_tp", None) is not None)


def _tp_modules(plan) -> list[str]:
    return sorted(m for m, _ in plan.tp)


def _same_locals(a: dict, b: dict) -> list[str]:
    """Names whose DTensors differ in placement, local shape or local bytes."""
    return [
        n
        for n in b
        if tuple(a[n].placements) != tuple(b[n].placements) or not torch.equal(a[n].to_local(), b[n].to_local())
    ]


# ---------------------------------------------------------------------------------------------
# Meta init and safetensors
# ---------------------------------------------------------------------------------------------


class _AllocationCounter(TorchDispatchMode):
    """Every non-meta storage created under the mode: the largest, and the peak of the live ones."""

    def __init__(self):
        super().__init__()
        self.largest = self.peak = 0
        self._live: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:
                continue
            storage = t.untyped_storage()
            if storage._cdata not in self._live or self._live[storage._cdata][0].expired():
                self._live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                self.largest = max(self.largest, storage.nbytes())
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out


def _init_on_ranks(rank, world, shape):
    model = _meta_model()
    plan = _plan(model, shape)
    with _AllocationCounter() as counted:
        shards = fsdpfn.init_shards(model, plan, seed=SEED)
    twin_model = GPT(CFG)
    twin = fsdpfn.init_full(_meta_model(), seed=SEED)
    with torch.no_grad():
        for n, p in twin_model.named_parameters():
            p.copy_(twin[n])
    reference = fsdpfn.shard(twin_model, plan)
    full_bytes = max(p.global_numel for u in plan.units for p in u.params) * 4
    return dict(
        differ=_same_locals(shards, reference),
        full_differ=[n for n in shards if not torch.equal(comm.full_tensor(shards[n]), twin[n])],
        hooked=_hooked(model, plan) == _tp_modules(plan) != [],
        largest=counted.largest,
        peak=counted.peak,
        full_param=full_bytes,
        shards=sum(s.to_local().numel() for s in shards.values()) * 4,
        model=sum(p.global_numel for u in plan.units for p in u.params) * 4,
        params=len(plan.param_names),
    )


def test_meta_init_on_dp_tp_is_bitwise_the_one_process_twin(run_on_ranks):
    """init_shards on (dp=2, tp=2) == shard() of init_full's values, local bytes and placements,
    and its full tensors == init_full; the plan's TP hooks are installed.

    Memory, counted: the largest storage created is one full (global) parameter, and alive at
    once are at most this rank's shards, that one parameter, the checks' float64 chunk (an
    eighth of the parameter's elements, at least 256: max(2048 B, a quarter of its fp32 bytes))
    and a 16-byte checksum pair plus scalars per parameter (64 B each): the shards are allocated
    at their local size, never whole."""
    for m in run_on_ranks(_init_on_ranks, 4, (2, 2)):
        assert m["differ"] == [] and m["full_differ"] == [], m
        assert m["hooked"], m
        assert m["largest"] == m["full_param"], m
        bound = m["shards"] + m["full_param"] + max(2048, m["full_param"] // 4) + 64 * m["params"]
        assert m["peak"] <= bound, (m, bound)
        assert m["model"] > bound, (m, bound)  # holding the model whole would break the bound


def _safetensors_on_ranks(rank, world, path, shape):
    from fsdpfn.transforms import _safetensors as module

    boxes = {}
    original = module._read_box

    def spy(f, entry, box, dtype, device):
        boxes[entry.key] = box
        return original(f, entry, box, dtype, device)

    model = _meta_model()
    plan = _plan(model, shape)
    module._read_box = spy
    try:
        shards = fsdpfn.load_safetensors(model, plan, path)
    finally:
        module._read_box = original
    reference = fsdpfn.shard(_full_model(), plan)
    return dict(
        differ=_same_locals(shards, reference),
        hooked=_hooked(model, plan) == _tp_modules(plan),
        boxes={n: boxes[n] for n in TP_WEIGHTS},
        tp=fsdpfn.transforms.tp_rank(plan),
        dp=fsdpfn.transforms.shard_rank(plan),
    )


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)], ids=["dp2-tp2", "hsdp2x2-tp2"])
def test_safetensors_into_dp_tp_is_bitwise_shard_of_the_full_model(run_on_ranks, tmp_path, shape):
    """load_safetensors into (2, 2) and (replicate=2, shard=2, tp=2) == shard() of the loaded
    full model; a weight split by columns is read as its dp rows x its tp columns, one split by
    rows as its tp rows' dp chunk (the replicate axis reads the same as its shard rank)."""
    from safetensors.torch import save_file

    save_file(
        {n: p.detach().contiguous() for n, p in _full_model().named_parameters()}, str(tmp_path / "model.safetensors")
    )
    world = 4 if len(shape) == 2 else 8
    for r in run_on_ranks(_safetensors_on_ranks, world, str(tmp_path), shape):
        assert r["differ"] == [] and r["hooked"], r
        t, d = r["tp"], r["dp"]
        assert r["boxes"]["blocks.0.qkv.weight"] == (slice(27 * t + 14 * d, 27 * t + min(14 * (d + 1), 27)),), r
        assert r["boxes"]["blocks.0.out.weight"] == (slice(9 * d, 9 * d + 9), slice(36 * t, 36 * t + 36)), r
        assert r["boxes"]["blocks.0.proj.weight"] == (slice(9 * d, 9 * d + 9), slice(9 * t, 9 * t + 9)), r


# ---------------------------------------------------------------------------------------------
# Checkpoints across tensor-parallel degrees
# ---------------------------------------------------------------------------------------------


def _batch(dp, dp_rank, per_rank=2):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CFG.vocab_size, (dp * per_rank, CFG.seq_len + 1), generator=g)
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return mine[:, :-1], mine[:, 1:]


def _trained(model, plan):
    """Two AdamW steps of the pure loop from the seed-0 model: parameters and moments that
    differ from their initial values everywhere."""
    params = fsdpfn.shard(model, plan)
    opt = fsdpfn.optim.adamw(1e-2)
    state = opt.init(params)
    x, y = _batch(plan.dp_size, fsdpfn.transforms.dp_rank(plan))

    def loss(ps):
        logits = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    for _ in range(2):
        updates, state = opt.update(torch.func.grad(loss)(params), state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
    return {"params": params, "opt_state": state, "step": 2}


def _template(model, plan):
    params = fsdpfn.shard(model, plan)
    params = {n: p * 0 - 1 for n, p in params.items()}  # not the saved values: the load must overwrite them
    return {"params": params, "opt_state": fsdpfn.optim.adamw(1e-2).init(params), "step": 0}


def _full(state):
    """``{path: full tensor}`` of every tensor leaf, by fsdpfn.comm.full_tensor; and the paths
    where it differs from DTensor.full_tensor()."""
    entries, _ = checkpoint.flatten_state(state)
    out, differ = {}, []
    for p, v in entries.items():
        if isinstance(v, torch.Tensor):
            out[p] = comm.full_tensor(v)
            if isinstance(v, DTensor) and not torch.equal(out[p], v.full_tensor()):
                differ.append(p)
    return out, differ


def _check_placements(state, plan) -> list[str]:
    entries, _ = checkpoint.flatten_state(state)
    bad = []
    for p, v in entries.items():
        name = p.rsplit("/", 1)[-1]
        if (
            isinstance(v, DTensor)
            and name in plan.param_names
            and tuple(v.placements) != fsdpfn.transforms.placements(plan, name)
        ):
            bad.append(p)
    return bad


def _save_first(rank, world, root, export):
    model = _full_model()
    plan = _plan(model, (2, 2))
    state = _trained(model, plan)
    checkpoint.save(root, state, plan)
    checkpoint.export_full(export, state["params"], plan, model=model)
    full, differ = _full(state)
    return full, differ


def _load_and_save(rank, world, src, dst, shape):
    model = _full_model()
    plan = _plan(model, shape)
    state = checkpoint.load(src, _template(model, plan), plan)
    checkpoint.save(dst, state, plan)
    full, differ = _full(state)
    return full, differ + _check_placements(state, plan)


def _chunks(ckpt, path):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata()
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[path].chunks)


def _expected_chunks(name, shape):
    """The box each (dp, tp) rank owns, from the plan's own arithmetic (an unbound plan)."""
    plan = fsdpfn.plan(_meta_model(), dict(zip(NAMES[len(shape)], shape)), tp=GPT_TP_PLAN)
    spec = plan.param(name)
    boxes = set()
    for d in range(plan.shard_size):
        for t in range(plan.tp_size):
            box = local_index(plan, name, rank=d, tp=t)
            box = box + (slice(None),) * (len(spec.shape) - len(box))
            bounds = [s.indices(n)[:2] for s, n in zip(box, spec.shape)]
            if all(b > a for a, b in bounds):
                boxes.add((tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds)))
    return sorted(boxes)


def test_checkpoint_reshards_across_tp_degrees_bitwise(run_on_ranks, tmp_path):
    """Parameters and AdamW moments saved on (dp=2, tp=2) load bitwise on (4, 1), which saves
    them for (1, 2), which saves them for one process; and (2, 2) loads bitwise into HSDP x TP
    (replicate=2, shard=2, tp=2). DCP writes each strided or column-split shard as the box the
    plan assigns it, and fsdpfn.comm.full_tensor equals DTensor.full_tensor() on every mesh.
    The export from the TP run holds the full tensors."""
    roots = [str(tmp_path / f"ckpt{i}") for i in range(3)]
    export = str(tmp_path / "model.pt")
    saved, differ = run_on_ranks(_save_first, 4, roots[0], export)[0]
    assert differ == [] and any("/mu/" in p for p in saved) and any("/nu/" in p for p in saved), differ
    ckpt = checkpoint.latest(roots[0])
    for name in TP_WEIGHTS + ("embed.weight",):
        assert _chunks(ckpt, f"params/{name}") == _expected_chunks(name, (2, 2)), name
        assert _chunks(ckpt, f"opt_state/mu/{name}") == _chunks(ckpt, f"params/{name}"), name

    exported = torch.load(export, weights_only=True)
    assert all(torch.equal(exported[n], saved[f"params/{n}"]) for n in exported) and len(exported) == len(
        [p for p in saved if p.startswith("params/")]
    )

    hops = [
        (4, roots[0], roots[1], (4, 1)),
        (2, roots[1], roots[2], (1, 2)),
        (8, roots[0], str(tmp_path / "hsdp"), (2, 2, 2)),
    ]
    for world, src, dst, shape in hops:
        for full, differ in run_on_ranks(_load_and_save, world, src, dst, shape):
            assert differ == [], (shape, differ)
            assert full.keys() == saved.keys(), shape
            assert [p for p in saved if not torch.equal(full[p], saved[p])] == [], shape

    # One process, no process group: plain full tensors as the template.
    plain = {n: torch.full_like(p, -1.0) for n, p in _full_model().named_parameters()}
    template = {"params": plain, "opt_state": fsdpfn.optim.adamw(1e-2).init(plain), "step": 0}
    loaded = checkpoint.load(roots[2], template)
    entries, _ = checkpoint.flatten_state(loaded)
    assert loaded["step"] == 2
    assert [p for p, v in entries.items() if isinstance(v, torch.Tensor) and not torch.equal(v, saved[p])] == []


def _strided_full_tensor(rank, world):
    """comm.full_tensor against DTensor.full_tensor() for placements built directly: the
    FSDP-over-TP strided rows (uneven), dp-outer and tp-outer plain nesting, and a column shard."""
    mesh = _mesh((2, 2))
    x = torch.arange(54 * 5, dtype=torch.float32).view(54, 5)
    out = []
    for placements in [(Shard(0), Shard(0)), (Shard(1), Shard(0)), (Shard(0), Shard(1))]:
        d = distribute_tensor(x[:29], mesh, placements)  # 29 x 5: uneven along both dims
        out.append(torch.equal(comm.full_tensor(d), x[:29]) and torch.equal(d.full_tensor(), x[:29]))
    coord = mesh.get_coordinate()
    rows = x[27 * coord[1] : 27 * coord[1] + 27]
    start, stop = fsdpfn._rows.chunk_bounds(27, 2, coord[0])
    strided = DTensor.from_local(
        rows[start:stop],
        mesh,
        (_StridedShard(0, split_factor=2), Shard(0)),
        shape=x.shape,
        stride=x.stride(),
        run_check=False,
    )
    out.append(torch.equal(comm.full_tensor(strided), x) and torch.equal(strided.full_tensor(), x))
    bad = DTensor.from_local(
        rows[start:stop],
        mesh,
        (_StridedShard(0, split_factor=3), Shard(0)),
        shape=x.shape,
        stride=x.stride(),
        run_check=False,
    )
    try:
        comm.full_tensor(bad)
        out.append(False)
    except NotImplementedError as e:
        out.append("split_factor" in str(e))
    return out


def test_full_tensor_of_nested_and_strided_shards(run_on_ranks):
    assert run_on_ranks(_strided_full_tensor, 4) == [[True] * 5] * 4


# ---------------------------------------------------------------------------------------------
# Global norm and the non-finite skip over (dp, tp)
# ---------------------------------------------------------------------------------------------


def _tree(plan):
    """A full gradient-like tree (seeded, the same on every rank) and its shards per the plan."""
    g = torch.Generator().manual_seed(11)
    full = {p.name: torch.randn(p.shape, generator=g) for u in plan.units for p in u.params}
    return full, fsdpfn.shard(full, plan)


def _norms(rank, world, shape):
    model = _meta_model()
    plan = _plan(model, shape)
    full, shards = _tree(plan)
    sharded = fsdpfn.optim.global_norm(shards)
    reference = fsdpfn.optim.global_norm(full)  # one process: plain tensors, no collective
    clip = fsdpfn.optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(shards, clip.init(None))
    expected, _ = clip.update(full, clip.init(None))
    clip_err = max(
        ((comm.full_tensor(clipped[n]) - expected[n]).abs().max() / expected[n].abs().max()).item() for n in full
    )
    # Each leaf alone: (its norm over the shards, its one-process norm, its elements).
    leaves = {
        n: (
            fsdpfn.optim.global_norm({n: shards[n]}).item(),
            fsdpfn.optim.global_norm({n: full[n]}).item(),
            full[n].numel(),
        )
        for n in full
    }
    return dict(
        sharded=sharded.item(),
        reference=reference.item(),
        elements=sum(v.numel() for v in full.values()),
        clip_err=clip_err,
        leaves=leaves,
        tp_sharded=sum(1 for n in full if plan.param(n).tp_dim is not None),
    )


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)], ids=["dp2-tp2", "hsdp2x2-tp2"])
def test_global_norm_counts_each_shard_once(run_on_ranks, shape):
    """global_norm of shards on (2, 2) and (2, 2, 2) == the one-process norm of the full tree.

    Bound: both are fp32 sums of the same n nonnegative squares in different orders. Any order
    of n - 1 additions, each rounded, plus the rounding of each square, is within
    gamma_n = n u / (1 - n u) of the exact sum S (u = 2^-24), so the two sums differ by at most
    2 gamma_n S and their square roots (each rounded once more) by about (gamma_n + 2 u) of the
    norm. A replicated-over-tp leaf counted tp times, or a dp shard counted once, would be off
    by a factor, far outside this. Clipping scales by the same norm, so its relative error is
    within the same bound plus the rounding of the division and the product (2 u).
    """
    world = 1
    for s in shape:
        world *= s
    results = run_on_ranks(_norms, world, shape)
    assert len({r["sharded"] for r in results}) == 1  # equal on every rank

    def bound(n):
        u = 2.0**-24
        return n * u / (1 - n * u) + 2 * u

    for r in results:
        assert r["tp_sharded"] >= 4
        assert abs(r["sharded"] - r["reference"]) <= bound(r["elements"]) * r["reference"], r
        assert r["clip_err"] <= bound(r["elements"]) + 2 * 2.0**-24, r
        # Leaf by leaf, so that no over-count in one leaf hides behind another's under-count.
        for name, (sharded, reference, n) in r["leaves"].items():
            assert abs(sharded - reference) <= bound(n) * reference, (name, sharded, reference)


def _finite(rank, world):
    model = _meta_model()
    plan = _plan(model, (2, 2))
    full, grads = _tree(plan)
    opt = fsdpfn.optim.apply_if_finite(fsdpfn.optim.sgd(0.1), 1)
    state = opt.init(grads)
    if rank == 3:  # one rank's shard of a tp-sharded weight
        grads["blocks.0.out.weight"].to_local()[0, 0] = float("nan")
    updates, state = opt.update(grads, state, grads)
    skipped = all(bool((u.to_local() == 0).all()) for u in updates.values())
    first = (state.notfinite_count, state.last_finite, skipped)
    _, clean = _tree(plan)
    updates, state = opt.update(clean, state, clean)
    applied = torch.equal(comm.full_tensor(updates["blocks.0.out.weight"]), -0.1 * full["blocks.0.out.weight"])
    return first, (state.notfinite_count, state.last_finite, applied)


def test_non_finite_step_is_skipped_on_every_rank_of_dp_tp(run_on_ranks):
    """A NaN in one rank's shard of a column-split weight: all four ranks skip the step (zero
    updates, count 1); the next finite step is applied everywhere."""
    assert run_on_ranks(_finite, 4) == [((1, False, True), (0, True, True))] * 4
