"""sx.auto_plan's pipeline candidate: stacked layers over a "stage" axis, compiled on
abstract values beside replicate/zero1/zero2/fsdp, picked under a budget, trained."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.hlo import collective_bytes, collectives
from shardax.train.auto import candidate_plans, choose

D, L, BATCH, M, STAGES = 64, 4, 16, 4, 4
RULES = [(r"blocks", P("stage"))]
ADAM = optax.adam(1e-3)


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def apply(params, x):
    h = sx.pipeline(layer, params["blocks"], x @ params["embed"], microbatches=M)
    return h @ params["head"]


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def init():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "embed": jax.random.normal(k[0], (4, D)) / 2,
        "blocks": {
            "w": jax.random.normal(k[1], (L, D, D)) / np.sqrt(D),
            "b": jax.random.normal(k[2], (L, D)) / 4,
        },
        "head": jax.random.normal(k[3], (D, 2)) / np.sqrt(D),
    }
    return sx.TrainState.from_params(params, apply, ADAM)


def batches(n=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 4)).astype(np.float32)
    y = rng.normal(size=(BATCH, 2)).astype(np.float32)
    return [{"x": x, "y": y}] * n  # one batch, so the loss must fall


@pytest.fixture(scope="module")
def mesh(stage_mesh):
    """This module's tests run on the pipeline mesh (conftest's ``stage_mesh``)."""
    return stage_mesh


@pytest.fixture(scope="module")
def report(mesh):
    batch = jax.eval_shape(lambda: batches(1)[0])
    return sx.auto_plan(mesh, init, loss_fn=loss_fn, batch=batch, pipeline_rules=RULES, min_size=1)


def test_the_candidate_joins_only_with_a_stage_axis_and_rules(mesh):
    assert "pipeline" not in candidate_plans(mesh)
    plans = candidate_plans(mesh, pipeline_rules=RULES)
    assert list(plans) == ["replicate", "zero1", "zero2", "fsdp", "pipeline"]
    # The stage rules alone: the stacked layers over "stage", the rest replicated (PP × DP).
    specs = plans["pipeline"].specs(jax.eval_shape(init))
    assert specs.params["blocks"]["w"] == P("stage")
    assert specs.opt_state[0].mu["blocks"]["w"] == P("stage")
    assert specs.params["embed"] == P()
    for shape in ({"data": 8}, {"data": 8, "stage": 1}):
        flat = sx.make_mesh(shape)
        message = r"pipeline_rules .* axis 'stage' \(stage_axis\).*axes are \{'data': 8.*drop"
        with pytest.raises(ValueError, match=message):
            candidate_plans(flat, pipeline_rules=RULES)
        with pytest.raises(ValueError, match=r"pipeline_rules .*axes are \{'data': 8"):
            sx.make_train_step(loss_fn, mesh=flat, plan=sx.AutoPlanOptions(pipeline_rules=RULES))
    # sx.rules says first that the regex matches no leaf; auto_plan then refuses
    with (
        pytest.warns(UserWarning, match=r"rules\[0\] \('nothing'.* gives no leaf its spec"),
        pytest.raises(ValueError, match=r"pipeline_rules place no leaf .* over mesh axis 'stage'"),
    ):
        sx.auto_plan(mesh, init, pipeline_rules=[(r"nothing", P("stage"))])


def test_pipeline_is_compiled_and_measured(report):
    by = {c.name: c for c in report.candidates}
    assert list(by) == ["replicate", "zero1", "zero2", "fsdp", "pipeline"]
    pipe = by["pipeline"]
    blocks = 4 * L * (D * D + D)  # bytes of the stacked layers
    rest = 4 * (4 * D + D * 2)
    batch_slice = 4 * BATCH // 2 * (4 + 2)
    # Arguments: params + Adam's two moments, the blocks split 4 ways, the rest whole.
    expected = 3 * (blocks / STAGES + rest) + batch_slice
    assert pipe.argument_bytes == pytest.approx(expected, rel=0.01)
    assert pipe.argument_bytes < min(c.argument_bytes for c in report.candidates[:-1])
    # Activations cross stages with collective-permutes: one per tick of the forward and
    # of the backward schedule, M + S - 1 ticks each (counted through the loops).
    assert pipe.collectives["collective-permute"] == 2 * (M + STAGES - 1)
    assert "all-gather" not in pipe.collectives  # the stage's layers are never gathered
    assert all(c.collectives.get("collective-permute") for c in report.candidates)
    assert pipe.collective_bytes > 0
    assert "'stage' (4) splits the state in pipeline only" in report.reason
    assert "batch split over 'data' only" in report.reason
    assert "pipeline" in str(report)


def test_plan_auto_picks_pipeline_when_only_it_fits_and_trains_like_one_device(report, mesh):
    by = {c.name: c for c in report.candidates}
    others = min(c.total_bytes for c in report.candidates if c.name != "pipeline")
    assert by["pipeline"].total_bytes < others
    budget = (by["pipeline"].total_bytes + others) / 2
    picked = choose(report.candidates, budget, "train step")
    assert picked.name == "pipeline" and "1 of 5 fit" in picked.reason

    options = sx.AutoPlanOptions(pipeline_rules=RULES, device_memory=budget, min_size=1)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=options)
    single = sx.make_train_step(loss_fn, mesh=mesh, mode="single")
    state, ref = init(), init()
    losses, ref_losses = [], []
    for batch in batches():
        state, metrics = step(state, batch)
        ref, ref_metrics = single(ref, batch)
        losses.append(float(metrics["loss"]))
        ref_losses.append(float(ref_metrics["loss"]))
    assert step.auto_report.name == "pipeline" and repr(step).startswith(
        "TrainStep(mode='jit', plan='auto:pipeline'"
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    w = state.params["blocks"]["w"]
    assert w.sharding.spec == P("stage")
    assert {s.data.shape for s in w.addressable_shards} == {(L // STAGES, D, D)}
    assert state.opt_state[0].mu["blocks"]["w"].sharding.spec == P("stage")
    assert state.params["embed"].sharding.spec == P()


def test_hlo_counts_loop_bodies_by_their_trip_count_and_mesh_groups():
    hlo = "\n".join(
        [
            "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
            "  %cp = f32[2,16]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}",
            "  %ar = f32[8]{0} all-reduce(%y), replica_groups=mesh['axis_0'=2,'axis_1'=4], "
            "device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply=%add",
            "}",
            "",
            "%cond (p: (s32[], f32[8])) -> pred[] {",
            "  ROOT %lt = pred[] compare(%i, %n), direction=LT",
            "}",
            "",
            "ENTRY %main (a: f32[8]) -> f32[8] {",
            "  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, "
            'backend_config={"known_trip_count":{"n":"7"}}',
            "  %ag = f32[64]{0} all-gather(%z), replica_groups=mesh['axis_0'=2,'axis_1'=4] "
            "{'axis_1'}, dimensions={0}",
            "}",
        ]
    )
    found = collectives(hlo, num_devices=8)
    assert [(c.op, c.bytes, c.group, c.count) for c in found] == [
        ("collective-permute", 128, 8, 7),
        ("all-reduce", 32, 2, 7),
        ("all-gather", 256, 4, 1),
    ]
    assert collective_bytes(hlo, 8) == pytest.approx(7 * 128 + 7 * 32 + 3 / 4 * 256)
