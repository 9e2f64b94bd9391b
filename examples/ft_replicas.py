"""One replica group of a fault-tolerant HSDP job: a small GPT under zero3 on this group's own
ranks (the shard dim), averaged with the other replica groups through ``fsdpfn.ft`` (the
replicate dim), which goes on without a replica that dies or stops and takes it back when it
is started again.

Start a lighthouse once (torchft's command, or ``fsdpfn.ft.Lighthouse()`` in a Python process),
then each replica group (any order; restart one at any time):

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 2000
    python examples/ft_replicas.py --lighthouse http://localhost:29510 --replica 0
    python examples/ft_replicas.py --lighthouse http://localhost:29510 --replica 1

Each rank appends one JSON line per attempted step to ``--log``: the step, this rank's loss, the
replica groups averaged, whether the step was committed and whether this replica received its
state from a live one first. ``--die-at STEP`` makes rank ``--die-rank`` of this replica kill
(``--how kill``) or stop (``--how stop``) itself in that step, after its backward and before the
replicas' all-reduce: the fault-injection the tests and ``benchmarks/replicas.py`` use.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import optim
from fsdpfn.launch import launch, shutdown
from fsdpfn.models import GPT, GPTConfig

VOCAB, SEQ = 32, 8


def build(world_size: int):
    """The model, plan, parameters and optimizer state every replica starts from."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, width=16, depth=2, heads=2, seq_len=SEQ, bias=False))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    params = fsdpfn.shard(model, plan)
    opt = optim.adamw(lr=1e-2)
    return model, plan, params, opt, opt.init(params)


def batch(replica: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This HSDP rank's batch at ``step``: the same whichever attempt of the step it is."""
    g = torch.Generator().manual_seed(100_003 * step + 101 * replica + rank)
    tokens = (torch.randint(0, VOCAB, (4, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, plan):
    def f(params, x, y):
        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return f


def train(rank, world_size, args):
    model, plan, params, opt, state = build(world_size)
    f = loss_fn(model, plan)
    replicas = fsdpfn.ft.ReplicaGroup(
        args.lighthouse, replica_id=f"replica{args.replica}", min_replicas=1, timeout=args.timeout
    )
    if args.ready:  # tell whoever started us that this replica is heartbeating, then wait for the go
        open(f"{args.ready}.{rank}", "w").close()
        while not os.path.exists(args.ready + ".go"):
            time.sleep(0.02)
    path = f"{args.log}.{rank}" if args.log else os.devnull
    with open(path, "a") as out:
        while replicas.step < args.steps:
            if replicas.step == args.hold_at:  # wait for whoever started us (a test: until a restarted peer is up)
                while not os.path.exists(args.hold_file):
                    time.sleep(0.02)
            params, state = replicas.start_step((params, state))
            step = replicas.step
            x, y = batch(args.replica, rank, step)
            grads, loss = torch.func.grad_and_value(f)(params, x, y)
            if step == args.die_at and rank == args.die_rank:
                os.kill(os.getpid(), signal.SIGSTOP if args.how == "stop" else signal.SIGKILL)
            grads = replicas.reduce(grads)  # the mean over the replicas alive, or None: not committed
            committed = grads is not None
            if committed:
                updates, state = opt.update(grads, state, params)
                params = optim.apply_updates(params, updates)
            last = replicas.history[-1]
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": loss.item(),
                        "replicas": last.replicas,
                        "committed": committed,
                        "healed": last.healed,
                        "error": last.error,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
            out.flush()
            if args.delay:
                time.sleep(args.delay)
    replicas.shutdown()
    return replicas.step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--shard", type=int, default=2, help="ranks of this replica group")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=5.0, help="collective timeout, seconds")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--log", default="")
    p.add_argument("--ready", default="", help="file prefix: write <prefix>.<rank> when up, wait for <prefix>.go")
    p.add_argument("--hold-at", type=int, default=-1, help="before this step, wait until --hold-file exists")
    p.add_argument("--hold-file", default="")
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=0)
    p.add_argument("--how", choices=["kill", "stop"], default="kill")
    args = p.parse_args(argv)
    launch(train, args.shard, args, timeout=args.timeout)


if __name__ == "__main__":
    main()
    shutdown()
