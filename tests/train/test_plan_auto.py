"""sx.auto_plan and make_train_step(plan="auto"): candidates compiled on abstract values."""

import jax
import optax
import pytest
from test_plan_training import (
    assert_same_training,
    batches,
    mlp_apply,
    mlp_init,
    mlp_loss,
    model_loss,
    train_sharded,
    train_single,
)

import shardax as sx
from shardax.train.auto import choose

SIZES = (16, 256, 256, 8)
ADAM = optax.adam(1e-2)


def init():
    return sx.TrainState.from_params(mlp_init(jax.random.key(0), SIZES), mlp_apply, ADAM)


@pytest.fixture(scope="module")
def report():
    mesh = sx.make_mesh({"data": 8})
    batch = jax.eval_shape(lambda: batches(SIZES, n=1)[0])
    return sx.auto_plan(mesh, init, loss_fn=model_loss, batch=batch, min_size=256)


def test_candidates_are_compiled_and_measured(report):
    by = {c.name: c for c in report.candidates}
    assert list(by) == ["replicate", "zero1", "zero2", "fsdp"]
    params = sum(x.size * 4 for x in jax.tree.leaves(jax.eval_shape(init).params))
    batch_slice = 32 * (16 + 8) * 4 // 8  # this device's rows of x and y
    # Arguments: the state (+ the batch's slice); replicate holds params + Adam's 2 moments.
    assert by["replicate"].argument_bytes == pytest.approx(3 * params, rel=0.02)
    assert by["zero1"].argument_bytes == pytest.approx(params + 2 * params / 8, rel=0.02)
    assert by["fsdp"].argument_bytes == pytest.approx(3 * params / 8, rel=0.05)
    # zero1's optimizer state per device, from memory_analysis: 1/8 of replicate's.
    opt_zero1 = by["zero1"].argument_bytes - params - batch_slice
    opt_replicate = by["replicate"].argument_bytes - params - batch_slice
    assert opt_replicate == pytest.approx(2 * params, rel=0.01)
    assert opt_zero1 / opt_replicate <= 0.14
    assert by["replicate"].collectives == {"all-reduce": 1}
    assert by["zero1"].collectives["all-gather"] >= 1  # the updated params, gathered
    assert by["replicate"].collective_bytes < by["zero1"].collective_bytes
    # Nothing was allocated: the state never existed outside eval_shape.
    assert report.compiled == "train step" and report.device_memory is None
    assert report.candidates[0].fits is None and "no device memory figure" in report.reason
    least = min(c.collective_bytes for c in report.candidates)
    assert next(c for c in report.candidates if c.plan is report.plan).collective_bytes == least
    text = str(report)
    assert "zero2" in text and f"pick: {report.name}" in text


def test_zero2_constrains_gradients_and_what_xla_cpu_emits(report):
    by = {c.name: c for c in report.candidates}
    z1, z2 = by["zero1"], by["zero2"]
    # XLA:CPU has no reduce-scatter pass: both all-reduce the gradients, then each device
    # updates its slice and all-gathers the new params; zero2's temporaries are no larger.
    for c in (z1, z2):
        assert c.collectives.get("all-reduce", 0) >= 1 and c.collectives.get("all-gather", 0) >= 1
        assert "reduce-scatter" not in c.collectives
    assert z2.temp_bytes <= z1.temp_bytes
    assert z2.argument_bytes == z1.argument_bytes


def test_budget_keeps_only_what_fits(report):
    by = {c.name: c for c in report.candidates}
    budget = (by["replicate"].total_bytes + by["zero1"].total_bytes) / 2
    picked = choose(report.candidates, budget, "train step")
    fits = {c.name: c.fits for c in picked.candidates}
    assert fits == {"replicate": False, "zero1": True, "zero2": True, "fsdp": True}
    assert picked.name != "replicate" and "3 of 4 fit" in picked.reason
    assert picked.to_dict()["pick"] == picked.name


def test_fits_nowhere_names_the_smallest_and_the_budget(report):
    smallest = min(report.candidates, key=lambda c: c.total_bytes)
    with pytest.raises(ValueError, match=f"no plan fits device_memory .*1000 bytes.*"
                       f"{smallest.name!r}, needs .*{smallest.total_bytes} bytes"):  # fmt: skip
        choose(report.candidates, 1000, "train step")


def test_update_only_without_loss_fn():
    mesh = sx.make_mesh({"data": 8})
    candidates = {
        "replicate": sx.plan.follow_params(sx.replicate(mesh)),
        "zero1": sx.zero1(mesh, min_size=256),
    }
    report = sx.auto_plan(mesh, jax.eval_shape(init), device_memory=1e9, candidates=candidates)
    assert report.compiled == "optimizer update"
    by = {c.name: c for c in report.candidates}
    assert by["zero1"].collectives.get("all-gather", 0) >= 1
    assert by["replicate"].collective_bytes == 0 and all(c.fits for c in report.candidates)


def test_plan_auto_trains_like_single_device():
    mesh = sx.make_mesh({"data": 8})
    step = sx.make_train_step(model_loss, mesh=mesh, plan="auto")
    with pytest.raises(ValueError, match=r"plan='auto' .* step.shard\(state\) has no batch"):
        step.shard(init())
    data = batches(SIZES, n=3)
    single = train_single(mlp_loss, mlp_init(jax.random.key(0), SIZES), data, ADAM)
    sharded = train_sharded(step, init(), data)
    assert step.auto_report is not None and step.plan is step.auto_report.plan
    assert repr(step).startswith("TrainStep(mode='jit', plan='auto:")
    assert_same_training(single, sharded)


def test_bad_input():
    mesh = sx.make_mesh({"data": 8})
    with pytest.raises(ValueError, match="so abstract values can be built; got int"):
        sx.auto_plan(mesh, 42)
    with pytest.raises(ValueError, match="pass loss_fn and batch together"):
        sx.auto_plan(mesh, init, loss_fn=model_loss)
    with pytest.raises(ValueError, match=r"plan='auto' .* only mode='jit'"):
        sx.make_train_step(model_loss, mesh=mesh, plan="auto", mode="shard_map")
    step = sx.make_train_step(model_loss, mesh=mesh, plan="auto")
    with pytest.raises(ValueError, match=r"step.init\(...\) has no batch"):
        step.init(init)


def test_hlo_collectives_and_the_ring_model():
    from shardax.cost.hlo import collective_bytes, collectives

    hlo = "\n".join(
        [
            "%a = (f32[256,64]{1,0}, f32[]) all-reduce(%x, %y), replica_groups={}, to_apply=%add",
            "%b = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %p), replica_groups=[2,4]<=[8]",
            "%c = bf16[8]{0} reduce-scatter(bf16[32]{0} %g), replica_groups={{0,1,2,3},{4,5,6,7}}",
            "%d = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(f32[8,16]{1,0} %q), "
            "replica_groups=[1,4]<=[4]",
            "%e = f32[32,16]{1,0} all-gather-done(%d)",
            "%f = s32[10]{0} collective-permute(s32[10]{0} %r), source_target_pairs={{0,1}}",
        ]
    )
    found = collectives(hlo, num_devices=8)
    assert [(c.op, c.bytes, c.group) for c in found] == [
        ("all-reduce", (256 * 64 + 1) * 4, 8),
        ("all-gather", 64 * 16 * 4, 4),
        ("reduce-scatter", 8 * 2, 4),
        ("all-gather", 32 * 16 * 4, 4),  # async: the result half of the tuple, once
        ("collective-permute", 40, 8),
    ]
    expected = 2 * 7 / 8 * (256 * 64 + 1) * 4 + 3 / 4 * 4096 + 3 * 16 + 3 / 4 * 2048 + 40
    assert collective_bytes(hlo, 8) == pytest.approx(expected)
