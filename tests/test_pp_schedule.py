"""Pipeline parallelism as plan data: the pp role, stages, and pipeline schedules as op lists."""

import dataclasses
import json

import pytest

import fsdpfn
from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn._plan.encode import FORMAT_PP
from fsdpfn._plan.stages import Stages, split_stages
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=4, heads=2)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]


@pytest.fixture(scope="module")
def model():
    return GPT(CFG)


# ---- the pp role ----------------------------------------------------------------------------------


def test_pp_role_is_not_data_parallel():
    axes = MeshAxes.from_shape({"pp": 2, "dp": 2, "tp": 2})
    assert axes.roles == (Role.PP, Role.SHARD, Role.TP)
    assert (axes.pp_size, axes.dp_size, axes.grad_ranks, axes.world_size) == (2, 2, 2, 8)
    assert not Role.PP.is_data_parallel


def test_one_dimensional_pp_mesh_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"mesh_dim_names=\('pp', 'dp'\)"):
        MeshAxes.from_shape({"pp": 4})


# ---- stages ---------------------------------------------------------------------------------------


def test_balanced_split_by_parameter_count(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=UNITS)
    assert plan.stages.units == (("embed", "pos", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "norm", "head"))
    assert plan.stages.rank_of(1) == 1 and plan.pp_size == 2


def test_balanced_split_minimises_the_heaviest_stage():
    units = [(n, [n + ".w"]) for n in "abcde"]
    # the only split with no stage heavier than 4; cutting after the first unit that reaches
    # half the total (greedily) would give a | bcde, 5
    st = split_stages(units, 2, numels={"a": 3, "b": 1, "c": 1, "d": 1, "e": 2})
    assert st.units == (("a", "b"), ("c", "d", "e"))
    st = split_stages(units, 2, 4, numels={"a": 1, "b": 1, "c": 1, "d": 1, "e": 4})
    assert max(sum({"a": 1, "b": 1, "c": 1, "d": 1, "e": 4}[u] for u in s) for s in st.units) == 4
    assert st.units[-1] == ("e",) and st.virtual == 2 and st.stages_of(0) == (0, 2)


def test_balanced_split_by_profile_costs(model):
    costs = {u: 1.0 for u in UNITS} | {"head": 10.0}
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=UNITS, stage_costs=costs)
    assert plan.stages.units[1] == ("head",)


def test_split_by_module_names_and_virtual_stages(model):
    split = [["embed", "pos", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "norm", "head"]]
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=UNITS, stages=split)
    assert plan.stages.units[0] == ("embed", "pos", "blocks.0") and plan.stages.virtual == 2
    assert plan.stages.stage_of("head") == 3 and plan.stages.rank_of(3) == 1


def test_stages_round_trip_through_json_with_a_format_bump(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS, stages=4)
    d = json.loads(plan.to_json())
    assert d["format"] == FORMAT_PP and d["stages"]["pp_size"] == 2
    back = fsdpfn.PipelinedPlan.from_json(plan.to_json())
    assert back == plan and back.stages == plan.stages and back.fingerprint == plan.fingerprint
    assert "pipeline stages" in str(plan) and str(plan).startswith("PipelinedPlan ")


def test_old_plans_still_load_unchanged(model):
    plan = fsdpfn.plan(model, (2,))
    d = json.loads(plan.to_json())
    assert d["format"] == 1 and "stages" not in d
    assert fsdpfn.Plan.from_json(plan.to_json()).stages is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, r"root unit holds \['embed.weight'"),
        (
            {"units": UNITS, "stages": [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "norm", "head"]]},
            r"parameter 'pos.weight' \(unit 'pos'\) matches no stage",
        ),
        (
            {"stages": [["embed", "pos", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "norm", "head"]]},
            r"unit '<root>' has parameters in 2 stages \('embed.weight' in stage 0, 'norm.weight' in stage 1\)",
        ),
        (
            {
                "units": UNITS,
                "stages": [
                    ["embed", "pos", "blocks.0.norm1", "blocks.0.qkv", "blocks.0.proj"],
                    [
                        "blocks.0.norm2",
                        "blocks.0.fc",
                        "blocks.0.out",
                        "blocks.1",
                        "blocks.2",
                        "blocks.3",
                        "norm",
                        "head",
                    ],
                ],
            },
            r"unit 'blocks.0' has parameters in 2 stages .*put all of 'blocks.0' in one stage",
        ),
        (
            {"units": UNITS, "stages": [["embed", "pos", "blocks"], ["blocks.3", "norm", "head"]]},
            r"parameter 'blocks.3.norm1.weight' matches prefixes of stages \[0, 1\]",
        ),
        (
            {
                "units": UNITS,
                "stages": [["blocks.2", "embed", "pos"], ["blocks.0", "blocks.1", "blocks.3", "norm", "head"]],
            },
            r"stage 0 holds unit 'blocks.2', which runs after stage 1's unit 'blocks.0'",
        ),
        (
            {"units": UNITS, "stages": [["embed", "pos", "blocks", "nothing"], ["norm", "head"]]},
            r"stage 0's prefix 'nothing' names no parameter",
        ),
        ({"units": UNITS, "stages": 3}, r"positive multiple of the pp size 2"),
        ({"units": UNITS, "stages": [["embed", "pos", "blocks", "norm", "head"]]}, r"lists 1 stages for 2 pp ranks"),
        ({"units": UNITS, "stages": 12}, r"12 stages need at least 12 units"),
    ],
)
def test_bad_splits_name_the_module_or_stage(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, **kwargs)


def test_stages_without_a_pp_axis_are_refused(model):
    with pytest.raises(ValueError, match="has no 'pp' axis.*fsdpfn.plan"):
        fsdpfn.pipeline_plan(model, (2,), units=UNITS, stages=2)
    with pytest.raises(TypeError, match="stages"):
        fsdpfn.plan(model, {"pp": 2, "dp": 1}, units=UNITS, stages=2)  # type: ignore[call-arg]


def test_a_pipelined_plan_is_its_own_type(model):
    """A pipelined plan is a ``PipelinedPlan``, never a ``Plan``: the builders, the JSON readers
    and the constructors each refuse the other kind by name; its stages' plans are ``Plan``s."""
    for mesh in ({"pp": 2, "dp": 1}, {"dp": 2, "pp": 2}, {"pp": 2, "dp": 2, "tp": 1}):
        with pytest.raises(ValueError, match=r"has a pipeline axis.*fsdpfn.pipeline_plan\(model, mesh"):
            fsdpfn.plan(model, mesh, units=UNITS)
    with pytest.raises(ValueError, match=r"has a pipeline axis.*fsdpfn.pipeline_plan"):  # the role, whatever the name
        fsdpfn.plan(model, {"stage": 2, "dp": 1}, units=UNITS, axes={"stage": "pp"})
    pp = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS)
    assert isinstance(pp, fsdpfn.PipelinedPlan) and not isinstance(pp, fsdpfn.Plan)
    stages = [pp.stage_plan(s) for s in range(pp.stages.num_stages)]
    assert all(type(s) is fsdpfn.Plan and s.stages is None for s in stages)
    with pytest.raises(ValueError, match=r"is a fsdpfn.PipelinedPlan, not a fsdpfn.Plan.*PipelinedPlan.from_json"):
        fsdpfn.Plan.from_json(pp.to_json())
    with pytest.raises(ValueError, match=r"a PipelinedPlan needs stages.*fsdpfn.Plan.from_json"):
        fsdpfn.PipelinedPlan.from_json(stages[0].to_json())
    with pytest.raises(ValueError, match=r"a PipelinedPlan needs stages"):
        fsdpfn.PipelinedPlan.from_json(fsdpfn.plan(model, (2,)).to_json())
    fields = {f.name: getattr(pp, f.name) for f in dataclasses.fields(pp)}
    with pytest.raises(ValueError, match=r"is a fsdpfn.PipelinedPlan, not a fsdpfn.Plan"):
        fsdpfn.Plan(**fields)  # the values of one kind under the other's class
    assert fsdpfn.PipelinedPlan(**fields) == pp
    assert fsdpfn.PipelinedPlan.from_json(pp.to_json()).bind(None) == pp


def test_stages_value_checks_itself():
    with pytest.raises(ValueError, match="unit 'a' is in stage 0 and stage 1"):
        Stages((("a",), ("a",)), 2)
    with pytest.raises(ValueError, match="3 stages over 2 pp ranks"):
        Stages((("a",), ("b",), ("c",)), 2)


# ---- pipeline schedules ---------------------------------------------------------------------------


from fsdpfn._plan.pipeline import PipelineSchedule, PipeOp, pipeline_schedule, validate_pipeline  # noqa: E402
from fsdpfn.sim import pipeline_times  # noqa: E402
from fsdpfn._plan.schedule import Op, OpKind, ScheduleError  # noqa: E402


def _stages(p: int, v: int = 1) -> Stages:
    return Stages(tuple((f"u{s}",) for s in range(p * v)), p)


def _edit(ps: PipelineSchedule, rank: int, ops) -> PipelineSchedule:
    ranks = list(ps.ranks)
    ranks[rank] = tuple(ops)
    return dataclasses.replace(ps, ranks=tuple(ranks))


def _parsed(ps: PipelineSchedule, rank: int, lines: str) -> PipelineSchedule:
    """``ps`` with rank ``rank``'s list replaced by ``lines`` written as text, the way a user edits it."""
    text = str(ps).split(f"rank {rank}:")
    rest = text[1].split(f"rank {rank + 1}:")
    tail = f"rank {rank + 1}:{rest[1]}" if len(rest) > 1 else ""
    return PipelineSchedule.from_str(f"{text[0]}rank {rank}:\n{lines}\n{tail}")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_bubble_matches_its_formula(name, p, m):
    ps = pipeline_schedule(_stages(p), name, m)
    validate_pipeline(ps)
    t = pipeline_times(ps, forward=1.0, backward=2.0)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert t.makespan == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 8), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaved_bubble_is_v_times_smaller(p, v, m):
    ps = pipeline_schedule(_stages(p, v), "interleaved_1f1b", m)
    validate_pipeline(ps)
    # a virtual stage holds 1 / v of a rank's layers, so it computes 1 / v as long
    t = pipeline_times(ps, forward=1.0 / v, backward=2.0 / v)
    assert t.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert t.bubble < pipeline_times(pipeline_schedule(_stages(p), "1f1b", m)).bubble


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 2)])
def test_activations_kept_at_once(p, m):
    assert pipeline_times(pipeline_schedule(_stages(p), "1f1b", m)).in_flight == tuple(min(p - r, m) for r in range(p))
    assert pipeline_times(pipeline_schedule(_stages(p), "gpipe", m)).in_flight == (m,) * p
    assert pipeline_times(pipeline_schedule(_stages(p, 2), "gpipe", m)).in_flight == (2 * m,) * p


@pytest.mark.parametrize("name, stages", [("gpipe", 2), ("1f1b", 2), ("interleaved_1f1b", 4), ("gpipe", 4)])
def test_plan_schedules_carry_fsdp_actions_and_round_trip(model, name, stages):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS, stages=stages)
    ps = pipeline_schedule(plan, name, 4)
    validate_pipeline(ps, plan)
    assert PipelineSchedule.from_str(str(ps)) == ps
    for r, ops in enumerate(ps.ranks):
        mine = [u for s in plan.stages.stages_of(r) for u in plan.stages.units[s]]
        for u in mine:  # every unit of the rank's stages: gathered before it computes, reduced once after
            kinds = [op.kind for op in ops if isinstance(op, Op) and op.unit == u]
            assert kinds.count(OpKind.GATHER) == 1 and kinds.count(OpKind.REDUCE) == 1 and kinds.count(OpKind.FREE) == 1
        first_compute = next(i for i, op in enumerate(ops) if isinstance(op, PipeOp) and op.kind.is_compute)
        assert all(Op(OpKind.WAIT, u) in ops[:first_compute] for u in plan.stages.units[plan.stages.stages_of(r)[0]])


def test_print_shows_peers_and_parses_with_or_without_numbers():
    ps = pipeline_schedule(_stages(2), "1f1b", 2)
    text = str(ps)
    assert "send_act s0 m0  # to rank 1" in text and "recv_grad s0 m0  # from rank 1" in text
    bare = "\n".join(
        ln.split("#")[0].strip().split(maxsplit=1)[-1] if ln.strip()[:1].isdigit() else ln for ln in text.splitlines()
    )
    assert PipelineSchedule.from_str(bare) == ps


def test_deadlock_is_refused_naming_each_waiting_op():
    ps = pipeline_schedule(_stages(2), "gpipe", 2)
    # rank 0 waits for a gradient before sending the activation that gradient needs
    edited = _parsed(
        ps,
        0,
        """
        recv_grad s0 m0
        stage_forward s0 m0
        send_act s0 m0
        stage_forward s0 m1
        send_act s0 m1
        stage_backward s0 m0
        recv_grad s0 m1
        stage_backward s0 m1""",
    )
    with pytest.raises(
        ScheduleError,
        match=r"deadlock.*rank 0 op #0 \(recv_grad s0 m0\) waits for rank 1's op #5 \(send_grad s1 m0\)"
        r".*rank 1 op #0 \(recv_act s1 m0\) waits for rank 0's op #2 \(send_act s0 m0\)",
    ):
        validate_pipeline(edited)


def test_recv_with_no_matching_send_is_refused():
    ps = pipeline_schedule(_stages(2), "1f1b", 2)
    ops = [op for op in ps.ranks[0] if op != PipeOp("send_act", 0, 1)]
    with pytest.raises(
        ScheduleError, match=r"rank 1 op #\d+ \(recv_act s1 m1\): has no matching send: rank 0 sends rank 1 only 1"
    ):
        validate_pipeline(_edit(ps, 0, ops))


def test_sends_received_out_of_order_are_refused():
    ps = pipeline_schedule(_stages(2), "gpipe", 2)
    r0 = list(ps.ranks[0])
    r0[1], r0[3] = r0[3], r0[1]  # send m1 before m0: ... and m1's send before it is computed
    r0 = [
        PipeOp("stage_forward", 0, 0),
        PipeOp("stage_forward", 0, 1),
        PipeOp("send_act", 0, 1),
        PipeOp("send_act", 0, 0),
    ] + r0[4:]
    with pytest.raises(
        ScheduleError, match=r"rank 1 op #0 \(recv_act s1 m0\): would receive rank 0's op #2 \(send_act s0 m1\)"
    ):
        validate_pipeline(_edit(ps, 0, r0))


def test_activation_used_before_it_arrives_is_refused():
    ps = pipeline_schedule(_stages(2), "gpipe", 2)
    r1 = list(ps.ranks[1])
    r1[0], r1[1] = r1[1], r1[0]  # forward, then receive its input
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 op #0 \(stage_forward s1 m0\): uses the activation of micro-batch 0 before "
        r"it arrives; put 'recv_act s1 m0' before it",
    ):
        validate_pipeline(_edit(ps, 1, r1))


def test_gradient_used_before_it_arrives_is_refused():
    ps = pipeline_schedule(_stages(2), "1f1b", 2)
    r0 = [op for op in ps.ranks[0] if op != PipeOp("recv_grad", 0, 1)] + [PipeOp("recv_grad", 0, 1)]
    with pytest.raises(
        ScheduleError, match=r"rank 0 op #\d+ \(stage_backward s0 m1\): uses the gradient of micro-batch 1"
    ):
        validate_pipeline(_edit(ps, 0, r0))


def test_an_earlier_send_is_a_valid_edit():
    ps = pipeline_schedule(_stages(2), "gpipe", 4)
    # rank 0 runs all four forwards, then sends all four activations: valid, but rank 1 starts later
    late = _parsed(
        ps,
        0,
        "\n".join(
            [f"stage_forward s0 m{i}" for i in range(4)]
            + [f"send_act s0 m{i}" for i in range(4)]
            + [f"recv_grad s0 m{i}\nstage_backward s0 m{i}" for i in range(4)]
        ),
    )
    validate_pipeline(late)
    # the edit: each send moved earlier, right after its forward (the generated order): the step gets shorter
    early = _parsed(
        ps,
        0,
        "\n".join(
            [f"stage_forward s0 m{i}\nsend_act s0 m{i}" for i in range(4)]
            + [f"recv_grad s0 m{i}\nstage_backward s0 m{i}" for i in range(4)]
        ),
    )
    validate_pipeline(early)
    assert pipeline_times(early).makespan < pipeline_times(late).makespan
    assert early == ps


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda ops: [op for op in ops if op != Op("wait", "blocks.0")],
            r"rank 0 op #\d+ \(stage_forward s0 m0\): stage 0's unit 'blocks.0' is not gathered",
        ),
        (
            lambda ops: [Op("reduce", "embed")] + list(ops),
            r"rank 0 op #0 \(reduce embed\): 'reduce embed' before its gradients are complete; they are complete "
            r"after its stage's last backward \(0 of 4",
        ),
        (lambda ops: [op for op in ops if op != Op("free", "pos")], r"rank 0: unit 'pos' is still unsharded"),
        (
            lambda ops: [op for op in ops if op.kind is not OpKind.WAIT_REDUCE or op.unit != "embed"],
            r"rank 0: 'wait_reduce embed' is missing",
        ),
        (
            lambda ops: [Op("gather", "head")] + list(ops),
            r"rank 0 op #0 \(gather head\): unit 'head' is in stage 1, on rank 1",
        ),
        (lambda ops: [Op("forward", "embed")] + list(ops), r"per-unit events have no place"),
        (
            lambda ops: [op for op in ops if op != PipeOp("stage_backward", 0, 3)],
            r"\(reduce blocks.1\): .* after its stage's last backward \(3 of 4 micro-batches done\)",
        ),
        (
            lambda ops: [PipeOp("stage_forward", 1, 0)] + list(ops),
            r"rank 0 op #0 \(stage_forward s1 m0\): stage 1 runs on rank 1",
        ),
        (
            lambda ops: [PipeOp("stage_forward", 0, 9)] + list(ops),
            r"rank 0 op #0 \(stage_forward s0 m9\): stage 0 / micro-batch 9 out of range \(stages 0..1, "
            r"micro-batches 0..3\)",
        ),
        (
            lambda ops: [PipeOp("recv_act", 0, 0)] + list(ops),
            r"rank 0 op #0 \(recv_act s0 m0\): stage 0 has no previous stage to talk to; remove the op",
        ),
        (
            lambda ops: [PipeOp("stage_backward", 0, 0)] + [op for op in ops if op != PipeOp("stage_backward", 0, 0)],
            r"rank 0 op #0 \(stage_backward s0 m0\): runs before 'stage_forward s0 m0'; a backward follows its forward",
        ),
        (
            lambda ops: [Op("gather", "blocks")] + list(ops),
            r"rank 0 op #0 \(gather blocks\): unit 'blocks' is not in the plan's stages; units: embed, pos, blocks.0",
        ),
    ],
)
def test_plan_schedule_edits_are_refused_naming_the_op(model, edit, message):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS)
    ps = pipeline_schedule(plan, "1f1b", 4)
    with pytest.raises(ScheduleError, match=message):
        validate_pipeline(_edit(ps, 0, edit(ps.ranks[0])), plan)


def test_stages_on_one_rank_pass_data_in_memory_not_by_transfers():
    ps = pipeline_schedule(_stages(1, 2), "interleaved_1f1b", 2)
    with pytest.raises(
        ScheduleError,
        match=r"rank 0 op #0 \(send_act s0 m0\): stages 0 and 1 are both on rank 0: they pass data in memory",
    ):
        validate_pipeline(_edit(ps, 0, [PipeOp("send_act", 0, 0), *ps.ranks[0]]))


def test_fsdp_actions_need_a_schedule_made_for_a_plan():
    ps = pipeline_schedule(_stages(2), "gpipe", 2)
    with pytest.raises(
        ScheduleError, match=r"rank 0 op #0 \(gather u0\): FSDP actions need a schedule made for a plan"
    ):
        validate_pipeline(_edit(ps, 0, [Op("gather", "u0"), *ps.ranks[0]]))


def test_a_missing_backward_is_refused():
    ps = pipeline_schedule(_stages(2), "gpipe", 2)
    r0 = [op for op in ps.ranks[0] if op not in (PipeOp("stage_backward", 0, 1), PipeOp("recv_grad", 0, 1))]
    r1 = [op for op in ps.ranks[1] if op != PipeOp("send_grad", 1, 1)]
    with pytest.raises(ScheduleError, match=r"rank 0 never runs 'stage_backward s0 m1'"):
        validate_pipeline(_edit(_edit(ps, 0, r0), 1, r1))


def test_schedule_for_another_plan_is_refused(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS)
    other = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 1}, units=UNITS)
    with pytest.raises(ScheduleError, match="made for plan"):
        validate_pipeline(pipeline_schedule(plan, "gpipe", 2), other)


@pytest.mark.parametrize(
    "args, message",
    [
        ((_stages(2, 2), "1f1b", 4), r"1f1b runs one stage per pp rank.*use 'interleaved_1f1b'"),
        ((_stages(2, 2), "interleaved_1f1b", 3), r"micro_batches=3 is not a multiple of 2. Use micro_batches=4"),
        ((_stages(2), "zb", 4), r"unknown pipeline schedule 'zb'"),
        ((_stages(2), "gpipe", 0), r"micro_batches must be an int >= 1"),
    ],
)
def test_generator_refuses_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        pipeline_schedule(*args)


def test_parse_errors_name_the_line():
    with pytest.raises(ScheduleError, match=r"line 3: cannot parse 'stage_forward s0'"):
        PipelineSchedule.from_str(
            "Pipeline schedule x for plan - (pp=1, stages=1, micro_batches=1):\nrank 0:\nstage_forward s0"
        )
    with pytest.raises(ScheduleError, match=r"unknown pipeline op kind 'stage_fwd'"):
        PipelineSchedule.from_str(
            "Pipeline schedule x for plan - (pp=1, stages=1, micro_batches=1):\nrank 0:\nstage_fwd s0 m0"
        )


# ---- a stage's plan -------------------------------------------------------------------------------


def test_stage_plan_holds_its_units_on_the_mesh_without_pp(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2, "tp": 1}, units=UNITS, stages=4)
    s2 = plan.stage_plan(2)
    assert [u.name for u in s2.units] == list(plan.stages.units[2])
    assert s2.axes.roles == (Role.SHARD, Role.TP) and s2.stages is None and s2.pp_stage == (2, 2)
    assert s2.mesh is None  # a shape plan stays unbound
    back = fsdpfn.Plan.from_json(s2.to_json())
    assert back == s2 and json.loads(s2.to_json())["pp_stage"] == [2, 2]
    assert s2.fingerprint != plan.stage_plan(1).fingerprint
    with pytest.raises(ValueError, match=r"stage 4 is not a stage of the plan; its stages are 0..3"):
        plan.stage_plan(4)
    assert not hasattr(fsdpfn.plan(model, (2,)), "stage_plan")  # a Plan is one stage


def test_a_pipelined_plan_has_no_single_step_schedule(model):
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS)
    with pytest.raises(ValueError, match=r"its step is a pipeline schedule, fsdpfn.pipeline_schedule\(plan"):
        fsdpfn.runtime.schedule(plan)
    assert not hasattr(plan, "cost")  # its step is priced by fsdpfn.sim.simulate_pipeline
    assert plan.stage_plan(0).cost().collectives  # a stage costs as any plan


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda ops: [op for op in ops if op != Op("copy_in", "embed")],
            r"rank 0 op #\d+ \(gather embed\): unit 'embed' is offloaded: its shards are in host memory; "
            r"add 'copy_in embed'",
        ),
        (
            lambda ops: [op for op in ops if op != Op("copy_out", "embed")],
            r"rank 0: 'copy_out embed' is missing after 'wait_reduce embed'",
        ),
        (
            lambda ops: [Op("copy_in", "pos")] + list(ops),
            r"rank 0 op #0 \(copy_in pos\): unit 'pos' is not offloaded",
        ),
        (lambda ops: [op for op in ops if op != Op("free", "pos")], r"rank 0: unit 'pos' is still unsharded"),
    ],
)
def test_a_pipeline_is_checked_by_the_single_stage_rules_of_its_units(model, edit, message):
    """The rules of a unit's actions (gather, wait, free, reduce, the offloaded unit's copies in
    and out) are one table, which the single-stage and the pipelined validators both read: an
    offloaded unit's copies are checked on a pipeline as on one stage."""
    plan = fsdpfn.pipeline_plan(model, {"pp": 2, "dp": 2}, units=UNITS, offload={"embed": True})
    ps = pipeline_schedule(plan, "1f1b", 4)
    validate_pipeline(ps, plan)
    with pytest.raises(ScheduleError, match=message):
        validate_pipeline(_edit(ps, 0, edit(ps.ranks[0])), plan)
