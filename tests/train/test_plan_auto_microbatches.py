"""sx.auto_plan over plans × model variants (remat) × microbatch counts, on the 8 CPU
devices: each candidate is the step make_train_step would compile, the pick follows the
budget, and bad counts are refused by name."""

import jax
import jax.numpy as jnp
import optax
import pytest
from test_plan_training import mlp_apply, mlp_init, model_loss

import shardax as sx
from shardax.train.auto import choose

SIZES = (16, 256, 256, 8)
ROWS = 8192


def init(remat="none"):
    apply = mlp_apply if remat == "none" else sx.remat(mlp_apply, policy=remat)
    return sx.TrainState.from_params(mlp_init(jax.random.key(0), SIZES), apply, optax.sgd(0.1))


BATCH = {
    "x": jax.ShapeDtypeStruct((ROWS, SIZES[0]), jnp.float32),
    "y": jax.ShapeDtypeStruct((ROWS, SIZES[-1]), jnp.float32),
}


@pytest.fixture(scope="module")
def report():
    mesh = sx.make_mesh({"data": 8})
    variants = {"none": init, "full": lambda: init("full")}
    return sx.auto_plan(mesh, variants, loss_fn=model_loss, batch=BATCH,
                        candidates={"replicate": "replicate", "fsdp": "fsdp"},
                        accumulate=(2, 1), min_size=256)  # fmt: skip


def test_every_plan_variant_and_count_is_a_candidate_measured_as_the_step(report):
    names = [c.name for c in report.candidates]
    assert names == [f"{p}·{v}·mb{k}" for p in ("replicate", "fsdp")
                     for v in ("none", "full") for k in (1, 2)]  # fmt: skip
    by = {c.name: c for c in report.candidates}
    assert [by[n].accumulate for n in names] == [1, 2] * 4
    assert by["fsdp·full·mb2"].variant == "full" and not any(c.skipped for c in by.values())
    # A candidate's figures are those of the step make_train_step compiles with its count.
    mesh = report.plan.mesh
    step = sx.make_train_step(model_loss, mesh=mesh, plan=sx.fsdp(mesh, min_size=256),
                              accumulate=2)  # fmt: skip
    m = step.lower(step.abstract(jax.eval_shape(init)), BATCH).compile().memory_analysis()
    assert by["fsdp·none·mb2"].temp_bytes == m.temp_size_in_bytes
    assert by["fsdp·none·mb2"].argument_bytes == m.argument_size_in_bytes
    # Halving the microbatch shrinks the activations; fsdp holds 1/8 of replicate's state.
    for p in ("replicate", "fsdp"):
        assert by[f"{p}·none·mb2"].temp_bytes < by[f"{p}·none·mb1"].temp_bytes
    assert by["fsdp·none·mb1"].argument_bytes < by["replicate·none·mb1"].argument_bytes / 2
    # No budget on CPU: least communication, ties to fewer microbatches.
    assert report.accumulate == 1 and report.name.endswith("mb1")
    assert report.name in str(report) and report.to_dict()["accumulate"] == 1


def test_a_budget_between_the_counts_picks_the_microbatched_candidate(report):
    by = {c.name: c for c in report.candidates}
    mb1, mb2 = by["replicate·none·mb1"], by["replicate·none·mb2"]
    budget = (mb1.total_bytes + mb2.total_bytes) / 2
    picked = choose(report.candidates, budget, "train step")
    fits = {c.name: c.fits for c in picked.candidates}
    assert fits["replicate·none·mb1"] is False and fits["replicate·none·mb2"] is True
    assert picked.candidate.total_bytes <= budget and picked.name in fits
    assert picked.accumulate == picked.candidate.accumulate
    assert picked.reasons()[picked.name] == "picked"
    assert "does not fit" in picked.reasons()["replicate·none·mb1"]


def test_one_count_keeps_the_plain_names():
    mesh = sx.make_mesh({"data": 8})
    r = sx.auto_plan(mesh, init, loss_fn=model_loss, batch=BATCH, accumulate=2,
                     candidates={"fsdp": "fsdp"}, min_size=256)  # fmt: skip
    assert [c.name for c in r.candidates] == ["fsdp"] and r.accumulate == 2


@pytest.mark.parametrize(
    ("accumulate", "match"),
    [
        ((1, 3), r"accumulate=\(1, 3\): each count must split the batch's 8192 rows .* "
                 r"data axis 'data' of size 8 .*; 3 does not \(8192 % 24 = 8\)"),
        ((1, 2048), r"accumulate=\(1, 2048\): .*2048 does not \(8192 % 16384 = 8192\)"),
        ((), "accumulate is an empty sequence"),
        ((1, True), r"accumulate\[1\] must be"),
        (1.5, r"accumulate \(a count, or a sequence of counts\) must be"),
    ],
)  # fmt: skip
def test_a_bad_count_is_refused_by_name_before_compiling(accumulate, match):
    mesh = sx.make_mesh({"data": 8})
    with pytest.raises(ValueError, match=f"^sx.auto_plan: {match}"):
        sx.auto_plan(mesh, init, loss_fn=model_loss, batch=BATCH, accumulate=accumulate)


def test_bad_variants_are_refused_by_name():
    mesh = sx.make_mesh({"data": 8})
    with pytest.raises(ValueError, match=r"abstract_state_or_init\['x'\] must be a shardax"):
        sx.auto_plan(mesh, {"x": 3}, loss_fn=model_loss, batch=BATCH)
    with pytest.raises(ValueError, match="abstract_state_or_init is an empty mapping"):
        sx.auto_plan(mesh, {}, loss_fn=model_loss, batch=BATCH)
    with pytest.raises(ValueError, match=r"accumulate=\(1, 2\) ranks microbatch counts"):
        sx.auto_plan(mesh, init, accumulate=(1, 2))


def test_a_seq_axis_step_lowers_for_an_abstract_batch():
    """The context candidates of `shardax plan --target` lower a seq_axis step for
    ShapeDtypeStructs: the batch is typed with the (data, context) sharding, not put."""
    mesh = sx.make_mesh({"data": 4, "context": 2})
    step = sx.make_train_step(model_loss, mesh=mesh, seq_axis="context")
    batch = {"x": jax.ShapeDtypeStruct((8, 2, 16), jnp.float32),
             "y": jax.ShapeDtypeStruct((8, 2, 8), jnp.float32)}  # fmt: skip
    compiled = step.lower(step.abstract(jax.eval_shape(init)), batch).compile()
    x_sharding = compiled.input_shardings[0][1]["x"]
    assert x_sharding.spec == jax.sharding.PartitionSpec("data", "context")


def test_candidates_compile_the_configs_step_seq_axis_and_all():
    """With config= (as plan='auto' passes its own), each candidate is the step that
    config makes with the candidate's plan: here the batch's sequence split over
    'context' halves the batch bytes each device holds."""
    mesh = sx.make_mesh({"data": 4, "context": 2})
    batch = {"x": jax.ShapeDtypeStruct((8, 2, 16), jnp.float32),
             "y": jax.ShapeDtypeStruct((8, 2, 8), jnp.float32)}  # fmt: skip
    config = sx.train.StepConfig(mesh=mesh, seq_axis="context", stats=("grad_norm",))
    kw = {"loss_fn": model_loss, "batch": batch, "candidates": {"fsdp": "fsdp"}, "min_size": 256}
    with_config = sx.auto_plan(mesh, init, config=config, **kw).candidate
    plain = sx.auto_plan(mesh, init, **kw).candidate
    step = sx.make_train_step(model_loss, mesh=mesh, plan=sx.fsdp(mesh, min_size=256),
                              seq_axis="context", stats=("grad_norm",))  # fmt: skip
    m = step.lower(step.abstract(jax.eval_shape(init)), batch).compile().memory_analysis()
    assert with_config.argument_bytes == m.argument_size_in_bytes
    batch_bytes = (8 * 2 * 16 + 8 * 2 * 8) * 4
    assert plain.argument_bytes - with_config.argument_bytes == batch_bytes // 4 - batch_bytes // 8
    # plan="auto" hands the step's whole config over: the pick's figures are its step's.
    auto = sx.make_train_step(model_loss, mesh=mesh, plan="auto", seq_axis="context")
    state = jax.eval_shape(init)
    picked = auto.pick(state, batch)
    assert picked.config.seq_axis == "context"
    m = picked.lower(picked.abstract(state), batch).compile().memory_analysis()
    assert auto.auto_report.candidate.argument_bytes == m.argument_size_in_bytes


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"axis": "data"}, TypeError, "config or as keywords, not both; got config and axis"),
        ({"precision": "bf16"}, TypeError, "not both; got config and precision"),
        ({"config": "fsdp"}, TypeError, "config must be a sx.train.StepConfig or None, got str"),
        ({"plan": "fsdp"}, ValueError, "config.plan is 'fsdp', but auto_plan picks the plan"),
        ({"mode": "shard_map"}, ValueError, "only mode='jit' runs; got config.mode='shard_map'"),
        ({"mesh": {"data": 4}}, ValueError, r"config is over mesh \{'data': 4\}, not auto_plan's"),
    ],
)  # fmt: skip
def test_a_config_that_cannot_be_the_auto_step_is_refused_by_name(change, error, match):
    mesh = sx.make_mesh({"data": 8})
    settings = {"mesh": mesh}
    if "plan" in change:
        settings["plan"] = sx.fsdp(mesh)
    if "mode" in change:
        settings["mode"] = change["mode"]
    if "mesh" in change:
        settings["mesh"] = sx.make_mesh(change["mesh"], devices=jax.devices()[:4])
    kw = {k: v for k, v in change.items() if k in ("axis", "precision", "config")}
    kw.setdefault("config", sx.train.StepConfig(**settings))
    with pytest.raises(error, match=match):
        sx.auto_plan(mesh, init, loss_fn=model_loss, batch=BATCH, **kw)
