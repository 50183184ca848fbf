"""Plans on arrays and ShapeDtypeStructs: rules, NNX annotations, optimizer state,
validate, describe and init_sharded, checked against real placements."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx


def mlp_params(sizes=(16, 32, 32, 8)):
    return {
        "layers": [
            {"kernel": jnp.ones((a, b)), "bias": jnp.zeros((b,))}
            for a, b in itertools.pairwise(sizes)
        ]
    }


def test_rules_first_match_wins_search_and_default(mesh_2d):
    plan = sx.rules(
        mesh_2d,
        [
            (r"layers/1/kernel", P(None, "model")),  # re.search: matches inside longer paths
            (r"layers/\d+/kernel", P("data")),
            (r"^bias$", P("model")),  # anchored: only a top-level "bias" leaf
        ],
        default=P(),
    )
    tree = {"params": mlp_params(), "bias": jnp.zeros(4)}
    specs = plan.specs(tree)
    layers = specs["params"]["layers"]
    assert layers[1]["kernel"] == P(None, "model")  # first match, although rule 2 matches too
    assert layers[0]["kernel"] == P("data") and layers[2]["kernel"] == P("data")
    assert layers[0]["bias"] == P()  # "^bias$" does not match "params/layers/0/bias"
    assert specs["bias"] == P("model")
    placed = sx.shard(tree, plan)
    w = placed["params"]["layers"][1]["kernel"]
    assert w.sharding.spec == P(None, "model")
    assert {s.data.shape for s in w.addressable_shards} == {(32, 16)}
    np.testing.assert_array_equal(np.asarray(w), np.ones((32, 32)))


def test_rules_default_plan_and_bad_rules(mesh_2d):
    plan = sx.rules(mesh_2d, [(r"kernel", P(None, "model"))], default=sx.fsdp(mesh_2d, min_size=1))
    specs = plan.specs({"kernel": np.ones((4, 4)), "emb": np.ones((8, 3))})
    assert specs == {"kernel": P(None, "model"), "emb": P("data", None)}
    with pytest.raises(ValueError, match=r"rules\[0\].*PartitionSpec.*\('data',\)"):
        sx.rules(mesh_2d, [("w", ("data",))])
    with pytest.raises(ValueError, match=r"rules\[0\].*'\('.*not a valid regular expression"):
        sx.rules(mesh_2d, [("(", P())])
    with pytest.raises(ValueError, match="default must be"):
        sx.rules(mesh_2d, [], default="data")


def test_plans_accept_shape_dtype_structs_and_scalars_stay_replicated(mesh_2d):
    abstract = jax.eval_shape(lambda: {"w": jnp.ones((64, 8)), "step": jnp.zeros((), jnp.int32)})
    shardings = sx.rules(mesh_2d, [(".*", P("data"))])(abstract)
    assert shardings["w"] == NamedSharding(mesh_2d, P("data"))
    assert shardings["step"].spec == P()


def test_validate_collects_every_error_and_apply_raises_the_same(mesh_2d):
    tree = {
        "indivisible": jax.ShapeDtypeStruct((6, 4), jnp.float32),
        "missing": jax.ShapeDtypeStruct((8, 4), jnp.float32),
        "twice": jax.ShapeDtypeStruct((8, 4), jnp.float32),
        "too_long": jax.ShapeDtypeStruct((8,), jnp.float32),
        "ok": jax.ShapeDtypeStruct((8, 4), jnp.float32),
    }
    plan = sx.rules(
        mesh_2d,
        [
            ("indivisible", P("data")),
            ("missing", P("tensor")),
            ("twice", P("model", "model")),
            ("too_long", P("data", None)),
            ("ok", P("data", "model")),
        ],
    )
    errors = sx.plan.validate(tree, plan)
    assert len(errors) == 4
    text = "\n".join(errors)
    assert "'indivisible' with shape (6, 4): dimension 0 of size 6" in text
    assert "size 4 of mesh axis 'data'" in text
    assert "'missing' with shape (8, 4)" in text and "'tensor', which is not in the mesh" in text
    assert "'data': 4, 'model': 2" in text  # the mesh's axis sizes are named
    assert "'twice' with shape (8, 4)" in text and "'model' (size 2) twice" in text
    assert "'too_long' with shape (8,)" in text and "more than the rank 1" in text
    with pytest.raises(ValueError) as info:
        plan(tree)
    for error in errors:
        assert error in str(info.value)
    # On the "ok" leaf alone no spec errs; the four other rules are reported as matching nothing.
    notes = sx.plan.validate({"ok": tree["ok"]}, plan)
    assert len(notes) == 4 and all("gives no leaf its spec" in n for n in notes)


def test_follow_params_shards_adam_state_like_params_whatever_the_plan(mesh_2d):
    params = mlp_params()
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    # Anchored rules only name params paths, and a catch-all would break scalars.
    base = sx.rules(mesh_2d, [(r"^params/layers/1/kernel$", P(None, "model")), (".*", P())])
    plan = sx.plan.follow_params(base)
    specs = plan.specs(state)
    adam = specs["opt_state"][0]
    for tree in (specs["params"], adam.mu, adam.nu):
        assert tree["layers"][1]["kernel"] == P(None, "model")
        assert tree["layers"][0]["kernel"] == P()
    assert adam.count == P()
    placed = sx.shard(state, plan)
    mu = placed["opt_state"][0].mu["layers"][1]["kernel"]
    assert mu.sharding == placed["params"]["layers"][1]["kernel"].sharding
    assert placed["opt_state"][0].count.sharding.spec == P()
    # Without follow_params the anchored rule does not reach mu.
    assert base.specs(state)["opt_state"][0].mu["layers"][1]["kernel"] == P()
    with pytest.raises(ValueError, match="params='model': no 'model'"):
        sx.plan.follow_params(base, params="model").specs(state)
    # Idempotent: a plan that follows the params already is itself (zero1's too)
    zero1 = sx.zero1(mesh_2d)
    assert sx.plan.follow_params(plan) is plan and sx.plan.follow_params(zero1) is zero1
    assert sx.plan.follow_params(plan, params="model").params == "model"


def test_init_sharded_builds_each_shard_in_place(mesh_2d):
    def init(key, width):
        return {"w": jax.random.normal(key, (64, width)), "count": jnp.zeros((), jnp.int32)}

    plan = sx.fsdp(mesh_2d, axis=("data", "model"), min_size=1)
    state = sx.plan.init_sharded(init, plan, jax.random.key(0), 16)
    assert state["w"].sharding.spec == P(("data", "model"), None)
    assert {s.data.shape for s in state["w"].addressable_shards} == {(8, 16)}
    np.testing.assert_allclose(state["w"], init(jax.random.key(0), 16)["w"], rtol=1e-6)
    with pytest.raises(ValueError, match="not divisible"):
        sx.plan.init_sharded(lambda: {"w": jnp.ones((6, 6))}, sx.rules(mesh_2d, [("w", P("data"))]))


class Annotated(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16,
            32,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            32, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
        )


def test_from_nnx_maps_logical_names_onto_any_mesh(mesh_2d):
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Annotated(nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    tp = sx.from_nnx(mesh_2d, abstract, {"embed": None, "mlp": "model"})
    specs = tp.specs(state)
    assert specs["up"]["kernel"].get_value() == P(None, "model")
    assert specs["up"]["bias"].get_value() == P("model")
    assert specs["down"]["kernel"].get_value() == P("model", None)
    assert specs["down"]["bias"].get_value() == P()  # not annotated: the default
    # The same model on a data-only mesh: another mapping, no change to the model.
    dp_mesh = sx.make_mesh({"data": 8})
    fsdp_like = sx.from_nnx(dp_mesh, abstract, {"embed": "data", "mlp": None})
    assert fsdp_like.specs(state)["up"]["kernel"].get_value() == P("data", None)
    # A train state holding the params: prefixes and Adam's mu/nu match by path suffix.
    train_state = {"params": state, "opt_state": optax.adam(1e-3).init(state)}
    mu = tp.specs(train_state)["opt_state"][0].mu
    assert mu["down"]["kernel"].get_value() == P("model", None)
    # A mapping onto an axis the mesh lacks is reported, not guessed around.
    errors = sx.plan.validate(
        state, sx.from_nnx(dp_mesh, abstract, {"embed": None, "mlp": "model"})
    )
    assert errors and "'model', which is not in the mesh" in errors[0]
    with pytest.raises(ValueError, match=re.escape("logical axis 'mlp' has no entry")):
        sx.from_nnx(mesh_2d, abstract, {"embed": None})


def test_describe_reports_bytes_per_device_as_table_and_data(mesh_2d):
    tree = {"w": jax.ShapeDtypeStruct((1024, 16), jnp.float32), "b": jnp.zeros(16, jnp.bfloat16)}
    report = sx.describe(tree, sx.fsdp(mesh_2d))
    rows = {r.path: r for r in report.rows}
    assert rows["w"].spec == P("data", None) and rows["w"].bytes_per_device == 1024 * 16
    assert (
        rows["b"].spec == P() and rows["b"].bytes_per_device == 32 and rows["b"].dtype == "bfloat16"
    )
    assert report.total_bytes_per_device == 1024 * 16 + 32
    assert report.total_bytes == 1024 * 16 * 4 + 32
    text = str(report)
    for piece in ("w", "(1024, 16)", "float32", "('data', None)", "16.00 KiB", "total"):
        assert piece in text
    assert {d["path"]: d["spec"] for d in report.to_dicts()} == {
        "w": str(P("data", None)),
        "b": str(P()),
    }
    # Without a plan: the leaves' own shardings; NumPy leaves are unplaced.
    placed = sx.shard({"w": np.ones((64, 8), np.float32)}, sx.fsdp(mesh_2d, min_size=1))
    own = sx.describe({**placed, "host": np.ones(3, np.float32)})
    rows = {r.path: r for r in own.rows}
    assert rows["w"].spec == P("data", None) and rows["w"].bytes_per_device == 16 * 8 * 4
    assert rows["w"].bytes_per_device == placed["w"].addressable_shards[0].data.nbytes
    assert rows["host"].spec is None and rows["host"].bytes_per_device == 12
