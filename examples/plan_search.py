"""Searches the fastest sharding plan that fits a memory budget, for a model and a cluster that
need not exist here: the model is built on the meta device, the hardware is a preset, your own
numbers, or fitted on the ranks of this machine.

What it prints: the search's pick beside the default plan (zero3, prefetch 1), the pick's
predicted step (time, exposed communication, bytes per link level, memory per rank), the first
spans of its timeline, and the lines that build and run the picked plan.

Usage:
  python examples/plan_search.py                                       # Llama 3 8B, 64 H100s, 80 GB, Muon
  python examples/plan_search.py --model 70b --gpus 1024 --optimizer adamw --remat none,save_dots,full
  python examples/plan_search.py --hardware A100_SXM --budget-gib 40   # another preset, a tighter budget
  python examples/plan_search.py --flops 700e12 --intra-gbps 300 --inter-gbps 25 --memory-gib 96 \\
      --gpus-per-node 4                                                # your own hardware's numbers
  python examples/plan_search.py --model gpt --gpus 2 --hardware measure --budget-gib 0.5 --seq 128
                                                                       # fitted on 2 gloo ranks here
  python examples/plan_search.py --plot step.png                       # the pick's timeline, drawn
  python examples/plan_search.py --tp 1,2,4,8                          # tensor parallelism searched too
  python examples/plan_search.py --model gpt --gpus 8 --seq 256 --experts 8 --ep 1,2,4,8
                                                                       # experts: expert parallelism searched

Your own model: replace ``build_model`` (any ``nn.Module`` built under ``torch.device("meta")``)
and ``batch`` (one rank's micro-batch, meta tensors), and ``tp_plan`` if you search tensor
parallelism (``--tp``): the layers it splits, as ``fsdpfn.plan(tp=...)`` takes them. A model
with experts (``--experts``) is built for real on the CPU: routing needs the tokens' values.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import sim
from fsdpfn.launch import launch, shutdown
from fsdpfn.models import GPT, GPT_TP_PLAN, LLAMA3_8B, LLAMA3_70B, GPTConfig, Llama

MODELS = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}
# Megatron-style for Llama: q, k, v and the MLP's gate and up split by output features (whole heads
# per rank), the attention and MLP outputs by input features; one all-reduce each per block.
LLAMA_TP_PLAN = {
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.w1": "colwise",
    "layers.*.mlp.w3": "colwise",
    "layers.*.mlp.w2": "rowwise",
}
OPTIMIZERS = {"adamw": sim.AdamW(), "muon": sim.Muon(layout="owner"), "muon-gather": sim.Muon(layout="gather")}


def build_model(name: str, seq: int, experts: int = 0) -> torch.nn.Module:
    if experts:  # MoE routing looks at the tokens (which expert each picks): a real model, small
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=2048, seq_len=seq, width=256, depth=4, heads=4, bias=False, experts=experts))
    with torch.device("meta"):  # nothing allocated: a 70B model plans in seconds
        if name == "gpt":
            return GPT(GPTConfig(vocab_size=2048, seq_len=seq, width=256, depth=4, heads=4, bias=False))
        return Llama(MODELS[name])


def tp_plan(name: str) -> dict[str, str]:
    """The layers tensor parallelism splits in ``build_model(name)`` (``fsdpfn.plan(tp=...)``)."""
    return GPT_TP_PLAN if name == "gpt" else LLAMA_TP_PLAN


def batch(model: torch.nn.Module, seq: int) -> torch.Tensor:
    device = next(model.parameters()).device
    if device.type == "meta":
        return torch.zeros(1, seq, dtype=torch.long, device=device)
    return torch.randint(0, model.cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))


def hardware(args) -> sim.Hardware:
    if args.hardware == "measure":
        return launch(_measure, args.gpus)[0]
    if args.flops is not None:  # your own numbers
        if args.intra_gbps is None or args.inter_gbps is None:
            raise SystemExit(
                "--flops needs --intra-gbps and --inter-gbps too (GB/s each rank sends, within and across nodes)"
            )
        return sim.Hardware(
            name=f"custom: {args.flops / 1e12:g} TFLOP/s, {args.intra_gbps:g}/{args.inter_gbps:g} GB/s",
            matmul_flops={"bfloat16": args.flops, "float32": args.flops / 8},
            memory_bandwidth=args.memory_gbps * 1e9,
            memory=int(args.memory_gib * 2**30),
            devices_per_node=args.gpus_per_node,
            intra=sim.Link(args.alpha_us * 1e-6, args.intra_gbps * 1e9),
            inter=sim.Link(args.alpha_us * 1e-6, args.inter_gbps * 1e9),
        )
    # The preset's kernel model already prices what kernels reach; the derates scale it further.
    return sim.PRESETS[args.hardware].scaled(flops=args.flops_derate, bandwidth=args.net_derate)


def _measure(rank: int, world: int) -> sim.Hardware:
    return sim.measure(sizes_mib=(0.25, 2, 8), repeats=3, dtypes=(torch.float32,))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's default once, after its help, unless the help
    already says it or there is none to show (``None``, or ``False`` for a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "(default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The command line (its ``--help``: this module's description, then every flag with its default)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("model and step")
    g.add_argument(
        "--model",
        choices=("8b", "70b", "gpt"),
        default="8b",
        help="8b, 70b: Llama 3 8B or 70B (bf16 parameters, fp32 gradient reduction); gpt: a 4-block GPT "
        "of width 256 (fp32)",
    )
    g.add_argument("--gpus", type=int, default=64, help="ranks (HSDP shapes R x G/R are searched too)")
    g.add_argument(
        "--budget-gib", type=float, default=None, help="memory per rank in GiB (default: the hardware's memory)"
    )
    g.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="muon",
        help="adamw; muon (each matrix orthogonalised on the rank that owns it); muon-gather (every rank "
        "gathers and orthogonalises every whole matrix)",
    )
    g.add_argument("--seq", type=int, default=4096, help="tokens per sequence (one sequence per micro-batch)")
    g.add_argument(
        "--global-tokens",
        type=int,
        default=4 * 2**20,
        help="tokens per step over all ranks (micro-batches per rank: global-tokens / (seq x gpus))",
    )
    g.add_argument(
        "--remat",
        default="none",
        help="activation-checkpointing policies to search per unit class, comma-separated (none, save_dots, full)",
    )
    g.add_argument("--prefetch", default="0,1,2", help="the runtime's prefetch depths to search, comma-separated")
    g.add_argument(
        "--tp",
        default="1",
        help="tensor-parallel degrees to search, comma-separated (1: none; each must divide --gpus and the "
        "model's heads); the data-parallel shapes of the remaining ranks are searched beside each",
    )
    g.add_argument(
        "--experts",
        type=int,
        default=0,
        help="gpt only: every block's MLP a top-2 mixture of this many experts (0: dense MLPs)",
    )
    g.add_argument(
        "--ep",
        default="1",
        help="expert-parallel degrees to search with --experts, comma-separated (1: no ep axis; each must "
        "divide --gpus and --experts); mesh (ep, edp) and its HSDP shapes beside each; not with --tp",
    )
    g = p.add_argument_group("hardware: a preset, your own numbers, or measured here")
    g.add_argument(
        "--hardware",
        default="H100_SXM",
        choices=sorted(sim.PRESETS) + ["measure"],
        help="a preset (its kernel model, scaled by --flops-derate and --net-derate), or measure: fitted "
        "on --gpus gloo ranks of this machine",
    )
    g.add_argument(
        "--flops-derate",
        type=float,
        default=1.0,
        help="scale of the preset's matmul FLOP/s (its kernel model already derates the peak)",
    )
    g.add_argument("--net-derate", type=float, default=1.0, help="scale of the preset's link bandwidth")
    g.add_argument(
        "--flops",
        type=float,
        default=None,
        help="your hardware: bf16 matmul FLOP/s (replaces the preset; needs --intra-gbps and --inter-gbps)",
    )
    g.add_argument("--intra-gbps", type=float, default=None, help="your hardware: GB/s each rank sends within a node")
    g.add_argument("--inter-gbps", type=float, default=None, help="your hardware: GB/s each rank sends across nodes")
    g.add_argument("--alpha-us", type=float, default=5.0, help="your hardware: latency per ring hop, microseconds")
    g.add_argument("--memory-gib", type=float, default=80.0, help="your hardware: memory per GPU, GiB")
    g.add_argument("--memory-gbps", type=float, default=3000.0, help="your hardware: memory bandwidth, GB/s")
    g.add_argument("--gpus-per-node", type=int, default=8, help="your hardware: GPUs per node")
    g = p.add_argument_group("output")
    g.add_argument("--plot", default=None, metavar="PNG", help="save the pick's timeline as an image")
    return p


def main(argv=None) -> sim.SearchResult:
    p = build_parser()
    args = p.parse_args(argv)
    if args.gpus < 1 or args.seq < 1 or args.global_tokens < args.seq:
        p.error("--gpus and --seq must be >= 1 and --global-tokens >= --seq")

    hw = hardware(args)
    model = build_model(args.model, args.seq, args.experts)
    x = batch(model, args.seq)
    budget = args.budget_gib * 2**30 if args.budget_gib is not None else hw.memory
    micro = max(1, args.global_tokens // (args.seq * args.gpus))  # micro-batches per rank per step
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.model != "gpt" else None
    remat = tuple(r.strip() for r in args.remat.split(",") if r.strip())
    for r in remat:
        try:
            fsdpfn.Unit("x", "zero3", (), 1, remat=r)
        except ValueError as e:
            p.error(f"--remat: {e}")
    try:
        tps = tuple(int(v) for v in args.tp.split(",") if v.strip())
    except ValueError:
        p.error(f"--tp: comma-separated integers, e.g. 1,2,4 (got {args.tp!r})")
    if not tps or any(t < 1 or args.gpus % t for t in tps):
        p.error(f"--tp: each degree must be >= 1 and divide --gpus {args.gpus} (got {args.tp!r})")
    if args.experts < 0 or (args.experts and args.model != "gpt"):
        p.error(
            f"--experts: a number of experts >= 1 for --model gpt, or 0 (got {args.experts} for --model {args.model})"
        )
    try:
        eps = tuple(int(v) for v in args.ep.split(",") if v.strip())
    except ValueError:
        p.error(f"--ep: comma-separated integers, e.g. 1,2,4 (got {args.ep!r})")
    if not eps or any(e < 1 or args.gpus % e for e in eps):
        p.error(f"--ep: each degree must be >= 1 and divide --gpus {args.gpus} (got {args.ep!r})")
    if max(eps) > 1 and (not args.experts or any(args.experts % e for e in eps)):
        p.error(
            f"--ep {args.ep}: needs --experts, a number of experts that every degree divides (got --experts {args.experts})"
        )
    if max(eps) > 1 and max(tps) > 1:
        p.error(f"--ep {args.ep} with --tp {args.tp}: expert and tensor parallelism do not combine; search one of them")
    print(hw)
    res = sim.search(
        model,
        args.gpus,
        budget,
        x,
        hardware=hw,
        optimizer=OPTIMIZERS[args.optimizer],
        mp=mp,
        micro_batches=micro,
        remat=remat,
        units=[None],
        prefetch=tuple(int(v) for v in args.prefetch.split(",")),
        accumulate=("reduce", "local"),
        loss_fn=_loss,
        tp=tps,
        tp_plan=tp_plan(args.model) if max(tps) > 1 else None,
        ep=eps,
    )
    print(
        f"\n{args.model}, {args.gpus} ranks, {micro} micro-batch(es) of {args.seq} tokens per rank per step, "
        f"optimizer {args.optimizer}\n"
    )
    print(res)
    if tps != (1,):
        print(f"tensor parallel: tp {res.tp} picked among {', '.join(map(str, tps))}")
    if eps != (1,):
        print(f"expert parallel: ep {res.ep} picked among {', '.join(map(str, eps))}")
    print("\nthe pick, predicted:\n" + res.result.summary())
    print("\n" + res.result.timeline(limit=12))
    if args.plot:
        res.result.plot(args.plot, title=f"{args.model} on {args.gpus} ranks: the search's pick")
        print(f"\ntimeline drawn to {args.plot}")
    strategy = {(u.name or "<root>"): u.strategy.value for u in res.plan.units}
    names = res.plan.mesh_dim_names if res.tp > 1 or res.ep > 1 or len(res.plan.mesh_shape) == 2 else None
    print(
        '\nto run it: mesh = init_device_mesh("cuda", {}{})\n'
        "  plan = fsdpfn.plan(model, mesh, strategy={}{}{}{})\n"
        "  rt = fsdpfn.runtime.Runtime(model, plan, prefetch={}{}".format(
            res.plan.mesh_shape,
            f", mesh_dim_names={names}" if names else "",
            _fold(strategy),
            _remat_arg(res.plan),
            f", tp={_tp_name(args.model)}" if res.tp > 1 else "",
            ", mp=..." if mp is not None else "",
            res.schedule.prefetch,
            ', accumulate="local")  # micro-batches inside rt.accumulating() reduce nothing'
            if res.accumulate == "local"
            else ")",
        )
    )
    return res


def _loss(out) -> torch.Tensor:
    # A model with experts returns (logits, aux): the router's load-balancing loss joins the loss.
    out, aux = out if isinstance(out, tuple) else (out, 0.0)
    # Targets shaped from the output: beside tp degree T the search profiles T ranks' batches at once.
    targets = torch.zeros(out.shape[:-1].numel(), dtype=torch.long, device=out.device)
    return F.cross_entropy(out.flatten(0, 1).float(), targets) + aux


def _tp_name(model: str) -> str:
    return "fsdpfn.models.GPT_TP_PLAN" if model == "gpt" else "LLAMA_TP_PLAN"


def _remat_arg(plan) -> str:
    """``, remat=...`` that rebuilds the plan's activation checkpointing ('' for none)."""
    remat = {u.name: u.remat for u in plan.units if u.name}
    if set(remat.values()) <= {"none"}:
        return ""
    if len(set(remat.values())) == 1:  # a string applies to every unit but the root
        return f", remat={next(iter(remat.values()))!r}"
    return f", remat={ {k: v for k, v in remat.items() if v != 'none'}!r}"


def _fold(strategy: dict[str, str]) -> str:
    """The strategy dict with the most common value as ``"*"``."""
    values = list(strategy.values())
    common = max(set(values), key=values.count)
    rest = {k: v for k, v in strategy.items() if v != common}
    return repr({"*": common, **rest})


if __name__ == "__main__":
    main(sys.argv[1:])
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
