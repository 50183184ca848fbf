"""The GPT step compiled for an 8xH100 node (``sx.target``, no GPU) with
``compiler_options="auto"`` gets shardax's GPU set, XLA:GPU takes every name of it, and
``sx.estimate`` records it. CI leg 3."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import shardax as sx
from shardax.models import gpt

pytestmark = pytest.mark.compile_only("gpu")

GPT = gpt.GPTConfig(layers=2, d_model=64, heads=4, max_seq_len=64)
BATCH = {
    "inputs": jax.ShapeDtypeStruct((16, 64), jnp.int32),
    "targets": jax.ShapeDtypeStruct((16, 64), jnp.int32),
}


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def test_gpt_on_an_h100_target_compiles_with_the_gpu_set():
    mesh = sx.make_mesh({"data": 8}, devices=sx.target("8xH100"))
    model = nnx.eval_shape(lambda: gpt.make_gpt(GPT))
    state = nnx.eval_shape(lambda: sx.TrainState.create(gpt.make_gpt(GPT), optax.adam(1e-3)))
    plan = gpt.plan(mesh, model, "fsdp")
    step = sx.make_train_step(lm_loss, mesh=mesh, plan=plan, precision="bf16")
    assert step.compiler_options == sx.train.gpu_options() == sx.train.compiler_options(mesh)
    assert f"compiler_options='auto' (gpu: {len(step.compiler_options)} options)" in repr(step)
    report = sx.estimate(step, state, BATCH)  # XLA:GPU compiles it with every option set
    # (and with whatever "auto" adds for this state, e.g. sized combine thresholds)
    assert report.compiler_options.items() >= sx.train.gpu_options().items()
    assert "xla_gpu_enable_latency_hiding_scheduler=True" in str(report)
    # ... and the options reach XLA:GPU: a name it does not know is refused by name.
    bad = sx.make_train_step(lm_loss, mesh=mesh, plan=plan, compiler_options={"xla_gpu_no": 1})
    with pytest.raises(Exception, match="No such compile option: 'xla_gpu_no'"):
        bad.lower(bad.abstract(state), BATCH).compile()
