"""fsdpfn.checkpoint under faults: damaged, truncated and missing files, errors on one rank, and
a collective counter that sees every torch.distributed call a save and a load make.

A damaged checkpoint must never load silently: given a checkpoint root, the load falls back to
the newest intact checkpoint with a warning naming what it skipped and why; given a checkpoint
directory, it raises naming the file. An error on one rank reaches every rank (no hang).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdpfn import checkpoint, comm, testing
from fsdpfn.checkpoint import CheckpointError

SHARD = "rank_1/__0_0.distcp"  # rank 1's shards: 2-rank saves of _state put rows 5..9 of "w" here


def _state(world, step):
    """10x4 "w" sharded by rows (5/5 on 2 ranks), a replicated plain "b", the step."""
    w = torch.arange(40.0).view(10, 4) + 100 * step
    b = torch.full((3,), float(step))
    if world > 1 or comm.is_initialized():
        w = distribute_tensor(w, testing.mesh((world,)), [Shard(0)])
    return {"params": {"w": w, "b": b}, "step": step}


def _full(state):
    entries, _ = checkpoint.flatten_state(state)
    return {p: (comm.full_tensor(v) if isinstance(v, DTensor) else v) for p, v in entries.items()}


def _same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[p], b[p]) if isinstance(a[p], torch.Tensor) else a[p] == b[p] for p in a
    )


def _save_steps(rank, world, root, steps):
    return [checkpoint.save(root, _state(world, s)) for s in steps]


def _load(rank, world, path):
    """What a load of ``path`` does on this rank: ("ok", step, bitwise equal to that step's state)
    or ("error", type, message, file), and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state, info = checkpoint.load(path, _state(world, 99), return_info=True)
            assert info["dir"] == os.path.join(os.path.dirname(info["dir"]), f"step_{state['step']:08d}")
            out = ("ok", state["step"], _same(_full(state), _full(_state(world, state["step"]))))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out = ("error", type(e).__name__, str(e), getattr(e, "file", None))
    return out, [str(w.message) for w in caught]


def _flip_bytes(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(8)
        f.seek(-len(b), os.SEEK_CUR)
        f.write(bytes(x ^ 0xFF for x in b))


def _truncate(path, keep=0.5):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


# ---- damaged, truncated, missing: multi-rank ----------------------------------------------------


def test_flipped_bytes_fall_back_from_root_and_raise_for_the_directory(run_on_ranks, tmp_path):
    """Bytes flipped in rank 1's shard of step 2 (same size, so only the checksum tells): a load
    of the root gives step 1 bitwise on both ranks, each warning that step 2 was skipped and why;
    a load of step 2's directory raises CheckpointError on both ranks naming the file, although
    only rank 1 reads (and so verifies) that file."""
    root = str(tmp_path / "ckpt")
    _, step2 = run_on_ranks(_save_steps, 2, root, [1, 2])[0]
    _flip_bytes(os.path.join(step2, SHARD))

    for out, caught in run_on_ranks(_load, 2, root):
        assert out == ("ok", 1, True), out
        assert len(caught) == 1 and "step_00000002" in caught[0] and SHARD in caught[0], caught
        assert "damaged" in caught[0] and "using" in caught[0] and "step_00000001" in caught[0], caught

    for rank, (out, caught) in enumerate(run_on_ranks(_load, 2, step2)):
        assert out[:2] == ("error", "CheckpointError") and out[3] == SHARD, out
        assert step2 in out[2] and "damaged" in out[2] and not caught, out
        if rank == 0:
            assert "on rank 1" in out[2], out  # rank 0 learned it from rank 1


def test_latest_pointing_at_a_deleted_step_falls_back(run_on_ranks, tmp_path):
    root = str(tmp_path / "ckpt")
    _, step2 = run_on_ranks(_save_steps, 2, root, [1, 2])[0]
    shutil.rmtree(step2)
    with pytest.warns(UserWarning, match=r"step_00000002: checkpoint .* does not exist"):
        assert checkpoint.latest(root) == os.path.join(root, "step_00000001")
    for out, caught in run_on_ranks(_load, 2, root):
        assert out == ("ok", 1, True) and len(caught) == 1 and "does not exist" in caught[0], (out, caught)


def _save_failing_on_rank_1(rank, world, root):
    import torch.distributed.checkpoint as dcp

    def no_space(self, plan, planner):
        raise OSError(28, "No space left on device")

    write_data = dcp.FileSystemWriter.write_data
    if rank == 1:  # a full disk on one rank only; undone below, the worker process is reused
        dcp.FileSystemWriter.write_data = no_space
    try:
        checkpoint.save(root, _state(world, 2))
        return "saved"
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"
    finally:
        dcp.FileSystemWriter.write_data = write_data


def test_save_error_on_one_rank_reaches_every_rank(run_on_ranks, tmp_path):
    """Rank 1 cannot write its shards: both ranks raise (rank 0 naming rank 1 and the error),
    nothing is published, the previous checkpoint stays latest."""
    root = str(tmp_path / "ckpt")
    run_on_ranks(_save_steps, 2, root, [1])
    errors = run_on_ranks(_save_failing_on_rank_1, 2, root)
    assert all(e.startswith("OSError") and "No space left on device" in e for e in errors), errors
    assert "on rank 1" in errors[0] and ".partial-step_00000002" in errors[0], errors
    assert checkpoint.latest(root) == os.path.join(root, "step_00000001")


# ---- truncated files, the manifest, old checkpoints: one process ------------------------------


def _two_steps(tmp_path):
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        checkpoint.save(root, _state(1, step))
    return root, os.path.join(root, "step_00000002")


def test_truncated_shard_is_named_and_skipped(tmp_path):
    root, step2 = _two_steps(tmp_path)
    shard = os.path.join(step2, "rank_0", "__0_0.distcp")
    _truncate(shard)
    truncated = r"rank_0/__0_0\.distcp.* is truncated: \d+ bytes, fsdpfn.json recorded"
    with pytest.raises(CheckpointError, match=truncated) as e:
        checkpoint.load(step2, _state(1, 0))
    assert e.value.path == step2 and e.value.file == "rank_0/__0_0.distcp"
    with pytest.warns(UserWarning, match=r"(?s)using .*step_00000001.*step_00000002.*truncated"):
        assert checkpoint.load(root, _state(1, 0))["step"] == 1
    with pytest.warns(UserWarning, match="truncated"):  # latest() checks sizes too
        assert checkpoint.latest(root) == os.path.join(root, "step_00000001")


def test_truncated_manifest_is_named_and_skipped(tmp_path):
    root, step2 = _two_steps(tmp_path)
    _truncate(os.path.join(step2, "fsdpfn.json"), keep=0.3)
    with pytest.raises(CheckpointError, match=r"fsdpfn\.json.* is not a valid checkpoint manifest") as e:
        checkpoint.read_info(step2)
    assert e.value.file == "fsdpfn.json" and not isinstance(e.value.__cause__, json.JSONDecodeError)
    with pytest.raises(CheckpointError, match=r"fsdpfn\.json"):
        checkpoint.load(step2, _state(1, 0))
    with pytest.warns(UserWarning, match=r"(?s)step_00000002.*fsdpfn\.json.*not a valid checkpoint manifest"):
        assert checkpoint.read_info(root)["values"]["step"] == 1
    with pytest.warns(UserWarning, match="not a valid checkpoint manifest"):
        state = checkpoint.load(root, _state(1, 0))
    assert state["step"] == 1 and torch.equal(state["params"]["w"], _state(1, 1)["params"]["w"])


def test_manifest_of_another_kind_and_missing_metadata(tmp_path):
    root, step2 = _two_steps(tmp_path)
    with open(os.path.join(step2, "fsdpfn.json"), "w") as f:
        json.dump([1, 2, 3], f)
    with pytest.raises(CheckpointError, match=r"valid JSON but not a checkpoint manifest"):
        checkpoint.read_info(step2)
    step1 = os.path.join(root, "step_00000001")
    os.remove(os.path.join(step1, ".metadata"))
    with pytest.raises(CheckpointError, match=r"'\.metadata' is missing"):
        checkpoint.load(step1, _state(1, 0))
    # Nothing intact is left: the error lists both checkpoints and why each was skipped.
    with pytest.raises(CheckpointError, match=r"(?s)no intact checkpoint.*step_00000002.*step_00000001"):
        checkpoint.load(root, _state(1, 0))


def test_damage_outside_what_is_loaded_does_not_reject(tmp_path):
    """Only the files a load reads are hashed: with the one shard file damaged, a load of the
    tensors raises, a load of the values alone (which reads no shard) still works."""
    root = str(tmp_path / "ckpt")
    checkpoint.save(root, {"params": {"w": torch.ones(3)}, "step": 1})
    ckpt = checkpoint.latest(root)
    _flip_bytes(os.path.join(ckpt, "rank_0", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint.load(ckpt, {"params": {"w": torch.zeros(3)}})
    assert checkpoint.load(ckpt, {"step": 0})["step"] == 1


def test_old_checkpoint_without_checksums_still_names_a_truncated_file(tmp_path):
    """A manifest without a file list (format 1) is loaded unverified; a truncated shard then
    fails inside DCP, and the error still names the file rather than torch's bare message."""
    root, step2 = _two_steps(tmp_path)
    info_path = os.path.join(step2, "fsdpfn.json")
    with open(info_path) as f:
        info = json.load(f)
    del info["files"]
    with open(info_path, "w") as f:
        json.dump({**info, "format": 1}, f)
    assert torch.equal(checkpoint.load(step2, _state(1, 0))["params"]["w"], _state(1, 2)["params"]["w"])
    _truncate(os.path.join(step2, "rank_0", "__0_0.distcp"), keep=0.9)
    with pytest.raises(CheckpointError, match=r"reading .*rank_0/__0_0\.distcp' failed") as e:
        checkpoint.load(step2, _state(1, 0))
    assert e.value.file == "rank_0/__0_0.distcp"


def test_latest_verify_hashes_everything(tmp_path):
    root, step2 = _two_steps(tmp_path)
    _flip_bytes(os.path.join(step2, "rank_0", "__0_0.distcp"))
    assert checkpoint.latest(root) == step2  # sizes only: the flip is invisible
    with pytest.warns(UserWarning, match=r"(?s)step_00000002.*damaged"):
        assert checkpoint.latest(root, verify=True) == os.path.join(root, "step_00000001")


# ---- export_full: an error on rank 0 reaches rank 1 ---------------------------------------------


def _export_into(rank, world, path):
    params = _state(world, 1)["params"]
    try:
        checkpoint.export_full(path, {"w": params["w"]}, timeout=60)
        return "exported"
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"


def test_export_full_error_on_rank_0_reaches_rank_1(run_on_ranks, tmp_path):
    """Rank 0 cannot write the file (its directory is a regular file). Before, rank 1 waited in
    a barrier forever; now both ranks raise, naming the path, within the test's timeout."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    path = str(blocker / "model.pt")
    errors = run_on_ranks(_export_into, 2, path, timeout=90)
    for e in errors:
        assert e.split(":")[0] in {"NotADirectoryError", "FileExistsError", "OSError"} and path in e, errors
    assert "on rank 0" in errors[1], errors


# ---- the counter sees every torch.distributed call ----------------------------------------------

# Every method of torch's ProcessGroup that moves data or synchronises ranks (torch 2.13).
_PG_CALLS = (
    "allgather",
    "all_gather_single",
    "_allgather_base",
    "allgather_coalesced",
    "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "recv",
    "recv_anysource",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "scatter",
    "send",
)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _every_call(rank, world, root):
    """Save + load with every collective method of torch's ProcessGroup wrapped (whatever calls
    it: fsdpfn.comm, DCP, DTensor), next to fsdpfn.comm's counter."""
    from torch._C._distributed_c10d import ProcessGroup

    state, template = _state(world, 1), _state(world, 7)
    seen, originals = [], {n: getattr(ProcessGroup, n) for n in _PG_CALLS if hasattr(ProcessGroup, n)}
    # The class attributes themselves (pybind method descriptors), to put back unchanged: the
    # worker process runs later tests too.
    raw = {n: ProcessGroup.__dict__[n] for n in originals if n in ProcessGroup.__dict__}

    def wrap(name, orig):
        def call(self, *args, **kwargs):
            seen.append((name, max((t.numel() * t.element_size() for t in _tensors(args)), default=0)))
            return orig(self, *args, **kwargs)

        return call

    for name, orig in originals.items():
        setattr(ProcessGroup, name, wrap(name, orig))
    try:
        with comm.count_collectives() as counter:
            checkpoint.save(root, state)
            loaded = checkpoint.load(root, template)
    finally:
        for name in originals:
            if name in raw:
                setattr(ProcessGroup, name, raw[name])
            else:
                delattr(ProcessGroup, name)
    assert _same(_full(loaded), _full(state))
    return seen, [(c.kind, c.nbytes) for c in counter.calls], counter.counts()


def test_counter_sees_every_torch_distributed_call(run_on_ranks, tmp_path):
    """Every ProcessGroup call of a save + load is one call of fsdpfn.comm's counter, with the
    same bytes: DCP's own object collectives are gone. The protocol, counted: save = entry check
    + rank 0's name (2 broadcasts) + every rank's metadata (2 all-gathers) + rank 0's commit (2
    broadcasts); load = entry check + the verdict on the checkpoint (2 all-gathers) + the read
    outcome (2 all-gathers)."""
    for seen, counted, counts in run_on_ranks(_every_call, 2, str(tmp_path / "ckpt")):
        assert len(seen) == len(counted), (seen, counted)
        assert sum(b for _, b in seen) == sum(b for _, b in counted), (seen, counted)
        assert counts == {"barrier": 2, "broadcast": 4, "all_gather": 6}, counts
        assert sorted(n for n, _ in seen).count("monitored_barrier") == 2, seen
