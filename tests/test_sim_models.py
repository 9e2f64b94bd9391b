"""fsdpfn.sim's device models against hand-computed cases: the kernel model (matmul roofline
with a per-kernel latency, the fused-attention ramp, streaming bytes, the sustained fraction),
the network per node (NCCL rings over all of a node's cards), memory (plan.cost()'s static
bytes plus the profiled activations, and the allocator's reserve), FP8 gather bytes and
tensor-parallel activation collectives timed with plan.cost()'s bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import runtime, sim
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig

# Every expected time below is a sum of a few products and quotients of exact decimal inputs:
# float64 rounding is ~1e-16 relative per operation, so 1e-12 relative is far above it.
REL = 1e-12

KERNELS = sim.Kernels(
    matmul_efficiency=0.5,
    matmul_latency=1e-5,
    attention_efficiency=0.25,
    attention_half_intensity=100.0,
    memory_efficiency=0.8,
)


def _hw(kernels=KERNELS, **kw):
    args = dict(
        name="toy",
        matmul_flops={"bfloat16": 1e12, "float32": 1e11},
        memory_bandwidth=1e11,
        memory=2**34,
        devices_per_node=8,
        intra=sim.Link(3e-6, 400e9),
        inter=sim.Link(1e-5, 25e9),
        kernels=kernels,
    )
    args.update(kw)
    return sim.Hardware(**args)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def test_matmul_compute_bound_by_hand():
    hw = _hw()
    # 1000^3: 2e9 FLOPs at 0.5 x 1e12 = 4 ms; operands 3e6 bf16 elements = 6e6 B at 0.8 x 1e11: 75 us.
    assert KERNELS.matmul_seconds(1000, 1000, 1000, torch.bfloat16, hw) == pytest.approx(4e-3 + 1e-5, rel=REL)


def test_matmul_memory_bound_by_hand():
    hw = _hw()
    # (100000 x 100) @ (100 x 2): 4e7 FLOPs (80 us of compute) over (1e7 + 200 + 2e5) * 2 B
    # = 2.04004e7 B at 8e10 B/s = 255.005 us: the bytes bound it.
    expected = (1e7 + 200 + 2e5) * 2 / 8e10 + 1e-5
    assert KERNELS.matmul_seconds(100000, 2, 100, "bfloat16", hw) == pytest.approx(expected, rel=REL)


def test_matmul_efficiency_curve_rises_to_the_large_gemm_rate():
    hw = _hw()
    sizes = [64, 256, 1024, 4096, 16384]
    rates = [KERNELS.achieved(s, s, s, "bfloat16", hw) for s in sizes]
    assert rates == sorted(rates)
    # F / (F + latency * rate): 16384^3 is 8.8e12 FLOPs against 1e-5 s * 5e11 = 5e6.
    f = 2.0 * 16384**3
    assert rates[-1] == pytest.approx(0.5e12 * f / (f + 1e-5 * 0.5e12), rel=1e-9)
    assert rates[0] < 0.1 * 0.5e12  # a 64^3 matmul is latency


def test_attention_ramp_by_hand():
    hw = _hw()
    # intensity 1e9 / 1e7 = 100 FLOP/B = the half point: rate 0.25 x 1e12 x 0.5.
    assert hw.kernel_seconds("attention bfloat16", 1e9, 1e7) == pytest.approx(1e9 / 1.25e11 + 1e-5, rel=REL)
    # 4x the intensity: 400 / 500 of the long-sequence rate.
    assert hw.kernel_seconds("attention bfloat16", 4e9, 1e7) == pytest.approx(4e9 / (0.25e12 * 0.8) + 1e-5, rel=REL)


def test_attention_flop_ratio_by_hand():
    """A rate published in FlashAttention's FLOP convention (backward counted as 2.5 forwards,
    3.5 for both) applies to 3.5 / 3 of the FLOPs the profile counts (backward as 2)."""
    k = sim.Kernels(0.5, 1e-5, 0.25, 100.0, 0.8, attention_flop_ratio=3.5 / 3)
    hw = _hw(kernels=k)
    # intensity 4e9 / 1e7 = 400 FLOP/B: ramp 400 / 500; rate 0.25 x 1e12 x 0.8 = 2e11 FLOP/s.
    assert hw.kernel_seconds("attention bfloat16", 4e9, 1e7) == pytest.approx(3.5 / 3 * 4e9 / 2e11 + 1e-5, rel=REL)
    # Matmuls are not attention: the ratio does not touch them.
    assert hw.kernel_seconds("bfloat16", 2e9, 6e6) == pytest.approx(4e-3 + 1e-5, rel=REL)
    with pytest.raises(ValueError, match="attention_flop_ratio"):
        sim.Kernels(0.5, 1e-5, 0.25, 100.0, 0.8, attention_flop_ratio=0.0)


def _attention_work(b, h, s, d):
    """The Work the profile counts for a causal bf16 attention forward and backward on meta."""
    from fsdpfn.sim._workload import _FusedAttentionOnMeta

    q, k, v = (torch.zeros(b, h, s, d, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(3))

    def run():
        with _FusedAttentionOnMeta():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return sim.count_work(run)[1]


def test_h100_attention_is_the_published_flashattention2_time():
    """The H100 preset's attention, at the kernel benchmark's own shape (batch 2 x 8,192 tokens,
    16 heads of 128, causal, bf16) and at the benchmark's clocks (sustained = 1), takes the
    published FlashAttention-2 time: 1.935 ms forward + 4.788 ms backward (hopper/benchmark_attn.py
    as posted in Dao-AILab/flash-attention pull request #1791)."""
    import dataclasses

    w = _attention_work(2, 16, 8192, 128)
    fwd_flops = 4.0 * 2 * 16 * 8192 * 8192 * 128 / 2  # causal: half
    key = "attention bfloat16@8192x8192x128"  # the shape rides along: s_q x s_k x head dim
    assert [(r, f) for r, f, _, _ in w.matmuls] == [(key, fwd_flops), (key, 2 * fwd_flops)]
    hw = dataclasses.replace(sim.H100_SXM, kernels=dataclasses.replace(sim.H100_SXM.kernels, sustained=1.0))
    seconds = sum(c * (hw.kernel_seconds(r, f, b) - hw.kernels.matmul_latency) for r, f, b, c in w.matmuls)
    # attention_efficiency is 0.2894 / 0.9578 rounded to three digits (0.302 for 0.30215): 0.05%.
    assert seconds == pytest.approx(1.935e-3 + 4.788e-3, rel=2e-3)


def test_attention_ramp_at_short_sequences_from_the_profile():
    """The ramp reads the profile's own bytes: 512 tokens (~130 FLOP/B) runs at
    I / (I + 90) of the long-sequence rate, 16k tokens at ~0.98."""
    for s, lo, hi in ((512, 0.55, 0.62), (16384, 0.97, 0.99)):
        w = _attention_work(1, 16, s, 128)
        k = sim.H100_SXM.kernels
        for r, f, b, _ in w.matmuls:
            ramp = k.attention_rate("bfloat16", f, b, sim.H100_SXM) / (k.sustained * k.attention_efficiency * 989e12)
            assert ramp == pytest.approx((f / b) / (f / b + 90.0), rel=REL)
            assert lo < ramp < hi


def test_torchtitan_op_checkpointing_as_save_names_recomputes_three_of_seven_matmuls():
    """torchtitan's per-operator selective checkpointing keeps the attention output and every
    other matmul of a Llama block (wq, wv, w1, w2 of wq, wk, wv, wo, w1, w3, w2); tagging those
    five results and remat="save_names:op_sac" recomputes exactly wk, wo and w3."""
    d, kv, ffn, heads, b, s = 64, 32, 96, 4, 2, 16
    hd = d // heads

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (
                torch.nn.Linear(d, d, bias=False),
                torch.nn.Linear(d, kv, bias=False),
                torch.nn.Linear(d, kv, bias=False),
            )
            self.wo = torch.nn.Linear(d, d, bias=False)
            self.w1, self.w2, self.w3 = (
                torch.nn.Linear(d, ffn, bias=False),
                torch.nn.Linear(ffn, d, bias=False),
                torch.nn.Linear(d, ffn, bias=False),
            )

        def forward(self, x):
            tag = lambda t: fsdpfn.checkpoint_name(t, "op_sac")  # noqa: E731
            q = tag(self.wq(x)).view(b, s, heads, hd).transpose(1, 2)
            k = self.wk(x).view(b, s, kv // hd, hd).transpose(1, 2).repeat_interleave(heads * hd // kv, dim=1)
            v = tag(self.wv(x)).view(b, s, kv // hd, hd).transpose(1, 2).repeat_interleave(heads * hd // kv, dim=1)
            a = tag(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            h = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
            return h + tag(self.w2(F.silu(tag(self.w1(h))) * self.w3(h)))

    with torch.device("meta"):
        model = torch.nn.Sequential(Block(), Block())
    x = torch.zeros(b, s, d, device="meta")
    plan = fsdpfn.plan(model, (1,), units=["0", "1"])
    wl = sim.profile(model, plan, x, remat_policies=("save_names:op_sac",))
    full = wl.with_remat({"0": "full"}).recompute("0")
    op = wl.with_remat({"0": "save_names:op_sac"}).recompute("0")
    tokens = b * s
    attn_fwd = 4.0 * b * heads * s * s * hd / 2
    assert full.flops == pytest.approx(2.0 * tokens * (d * d + 2 * d * kv + d * d + 3 * d * ffn) + attn_fwd, rel=REL)
    assert op.flops == pytest.approx(2.0 * tokens * (d * kv + d * d + d * ffn), rel=REL)  # wk, wo, w3


def test_sustained_scales_every_kernel_rate():
    slow = _hw(kernels=sim.Kernels(0.5, 1e-5, 0.25, 100.0, 0.8, sustained=0.5))
    fast = _hw()
    for rate, f, b in (("bfloat16", 2e9, 6e6), ("attention bfloat16", 1e9, 1e7)):
        assert slow.kernel_seconds(rate, f, b) - 1e-5 == pytest.approx(
            2 * (fast.kernel_seconds(rate, f, b) - 1e-5), rel=REL
        )
    assert slow.memory_seconds(1e9) == pytest.approx(2 * fast.memory_seconds(1e9), rel=REL)


def test_work_seconds_uses_the_kernel_model():
    hw = _hw(op_overhead=1e-6)
    w = sim.Work(matmuls=(("bfloat16", 2e9, 6e6, 3),), bytes=8e6, ops=5)
    assert w.seconds(hw) == pytest.approx(3 * (4e-3 + 1e-5) + 8e6 / 8e10 + 5e-6, rel=REL)


def test_without_kernels_the_plain_roofline():
    """Hardware fitted by sim.measure() has no kernel model: rates are taken as given."""
    hw = _hw(kernels=None)
    assert hw.kernel_seconds("bfloat16", 2e9, 6e6) == max(2e9 / 1e12, 6e6 / 1e11)
    assert hw.kernel_seconds("attention bfloat16", 2e9, 6e6) == max(2e9 / 1e12, 6e6 / 1e11)
    assert hw.memory_seconds(1e9) == 1e9 / 1e11


def test_kernels_reject_bad_values():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        sim.Kernels(1.5, 0.0, 0.5, 1.0, 0.9)
    with pytest.raises(ValueError, match="matmul_latency"):
        sim.Kernels(0.5, -1.0, 0.5, 1.0, 0.9)
    with pytest.raises(ValueError, match="nics_per_node"):
        _hw(nics_per_node=-1)


def test_presets_document_their_kernels():
    for hw in sim.PRESETS.values():
        assert hw.kernels is not None and hw.nics_per_node == 8
        assert 0 < hw.kernels.matmul_efficiency < 1 and 0 < hw.kernels.sustained <= 1
    # The measured large-GEMM rates (fsdpfn/sim/_rates.py): A100 271.2 of 312, H100 794.5 of 989 TFLOP/s.
    assert sim.A100_SXM.kernels.matmul_efficiency == pytest.approx(271.2 / 312, abs=1e-3)
    assert sim.H100_SXM.kernels.matmul_efficiency == pytest.approx(794.5 / 989, abs=1e-3)
    # One preset per part: the part's own memory, the same silicon's kernels.
    assert sim.H100_96GB_500W.memory_bandwidth == 2.4e12 and sim.H100_96GB_500W.kernels == sim.H100_SXM.kernels
    assert sim.A100_SXM_40GB.memory == 40960 * 2**20 and sim.A100_SXM_40GB.kernels == sim.A100_SXM.kernels
    # Compute beside a collective runs 18.9% slower (arXiv 2507.03114): overlap 0.811 on every GPU preset.
    assert all(hw.overlap == pytest.approx(0.811) for hw in sim.PRESETS.values())
    assert sim.H100_SXM.memory == 81559 * 2**20


# ---------------------------------------------------------------------------------------------
# Network per node
# ---------------------------------------------------------------------------------------------


def test_network_bandwidth_per_node_by_hand():
    hw = _hw(nics_per_node=8)  # 8 cards of 25 GB/s per node, NVLink 400 GB/s
    assert hw.network_bandwidth("all_gather", range(16)) == 200e9  # whole nodes: all 8 cards
    assert hw.network_bandwidth("all_gather", [0, 8, 16, 24]) == 25e9  # one rank per node: its own card
    assert hw.network_bandwidth("all_gather", [0, 1, 8, 9]) == 50e9  # two per node: two cards
    capped = _hw(nics_per_node=8, inter=sim.Link(1e-5, 100e9))
    assert capped.network_bandwidth("all_gather", range(16)) == 400e9  # 800 GB/s of cards, NVLink caps it
    assert _hw(nics_per_node=0).network_bandwidth("all_gather", range(16)) == 25e9  # inter is per rank


def test_collective_across_nodes_by_hand():
    hw = _hw(nics_per_node=8)
    n = 1.6e9
    # 16 ranks on 2 nodes: 15 hops, 15 * 2 / 16 = 1.875 of them network hops; (15/16) n sent at 200 GB/s.
    expected = 1.875 * 1e-5 + 13.125 * 3e-6 + 15 / 16 * n / 200e9
    assert hw.collective_seconds("all_gather", range(16), n) == pytest.approx(expected, rel=REL)
    # all-reduce: twice the hops and the bytes.
    expected_ar = 2 * 1.875 * 1e-5 + 2 * 13.125 * 3e-6 + 2 * 15 / 16 * n / 200e9
    assert hw.collective_seconds("all_reduce", range(16), n) == pytest.approx(expected_ar, rel=REL)
    # within one node: NVLink only.
    assert hw.collective_seconds("all_gather", range(8), n) == pytest.approx(7 * 3e-6 + 7 / 8 * n / 400e9, rel=REL)


def test_fsdp_across_nodes_not_slower_per_rank_than_one_card():
    """The failure the per-node model fixes: a ring over whole nodes used to be costed at one
    card's bandwidth, 8x too slow on DGX nodes."""
    h = sim.H100_SXM
    within = h.collective_seconds("reduce_scatter", range(8), 2**30)
    across = h.collective_seconds("reduce_scatter", range(64), 2**30)
    assert across < 1.5 * within


# ---------------------------------------------------------------------------------------------
# Memory, FP8 gathers, tensor parallelism
# ---------------------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=64, seq_len=16, width=32, depth=3, heads=4, bias=False)


def _setup(mesh, mp=None, tp=None, batch=2):
    with torch.device("meta"):
        model = GPT(CFG)
    plan = fsdpfn.plan(model, mesh, mp=mp, tp=tp)
    x = torch.zeros(batch, CFG.seq_len, dtype=torch.long, device="meta")
    wl = sim.profile(model, plan, x, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1).float(), x.flatten()))
    return plan, wl


def test_memory_is_plan_cost_plus_profiled_activations():
    plan, wl = _setup((4,))
    hw = _hw(memory_reserve=0.05)
    r = sim.simulate(plan, runtime.schedule(plan), wl, sim.AdamW(), hw)
    cost = plan.cost()
    assert r.memory["params"] == cost.memory["params"] and r.memory["grads"] == cost.memory["grads"]
    assert r.memory["optimizer_state"] == 2 * cost.memory["optimizer_state_per_slot"]  # Adam's two slots
    assert r.memory["unsharded_peak"] <= cost.memory["unsharded_peak"]
    # Every unit's forward saves its activations until its backward is done: at the turn from
    # forward to backward all of them are held at once.
    assert r.memory["activations_peak"] == sum(a for _, a in wl.activations) > 0
    assert r.memory["reserved"] == int(r.memory["peak"] * 1.05)


def test_loss_temporaries_by_hand():
    """F.cross_entropy(logits.float(), y) over (tokens, vocab) bfloat16 logits: forward writes a
    float32 copy (4 B an element) and the log-softmax (4 B, saved for backward: an activation);
    backward writes the log-softmax's gradient (4 B, dense) and from it the logits' (4 B) before
    its bf16 cast. The profile's transient bytes are those not saved, at the worst moment of each
    stretch, and the simulator's peak holds them on top of the activations."""
    T, V, D = 64, 1000, 32
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(D, V, bias=False, dtype=torch.bfloat16))
    h = torch.zeros(T, D, dtype=torch.bfloat16, device="meta")
    y = torch.zeros(T, dtype=torch.long, device="meta")
    plan = fsdpfn.plan(model, (1,))
    wl = sim.profile(model, plan, h, loss_fn=lambda out: F.cross_entropy(out.float(), y))
    scalar = 4  # the float32 loss; in backward also the seed gradient
    # saved: the log-softmax (float32), the head's input h (bf16), nll_loss's targets and total weight
    assert wl.activation("") == T * V * 4 + T * D * 2 + T * 8 + scalar
    assert wl.transient_at(runtime.Op("forward", "")) == T * V * 2  # the bf16 logits
    assert wl.transient_at(runtime.Op("forward_done", "")) == T * V * (2 + 4) + scalar  # bf16 logits + float32 copy
    # backward: the log-softmax's gradient and the logits' float32 gradient, both (T, V) float32;
    # the bf16 logits were let go before backward and the saved log-softmax is an activation
    assert wl.transient_at(runtime.Op("backward", "")) == T * V * (4 + 4) + 2 * scalar
    r = sim.simulate(plan, runtime.schedule(plan), wl, None, _hw())
    static = r.memory["params"] + r.memory["grads"] + r.memory["optimizer_state"]
    weight = D * V * 2  # the head's gathered bf16 weight, and its bf16 gradient from its backward to its reduce
    assert r.memory["unsharded_peak"] == weight
    assert r.memory["peak"] == static + weight + wl.activation("") + weight + T * V * 8 + 2 * scalar


def test_rematerialised_backward_holds_its_recomputed_activations():
    """Full remat keeps a block's inputs from forward to backward, but its backward reruns the
    forward first: the activations it dropped are live again when the gradients' temporaries
    start, so the backward's transient bytes are the dropped activations plus the plain
    backward's own."""
    plan, wl = _setup((4,))
    full = wl.with_remat({"blocks.1": "full"})
    fwd, bwd = runtime.Op("forward", "blocks.1"), runtime.Op("backward", "blocks.1")
    assert full.activation("blocks.1") < wl.activation("blocks.1")
    assert full.transient_at(bwd) == max(wl.transient_at(fwd), wl.activation("blocks.1") + wl.transient_at(bwd))
    assert full.transient_at(bwd) > wl.transient_at(bwd)
    assert full.transient_at(runtime.Op("backward", "blocks.0")) == wl.transient_at(runtime.Op("backward", "blocks.0"))


def test_rms_norm_counted_as_the_fused_kernel_on_meta():
    """On meta, nn.RMSNorm would take the composite path (float32 copies saved); the profile
    counts CUDA's fused kernel: it saves its bf16 input and the reciprocal RMS."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.RMSNorm(64, dtype=torch.bfloat16))
    x = torch.zeros(4, 16, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    plan = fsdpfn.plan(model, (1,))
    wl = sim.profile(model, plan, x)
    saved = sum(a for _, a in wl.activations)
    assert saved == 4 * 16 * 64 * 2 + 4 * 16 * 4  # the bf16 input and one float32 per row


def test_fp8_gather_bytes_in_the_simulator_are_plan_cost():
    mp = fsdpfn.MixedPrecision(torch.bfloat16, torch.float32, fp8="tensorwise")
    plan, wl = _setup((4,), mp=mp)
    r = sim.simulate(plan, runtime.schedule(plan), wl, None, _hw())
    cost = plan.cost()
    for kind in ("all_gather", "all_reduce", "reduce_scatter"):
        got, want = r.traffic["step"].get(kind), cost.collectives.get(kind)
        assert (got.calls, got.nbytes, got.wire_bytes) == (want.calls, want.nbytes, want.wire_bytes), kind
    bf16_plan, _ = _setup((4,), mp=fsdpfn.MixedPrecision(torch.bfloat16, torch.float32))
    assert cost.collectives["all_gather"].nbytes < bf16_plan.cost().collectives["all_gather"].nbytes
    # The timed gathers carry those bytes: the spans of the all_gather stream sum to them.
    gathered = sum(s.nbytes for s in r.spans if s.stream == "all_gather" and s.kind == "all_gather")
    assert gathered == cost.collectives["all_gather"].nbytes


def test_tensor_parallel_activation_collectives_are_timed():
    plan, wl = _setup({"dp": 2, "tp": 2}, tp=GPT_TP_PLAN)
    assert wl.tokens == 2 * CFG.seq_len
    r = sim.simulate(plan, runtime.schedule(plan), wl, None, _hw())
    acts = [c for c in plan.cost(tokens=wl.tokens).calls if c.activation]
    tp_spans = [s for s in r.spans if s.stream == "tp"]
    assert acts and len(tp_spans) == len(acts)
    assert sum(s.nbytes for s in tp_spans) == sum(c.nbytes for c in acts)
    # A slower link within the node makes the step slower by at least those collectives' extra time.
    slow = sim.simulate(plan, runtime.schedule(plan), wl, None, _hw(intra=sim.Link(3e-6, 1e6)))
    extra = sum(
        _hw(intra=sim.Link(3e-6, 1e6)).collective_seconds(c.kind, [0, 1], c.nbytes)
        - _hw().collective_seconds(c.kind, [0, 1], c.nbytes)
        for c in acts
    )
    assert slow.step_time >= r.step_time + extra * (1 - 1e-9)
    assert math.isfinite(slow.step_time)
