"""fsdpfn.checkpoint: resume parity, resharding across plans and world sizes, atomicity, export.

Every comparison is bitwise (``torch.equal``): a checkpoint moves bytes, it does no arithmetic.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdpfn
from fsdpfn import checkpoint, testing
from fsdpfn.models import GPT, GPTConfig

# Uneven on purpose: 37-row vocabulary and 20-wide layers split 19/18 over 2 ranks, 13/12/12
# over 3; the "odd" leaf has 2 rows, so on 3 ranks one shard is empty.
CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=2, heads=2)


# ---- a hand-made optimizer: the shape of fsdpfn.optim's states (NamedTuple of DTensor trees) --


class AdamState(NamedTuple):
    count: torch.Tensor  # plain replicated tensor
    mu: dict
    nu: dict


def _adam_init(params):
    return AdamState(
        torch.zeros((), dtype=torch.int64),
        {n: torch.zeros_like(p) for n, p in params.items()},
        {n: torch.zeros_like(p) for n, p in params.items()},
    )


def _adam_update(grads, state, params, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8):
    count = state.count + 1
    mu = {n: b1 * state.mu[n] + (1 - b1) * g for n, g in grads.items()}
    nu = {n: b2 * state.nu[n] + (1 - b2) * g * g for n, g in grads.items()}
    c1, c2 = 1 - b1 ** count.item(), 1 - b2 ** count.item()
    new = {n: params[n] - lr * (mu[n] / c1) / ((nu[n] / c2).sqrt() + eps) for n in params}
    return new, AdamState(count, mu, nu)


def _batch(step, rank, world, per_rank=2):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (world * per_rank, CFG.seq_len + 1), generator=g)
    x = x[rank * per_rank : (rank + 1) * per_rank]
    return x[:, :-1], x[:, 1:]


def _setup(world, strategy, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy)
    params = fsdpfn.shard(model, plan)
    odd = distribute_tensor(torch.arange(6.0).view(2, 3) + seed, plan.mesh, [Shard(0)])
    state = {"params": params, "opt_state": (_adam_init(params), {"odd": odd}), "step": 0, "lr": 1e-2}
    return model, plan, state


def _loss_fn(model, plan):
    """The pure loop's loss over sharded parameters (both training helpers below use it)."""

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return loss_fn


def _train(model, plan, state, steps, rank, world):
    loss_fn = _loss_fn(model, plan)

    for _ in range(steps):
        x, y = _batch(state["step"], rank, world)
        grads = torch.func.grad(loss_fn)(state["params"], x, y)
        params, adam = _adam_update(grads, state["opt_state"][0], state["params"], lr=state["lr"])
        odd = state["opt_state"][1]["odd"] * 1.5
        state = {**state, "params": params, "opt_state": (adam, {"odd": odd}), "step": state["step"] + 1}
    return state


def _full(state):
    """Every tensor leaf gathered to a plain tensor, keyed by checkpoint path."""
    entries, _ = checkpoint.flatten_state(state)
    return {p: (v.full_tensor() if isinstance(v, DTensor) else v) for p, v in entries.items()}


# ---- runs on ranks ---------------------------------------------------------------------------


def _resume_parity(rank, world, root, n):
    model, plan, state = _setup(world, "zero3")
    straight = _full(_train(model, plan, state, 2 * n, rank, world))

    half = _train(model, plan, state, n, rank, world)
    checkpoint.save(root, half, plan)
    _, plan2, template = _setup(world, "zero3", seed=1)  # different values: the load must overwrite all
    resumed = checkpoint.load(root, template, plan2)
    assert resumed["step"] == n and resumed["opt_state"][0].count.item() == n
    for p, v in checkpoint.flatten_state(resumed)[0].items():
        if isinstance(v, DTensor):
            assert v.placements == checkpoint.flatten_state(template)[0][p].placements, p
    after = _full(_train(model, plan2, resumed, n, rank, world))
    return {
        p: (torch.equal(straight[p], after[p]) if isinstance(after[p], torch.Tensor) else straight[p] == after[p])
        for p in straight
    }


def _save_trained(rank, world, root, strategy, steps):
    model, plan, state = _setup(world, strategy)
    state = _train(model, plan, state, steps, rank, world)
    path = checkpoint.save(root, state, plan)
    return _full(state), path


def _load_into(rank, world, root, strategy):
    _, plan, template = _setup(world, strategy, seed=7)
    state = checkpoint.load(root, template, plan)
    entries, _ = checkpoint.flatten_state(state)
    placements = {
        p: (tuple(v.placements), tuple(v.to_local().shape)) for p, v in entries.items() if isinstance(v, DTensor)
    }
    return _full(state), placements


def _export(rank, world, path, tie):
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": tie})
    torch.manual_seed(3)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params = fsdpfn.shard(model, plan)
    params = {n: p * 1.25 for n, p in params.items()}  # not the model's own values
    checkpoint.export_full(path, params, plan, model=model)
    return {n: p.full_tensor() for n, p in params.items()}


def _real_opt(name):
    from fsdpfn import optim

    if name == "muon":
        return optim.muon(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
    return optim.adamw(3e-3)


def _setup_real(world, strategy, opt_name, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    mesh = testing.mesh((2, world // 2), ("replicate", "shard")) if strategy == "hsdp" else testing.mesh((world,))
    plan = fsdpfn.plan(model, mesh, strategy="zero3" if strategy == "hsdp" else strategy)
    params = fsdpfn.shard(model, plan)
    return model, plan, {"params": params, "opt_state": _real_opt(opt_name).init(params), "step": 0}


def _train_real(model, plan, state, steps, rank, world, opt_name):
    from fsdpfn import optim

    opt = _real_opt(opt_name)

    loss_fn = _loss_fn(model, plan)

    for _ in range(steps):
        x, y = _batch(state["step"], rank, world)
        grads = torch.func.grad(loss_fn)(state["params"], x, y)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        state = {
            "params": optim.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
    return state


def _real_resume_parity(rank, world, root, opt_name, n):
    model, plan, state = _setup_real(world, "zero3", opt_name)
    straight = _full(_train_real(model, plan, state, 2 * n, rank, world, opt_name))
    checkpoint.save(root, _train_real(model, plan, state, n, rank, world, opt_name), plan)
    _, plan2, template = _setup_real(world, "zero3", opt_name, seed=1)
    after = _full(_train_real(model, plan2, checkpoint.load(root, template, plan2), n, rank, world, opt_name))
    return sorted(
        p
        for p in straight
        if not (torch.equal(straight[p], after[p]) if isinstance(after[p], torch.Tensor) else straight[p] == after[p])
    )


def _real_save(rank, world, root, opt_name):
    model, plan, state = _setup_real(world, "zero3", opt_name)
    state = _train_real(model, plan, state, 2, rank, world, opt_name)
    checkpoint.save(root, state, plan)
    return _full(state)


def _real_load(rank, world, root, opt_name, strategy):
    _, plan, template = _setup_real(world, strategy, opt_name, seed=9)
    return _full(checkpoint.load(root, template, plan))


# ---- tests -----------------------------------------------------------------------------------


def test_resume_is_bitwise_same_world_size(run_on_ranks, tmp_path):
    """2N steps straight == N steps, save, load into a fresh template, N steps (2 ranks, zero3)."""
    results = run_on_ranks(_resume_parity, 2, str(tmp_path / "ckpt"), 3)
    for rank_result in results:
        assert rank_result and all(rank_result.values()), {p: ok for p, ok in rank_result.items() if not ok}


def test_reshard_2_ranks_zero3_to_3_ranks_zero2_and_1_rank(run_on_ranks, tmp_path):
    """Saved on 2 ranks zero3; loaded on 3 ranks zero2, on 1 rank zero3, on 2 ranks replicated,
    and in one process with no process group into plain tensors: every parameter and
    optimizer-state leaf identical."""
    root = str(tmp_path / "ckpt")
    (saved, path), _ = run_on_ranks(_save_trained, 2, root, "zero3", 2)
    assert os.path.basename(path) == "step_00000002" and checkpoint.latest(root) == path
    info = checkpoint.read_info(root)
    assert info["values"] == {"step": 2, "lr": 1e-2} and info["world_size"] == 2
    assert fsdpfn.Plan.from_json(__import__("json").dumps(info["plan"])).mesh_shape == (2,)

    three = run_on_ranks(_load_into, 3, root, "zero2")
    one = run_on_ranks(_load_into, 1, root, "zero3")
    replicated = run_on_ranks(_load_into, 2, root, "replicate")
    assert replicated[1][1]["params/embed.weight"] == ((Replicate(),), (37, 20))
    for loaded, placements in [*three, *one, *replicated]:
        assert loaded.keys() == saved.keys()
        for p in saved:
            if isinstance(saved[p], torch.Tensor):
                assert torch.equal(loaded[p], saved[p]), p
            else:
                assert loaded[p] == saved[p], p
    # The 3-rank load really is sharded three ways, with an empty shard for the 2-row leaf.
    assert [r[1]["opt_state/1/odd"] for r in three] == [
        ((Shard(0),), (1, 3)),
        ((Shard(0),), (1, 3)),
        ((Shard(0),), (0, 3)),
    ]
    assert three[2][1]["params/embed.weight"] == ((Shard(0),), (11, 20))

    # One process, no process group: plain full tensors as the template.
    template = {
        "params": {p.split("/", 1)[1]: torch.full_like(v, -1.0) for p, v in saved.items() if p.startswith("params/")}
    }
    plain = checkpoint.load(root, template)
    for name, v in plain["params"].items():
        assert type(v) is torch.Tensor and torch.equal(v, saved[f"params/{name}"]), name


def test_load_errors_name_the_path_and_shapes(tmp_path):
    root = str(tmp_path / "ckpt")
    checkpoint.save(root, {"params": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "step": 5})
    with pytest.raises(ValueError, match=r"'params/w': checkpoint \(4, 3\), template \(5, 3\)"):
        checkpoint.load(root, {"params": {"w": torch.ones(5, 3), "b": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"'params/missing' \(missing\)"):
        checkpoint.load(root, {"params": {"missing": torch.ones(2)}})
    with pytest.raises(ValueError, match=r"'step' \(a value, not a tensor\)"):
        checkpoint.load(root, {"step": torch.zeros(())})
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.load(str(tmp_path / "nothing"), {"step": 0})
    with pytest.raises(ValueError, match="'params/f' is a builtin_function_or_method"):
        checkpoint.save(root, {"params": {"f": len}})
    # A sub-tree of the saved state loads alone; the template is not modified.
    template = {"params": {"w": torch.zeros(4, 3)}}
    out = checkpoint.load(root, template)
    assert torch.equal(out["params"]["w"], torch.ones(4, 3)) and torch.equal(template["params"]["w"], torch.zeros(4, 3))


def test_keep_prunes_old_checkpoints(tmp_path):
    root = str(tmp_path / "ckpt")
    for step in range(4):
        checkpoint.save(root, {"w": torch.full((2,), float(step)), "step": step}, keep=2)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000002", "step_00000003"]
    assert checkpoint.load(root, {"step": 0})["step"] == 3
    # Re-saving an existing step replaces it.
    checkpoint.save(root, {"w": torch.full((2,), 9.0), "step": 3}, keep=2)
    assert torch.equal(checkpoint.load(root, {"w": torch.zeros(2)})["w"], torch.full((2,), 9.0))


_NO_FSDPFN_LOAD = textwrap.dedent(
    """
    import sys, types, torch
    sys.modules["fsdpfn"] = None  # any import of fsdpfn now fails
    gpt = sys.modules["standalone_gpt"] = types.ModuleType("standalone_gpt")  # the model's source, copied
    exec(open(sys.argv[1]).read(), gpt.__dict__)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=37, seq_len=8, width=20, depth=2, heads=2, tie_embeddings=sys.argv[3] == "1"))
    sd = torch.load(sys.argv[2], weights_only=True)
    assert all(type(v) is torch.Tensor for v in sd.values())
    model.load_state_dict(sd)  # strict
    torch.save({n: p.detach() for n, p in model.named_parameters()}, sys.argv[4])
    """
)


@pytest.mark.e2e
@pytest.mark.parametrize("tie", [False, True])
def test_export_full_loads_without_fsdpfn(run_on_ranks, tmp_path, tie):
    path = str(tmp_path / "model.pt")
    expected = run_on_ranks(_export, 2, path, tie)[0]
    gpt_src = os.path.join(os.path.dirname(fsdpfn.__file__), "models", "_gpt.py")
    out = str(tmp_path / "loaded.pt")
    subprocess.run([sys.executable, "-c", _NO_FSDPFN_LOAD, gpt_src, path, "1" if tie else "0", out], check=True)
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == expected.keys()
    for n in expected:
        assert torch.equal(loaded[n], expected[n]), n
    if tie:
        assert set(torch.load(path, weights_only=True)) >= {"embed.weight", "head.weight"}


# ---- a save interrupted by a dying rank ------------------------------------------------------


def _die_at(stage, rank):
    """Makes this process exit abruptly (as if killed) at ``stage`` of the next save: "write"
    (its shards written, before the ranks exchange metadata), "commit" (everything written,
    at the rename that publishes the checkpoint). Test-only: patches this process alone."""
    import torch.distributed.checkpoint as dcp

    if stage == "write":
        write_data = dcp.FileSystemWriter.write_data

        def dying_write_data(self, plan, planner):
            write_data(self, plan, planner).wait()
            os._exit(137)

        dcp.FileSystemWriter.write_data = dying_write_data
    elif stage == "commit":
        rename = os.rename

        def dying_rename(src, dst, *args, **kwargs):
            if os.path.basename(os.fspath(src)).startswith(".partial-"):
                os._exit(137)
            return rename(src, dst, *args, **kwargs)

        os.rename = dying_rename
    else:
        raise ValueError(f"unknown stage {stage!r}")


def _kill_worker(rank, world, init_file, root, die_at):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    _, plan, state = _setup(world, "zero3")
    state = {**state, "step": 1}
    checkpoint.save(root, state, plan)  # the previous, complete checkpoint
    state = {**state, "params": {n: p + 1 for n, p in state["params"].items()}, "step": 2}
    stage, dying = die_at.split(":")
    if rank == int(dying):
        _die_at(stage, rank)
    checkpoint.save(root, state, plan)  # one rank dies in here
    os._exit(3)  # not reached by the dying rank; survivors should have raised before this


def _spawn_and_kill(root, die_at, world=2):
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    init_file = os.path.join(tempfile.mkdtemp(prefix="fsdpfn_kill_"), "store")
    procs = [ctx.Process(target=_kill_worker, args=(r, world, init_file, root, die_at)) for r in range(world)]
    for p in procs:
        p.start()
    dying = int(die_at.split(":")[1])
    procs[dying].join(timeout=120)
    for p in procs:  # the survivors are stuck in (or failing out of) a collective: end them
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _load_step1(rank, world, root):
    _, plan, template = _setup(world, "zero3", seed=5)
    state = checkpoint.load(root, template, plan)
    _, _, expected = _setup(world, "zero3")
    got, want = _full(state), _full({**expected, "step": 1})
    same = all(torch.equal(got[p], want[p]) if isinstance(want[p], torch.Tensor) else got[p] == want[p] for p in want)
    # A new save over the debris of the killed one works and cleans it up.
    checkpoint.save(root, {**state, "step": 3}, plan)
    return same


@pytest.mark.e2e
@pytest.mark.parametrize("die_at", ["write:1", "commit:0"])
def test_killed_save_leaves_previous_checkpoint_loadable(run_on_ranks, tmp_path, die_at):
    """A rank dies mid-save ("write:1": rank 1 after writing its data, before the metadata;
    "commit:0": rank 0 after all data and metadata, before publishing). The previous checkpoint
    (step 1) still loads bitwise in a fresh group, and the next save succeeds."""
    root = str(tmp_path / "ckpt")
    codes = _spawn_and_kill(root, die_at)
    assert codes[int(die_at.split(":")[1])] == 137, codes
    assert checkpoint.read_info(root)["values"]["step"] == 1
    assert any(n.startswith(".partial-step_00000002") for n in os.listdir(root))  # the debris
    assert all(run_on_ranks(_load_step1, 2, root))
    assert checkpoint.read_info(root)["values"]["step"] == 3
    assert not any(n.startswith(".partial-") for n in os.listdir(root))


# ---- with fsdpfn.optim's real states ------------------------------------------------------------


def test_resume_is_bitwise_with_fsdpfn_muon(run_on_ranks, tmp_path):
    """fsdpfn.optim.muon (Muon + AdamW partition, owner-layout Newton–Schulz): 2N steps straight ==
    N, save, load, N (2 ranks, zero3), every parameter and state leaf bitwise."""
    assert run_on_ranks(_real_resume_parity, 2, str(tmp_path / "ckpt"), "muon", 2) == [[], []]


def test_muon_and_adamw_state_reshard_2_to_3_and_1(run_on_ranks, tmp_path):
    """fsdpfn.optim states saved on 2 ranks zero3 load bitwise on 3 ranks zero2, on 1 rank, and
    (AdamW) on 4 ranks as HSDP 2x2 (placements (Replicate(), Shard(0)))."""
    for opt_name in ["muon", "adamw"]:
        root = str(tmp_path / opt_name)
        saved = run_on_ranks(_real_save, 2, root, opt_name)[0]
        assert any("momentum_buffer" in p for p in saved) if opt_name == "muon" else any("/mu/" in p for p in saved)
        for world, strategy in [(3, "zero2"), (1, "zero3")] + ([(4, "hsdp")] if opt_name == "adamw" else []):
            for loaded in run_on_ranks(_real_load, world, root, opt_name, strategy):
                assert loaded.keys() == saved.keys()
                for p in saved:
                    same = (
                        torch.equal(loaded[p], saved[p])
                        if isinstance(saved[p], torch.Tensor)
                        else loaded[p] == saved[p]
                    )
                    assert same, (opt_name, world, p)


def _real_save_as(rank, world, root, strategy):
    model, plan, state = _setup_real(world, strategy, "adamw")
    state = _train_real(model, plan, state, 1, rank, world, "adamw")
    checkpoint.save(root, state, plan)
    return _full(state)


def test_replicated_chunks_are_written_once(run_on_ranks, tmp_path):
    """Each rank writes only its own subdirectory, and a chunk held by several ranks is written
    once: HSDP 2x2 saves from the first replica group (ranks 0 and 1) only, a replicated plan
    from rank 0 only. Both load bitwise into 3 ranks zero2."""
    for world, strategy, writers in [(4, "hsdp", ["rank_0", "rank_1"]), (2, "replicate", ["rank_0"])]:
        root = str(tmp_path / strategy)
        saved = run_on_ranks(_real_save_as, world, root, strategy)[0]
        ckpt = checkpoint.latest(root)
        assert sorted(n for n in os.listdir(ckpt) if n.startswith("rank_")) == writers, strategy
        files = checkpoint.read_info(root)["files"]
        assert sorted(files) == [".metadata"] + [f"{w}/__0_0.distcp" for w in writers], files
        for loaded in run_on_ranks(_real_load, 3, root, "adamw", "zero2"):
            assert loaded.keys() == saved.keys()
            for p in saved:
                same = torch.equal(loaded[p], saved[p]) if isinstance(saved[p], torch.Tensor) else loaded[p] == saved[p]
                assert same, (strategy, p)


# ---- the deadlock of seed 001: a save gated on rank 0 --------------------------------------------


def _gated_worker(rank, world, init_file, root, report):
    import time

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    if rank == 0:  # the bug: only rank 0 saves
        try:
            checkpoint.save(root, {"w": torch.ones(2), "step": 1}, timeout=3)
            msg = "no error"
        except RuntimeError as e:
            msg = str(e)
        with open(report, "w") as f:
            f.write(msg)
    else:
        time.sleep(8)  # busy elsewhere, never entering the save
    os._exit(0)


@pytest.mark.e2e
def test_save_gated_on_rank_0_fails_naming_the_missing_rank(tmp_path):
    """Seed 001: `if rank == 0: save(...)` deadlocked. Here rank 0 gets an error within the
    timeout that names rank 1 and says to call the save on every rank; nothing is published."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    init_file = os.path.join(tempfile.mkdtemp(prefix="fsdpfn_gated_"), "store")
    report, root = str(tmp_path / "report.txt"), str(tmp_path / "ckpt")
    procs = [ctx.Process(target=_gated_worker, args=(r, 2, init_file, root, report)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    with open(report) as f:
        msg = f.read()
    assert "every rank must call it" in msg and "Ranks 1 failed" in msg, msg
    assert checkpoint.latest(root) is None
