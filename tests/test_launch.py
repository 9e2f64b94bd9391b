"""fsdpfn.launch with NCCL where CUDA cannot work: every rank says what is missing (a CPU-only
torch, no usable GPU, fewer GPUs than local ranks) before it touches CUDA or starts a process
group, instead of failing deep inside torch. The CUDA state is faked, so these run (and mean the
same) on any machine."""

from __future__ import annotations

import re

import pytest
import torch

from fsdpfn import comm, launch as launch_mod
from fsdpfn.launch import cuda_problem, launch


def _fake_cuda(monkeypatch, *, built: bool, available: bool = False, count: int = 0) -> list:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    set_device_calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device_calls.append)
    return set_device_calls


def _main(rank, world_size):
    return rank


def test_cuda_problem_names_what_is_missing_and_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_cuda(monkeypatch, built=False)
    assert cuda_problem(0) == (
        f"this torch ({torch.__version__}) is a CPU-only build: it cannot use a GPU. Install a "
        "CUDA build of torch (https://pytorch.org/get-started/locally/)"
    )

    _fake_cuda(monkeypatch, built=True, available=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    problem = cuda_problem(0)
    assert "finds no usable GPU (CUDA_VISIBLE_DEVICES='' limits which GPUs this process sees)" in problem, problem
    assert "nvidia-smi" in problem

    _fake_cuda(monkeypatch, built=True, available=True, count=2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_problem(0) is None and cuda_problem(1) is None
    assert cuda_problem(2) == (
        "this process is local rank 2, which needs GPU 2, but it sees 2 GPU(s): start at most "
        "2 process(es) per node (torchrun --nproc_per_node 2)"
    )


@pytest.mark.parametrize(
    "built, available, count, local_rank, missing",
    [
        (False, False, 0, 0, "is a CPU-only build"),
        (True, False, 0, 0, "finds no usable GPU"),
        (True, True, 1, 1, "is local rank 1, which needs GPU 1, but it sees 1 GPU(s)"),
    ],
)
def test_under_torchrun_nccl_fails_before_cuda_or_the_process_group(
    monkeypatch, built, available, count, local_rank, missing
):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    set_device_calls = _fake_cuda(monkeypatch, built=built, available=available, count=count)
    monkeypatch.setattr(comm, "init_process_group", lambda *a, **k: pytest.fail("the process group was started"))
    with pytest.raises(
        RuntimeError,
        match=re.escape(f"rank 1 of 2 (backend 'nccl', LOCAL_RANK {local_rank}): this ") + ".*" + re.escape(missing),
    ):
        launch(_main, 2, backend="nccl")
    assert set_device_calls == []


def test_under_torchrun_the_default_backend_checks_the_gpu_too(monkeypatch):
    # CUDA available picks NCCL; a local rank without its own GPU is named, not left to NCCL.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    _fake_cuda(monkeypatch, built=True, available=True, count=2)
    monkeypatch.setattr(comm, "init_process_group", lambda *a, **k: pytest.fail("the process group was started"))
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node 2"):
        launch(_main)


def test_spawning_nccl_ranks_checks_once_before_any_process_starts(monkeypatch):
    _fake_cuda(monkeypatch, built=False)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch_mod.mp, "get_context", lambda *a: pytest.fail("a process was spawned"))
    with pytest.raises(RuntimeError, match=r"^launch\(backend='nccl', world_size=2\): this torch .* CPU-only build"):
        launch(_main, 2, backend="nccl")
