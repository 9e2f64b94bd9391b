"""The vocabulary split over tp, on 4 gloo ranks: what a rank keeps for backward and sends, with
the embedding and the output Linear whole on every tp rank (``F.cross_entropy`` of whole
logits) and split over the vocabulary (``"vocab"``, ``"colwise_loss"``,
``fsdpfn.vocab_parallel_cross_entropy``), in one launch.

A GPT (width ``--width``, ``--depth`` blocks, the blocks split by ``GPT_TP_PLAN`` in both) on a
(dp, tp) = (1, 4) mesh, one sequence of ``--seq`` tokens per rank, fp32, the pure loop. Per
vocabulary size, rank 0's:

1. saved: bytes autograd keeps for backward (each storage once, the gathered parameters left
   out): the loss over whole logits keeps their log-softmax, ``N V`` floats; split, each rank
   keeps ``N V / tp``, its columns' softmax;
2. bytes sent, counted by ``fsdpfn.count_collectives``, against ``plan.cost(tokens=N)``'s list
   (the split adds the embedding's all-reduce and the loss's two small ones, ``3 N`` floats);
3. the loss against the whole-vocabulary run's (the same model and batch).

Usage:
  OMP_NUM_THREADS=1 python benchmarks/vocab.py
  OMP_NUM_THREADS=1 python benchmarks/vocab.py --vocabs 4096 --seq 64   # a quick look
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.launch import launch
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig

WORLD = 4
MIB = 2**20
SPLIT = {**GPT_TP_PLAN, "embed": "vocab", "head": "colwise_loss"}


def _step(rank, world, args):
    mesh = testing.mesh((1, WORLD), ("dp", "tp"))
    rows = []
    for vocab in args.vocabs:
        cfg = GPTConfig(vocab_size=vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=4, bias=False)
        tokens = torch.randint(0, vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(vocab))
        x, y = tokens[:, :-1], tokens[:, 1:]
        for split in (False, True):
            torch.manual_seed(0)
            model = GPT(cfg)
            plan = fsdpfn.plan(model, mesh, tp=SPLIT if split else GPT_TP_PLAN)
            params = fsdpfn.shard(model, plan, requires_grad=True)
            saved: dict[int, int] = {}
            with fsdpfn.count_collectives() as counter:
                full = fsdpfn.unshard(params, plan)
                skip = {t.untyped_storage()._cdata for t in full.values()}

                def pack(t):
                    if t.untyped_storage()._cdata not in skip:
                        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    logits = torch.func.functional_call(model, full, (x,))
                    if split:
                        loss = fsdpfn.vocab_parallel_cross_entropy(logits, y, plan)
                    else:
                        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            listed = plan.cost(reshard_after_forward=False, tokens=args.seq).calls
            rows.append(
                dict(
                    vocab=vocab,
                    split=split,
                    saved=sum(saved.values()),
                    sent=sum(c.wire_bytes for c in counter.calls),
                    listed=sum(c.wire_bytes for c in listed),
                    same_calls=sorted((c.kind, c.nbytes, c.tag) for c in counter.calls)
                    == sorted((c.kind, c.nbytes, c.tag) for c in listed),
                    loss=float(loss.detach()),
                )
            )
            del full, loss, params, logits
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = launch(_step, WORLD, args)[0]
    print(
        f"\n({time.time() - t0:.0f} s) GPT width {args.width}, {args.depth} blocks (GPT_TP_PLAN), {args.seq} tokens per "
        f"rank, fp32, (dp, tp) = (1, {WORLD}); rank 0's figures\n"
    )
    print(
        "| vocabulary | saved, whole (MiB) | saved, split (MiB) | split / whole | logits N V / tp (MiB) | sent whole / split "
        "(MiB) | counted / listed | loss split - whole |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for vocab in args.vocabs:
        whole, split = (next(r for r in rows if r["vocab"] == vocab and r["split"] is s) for s in (False, True))
        same = whole["same_calls"] and split["same_calls"]
        ratio = f"{whole['sent'] / whole['listed']:.4f} / {split['sent'] / split['listed']:.4f}"
        print(
            f"| {vocab:,} | {whole['saved'] / MIB:.2f} | {split['saved'] / MIB:.2f} | {split['saved'] / whole['saved']:.3f} "
            f"| {args.seq * vocab / WORLD * 4 / MIB:.2f} | {whole['sent'] / MIB:.3f} / {split['sent'] / MIB:.3f} "
            f"| {ratio}{'' if same else ' (calls differ)'} | {split['loss'] - whole['loss']:+.2e} |"
        )


if __name__ == "__main__":
    main()
    fsdpfn.launch.shutdown()
