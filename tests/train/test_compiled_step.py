"""The compiled step: one per state structure (bounded MRU cache), equal optax
transformations share it, ``step.lower`` exposes it, and every mode takes a batch placed
over the mesh."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from train_models import batches, count_compiles, leaves, make_loss, make_state

import shardax as sx
import shardax.train.compiled as step_module

MODES = ("single", "jit", "shard_map", "pmap")


def run(step, state, data):
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_equal_transformations_share_a_step_and_structures_alternate(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    batch = batches(1)[0]
    a = step.shard(make_state("pytree", optax.adam(1e-2)))
    b = step.shard(make_state("pytree", optax.adam(1e-2)))  # a new but equal object
    c = step.shard(make_state("pytree", optax.sgd(0.1)))  # another structure
    assert jax.tree.structure(a) == jax.tree.structure(b) != jax.tree.structure(c)
    with count_compiles() as compiles:
        for _ in range(3):
            a, _ = step(a, batch)
            c, _ = step(c, batch)
            b, _ = step(b, batch)
        jax.block_until_ready((a, b, c))
    assert len(compiles) == 2
    assert int(a.step) == int(b.step) == int(c.step) == 3
    for x, y in zip(leaves(a.params), leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_compiled_steps_are_a_bounded_most_recently_used_cache(mesh, monkeypatch):
    monkeypatch.setattr(step_module, "COMPILED_CACHE_SIZE", 2)
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    batch = batches(1)[0]
    txs = {"sgd": optax.sgd(0.1), "momentum": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(0.1)}
    states = {name: step.shard(make_state("pytree", tx)) for name, tx in txs.items()}
    counts = []
    with count_compiles() as compiles:
        # sgd, momentum; adam evicts sgd; sgd evicts momentum; adam is still cached.
        for name in ("sgd", "momentum", "adam", "sgd", "adam", "sgd"):
            states[name], metrics = step(states[name], batch)
            jax.block_until_ready(metrics)
            counts.append(len(compiles))
    assert counts == [1, 2, 3, 4, 4, 4]


@pytest.mark.parametrize("mode", MODES)
def test_lower_gives_the_compiled_step(mesh, mode):
    plan = sx.fsdp(mesh, min_size=1) if mode == "jit" else None
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode=mode, plan=plan)
    state = step.shard(make_state("pytree"))
    batch = batches(1)[0]
    lowered = step.lower(state, batch)
    assert "HloModule" in lowered.as_text(dialect="hlo")
    compiled = lowered.compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] > 0
    if mode == "jit":
        (state_in, batch_in), _ = compiled.input_shardings
        assert state_in.params["w1"].spec == P(None, "data") and batch_in["x"].spec == P("data")
    if mode != "single":
        with pytest.raises(ValueError, match="not divisible"):
            step.lower(state, {k: v[:3] for k, v in batch.items()})


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_takes_a_batch_placed_over_the_mesh(mesh, mode):
    data = batches(2)
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode=mode)
    _, expected = run(step, step.shard(make_state("pytree")), data)
    sharding = sx.batch_sharding(mesh)
    for placed in (
        [sx.distribute_batch(b, sharding) for b in data],
        [sx.global_batch(b, sharding) for b in data],
        list(sx.prefetch_to_device(iter(data), mesh)),
    ):
        assert placed[0]["x"].sharding.spec == P("data")
        _, losses = run(step, step.shard(make_state("pytree")), placed)
        np.testing.assert_allclose(losses, expected, rtol=1e-6)
