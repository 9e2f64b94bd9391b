"""A whole pipelined plan is refused by the transforms that would hold every stage on every pp
rank (a model that trains without its pipeline), on every rank and before any collective, with
the way to its stages; one stage's plan takes its parameters from the whole model."""

import torch

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=8, width=16, depth=2, heads=2)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "norm", "head"]


def _refusals(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.pipeline_plan(model, testing.mesh((2, 1), ("pp", "dp")), units=UNITS)
    stage = plan.stage_plan(rank)
    params = fsdpfn.shard(model, stage)  # the whole model: the stage takes its own
    own = fsdpfn.shard({n: p for n, p in model.named_parameters() if n in stage.param_names}, stage)
    same = sorted(params) == sorted(stage.param_names) and all(
        torch.equal(params[n].to_local(), own[n].to_local()) for n in own
    )
    with torch.device("meta"):
        meta = GPT(CFG)
    init = fsdpfn.init_shards(meta, plan.stage_plan(rank), seed=0)
    said = {}
    calls = {
        "shard": lambda: fsdpfn.shard(model, plan),
        "unshard": lambda: fsdpfn.unshard(params, plan),
        "reduce": lambda: fsdpfn.reduce({n: None for n in plan.param_names}, plan),
        "init_shards": lambda: fsdpfn.init_shards(meta, plan, seed=0),
        "Runtime": lambda: fsdpfn.runtime.Runtime(model, plan),
        "load_safetensors": lambda: fsdpfn.load_safetensors(model, plan, "no-such-file.safetensors"),
        "verify": lambda: fsdpfn.verify(model, plan, params, torch.zeros(2, 4, dtype=torch.long)),
    }
    with fsdpfn.count_collectives() as calls_made:
        for name, call in calls.items():
            try:
                call()
                said[name] = None
            except ValueError as e:
                said[name] = str(e)
    return same, sorted(init) == sorted(stage.param_names), said, len(calls_made.calls)


def test_whole_pipelined_plans_are_refused_with_the_way_to_the_stages(run_on_ranks):
    for same, init_ok, said, collectives in run_on_ranks(_refusals, 2):
        assert same and init_ok
        assert collectives == 0  # refused before any collective
        for name, msg in said.items():
            assert msg is not None, f"{name} accepted a whole pipelined plan"
            assert "pipeline stages" in msg and "PipelinedPlan" in msg and "PipelineRuntime" in msg, (name, msg)
        assert "plan.stage_plan(stage)" in said["shard"]
