"""Fine-tune a Hugging Face causal LM with fsdpfn: pretrained safetensors weights streamed
straight into shards, torch.func over the HF module, Muon + AdamW.

No rank ever builds the model: every rank makes a skeleton with its parameters on the meta
device, plans it, and reads only its own rows of the checkpoint (``fsdpfn.load_safetensors``).
The step is the pure one of ``examples/train_gpt.py``: ``torch.func.grad`` of a loss written
over ``fsdpfn.unshard(params, plan)`` gives sharded, reduced gradients. Runs on CPU with gloo
ranks it spawns itself, no downloads::

    pip install -e ".[hf,demo]"                         # transformers is an optional extra
    python examples/finetune_hf.py                      # a tiny GPT-2, created and saved locally first
    python examples/finetune_hf.py --model path/to/dir  # any local causal-LM directory (config + safetensors)

By default (no ``--model``) it creates a randomly initialised 4-layer GPT-2 with a byte-level
vocabulary, saves it with ``save_pretrained`` to ``--out``/base (``config.json`` +
``model.safetensors``) and fine-tunes that on ``examples/data/tiny_tales.txt``. A directory
with tokenizer files is tokenised with its tokenizer, one without with UTF-8 bytes (a model
with at least 256 tokens). Outputs in ``--out`` (default ``runs/hf``): ``metrics.jsonl``, the
fine-tuned model as an HF directory ``finetuned/`` (rank 0 gathers it one parameter at a time)
and a text sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdpfn
from fsdpfn import comm, optim
from fsdpfn.launch import launch, shutdown

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "tiny_tales.txt")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="a local HF causal-LM directory (default: create a tiny GPT-2 in --out/base)"
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--strategy", default="zero3", choices=["replicate", "zero1", "zero2", "zero3"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (hidden matrices)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (embeddings, head, norms, biases)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps, then cosine decay to 10%%")
    p.add_argument("--seed", type=int, default=0, help="data order (and the tiny model's initialisation)")
    p.add_argument("--data", default=DEFAULT_DATA, help="a UTF-8 text file")
    p.add_argument("--out", default="runs/hf", help="output directory")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--sample-tokens", type=int, default=200, help="tokens sampled at the end (0: no sample)")
    p.add_argument("--no-export", action="store_true", help="do not write the fine-tuned model to --out/finetuned")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The model: a tiny GPT-2 to start from, and a skeleton with its parameters on meta
# ---------------------------------------------------------------------------------------------


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def create_tiny_gpt2(directory: str, seed: int) -> str:
    """A randomly initialised GPT-2 (4 layers, width 128, byte vocabulary) saved with
    ``save_pretrained``: what a downloaded checkpoint directory would hold."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=256,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=10,
        eos_token_id=10,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside put their parameters on the meta device as they register them and
    keep their buffers (rotary frequencies, masks: small, and not in checkpoints) real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def skeleton(directory: str):
    """The HF model of ``directory`` with every parameter on meta (and fp32 masters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def hf_rename(model):
    """Checkpoint names -> the model's: HF checkpoints may lack the base-model prefix
    (``h.0...`` for ``transformer.h.0...``) and hold buffers the model no longer has
    (``_keys_to_ignore_on_load_unexpected``)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    prefix = getattr(model, "base_model_prefix", "")
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]

    def rename(key: str):
        if key in names:
            return key
        if prefix and f"{prefix}.{key}" in names:
            return f"{prefix}.{key}"
        if any(p.search(key) for p in ignore):
            return None
        return key  # fsdpfn names it in its error if it fits nowhere

    return rename


# ---------------------------------------------------------------------------------------------
# Data: a tokenizer if the directory has one, else UTF-8 bytes
# ---------------------------------------------------------------------------------------------


def tokenize(directory: str, path: str, vocab_size: int):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if any(os.path.exists(os.path.join(directory, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids = tokenizer(text)["input_ids"]
        decode = tokenizer.decode
    else:
        if vocab_size < 256:
            raise ValueError(f"{directory} has no tokenizer and a vocabulary of {vocab_size} < 256: cannot use bytes")
        ids = list(text.encode("utf-8"))
        decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    data = torch.tensor(ids, dtype=torch.long)
    split = int(0.95 * len(data))
    return data[:split], data[split:], decode


def get_batch(data: torch.Tensor, step: int, rank: int, batch: int, seq_len: int, seed: int):
    g = torch.Generator().manual_seed(hash((seed, step, rank)) % (2**63))
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def make_loss(model, plan):
    def loss_fn(params, x, y):
        out = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,), {"use_cache": False})
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    return loss_fn


def make_optimizer(args):
    def sched(peak):
        return optim.warmup_cosine_schedule(peak, args.warmup, max(args.steps, args.warmup + 1), end_value=0.1 * peak)

    # fp32 Newton-Schulz: CPUs without bf16 matrix units run it far slower in bf16.
    return optim.muon(
        lr=sched(args.lr),
        adamw_lr=sched(args.adamw_lr),
        weight_decay=0.0,
        adamw_weight_decay=0.0,
        ns_dtype=torch.float32,
    )


class Progress:
    """tqdm if installed (``pip install -e .[demo]``), else log lines."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stdout)
            except ImportError:
                pass
        self.total, self.enabled = total, enabled

    def update(self, step: int, text: str) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        elif self.enabled:
            print(f"step {step}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def gather_full(params, plan) -> dict:
    """The full parameters on rank 0, one parameter at a time (every rank takes part; the
    others hold one full parameter at most)."""
    full = {}
    for name, p in params.items():
        value = comm.full_tensor(p)
        if comm.rank() == 0:
            full[name] = value.cpu()
    return full


@torch.no_grad()
def sample(model, full, prompt_ids: list[int], n: int, seq_len: int, seed: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    g = torch.Generator().manual_seed(seed)
    model.eval()
    for _ in range(n):
        logits = torch.func.functional_call(model, full, (ids[:, -seq_len:],), {"use_cache": False}).logits[0, -1]
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g)[None]], dim=1)
    return ids[0].tolist()


def train(rank: int, world: int, args, directory: str) -> None:
    quiet_transformers()
    model = skeleton(directory)
    mesh = init_device_mesh("cpu", (world,))
    plan = fsdpfn.plan(model, mesh, strategy=args.strategy)  # each transformer block a unit
    t0 = time.perf_counter()
    params = fsdpfn.load_safetensors(model, plan, directory, rename=hf_rename(model))  # this rank's rows only
    load_s = time.perf_counter() - t0
    train_data, val_data, decode = tokenize(directory, args.data, model.config.vocab_size)
    opt = make_optimizer(args)
    opt_state = opt.init(params)
    loss_fn = make_loss(model, plan)
    grad_and_loss = torch.func.grad_and_value(loss_fn)
    metrics = os.path.join(args.out, "metrics.jsonl")
    if rank == 0:
        n = sum(p.numel for u in plan.units for p in u.params)
        print(
            f"{type(model).__name__} from {directory}: {n / 1e6:.2f}M parameters in {len(plan.units)} units, "
            f"loaded into {world} rank(s)' shards in {load_s:.2f} s; {len(train_data) / 1e3:.0f}k training tokens; "
            f"{world} x {args.batch_size} x {args.seq_len} tokens per step; {args.strategy}, muon + adamw",
            flush=True,
        )
        open(metrics, "w").close()
    progress = Progress(args.steps, enabled=rank == 0 and not args.no_progress)
    first = last = float("nan")
    window, window_steps, t_window, t_start = torch.zeros(()), 0, time.perf_counter(), time.perf_counter()
    for step in range(args.steps):
        x, y = get_batch(train_data, step, rank, args.batch_size, args.seq_len, args.seed)
        grads, loss = grad_and_loss(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        window += loss.detach()
        window_steps += 1
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            comm.all_reduce(window)
            last = window.item() / (world * window_steps)
            first = last if first != first else first  # NaN until the first log
            tok_s = world * args.batch_size * args.seq_len * window_steps / (time.perf_counter() - t_window)
            if rank == 0:
                with open(metrics, "a") as f:
                    f.write(json.dumps({"step": done, "loss": round(last, 5), "tokens_per_s": round(tok_s, 1)}) + "\n")
                progress.update(done, f"loss={last:.3f} tok/s={tok_s:,.0f}")
                if args.no_progress:
                    print(f"step {done}/{args.steps} loss {last:.3f} tok/s {tok_s:,.0f}", flush=True)
            window, window_steps, t_window = torch.zeros(()), 0, time.perf_counter()
    progress.close()
    wall = time.perf_counter() - t_start

    with torch.no_grad():
        x, y = get_batch(val_data, -1, rank, args.batch_size, args.seq_len, args.seed)
        model.eval()
        val = loss_fn(params, x, y).detach()
        comm.all_reduce(val)
        val = val.item() / world
    full = gather_full(params, plan) if not args.no_export or args.sample_tokens else {}
    if rank == 0:
        finished = [
            f"steps 0->{args.steps} in {wall:.0f} s ({world} rank(s), {args.strategy}, muon + adamw)",
            f"loss {first:.3f} (first logged) -> {last:.3f} (final); validation {val:.3f}",
            f"metrics    {metrics}",
        ]
        if not args.no_export:
            out = os.path.join(args.out, "finetuned")
            from safetensors.torch import save_file

            os.makedirs(out, exist_ok=True)
            model.config.save_pretrained(out)
            save_file(
                {n: t.contiguous() for n, t in full.items()},
                os.path.join(out, "model.safetensors"),
                metadata={"format": "pt"},
            )
            finished.append(f"model      {out}  (AutoModelForCausalLM.from_pretrained)")
        if args.sample_tokens:
            prompt = train_data[:8].tolist()
            text = decode(sample(model, full, prompt, args.sample_tokens, args.seq_len, args.seed))
            print("\n--- sample ---------------------------------------------------------------")
            print(text)
            print("--------------------------------------------------------------------------")
        print("\n".join(finished), flush=True)
    comm.barrier()


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("examples/finetune_hf.py needs transformers: pip install -e '.[hf]'")
    quiet_transformers()
    directory = args.model
    if directory is None:
        directory = create_tiny_gpt2(os.path.join(args.out, "base"), args.seed)
        print(f"created a tiny GPT-2 in {directory} (save_pretrained: config.json + model.safetensors)", flush=True)
    elif not os.path.isdir(directory):
        sys.exit(f"--model {directory}: not a directory; pass a local HF directory with config.json and *.safetensors")
    os.makedirs(args.out, exist_ok=True)
    launch(train, args.world_size, args, directory)


if __name__ == "__main__":
    main()
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
