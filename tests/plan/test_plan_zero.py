"""ZeRO-1/2 and HSDP: placements, compiled memory, and losses equal to single-device Adam."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
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

SIZES = (16, 64, 64, 8)
ADAM = optax.adam(1e-2)


def pytree_state(key=0):
    return sx.TrainState.from_params(mlp_init(jax.random.key(key), SIZES), mlp_apply, ADAM)


def nbytes_on(tree, device):
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


def test_zero1_layout_and_optimizer_state_is_one_eighth_per_device():
    mesh = sx.make_mesh({"data": 8})
    step = sx.make_train_step(model_loss, mesh=mesh, plan=sx.zero1(mesh, min_size=256))
    state = step.init(pytree_state)
    w, mu, nu = state.params[1][0], state.opt_state[0].mu[1][0], state.opt_state[0].nu[1][0]
    assert w.sharding.spec == P() and {s.data.shape for s in w.addressable_shards} == {(64, 64)}
    assert mu.sharding.spec == nu.sharding.spec == P("data", None)
    assert {s.data.shape for s in mu.addressable_shards} == {(8, 64)}
    # (16, 64): the largest divisible dimension is the second, as fsdp picks it.
    assert state.opt_state[0].mu[0][0].sharding.spec == P(None, "data")
    assert state.opt_state[0].mu[1][1].sharding.spec == P()  # 64 elements < min_size
    assert state.opt_state[0].count.sharding.spec == P()

    # Placed: bytes device 0 holds of the optimizer state, against the whole state.
    opt = [x for x in jax.tree.leaves(state.opt_state[0]) if x.size >= 256]
    whole = sum(x.nbytes for x in opt)
    assert nbytes_on(opt, jax.devices()[0]) / whole <= 0.14

    # Compiled (memory_analysis): tests/train/test_plan_auto.py, zero1 against replicate.


def make_plan(name, mesh):
    """zero1 / zero2 over "data" (8), or HSDP: fsdp over "fsdp" (4) inside 2 replicas."""
    if name == "hsdp":
        return sx.fsdp(mesh, axis="fsdp", min_size=256)
    return getattr(sx, name)(mesh, min_size=256)


MESHES = {"zero1": {"data": 8}, "zero2": {"data": 8}, "hsdp": {"replica": 2, "fsdp": 4}}
AXES = {"zero1": "data", "zero2": "data", "hsdp": ("replica", "fsdp")}


@pytest.fixture(scope="module")
def pytree_reference():
    data = batches(SIZES, n=4)
    return data, train_single(mlp_loss, mlp_init(jax.random.key(0), SIZES), data, ADAM)


@pytest.mark.parametrize("name", ["zero1", "zero2", "hsdp"])
def test_pytree_training_matches_single_device(name, pytree_reference):
    data, single = pytree_reference
    mesh = sx.make_mesh(MESHES[name])
    step = sx.make_train_step(
        model_loss, mesh=mesh, plan=make_plan(name, mesh), data_axis=AXES[name]
    )
    sharded = train_sharded(step, step.init(pytree_state), data)
    w, nu = sharded[0].params[1][0], sharded[0].opt_state[0].nu[1][0]
    if name == "hsdp":
        # Sharded 4 ways inside a replica, copied across the 2 replicas.
        assert w.sharding.spec == nu.sharding.spec == P("fsdp", None)
        assert {s.data.shape for s in w.addressable_shards} == {(16, 64)}
    else:
        # The update ran sharded; the new params came back replicated.
        assert w.sharding.spec == P() and nu.sharding.spec == P("data", None)
    assert_same_training(single, sharded)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def nnx_reference():
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        return nnx_loss(nnx.merge(graphdef, params), batch)

    data = batches((16, 8), n=4)
    return data, train_single(loss_fn, params, data, ADAM)


@pytest.mark.parametrize("name", ["zero1", "zero2", "hsdp"])
def test_nnx_training_matches_single_device(name, nnx_reference):
    data, single = nnx_reference
    mesh = sx.make_mesh(MESHES[name])
    step = sx.make_train_step(nnx_loss, mesh=mesh, plan=make_plan(name, mesh), data_axis=AXES[name])
    state = step.init(lambda: sx.TrainState.create(MLP(nnx.Rngs(0)), ADAM))
    sharded = train_sharded(step, state, data)
    kernel = sharded[0].params["up"]["kernel"].get_value()
    mu = sharded[0].opt_state[0].mu["up"]["kernel"].get_value()
    axis = "fsdp" if name == "hsdp" else "data"
    assert kernel.sharding.spec == (P(None, "fsdp") if name == "hsdp" else P())
    assert mu.sharding.spec == P(None, axis)
    assert {s.data.shape for s in mu.addressable_shards} == {(16, 64 // mesh.shape[axis])}
    assert_same_training(single, sharded)


def test_batch_over_two_axes_in_shard_map_mode(pytree_reference):
    data, single = pytree_reference
    mesh = sx.make_mesh({"replica": 2, "fsdp": 4})
    sharding = sx.batch_sharding(mesh, ("replica", "fsdp"))
    batch = sx.distribute_batch(data[0], sharding)
    assert batch["x"].sharding.spec == P(("replica", "fsdp"))
    assert {s.data.shape for s in batch["x"].addressable_shards} == {(4, 16)}
    step = sx.make_train_step(
        model_loss, mesh=mesh, data_axis=("replica", "fsdp"), accumulate=2, mode="shard_map"
    )
    _, losses = train_sharded(step, step.init(pytree_state), data)
    np.testing.assert_allclose(losses, single[1], rtol=1e-5)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("zero", ["zero1", "zero2"])
def test_zero_in_mapped_modes_is_an_error(mode, zero):
    mesh = sx.make_mesh({"data": 8})
    step = sx.make_train_step(
        model_loss, mesh=mesh, plan=getattr(sx, zero)(mesh, min_size=1), mode=mode
    )
    with pytest.raises(ValueError, match=f"only a replicating plan; plan '{zero}' gives leaf"):
        step.init(pytree_state)


def test_data_axis_tuple_errors():
    mesh = sx.make_mesh({"replica": 2, "fsdp": 4})
    with pytest.raises(
        ValueError, match=r"data_axis \('replica', 'data'\): 'data' is not in the mesh"
    ):
        sx.make_train_step(model_loss, mesh=mesh, data_axis=("replica", "data"))
    with pytest.raises(ValueError, match="tuple of distinct names"):
        sx.make_train_step(model_loss, mesh=mesh, data_axis=("fsdp", "fsdp"))
    with pytest.raises(ValueError, match="mode='pmap' maps over one axis"):
        sx.make_train_step(model_loss, mesh=mesh, data_axis=("replica", "fsdp"), mode="pmap")
    with pytest.raises(ValueError, match=r"batch axis .*'model'.* not in the mesh"):
        sx.batch_sharding(mesh, ("replica", "model"))


def test_make_mesh_default_dcn_axis_is_replica_for_hsdp():
    # One process here: the layout is the plain one; the multi-process test checks DCN.
    mesh = sx.make_mesh({"replica": 2, "fsdp": 4})
    assert mesh.shape == {"replica": 2, "fsdp": 4}
    assert math.prod(mesh.devices.shape) == 8


# zero1(gather="forward"): the params kept split (the master), their compute-dtype copy
# gathered at the step's start. Under bf16 it computes what gather="update" computes.
FORWARD_STEPS = 3


@pytest.fixture(scope="module")
def bf16_zero1_runs():
    """Both gathers under precision="bf16", trained on the same batches: {gather: (step,
    first state, last state, losses)}."""
    mesh = sx.make_mesh({"data": 8})
    data = batches(SIZES, n=FORWARD_STEPS)
    out = {}
    for gather in ("update", "forward"):
        plan = sx.zero1(mesh, min_size=8, gather=gather)
        step = sx.make_train_step(model_loss, mesh=mesh, plan=plan, precision="bf16")
        first = step.init(pytree_state)
        state, losses = train_sharded(step, step.init(pytree_state), data)
        out[gather] = step, first, state, losses
    return out


def test_zero1_gather_forward_trains_as_gather_update_under_bf16(bf16_zero1_runs):
    """The forward and backward passes read the same bf16 values and the update is the
    same arithmetic on a slice: equal to the order of floating-point sums (bitwise on
    XLA:CPU; the documented tolerance is rtol 1e-6)."""
    _, _, update, losses_update = bf16_zero1_runs["update"]
    _, _, forward, losses_forward = bf16_zero1_runs["forward"]
    np.testing.assert_allclose(losses_forward, losses_update, rtol=1e-6)
    assert losses_forward[-1] < losses_forward[0]
    for tree in ("params", "opt_state"):
        got, want = jax.tree.leaves(getattr(forward, tree)), jax.tree.leaves(getattr(update, tree))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_zero1_gather_forward_keeps_the_master_split_and_gathers_the_compute_copy(
    bf16_zero1_runs,
):
    from shardax.train.forward_gather import gathered

    step, _, state, _ = bf16_zero1_runs["forward"]
    w, mu = state.params[1][0], state.opt_state[0].mu[1][0]
    # The master: float32, split as Adam's moments are, after every step.
    assert w.dtype == jnp.float32 and w.sharding.spec == mu.sharding.spec == P("data", None)
    assert {s.data.shape for s in w.addressable_shards} == {(8, 64)}
    assert state.params[0][0].sharding.spec == P(None, "data")  # (16, 64): as fsdp splits it
    # The copy the passes read: whole on every device, the master's bf16 values.
    specs = step.state_plan.mirror_specs(state.params)
    copy = jax.jit(lambda p: gathered(p, specs, step.mesh, step.precision))(state.params)
    c = copy[1][0]
    assert c.sharding.spec == P() and {s.data.shape for s in c.addressable_shards} == {(64, 64)}
    np.testing.assert_array_equal(np.asarray(c), np.asarray(w.astype(jnp.bfloat16), np.float32))
    # In the step, the cast runs on the slice and the bf16 copy is what is gathered
    # (XLA:CPU then gathers it widened; the GPU target's bf16 gathers:
    # tests/compile/test_overlap_targets.py).
    text = step.lower(state, batches(SIZES, n=1)[0]).as_text()
    assert re.search(r"sharding_constraint %\w+ <@mesh, \[\{}, \{}]> : tensor<64x64xbf16>", text)


def test_zero1_gather_forward_state_bytes_are_the_formula(bf16_zero1_runs):
    """Placed bytes per device of params + Adam against cost.memory's ZeRO-1 formula with
    gather="forward" (every leaf split: min_size 8 and each divisible by 8), and the
    gradients sx.estimate counts: whole, as under gather="update"."""
    from shardax.cost.accounting import grad_bytes
    from shardax.cost.memory import estimate

    device = jax.devices()[0]
    for gather in ("update", "forward"):
        step, first, _, _ = bf16_zero1_runs[gather]
        count = sum(x.size for x in jax.tree.leaves(first.params))
        formula = estimate(count, "bf16", data=8, zero=1, gather=gather)
        adam = [first.opt_state[0].mu, first.opt_state[0].nu]
        assert nbytes_on(first.params, device) == formula.params_bytes
        assert nbytes_on(adam, device) == formula.master_bytes + formula.optimizer_bytes
        grads = grad_bytes(step, first, nbytes_on(first.params, device), step.mesh)
        assert grads == formula.grads_bytes == 4 * count


def test_zero1_gather_forward_resumes_bitwise(bf16_zero1_runs, tmp_path):
    """The state is the split master: saved and restored onto the step's shardings, it
    is the same bits in the same places, and the next step from it is the same step."""
    step, first, state, _ = bf16_zero1_runs["forward"]
    sx.save_checkpoint(tmp_path, state, step=int(state.step))
    restored = sx.restore_checkpoint(tmp_path, like=first).state  # the plan's shardings
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = batches(SIZES, n=1)[0]
    (after, m1), (again, m2) = step(restored, batch), step(state, batch)
    assert float(m1["loss"]) == float(m2["loss"])
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_zero1_gather_is_checked():
    mesh = sx.make_mesh({"data": 8})
    with pytest.raises(
        ValueError, match=r"gather must be one of \('update', 'forward'\), got 'end'"
    ):
        sx.zero1(mesh, gather="end")
    assert sx.zero2(mesh, gather="forward").gathers_forward
    assert not sx.zero1(mesh).gathers_forward
