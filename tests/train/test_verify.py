"""sx.verify: the distributed step against one device. It fails with the right cause
named where the sharded run is not one device's (per-device token means without a mask,
device-folded dropout, bf16 under a too-tight tolerance), and raises no false alarm on
the plans × modes the suite trains. BatchNorm normalizes over the global batch in every
mode, in NNX, Linen and Equinox, with one model definition."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from train_models import (
    IN,
    NNXMLP,
    OUT,
    batches,
    count_compiles,
    leaves,
    lm_state,
    make_loss,
    make_state,
    padded_token_batches,
)

import shardax as sx

BATCH = batches(1, size=16)[0]


# -- no false alarm ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "mode", "plan", "kwargs"),
    [
        ("nnx", "jit", "fsdp", {"steps": 2}),
        ("nnx", "shard_map", None, {"steps": 2}),
        ("nnx", "pmap", None, {"accumulate": 2}),
        ("linen", "jit", "zero2", {}),
        ("linen", "shard_map", None, {"accumulate": 2}),
        ("equinox", "jit", "zero1", {"accumulate": 2}),
        ("equinox", "pmap", None, {}),
        ("pytree", "jit", None, {"precision": "bf16"}),
        ("pytree", "shard_map", None, {"precision": "fp16", "steps": 2}),
    ],
)
def test_plans_and_modes_pass(mesh, framework, mode, plan, kwargs):
    if plan is not None:
        plan = getattr(sx, plan)(mesh, **({"min_size": 1} if plan == "fsdp" else {}))
    steps = kwargs.pop("steps", 1)
    step = sx.make_train_step(make_loss(framework), mesh=mesh, mode=mode, plan=plan, **kwargs)
    state = step.shard(make_state(framework, optax.adam(1e-2)))
    before = leaves(state)
    report = sx.verify(step, state, batches(1, size=16, mask=True)[0], steps=steps)
    assert report.ok, str(report)
    assert report.cause is None and report.first_step is None and report.compared > 0
    # The state it was given is unchanged, and still usable by the (donating) step.
    for x, y in zip(leaves(state), before, strict=True):
        np.testing.assert_array_equal(x, y)
    step(state, BATCH)


def test_report_prints_a_table_and_names_the_worst_leaf(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode="single")
    report = sx.verify(step, make_state("pytree"), BATCH)
    text = str(report)
    assert "sx.verify: ok" in text and "max rel diff" in text and report.worst.path in text
    assert set(report.to_dict()) >= {"ok", "worst", "first_step", "cause", "seconds"}


def test_explicit_mesh_with_the_models_own_shardings():
    from test_explicit import Block, Sharding, data, loss_fn

    mesh = sx.make_mesh({"data": 4, "model": 2}, axis_types=AxisType.Explicit)
    with jax.set_mesh(mesh):
        model = Block(Sharding.fsdp_tp(), nnx.Rngs(0))
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=1))
    report = sx.verify(step, step.shard(sx.TrainState.create(model, optax.adam(1e-2))), data(1)[0])
    assert report.ok, str(report)
    assert report.reference.startswith("TFRT_CPU_0") or "0" in report.reference


def test_pipeline_gpt_and_its_cost_is_two_compilations():
    from shardax.models import gpt

    cfg = gpt.GPTConfig(layers=2, d_model=16, heads=2, max_seq_len=8, pipeline_microbatches=2)
    tokens = np.random.default_rng(0).integers(0, 256, size=(8, 9)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def lm_loss(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    mesh = sx.make_mesh({"data": 4, "stage": 2})
    model = gpt.make_gpt(cfg)
    step = sx.make_train_step(lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, "pipeline"))
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
    with count_compiles() as compiles:
        report = sx.verify(step, state, batch)
    assert report.ok, str(report)
    assert len(compiles) <= 2 + 2  # the two step programs (and at most two tiny copies)


def test_auto_plan_picks_once_and_the_step_then_trains(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, plan="auto")
    state = make_state("pytree")
    report = sx.verify(step, state, BATCH)
    assert report.ok and step.auto_report is not None
    _, metrics = step(state, BATCH)  # places the unplaced state on the picked plan
    assert np.isfinite(float(metrics["loss"]))


# -- must fail, with the cause named ------------------------------------------------------


def weighted_token_loss(model, batch):
    """lm1b's loss: a per-device token mean, its weights in a field the step cannot see."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        model(batch["tokens"]), batch["targets"]
    )
    return (losses * batch["weights"]).sum() / batch["weights"].sum()


def test_per_device_token_mean_without_a_mask_is_named(mesh):
    data = padded_token_batches(1, size=16)[0]
    batch = {"tokens": data["tokens"], "targets": data["targets"]}
    batch["weights"] = data["mask"].astype(np.float32)
    step = sx.make_train_step(weighted_token_loss, mesh=mesh, mode="shard_map")
    report = sx.verify(step, lm_state(), batch)
    assert not report.ok and report.first_step == 1
    assert report.cause == "per-device means weighted equally", str(report)
    assert "mask" in report.hint and "likely cause: per-device means" in str(report)
    # The fix the report names: a mask leaf, the loss unchanged.
    assert sx.verify(step, lm_state(), {**batch, "mask": data["mask"]}).ok


class Dropped(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.mlp = NNXMLP(rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.mlp(self.drop(x))


def test_dropout_from_framework_rng_under_shard_map_is_named(mesh):
    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    state = sx.TrainState.create(Dropped(nnx.Rngs(0, dropout=1)), optax.sgd(0.1))
    step = sx.make_train_step(loss_fn, mesh=mesh, mode="shard_map")
    report = sx.verify(step, state, BATCH)
    assert not report.ok and report.cause == "device-folded RNG", str(report)
    # Under jit the same model draws the same masks as one device.
    assert sx.verify(sx.make_train_step(loss_fn, mesh=mesh), state, BATCH).ok


def test_bf16_against_a_too_tight_tolerance_is_reduced_precision(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, precision="bf16")
    report = sx.verify(step, make_state("pytree"), batches(1, size=64)[0], rtol=1e-7)
    assert not report.ok and report.cause == "reduced precision", str(report)
    assert "bf16" in report.hint


def test_reference_that_does_not_fit_says_so():
    from shardax.train.verify import _out_of_memory, _too_big

    error = _too_big("cuda:0", 4096, RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert "one device (cuda:0)" in str(error) and "smaller probe batch" in str(error)
    assert _out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: while allocating"))


# -- BatchNorm: the global batch in every mode, three frameworks ----------------------------


class NNXNorm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(IN, OUT, rngs=rngs)
        self.norm = nnx.BatchNorm(OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.linear(x))


class LinenNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.BatchNorm(use_running_average=False)(nn.Dense(OUT)(x))


class EqxNorm(eqx.Module):
    """An Equinox BatchNorm and its eqx.nn.State, vmapped over the examples ("batch")."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    state: eqx.nn.State

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(IN, OUT, key=key)
        self.norm = eqx.nn.BatchNorm(OUT, "batch", mode="batch")
        self.state = eqx.nn.State(self.norm)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.linear)(x)
        vmapped = jax.vmap(self.norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return vmapped(h, self.state)[0]


def norm_state(framework: str) -> sx.TrainState:
    if framework == "nnx":
        return sx.TrainState.create(NNXNorm(nnx.Rngs(0)), optax.sgd(0.1))
    if framework == "linen":
        variables = LinenNorm().init(jax.random.key(0), jnp.ones((2, IN)))
        return sx.TrainState.from_linen(LinenNorm(), variables, optax.sgd(0.1))
    return sx.TrainState.create(EqxNorm(jax.random.key(0)), optax.sgd(0.1))


def norm_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize(
    ("framework", "mode"),
    [("nnx", "shard_map"), ("nnx", "pmap"), ("linen", "shard_map"), ("equinox", "shard_map")],
)
def test_batchnorm_normalizes_over_the_global_batch_in_mapped_modes(mesh, framework, mode):
    step = sx.make_train_step(norm_loss, mesh=mesh, mode=mode)
    report = sx.verify(step, norm_state(framework), BATCH, steps=2 if framework == "nnx" else 1)
    assert report.ok, str(report)


def test_batchnorm_written_for_pmap_runs_under_jit(mesh):
    """A layer whose axis_name names the data axis (written for pmap) works under jit."""

    class PmapNorm(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(IN, OUT, rngs=rngs)
            self.norm = nnx.BatchNorm(OUT, axis_name="data", rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.norm(self.linear(x))

    state = sx.TrainState.create(PmapNorm(nnx.Rngs(0)), optax.sgd(0.1))
    assert sx.verify(sx.make_train_step(norm_loss, mesh=mesh), state, BATCH).ok


# -- your own step function (keep your loop) ------------------------------------------------


def nnx_objects(mesh):
    model = NNXMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    return nnx.merge(graphdef, jax.device_put(state, sx.fsdp(mesh, min_size=1)(state)))


@nnx.jit(donate_argnums=(0, 1))
def nnx_train_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_own_nnx_step_with_placed_objects(mesh):
    model, optimizer = nnx_objects(mesh)
    before = leaves(nnx.state(model))
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(nnx_train_step, (model, optimizer), batch, steps=2)
    assert report.ok, str(report)
    assert any(d.path.startswith("state/") for d in report.diffs)
    for x, y in zip(leaves(nnx.state(model)), before, strict=True):  # not donated, not changed
        np.testing.assert_array_equal(x, y)


def test_own_shard_map_step_with_batchnorm_needs_a_reference_and_names_the_cause(mesh):
    """A functional step written with shard_map: the per-device BatchNorm it computes is
    found against the user's own one-device step."""
    module = LinenNorm()
    variables = module.init(jax.random.key(0), jnp.ones((2, IN)))

    def grads_of(variables, batch):
        def loss(params):
            out, _ = module.apply(
                {**variables, "params": params}, batch["x"], mutable=["batch_stats"]
            )
            return jnp.mean((out - batch["y"]) ** 2)

        return jax.value_and_grad(loss)(variables["params"])

    def update(variables, loss_grads):
        loss, grads = loss_grads
        params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads)
        return {**variables, "params": params}, loss

    P = jax.sharding.PartitionSpec

    @jax.jit
    def sharded_step(variables, batch):
        def per_device(variables, batch):
            return jax.lax.pmean(grads_of(variables, batch), "data")

        # check_vma=False: the gradients of the replicated params are each device's own
        # (with it, JAX sums them over the devices before the pmean)
        mapped = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False
        )
        return update(variables, mapped(variables, batch))

    @jax.jit
    def one_device_step(variables, batch):
        return update(variables, grads_of(variables, batch))

    report = sx.verify(sharded_step, variables, BATCH, reference=one_device_step, mesh=mesh)
    assert not report.ok and report.cause == "per-device BatchNorm statistics", str(report)


def test_bad_arguments_are_named(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        sx.verify(step, make_state("pytree"), BATCH, steps=0)
    with pytest.raises(TypeError, match="reference= and mesh= are for your own step"):
        sx.verify(step, make_state("pytree"), BATCH, reference=lambda s, b: s)
    with pytest.raises(
        TypeError, match=r"train step \(sx.make_train_step\) or your own step function, got int"
    ):
        sx.verify(3, make_state("pytree"), BATCH)
