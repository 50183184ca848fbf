"""A batch whose leaves are not examples: a jraph GraphsTuple (a NamedTuple with its
fields stands in), 192 nodes, 512 edges and 16 graphs, senders and receivers indexing
the whole batch, as flax's ogbg_molpcba example feeds it. With batch_spec= it trains
under jit with every plan as its own one-device loop does; the modes that split rows
as examples refuse it by name."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx

NODES, EDGES, GRAPHS = 192, 512, 16
TX = optax.adam(1e-2)


class GraphsTuple(NamedTuple):  # jraph.GraphsTuple's fields
    nodes: np.ndarray
    edges: np.ndarray
    receivers: np.ndarray
    senders: np.ndarray
    globals: np.ndarray
    n_node: np.ndarray
    n_edge: np.ndarray


def graphs(seed):
    rng = np.random.default_rng(seed)
    n_node = np.full(GRAPHS, NODES // GRAPHS, np.int32)
    n_edge = np.full(GRAPHS, EDGES // GRAPHS, np.int32)
    offset = np.repeat(np.arange(GRAPHS) * (NODES // GRAPHS), EDGES // GRAPHS)
    local = lambda: rng.integers(0, NODES // GRAPHS, EDGES)  # noqa: E731
    return GraphsTuple(
        nodes=rng.normal(size=(NODES, 4)).astype(np.float32),
        edges=rng.normal(size=(EDGES, 3)).astype(np.float32),
        receivers=(offset + local()).astype(np.int32),
        senders=(offset + local()).astype(np.int32),
        globals=rng.normal(size=(GRAPHS, 1)).astype(np.float32),  # the targets
        n_node=n_node,
        n_edge=n_edge,
    )


def gnn(params, g):
    """One message-passing layer and a per-graph readout."""
    messages = jnp.tanh(jnp.concatenate([g.nodes[g.senders], g.edges], axis=1) @ params["edge"])
    incoming = jax.ops.segment_sum(messages, g.receivers, num_segments=NODES)
    h = jnp.tanh(jnp.concatenate([g.nodes, incoming], axis=1) @ params["node"])
    graph = jnp.repeat(jnp.arange(GRAPHS), g.n_node, total_repeat_length=NODES)
    pooled = jax.ops.segment_sum(h, graph, num_segments=GRAPHS) / g.n_node[:, None]
    return pooled @ params["out"]


def loss_fn(model, g):
    return jnp.mean((model(g) - g.globals) ** 2)


def init():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "edge": jax.random.normal(k1, (7, 16)) * 0.3,
        "node": jax.random.normal(k2, (20, 16)) * 0.3,
        "out": jax.random.normal(k3, (16, 1)) * 0.3,
    }


BATCHES = [graphs(i) for i in range(3)]


def own_loop():
    """The program's own loop, on one device."""
    params, losses = init(), []
    opt_state = TX.init(params)

    @jax.jit
    def step(params, opt_state, g):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(lambda g: gnn(p, g), g))(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for g in BATCHES:
        params, opt_state, loss = step(params, opt_state, g)
        losses.append(float(loss))
    return losses, params


@pytest.fixture(scope="module")
def reference():
    return own_loop()


def train(step, batches):
    state = step.shard(sx.TrainState.from_params(init(), gnn, TX))
    losses = []
    for g in batches:
        state, metrics = step(state, g)
        losses.append(float(metrics["loss"]))
    return losses, state.params


# Split nodes and edges over the data axis, the per-graph leaves whole on every device.
BY_FIELD = GraphsTuple(P("data"), P("data"), P("data"), P("data"), P(), P(), P())

PLANS = {
    "replicate": lambda mesh: None,
    "fsdp": lambda mesh: sx.fsdp(mesh, min_size=16),
    "zero1": lambda mesh: sx.zero1(mesh),
    "tp": lambda mesh: sx.rules(mesh, [(r"(edge|node)", P(None, "model"))]),
}


@pytest.mark.parametrize(
    ("plan", "batch_spec"),
    [("replicate", P()), ("fsdp", BY_FIELD), ("zero1", P()), ("tp", BY_FIELD)],
)
def test_graph_batch_trains_under_jit_with_every_plan(plan, batch_spec, reference):
    mesh = sx.make_mesh({"data": 4, "model": 2})
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=PLANS[plan](mesh), batch_spec=batch_spec)
    losses, params = train(step, BATCHES)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_single_and_placed_by_prepare_and_prefetch(reference, mesh):
    single = sx.make_train_step(loss_fn, mesh=mesh, mode="single", batch_spec=P())
    np.testing.assert_allclose(train(single, BATCHES)[0], reference[0], rtol=1e-5)
    loader = sx.prepare(iter(BATCHES), mesh=mesh, batch_spec=BY_FIELD)
    placed = list(loader)
    assert placed[0].nodes.shape == (NODES, 4)
    assert placed[0].nodes.sharding.spec == P("data")
    assert placed[0].n_node.sharding.spec == P() and placed[0].n_node.sharding.mesh == mesh
    prefetched = list(sx.prefetch_to_device(iter(BATCHES), mesh, batch_spec=P()))
    assert prefetched[0].senders.sharding.is_fully_replicated
    # the step takes the placed batches as they are
    step = sx.make_train_step(loss_fn, mesh=mesh, batch_spec=BY_FIELD)
    np.testing.assert_allclose(train(step, placed)[0], reference[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", [{"mode": "shard_map"}, {"mode": "pmap"}, {"accumulate": 2}])
def test_modes_that_split_rows_as_examples_are_refused_by_name(how, mesh):
    with pytest.raises(ValueError, match=r"batch_spec=.* not examples .* Use mode='jit'"):
        sx.make_train_step(loss_fn, mesh=mesh, batch_spec=P(), **how)


def test_without_batch_spec_the_refusal_names_it(mesh):
    step = sx.make_train_step(loss_fn, mesh=mesh)
    with pytest.raises(ValueError, match=r"disagree on the batch size .* batch_spec=P\(\)"):
        step(step.shard(sx.TrainState.from_params(init(), gnn, TX)), BATCHES[0])
    with pytest.raises(TypeError, match="batch_spec must be a PartitionSpec"):
        sx.make_train_step(loss_fn, mesh=mesh, batch_spec="whole")


# A graph batch padded to equal leaf sizes (16 nodes, 16 edges, 16 graph slots, as
# jraph.pad_with_graphs can make it): its leaves agree on dimension 0, so only its type
# says the rows are not examples.
PAD = 16


def padded_graphs(seed):
    rng = np.random.default_rng(seed)
    n_node = np.array([5, 4, 4, 3] + [0] * (PAD - 4), np.int32)
    n_edge = np.array([6, 4, 3, 3] + [0] * (PAD - 4), np.int32)
    starts = np.repeat(np.cumsum(n_node) - n_node, n_edge)
    sizes = np.repeat(n_node, n_edge)
    pick = lambda: (starts + rng.integers(0, 1 << 20, PAD) % sizes).astype(np.int32)  # noqa: E731
    return GraphsTuple(
        nodes=rng.normal(size=(PAD, 4)).astype(np.float32),
        edges=rng.normal(size=(PAD, 3)).astype(np.float32),
        receivers=pick(),
        senders=pick(),
        globals=rng.normal(size=(PAD, 1)).astype(np.float32),
        n_node=n_node,
        n_edge=n_edge,
    )


def padded_gnn(params, g):
    messages = jnp.tanh(jnp.concatenate([g.nodes[g.senders], g.edges], axis=1) @ params["edge"])
    incoming = jax.ops.segment_sum(messages, g.receivers, num_segments=PAD)
    h = jnp.tanh(jnp.concatenate([g.nodes, incoming], axis=1) @ params["node"])
    graph = jnp.repeat(jnp.arange(PAD), g.n_node, total_repeat_length=PAD)
    pooled = jax.ops.segment_sum(h, graph, num_segments=PAD) / jnp.maximum(g.n_node, 1)[:, None]
    real = g.n_node > 0
    return jnp.where(real[:, None], pooled @ params["out"], g.globals)


@pytest.mark.parametrize("how", [{"mode": "shard_map"}, {"mode": "pmap"}, {"accumulate": 2}])
def test_a_padded_graph_batch_is_refused_where_rows_are_split(how, mesh):
    g = padded_graphs(0)
    assert len({leaf.shape[0] for leaf in g}) == 1  # passes the size check
    step = sx.make_train_step(loss_fn, mesh=mesh, **how)
    state = step.shard(sx.TrainState.from_params(init(), padded_gnn, TX))
    with pytest.raises(ValueError, match=r"is a graph batch \(GraphsTuple.* Use mode='jit'"):
        step(state, g)
    # nested in a dict too, named by its path
    with pytest.raises(ValueError, match=r"batch leaf 'graph' is a graph batch"):
        step(state, {"graph": g, "w": np.ones(PAD, np.float32)})


def test_a_padded_graph_batch_trains_under_jit_as_on_one_device(mesh):
    batches = [padded_graphs(i) for i in range(2)]
    params, opt_state, want = init(), TX.init(init()), []
    for g in batches:  # the program's own loop
        loss, grads = jax.value_and_grad(
            lambda p, g=g: loss_fn(functools.partial(padded_gnn, p), g)
        )(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        want.append(float(loss))
    step = sx.make_train_step(loss_fn, mesh=mesh)
    state, got = step.shard(sx.TrainState.from_params(init(), padded_gnn, TX)), []
    for g in batches:
        state, metrics = step(state, g)
        got.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
