"""Collectives in the compiled HLO of a train step under FSDP and under pure DP."""

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.hlo import collectives as hlo_collectives

PARAMS = {"w1": (64, 128), "w2": (128, 16), "b": (16,)}


def collectives(hlo: str) -> dict[str, list[list[int]]]:
    """op name -> for each op, the element counts of its outputs (shardax.cost.hlo)."""
    found: dict[str, list[list[int]]] = {}
    for c in hlo_collectives(hlo):
        found.setdefault(c.op, []).append([math.prod(shape) for shape in c.shapes])
    return found


def compiled_step(plan, mesh, dropout=False):
    tx = optax.adam(1e-3)
    params = {k: jnp.ones(s) for k, s in PARAMS.items()}
    state = {"params": params, "opt_state": tx.init(params)}

    def step(state, batch, key):
        def loss(p):
            h = jnp.tanh(batch @ p["w1"])
            if dropout:
                h = h * jax.random.bernoulli(key, 0.9, h.shape) / 0.9
            return jnp.mean((h @ p["w2"] + p["b"]) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    shardings = sx.plan.follow_params(plan)(state)
    # A batch larger than the params, so XLA moves the params (as FSDP does).
    batch = jax.ShapeDtypeStruct((1024, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    jitted = jax.jit(step, in_shardings=(shardings, batch.sharding, None), out_shardings=shardings)
    return jitted.lower(state, batch, jax.random.key(0)).compile().as_text()


def test_fsdp_all_gathers_params_and_reduces_grads(mesh):
    ops = collectives(compiled_step(sx.fsdp(mesh, min_size=1), mesh))
    gathered = {n for sizes in ops.get("all-gather", []) for n in sizes}
    assert {math.prod(PARAMS["w1"]), math.prod(PARAMS["w2"])} <= gathered
    reduced = {n for op in ("reduce-scatter", "all-reduce") for s in ops.get(op, []) for n in s}
    # Whole grads (all-reduce) or their 1/8 shards (reduce-scatter).
    for shape in (PARAMS["w1"], PARAMS["w2"]):
        assert math.prod(shape) in reduced or math.prod(shape) // 8 in reduced


def test_pure_data_parallel_has_no_all_gather(mesh):
    ops = collectives(compiled_step(sx.replicate(mesh), mesh))
    assert "all-gather" not in ops
    reduced = {n for s in ops["all-reduce"] for n in s}
    assert {math.prod(s) for s in PARAMS.values()} <= reduced


def test_no_collective_permute_from_random_numbers(mesh):
    assert jax.config.jax_threefry_partitionable  # the default in jax 0.10
    for plan in (sx.fsdp(mesh, min_size=1), sx.replicate(mesh)):
        assert "collective-permute" not in collectives(compiled_step(plan, mesh, dropout=True))
    # The check can fail: the legacy RNG does permute (seed 002's sharp bit).
    with jax.threefry_partitionable(False):
        legacy = collectives(compiled_step(sx.replicate(mesh), mesh, dropout=True))
    assert "collective-permute" in legacy


def test_ragged_all_to_all_is_counted_by_its_output_buffer():
    """XLA:CPU cannot compile lax.ragged_all_to_all, so the op is read from a GPU-style
    HLO line: its output buffer (an upper bound: the sizes are data-dependent)."""
    hlo = """HloModule m

ENTRY %main (p0: f32[64,16], p1: f32[64,16], s: s32[4]) -> f32[64,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = f32[64,16]{1,0} parameter(1)
  %s = s32[4]{0} parameter(2)
  ROOT %r = f32[64,16]{1,0} ragged-all-to-all(ARGS), channel_id=1, replica_groups={{0,1,2,3}}
}
""".replace(
        "ARGS", ", ".join(["f32[64,16]{1,0} %p0", "f32[64,16]{1,0} %p1"] + ["s32[4]{0} %s"] * 4)
    )
    (found,) = hlo_collectives(hlo, 4)
    assert (found.op, found.bytes, found.group, found.shapes) == (
        "ragged-all-to-all",
        64 * 16 * 4,
        4,
        ((64, 16),),
    )
    assert found.sent_bytes == 3 / 4 * 64 * 16 * 4
