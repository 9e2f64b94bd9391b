"""The differential check (fsdpfn.verify): a model-parallel layout the model's code does not
compute as planned is named on every rank, however the model spells the mistake; a correct one
passes with errors at rounding level, far inside the bound.

Each mistake is written several ways (the ways a pattern guard would have to know one by one);
each must raise fsdpfn.VerificationError naming the unit and the axis, on every rank, with the
same text. The bound is 4 u (fan-in + fan-out + tokens), u = 2**-24 (see [Note: the differential
check] in fsdpfn/transforms/_verify.py): for these models about 1e-4, while every mistake here
is off by more than 1e-2 and rounding stays under 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn.models import GPT, GPTConfig, MoE, MoEConfig
from fsdpfn.models._gpt import TP_PLAN

WIDTH, HEADS, VOCAB, SEQ = 16, 2, 20, 8
HD = WIDTH // HEADS


class Block(nn.Module):
    """A pre-norm block whose fused qkv lies q | k | v (HF GPT-2's layout, ``qkv="sides"``) or
    head-major (``"heads"``), cut as ``cut`` says; the MLP called as ``mlp`` says."""

    def __init__(self, layout: str, cut: str, mlp: str, sdpa: bool = False):
        super().__init__()
        self.layout, self.cut, self.mlp, self.sdpa = layout, cut, mlp, sdpa
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def _split(self, o):
        b, t, n = o.shape
        if self.layout == "heads":
            q, k, v = o.view(b, t, -1, 3, HD).permute(3, 0, 2, 1, 4)
            return q, k, v
        d = n // 3
        if self.cut == "unbind":
            q, k, v = o.view(b, t, 3, -1, HD).unbind(2)
        elif self.cut == "slice":
            q, k, v = o[..., :d], o[..., d : 2 * d], o[..., 2 * d :]
            q, k, v = (z.reshape(b, t, -1, HD) for z in (q, k, v))
        elif self.cut == "permute":
            q, k, v = o.reshape(b, t, 3, -1, HD).permute(2, 0, 1, 3, 4)
        elif self.cut == "transpose_chunk":
            q, k, v = (z.transpose(1, 2) for z in o.transpose(1, 2).chunk(3, 1))
            q, k, v = (z.reshape(b, t, -1, HD) for z in (q, k, v))
        else:
            raise AssertionError(self.cut)
        return tuple(z.transpose(1, 2) for z in (q, k, v))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self._split(self.qkv(self.norm1(x)))
        att = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if self.sdpa
            else fsdpfn.context_parallel_attention(q, k, v, causal=True)
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        if self.mlp == "module":
            return x + self.out(F.gelu(self.fc(h)))
        if self.mlp == "f_linear":  # the rowwise layer called around its module
            return x + F.linear(F.gelu(self.fc(h)), self.out.weight, self.out.bias)
        if self.mlp == "dot_forward":  # the colwise layer called around its hooks
            return x + self.out(F.gelu(self.fc.forward(h)))
        raise AssertionError(self.mlp)


class Net(nn.Module):
    def __init__(self, layout="heads", cut="unbind", mlp="module", sdpa_blocks=()):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(layout, cut, mlp, i in sdpa_blocks) for i in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


TP = {"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def _batch(rank: int, plan=None, rows: int = 2, seq: int = SEQ):
    g = torch.Generator().manual_seed(100 + (fsdpfn.transforms.dp_rank(plan) if plan is not None else rank))
    return torch.randint(0, VOCAB, (rows, seq), generator=g)


def _tp_case(rank, world, layout, cut, mlp, style):
    torch.manual_seed(0)
    model = Net(layout, cut, mlp)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    tp = {"blocks.*.qkv": style, "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
    plan = fsdpfn.plan(model, mesh, tp=tp)
    params = fsdpfn.shard(model, plan)
    return _outcome(lambda: fsdpfn.verify(model, plan, params, _batch(rank, plan)))


def _outcome(fn):
    try:
        report = fn()
    except fsdpfn.VerificationError as e:
        return ("error", str(e), e.comparison.unit if e.comparison else None)
    except ValueError as e:
        return ("refused", str(e), None)
    worst = report.worst()
    return ("ok", max(c.error for c in report.comparisons), worst.bound if worst else None, len(report.comparisons))


def _same_error_everywhere(results):
    assert all(r[0] == "error" for r in results), results
    assert len({r[1] for r in results}) == 1, "every rank raises the same text"
    return results[0][1]


def test_a_correct_tp_layout_passes_at_rounding_level(run_on_ranks):
    """Head-major qkv split colwise (whole heads per rank), the MLP through its modules."""
    for r in run_on_ranks(_tp_case, 2, "heads", "unbind", "module", "colwise"):
        kind, worst, bound, n = r
        assert kind == "ok" and n > 20
        # rounding alone: a few float32 ulps, over fifty times inside the bound
        assert worst < 1e-6 and worst * 50 < bound, r


@pytest.mark.parametrize("cut", ["unbind", "slice", "permute", "transpose_chunk"])
def test_a_side_by_side_qkv_split_colwise_is_named_however_it_is_cut(run_on_ranks, cut):
    """q | k | v split plainly gives rank 0 all of q and half of k. No chunk or split call
    appears in any of these cuts, so only the check can see it."""
    text = _same_error_everywhere(run_on_ranks(_tp_case, 2, "sides", cut, "module", "colwise"))
    assert "unit 'blocks.0'" in text and "Axes this unit is split over: tp" in text
    assert "colwise_fused:k" in text  # the fix is named
    assert "bound" in text and "sharded" in text and "unsharded" in text


def test_the_same_model_planned_colwise_fused_passes(run_on_ranks):
    r = run_on_ranks(_tp_case, 2, "sides", "slice", "module", "colwise_fused:3")
    assert all(x[0] == "ok" and x[1] < 1e-6 for x in r), r


def test_a_head_major_qkv_planned_colwise_fused_is_named(run_on_ranks):
    """The mirror mistake: a fused split of a layout that is not side by side."""
    text = _same_error_everywhere(run_on_ranks(_tp_case, 2, "heads", "unbind", "module", "colwise_fused:3"))
    assert "unit 'blocks.0'" in text and "tp" in text


@pytest.mark.parametrize("mlp", ["f_linear", "dot_forward"])
def test_a_split_layer_called_around_its_module_is_named(run_on_ranks, mlp):
    """F.linear(h, out.weight) skips the rowwise all-reduce (the forward differs);
    fc.forward(h) skips the colwise layer's hooks (the forward agrees, the input cotangent does
    not: its backward all-reduce is missing)."""
    text = _same_error_everywhere(run_on_ranks(_tp_case, 2, "heads", "unbind", mlp, "colwise"))
    assert "unit 'blocks.0'" in text and "F.linear(x, m.weight), m.forward(x)" in text
    assert ("output 0" if mlp == "f_linear" else "cotangent of input 0") in text


# ---- experts -------------------------------------------------------------------------------------


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = MoE(MoEConfig(width=WIDTH, hidden=24, experts=4, top_k=2))

    def forward(self, x):
        b, t, c = x.shape
        y, _ = self.moe(self.norm(x).reshape(b * t, c))
        return x + y.view(b, t, c)


def _ep_case(rank, world, experts):
    torch.manual_seed(0)
    model = MoENet()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "edp"))
    plan = fsdpfn.plan(model, mesh, experts=experts)
    params = fsdpfn.shard(model, plan)
    return _outcome(lambda: fsdpfn.verify(model, plan, params, _batch(rank, plan)))


def test_experts_over_ep_pass(run_on_ranks):
    r = run_on_ranks(_ep_case, 2, ["blocks.*.moe.experts.w1", "blocks.*.moe.experts.w2"])
    assert all(x[0] == "ok" and x[1] < 1e-6 for x in r), r


def test_experts_with_one_packed_weight_left_out_are_named(run_on_ranks):
    """Only w1 split over ep: the layer pairs this rank's w1 experts with the first of the whole
    w2; the loss moves by about 0.05, silently, without the check."""
    r = run_on_ranks(_ep_case, 2, ["blocks.*.moe.experts.w1"])
    assert all(x[0] in ("error", "refused") for x in r), r
    if r[0][0] == "error":
        text = _same_error_everywhere(r)
        assert "unit 'blocks.0'" in text and "ep" in text and "w1, w2" in text


# ---- context parallelism -------------------------------------------------------------------------


def _cp_case(rank, world, sdpa_blocks):
    torch.manual_seed(0)
    model = Net("heads", "unbind", "module", sdpa_blocks)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    plan = fsdpfn.plan(model, mesh)
    params = fsdpfn.shard(model, plan)
    (x,) = fsdpfn.context_parallel_shard((_batch(rank, plan),), plan)
    with fsdpfn.context_parallel(plan):
        return _outcome(lambda: fsdpfn.verify(model, plan, params, x))


def test_cp_attention_passes(run_on_ranks):
    r = run_on_ranks(_cp_case, 2, ())
    assert all(x[0] == "ok" and x[1] < 1e-6 for x in r), r


def test_cp_with_one_block_still_on_plain_sdpa_is_named(run_on_ranks):
    """Block 0 calls context_parallel_attention, block 1 still F.scaled_dot_product_attention:
    block 1 attends within this rank's tokens only."""
    text = _same_error_everywhere(run_on_ranks(_cp_case, 2, (1,)))
    assert "unit 'blocks.1'" in text and "cp" in text and "context_parallel_attention" in text


# ---- where the check runs ------------------------------------------------------------------------


def _runtime_case(rank, world, layout, verify):
    torch.manual_seed(0)
    model = Net(layout, "slice", "module")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = fsdpfn.plan(model, mesh, tp=TP)
    params = fsdpfn.shard(model, plan)
    rt = fsdpfn.runtime.Runtime(model, plan, verify=verify)
    x = _batch(rank, plan)

    def loss_fn(p, x):
        return rt.apply(p, x).square().mean()

    with fsdpfn.count_collectives() as counter:
        try:
            _, loss = rt.value_and_grad(loss_fn)(params, x)
        except fsdpfn.VerificationError as e:
            return ("error", str(e))
    return ("ran", float(loss), counter.counts())


def test_the_runtime_checks_its_first_step_and_the_check_is_not_counted(run_on_ranks):
    good = run_on_ranks(_runtime_case, 2, "heads", True)
    unchecked = run_on_ranks(_runtime_case, 2, "heads", False)
    assert good[0][0] == "ran" and good[0][2] == unchecked[0][2]  # the step's collectives only
    assert good[0][1] == unchecked[0][1]
    bad = run_on_ranks(_runtime_case, 2, "sides", True)
    assert "unit 'blocks.0'" in _same_error_everywhere(bad)
    assert run_on_ranks(_runtime_case, 2, "sides", False)[0][0] == "ran"  # verify=False: trains, wrong


def _pure_case(rank, world, layout):
    torch.manual_seed(0)
    model = Net(layout, "permute", "module")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = fsdpfn.plan(model, mesh, tp=TP)
    params = fsdpfn.shard(model, plan)

    def loss_fn(p, x):
        return torch.func.functional_call(model, fsdpfn.unshard(p, plan), (x,)).square().mean()

    return _outcome(lambda: fsdpfn.verify_step(loss_fn, params, _batch(rank, plan)))


def test_verify_step_finds_the_model_plan_and_batch_of_a_pure_loss(run_on_ranks):
    ok = run_on_ranks(_pure_case, 2, "heads")
    assert all(x[0] == "ok" and x[3] > 10 for x in ok), ok
    assert "unit 'blocks.0'" in _same_error_everywhere(run_on_ranks(_pure_case, 2, "sides"))


def _gpt_case(rank, world, inner="tp"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, width=WIDTH, depth=2, heads=HEADS))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", inner))
    plan = fsdpfn.plan(model, mesh, **({"tp": TP_PLAN} if inner == "tp" else {"units": PP_UNITS}))
    (x,) = fsdpfn.context_parallel_shard((_batch(rank, plan),), plan)
    with fsdpfn.context_parallel(plan):
        return _outcome(lambda: fsdpfn.verify(model, plan, fsdpfn.shard(model, plan), x))


@pytest.mark.parametrize("inner", ["tp", "cp"])
def test_gpt_with_its_tp_plan_or_under_cp_passes(run_on_ranks, inner):
    """Under cp, with "pos" a unit of its own, GPT's position ids (1-d, this rank's positions)
    cross a unit boundary: they are cut and joined like the activations."""
    assert all(x[0] == "ok" and x[1] < 1e-6 for x in run_on_ranks(_gpt_case, 2, inner))


# ---- every guard on every path: the pipeline, cp outside its block, named errors ------------------

PP_UNITS = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]
PP_CFG = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, width=WIDTH, depth=2, heads=HEADS, bias=False)


def _pp_case(rank, world, mistake):
    from fsdpfn.runtime import PipelineRuntime

    torch.manual_seed(0)
    model = GPT(PP_CFG)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    plan = fsdpfn.pipeline_plan(model, mesh, units=PP_UNITS)

    def ce(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    pipe = PipelineRuntime(model, plan, "1f1b", 2, loss_fn=ce)
    params = pipe.shard(model)
    dp = mesh.get_local_rank("dp")
    rows = 4 if (mistake == "unequal_rows" and dp == 1) else 8
    seed = rank if mistake == "stages_differ" else dp  # by global rank: stage 0 and the last read different batches
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    try:
        _, loss = pipe.step(params, tokens[:, :-1], tokens[:, 1:])
    except ValueError as e:
        return ("refused", str(e))
    return ("ran", float(loss))


@pytest.mark.parametrize("mistake", ["unequal_rows", "stages_differ"])
def test_the_pipeline_checks_the_batch_on_every_rank(run_on_ranks, mistake):
    """pp 2 x dp 2: batches of 8 and 4 rows (the mean of unequal means), or a batch indexed by
    the global rank (stage 0 reads one batch, the last stage the targets of another)."""
    results = run_on_ranks(_pp_case, 4, mistake)
    assert all(r[0] == "refused" for r in results), results
    text = results[0][1]
    assert ("batches of different sizes" if mistake == "unequal_rows" else "were given different inputs") in text


def test_a_correct_pipeline_still_runs(run_on_ranks):
    assert all(r[0] == "ran" for r in run_on_ranks(_pp_case, 4, None))


def test_a_pipeline_stage_or_loss_that_cannot_go_on_is_named():
    """What the last stage finds (a loss that is not a scalar) or a stage returns (a 1-tuple, as
    Hugging Face layers do) is named with its fix; the launcher then tells the ranks waiting on it
    (fsdpfn.comm.announce_failure), and they stop when its process ends."""
    from types import SimpleNamespace

    from fsdpfn.runtime import PipelineRuntime

    with pytest.raises(
        ValueError,
        match=r"must return the micro-batch's mean loss, a scalar; got shape \(32,\) \(a loss built with reduction='none'",
    ):
        PipelineRuntime._check_loss(None, torch.ones(32))
    fake = SimpleNamespace(modules={1: nn.Identity()})
    with pytest.raises(ValueError, match=r"stage 1 \(Identity\) returned a tuple of 1; .*return layer\(x\)\[0\]"):
        PipelineRuntime._stage_output(fake, 1, (torch.ones(2),))
    x = torch.ones(2)
    assert PipelineRuntime._stage_output(fake, 1, x) is x


def _cp_outside(rank, world):
    torch.manual_seed(0)
    model = Net()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    plan = fsdpfn.plan(model, mesh)
    params = fsdpfn.shard(model, plan)
    (x,) = fsdpfn.context_parallel_shard((_batch(rank, plan),), plan)
    try:  # a validation forward, written outside the block
        with torch.no_grad():
            torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
    except ValueError as e:
        return str(e)
    return None


def test_a_cp_forward_outside_its_block_is_refused(run_on_ranks):
    for text in run_on_ranks(_cp_outside, 2):
        assert text and "outside `with fsdpfn.context_parallel(plan):`" in text and "cp=2" in text


def test_a_mask_given_to_cp_attention_is_named():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"fourth argument is the plan or process group .* attn_mask\?"):
        fsdpfn.context_parallel_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool))


# ---- the loss the step trains, against the loss function on the whole batch ---------------------


class AuxNet(Net):
    """Returns ``(logits, aux)``: an auxiliary loss without batch rows, per rank by design."""

    def forward(self, tokens):
        logits = super().forward(tokens)
        return logits, logits.float().square().mean()


def _loss_case(rank, world, names, loss, ignored):
    torch.manual_seed(0)
    model = AuxNet() if loss == "aux" else Net()
    shape = (world // 2, 2) if len(names) == 2 else (world,)  # tp: (1, 2)
    plan = fsdpfn.plan(
        model,
        torch.distributed.device_mesh.init_device_mesh("cpu", shape, mesh_dim_names=names),
        **({"tp": TP} if "tp" in names else {}),
    )
    params = fsdpfn.shard(model, plan)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(7))
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    if ignored == "rows":  # the ignored tokens fall on the first data-parallel rank's rows
        y[:2, : SEQ // 2] = -100
    elif ignored == "positions":  # on the first cp rank's chunk of every sequence
        y[:, : SEQ // 4] = -100
    n = 4 // plan.dp_size
    mine = slice(n * fsdpfn.transforms.dp_rank(plan), n * (fsdpfn.transforms.dp_rank(plan) + 1))
    x, y = fsdpfn.context_parallel_shard((x[mine], y[mine]), plan)
    count = (y != -100).sum().float()
    torch.distributed.all_reduce(count)
    count = float(count) * plan.grad_ranks / world  # each token once, not once per tp peer

    def loss_fn(p, x, y):
        if loss == "sum":  # the documented fix: a summed loss over the global count
            full = fsdpfn.unshard(p, plan, grad_op="sum", grad_scale=1 / count)
            logits = torch.func.functional_call(model, full, (x,))
            return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        out = torch.func.functional_call(model, fsdpfn.unshard(p, plan), (x,))
        logits, aux = out if loss == "aux" else (out, 0.0)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100) + 0.01 * aux

    with fsdpfn.context_parallel(plan):
        try:
            report = fsdpfn.verify_step(loss_fn, params, x, y)
        except fsdpfn.VerificationError as e:
            return ("error", str(e))
    return ("ok", [(c.what, c.error, c.bound) for c in report.comparisons if c.unit == "loss"], report.notes)


@pytest.mark.parametrize("names,ignored", [(("dp",), "rows"), (("dp", "cp"), "positions"), (("dp", "cp"), "rows")])
def test_a_mean_over_each_ranks_counted_tokens_is_named(run_on_ranks, names, ignored):
    """cross_entropy(ignore_index=...) averaged per rank: the mean of the ranks' means, which is
    not the whole batch's mean when ranks count different numbers of tokens."""
    results = run_on_ranks(_loss_case, 2 * len(names), names, "mean", ignored)
    assert all(r[0] == "error" for r in results), results
    assert len({r[1] for r in results}) == 1
    text = results[0][1]
    assert "the loss the step trains differs from the loss function on the whole batch" in text
    assert f"mean over the {2 * len(names)} ranks" in text and "grad_op='sum'" in text


@pytest.mark.parametrize(
    "names,loss,ignored",
    [
        (("dp",), "mean", None),
        (("dp", "cp"), "mean", None),  # every rank counts all its tokens
        (("dp",), "sum", "rows"),
        (("dp", "cp"), "sum", "positions"),
        (("dp", "cp"), "sum", "rows"),  # the fix
        (("dp", "tp"), "mean", "rows"),  # dp 1 x tp 2: tp peers read the same rows, one data-parallel rank
        (("dp",), "aux", None),
    ],
)  # an auxiliary output, used linearly
def test_a_loss_that_is_the_whole_batchs_passes(run_on_ranks, names, loss, ignored):
    """Both sides compute from the same model outputs: they differ by the loss's own sums in
    another order, within 4 u (tokens + classes) (about 1e-5 here); rounding gives 1e-7."""
    world = 2 if "tp" in names else 2 * len(names)
    for kind, comparisons, notes in run_on_ranks(_loss_case, world, names, loss, ignored):
        assert kind == "ok" and not notes and len(comparisons) >= 2, (kind, comparisons, notes)
        assert all(err <= bound and err < 1e-6 for _, err, bound in comparisons), comparisons


# ---- a pipeline's stages, one after the other ----------------------------------------------------


def _pp_tp_case(rank, world, qkv0, qkv1, inner="tp"):
    from fsdpfn.runtime import PipelineRuntime

    torch.manual_seed(0)
    model = GPT(PP_CFG)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", inner))
    tp = {
        "blocks.0.qkv": qkv0,
        "blocks.1.qkv": qkv1,
        "blocks.*.proj": "rowwise",
        "blocks.*.fc": "colwise",
        "blocks.*.out": "rowwise",
    }
    plan = fsdpfn.pipeline_plan(model, mesh, units=PP_UNITS, **({"tp": tp} if inner == "tp" else {}))

    def ce(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    pipe = PipelineRuntime(model, plan, "1f1b", 2, loss_fn=ce)
    params = pipe.shard(model)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(3))
    try:
        _, loss = pipe.step(params, tokens[:, :-1], tokens[:, 1:])
    except fsdpfn.VerificationError as e:
        return ("error", str(e))
    return (
        "ran",
        float(loss),
        {
            s: (r.units, max(c.error for c in r.comparisons), r.worst().error / r.worst().bound)
            for s, r in pipe.verified.items()
        },
    )


@pytest.mark.parametrize("inner", ["tp", "cp"])
def test_each_pipeline_stage_is_checked_on_its_own_ranks(run_on_ranks, inner):
    """pp 2 x tp 2 (and pp 2 x cp 2): stage 0 checks blocks.0 on the tokens, stage 1 blocks.1
    on the activation stage 0 computed; rounding only."""
    results = run_on_ranks(_pp_tp_case, 4, "colwise", "colwise", inner)
    assert all(r[0] == "ran" for r in results), results
    assert "blocks.0" in results[0][2][0][0] and "blocks.1" in results[2][2][1][0]
    for r in results:  # rounding alone: a few float32 ulps, every comparison ten times inside its bound
        ((units, worst, ratio),) = r[2].values()
        assert worst < 1e-6 and ratio < 0.1, r


@pytest.mark.parametrize("qkv0, qkv1, stage", [("colwise_fused:3", "colwise", 0), ("colwise", "colwise_fused:3", 1)])
def test_a_pipeline_stage_that_computes_wrong_is_named_on_every_rank(run_on_ranks, qkv0, qkv1, stage):
    """GPT's head-major qkv planned colwise_fused:3 on one stage only: that stage's ranks find it,
    and every rank (the other stage's too, which would otherwise wait for an activation) raises
    the same text."""
    results = run_on_ranks(_pp_tp_case, 4, qkv0, qkv1)
    assert all(r[0] == "error" for r in results), results
    assert len({r[1] for r in results}) == 1
    text = results[0][1]
    assert f"stage {stage} (on pp rank {stage})" in text and f"unit 'blocks.{stage}'" in text and "tp=2" in text


def _cp_cut_case(rank, world, by_global_rank):
    torch.manual_seed(0)
    model = Net()
    plan = fsdpfn.plan(
        model, torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    )
    params = fsdpfn.shard(model, plan)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(7))
    index = rank % 2 if by_global_rank else fsdpfn.transforms.dp_rank(plan)  # rank % 2: the cp peers 0, 1 differ
    (x,) = fsdpfn.context_parallel_shard((tokens[2 * index : 2 * index + 2],), plan)
    with fsdpfn.context_parallel(plan):
        return _outcome(lambda: fsdpfn.verify(model, plan, params, x))


@pytest.mark.parametrize("by_global_rank", [True, False])
def test_cp_peers_that_cut_different_batches_are_named(run_on_ranks, by_global_rank):
    """dp 2 x cp 2 with the batch indexed by the global rank: the two cp ranks of a data-parallel
    index keep parts of different sequences, which no computation can tell from a sequence (a mix
    of two slices' chunks is one); what context_parallel_shard was given must agree."""
    results = run_on_ranks(_cp_cut_case, 4, by_global_rank)
    if not by_global_rank:
        assert all(r[0] == "ok" for r in results), results
        return
    assert all(r[0] == "refused" for r in results), results
    assert len({r[1] for r in results}) == 1
    assert "ranks [0, 1] are context-parallel peers" in results[0][1] and "dp_rank(plan)" in results[0][1]


def _pp_loss_case(rank, world, ignored):
    from fsdpfn.runtime import PipelineRuntime

    torch.manual_seed(0)
    model = GPT(PP_CFG)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    plan = fsdpfn.pipeline_plan(model, mesh, units=PP_UNITS)

    def ce(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)

    pipe = PipelineRuntime(model, plan, "1f1b", 2, loss_fn=ce)
    params = pipe.shard(model)
    dp = mesh.get_local_rank("dp")
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(dp))
    y = tokens[:, 1:].clone()
    if ignored and dp == 0:  # padding in data-parallel rank 0's rows only
        y[:, : SEQ // 2] = -100
    try:
        _, loss = pipe.step(params, tokens[:, :-1], y)
    except fsdpfn.VerificationError as e:
        return ("error", str(e))
    report = pipe.verified.get(1)
    return ("ran", [(c.what, c.error, c.bound) for c in report.comparisons if c.unit == "loss"] if report else None)


@pytest.mark.parametrize("ignored", [False, True])
def test_a_pipelines_loss_is_checked_against_the_whole_micro_batch(run_on_ranks, ignored):
    """pp 2 x dp 2: the last stage's loss on the first micro-batch, averaged over the data-parallel
    ranks, against the loss of both ranks' rows; padding on one rank only makes it another mean."""
    results = run_on_ranks(_pp_loss_case, 4, ignored)
    if not ignored:
        last = [r for r in results if r[1] is not None]
        assert all(r[0] == "ran" for r in results) and len(last) == 2, results
        assert all(len(r[1]) == 2 and all(e <= b and e < 1e-6 for _, e, b in r[1]) for r in last), last
        return
    assert all(r[0] == "error" for r in results), results
    assert len({r[1] for r in results}) == 1
    assert "stage 1 (on pp rank 1)" in results[0][1] and "the loss the step trains differs" in results[0][1]
