"""The published curves behind the GPU presets (fsdpfn/sim/_rates.py): each reproduces its
source's points, and moves the way its source says it moves."""

import dataclasses

import pytest
import torch

from fsdpfn import sim
from fsdpfn._flops import rate_key, split_key
from fsdpfn.sim import _rates


def test_matmul_shape_table_reproduces_its_source_points():
    """At the table's own grid points the curve is XLA's measured sm_90 bf16 throughput (to the
    0.1 TFLOP/s the table is kept at), as a fraction of the 989 TFLOP/s dense peak."""
    for (rows, cols, k), tflops in _rates._XLA_SM90_BF16.items():
        assert _rates.matmul_shape_efficiency("h100", "bfloat16", rows, cols, k) * 989.0 == pytest.approx(
            tflops, abs=1e-9
        )
    # A GEMM and its transpose are one kernel's work.
    assert _rates.matmul_shape_efficiency("h100", "bfloat16", 1024, 4096, 2048) == _rates.matmul_shape_efficiency(
        "h100", "bfloat16", 4096, 1024, 2048
    )


def test_matmul_shape_curve_grows_with_the_inner_dimension_and_levels_off():
    """For the shapes of the profiled models (many rows), the source's throughput rises with k
    at every (rows, cols) of the grid; beyond the table it stays at its edge."""
    eff = lambda m, n, k: _rates.matmul_shape_efficiency("h100", "bfloat16", m, n, k)  # noqa: E731
    for rows in (4096, 8192, 16384):
        for cols in (1024, 2048, 4096):
            ks = [eff(rows, cols, k) for k in (1024, 1536, 2048, 3072, 4096)]
            assert ks == sorted(ks)
    assert eff(65536, 8192, 8192) == eff(16384, 4096, 4096)
    assert _rates.matmul_shape_efficiency("a100", "bfloat16", 4096, 4096, 4096) is None  # no table: the flat rate


def test_preset_prices_a_matmul_by_its_shape():
    """The H100 preset's matmul of known shape runs at the table's rate (times sustained), with
    no extra latency; the same FLOPs without a shape at the best-shape rate plus the latency."""
    hw = sim.H100_SXM
    k = hw.kernels
    flops = 2.0 * 16384 * 1536 * 1536
    shaped = hw.kernel_seconds("bfloat16@16384x1536x1536", flops, 0.0)
    rate = _rates.matmul_shape_efficiency("h100", "bfloat16", 16384, 1536, 1536) * 989e12 * k.sustained
    assert shaped == pytest.approx(flops / rate, rel=1e-12)
    flat = hw.kernel_seconds("bfloat16", flops, 0.0)
    assert flat == pytest.approx(flops / (k.matmul_efficiency * 989e12 * k.sustained) + k.matmul_latency, rel=1e-12)


def test_rate_key_carries_the_shape_of_matmuls_and_attention():
    a, b = torch.zeros(6, 4, 3, device="meta"), torch.zeros(6, 3, 5, device="meta")
    assert rate_key(torch.ops.aten.bmm.default, (a, b), {}, torch.bfloat16) == "bfloat16@24x5x3"
    assert split_key("attention bfloat16@2048x2048x112") == ("attention bfloat16", (2048, 2048, 112))
    assert sim.H100_SXM.flops("bfloat16@24x5x3") == sim.H100_SXM.flops("bfloat16")


def test_flashattention2_runs_padded_head_dims():
    """flash_api.cpp rounds a head up to a multiple of 32 (64 above 128): MPT-30B's 112 runs the
    128 kernel, which the preset charges as 128/112 of the time of an unpadded head."""
    assert [_rates.attention_head_dim("fa2", d) for d in (64, 80, 112, 128, 160)] == [64, 96, 128, 128, 192]
    assert _rates.attention_head_dim("fa3", 112) == 112
    hw = sim.H100_SXM
    f, b = 1e12, 1e9
    plain = dataclasses.replace(hw, kernels=dataclasses.replace(hw.kernels, attention_kernel=""))
    lat = hw.kernels.matmul_latency
    padded = hw.kernel_seconds("attention bfloat16@8192x8192x112", f, b) - lat
    assert padded == pytest.approx(
        (plain.kernel_seconds("attention bfloat16@8192x8192x112", f, b) - lat) * 128 / 112, rel=1e-12
    )


def test_links_run_at_the_published_nccl_bus_bandwidth():
    """H100: 370 of NVLink's 450 GB/s (NVIDIA/nccl-tests #212); A100: 232.54 of 300 (#175)."""
    assert sim.H100_SXM.link("all_gather", inter=False).bandwidth == pytest.approx(370e9)
    assert sim.A100_SXM.link("all_gather", inter=False).bandwidth == pytest.approx(232.54e9)
    assert sim.A100_SXM.link("all_gather", inter=True).bandwidth == pytest.approx(21.5e9)
    for key in _rates.NCCL:
        assert 0 < _rates.nccl_efficiency(*key) < 1
