"""Tensor-parallel mistakes the plan can see, refused when the plan is built (on every rank,
before any collective), and the fused q|k|v-major projection split ``colwise_fused:3``, trained
against one process.

[Note: the tolerance of the fused parity tests]
Against one process, a (dp, tp) run sums the same float32 terms in other orders: the rowwise
``proj`` and ``out`` add tp partial sums of K/tp products (K <= 64), the colwise layers' input
gradients add tp parts, and the data-parallel mean adds dp per-rank means. Each reassociation
moves a sum by at most (terms) x 2^-24 of its magnitude, ~64 x 6e-8 = 4e-6 in the worst case
and ~1e-7 in norm, so gradients are compared at 1e-5 relative (norm-wise). AdamW's first steps
move an element by lr x g / (|g| + eps), so an element whose gradient is within rounding of
zero can move by up to 2 lr whatever the rest does (see [Note: the tolerance of the TP parity
tests] in tests/test_tp.py): with lr = 1e-3, no biases and |p| ~ 1 per matrix, the parameters
after 3 steps are compared at 1e-5 too. A wrong split is off by 1e-2 or more.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig, Llama, LlamaConfig
from fsdpfn.runtime import Runtime
from _refusals import refusals

WIDTH, HEADS, VOCAB, SEQ, PER_RANK = 16, 4, 20, 8, 2


class FusedAttention(nn.Module):
    """HF GPT-2's layout: one projection whose output is q | k | v side by side."""

    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        # Heads read off the tensor: under tp a rank holds num_heads / tp of them.
        q, k, v = (z.view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class FusedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = FusedAttention()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.out = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class FusedGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(FusedBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


FUSED_TP = {
    "blocks.*.attn.qkv": "colwise_fused:3",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.fc": "colwise",
    "blocks.*.out": "rowwise",
}
PLAIN_TP = {**FUSED_TP, "blocks.*.attn.qkv": "colwise"}  # head-major split of a q|k|v-major weight: wrong
# Fused parts are not cut over a data-parallel axis > 1 yet: the blocks replicate, the root is FSDP.
REPLICATED_BLOCKS = {"*": "replicate", "<root>": "zero3"}


def _fused_model():
    torch.manual_seed(0)
    return FusedGPT()


def _batch(dp, step):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (dp * PER_RANK, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _reference(dp, steps):
    """One process: the gradients of the first step, then the parameters after each AdamW step."""
    model = _fused_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    grads0, out = None, []
    for step in range(steps):
        x, y = _batch(dp, step)
        g = torch.func.grad(lambda ps: _loss(torch.func.functional_call(model, ps, (x,)), y))(params)
        grads0 = g if grads0 is None else grads0
        updates, state = opt.update(g, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        out.append(params)
    return grads0, out


def _train(rank, world, shape, tp, strategy, steps=3, runtime=False):
    """Worst relative differences from one process: first-step gradients (torch's and fsdpfn's
    full_tensor), then parameters after each step; and the placements of the fused weight."""
    mesh = testing.mesh(shape, ("dp", "tp"))
    ref_grads, ref = _reference(shape[0], steps)
    model = _fused_model()
    plan = fsdpfn.plan(model, mesh, strategy=strategy, tp=tp)
    me = fsdpfn.transforms.dp_rank(plan)
    mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
    params = fsdpfn.shard(model, plan)
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    rt = Runtime(model, plan) if runtime else None
    grad_err, fsdpfn_grad_err, param_err = 0.0, 0.0, 0.0
    for step in range(steps):
        x, y = _batch(shape[0], step)
        if rt is not None:
            grads, _ = rt.value_and_grad(lambda ps: _loss(rt.apply(ps, x[mine]), y[mine]))(params)
        else:
            grads = torch.func.grad(
                lambda ps: _loss(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x[mine],)), y[mine])
            )(params)
        if step == 0:
            grad_err = max(_rel(g.full_tensor(), ref_grads[n]) for n, g in grads.items())
            fsdpfn_grad_err = max(_rel(fsdpfn.comm.full_tensor(g), ref_grads[n]) for n, g in grads.items())
        updates, state = opt.update(grads, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        param_err = max(param_err, max(_rel(p.full_tensor(), ref[step][n]) for n, p in params.items()))
    return grad_err, fsdpfn_grad_err, param_err, str(params["blocks.0.attn.qkv.weight"].placements)


@pytest.mark.parametrize(
    "shape, runtime", [((1, 2), False), ((2, 2), False), ((1, 2), True)], ids=["1x2", "2x2", "1x2-runtime"]
)
def test_fused_qkv_split_colwise_fused_trains_as_one_process(run_on_ranks, shape, runtime):
    """Tolerance: [Note: the tolerance of the fused parity tests]. The pure loop, and the runtime."""
    strategy = "zero3" if shape[0] == 1 else REPLICATED_BLOCKS
    for grad_err, fsdpfn_grad_err, param_err, placed in run_on_ranks(
        _train, shape[0] * shape[1], shape, FUSED_TP, strategy, 3, runtime
    ):
        assert grad_err < 1e-5 and fsdpfn_grad_err < 1e-5 and param_err < 1e-5, (grad_err, fsdpfn_grad_err, param_err)
        assert placed == "(Replicate(), _StridedShard(dim=0, sf=3))", placed


def _plain_colwise(rank, world, runtime, steps):
    """Steps of the fused model with its qkv split plainly: the first error, and the forwards run
    under the cut watch (the mode is on the torch function stack while the model's forward runs)."""
    from fsdpfn.transforms import _guards

    model = _fused_model()
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=PLAIN_TP)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(1, 0)
    watched = []
    model.head.register_forward_pre_hook(lambda m, a: watched.append(bool(_guards._MODE)))
    try:
        for _ in range(steps):
            if runtime:
                rt = Runtime(model, plan)
                rt.value_and_grad(lambda ps: _loss(rt.apply(ps, x), y))(params)
            else:
                torch.func.grad(lambda ps: _loss(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y))(
                    params
                )
    except ValueError as e:
        return str(e), watched, bool(_guards._MODE)
    return None, watched, bool(_guards._MODE)


@pytest.mark.parametrize("runtime", [False, True], ids=["pure", "runtime"])
def test_plain_colwise_on_a_fused_qkv_is_refused_on_every_rank(run_on_ranks, runtime):
    """'colwise' gives tp rank 0 all of q and half of k (it is for head-major rows): before, the
    gradients were silently wrong (1.35 relative, norm-wise). The forward cuts qkv's output into
    3 along its last dimension, which names the layout: refused with the style that fits."""
    for err, _, left_on in run_on_ranks(_plain_colwise, 2, runtime, 1):
        assert err is not None, "a q|k|v-major qkv split plainly trained without a word"
        assert (
            "tp splits 'blocks.0.attn.qkv' 'colwise'" in err and "into 3 parts along its last dimension (chunk)" in err
        ), err
        assert "tp={'blocks.*.attn.qkv': 'colwise_fused:3'}" in err, err
        assert not left_on  # the watch is left when the forward raises


def test_the_cut_watch_runs_on_the_checked_forwards_only(run_on_ranks):
    """The head-major GPT splits colwise and views qkv into heads: nothing refused, and the torch
    function mode is on for the first CHECKED_STEPS forwards only."""
    from fsdpfn.transforms._guards import CHECKED_STEPS

    for err, watched, left_on in run_on_ranks(_gpt_steps_watched, 2, CHECKED_STEPS + 2):
        assert err is None and not left_on, err
        assert watched == [True] * CHECKED_STEPS + [False] * 2, watched


def _gpt_steps_watched(rank, world, steps):
    from fsdpfn.transforms import _guards

    model = _gpt()
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=GPT_TP_PLAN)
    params = fsdpfn.shard(model, plan)
    x, y = _batch(1, 0)
    watched = []
    model.head.register_forward_pre_hook(lambda m, a: watched.append(bool(_guards._MODE)))
    try:
        for _ in range(steps):
            torch.func.grad(lambda ps: _loss(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y))(
                params
            )
    except ValueError as e:
        return str(e), watched, bool(_guards._MODE)
    return None, watched, bool(_guards._MODE)


def _fused_state(rank, world, root):
    """A checkpoint of a fused plan on (1, 2) loads back bitwise, into the same plan and into a
    one-process-like (2, 1) plan without tp; Muon refuses the fused weight by name."""
    model = _fused_model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=FUSED_TP)
    params = fsdpfn.shard(model, plan)
    fsdpfn.checkpoint.save(root, {"params": params}, plan)
    again = fsdpfn.checkpoint.load(root, {"params": fsdpfn.shard(_zeros(model), plan, check=False)}, plan)["params"]
    same_plan = all(torch.equal(again[n].full_tensor(), full[n]) for n in full)
    plan2 = fsdpfn.plan(model, testing.mesh((2, 1), ("dp", "tp")))
    other = fsdpfn.checkpoint.load(root, {"params": fsdpfn.shard(_zeros(model), plan2, check=False)}, plan2)["params"]
    other_plan = all(torch.equal(other[n].full_tensor(), full[n]) for n in full)
    try:
        opt = fsdpfn.optim.muon(lr=0.02, ns_dtype=torch.float32)
        opt.update(params, opt.init(params), params)
        muon = "no error"
    except NotImplementedError as e:
        muon = str(e)
    return same_plan, other_plan, muon


def _zeros(model):
    return {n: torch.zeros_like(p) for n, p in model.named_parameters()}


def test_fused_weights_checkpoint_by_path_and_muon_refuses_them_by_name(run_on_ranks, tmp_path):
    for same_plan, other_plan, muon in run_on_ranks(_fused_state, 2, str(tmp_path / "ckpt")):
        assert same_plan and other_plan
        assert "'blocks.0.attn.qkv.weight'" in muon, muon


def _state_init_shards(rank, world):
    """init_shards builds shards box by box, which a fused weight is not: refused by name."""
    with torch.device("meta"):
        model = FusedGPT()
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=FUSED_TP)
    with fsdpfn.comm.count_collectives() as counter:
        try:
            fsdpfn.init_shards(model, plan, seed=0)
            msg = "no error"
        except NotImplementedError as e:
            msg = str(e)
    return msg, sum(counter.counts().values())


def test_init_shards_refuses_a_fused_weight_by_name_before_any_collective(run_on_ranks):
    for msg, collectives in run_on_ranks(_state_init_shards, 2):
        assert "'blocks.0.attn.qkv.weight' is split colwise_fused:3" in msg and "fsdpfn.shard(model, plan)" in msg, msg
        assert collectives == 0


# ---- the fused style in plans and JSON ----------------------------------------------------


def test_fused_style_places_each_part_and_round_trips_through_json():
    model = _fused_model()
    plan = fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp=FUSED_TP)
    spec = plan.param("blocks.0.attn.qkv.weight")
    assert (spec.tp, spec.tp_stride, spec.local_shape) == ("shard0", 3, (24, 16))
    assert dict(plan.tp)["blocks.0.attn.qkv"] == "colwise_fused:3"
    text = plan.to_json()
    assert json.loads(text)["format"] == 4  # an older reader refuses it rather than split it plainly
    again = fsdpfn.Plan.from_json(text)
    assert again == plan and again.fingerprint == plan.fingerprint
    assert again.param("blocks.0.attn.qkv.weight").tp_stride == 3
    edited = json.loads(text)  # the style kept, the parameters' stride lost: refused, not split plainly
    for u in edited["units"]:
        for p in u["params"]:
            p.pop("tp_stride", None)
    with pytest.raises(
        ValueError, match=r"'blocks.0.attn.qkv' is split 'colwise_fused:3', but its weight has tp_stride 1"
    ):
        fsdpfn.Plan.from_json(json.dumps(edited))
    # Plans without fused layers keep format 3 and read as before.
    plain = fsdpfn.plan(
        GPT(GPTConfig(vocab_size=20, seq_len=8, width=16, depth=2, heads=2)), {"dp": 1, "tp": 2}, tp=GPT_TP_PLAN
    )
    d = json.loads(plain.to_json())
    assert d["format"] == 3 and all("tp_stride" not in p for u in d["units"] for p in u["params"])
    assert fsdpfn.Plan.from_json(plain.to_json()) == plain


def test_fused_slices_are_the_parts_slices():
    model = _fused_model()
    plan = fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp=FUSED_TP)
    w = model.blocks[0].attn.qkv.weight.detach()
    q, k, v = w.chunk(3)
    for r in range(2):
        local = fsdpfn.transforms.tp_slice(plan, "blocks.0.attn.qkv.weight", w, rank=r)
        assert torch.equal(local, torch.cat([z.chunk(2)[r] for z in (q, k, v)]))


@pytest.mark.parametrize(
    "style, match",
    [
        ("colwise_fused:1", "unknown style"),
        ("colwise_fused:x", "unknown style"),
        ("colwise_fused:5", r"'blocks.0.attn.qkv.weight' has 48 rows, which do not make 5 fused parts"),
    ],
)
def test_bad_fused_styles_are_named(style, match):
    with pytest.raises(ValueError, match=match):
        fsdpfn.plan(_fused_model(), {"dp": 1, "tp": 2}, tp={**FUSED_TP, "blocks.*.attn.qkv": style})


def test_fused_weights_sharded_over_dp_are_refused_with_the_fix():
    with pytest.raises(NotImplementedError) as e:
        fsdpfn.plan(_fused_model(), {"dp": 2, "tp": 2}, tp=FUSED_TP)
    msg = str(e.value)
    assert "'blocks.0.attn.qkv.weight' is split colwise_fused:3" in msg and "unit 'blocks.0'" in msg, msg
    assert "'replicate'" in msg and "data-parallel axis of 1" in msg, msg
    fsdpfn.plan(_fused_model(), {"dp": 2, "tp": 2}, tp=FUSED_TP, strategy=REPLICATED_BLOCKS)  # the fix


# ---- split Linears beside whole ones, partners, head counts ---------------------------------


def _gpt(heads=2, width=16):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, seq_len=8, width=width, depth=2, heads=heads))


def test_a_split_layer_beside_whole_ones_is_named_with_the_fix():
    """Before: a plan splitting only qkv (or leaving out its rowwise partners) was accepted, and
    the forward failed on a matmul shape deep in the block."""
    with pytest.raises(ValueError) as e:
        fsdpfn.plan(_gpt(), {"dp": 1, "tp": 2}, tp={"blocks.*.qkv": "colwise"})
    msg = str(e.value)
    assert (
        "module 'blocks.0' (Block) has Linear layers split over tp (qkv: colwise) beside ones left whole (proj, fc, out)"
        in msg
    )
    assert "tp={'blocks.*.proj': 'replicate'}" in msg and "'rowwise'" in msg, msg
    no_out = {k: v for k, v in GPT_TP_PLAN.items() if k != "blocks.*.out"}
    with pytest.raises(
        ValueError, match=r"split over tp \(qkv: colwise, proj: rowwise, fc: colwise\) beside ones left whole \(out\)"
    ):
        fsdpfn.plan(_gpt(), {"dp": 1, "tp": 2}, tp=no_out)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()


def test_colwise_without_rowwise_partner_and_back_are_named():
    """Before: an unnamed matmul shape error in the forward."""
    with pytest.raises(ValueError) as e:
        fsdpfn.plan(Net(), {"dp": 1, "tp": 2}, tp={"mlp.fc": "colwise", "mlp.out": "replicate"})
    msg = str(e.value)
    assert "tp splits 'mlp.fc' 'colwise'" in msg and "Add its rowwise partner" in msg and "colwise_gather" in msg, msg
    with pytest.raises(ValueError, match=r"tp splits 'mlp.out' 'rowwise'.*Add its colwise partner"):
        fsdpfn.plan(Net(), {"dp": 1, "tp": 2}, tp={"mlp.fc": "replicate", "mlp.out": "rowwise"})
    fsdpfn.plan(Net(), {"dp": 1, "tp": 2}, tp={"mlp.fc": "colwise_gather", "mlp.out": "replicate"})  # needs no partner
    fsdpfn.plan(Net(), {"dp": 1, "tp": 2}, tp={"mlp.fc": "colwise", "mlp.out": "rowwise"})


def test_a_replicated_layer_fed_by_a_colwise_one_is_named():
    """Before: GPT's out marked 'replicate' beside a colwise fc passed the partner rule (proj is
    the block's rowwise layer) and the forward failed on a matmul shape, naming nothing."""
    with pytest.raises(ValueError) as e:
        fsdpfn.plan(_gpt(), {"dp": 1, "tp": 2}, tp={**GPT_TP_PLAN, "blocks.*.out": "replicate"})
    msg = str(e.value)
    assert "tp marks 'blocks.0.out' 'replicate'" in msg and "the output of 'blocks.0.fc'" in msg, msg
    assert "tp={'blocks.*.out': 'rowwise'}" in msg and "'blocks.*.fc' 'colwise_gather'" in msg, msg
    # Both fixes pass, and so does a replicated layer that reads the block's input (a router).
    fsdpfn.plan(
        _gpt(), {"dp": 1, "tp": 2}, tp={**GPT_TP_PLAN, "blocks.*.fc": "colwise_gather", "blocks.*.out": "replicate"}
    )
    fsdpfn.plan(Net(), {"dp": 1, "tp": 2}, tp={"mlp.fc": "colwise_gather", "mlp.out": "replicate"})


class BertLikeSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_attention_heads = 4
        self.query, self.key, self.value = (nn.Linear(8, 8) for _ in range(3))


class BertLikeOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 8)


class BertLikeAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.self = BertLikeSelf()
        self.output = BertLikeOutput()


def test_partner_in_a_sibling_module_is_accepted():
    """BERT's layout: the rowwise partner of attention.self.query is attention.output.dense."""
    model = nn.ModuleDict({"attention": BertLikeAttention()})
    tp = {"attention.self.*": "colwise", "attention.output.dense": "rowwise"}
    assert len(fsdpfn.plan(model, {"dp": 1, "tp": 2}, tp=tp).tp) == 4
    with pytest.raises(
        ValueError,
        match=r"'attention.self' \(BertLikeSelf\) has num_attention_heads = 4, which does not divide over tp=8",
    ):
        fsdpfn.plan(model, {"dp": 1, "tp": 8}, tp=tp)


def test_head_counts_tp_does_not_divide_are_named():
    """Before: GPT with 2 heads on tp = 4 was accepted (48 qkv rows divide by 4) and failed on a
    view deep in the attention; Llama's 2 kv heads on tp = 4 likewise."""
    with pytest.raises(ValueError) as e:
        fsdpfn.plan(_gpt(heads=2), {"dp": 1, "tp": 4}, tp=GPT_TP_PLAN)
    msg = str(e.value)
    assert "module 'blocks.0' (Block) has heads = 2, which does not divide over tp=4 ranks" in msg and "whole" in msg, (
        msg
    )
    llama = Llama(LlamaConfig(dim=32, layers=1, heads=4, kv_heads=2, ffn=64, vocab=64))
    with pytest.raises(
        ValueError, match=r"'layers.0.attn' \(Attention\) has kv_heads = 2, which does not divide over tp=4"
    ):
        fsdpfn.plan(llama, {"dp": 1, "tp": 4}, tp=LLAMA_TP)
    assert len(fsdpfn.plan(llama, {"dp": 1, "tp": 2}, tp=LLAMA_TP).tp) == 7


LLAMA_TP = {
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.w1": "colwise",
    "layers.*.mlp.w3": "colwise",
    "layers.*.mlp.w2": "rowwise",
}


def test_a_style_matching_a_non_linear_names_the_pattern_formatted():
    """Before: the message printed the placeholder '{name}.*' unformatted."""
    with pytest.raises(ValueError) as e:
        fsdpfn.plan(_gpt(), {"dp": 1, "tp": 2}, tp={"blocks.0": "colwise"})
    assert "(e.g. 'blocks.0.*')" in str(e.value) and "{name}" not in str(e.value), str(e.value)


# ---- the same errors on every rank, before any collective; a plan bound to another mesh ------


def _every_rank(rank, world):
    cases = {
        "beside": lambda: fsdpfn.plan(_gpt(), testing.mesh((2, 2), ("dp", "tp")), tp={"blocks.*.qkv": "colwise"}),
        "heads": lambda: fsdpfn.plan(_gpt(heads=2), testing.mesh((1, 4), ("dp", "tp")), tp=GPT_TP_PLAN),
        "fused_dp": lambda: fsdpfn.plan(_fused_model(), testing.mesh((2, 2), ("dp", "tp")), tp=FUSED_TP),
        "rebind": lambda: fsdpfn.plan(_gpt(), {"dp": 2, "tp": 2}, tp=GPT_TP_PLAN).bind(
            testing.mesh((1, 4), ("dp", "tp"))
        ),
        "replicated_reader": lambda: fsdpfn.plan(
            _gpt(), testing.mesh((2, 2), ("dp", "tp")), tp={**GPT_TP_PLAN, "blocks.*.out": "replicate"}
        ),
    }
    return refusals(cases)


def test_tp_layout_errors_reach_every_rank_before_any_collective(run_on_ranks):
    outs = run_on_ranks(_every_rank, 4)
    assert all(out == outs[0] for out in outs)
    out = outs[0]
    assert out["collectives"] == 0
    assert "beside ones left whole (proj, fc, out)" in out["beside"], out["beside"]
    assert "has heads = 2, which does not divide over tp=4" in out["heads"], out["heads"]
    assert out["fused_dp"].startswith("NotImplementedError") and "colwise_fused:3" in out["fused_dp"], out["fused_dp"]
    assert out["replicated_reader"].startswith("ValueError: tp marks 'blocks.0.out' 'replicate'"), out[
        "replicated_reader"
    ]
    rebind = out["rebind"]
    assert "mesh has shape (1, 4), but the plan was made for (2, 2)" in rebind, rebind
    assert (
        "Build the plan again on the new mesh" in rebind and "load it into the plan built for the new mesh" in rebind
    ), rebind


# ---- grouped-query attention in a Hugging Face Llama ------------------------------------------

HF_TP = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
HF_Q_ONLY = {k: v for k, v in HF_TP.items() if not k.endswith(("k_proj", "v_proj"))}


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_hf_gqa_q_split_without_k_and_v_is_named():
    """Before: q_proj split with k_proj / v_proj whole trained with silently wrong losses."""
    with pytest.raises(ValueError) as e:
        fsdpfn.plan(_hf_llama(), {"dp": 1, "tp": 2}, tp=HF_Q_ONLY)
    msg = str(e.value)
    assert (
        "module 'model.layers.0.self_attn' (LlamaAttention) has Linear layers split over tp (q_proj: colwise, o_proj: rowwise)"
        in msg
    )
    assert "left whole (k_proj, v_proj)" in msg and "'model.layers.*.self_attn.k_proj'" in msg, msg


def test_hf_gqa_kv_heads_tp_does_not_divide_are_named():
    """Before: tp = 4 with 2 kv heads failed on a view deep inside LlamaAttention."""
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn' \(LlamaAttention\) has config.num_key_value_heads = 2, "
        r"which does not divide over tp=4",
    ):
        fsdpfn.plan(_hf_llama(), {"dp": 1, "tp": 4}, tp=HF_TP)


def _hf_loss(rank, world, tp):
    model = _hf_llama()
    tokens = torch.arange(2 * 9).view(2, 9) % 32
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref = _loss(model(x, use_cache=False).logits, y).item()
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=tp)
    params = fsdpfn.shard(model, plan)
    logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,), {"use_cache": False}).logits
    return _loss(logits, y).item(), ref


def test_hf_gqa_split_whole_heads_computes_the_one_process_loss(run_on_ranks):
    """The plan the rules accept: q, k, v colwise (2 of 4 q heads and 1 of 2 kv heads a rank), o
    rowwise. Float32 sums reassociated over K <= 32 terms: 1e-5 relative (see the module note)."""
    for loss, ref in run_on_ranks(_hf_loss, 2, HF_TP):
        assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
