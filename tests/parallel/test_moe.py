"""sx.moe against a dense single-device reference whose drop rule is written in NumPy.

Small shapes, one compiled function per configuration (cached): 8 experts of a tanh MLP
(d=8, hidden 16), 16 × 8 tokens, top-2. On mesh data=2,expert=4 and expert=8 the tokens
form 8 routing groups of 16; with no mesh, one group of 128.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.hlo import collectives
from shardax.parallel import experts as moe_module
from shardax.parallel.experts import GATE_STEPS, capacity, choose_dispatch, moe

E, D, H, K = 8, 8, 16, 2
BATCH, LEN = 16, 8
MESHES = {"none": None, "data2_expert4": {"data": 2, "expert": 4}, "expert8": {"expert": 8}}
NO_DROPS, DROPS = 8.0, 1.0


def ffn(p, h):
    return jnp.tanh(h @ p["w1"]) @ p["w2"]


def _inputs():
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(E, D, H)).astype(np.float32) / 3,
        "w2": rng.normal(size=(E, H, D)).astype(np.float32) / 4,
    }
    x = rng.normal(size=(BATCH, LEN, D)).astype(np.float32)
    router = rng.normal(size=(D, E)).astype(np.float32)
    cotangent = rng.normal(size=(BATCH, LEN, D)).astype(np.float32)
    return x, router, params, cotangent


X, ROUTER, PARAMS, COT = _inputs()


# -- the reference -----------------------------------------------------------------------


def numpy_routing(x, router, groups, capacity_factor, top_k=K):
    """Top-k experts, renormalised gates and the keep mask, per group, in NumPy: each
    expert keeps its C assignments of highest gate (in steps of 1/GATE_STEPS), ties to
    the earlier token."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    gates = np.take_along_axis(probs, experts, -1)
    gates /= gates.sum(-1, keepdims=True)
    keep = np.zeros(experts.shape, bool)
    per = x.shape[0] // groups
    cap = min(per, math.ceil(capacity_factor * per * top_k / E))
    for g in range(groups):
        for e in range(E):
            queue = [
                (-np.round(gates[t, j] * GATE_STEPS), t, j)
                for t in range(g * per, (g + 1) * per)
                for j in range(top_k)
                if experts[t, j] == e
            ]
            for _, t, j in sorted(queue)[:cap]:
                keep[t, j] = True
    lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    counts = np.bincount(experts.ravel(), minlength=E)
    aux = {
        "balance_loss": E * np.sum(counts / experts.size * probs.mean(0)),
        "z_loss": np.mean(lse**2),
        "dropped_fraction": 1 - keep.mean(),
        "tokens_per_expert": counts,
    }
    return experts, keep, aux


def reference(x, router, params, experts, keep):
    """Each token through its top-k experts (NumPy's choice), weighted by its gates, on
    one device; dropped assignments add zero. Differentiable in x, router and params."""
    x2 = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(x2 @ router, axis=-1)
    gates = jnp.take_along_axis(probs, experts, -1)
    gates = gates / gates.sum(-1, keepdims=True)
    outs = jnp.stack([ffn(jax.tree.map(lambda p, e=e: p[e], params), x2) for e in range(E)])
    tokens = jnp.arange(x2.shape[0])
    y = sum(
        jnp.where(keep[:, j], gates[:, j], 0.0)[:, None] * outs[experts[:, j], tokens]
        for j in range(K)
    )
    return y.reshape(*x.shape[:-1], -1)


def with_grads(fn):
    """``fn(x, router, params) -> y`` as ``(y, (dx, drouter, dparams))`` of ``<y, COT>``."""

    def run(x, router, params):
        y, vjp = jax.vjp(fn, x, router, params)
        return y, vjp(jnp.asarray(COT, y.dtype))

    return run


@functools.cache
def expected(groups, capacity_factor):
    experts, keep, aux = numpy_routing(X, ROUTER, groups, capacity_factor)
    ref = jax.jit(with_grads(lambda x, r, p: reference(x, r, p, experts, keep)))
    return ref(X, ROUTER, PARAMS), aux


def assert_close(actual, desired, rtol=1e-5, atol=1e-6):
    jax.tree.map(
        lambda a, d: np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol, atol),
        actual,
        desired,
    )


def check_aux(aux, want):
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), want["tokens_per_expert"])
    for name in ("balance_loss", "z_loss", "dropped_fraction"):
        np.testing.assert_allclose(float(getattr(aux, name)), want[name], rtol=1e-5, err_msg=name)


@functools.cache
def compiled(dispatch, capacity_factor):
    """One jitted ``(y, grads), aux`` per configuration; traced under whatever mesh is set."""

    def run(x, router, params):
        fn = lambda x, r, p: moe(  # noqa: E731
            x, r, ffn, p, top_k=K, capacity_factor=capacity_factor, dispatch=dispatch
        )
        y_grads = with_grads(lambda x, r, p: fn(x, r, p)[0])(x, router, params)
        return y_grads, fn(x, router, params)[1]

    return jax.jit(run)


def mesh_of(name, axis_types=AxisType.Auto):
    return None if MESHES[name] is None else sx.make_mesh(MESHES[name], axis_types=axis_types)


def expert_placed(mesh, params):
    return jax.device_put(params, NamedSharding(mesh, P("expert")))


# -- equal to the reference --------------------------------------------------------------


CASES = [
    (mesh_name, dispatch, cf)
    for mesh_name in MESHES
    for dispatch in ("all_to_all", "dense")
    for cf in (NO_DROPS, DROPS)
    if mesh_name != "none" or cf == DROPS  # with no mesh, one group: drops cover it
]


@pytest.mark.parametrize(("mesh_name", "dispatch", "capacity_factor"), CASES)
def test_output_gradients_and_aux_equal_the_reference(mesh_name, dispatch, capacity_factor):
    mesh = mesh_of(mesh_name)
    groups = 1 if mesh is None else 8
    (want, want_grads), want_aux = expected(groups, capacity_factor)
    fn = compiled(dispatch, capacity_factor)
    if mesh is None:
        (y, grads), aux = fn(X, ROUTER, PARAMS)
    else:
        x = jax.device_put(X, sx.batch_sharding(mesh, ("data", "expert")[2 - len(mesh.shape) :]))
        with jax.set_mesh(mesh):
            (y, grads), aux = fn(x, ROUTER, expert_placed(mesh, PARAMS))
    assert_close(y, want)
    assert_close(grads, want_grads)
    check_aux(aux, want_aux)
    assert (float(aux.dropped_fraction) > 0) == (capacity_factor == DROPS)


def test_data_only_mesh_routes_as_data_times_expert():
    """data=8 (every expert on every device) has the 8 routing groups of data=2 × expert=4,
    so the same drops and the same result: a model's losses agree on the two meshes."""
    mesh = sx.make_mesh({"data": 8})
    (want, want_grads), want_aux = expected(8, DROPS)
    with jax.set_mesh(mesh):
        (y, grads), aux = compiled("all_to_all", DROPS)(X, ROUTER, PARAMS)
    assert_close(y, want)
    assert_close(grads, want_grads)
    check_aux(aux, want_aux)


def test_aux_loss_gradients_equal_the_reference():
    """d(balance_loss + z_loss)/d(router, x) against the formulas on one device."""
    mesh = mesh_of("data2_expert4")
    experts, _, _ = numpy_routing(X, ROUTER, 8, DROPS)
    f = np.bincount(experts.ravel(), minlength=E) / experts.size

    def ours(x, r):
        aux = moe(x, r, ffn, PARAMS, top_k=K, capacity_factor=DROPS)[1]
        return aux.balance_loss + aux.z_loss

    def ref(x, r):
        logits = x.reshape(-1, D) @ r
        probs = jax.nn.softmax(logits, axis=-1)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return E * jnp.sum(f * probs.mean(0)) + jnp.mean(lse**2)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(X, ROUTER)
    assert_close(got, jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(X, ROUTER))


def test_explicit_mesh_axes():
    mesh = mesh_of("data2_expert4", AxisType.Explicit)
    (want, want_grads), want_aux = expected(8, DROPS)
    x = jax.device_put(X, sx.batch_sharding(mesh, ("data", "expert")))
    router = jax.device_put(ROUTER, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        (y, grads), aux = compiled("all_to_all", DROPS)(x, router, expert_placed(mesh, PARAMS))
    assert_close(y, want)
    assert_close(grads, want_grads)
    check_aux(aux, want_aux)
    assert y.sharding.spec == P(("data", "expert"), None, None)
    assert grads[2]["w1"].sharding.spec[0] == "expert"


def test_inside_the_users_shard_map():
    mesh = mesh_of("data2_expert4")
    (want, _), want_aux = expected(8, DROPS)

    def local(x, router, params):  # params: this device's E/4 experts
        return moe(x, router, ffn, params, top_k=K, capacity_factor=DROPS)

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(("data", "expert")), P(), P("expert")),
            out_specs=(P(("data", "expert")), P()),
        )
    )
    y, aux = fn(X, ROUTER, PARAMS)
    assert_close(y, want)
    check_aux(aux, want_aux)


def test_remat_and_fsdp_over_data():
    """A residual block under sx.remat, the router fsdp-sharded over data, the batch
    over data × expert: gradients equal the reference's."""
    mesh = mesh_of("data2_expert4")
    experts, keep, _ = numpy_routing(X, ROUTER, 8, DROPS)

    def block(params, x, layer):
        y, aux = layer(x, params["router"], params["experts"])
        return jnp.sum((x + y) * COT) + 0.0 * aux.balance_loss

    def ours(x, r, p):
        return moe(x, r, ffn, p, top_k=K, capacity_factor=DROPS)[0], moe_module.MoEAux(*[0.0] * 4)

    def ref(x, r, p):
        return reference(x, r, p, experts, keep), moe_module.MoEAux(*[0.0] * 4)

    params = {"router": ROUTER, "experts": PARAMS}
    plan = sx.rules(mesh, [(r"experts", P("expert"))], default=sx.fsdp(mesh, min_size=0))
    placed = jax.device_put(params, plan(params))
    assert placed["router"].sharding.spec[0] == "data"
    x = jax.device_put(X, sx.batch_sharding(mesh, ("data", "expert")))
    remat_block = sx.remat(functools.partial(block, layer=ours), policy="dots")
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(remat_block))(placed, x)
    want = jax.jit(jax.grad(functools.partial(block, layer=ref)))(params, X)
    assert_close(grads, want)
    assert grads["experts"]["w2"].sharding.spec[0] == "expert"


def test_trains_in_make_train_step_with_accumulation_like_one_device():
    """sx.make_train_step (jit, data=2 × expert=4, accumulate=2) against mode='single':
    with nothing dropped the routing groups do not matter, so losses and params agree.
    (The balance loss is not linear in the tokens: under accumulation it is each
    microbatch's, so it is left out of the loss here.)"""
    import optax

    mesh = mesh_of("data2_expert4")

    def apply(params, x):
        y, aux = moe(x, params["router"], ffn, params["experts"], capacity_factor=NO_DROPS)
        return x + y, aux

    def loss_fn(model, batch):
        h, _ = model(batch["x"])
        return jnp.mean((h - batch["y"]) ** 2)

    def state():
        params = {"router": ROUTER, "experts": PARAMS}
        return sx.TrainState.from_params(params, apply, optax.sgd(0.5))

    batch = {"x": X, "y": COT}
    plan = sx.rules(mesh, [(r"experts", P("expert"))])
    results = []
    for step in (
        sx.make_train_step(loss_fn, mesh=mesh, mode="single"),
        sx.make_train_step(
            loss_fn, mesh=mesh, plan=plan, accumulate=2, data_axis=("data", "expert")
        ),
    ):
        s, losses = step.shard(state()), []
        for _ in range(2):
            s, metrics = step(s, batch)
            losses.append(float(metrics["loss"]))
        results.append((s.params, losses))
    (want, want_losses), (got, losses) = results
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_close(got, want)
    assert got["experts"]["w1"].sharding.spec[0] == "expert"


# -- placement and communication ---------------------------------------------------------


def test_expert_params_split_one_eighth_per_device_and_all_to_all_in_hlo():
    mesh = mesh_of("expert8")
    placed = expert_placed(mesh, PARAMS)
    for shard in placed["w1"].addressable_shards:
        assert shard.data.shape == (E // 8, D, H)
    x = jax.device_put(X, sx.batch_sharding(mesh, "expert"))
    with jax.set_mesh(mesh):
        hlo = compiled("all_to_all", NO_DROPS).lower(x, ROUTER, placed).compile().as_text()
    ops = [c.op for c in collectives(hlo)]
    assert ops.count("all-to-all") >= 4, ops  # tokens out and back, and again for the grads
    assert "all-gather" not in ops, ops  # the experts never gather


@pytest.mark.parametrize("rules", [{"expert": "expert", "embed": None, "mlp": None}, None])
def test_from_nnx_maps_the_logical_expert_axis(rules):
    from flax import nnx

    class Experts(nnx.Module):
        def __init__(self):
            init = nnx.with_partitioning(nnx.initializers.normal(), ("expert", "embed", "mlp"))
            self.w1 = nnx.Param(init(jax.random.key(0), (E, D, H)))

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(Experts)
    mesh = mesh_of("data2_expert4")
    rules = rules or {"embed": None, "mlp": None}  # "expert" is also the mesh axis's name
    state = nnx.state(model)
    report = sx.describe(state, sx.from_nnx(mesh, model, rules))
    (row,) = report.rows
    assert row.spec == P("expert", None, None)
    assert row.bytes_per_device * 4 == row.bytes == E * D * H * 4


# -- ragged and auto ---------------------------------------------------------------------


def test_ragged_is_refused_by_name_on_xla_cpu():
    ok, why = moe_module.ragged_support("cpu")
    assert not ok and "ragged" in why
    mesh = mesh_of("data2_expert4")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"dispatch='ragged'.*XLA:CPU"):
        jax.jit(lambda x: moe(x, ROUTER, ffn, PARAMS, dispatch="ragged")[0])(X)


def test_ragged_lowers_with_ragged_all_to_all_both_ways(monkeypatch):
    """XLA:CPU cannot compile it, so only the lowering is checked here: two ragged
    all-to-alls forward (out and back) and two in the backward pass."""
    monkeypatch.setattr(moe_module, "ragged_support", lambda platform: (True, "lowering only"))
    mesh = mesh_of("data2_expert4")
    with jax.set_mesh(mesh):
        lowered = compiled("ragged", NO_DROPS).trace(X, ROUTER, PARAMS).lower()
    assert lowered.as_text().count("ragged_all_to_all") == 4


def test_auto_says_which_and_why():
    assert choose_dispatch(8, 2, 1.25, 4)[0] == "all_to_all"
    dispatch, why = choose_dispatch(4, 2, 1.25, 4)
    assert dispatch == "dense" and "E=4" in why
    assert choose_dispatch(8, 2, 1.25, 4, "dense") == ("dense", "asked for")
    assert capacity(64, 8, 2, 1.25) == 20 and capacity(4, 8, 2, 100.0) == 4


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 9}, r"top_k must be <= the number of experts E=8.*got 9"),
        ({"top_k": 0}, r"top_k must be an integer >= 1, got 0"),
        ({"capacity_factor": 0.0}, r"capacity_factor must be a finite number > 0, got 0.0"),
        ({"capacity_factor": True}, r"capacity_factor must be .* got True"),
        ({"dispatch": "ring"}, r"dispatch must be one of .* got 'ring'"),
        (
            {"params": {"w1": PARAMS["w1"][:4], "w2": PARAMS["w2"]}},
            r"leading \(experts\).*\['w1'\]",
        ),
        ({"router": ROUTER[:, :6]}, r"E=6 is not divisible by the size 4 of mesh axis 'expert'"),
        ({"x": X[:12]}, r"leading \(batch\) dimension 12 is not divisible by the 8 routing groups"),
        ({"axis": "experts"}, r"axis 'experts' is not in the mesh"),
        ({"batch_axes": ("replica",)}, r"batch_axes entry 'replica' is not in the mesh"),
        ({"x": X[0, 0]}, r"x must be \(tokens, d\) or \(batch, length, d\)"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(kwargs, match):
    x, router, params = kwargs.pop("x", X), kwargs.pop("router", ROUTER), PARAMS
    params = kwargs.pop("params", params)
    if "router" not in kwargs and router.shape[1] != E:
        params = jax.tree.map(lambda p: p[: router.shape[1]], params)
    with jax.set_mesh(mesh_of("data2_expert4")), pytest.raises(ValueError, match=match):
        moe(x, router, ffn, params, **kwargs)


# -- the GPT's MoE MLP -------------------------------------------------------------------


def test_gpt_moe_trains_alike_on_data_and_data_times_expert():
    """GPT with 4 experts in every 2nd block: 3 Adam steps on data=8 and on data=2 ×
    expert=4 (the same 8 routing groups) give the same losses; the experts are split."""
    import optax
    from flax import nnx

    from shardax.models import gpt
    from shardax.plan.tree import path_str

    cfg = gpt.GPTConfig(layers=2, d_model=32, heads=4, max_seq_len=16, experts=4, moe_every=2)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, 16)), jnp.int32)

    def lm_loss(model, batch):
        logits, aux = model(batch[:, :-1], return_aux=True)
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, batch[:, 1:, None], -1).mean()
        return nll + 1e-2 * aux.balance_loss

    make_gpt = nnx.jit(lambda: gpt.make_gpt(cfg))  # one program, not one per initialiser
    runs = {}
    for spec in ({"data": 8}, {"data": 2, "expert": 4}):
        mesh = sx.make_mesh(spec)
        model = make_gpt()
        plan = gpt.plan(mesh, model, "replicate")
        step = sx.make_train_step(lm_loss, mesh=mesh, plan=plan, data_axis=tuple(spec))
        state, losses = step.shard(sx.TrainState.create(model, optax.adam(1e-2))), []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[len(spec)], last = losses, state
    np.testing.assert_allclose(runs[2], runs[1], rtol=1e-5)
    assert runs[1][-1] < runs[1][0]
    ups = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(last)[0]
        if path_str(path).endswith("moe/up/value") or path_str(path).endswith("moe/up")
    ]
    assert ups, "no expert weights found in the train state"
    for leaf in ups:  # (moe layers, E, d, 4d): 1 of the 4 experts per device
        assert leaf.addressable_shards[0].data.shape[1] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"experts": 4, "top_k": 5}, r"top_k=5 must be <= experts=4"),
        ({"experts": 4, "moe_every": 3}, r"moe_every=3 must divide layers=2"),
        ({"experts": -1}, r"experts must be an integer >= 0, got -1"),
    ],
)
def test_gpt_moe_config_is_checked(kwargs, match):
    from shardax.models import gpt

    with pytest.raises(ValueError, match=match):
        gpt.GPTConfig(layers=2, d_model=32, heads=4, **kwargs)
