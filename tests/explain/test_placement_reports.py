"""Placement against intent where the user reads it: ``sx.verify``'s report (one line, and
its ``to_dict``) and ``shardax train``'s run summary (``summary.json``'s ``placement``)."""

import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import shardax as sx
from shardax.cli.loop import _placement


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_verify_and_the_run_summary_carry_the_placement(mesh):
    state = sx.TrainState.create(MLP(nnx.Rngs(0)), optax.adam(1e-3))
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh, min_size=2**10))
    batch = {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 8))}
    report = sx.verify(step, state, batch)
    assert report.ok and report.placement is not None
    down = next(leaf for leaf in report.placement.leaves if "down']['kernel" in leaf.path)
    assert down.shape == (64, 8) and down.ways == 1 and down.meant == 8
    assert "min_size" in down.why  # 512 elements under the plan's 1024
    line = report.placement.summary()
    share = report.placement.share("parameter")[8]
    assert share == 16 * 64 / (16 * 64 + 64 + 64 * 8 + 8)  # only up's kernel is split
    assert line.startswith("placement (fsdp") and f"{share:.1%} of parameter bytes 8-way" in line
    assert f"{share:.1%} of parameter bytes 8-way" in " ".join(str(report).split())
    data = json.loads(json.dumps(report.to_dict()))
    assert data["placement"]["summary"] == line
    assert data["placement"]["ways"]["parameter"]["8"] == 16 * 64 * 4  # up's kernel
    summary = json.loads(json.dumps(_placement(step, state)))
    assert summary == data["placement"]
    assert _placement(lambda s, b: (s, {}), state) is None  # a step without a plan


def test_a_replicating_plan_names_no_idle_axis(mesh):
    from shardax.train.explanation.placement import placement

    state = sx.TrainState.create(MLP(nnx.Rngs(0)), optax.adam(1e-3))
    assert placement(state, sx.replicate(mesh)).ok  # data parallel: copies are meant
    starved = placement(state, sx.fsdp(mesh, min_size=2**20))  # every leaf under min_size
    assert starved.idle_axes == ("data",) and "axes splitting nothing: data" in starved.summary()
