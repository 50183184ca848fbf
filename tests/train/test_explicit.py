"""Explicit mesh axes are first-class: a model that carries its own activation shardings
(flax's examples/gemma ``ShardingConfig.fsdp_tp_sharding`` pattern) trains under
make_train_step like the unannotated model on one device, and batches and checkpoints
keep the axis types."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardax as sx

D, F = 8, 16


class Sharding(NamedTuple):
    """Where weights and activations go; all None is the unannotated model."""

    w_df: Any = None
    w_fd: Any = None
    act_bd: Any = None
    act_bf: Any = None

    @staticmethod
    def fsdp_tp(fsdp: str = "data", tp: str = "model") -> "Sharding":
        # As flax's ShardingConfig.fsdp_tp_sharding: weights over (fsdp, tp), the batch of
        # activations over fsdp and their features over tp.
        return Sharding(
            w_df=P(fsdp, tp), w_fd=P(tp, fsdp), act_bd=P(fsdp, None), act_bf=P(fsdp, tp)
        )


class Block(nnx.Module):
    def __init__(self, shd: Sharding, rngs: nnx.Rngs) -> None:
        self.shd = shd
        # No biases, as in gemma: a bias split by another plan would not add to h.
        self.up = nnx.Linear(
            D, F, use_bias=False, kernel_metadata={"out_sharding": shd.w_df}, rngs=rngs
        )
        init = nnx.initializers.lecun_normal()
        self.down = nnx.Param(init(rngs.params(), (F, D)), out_sharding=shd.w_fd)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.shd.act_bd is not None:
            x = jax.sharding.reshard(x, self.shd.act_bd)
        h = jnp.tanh(self.up(x, out_sharding=self.shd.act_bf))  # flax layer
        return jnp.einsum("bf,fd->bd", h, self.down[...], out_sharding=self.shd.act_bd)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def data(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{k: rng.normal(size=(16, D)).astype(np.float32) for k in ("x", "y")} for _ in range(n)]


def run(step, state, batches):
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def expected():
    """The unannotated model on one device."""
    step = sx.make_train_step(loss_fn, mesh=sx.make_mesh({"data": -1}), mode="single")
    state = step.shard(sx.TrainState.create(Block(Sharding(), nnx.Rngs(0)), optax.adam(1e-2)))
    return run(step, state, data())[1]


def model():
    return Block(Sharding.fsdp_tp(), nnx.Rngs(0))


def build(mesh, fn=model):
    with jax.set_mesh(mesh):  # flax 0.12 shards annotated variables as it creates them
        return fn()


@pytest.mark.parametrize(
    ("make_mesh", "plan", "accumulate"),
    [
        ("jax", "from_nnx", 1),
        ("jax", "from_nnx", 2),
        ("sx", "fsdp", 1),
        ("sx", "replicate", 1),
    ],
)
def test_model_with_its_own_shardings_trains_like_one_device(make_mesh, plan, accumulate, expected):
    if make_mesh == "jax":
        mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit by default
    else:
        mesh = sx.make_mesh({"data": 4, "model": 2}, axis_types=AxisType.Explicit)
    assert mesh.axis_types == (AxisType.Explicit,) * 2
    plans = {
        "from_nnx": lambda: sx.from_nnx(mesh, build(mesh, lambda: nnx.eval_shape(model))),
        "fsdp": lambda: sx.fsdp(mesh, min_size=1),
        "replicate": lambda: sx.replicate(mesh),
    }
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plans[plan](), accumulate=accumulate)
    if plan == "from_nnx":
        state = step.init(lambda: sx.TrainState.create(model(), optax.adam(1e-2)))
    else:
        state = step.shard(sx.TrainState.create(build(mesh), optax.adam(1e-2)))
    state, losses = run(step, state, data())
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    kernel = state.params["up"]["kernel"][...]
    assert kernel.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
    want = {"from_nnx": P("data", "model"), "fsdp": P(None, "data"), "replicate": P()}[plan]
    assert kernel.sharding.spec == want
    typed = tuple(jax.typeof(kernel).sharding.spec)
    assert typed == tuple(want) + (None,) * (kernel.ndim - len(want))  # in the type too


def test_model_with_its_own_shardings_on_an_auto_mesh_says_use_explicit_axes():
    auto = sx.make_mesh({"data": 4, "model": 2})
    with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"))):
        model = Block(Sharding.fsdp_tp(), nnx.Rngs(0))
    step = sx.make_train_step(loss_fn, mesh=auto)
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
    with pytest.raises(ValueError, match="of type Auto") as error:
        step(state, data(1)[0])
    assert "need Explicit axes" in "".join(error.value.__notes__)


def test_batches_and_checkpoints_keep_explicit_axes(tmp_path, expected):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    explicit = (AxisType.Explicit,) * 2
    sharding = sx.batch_sharding(mesh)
    batches = data()
    placed = [sx.global_batch(batches[0], sharding)]
    with sx.prefetch_to_device(iter(batches[1:]), mesh) as rest:
        placed += list(rest)
    for batch in placed:
        assert batch["x"].sharding.mesh.axis_types == explicit
        assert jax.typeof(batch["x"]).sharding.spec == P("data", None)

    model = build(mesh)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.from_nnx(mesh, model))
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
    state, first = run(step, state, placed[:1])
    sx.save_checkpoint(tmp_path, state, step=1)
    like = step.shard(sx.TrainState.create(build(mesh), optax.adam(1e-2)))
    restored = sx.restore_checkpoint(tmp_path, like=like).state
    for leaf in jax.tree.leaves(restored.params):
        assert leaf.sharding.mesh.axis_types == explicit
        assert jax.typeof(leaf).sharding.mesh.axis_types == explicit
    kernel = restored.params["up"]["kernel"][...]
    assert jax.typeof(kernel).sharding.spec == P("data", "model")
    _, rest_losses = run(step, restored, placed[1:])
    np.testing.assert_allclose(first + rest_losses, expected, rtol=2e-5)
