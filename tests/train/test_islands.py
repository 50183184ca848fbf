"""DiLoCo islands: the inner step is each island's own DP step, nothing crosses islands
between outer steps, the outer step is Nesterov SGD on the mean outer gradient, and a
resumed run is bitwise the uninterrupted one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardax as sx
from shardax.train.diloco import int8_encode, topk_decode, topk_encode
from shardax.train.islands import crossing


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def _state():
    return sx.TrainState.create(MLP(nnx.Rngs(0)), optax.adamw(1e-2))


def _batches(n, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(rows, 8)).astype(np.float32),
         "y": rng.normal(size=rows).astype(np.float32)}
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def island_mesh():
    return sx.make_mesh({"island": 2, "data": 4})


def _plan(mesh, name):
    return None if name == "replicate" else sx.fsdp(mesh, axis="data", min_size=0)


def test_inner_steps_are_each_islands_dp_step_and_outer_is_nesterov(island_mesh, plan="fsdp"):
    """Each island's rows of the state after 3 inner steps equal a plain DP step on a
    4-device mesh given that island's half of each batch; the outer step is
    sgd(0.7, momentum=0.9, nesterov=True) on the mean of anchor - params, in NumPy."""
    mesh, batches = island_mesh, _batches(3)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=_plan(mesh, plan),
                              diloco=sx.DiLoCo(inner_steps=3))  # fmt: skip
    state = step.shard(_state())
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.sharding.spec[0] == "island" and leaf.shape[0] == 2
    for batch in batches:
        state, metrics = step(state, batch)
    assert metrics["loss"].shape == (2,) and metrics["loss"].sharding.spec == jax.P("island")
    for i in range(2):
        sub = sx.make_mesh({"data": 4}, devices=mesh.devices[i])
        dp = sx.make_train_step(loss_fn, mesh=sub, plan=_plan(sub, plan))
        one = dp.shard(_state())
        for batch in batches:
            one, m = dp(one, {k: v[8 * i : 8 * (i + 1)] for k, v in batch.items()})
        np.testing.assert_allclose(metrics["loss"][i], m["loss"], rtol=1e-6)
        for got, want in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(one.params), strict=True
        ):
            np.testing.assert_allclose(np.asarray(got)[i], np.asarray(want), rtol=1e-6, atol=1e-7)
    anchor = [np.asarray(x) for x in jax.tree.leaves(state.outer.anchor)]
    islands = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    synced = step.sync(state)
    assert int(synced.outer.syncs) == 1
    for a, p, new in zip(anchor, islands, jax.tree.leaves(synced.params), strict=True):
        g = (a[None] - p).mean(0)  # the outer gradient
        momentum = g  # the first step: trace = 0 * 0.9 + g
        want = a - 0.7 * (g + 0.9 * momentum)
        np.testing.assert_allclose(np.asarray(new)[0], want, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(new)[0], np.asarray(new)[1])


@pytest.mark.parametrize("plan", ["replicate", "fsdp"])
def test_no_collective_crosses_islands_in_the_inner_step(island_mesh, plan):
    """From the compiled HLO: the inner step has no collective whose replica groups span
    two islands, the outer step only the outer gradients' all-reduce over the island pairs,
    and DP on the same mesh sends >= 50x more across islands per step than DiLoCo at H=50."""
    mesh = island_mesh
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=_plan(mesh, plan),
                              diloco=sx.DiLoCo(inner_steps=50))  # fmt: skip
    state, batch = step.shard(_state()), _batches(1)[0]
    traffic = step.traffic(state, batch)
    assert len(traffic.inner) == 0 and traffic.inner.bytes == 0
    assert traffic.inner.all_ops or plan == "replicate"  # fsdp gathers inside islands
    assert {c.op for c in traffic.outer.ops} == {"all-reduce"}
    pairs = {tuple(g) for c in traffic.outer.ops for g in c.groups}
    assert pairs == {(0, 4), (1, 5), (2, 6), (3, 7)}
    params = sum(x.size * 4 for x in jax.tree.leaves(_state().params))
    assert traffic.outer.bytes == pytest.approx(params / (4 if plan == "fsdp" else 1), rel=0.1)
    dp = sx.make_train_step(loss_fn, mesh=mesh, plan=_plan(mesh, plan),
                            data_axis=("island", "data"))  # fmt: skip
    hlo = dp.lower(dp.shard(_state()), batch).compile().as_text()
    assert crossing(hlo, mesh).bytes >= 50 * traffic.per_step


@pytest.mark.parametrize(("compress", "dtypes", "ratio"),
                         [("bf16", {"u16"}, 0.5), ("int8", {"s8", "f32"}, 0.35),
                          ("topk", {"u16", "u8"}, 0.1)])  # fmt: skip
def test_compressed_outer_gradients_cross_islands_in_their_encoding(
    island_mesh, compress, dtypes, ratio
):
    """The outer step's only cross-island collectives carry the encoding (bf16 as its
    bits, int8 with its float32 scales, top-k's bf16 values and uint8 positions), at
    a fraction of float32's bytes (the uncompressed all-reduce sends each param once)."""
    config = sx.DiLoCo(inner_steps=2, compress=compress, block=32, topk=2)
    step = sx.make_train_step(loss_fn, mesh=island_mesh, diloco=config)
    state, batch = step.shard(_state()), _batches(1)[0]
    outer = crossing(step.lower_outer(state).compile().as_text(), island_mesh)
    assert {d for c in outer.ops for d in c.dtypes} == dtypes
    assert {c.op for c in outer.ops} == {"all-gather"}
    full = sum(x.size * 4 for x in jax.tree.leaves(_state().params))
    assert outer.bytes <= ratio * full
    state, _ = step(state, batch)
    synced = step.sync(state, 2)
    rows = [np.asarray(x) for x in jax.tree.leaves(synced.params)]
    assert all(np.array_equal(r[0], r[1]) for r in rows)  # every island from one anchor
    if compress == "topk":  # error feedback: what was not sent is kept per island
        errors = jax.tree.leaves(synced.outer.error)
        assert any(np.abs(np.asarray(e)).max() > 0 for e in errors)


def test_encodings_against_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 16)).astype(np.float32)
    q, scale = int8_encode(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(q) * np.asarray(scale), x, atol=np.abs(x).max() / 254)
    np.testing.assert_allclose(np.asarray(scale)[:, 0], np.abs(x).max(1) / 127, rtol=1e-6)
    values, index = topk_encode(jnp.asarray(x), 4)
    dense = np.asarray(topk_decode(values, index, 16))
    want = np.where(np.abs(x) >= np.sort(np.abs(x), 1)[:, -4:-3], x, 0)
    np.testing.assert_allclose(dense, want, rtol=1e-2)  # bf16 values
    assert index.dtype == np.uint8


def test_resumed_between_outer_steps_is_bitwise_the_uninterrupted_run(island_mesh, tmp_path):
    """A run checkpointed after inner step 3 (between the syncs at 2 and 4), restored and
    continued to step 5, equals the uninterrupted run bit for bit (topk's error feedback
    and the outer momentum included)."""
    mesh, batches = island_mesh, _batches(5)
    config = sx.DiLoCo(inner_steps=2, compress="topk", block=32, topk=4)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=0), diloco=config)

    def run(state, start, stop):
        for i in range(start, stop):
            state, _ = step(state, batches[i])
            state = step.sync(state, i + 1)
        return state

    whole = run(step.shard(_state()), 0, 5)
    half = run(step.shard(_state()), 0, 3)
    sx.save_checkpoint(tmp_path / "ckpt", half, step=3)
    abstract = step.abstract(_state())
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, step.shardings(abstract))  # fmt: skip
    restored = sx.restore_checkpoint(tmp_path / "ckpt", like=like).state
    assert int(restored.outer.syncs) == 1
    resumed = run(step.shard(restored), 3, 5)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refusals(island_mesh):
    with pytest.raises(ValueError, match="DiLoCo's axis 'island' is not in the mesh"):
        sx.make_train_step(loss_fn, mesh=sx.make_mesh({"data": 8}),
                           diloco=sx.DiLoCo(inner_steps=2))  # fmt: skip
    with pytest.raises(ValueError, match="must not hold the island axis"):
        sx.make_train_step(loss_fn, mesh=island_mesh, data_axis=("island", "data"),
                           diloco=sx.DiLoCo(inner_steps=2))  # fmt: skip
    with pytest.raises(ValueError, match="mode='jit' only, got mode='shard_map'"):
        sx.make_train_step(loss_fn, mesh=island_mesh, mode="shard_map",
                           diloco=sx.DiLoCo(inner_steps=2))  # fmt: skip
    with pytest.raises(ValueError, match="compress must be one of"):
        sx.DiLoCo(inner_steps=2, compress="fp8")
    with pytest.raises(ValueError, match="inner_steps"):
        sx.DiLoCo(inner_steps=0)
    with pytest.raises(ValueError, match="over the island axis 'island'"):
        step = sx.make_train_step(loss_fn, mesh=island_mesh,
                                  plan=sx.fsdp(island_mesh, axis="island", min_size=0),
                                  diloco=sx.DiLoCo(inner_steps=2))  # fmt: skip
        step.shard(_state())


@pytest.mark.compile_only("gpu")
@pytest.mark.parametrize("plan", ["replicate", "fsdp"])
def test_no_cross_island_collective_on_a_2x8xh100_target(plan):
    """Two H100 nodes as two islands (compile-only): the inner step crosses nothing."""
    mesh = sx.make_mesh({"island": 2, "data": 8}, devices=sx.target("2x8xH100"))
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=_plan(mesh, plan),
                              diloco=sx.DiLoCo(inner_steps=50))  # fmt: skip
    state = step.abstract(nnx.eval_shape(_state))
    batch = {"x": jax.ShapeDtypeStruct((64, 8), jnp.float32),
             "y": jax.ShapeDtypeStruct((64,), jnp.float32)}  # fmt: skip
    traffic = step.traffic(state, batch)
    assert len(traffic.inner) == 0
    assert traffic.outer.ops and {c.op for c in traffic.outer.ops} <= {"all-reduce"}


@pytest.mark.skipif(not hasattr(jax.sharding, "no_collectives"), reason="JAX < 0.12")
def test_inner_step_traces_under_no_collectives_over_the_island_axis():
    """JAX 0.12's own check: on Explicit axes the inner step traces with
    ``jax.sharding.no_collectives({"island"})``, which refuses the outer step's reduction
    and DP's gradient all-reduce across the islands."""
    mesh = sx.make_mesh({"island": 2, "data": 4}, axis_types=jax.sharding.AxisType.Explicit)
    step = sx.make_train_step(loss_fn, mesh=mesh, diloco=sx.DiLoCo(inner_steps=2))
    state, batch = step.shard(_state()), _batches(1)[0]
    dp = sx.make_train_step(loss_fn, mesh=mesh, data_axis=("island", "data"))
    with jax.sharding.no_collectives({"island"}):
        step.lower(state, batch).compile()
        with pytest.raises(Exception, match="forbidden by `no_collectives`"):
            step.lower_outer(state)
        with pytest.raises(Exception, match="forbidden by `no_collectives`"):
            dp.lower(dp.shard(_state()), batch)
    state, metrics = step(state, batch)  # and it runs on Explicit axes, outer step included
    synced = step.outer(state)
    assert np.isfinite(np.asarray(metrics["loss"])).all() and int(synced.outer.syncs) == 1


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 2048, rngs=rngs)
        self.l2 = nnx.Linear(2048, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


@pytest.mark.compile_only("gpu")
def test_estimate_prices_diloco_against_dp_over_a_slow_link():
    """sx.estimate on two H100 nodes joined by 10 Gb/s (``links=``): DiLoCo at H=50 sends
    >= 50x fewer bytes between the hosts per step than DP, and is predicted faster."""
    mesh = sx.make_mesh({"island": 2, "data": 8}, devices=sx.target("2x8xH100"))
    state = nnx.eval_shape(lambda: sx.TrainState.create(Wide(nnx.Rngs(0)), optax.adamw(1e-3)))
    batch = {"x": jax.ShapeDtypeStruct((256, 8), jnp.float32),
             "y": jax.ShapeDtypeStruct((256,), jnp.float32)}  # fmt: skip
    links = {"inter-host": 1.25e9}
    dp = sx.make_train_step(loss_fn, mesh=mesh, data_axis=("island", "data"))
    diloco = sx.make_train_step(loss_fn, mesh=mesh, diloco=sx.DiLoCo(inner_steps=50))
    a, b = (sx.estimate(s, state, batch, links=links) for s in (dp, diloco))
    assert b.outer is not None and b.inner_steps == 50 and "inter-host" not in b.link_bytes()
    assert a.per_step_link_bytes()["inter-host"] >= 50 * b.per_step_link_bytes()["inter-host"]
    assert b.per_step_s < a.per_step_s
    assert "DiLoCo, H=50" in str(b)


def test_an_all_reduce_start_carrying_its_operands_counts_its_result_once():
    """JAX 0.12's XLA:GPU writes an async all-reduce as ``((operands), results)``: the
    bytes are the results' (the outer step's reduction was counted twice)."""
    from shardax.cost.hlo import collectives

    line = ("%s = ((f32[20481]{0}), f32[20481]{0}) all-reduce-start(%c), channel_id=1, "
            "replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add")  # fmt: skip
    (c,) = collectives("ENTRY %main {\n  " + line + "\n}", 2)
    assert c.bytes == 20481 * 4 and c.shapes == ((20481,),)
