"""shardax's programs compiled for an 8xH100 node (and 2 hosts of 4 H100) and a TPU v5e-8
slice without either (``sx.target``): the collectives of each plan read from the compiled
HLO, and model-state memory per device against ``sx.cost``'s formula. Abstract inputs only
(``nnx.eval_shape``, ``jax.ShapeDtypeStruct``): nothing is allocated. CI leg 3."""

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
from shardax.cost.hlo import collectives
from shardax.cost.memory import estimate
from shardax.models import gpt

pytestmark = pytest.mark.compile_only

TARGETS = {"gpu": "8xH100", "tpu": "v5e-8"}
GPT = gpt.GPTConfig(layers=2, d_model=64, heads=4, max_seq_len=64)
BATCH = {
    "inputs": jax.ShapeDtypeStruct((16, 64), jnp.int32),
    "targets": jax.ShapeDtypeStruct((16, 64), jnp.int32),
}


@pytest.fixture(scope="module")
def target():
    return {kind: sx.target(name) for kind, name in TARGETS.items()}


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


class UserMLP(nnx.Module):
    """A user's own NNX model: 2 x 256 x 1024 weights (0.5 M parameters)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(256, 1024, rngs=rngs)
        self.down = nnx.Linear(1024, 256, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


MLP_BATCH = {
    "x": jax.ShapeDtypeStruct((64, 256), jnp.float32),
    "y": jax.ShapeDtypeStruct((64, 256), jnp.float32),
}


def ops(compiled):
    """``{(op, devices per group)}`` of the compiled program's collectives."""
    return {(c.op, c.group) for c in collectives(compiled.as_text())}


def gpt_step(mesh, plan_name):
    model = nnx.eval_shape(lambda: gpt.make_gpt(GPT))
    state = nnx.eval_shape(lambda: sx.TrainState.create(gpt.make_gpt(GPT), optax.adam(1e-3)))
    step = sx.make_train_step(
        lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, plan_name), precision="bf16"
    )
    return step.lower(state, BATCH).compile()


# --- the built-in GPT through make_train_step and its logical axis rules ----------------


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_gpt_fsdp_gathers_params_and_reduces_grads_over_data(target, kind):
    found = ops(gpt_step(sx.make_mesh({"data": 8}, devices=target[kind]), "fsdp"))
    assert ("all-gather", 8) in found
    # The gradients: a reduce-scatter over data on the GPU; XLA:TPU's HLO keeps it as an
    # all-reduce over data whose result each device slices (a fused reduce-scatter).
    assert ("reduce-scatter", 8) in found if kind == "gpu" else ("all-reduce", 8) in found


def test_gpt_tp_all_reduces_within_a_host(target):
    two_hosts = sx.target("2x4xH100")
    mesh = sx.make_mesh({"data": 2, "model": 4}, devices=two_hosts)
    compiled = gpt_step(mesh, "tp")
    assert ("all-reduce", 4) in ops(compiled)
    processes = process_of(mesh)
    for op, groups in replica_groups(compiled.as_text(), mesh.size):
        if op == "all-reduce" and len(groups[0]) == 4:  # the model axis
            assert all(len({processes[i] for i in g}) == 1 for g in groups), groups
    tpu = gpt_step(sx.make_mesh({"data": 2, "model": 4}, devices=target["tpu"]), "tp")
    assert ("all-reduce", 4) in ops(tpu)


# --- HSDP over two hosts: the gradients cross hosts once per step ------------------------


_GROUPS = re.compile(
    r"(all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\(.*?replica_groups="
    r"(\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)


def replica_groups(hlo, num_devices):
    """``[(op, groups)]`` of the collectives of ``hlo``, each group a list of device ids
    (positions in the mesh's device order), from listed or iota replica groups."""
    out = []
    for op, text in _GROUPS.findall(hlo):
        if text.startswith("{"):
            groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", text)]
        else:
            shape, dims, perm = re.fullmatch(
                r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text
            ).groups()
            ids = np.arange(num_devices).reshape([int(d) for d in dims.split(",")])
            if perm:
                ids = ids.transpose([int(p) for p in perm.split(",")])
            groups = ids.reshape([int(s) for s in shape.split(",")]).tolist()
        out.append((op, groups))
    return out


def process_of(mesh):
    return [d.process_index for d in mesh.devices.flat]


def test_hsdp_gradients_cross_hosts_once_per_step():
    mesh = sx.make_mesh({"replica": 2, "fsdp": 4}, devices=sx.target("2x4xH100"))
    state = nnx.eval_shape(lambda: sx.TrainState.create(UserMLP(nnx.Rngs(0)), optax.adam(1e-3)))
    step = sx.make_train_step(
        mse, mesh=mesh, plan=sx.fsdp(mesh, axis="fsdp"), data_axis=("replica", "fsdp")
    )
    hlo = step.lower(state, MLP_BATCH).compile().as_text()
    processes = process_of(mesh)
    crossing = [
        (op, groups)
        for op, groups in replica_groups(hlo, mesh.size)
        if any(len({processes[i] for i in g}) > 1 for g in groups)
    ]
    # Inside each host the gradients are reduce-scattered over fsdp; across hosts each
    # shard is all-reduced over replica (pairs of devices, one per host), in one op.
    grad_shard = (256 * 1024 * 2 + 1024 + 256) * 4 // 4
    assert [op for op, _ in crossing].count("all-reduce") >= 1
    assert all(len(g) == 2 for _, groups in crossing for g in groups)
    big = [c for c in collectives(hlo) if c.group == 2 and c.bytes >= grad_shard // 2]
    assert len(big) == 1 and big[0].count == 1 and big[0].op == "all-reduce", big


# --- context ring, MoE all-to-all, pipeline --------------------------------------------------


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_ring_attention_passes_blocks_round_the_context_axis(target, kind):
    mesh = sx.make_mesh({"context": 8}, devices=target[kind])
    spec = NamedSharding(mesh, P(None, "context"))
    q = jax.ShapeDtypeStruct((2, 512, 4, 64), jnp.bfloat16, sharding=spec)

    def loss(q, k, v):
        return sx.attention(q, k, v, causal=True, impl="ring").astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
    assert any(op == "collective-permute" for op, _ in ops(compiled))


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_moe_all_to_all_sends_tokens_to_their_experts(target, kind):
    mesh = sx.make_mesh({"expert": 8}, devices=target[kind])
    x = jax.ShapeDtypeStruct((16, 32, 64), jnp.float32, sharding=NamedSharding(mesh, P("expert")))
    router = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
    ep = NamedSharding(mesh, P("expert"))
    params = {
        "w1": jax.ShapeDtypeStruct((8, 64, 128), jnp.float32, sharding=ep),
        "w2": jax.ShapeDtypeStruct((8, 128, 64), jnp.float32, sharding=ep),
    }

    def ffn(p, h):
        return jnp.tanh(h @ p["w1"]) @ p["w2"]

    def run(x, router, params):
        return sx.moe(x, router, ffn, params, top_k=2, dispatch="all_to_all")[0].sum()

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(run, argnums=(0, 2))).lower(x, router, params).compile()
    assert ("all-to-all", 8) in ops(compiled)


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_pipeline_passes_activations_between_stages(target, kind):
    mesh = sx.make_mesh({"data": 2, "stage": 4}, devices=target[kind])
    stage = NamedSharding(mesh, P("stage"))
    blocks = {
        "w": jax.ShapeDtypeStruct((8, 128, 128), jnp.float32, sharding=stage),
        "b": jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=stage),
    }
    h = jax.ShapeDtypeStruct((32, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))

    def layer(p, h):
        return jnp.tanh(h @ p["w"] + p["b"])

    def loss(blocks, h):
        return sx.pipeline(layer, blocks, h, microbatches=4, axis="stage").sum()

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(blocks, h).compile()
    assert any(op == "collective-permute" for op, _ in ops(compiled))


# --- memory per device against sx.cost's formula --------------------------------------------


PLANS = {
    "replicate": (sx.replicate, {}),
    "zero1": (sx.zero1, {"zero": 1}),
    "zero2": (sx.zero2, {"zero": 2}),
    "fsdp": (sx.fsdp, {"shard_data": True}),
}


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_params_and_optimizer_state_per_device_follow_the_formula(target, kind, plan_name):
    make_plan, split = PLANS[plan_name]
    mesh = sx.make_mesh({"data": 8}, devices=target[kind])
    state = nnx.eval_shape(lambda: sx.TrainState.create(UserMLP(nnx.Rngs(0)), optax.adam(1e-3)))
    step = sx.make_train_step(mse, mesh=mesh, plan=make_plan(mesh))
    memory = step.lower(state, MLP_BATCH).compile().memory_analysis()
    batch_per_device = 2 * 64 * 256 * 4 // 8
    compiled = memory.argument_size_in_bytes - batch_per_device
    n = (256 * 1024) * 2 + 1024 + 256
    want = estimate(n, "fp32", data=8, **split)
    formula = want.params_bytes + want.master_bytes + want.optimizer_bytes
    assert abs(compiled - formula) <= 0.1 * formula, (compiled, formula)
