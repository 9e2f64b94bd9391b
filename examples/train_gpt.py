"""Train a small character-level GPT with fsdpfn: sharded (zero3 by default), Muon + AdamW.

One command, no GPU, no downloads: it starts its own ranks (2 by default, gloo on CPU), trains
on the small corpus shipped in ``examples/data``, shows a progress bar, logs metrics, plots the
loss, saves checkpoints as it goes, and prints a text sample at the end::

    python examples/train_gpt.py                                 # 300 steps, about 1 min 20 s on 2 idle CPU cores
    python examples/train_gpt.py --resume --steps 400            # continue the run to step 400
    python examples/train_gpt.py --resume --steps 500 --world-size 1 --strategy zero2  # resharded
    python examples/train_gpt.py --world-size 4 --tp 2                # FSDP x tensor parallel
    python examples/train_gpt.py --world-size 4 --cp 2 --seq-len 256  # context parallel: each rank half of every sequence
    python examples/train_gpt.py --world-size 4 --experts 4 --ep 2    # mixture of experts, expert parallel
    python examples/train_gpt.py --world-size 4 --pp 2 --schedule interleaved_1f1b  # pipeline x FSDP
    python examples/train_gpt.py --resume runs/gpt/ckpt/step_00000400 --steps 600 --out runs/from400
                                                                 # a given checkpoint, into another run
    python examples/train_gpt.py --world-size 4 --replicas 2 --ft --ft-timeout 10 --out runs/ft
                                                                 # fault-tolerant HSDP: a replica group that
                                                                 # loses a rank is restarted and rejoins

``--ft`` (fsdpfn.ft, on torchft): each of the ``--replicas`` replica groups is a job of its own
(``--world-size / --replicas`` ranks, outputs in ``--out/replica<I>``, one line per attempted step
in its ``ft.jsonl``); the replicas' gradient mean spans the groups alive. This process starts a
lighthouse (or uses ``--lighthouse`` / ``$TORCHFT_LIGHTHOUSE``) and the groups, and restarts a
group that fails; the restarted group receives a live group's parameters and optimizer state at
a step boundary. ``--replica-group I`` runs one group alone (several hosts, another supervisor).

``--resume`` (or ``--resume latest``) continues from the newest intact checkpoint in
``--out/ckpt``. The learning-rate schedule (warm-up, then cosine decay to 10% of the peak) has
the horizon ``--schedule-steps``, by default ``--steps`` of the run's first launch, saved in
every checkpoint: resuming with a larger ``--steps`` keeps that horizon, so the extra steps
train at the final learning rate; pass ``--schedule-steps`` to stretch the decay instead.
Resuming a run that has reached ``--steps`` says so and changes nothing.

On GPUs, one rank per GPU under torchrun (NCCL)::

    torchrun --nproc_per_node 8 examples/train_gpt.py --device cuda --width 768 --depth 12 ...

Outputs (in ``--out``, default ``runs/gpt``): ``metrics.jsonl`` (one line per logged step),
``loss.png``, ``ckpt/`` (fsdpfn.checkpoint: ``latest`` + ``step_*`` directories, loadable on any
world size or plan), ``model.pt`` (a plain state dict: ``GPT(cfg).load_state_dict(torch.load(...))``
works without fsdpfn), ``config.json`` (model configuration and vocabulary), ``sample.txt``.

The step is pure: ``torch.func.grad`` of a loss over ``fsdpfn.unshard(params, plan)`` returns
sharded, reduced gradients; ``fsdpfn.optim`` turns them into updates. See :func:`make_step`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdpfn
from fsdpfn import checkpoint, comm, optim
from fsdpfn.launch import RankError, cuda_problem, launch, shutdown, under_torchrun
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import PipelineRuntime

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "tiny_tales.txt")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


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


class ReasonFirstParser(argparse.ArgumentParser):
    """An argument parser whose errors are the reason, on one line, and where to read more.

    argparse prints the whole usage (two dozen lines of flags here) before the one line that says
    what is wrong; a mistyped flag deserves the reason first and nothing to scroll past.

    Example:
      >>> p = ReasonFirstParser(prog="train_gpt.py"); _ = p.add_argument("--steps", type=int)
      >>> p.parse_args(["--steps", "x"])  # doctest: +SKIP
      train_gpt.py: error: argument --steps: invalid int value: 'x'
        (--help lists every flag)
    """

    def error(self, message: str):
        # The one-line usage is what argparse would print first; the reason comes first here.
        self.exit(2, f"{self.prog}: error: {message}\n  (--help lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line (its ``--help``: what the job does, then every flag with its default)."""
    description = __doc__.split("\nThe step is pure")[0]
    p = ReasonFirstParser(prog=os.path.basename(__file__), description=description, formatter_class=HelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    g.add_argument(
        "--strategy",
        default="zero3",
        choices=["replicate", "zero1", "zero2", "zero3"],
        help="sharding strategy of every unit",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="HSDP: replicate over this many groups, shard within each (mesh (replicas, world/replicas))",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: attention and MLP matmuls split over tp ranks (mesh (dp, tp), or "
        "(replicate, shard, tp) with --replicas); ranks differing only in tp read the same batch",
    )
    g.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: every sequence split over cp ranks (a head and a tail chunk each), "
        "attention over cp, parameters sharded over shard x cp (mesh (dp, cp[, tp]))",
    )
    g.add_argument(
        "--cp-strategy",
        default="allgather",
        choices=["allgather", "ring"],
        help="how attention fetches the other ranks' keys and values (with --cp)",
    )
    g.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel degree: the model cut into stages (embedding, blocks, head), each on its own "
        "ranks, with FSDP (and --tp) inside a stage",
    )
    g.add_argument(
        "--schedule",
        default=None,
        choices=list(fsdpfn.PIPELINE_SCHEDULES),
        help="with --pp: the pipeline schedule (interleaved_1f1b: two stages per pp rank) (default: 1f1b)",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="with --pp: micro-batches per step, dividing --batch-size (default: the most, up to 2 x --pp, "
        "that divide it)",
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree (with --experts): each MoE layer's experts split over ep ranks, tokens "
        "sent to their experts by all-to-alls, each expert sharded over the world / ep ranks of its "
        "expert-data-parallel group (mesh (ep, edp), with --cp (ep, edp, cp)); every rank reads its own "
        "batch (the cp ranks of one position the same one, each its part of every sequence)",
    )
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one rank per GPU, NCCL")
    g.add_argument(
        "--executor",
        default="runtime",
        choices=["runtime", "pure"],
        help="runtime: fsdpfn.runtime (prefetch, reshard after forward); pure: fsdpfn.unshard + torch.func.grad",
    )
    g.add_argument("--prefetch", type=int, default=1, help="units gathered ahead by the runtime")
    g.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds any collective may wait before the job fails naming the ranks that are behind "
        "(default: $FSDPFN_TIMEOUT, else 600)",
    )
    g = p.add_argument_group("fault tolerance (fsdpfn.ft, on torchft: pip install 'fsdpfn[ft]')")
    g.add_argument(
        "--ft",
        action="store_true",
        help="each of the --replicas replica groups is a job of its own: when a rank of one dies or stops, "
        "the others go on (the gradient mean over the groups alive) and the failed group, restarted, "
        "rejoins with a live group's state",
    )
    g.add_argument(
        "--lighthouse",
        default=os.environ.get("TORCHFT_LIGHTHOUSE"),
        help="with --ft: the address of a running torchft lighthouse (default: $TORCHFT_LIGHTHOUSE; "
        "unset: this process starts one)",
    )
    g.add_argument(
        "--replica-group",
        type=int,
        default=None,
        metavar="I",
        help="with --ft: run only replica group I (0 <= I < --replicas) on --world-size / --replicas ranks, "
        "against --lighthouse (jobs on several hosts, or under a supervisor of your own)",
    )
    g.add_argument("--ft-restarts", type=int, default=3, help="with --ft: restarts per replica group")
    g.add_argument(
        "--ft-timeout",
        type=float,
        default=30.0,
        help="with --ft: seconds the other replica groups wait in the replicas' all-reduce for a stopped "
        "one before going on without it (--timeout is for the collectives inside a group)",
    )
    g.add_argument(
        "--fault",
        default=None,
        metavar="R:K:STEP:HOW",
        help="with --ft, to see it work: rank K of replica group R kills (HOW=kill) or stops (stop) itself "
        "in step STEP (from 0) after its backward, or kills itself during the background write of the "
        "checkpoint saved after step STEP (save, with --ckpt-async); on the group's first start only",
    )
    g.add_argument(
        "--step-delay", type=float, default=0.0, help="seconds to sleep after each step (to watch a fault by hand)"
    )
    g.add_argument(
        "--ft-verbose",
        action="store_true",
        help="with --ft: torchft's own logs too (its INFO lines, quorums and HTTP requests; RUST_LOG=info), "
        "which are off by default: only the job's lines and torchft's warnings show",
    )
    g = p.add_argument_group("model")
    g.add_argument("--width", type=int, default=128, help="embedding width")
    g.add_argument("--depth", type=int, default=4, help="transformer blocks (each one fsdpfn unit)")
    g.add_argument("--heads", type=int, default=4, help="attention heads")
    g.add_argument("--seq-len", type=int, default=64, help="context length in characters")
    g.add_argument(
        "--init",
        default="meta",
        choices=["meta", "full"],
        help="meta: build the model on the meta device, each rank creates only its shards (fsdpfn.init_shards); "
        "full: every rank builds the whole model, then keeps its shards (fsdpfn.shard)",
    )
    g.add_argument(
        "--experts",
        type=int,
        default=0,
        help="experts per MoE layer: the MLPs of every --moe-every-th block (blocks 0, k, 2k, ...) become "
        "top-k mixtures of experts, each expert as wide as the dense MLP, with a load-balancing loss "
        "(weight 0.01 per layer) added to the loss (0: dense MLPs)",
    )
    g.add_argument("--top-k", type=int, default=2, help="experts each token is sent to (with --experts)")
    g.add_argument(
        "--moe-every",
        type=int,
        default=1,
        metavar="K",
        help="with --experts: block i has an MoE MLP when i %% K == 0 (1: every block; 2: blocks 0, 2, 4, ...)",
    )
    g.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="with --experts: each expert takes at most ceil(factor x tokens x top-k / experts) of a rank's "
        "tokens per step, the first in token order; the rest skip the layer (residual only) "
        "(default: no dropping)",
    )
    g.add_argument(
        "--fp8",
        action="store_true",
        help="gather the weight matrices as MXFP8 (fsdpfn.MixedPrecision(fp8='mxfp8')): fp32 masters, FP8 bytes on the wire",
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--optimizer",
        default="muon",
        choices=["muon", "adamw"],
        help="muon: Muon for hidden matrices, AdamW for the rest",
    )
    g.add_argument(
        "--ns-method",
        default="standard",
        choices=["standard", "gram"],
        help="Muon's Newton-Schulz: standard (torch.optim.Muon's) or gram (fewer FLOPs on wide matrices)",
    )
    g.add_argument(
        "--muon-blocks",
        default="none",
        choices=["none", "heads"],
        help="heads: orthogonalise qkv and proj per attention head (optim.head_blocks), not as whole matrices",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=300,
        help="total steps; a resumed run continues up to this (and the lr schedule keeps its horizon: "
        "see --schedule-steps)",
    )
    g.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        metavar="N",
        help="horizon of the lr schedule: warm-up, then cosine decay to 10%% of the peak at step N, flat "
        "after (default: --steps on a fresh run; on --resume the horizon saved in the checkpoint, so a "
        "larger --steps trains its extra steps at the final lr; pass N to stretch the decay instead)",
    )
    g.add_argument(
        "--stop-at", type=int, default=None, help="stop (with a checkpoint) after this step; --resume continues"
    )
    g.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    g.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    g.add_argument(
        "--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (everything with --optimizer adamw)"
    )
    g.add_argument(
        "--warmup", type=int, default=20, help="warm-up steps, then cosine decay to 10%% (see --schedule-steps)"
    )
    g.add_argument(
        "--max-nonfinite",
        type=int,
        default=5,
        help="skip steps whose gradients hold a NaN/inf (on every rank); stop after this many in a row",
    )
    g.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    g.add_argument("--data", default=DEFAULT_DATA, help="a UTF-8 text file (character-level)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/gpt", help="output directory")
    g.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the newest intact checkpoint in --out/ckpt (--resume or --resume latest), or "
        "from PATH (a checkpoint root such as runs/gpt/ckpt, its 'latest' file, or one step_* "
        "directory); any world size or strategy. A run already at --steps is left as it is",
    )
    g.add_argument("--ckpt-every", type=int, default=100, help="save a checkpoint every N steps")
    g.add_argument(
        "--ckpt-async",
        action="store_true",
        help="write checkpoints in the background (fsdpfn.checkpoint.async_save): training stalls only "
        "while the shards are copied to host memory, at the cost of that copy; worth it for large "
        "models (off by default: this demo's 10 MiB of state saves in about 0.4 s, and the fixed cost of a "
        "save's collectives keeps an asynchronous one near 0.1 s)",
    )
    g.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    g.add_argument("--log-every", type=int, default=10, help="log loss, gradient norm and learning rate every N steps")
    g.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (0: only at the end)")
    g.add_argument("--sample-chars", type=int, default=400, help="characters of text to generate at the end (0: none)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume == "latest":  # the keyword, as in checkpoint roots' own 'latest' file
        args.resume = True
    elif (
        isinstance(args.resume, str)
        and os.path.basename(os.path.normpath(args.resume)) == "latest"
        and os.path.isfile(args.resume)
    ):  # a root's 'latest' pointer file: load that root
        args.resume = os.path.dirname(os.path.abspath(args.resume))
    problem = check_args(args)
    if problem:
        p.error(problem)  # before any rank starts: a bad flag is named, nothing runs
    return args


def check_experts(args, world: int) -> str | None:
    """The first MoE flag (``--experts``, ``--ep``, ``--top-k``, ``--capacity-factor``) that
    cannot work with the others, or ``None``."""
    if not args.experts:
        for flag, value, default in (("--ep", args.ep, 1), ("--capacity-factor", args.capacity_factor, None)):
            if value != default:
                return f"{flag} {value} needs --experts (the number of experts per MoE layer, e.g. --experts 4)"
        return None
    if args.top_k > args.experts:
        return f"--top-k {args.top_k} must be at most --experts {args.experts}"
    if args.capacity_factor is not None and not 0 < args.capacity_factor < float("inf"):
        return f"--capacity-factor must be a number > 0 (e.g. 1.25), got {args.capacity_factor}"
    if args.tp > 1:
        return (
            f"--experts with --tp {args.tp}: mixture-of-experts layers do not run under tensor parallelism; drop --tp"
        )
    if args.ep > 1 and args.replicas > 1:
        return f"--ep {args.ep} with --replicas {args.replicas}: an expert-parallel mesh has no replicate axis; drop --replicas"
    if world % args.ep:
        return f"--ep {args.ep} must divide the world size {world} (the mesh is (ep, world / ep))"
    if world % (args.ep * args.cp):
        return f"--ep {args.ep} x --cp {args.cp} must divide the world size {world} (the mesh is (ep, world / (ep x cp), cp))"
    if args.experts % args.ep:
        return f"--ep {args.ep} must divide --experts {args.experts} (each ep rank holds experts / ep of them)"
    return None


FAULTS = ("kill", "stop", "save")


def parse_fault(text: str) -> tuple[int, int, int, str]:
    """``--fault R:K:STEP:HOW`` as ``(R, K, STEP, HOW)``, or ``ValueError`` saying what is wrong."""
    parts = text.split(":")
    if len(parts) != 4 or parts[3] not in FAULTS or not all(x.isdigit() for x in parts[:3]):
        raise ValueError(
            f"--fault {text!r}: expected R:K:STEP:HOW (replica group, rank in it, step, one of "
            f"{'/'.join(FAULTS)}), e.g. --fault 1:0:5:kill"
        )
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3]


def check_ft(args, world: int) -> str | None:
    """The first fault-tolerance flag that cannot work with the others, or ``None``."""
    if not args.ft:
        for flag, value in (("--replica-group", args.replica_group), ("--fault", args.fault)):
            if value is not None:
                return f"{flag} needs --ft (fault-tolerant replica groups, e.g. --ft --replicas 2)"
        if args.ft_verbose:
            return "--ft-verbose needs --ft (it shows torchft's own logs): add --ft, or drop --ft-verbose"
        return None
    if args.replicas < 2:
        return (
            f"--ft needs --replicas >= 2 (replica groups that outlive each other), got --replicas {args.replicas}: "
            f"e.g. --world-size {max(2, 2 * (world // 2))} --replicas 2"
        )
    if args.ep > 1:
        return (
            f"--ft with --ep {args.ep}: an expert-parallel mesh has no replicate axis to make fault-tolerant; "
            "drop --ft, or --ep"
        )
    if args.ft_restarts < 0:
        return f"--ft-restarts must be >= 0, got {args.ft_restarts}"
    if not 0 < args.ft_timeout < float("inf"):
        return f"--ft-timeout must be a positive number of seconds, got {args.ft_timeout}"
    if not args.step_delay >= 0:
        return f"--step-delay must be >= 0 seconds, got {args.step_delay}"
    if not fsdpfn.ft.available():
        return "--ft runs on torchft, which is not installed: pip install 'fsdpfn[ft]' (or pip install torchft)"
    if args.replica_group is not None:
        if not 0 <= args.replica_group < args.replicas:
            return f"--replica-group {args.replica_group} must be in [0, --replicas {args.replicas})"
        if not args.lighthouse:
            return (
                "--replica-group needs a lighthouse: --lighthouse ADDR or $TORCHFT_LIGHTHOUSE (start one with "
                "torchft_lighthouse --min_replicas 1), or drop --replica-group to have this job start one"
            )
    elif under_torchrun():
        return (
            "--ft under torchrun: each torchrun job is one replica group: pass --replica-group I and --lighthouse ADDR"
        )
    if args.fault is not None:
        try:
            r, k, step, how = parse_fault(args.fault)
        except ValueError as e:
            return str(e)
        group = world // args.replicas
        if r >= args.replicas or k >= group or step >= stop_step(args):
            return (
                f"--fault {args.fault}: replica group {r}, rank {k}, step {step} do not exist (replica groups "
                f"0..{args.replicas - 1}, ranks 0..{group - 1}, steps 0..{stop_step(args) - 1})"
            )
        if how == "save" and (not args.ckpt_async or ((step + 1) % args.ckpt_every and step + 1 != stop_step(args))):
            return (
                f"--fault {args.fault}: HOW=save kills a rank during the background write of an asynchronous "
                f"checkpoint: needs --ckpt-async and a save after step {step} (--ckpt-every dividing {step + 1})"
            )
    return None


def check_pipeline(args, world: int) -> str | None:
    """The first pipeline flag (``--pp``, ``--schedule``, ``--micro-batches``) that cannot work
    with the others, or ``None``. Sets their defaults when ``--pp`` is given."""
    if args.pp == 1:
        for flag, value in (("--schedule", args.schedule), ("--micro-batches", args.micro_batches)):
            if value is not None:
                return f"{flag} needs --pp (the pipeline-parallel degree, e.g. --pp 2)"
        return None
    args.schedule = args.schedule or "1f1b"
    for flag, value in (
        ("--experts", args.experts > 0),
        ("--ft", args.ft),
        ("--fp8", args.fp8),
        ("--executor pure", args.executor == "pure"),
    ):
        if value:
            return (
                f"--pp {args.pp} with {flag}: not supported yet (pipelines run with FSDP, HSDP, --cp and --tp inside "
                f"each stage); drop {flag.split()[0]} or --pp"
            )
    if world % (args.pp * args.replicas * args.cp * args.tp):
        return (
            f"--pp {args.pp} x --replicas {args.replicas} x --cp {args.cp} x --tp {args.tp} must divide the world size "
            f"{world} (the mesh is (pp, replicas, dp, cp, tp))"
        )
    stages = 2 * args.pp if args.schedule == "interleaved_1f1b" else args.pp
    units = args.depth + 4  # embedding, positions, each block, final norm, head
    if stages > units:
        return (
            f"--pp {args.pp} with --schedule {args.schedule} cuts the model into {stages} stages, but it has only {units} "
            f"units (--depth {args.depth} blocks + embedding, positions, norm and head); raise --depth or lower --pp"
        )
    step = args.pp if args.schedule == "interleaved_1f1b" else 1
    if args.micro_batches is None:  # the most up to 2 x pp that divide the batch (a multiple of pp when interleaved)
        args.micro_batches = max(
            (m for m in range(step, 2 * args.pp + 1, step) if args.batch_size % m == 0), default=None
        )
        if args.micro_batches is None:
            return (
                f"--pp {args.pp} with --schedule {args.schedule}: no micro-batch count divides --batch-size "
                f"{args.batch_size}{f' in multiples of {step}' if step > 1 else ''}; pass --batch-size {2 * args.pp} "
                "(or a multiple) or --micro-batches"
            )
    if args.micro_batches < 1 or args.batch_size % args.micro_batches:
        return (
            f"--micro-batches {args.micro_batches} must be >= 1 and divide --batch-size {args.batch_size} (each "
            "micro-batch holds batch-size / micro-batches sequences)"
        )
    if args.schedule == "interleaved_1f1b" and args.micro_batches % args.pp:
        return (
            f"--schedule interleaved_1f1b sends micro-batches through each stage in groups of --pp {args.pp}: "
            f"--micro-batches {args.micro_batches} must be a multiple of it"
        )
    return None


def check_args(args) -> str | None:
    """The first flag that cannot work, as a message naming it, or ``None``."""
    positive = (
        "world_size",
        "replicas",
        "tp",
        "cp",
        "pp",
        "ep",
        "top_k",
        "moe_every",
        "width",
        "depth",
        "heads",
        "seq_len",
        "steps",
        "batch_size",
        "ckpt_every",
        "keep",
        "log_every",
        "max_nonfinite",
    )
    for name in positive:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in ("prefetch", "eval_every", "sample_chars", "warmup", "experts"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    if args.schedule_steps is not None and args.schedule_steps < 1:
        return f"--schedule-steps must be >= 1, got {args.schedule_steps}"
    if args.device == "cuda":  # on every rank, before anything touches CUDA
        local_rank = int(os.environ.get("LOCAL_RANK", "0")) if under_torchrun() else 0
        problem = cuda_problem(local_rank)
        if problem is not None:
            return f"--device cuda: {problem}; or use --device cpu"
    if args.width % args.heads:
        return f"--heads {args.heads} must divide --width {args.width} (each head gets width / heads channels)"
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    if world % args.replicas:
        return (
            f"--replicas {args.replicas} must divide the world size {world} (the mesh is (replicas, world / replicas))"
        )
    if world % (args.replicas * args.tp * args.cp):
        return f"--tp {args.tp} x --cp {args.cp} x --replicas {args.replicas} must divide the world size {world}"
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        return f"--seq-len {args.seq_len} must divide by 2 x --cp = {2 * args.cp} (each cp rank holds a head and a tail chunk)"
    if args.heads % args.tp:
        return f"--tp {args.tp} must divide --heads {args.heads} (each tp rank computes whole heads)"
    problem = check_ft(args, world) or check_experts(args, world) or check_pipeline(args, world)
    if problem:
        return problem
    if args.fp8 and args.strategy == "replicate":
        return "--fp8 needs a sharded --strategy (zero1, zero2 or zero3): 'replicate' has no all-gather to carry FP8 weights"
    for name in ("lr", "adamw_lr"):  # peaks of warm-up schedules, which start at 0 whatever the sign
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be a positive learning rate, got {getattr(args, name)}"
    if args.stop_at is not None and args.stop_at < 1:
        return f"--stop-at must be >= 1, got {args.stop_at}"
    if args.timeout is not None and not args.timeout > 0:
        return f"--timeout must be a positive number of seconds, got {args.timeout}"
    if not os.path.isfile(args.data):
        return f"--data {args.data!r} is not a file"
    if os.path.getsize(args.data) < 2 * (args.seq_len + 2):
        return f"--data {args.data!r} is too short for --seq-len {args.seq_len}"
    if isinstance(args.resume, str) and not os.path.exists(args.resume):
        return f"--resume {args.resume!r} does not exist (give a checkpoint root such as runs/gpt/ckpt, or one step_* directory)"
    try:
        make_optimizer(args)  # the optimizers validate their own settings (learning rates, ...)
    except ValueError as e:
        return f"optimizer settings: {e}"
    return None


# ---------------------------------------------------------------------------------------------
# Data: characters of one text file, random windows chosen by (seed, step, rank)
# ---------------------------------------------------------------------------------------------


def load_corpus(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    data = torch.tensor([index[ch] for ch in text], dtype=torch.long, device="cpu")
    split = int(0.95 * len(data))
    return vocab, data[:split], data[split:]


def get_batch(data: torch.Tensor, step: int, rank: int, batch: int, seq_len: int, seed: int, device="cpu"):
    """Deterministic in (seed, step, rank): a resumed run sees exactly the batches it would have."""
    g = torch.Generator(device="cpu").manual_seed(hash((seed, step, rank)) % (2**63))
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g, device="cpu")
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


# ---------------------------------------------------------------------------------------------
# Model, plan, optimizer, step
# ---------------------------------------------------------------------------------------------


def schedule_steps(args) -> int:
    """The horizon of the lr schedule: ``--schedule-steps`` once set (by the user, or on resume
    from the checkpoint), else ``--steps``."""
    return args.steps if args.schedule_steps is None else args.schedule_steps


def lr_schedule(args, peak, horizon: int | None = None):
    horizon = schedule_steps(args) if horizon is None else horizon
    return optim.warmup_cosine_schedule(peak, args.warmup, max(horizon, args.warmup + 1), end_value=0.1 * peak)


def main_lr(args, horizon: int | None = None):
    """The schedule the logs show: Muon's with ``--optimizer muon``, else AdamW's."""
    return lr_schedule(args, args.lr if args.optimizer == "muon" else args.adamw_lr, horizon)


def muon_labels(name: str, param: torch.Tensor) -> str:
    """Muon's default labels, except the MoE routers, which train with AdamW: a router's gradient
    has an exact null direction (the softmax's gradient over the experts sums to zero per token)
    that holds only rounding noise, which Newton–Schulz would blow up to a full-size step. The
    packed experts (``[experts, out, in]``) are Muon's: each expert's matrices orthogonalised alone."""
    return "adamw" if "router" in name.split(".") else optim.muon_labels(name, param)


def make_optimizer(args) -> optim.GradientTransformation:
    """Muon + AdamW (or AdamW alone), wrapped so that a step with a NaN or inf gradient anywhere
    is skipped on every rank (``--max-nonfinite`` in a row end the run)."""
    if args.optimizer == "muon":
        # Newton–Schulz in bf16 (torch.optim.Muon's choice) pays off on GPUs; CPUs without bf16
        # matrix units run it ~40x slower than fp32 (2.4 s vs 0.06 s per step for the default model).
        ns_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        inner = optim.muon(
            lr=lr_schedule(args, args.lr),
            adamw_lr=lr_schedule(args, args.adamw_lr),
            weight_decay=0.01,
            adamw_weight_decay=0.0,
            ns_dtype=ns_dtype,
            ns_method=args.ns_method,
            blocks=optim.head_blocks(args.heads) if args.muon_blocks == "heads" else None,
            labels=muon_labels,
        )
    else:
        inner = optim.adamw(lr_schedule(args, args.adamw_lr), weight_decay=0.0)
    return optim.apply_if_finite(inner, max_consecutive_errors=args.max_nonfinite)


def make_forward(model, plan, args):
    """``forward(params, x) -> logits`` on sharded ``params``: through the runtime (per-unit
    gathers with prefetch, units freed after forward and gathered again in backward) or the pure
    path (``fsdpfn.unshard`` of everything, then the module). Same numbers either way."""
    if args.executor == "runtime":
        from fsdpfn.runtime import Runtime

        rt = Runtime(model, plan, prefetch=args.prefetch, device=args.device)
        return rt.apply

    def pure(params, x):
        return torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))

    return pure


def cross_entropy(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def make_loss(forward, plan=None, cp_strategy="allgather"):
    """``loss_fn(params, x, y, aux=True)``: cross-entropy, plus the MoE layers' load-balancing
    loss (with ``--experts``) unless ``aux=False``. With a cp axis in ``plan``, each rank keeps
    its part of every sequence and the forward runs inside ``fsdpfn.context_parallel`` (the
    loss is then the mean over this rank's tokens; gradients are averaged over dp x cp)."""
    cp = plan is not None and plan.cp_size > 1

    def loss_fn(params, x, y, aux=True):
        if cp:
            x, y = fsdpfn.context_parallel_shard((x, y), plan)
        with fsdpfn.context_parallel(plan, strategy=cp_strategy) if cp else contextlib.nullcontext():
            out = forward(params, x)
        logits, balance = out if isinstance(out, tuple) else (out, None)
        loss = cross_entropy(logits, y)
        return loss + balance if aux and balance is not None else loss

    return loss_fn


def make_step(loss_fn, opt, replicas=None, before_reduce=None, pipe=None):
    """``step(state, x, y, norm=False) -> (state, local loss, global gradient norm or None)``.
    ``torch.func.grad`` of a loss over sharded parameters gives sharded, reduced gradients;
    ``opt`` turns them into updates. The norm (one all-reduce) is computed only when asked.
    With ``pipe`` (``--pp``) the pipeline runtime's step gives this rank's stages' gradients,
    and the norm spans every stage.

    With ``replicas`` (a :class:`fsdpfn.ft.ReplicaGroup`) the gradients are first averaged over
    the replica groups alive; a step that was not committed returns ``state`` unchanged (its
    ``"step"`` too). ``before_reduce(step)`` runs between the backward and that average (fault
    injection)."""
    grad_and_loss = pipe.step if pipe is not None else torch.func.grad_and_value(loss_fn)

    def step(state, x, y, norm=False):
        grads, loss = grad_and_loss(state["params"], x, y)
        if replicas is not None:
            if before_reduce is not None:
                before_reduce(state["step"])
            grads = replicas.reduce(grads)
            if grads is None:
                return state, loss.detach(), None
        grad_norm = optim.global_norm(grads).item() if norm else None
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        params = optim.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss.detach(), grad_norm

    return step


@torch.no_grad()
def evaluate(state, loss_fn, data, args, world, rank, device, batches=4) -> float:
    total = torch.zeros((), device=device)
    for i in range(batches):
        x, y = get_batch(data, -1 - i, rank, args.batch_size, args.seq_len, args.seed, device)
        total += loss_fn(state["params"], x, y, aux=False)
    comm.all_reduce(total, tag="validation loss")
    return total.item() / (batches * world)


@torch.no_grad()
def sample(model, full_params, vocab, prompt: str, n: int, seq_len: int, device, seed=0) -> str:
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([[index[c] for c in prompt if c in index]], device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        out = torch.func.functional_call(model, full_params, (ids[:, -seq_len:],))
        logits = (out[0] if isinstance(out, tuple) else out)[0, -1]
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
    return "".join(vocab[i] for i in ids[0].tolist())


# ---------------------------------------------------------------------------------------------
# Logging: progress bar, metrics JSONL, loss plot (rank 0)
# ---------------------------------------------------------------------------------------------


class Progress:
    """tqdm if installed (``pip install -e .[demo]``), else one ``\\r`` line."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)
        except ImportError:
            pass

    def update(self, step: int, **fields):
        if not self.enabled:
            return
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(f"\rstep {step}/{self.total} {text}", end="", flush=True)

    def note(self, text: str) -> None:
        """A line of its own, above the bar (tqdm's write) or after the ``\\r`` line."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(("\n" if self.enabled else "") + text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print()


class StopRequest:
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice) in a rank: noted, not raised, and acted
    on at the next step boundary, where every rank agrees on it (a max over ranks: a signal that
    reached one rank stops them all at the same step) so that they save the same step's checkpoint
    together and stop."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def agreed(self, device) -> int:
        """The signal every rank acts on now (0: none); a collective, so every rank calls it."""
        flag = torch.tensor([float(self.signum)], device=device)
        comm.all_reduce(flag, tag="stop request", op="max")
        return int(flag.item())


class SaveTimes:
    """--ckpt-async: each save's stall (the call, which returns once the shards are in host
    memory) and write time (until the background write, checks and commit are done), told on rank
    0 once the save is committed."""

    def __init__(self):
        self.saves: list[tuple[object, float, float]] = []  # (pending, stall, started)
        self.ends: dict[int, float] = {}

    def started(self, pending, stall: float, t0: float) -> None:
        self.saves.append((pending, stall, t0))
        pending.add_done_callback(lambda f: self.ends.setdefault(id(f), time.perf_counter()))

    def report(self, note) -> None:
        """A line for each save committed since the last call."""
        while self.saves and id(self.saves[0][0]) in self.ends:
            pending, stall, t0 = self.saves.pop(0)
            if pending.exception() is None:
                note(
                    f"checkpoint {os.path.basename(pending.path)}: training stalled {stall:.2f} s, "
                    f"written beside it in {self.ends[id(pending)] - t0:.2f} s"
                )


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, step: int) -> None:
    """On resume, drop lines logged after the checkpoint (they will be logged again)."""
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def plot_loss(metrics_path: str, png_path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title("fsdpfn: char-level GPT on tiny_tales.txt")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


# Flags that must match the checkpoint's run (the plan, world size and schedule may change).
RESUME_FLAGS = ("width", "depth", "heads", "seq_len", "optimizer", "data", "experts", "top_k", "moe_every")


def check_resumable(config_path: str, args) -> None:
    if not os.path.exists(config_path):
        return
    with open(config_path) as f:
        saved = json.load(f)["args"]
    diff = [f"--{k.replace('_', '-')} {saved[k]}" for k in RESUME_FLAGS if k in saved and saved[k] != getattr(args, k)]
    if diff:
        sys.exit(
            f"--resume: the run in {os.path.dirname(config_path)} was trained with {' '.join(diff)}; "
            "pass the same to continue it (the world size, strategy, steps and learning rates may change)"
        )


# ---------------------------------------------------------------------------------------------
# The training job (every rank)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """What every rank holds besides the training state."""

    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    paths: dict
    vocab: list
    train_data: torch.Tensor
    val_data: torch.Tensor
    cfg: GPTConfig
    model: torch.nn.Module  # a skeleton on the meta device: the parameters live in the state
    plan: fsdpfn.Plan
    opt: optim.GradientTransformation
    data_rank: int  # which batches this rank reads: its data-parallel index (tp ranks share one)
    tag: str = ""  # before the lines this job prints: which replica group, with --ft
    stopped: str = ""  # the signal (SIGINT, SIGTERM) that stopped the job early, after saving
    pipe: PipelineRuntime | None = None  # with --pp: runs this rank's stages


OUTPUTS = dict(
    ft="ft.jsonl",
    metrics="metrics.jsonl",
    png="loss.png",
    ckpt="ckpt",
    model="model.pt",
    config="config.json",
    sample="sample.txt",
)


def setup(rank: int, world: int, args) -> tuple[Job, dict]:
    """The job and a fresh state ``{"params", "opt_state", "step"}`` (same seed on every rank)."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    paths = {k: os.path.join(args.out, v) for k, v in OUTPUTS.items()}
    vocab, train_data, val_data = load_corpus(args.data)
    cfg = GPTConfig(
        vocab_size=len(vocab),
        seq_len=args.seq_len,
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        experts=args.experts,
        top_k=args.top_k,
        moe_every=args.moe_every,
        capacity_factor=args.capacity_factor,
    )
    if args.init == "full":  # every rank builds the same full model, then keeps its shards
        torch.manual_seed(args.seed)
        with device:
            model = GPT(cfg)
    else:  # shapes only: no rank ever holds the whole model
        with torch.device("meta"):
            model = GPT(cfg)
    # With --ft this process is one replica group: the replicate dim is fsdpfn.ft's, not the mesh's.
    replicas = 1 if args.ft else args.replicas
    if args.pp > 1:  # named axes: pipeline x data parallel (HSDP with --replicas) (x context x tensor parallel)
        shard = world // (args.pp * replicas * args.cp * args.tp)
        dims = {
            "pp": args.pp,
            "replicate": replicas,
            "shard" if replicas > 1 else "dp": shard,
            "cp": args.cp,
            "tp": args.tp,
        }
        dims = {n: d for n, d in dims.items() if d > 1 or n in ("pp", "shard", "dp")}
        mesh = init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    elif args.cp > 1 and args.ep > 1:  # experts over ep, each over edp x cp; the rest over ep x edp x cp
        mesh = init_device_mesh(
            device.type, (args.ep, world // (args.ep * args.cp), args.cp), mesh_dim_names=("ep", "edp", "cp")
        )
    elif args.cp > 1:  # named axes: data parallel (HSDP with --replicas) x context parallel (x tensor parallel)
        shard = world // (replicas * args.cp * args.tp)
        dims = {"replicate": replicas, "shard": shard, "cp": args.cp, "tp": args.tp}
        dims = {n: d for n, d in dims.items() if d > 1 or n in ("shard", "cp")}
        mesh = init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    elif args.tp > 1:  # named axes: data parallel (HSDP with --replicas) x tensor parallel
        shard = world // (replicas * args.tp)
        mesh = (
            init_device_mesh(device.type, (replicas, shard, args.tp), mesh_dim_names=("replicate", "shard", "tp"))
            if replicas > 1
            else init_device_mesh(device.type, (shard, args.tp), mesh_dim_names=("dp", "tp"))
        )
    elif args.ep > 1:  # experts split over ep; each expert sharded over edp, the rest over ep x edp
        mesh = init_device_mesh(device.type, (args.ep, world // args.ep), mesh_dim_names=("ep", "edp"))
    elif replicas > 1:  # HSDP: all-reduce across replicas, reduce-scatter within one
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    common = dict(
        strategy=args.strategy,
        mp=fsdpfn.MixedPrecision(fp8="mxfp8") if args.fp8 else None,
        tp=GPT_TP_PLAN if args.tp > 1 else None,
    )
    plan: fsdpfn.Plan | fsdpfn.PipelinedPlan
    if args.pp > 1:  # stages are runs of whole units: the embedding and the head get units of their own
        units = ["embed", "pos", *(f"blocks.{i}" for i in range(args.depth)), "norm", "head"]
        stages = 2 * args.pp if args.schedule == "interleaved_1f1b" else None
        plan = fsdpfn.pipeline_plan(model, mesh, units=units, stages=stages, **common)
    else:
        plan = fsdpfn.plan(model, mesh, **common)
    opt = make_optimizer(args)
    pipe = None
    if args.pp > 1:  # this rank's stages only, each sharded over its data-parallel ranks
        pipe = PipelineRuntime(
            model,
            plan,
            args.schedule,
            args.micro_batches,
            loss_fn=cross_entropy,
            prefetch=args.prefetch,
            device=device,
            cp_strategy=args.cp_strategy,
        )
        if args.init == "full":
            params = pipe.shard(model)
        else:
            params = {
                n: t
                for sp in pipe.stage_plans.values()
                for n, t in fsdpfn.init_shards(model, sp, seed=args.seed, device=device).items()
            }
    elif args.init == "full":
        params = fsdpfn.shard(model, plan)
    else:  # one parameter at a time, seeded by its path: the same values on any world size or plan
        params = fsdpfn.init_shards(model, plan, seed=args.seed, device=device)
    state = {"params": params, "opt_state": opt.init(params), "step": 0}
    model = model.to("meta")  # the shards are copies: keep only a skeleton for functional_call
    data_rank = fsdpfn.transforms.dp_rank(plan)
    if args.ft:  # replica group I reads the batches of the I-th replica of the same HSDP job without --ft
        data_rank += args.replica_group * plan.dp_size
    job = Job(
        args, rank, world, device, paths, vocab, train_data, val_data, cfg, model, plan, opt, data_rank, pipe=pipe
    )
    return job, state


def moe_summary(args) -> str:
    if not args.experts:
        return ""
    layers = len(range(0, args.depth, args.moe_every))
    cap = f", capacity factor {args.capacity_factor}" if args.capacity_factor is not None else ""
    return f", {layers} MoE layer(s) of {args.experts} experts (top-{args.top_k}{cap}) over ep={args.ep}"


def announce(job: Job) -> None:
    if job.rank == 0:
        n_params = sum(p.numel() for p in job.model.parameters())
        args = job.args
        dp = job.plan.dp_size  # the ranks reading different batches
        ranks = f"{job.world} rank(s)" if dp == job.world else f"{dp} data-parallel rank(s) of {job.world}"
        print(
            f"{job.tag}GPT {n_params / 1e6:.2f}M parameters, vocabulary {len(job.vocab)}, {len(job.train_data) / 1e3:.0f}k "
            f"training characters; {ranks} x {args.batch_size} x {args.seq_len} tokens per step; "
            f"{args.strategy}{f' x pp={args.pp} ({args.schedule}, {args.micro_batches} micro-batches)' if args.pp > 1 else ''}{f' x tp={args.tp}' if args.tp > 1 else ''}{f' x cp={args.cp} ({args.cp_strategy})' if args.cp > 1 else ''}{moe_summary(args)}, {args.optimizer}{', MXFP8 weight gathers' if args.fp8 else ''}"
        )


def resume(job: Job, state: dict) -> tuple[dict, dict | None]:
    """The state of the newest intact checkpoint under ``--out/ckpt`` (or of ``--resume PATH``),
    resharded to this job's plan and world size, and the checkpoint's :func:`checkpoint.read_info`
    (``None`` when there was none to resume). A damaged newest checkpoint is skipped with a
    warning naming it; an explicitly named directory that is damaged is an error."""
    source = job.args.resume if isinstance(job.args.resume, str) else job.paths["ckpt"]
    if checkpoint.latest(source) is None and not isinstance(job.args.resume, str):
        if job.rank == 0:
            print(f"--resume: no checkpoint in {source}, starting from step 0")
        return state, None
    return checkpoint.load(source, state, job.plan, return_info=True)


def stop_step(args) -> int:
    return args.steps if args.stop_at is None else min(args.stop_at, args.steps)


def nothing_to_train(info: dict, step: int, args) -> str:
    """The one line a resume that has nothing left to do prints."""
    limit = f"--steps {args.steps}" if stop_step(args) == args.steps else f"--stop-at {args.stop_at}"
    more = "a larger --steps" if limit.startswith("--steps") else "a larger --stop-at, or none,"
    return (
        f"nothing to train: the checkpoint {info['dir']} is at step {step} and {limit}; pass {more} to continue "
        "the run. Outputs left as they are."
    )


def nothing_left(args) -> str | None:
    """:func:`nothing_to_train`'s line if the checkpoint ``--resume`` names is already at the
    run's last step, else ``None`` (also when there is none, or it is damaged: the ranks' load
    says so). Read before any rank starts; :func:`train` checks again what the ranks loaded, in
    case the checkpoints changed in between (``--resume PATH`` into a run still training)."""
    source = args.resume if isinstance(args.resume, str) else os.path.join(args.out, OUTPUTS["ckpt"])
    try:
        with warnings.catch_warnings():  # a damaged checkpoint is reported by the load itself
            warnings.simplefilter("ignore")
            info = checkpoint.read_info(source)
    except (FileNotFoundError, checkpoint.CheckpointError):
        return None
    step = info["values"].get("step")
    return nothing_to_train(info, step, args) if isinstance(step, int) and step >= stop_step(args) else None


def resolve_schedule(args, step: int, info: dict) -> str | None:
    """Sets ``args.schedule_steps`` for a resumed run (see ``--schedule-steps``): the user's
    value, else the horizon saved in the checkpoint, else (a checkpoint from before the
    horizon was saved) ``--steps``. Returns a line for the log when the lr differs from what a
    fresh run with these flags would use, or changes at the resume, else ``None``."""
    saved = info["values"].get("schedule_steps")
    if args.schedule_steps is None:
        if saved is None:
            args.schedule_steps = args.steps
            return (
                f"lr schedule: {info['dir']} records no horizon (saved by an older version of this script); "
                f"decaying over --steps {args.steps}"
            )
        args.schedule_steps = saved
        if saved == args.steps:
            return None
        return (
            f"lr schedule: kept the checkpoint's horizon of {saved} steps (--steps {args.steps} does not move it): "
            f"the lr reaches its final {main_lr(args)(saved):.3g} at step {saved} and stays there. To decay over "
            f"{args.steps} steps instead pass --schedule-steps {args.steps} (the lr at step {step} would then be "
            "{}, not {})".format(*distinct(main_lr(args, args.steps)(step), main_lr(args)(step)))
        )
    if saved is not None and saved != args.schedule_steps:
        return (
            f"lr schedule: horizon {saved} -> {args.schedule_steps} steps (--schedule-steps): the lr at step "
            "{} is {}, not {}".format(step, *distinct(main_lr(args)(step), main_lr(args, saved)(step)))
        )
    return None


def distinct(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 3 significant digits, or as many more as it takes to tell them apart
    (an lr of 0.0020004 is not "0.002, not 0.002")."""
    for digits in range(3, 10):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb or a == b:
            break
    return sa, sb


def start_logs(job: Job, start: int) -> None:
    if job.rank != 0:
        return
    os.makedirs(job.args.out, exist_ok=True)
    if job.args.ft and fsdpfn.ft.restarts() > 0:
        pass  # a restarted replica group appends: its logs say what happened before it failed
    elif start == 0 and not job.args.resume:
        open(job.paths["metrics"], "w").close()
        open(job.paths["ft"], "w").close()
    else:
        truncate_metrics(job.paths["metrics"], start)
    with open(job.paths["config"], "w") as f:
        json.dump(
            {"model": job.cfg.__dict__, "vocab": "".join(job.vocab), "args": vars(job.args), "world_size": job.world},
            f,
            indent=1,
        )


def dropped_fraction(job: Job) -> float:
    """The fraction of (token, choice) pairs the MoE layers dropped for capacity in the last
    step's forward, over every rank (one all-reduce)."""
    layers = [m for m in job.model.modules() if hasattr(m, "dropped")]
    counts = torch.tensor([float(sum(m.dropped for m in layers))], device=job.device)
    comm.all_reduce(counts, tag="dropped tokens")
    pairs = len(layers) * job.args.top_k * job.args.batch_size * job.args.seq_len * job.world
    return round(counts.item() / pairs, 5)


class Fault:
    """``--fault R:K:STEP:HOW`` on this rank: nothing unless it is rank K of replica group R on
    the group's first start."""

    def __init__(self, args, rank: int):
        self.step, self.how = -1, ""
        if args.fault is not None and fsdpfn.ft.restarts() == 0:
            r, k, step, how = parse_fault(args.fault)
            if (r, k) == (args.replica_group, rank):
                self.step, self.how = step, how
        self.where = f"fault injection: replica group {args.replica_group}, rank {rank} (pid {os.getpid()})"

    def before_reduce(self, step: int) -> None:
        if step == self.step and self.how in ("kill", "stop"):
            sig = signal.SIGSTOP if self.how == "stop" else signal.SIGKILL
            print(f"{self.where}: {sig.name} in step {step}, after its backward", flush=True)
            os.kill(os.getpid(), sig)

    def before_save(self, step: int) -> None:
        if step != self.step or self.how != "save":
            return
        import torch.distributed.checkpoint as dcp

        write_data = dcp.FileSystemWriter.write_data
        where = self.where

        def dying_write_data(writer, plan, planner):  # this process alone: its shards written, not yet committed
            write_data(writer, plan, planner).wait()
            print(f"{where}: SIGKILL during the background write of the checkpoint after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.FileSystemWriter.write_data = dying_write_data


def ft_log(job: Job, replicas, loss: torch.Tensor) -> None:
    """One line per attempted step in ``--out/replica<I>/ft.jsonl`` (rank 0): the step, the
    replica groups averaged, whether it was committed, whether this group received a live
    group's state first, why it was not committed, and this group's mean loss (not rounded)."""
    total = loss.detach().clone()
    comm.all_reduce(total, tag="ft loss")
    last = replicas.history[-1]
    if job.rank == 0:
        with open(job.paths["ft"], "a") as f:
            f.write(
                json.dumps(
                    {
                        "step": last.step,
                        "replicas": last.replicas,
                        "committed": last.committed,
                        "healed": last.healed,
                        "loss": total.item() / job.world,
                        "error": last.error,
                        "time": time.time(),
                    }
                )
                + "\n"
            )


def train_loop(job: Job, state: dict, loss_fn, replicas=None) -> tuple[dict, float]:
    """Steps from ``state["step"]`` to ``--steps`` (or ``--stop-at``): logs, evaluates and saves
    checkpoints on the way. Returns the state and the last logged loss.

    With ``replicas`` (``--ft``) each step starts with the replica groups' quorum, which may hand
    this group a live group's state (and step); a step that is not committed runs again."""
    args, rank, world, device = job.args, job.rank, job.world, job.device
    data_rank = job.data_rank
    fault = Fault(args, rank) if replicas is not None else None
    # Ctrl-C and SIGTERM: a checkpoint of the step reached, then stop (not under --ft, where a
    # replica group's supervisor stops and restarts the groups).
    stop_request = StopRequest() if replicas is None else None
    times = SaveTimes() if args.ckpt_async else None
    step_fn = make_step(loss_fn, job.opt, replicas, fault.before_reduce if fault else None, job.pipe)
    progress = Progress(args.steps, state["step"], enabled=rank == 0 and not args.no_progress)
    tokens_per_step = job.plan.dp_size * args.batch_size * args.seq_len
    t_start = t_window = time.perf_counter()
    window_steps, loss_sum, last_loss = 0, torch.zeros((), device=device), float("nan")
    stop = stop_step(args)
    lr = main_lr(args)
    # Saved beside the state: a resume keeps this horizon (see --schedule-steps).
    horizon = {"schedule_steps": schedule_steps(args)}
    first = True
    while state["step"] < stop:
        if replicas is not None:
            state = replicas.start_step(state)
            alone = replicas.replicas == 1 and not replicas.healed
            if first and fsdpfn.ft.restarts() > 0 and alone and (state["step"] == 0 or fsdpfn.ft.job_finished()):
                # a restart with no live group to rejoin and no checkpoint to resume from (or
                # after the job finished): training alone would not be the job's run
                if rank == 0:
                    print(f"{job.tag}restarted, but no live replica group to rejoin: nothing to do", flush=True)
                    open(os.path.join(args.out, NOTHING_TO_REJOIN_FILE), "w").close()
                break
            first = False
            if state["step"] >= stop:
                break
        step = state["step"]
        x, y = get_batch(job.train_data, step, data_rank, args.batch_size, args.seq_len, args.seed, device)
        log = (step + 1) % args.log_every == 0 or step + 1 == stop
        state, loss, grad_norm = step_fn(state, x, y, norm=log)
        if replicas is not None:
            ft_log(job, replicas, loss)
            if args.step_delay:
                time.sleep(args.step_delay)
            if state["step"] == step:  # not committed: the step runs again
                continue
        finite = state["opt_state"]  # optim.ApplyIfFiniteState: the same on every rank
        if finite.last_finite:
            loss_sum += loss
            window_steps += 1
        elif rank == 0:  # a skipped step's loss stays out of the logged average
            print(
                f"\nstep {step + 1}: non-finite gradients, update skipped on every rank "
                f"({finite.notfinite_count} in a row, {finite.total_notfinite} in all)",
                flush=True,
            )
        done = state["step"]
        if log:
            comm.all_reduce(loss_sum, tag="training loss")
            last_loss = loss_sum.item() / (world * max(window_steps, 1))
            tok_s = tokens_per_step * window_steps / (time.perf_counter() - t_window)
            row = {
                "step": done,
                "loss": round(last_loss, 5),
                "grad_norm": round(grad_norm, 5),
                "lr": lr(step),
                "skipped": finite.total_notfinite,
                "tokens_per_s": round(tok_s, 1),
                "elapsed_s": round(time.perf_counter() - t_start, 2),
            }
            if args.capacity_factor is not None:
                row["dropped"] = dropped_fraction(job)
            if args.eval_every and done % args.eval_every == 0 or done == stop:
                row["val_loss"] = round(evaluate(state, loss_fn, job.val_data, args, world, data_rank, device), 5)
            if rank == 0:
                with open(job.paths["metrics"], "a") as f:
                    f.write(json.dumps(row) + "\n")
                progress.update(
                    done,
                    loss=f"{last_loss:.3f}",
                    **{"|g|": f"{grad_norm:.2f}", "lr": f"{lr(step):.2g}", "tok/s": f"{tok_s:,.0f}"},
                )
                if args.no_progress:
                    drop = f" dropped {row['dropped']:.1%}" if "dropped" in row else ""
                    print(
                        f"{job.tag}step {done}/{args.steps} loss {last_loss:.3f} |g| {grad_norm:.3f} lr {lr(step):.3g} "
                        f"skipped {finite.total_notfinite}{drop} tok/s {tok_s:,.0f}",
                        flush=True,
                    )
            t_window, window_steps, loss_sum = time.perf_counter(), 0, torch.zeros((), device=device)
        signum = stop_request.agreed(device) if stop_request is not None else 0
        if done % args.ckpt_every == 0 or done == stop or signum:
            if fault is not None:
                fault.before_save(done - 1)
            save = checkpoint.async_save if args.ckpt_async else checkpoint.save
            t0 = time.perf_counter()
            saved = save(job.paths["ckpt"], {**state, **horizon}, job.plan, keep=args.keep)  # collective: every rank
            if times is not None and rank == 0:
                times.started(saved, time.perf_counter() - t0, t0)
        if times is not None and rank == 0:
            times.report(progress.note)
        if signum:
            job.stopped = signal.Signals(signum).name
            break
    checkpoint.wait()  # the last checkpoint is committed (or its error raised) before the job reports it
    if times is not None and rank == 0:
        times.report(progress.note)
    progress.close()
    return state, last_loss


def finish(job: Job, state: dict, start: int, last_loss: float, wall: float) -> None:
    """A plain state dict, a sample, the plot, a summary."""
    args, paths = job.args, job.paths
    checkpoint.export_full(paths["model"], state["params"], job.plan, model=job.model)  # collective
    want_sample = args.sample_chars > 0  # --sample-chars 0: no sample, no sample.txt, no frame
    if job.pipe is not None:  # each rank holds its stages only: rank 0 samples from the exported model
        if want_sample and job.rank == 0:
            with torch.device("meta"):
                whole = GPT(job.cfg)
            whole.load_state_dict(torch.load(paths["model"], weights_only=True), assign=True)
            text = sample(
                whole,
                dict(whole.named_parameters()),
                job.vocab,
                "Once upon a time",
                args.sample_chars,
                args.seq_len,
                job.device,
                args.seed,
            )
    else:
        with torch.no_grad():
            full = fsdpfn.unshard(state["params"], job.plan)  # collective
        # Under tp (ep) the model's layers run tp (all-to-all) collectives: every rank samples
        # (the same text, same seed).
        if want_sample and (job.rank == 0 or job.plan.tp_size > 1 or job.plan.ep_size > 1):
            text = sample(
                job.model, full, job.vocab, "Once upon a time", args.sample_chars, args.seq_len, job.device, args.seed
            )
    if job.rank == 0:
        if want_sample:
            with open(paths["sample"], "w") as f:
                f.write(text + "\n")
        png = plot_loss(paths["metrics"], paths["png"])
        rows = read_metrics(paths["metrics"])
        first = rows[0]["loss"] if rows else float("nan")
        val = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), float("nan"))
        # Replica groups hold the same parameters, so the same sample: shown once (each writes its file).
        if want_sample and not (args.ft and args.replica_group):
            print("\n--- sample ---------------------------------------------------------------")
            print(text)
            print("--------------------------------------------------------------------------")
        print(
            f"{job.tag}steps {start}->{state['step']} of {args.steps} in {wall:.0f} s ({job.world} rank(s), {args.strategy}, "
            f"{args.optimizer}, {args.executor})"
        )
        print(f"{job.tag}loss {first:.3f} (first logged) -> {last_loss:.3f} (final); validation {val:.3f}")
        print(f"{job.tag}metrics    {paths['metrics']}")
        print(f"{job.tag}plot       {png or '(matplotlib not installed: pip install -e .[demo])'}")
        print(f"{job.tag}checkpoint {checkpoint.latest(paths['ckpt'])}  (resume: add --resume)")
        print(f"{job.tag}model      {paths['model']}  (plain state dict for GPT(GPTConfig(**config['model'])))")
    comm.barrier(tag="finish")


def one_write_per_line() -> None:
    """Line-buffered stdout: each line reaches the terminal in one write, so lines of processes
    sharing it (the ranks, the replica groups) never interleave mid-line. Block-buffered (the
    default into a pipe or file) could cut a line at any byte."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)


def quiet_torchft(device: str) -> None:
    """--ft without --ft-verbose, in each rank: torchft's Python side says warnings only, on one
    line each (a traceback of an expected fault, e.g. a peer lost mid all-reduce, is the line of
    its error; --ft-verbose shows it whole), without its note about NCCL's flight recorder on a
    run that has no NCCL, and its checkpoint server logs no HTTP request. Its Rust side is quieted
    by RUST_LOG=warn, set for the whole job in :func:`main`."""
    import logging
    from http.server import BaseHTTPRequestHandler

    class OneLine(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if device != "cuda" and "NCCL flight recorder" in record.getMessage():
                return False
            record.exc_info, record.exc_text = None, None
            return True

    # One handler per top-level torchft logger, which the records of its children (created later,
    # with each Manager) pass through on their way up: a logger's own filters would see only the
    # records logged to that logger.
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(OneLine())
        log = logging.getLogger(name)
        log.setLevel(logging.WARNING)
        log.addHandler(handler)
        log.propagate = False
    # The peers' state transfer is torchft's HTTP server in this process; the access lines it
    # writes to stderr for every request are not the job's events.
    BaseHTTPRequestHandler.log_request = lambda self, code="-", size="-": None


def train(rank: int, world: int, args) -> None:
    """The whole job, on every rank (started by :func:`fsdpfn.launch.launch`)."""
    one_write_per_line()
    if args.ft:
        job_tag = f"[replica group {args.replica_group}] "
        if not args.ft_verbose:
            quiet_torchft(args.device)
    job, state = setup(rank, world, args)
    if args.ft:
        job.tag = job_tag
    note, info = None, None
    # A restarted replica group starts from its latest verified checkpoint: alone (every group
    # was lost) it goes on from there; with a live group further on, the quorum replaces it.
    restarted = args.ft and fsdpfn.ft.restarts() > 0 and checkpoint.latest(job.paths["ckpt"]) is not None
    if args.resume or restarted:
        state, info = resume(job, state)
        if info is not None:
            if state["step"] >= stop_step(args):  # see nothing_left: no training, no outputs rewritten
                if rank == 0:
                    print(nothing_to_train(info, state["step"], args))
                return
            note = resolve_schedule(args, state["step"], info)
            job.opt = make_optimizer(args)  # the same state structure; the schedules' horizon may differ
    announce(job)
    if rank == 0 and info is not None:
        print(
            f"resumed from {info['dir']} (step {state['step']}, saved on {info['world_size']} rank(s); "
            f"now {job.world} rank(s), {args.strategy})"
        )
        if note:
            print(note)
    start = state["step"]
    start_logs(job, start)
    if job.pipe is not None:  # the pipeline's forward-only pass, for the validation loss
        loss_fn = lambda params, x, y, aux=True: job.pipe.evaluate(params, x, y)  # noqa: E731
    else:
        loss_fn = make_loss(make_forward(job.model, job.plan, args), job.plan, args.cp_strategy)
    replicas = None
    if args.ft:
        replicas = fsdpfn.ft.ReplicaGroup(
            args.lighthouse,
            replica_id=f"replica{args.replica_group}",
            min_replicas=1,
            timeout=args.ft_timeout,
            step=state["step"],
        )
        fsdpfn.ft.start_together(args.replica_group)
    t0 = time.perf_counter()
    state, last_loss = train_loop(job, state, loss_fn, replicas)
    if job.stopped:  # Ctrl-C or SIGTERM: the checkpoint of this step is saved; no sample, no export
        return {"stopped": job.stopped, "step": state["step"], "checkpoint": checkpoint.latest(job.paths["ckpt"])}
    if replicas is not None:
        if state["step"] >= stop_step(args) and rank == 0:  # before leaving the quorum: see fsdpfn.ft.mark_finished
            fsdpfn.ft.mark_finished()
        replicas.shutdown()  # the other groups go on without this one
        if state["step"] == start:
            return  # a restart with nothing to rejoin: no outputs
    finish(job, state, start, last_loss, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Launch: join torchrun's ranks, or spawn our own (fsdpfn.launch)
# ---------------------------------------------------------------------------------------------


def lock_run_dir(out: str):
    """One job per run directory: a second job writing the same checkpoints and logs would
    corrupt both. The lock is an ``flock`` held by this process, released however it ends."""
    import fcntl

    os.makedirs(out, exist_ok=True)
    handle = open(os.path.join(out, ".lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        sys.exit(
            f"{out} is in use by {holder}: another job is training into it. Wait for it, stop it, or pass --out DIR."
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def train_ft(rank: int, world: int, args) -> None:
    """:func:`train` on a rank of one replica group (``--ft``): says its pid and registers with
    the group's watchdog first, and tells it when it ended well (see fsdpfn.ft.watch_ranks)."""
    fsdpfn.ft.rank_up(args.replica_group, rank)
    train(rank, world, args)
    fsdpfn.ft.rank_done(rank)


NOTHING_TO_REJOIN_FILE = ".nothing_to_rejoin"  # left by a restarted replica group's rank 0 for its main process


def ft_stop_grace(args) -> float:
    """How long a rank of a replica group (or a group's process) may stay stopped before its
    group is ended: half of --ft-timeout, so that the other groups, waiting in the quorum, go on
    within --ft-timeout plus the lighthouse's heartbeat timeout."""
    return args.ft_timeout / 2


def run_ft(args, argv: list[str]) -> int:
    """``--ft`` without ``--replica-group``: a lighthouse (unless given) and one process per
    replica group (this script with ``--replica-group I``), each restarted when it fails while
    another trains (:func:`fsdpfn.ft.run_replica_groups`). Returns the exit status."""

    def command(replica: int, lighthouse: str) -> list[str]:
        # --no-progress: two progress bars cannot share one terminal; each group logs tagged lines.
        return [
            sys.executable,
            os.path.abspath(__file__),
            *argv,
            "--replica-group",
            str(replica),
            "--lighthouse",
            lighthouse,
            "--no-progress",
        ]

    print(
        f"ft: {args.replicas} replica groups of {args.world_size // args.replicas} rank(s), outputs in "
        f"{os.path.join(args.out, 'replica<I>')}",
        flush=True,
    )
    code = fsdpfn.ft.run_replica_groups(
        command,
        args.replicas,
        lighthouse=args.lighthouse,
        max_restarts=args.ft_restarts,
        restart_alone=True,
        stop_grace_s=ft_stop_grace(args),
        echo=lambda line: print(line, flush=True),
    )
    print("ft: the job finished" if code == 0 else f"ft: finished with status {code}", flush=True)
    return code


def forward_stop_signals() -> None:
    """In the process that spawned the ranks: SIGINT and SIGTERM are passed on to them (Ctrl-C
    reaches them already, a scheduler's SIGTERM often only this process), and this process waits
    for them to save and stop instead of raising KeyboardInterrupt. A second signal stops the ranks
    at once, without a checkpoint of the current step."""
    import multiprocessing

    count = [0]

    def on_signal(signum, frame):
        count[0] += 1
        name = signal.Signals(signum).name
        ranks = multiprocessing.active_children()
        if count[0] == 1:
            print(
                f"\n{name}: saving a checkpoint of the current step, then stopping "
                f"({'Ctrl-C' if signum == signal.SIGINT else 'a second signal'} again: stop at once, without it)",
                flush=True,
            )
            for p in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)
            return
        for p in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        print(
            f"{name} again: stopped at once; the last checkpoint saved is the one to resume from (--resume)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: its own flags, with ``--resume`` (a ``--resume PATH``
    of its own replaced: the newest checkpoint under --out is the one just saved).

    Example:
      >>> resume_command(["examples/train_gpt.py", "--steps", "400", "--resume", "runs/x/ckpt/step_00000300"])
      'python examples/train_gpt.py --steps 400 --resume'
    """
    rest, i = [], 1
    while i < len(argv):
        if argv[i] == "--resume":
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("-") else 1
            continue
        if argv[i].startswith("--resume="):
            i += 1
            continue
        rest.append(argv[i])
        i += 1
    return shlex.join(["python", os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0], *rest, "--resume"])


def quiet_torchft_rust(args) -> None:
    """--ft without --ft-verbose: RUST_LOG=warn in this process's environment, read by the
    lighthouse it starts and inherited by every replica group. torchft's Rust side (lighthouse,
    quorum, manager) logs INFO lines by the hundred; a RUST_LOG of the user's own is kept."""
    if args.ft and not args.ft_verbose and "RUST_LOG" not in os.environ:
        os.environ["RUST_LOG"] = "warn"


def main(argv=None) -> None:
    args = parse_args(argv)
    one_write_per_line()
    quiet_torchft_rust(args)
    if args.device == "cuda" and not under_torchrun():
        sys.exit(
            "--device cuda: launch under torchrun, one process per GPU: torchrun --nproc_per_node N examples/train_gpt.py --device cuda"
        )
    if args.ft and args.replica_group is not None:  # before the checks: each group's run is its own
        args.out = os.path.join(args.out, f"replica{args.replica_group}")
    if args.resume:
        check_resumable(os.path.join(args.out, "config.json"), args)
    if not under_torchrun() or os.environ.get("LOCAL_RANK", "0") == "0":
        lock = lock_run_dir(args.out)  # noqa: F841 - held until this process exits
    finished = args.resume and nothing_left(args)
    if finished:  # said at once, without starting ranks; exit status 0
        if os.environ.get("RANK", "0") == "0":
            print(finished)
        return
    if args.ft and args.replica_group is None:
        sys.exit(run_ft(args, sys.argv[1:] if argv is None else list(argv)))
    world = args.world_size
    if args.ft:  # this process is one replica group
        world //= args.replicas
    marker = os.path.join(args.out, NOTHING_TO_REJOIN_FILE)
    if args.ft and os.path.exists(marker):
        os.remove(marker)
    if not args.ft and not under_torchrun():
        forward_stop_signals()
    # the ranks this process spawns: under torchrun, torchrun watches them
    watch = (
        fsdpfn.ft.watch_ranks(args.replica_group, world, stop_grace_s=ft_stop_grace(args))
        if args.ft and not under_torchrun()
        else contextlib.nullcontext()
    )
    try:
        with watch:
            results = launch(
                train_ft if args.ft else train,
                world,
                args,
                backend="nccl" if args.device == "cuda" else "gloo",
                timeout=args.timeout,
            )
    except RankError as e:  # the tracebacks are in str(e); people need the reasons
        if getattr(watch, "reason", None):  # the watchdog ended the group and said why
            sys.exit(1)
        sys.exit(f"\ntraining failed:\n{e.summary()}")
    stopped = results[0] if results and isinstance(results[0], dict) else None
    if stopped:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"stopped by {stopped['stopped']} at step {stopped['step']} of {args.steps}; checkpoint "
                f"{stopped['checkpoint']}. Resume with: {resume_command(sys.argv if argv is None else ['train_gpt.py', *argv])}",
                flush=True,
            )
        sys.exit(128 + signal.Signals[stopped["stopped"]].value)  # the shell's code for a job a signal ended
    if args.ft and os.path.exists(marker):  # tells the supervisor: neither finished nor failed
        os.remove(marker)
        sys.exit(fsdpfn.ft.NOTHING_TO_REJOIN)


if __name__ == "__main__":
    main()
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
