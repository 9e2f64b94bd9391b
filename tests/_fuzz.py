"""The differential check's fuzzer: small models and plans drawn at random, each run on gloo ranks
and judged against one process. Shared by tests/test_verify_fuzz.py (a fixed few examples) and
benchmarks/fuzz.py (more, with counts).

[Note: the fuzzer's oracle]
An example is a plain dict (``describe`` below draws it with hypothesis on the test process; the
ranks build the model and plan from it, see ``run_example``). Each rank:

1. builds the model (seed 0), the mesh and the plan, and shards the model: a ``ValueError``
   here is a refusal by name;
2. runs ``fsdpfn.verify`` on its part of a batch (its data-parallel rows, its part of each
   sequence under cp): a ``fsdpfn.VerificationError`` is a refusal by name, unless the example
   run again without the check (``probe=True``) gives one process's gradients: then the check
   raised a false alarm on a correct layout;
3. when the check passed, takes the gradient of the mean cross-entropy with the pure loop
   (``torch.func.grad`` over ``fsdpfn.unshard``, inside ``fsdpfn.context_parallel(plan)`` on a
   cp mesh), gathers each gradient whole (``fsdpfn.comm.full_tensor``: every rank's part put
   where its placements say) and compares it with one process's gradient on a separate model
   instance of the same seed, over the whole batch.

Outcomes: ``refused`` (1 or 2, or a ``ValueError`` of the step itself), ``correct`` (3 within
the bound), ``silent`` (3 beyond it: the check passed a layout that trains wrong),
``false_alarm`` (the check refused a step whose gradients are one process's) and ``unnamed`` (any
other exception, ranks that disagree, or a rank that never answered). A test fails on all but
``refused`` and ``correct``.

[Note: the fuzzer's bound]
A correct plan computes one process's gradient with float32 sums in another order: tp partial
sums of a weight's fan-in then an all-reduce, per-rank means of the loss then the data-parallel
mean, an expert's rows summed by source rank, attention's keys merged by log-sum-exp over cp.
Reordering a K-term float32 sum moves it by at most 2 K u of its terms' magnitudes
(u = 2^-24; Higham, 3.1). A gradient of this model passes, forward and back, through every
weight's fan-in and fan-out and sums over the batch's tokens, so the bound asked of each
parameter's norm-wise relative difference is the check's own form over the whole model:
``4 u (sum over weight matrices of fan-in + fan-out + tokens)``, twice the dot-product bound for
the normalisations and softmaxes between the sums. For the models drawn here (width 16, vocab 20,
two blocks, 32 or 64 tokens) that is 1.4e-4 to 4.5e-4; rounding alone measures 1e-7 to 4e-7, and
a layout mistake (a missing all-reduce, q and k mixed, half the experts) is off by 1e-2 or more.
No parameter's true gradient is zero (the q/k/v layers have no bias, see ``Block``), so each
is judged relative to its own norm.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn.models import MoE, MoEConfig

WIDTH, HEADS, VOCAB, SEQ, ROWS = 16, 2, 20, 8, 2  # ROWS: sequences per data-parallel rank
HD = WIDTH // HEADS
U32 = 2.0**-24

# Every way of cutting a q | k | v fused output into heads (side by side) the fuzzer knows, and the
# two ways of cutting a head-major one. A cut is correct for its layout on one process.
SIDE_CUTS = ("chunk", "split", "unbind", "slice", "permute", "transpose_chunk")
HEAD_CUTS = ("heads_permute", "heads_unbind")
CALLS = ("call", "forward", "f_linear")
STYLES = ("colwise", "colwise_fused:3", "rowwise", "colwise_gather", None)
MESHES = {  # name: (shape, dim names), every one of up to 4 ranks
    "dp2": ((2,), ("dp",)),
    "dp1_tp2": ((1, 2), ("dp", "tp")),
    "dp2_tp2": ((2, 2), ("dp", "tp")),
    "dp1_cp2": ((1, 2), ("dp", "cp")),
    "dp2_cp2": ((2, 2), ("dp", "cp")),
    "ep2": ((2, 1), ("ep", "edp")),
    "ep2_cp2": ((2, 1, 2), ("ep", "edp", "cp")),
}


# ---------------------------------------------------------------------------------------------
# The model a description builds
# ---------------------------------------------------------------------------------------------


def _linear(m: nn.Linear, x: torch.Tensor, how: str) -> torch.Tensor:
    """``m`` applied to ``x`` as a user might write it."""
    if how == "call":
        return m(x)
    if how == "forward":
        return m.forward(x)
    return F.linear(x, m.weight, m.bias)


class Block(nn.Module):
    """Pre-norm attention (fused qkv side by side or head-major, or separate q, k, v) and an MLP
    (or an MoE layer); attention through the cp-aware call or plain SDPA."""

    def __init__(self, d: dict, attn: str):
        super().__init__()
        self.d, self.attn = d, attn
        self.norm1 = nn.LayerNorm(WIDTH)
        if d["qkv"] == "separate":
            # No q/k/v biases: a key bias's true gradient is exactly zero (softmax ignores a
            # shift of every score of a row), so its computed gradient is rounding alone and no
            # relative bound can judge it.
            self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        else:
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        if d["moe"]:
            self.moe = MoE(MoEConfig(width=WIDTH, hidden=24, experts=4, top_k=2, capacity_factor=None))
        else:
            self.fc = nn.Linear(WIDTH, 4 * WIDTH)
            self.out = nn.Linear(4 * WIDTH, WIDTH)

    def _heads(self, h):
        d, calls = self.d, self.d["calls"]
        b, t, _ = h.shape
        if d["qkv"] == "separate":
            return tuple(_linear(getattr(self, n), h, calls["qkv"]).view(b, t, -1, HD).transpose(1, 2) for n in "qkv")
        o = _linear(self.qkv, h, calls["qkv"])
        n = o.shape[-1] // 3
        cut = d["cut"]
        if cut == "heads_permute":
            q, k, v = o.view(b, t, -1, 3, HD).permute(3, 0, 2, 1, 4)
            return q, k, v
        if cut == "heads_unbind":
            q, k, v = o.view(b, t, -1, 3, HD).unbind(3)
        elif cut == "chunk":
            q, k, v = (z.reshape(b, t, -1, HD) for z in o.chunk(3, -1))
        elif cut == "split":
            q, k, v = (z.reshape(b, t, -1, HD) for z in o.split(n, dim=-1))
        elif cut == "unbind":
            q, k, v = o.view(b, t, 3, -1, HD).unbind(2)
        elif cut == "slice":
            q, k, v = (o[..., i * n : (i + 1) * n].reshape(b, t, -1, HD) for i in range(3))
        elif cut == "permute":
            q, k, v = o.reshape(b, t, 3, -1, HD).permute(2, 0, 1, 3, 4)
        elif cut == "transpose_chunk":
            q, k, v = (z.transpose(1, 2).reshape(b, t, -1, HD) for z in o.transpose(1, 2).chunk(3, 1))
        else:
            raise AssertionError(cut)
        return tuple(z.transpose(1, 2) for z in (q, k, v))

    def forward(self, x):
        b, t, _ = x.shape
        calls = self.d["calls"]
        q, k, v = self._heads(self.norm1(x))
        if self.attn == "cp":
            att = fsdpfn.context_parallel_attention(q, k, v, causal=True)
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + _linear(self.proj, att.transpose(1, 2).reshape(b, t, -1), calls["proj"])
        h = self.norm2(x)
        if self.d["moe"]:
            y, _aux = self.moe(h.reshape(b * t, -1))  # the loss is the cross-entropy alone: linear in the tokens
            return x + y.view(b, t, -1)
        return x + _linear(self.out, F.gelu(_linear(self.fc, h, calls["fc"])), calls["out"])


class Net(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(d, a) for a in d["attn"])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=not d["tied"])
        if d["tied"]:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------------------
# Drawing an example (on the test process)
# ---------------------------------------------------------------------------------------------


def describe():
    """A hypothesis strategy of example descriptions (plain dicts: they travel to the ranks)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw):
        qkv = draw(st.sampled_from(["heads", "sides", "separate"]))
        cut = draw(st.sampled_from(HEAD_CUTS if qkv == "heads" else SIDE_CUTS)) if qkv != "separate" else None
        mesh = draw(st.sampled_from(sorted(MESHES)))
        names = MESHES[mesh][1]
        moe = True if "ep" in names else draw(st.booleans())  # an ep mesh without experts is refused at once
        # Mostly the module called as such and the cp attention (each other spelling is refused
        # on a split layer or a cp mesh, so a uniform draw would leave few examples to train).
        calls = {n: draw(st.sampled_from(("call", "call", "call") + CALLS[1:])) for n in ("qkv", "proj", "fc", "out")}
        attn = tuple(draw(st.sampled_from(["cp", "cp", "sdpa"])) for _ in range(2))
        tp: dict[str, str] = {}
        if "tp" in names:
            # Half the time the layout a user would write for this model, the rest each layer's
            # style drawn alone (mostly refused by the tp layout rules, which is worth knowing too).
            q_style = {"heads": "colwise", "sides": "colwise_fused:3", "separate": "colwise"}[qkv]
            canonical = {"qkv": q_style, "proj": "rowwise", "fc": "colwise", "out": "rowwise"}
            wild = draw(st.sampled_from([False, False, True]))
            for layer in ("qkv", "proj", "fc", "out"):
                if moe and layer in ("fc", "out"):
                    continue
                style = draw(st.sampled_from(STYLES)) if wild else canonical[layer]
                if style is None:
                    continue
                if layer == "qkv" and qkv == "separate":
                    for n in "qkv":
                        tp[f"blocks.*.{n}"] = style
                else:
                    tp[f"blocks.*.{layer}"] = style
        experts: list[str] = []
        if moe and "ep" in names:
            experts = [
                f"blocks.*.moe.experts.{w}"
                for w in draw(st.sampled_from([("w1", "w2"), ("w1", "w2"), ("w1",), ("w2",), ()]))
            ]
        return {
            "qkv": qkv,
            "cut": cut,
            "moe": moe,
            "tied": draw(st.booleans()),
            "calls": calls,
            "attn": attn,
            "mesh": mesh,
            "tp": tp,
            "experts": experts,
            "remat": draw(st.booleans()),
            "strategy": draw(st.sampled_from(["zero2", "zero3"])),
        }

    return draw()


def world_of(d: dict) -> int:
    return math.prod(MESHES[d["mesh"]][0])


# ---------------------------------------------------------------------------------------------
# Running an example (on every rank)
# ---------------------------------------------------------------------------------------------


def _batch(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch: ``dp x ROWS`` sequences and their next tokens."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (dp * ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def bound(model: nn.Module, tokens: int) -> float:
    """[Note: the fuzzer's bound]: 4 u (sum of fan-in + fan-out over weight matrices + tokens)."""
    terms = tokens + sum(p.shape[0] + p[0].numel() for p in model.parameters() if p.dim() >= 2)
    return 4 * U32 * terms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale > 0 else float((a - b).norm())


def _reference(d: dict, dp: int) -> tuple[dict[str, torch.Tensor], nn.Module]:
    torch.manual_seed(0)
    ref = Net(d)
    x, y = _batch(dp)
    params = dict(ref.named_parameters())
    g = torch.func.grad(lambda ps: _ce(torch.func.functional_call(ref, ps, (x,)), y))(
        {n: p.detach() for n, p in params.items()}
    )
    return g, ref


def _step_grads(model, plan, params, x, y, cp: bool) -> dict[str, torch.Tensor]:
    """The pure loop's gradients, each gathered whole."""
    with fsdpfn.context_parallel(plan) if cp else contextlib.nullcontext():
        grads = torch.func.grad(lambda ps: _ce(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)), y))(
            params
        )
    return {n: fsdpfn.comm.full_tensor(g) for n, g in grads.items()}


def _judge(d: dict, dp: int, got: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """Whether ``got`` is one process's gradient within the bound, and how far it is."""
    want, ref = _reference(d, dp)
    tol = bound(ref, dp * ROWS * SEQ)
    if sorted(want) != sorted(got):
        return False, f"gradients of {sorted(set(want) ^ set(got))} missing or extra"
    errors = {n: _rel(got[n], want[n]) for n in want}
    worst = max(errors, key=lambda n: errors[n])
    ok = errors[worst] <= tol
    return ok, f"worst gradient {worst!r} off by {errors[worst]:.3g} {'<=' if ok else '>'} bound {tol:.3g}"


def run_example(rank: int, world: int, d: dict, probe: bool = False) -> tuple:
    """One example on this rank: ``(outcome, detail)``, outcome one of ``refused``, ``correct``,
    ``silent``, ``unnamed`` ([Note: the fuzzer's oracle]). ``probe``: skip the check and judge
    the step's gradients alone (``correct`` or ``silent``), to tell a false alarm of the check."""
    from fsdpfn import testing

    stage = "plan"
    try:
        shape, names = MESHES[d["mesh"]]
        mesh = testing.mesh(shape, names)
        torch.manual_seed(0)
        model = Net(d)
        kwargs: dict[str, Any] = {"strategy": d["strategy"]}
        if d["tp"]:
            kwargs["tp"] = dict(d["tp"])
        if d["experts"]:
            kwargs["experts"] = list(d["experts"])
        if d["remat"]:
            kwargs["remat"] = {"blocks.*": "full"}
        plan = fsdpfn.plan(model, mesh, **kwargs)
        stage = "shard"
        params = fsdpfn.shard(model, plan)
        dp, me = plan.dp_size, fsdpfn.transforms.dp_rank(plan)
        x, y = _batch(dp)
        x, y = x[me * ROWS : (me + 1) * ROWS], y[me * ROWS : (me + 1) * ROWS]
        cp = plan.cp_size > 1
        if cp:
            x, y = fsdpfn.context_parallel_shard((x, y), plan)
        stage = "verify"
        if not probe:
            with fsdpfn.context_parallel(plan) if cp else contextlib.nullcontext():
                fsdpfn.verify(model, plan, params, x)
        stage = "step"
        got = _step_grads(model, plan, params, x, y, cp)
    except ValueError as e:  # named (fsdpfn.VerificationError included), before any update
        return ("refused", f"{stage}: {type(e).__name__}: {e}")
    except Exception:
        return ("unnamed", f"{stage}: {traceback.format_exc()}")
    ok, detail = _judge(d, dp, got)
    return ("correct" if ok else "silent", detail)


def classify(results: list[tuple]) -> tuple[str, str]:
    """One outcome for every rank's: ``silent`` if any rank's is, ``unnamed`` if any rank raised
    something unnamed or the ranks disagree."""
    kinds = {r[0] for r in results}
    for k in ("silent", "unnamed"):
        if k in kinds:
            return k, next(r[1] for r in results if r[0] == k)
    if len(kinds) > 1:
        return "unnamed", f"ranks disagree: {[r[0] for r in results]}: {results}"
    return results[0][0], results[0][1]


def run(run_on_ranks, d: dict, timeout: float = 120.0) -> tuple[str, str]:
    """The example on its ranks, classified; a rank error (a hang included) is ``unnamed``. An
    example the check refused runs again without it (the probe): one process's gradients then
    make the refusal a ``false_alarm``; anything else (wrong gradients, an error) confirms it."""
    try:
        outcome, detail = classify(run_on_ranks(run_example, world_of(d), d, timeout=timeout))
    except Exception as e:  # RankError: a rank died or never answered
        return "unnamed", f"{type(e).__name__}: {e}"
    if outcome == "refused" and detail.startswith("verify:"):
        try:
            probed, how = classify(run_on_ranks(run_example, world_of(d), d, True, timeout=timeout))
        except Exception:  # the step fails without the check too: the refusal stands
            probed, how = "unnamed", ""
        if probed == "correct":
            return "false_alarm", f"{how}, yet {detail}"
    return outcome, detail


EXAMPLES = int(os.environ.get("FSDPFN_FUZZ_EXAMPLES", "6"))
