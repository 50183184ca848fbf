"""A GPT step compiled for 2 hosts of 4 H100 (``sx.target``, no GPU) on named networks: the
report names the network, its collectives across hosts are priced level by level and
shown as their own exposed line, a slower network prices them slower, an Equinox user's
own jit step is priced alike, and ``sx.search_plans``' default space on a multi-host
target holds the hybrid (HSDP) plan. CI leg 3."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.models import gpt

pytestmark = pytest.mark.compile_only("gpu")

CFG = gpt.GPTConfig(layers=1, d_model=128, heads=2, max_seq_len=64, vocab=256)
BATCH = {k: jax.ShapeDtypeStruct((16, 64), jnp.int32) for k in ("inputs", "targets")}


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@pytest.fixture(scope="module")
def estimates():
    """The GPT's fsdp step on 2 x 4 H100 over InfiniBand NDR, compiled once, and the same
    program analysed again as if its hosts were joined by generic Ethernet."""
    from shardax.cost.estimation import analyse
    from shardax.cost.network import NETWORKS, remember_network

    target = sx.target("2x4xH100", network="ib-ndr")
    assert target.network.name == "ib-ndr" and "network 'ib-ndr'" in repr(target)
    mesh = sx.make_mesh({"data": 8}, devices=target)
    model = nnx.eval_shape(lambda: gpt.make_gpt(CFG))
    state = nnx.eval_shape(lambda: sx.TrainState.create(gpt.make_gpt(CFG), optax.adam(1e-3)))
    step = sx.make_train_step(lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, "fsdp"))
    out = {"ib-ndr": sx.estimate(step, state, BATCH)}
    compiled = step.lower(step.abstract(state), BATCH).compile()  # the cache's program
    remember_network(target[0].client, NETWORKS["ethernet-100g"])
    out["ethernet-100g"] = analyse(compiled, mesh, state=step.abstract(state), batch=BATCH)
    remember_network(target[0].client, target.network)
    return out


def test_the_report_names_the_network_and_shows_the_inter_host_line(estimates):
    ib, eth = estimates["ib-ndr"], estimates["ethernet-100g"]
    assert ib.network["name"] == "ib-ndr" and ib.network["why"] == "the target's"
    assert ib.network["nic_bandwidth"] == 50e9
    text = str(ib)
    assert "network: ib-ndr (DGX H100/H200" in text
    assert "exposed inter-host time:" in text and "of which across hosts, exposed" in text
    # every FSDP collective's group spans both hosts: all of them priced level by level
    assert ib.per_op.inter_host_s == pytest.approx(ib.per_op.collective_s)
    assert 0 < ib.per_op.exposed_inter_host_s <= ib.per_op.inter_host_s
    # 32x less NIC bandwidth: slower across hosts, the kernels the same
    assert eth.per_op.inter_host_s > 4 * ib.per_op.inter_host_s
    assert eth.per_op.compute_s == pytest.approx(ib.per_op.compute_s)
    assert eth.per_op.step_s > ib.per_op.step_s
    assert eth.roofline.link_s["inter-host"] > ib.roofline.link_s["inter-host"]


def test_an_equinox_users_jit_step_is_priced_across_hosts():
    """An Equinox MLP trained by the user's own ``eqx.filter_jit`` step, data parallel over
    2 hosts: its gradient all-reduce spans them and is priced level by level."""
    target = sx.target("2x4xH100", network="gcp-a3-mega")
    mesh = sx.make_mesh({"data": 8}, devices=target)
    model = eqx.nn.MLP(256, 256, 1024, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adamw(1e-3)
    opt = tx.init(params)
    replicated = NamedSharding(mesh, P())

    def place(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

    state = jax.tree.map(place, (params, opt))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))

    @jax.jit
    def train_step(state, x):
        params, opt = state

        def loss(p):
            m = eqx.combine(p, static)
            return jnp.mean(jax.vmap(m)(x) ** 2)

        grads = jax.grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return eqx.apply_updates(params, updates), opt

    report = sx.estimate(train_step, state, x)
    assert report.network["name"] == "gcp-a3-mega"
    assert report.per_op.inter_host_s > 0
    assert {c["link"] for c in report.collectives} == {"inter-host"}


def test_search_plans_on_a_multi_host_target_ranks_the_hybrid_plan():
    target = sx.target("2x4xH100", network="gcp-a3-high")
    assert [layout.name for layout in sx.SearchSpace(devices=target).layouts] == [
        None, "replica=2"]  # fmt: skip
    assert len(sx.SearchSpace(devices=target, plans=("fsdp",)).layouts) == 1
    assert len(sx.SearchSpace(devices=target[:4]).layouts) == 1  # one host
    space = sx.SearchSpace(devices=target, plans=("hsdp",))

    def init():
        return sx.TrainState.create(gpt.make_gpt(CFG), optax.adam(1e-3))

    report = sx.search_plans(space, init, loss_fn=lm_loss, batch=BATCH)
    names = {c.name for c in report.candidates}
    assert names == {"replica=2:hsdp"}, names
    hybrid = next(c for c in report.candidates if c.name == "replica=2:hsdp")
    assert dict(hybrid.mesh.shape) == {"replica": 2, "data": 4}
