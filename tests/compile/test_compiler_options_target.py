"""The GPT step compiled for an 8xH100 node (``sx.target``, no GPU) with
``compiler_options="auto"`` gets shardax's GPU set (the fusion autotuner off: no GPU to time
it on, and the same program), XLA:GPU takes every name of it, and ``sx.estimate`` records
it. CI leg 3."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.models import gpt
from shardax.train.compiler import DEVICELESS_GPU

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
    deviceless = {**sx.train.gpu_options(), **DEVICELESS_GPU}  # no GPU to autotune on
    assert step.compiler_options == deviceless == sx.train.compiler_options(mesh)
    assert f"compiler_options='auto' (gpu: {len(step.compiler_options)} options)" in repr(step)
    report = sx.estimate(step, state, BATCH)  # XLA:GPU compiles it with every option set
    # (and with whatever "auto" adds for this state, e.g. sized combine thresholds)
    assert report.compiler_options.items() >= sx.train.gpu_options().items()
    assert "xla_gpu_enable_latency_hiding_scheduler=True" in str(report)
    # ... and the options reach XLA:GPU: a name it does not know is refused by name.
    bad = sx.make_train_step(lm_loss, mesh=mesh, plan=plan, compiler_options={"xla_gpu_no": 1})
    with pytest.raises(Exception, match="No such compile option: 'xla_gpu_no'"):
        bad.lower(bad.abstract(state), BATCH).compile()


AUTOTUNER_RECORD = (', backend_config={"operation_queue_id":"0","force_earliest_schedule":false,'
                    '"reification_cost":[],"device_type":"DEVICE_TYPE_INVALID",'
                    '"native_emitter_backend_config":{"type":"NATIVE_EMITTER_TYPE_INVALID",'
                    '"unroll_factor":0}}')  # fmt: skip
"""What the fusion autotuner writes on a fusion when it has chosen nothing (no GPU)."""


def test_the_fusion_autotuner_off_compiles_the_same_program():
    """On compile-only GPUs the autotuner has nothing to time: turned off
    (``DEVICELESS_GPU``), the optimized program is the same but for its empty records
    and the fingerprint, and its compiles of each fusion are saved. A bf16 gradient of
    matmuls and a softmax over 8 H100s, as the GPT's blocks have them."""
    mesh = sx.make_mesh({"data": 8}, devices=sx.target("8xH100"))
    x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def loss(w, x):
        h = jax.nn.gelu(x @ w)
        return jax.nn.softmax((h @ w.T).astype(jnp.float32)).max(axis=-1).mean()

    programs = []
    for tuner in (True, False):
        options = {**sx.train.gpu_options(), "xla_gpu_experimental_enable_fusion_autotuner": tuner}
        text = jax.jit(jax.grad(loss), compiler_options=options).lower(w, x).compile().as_text()
        text = re.sub(r'fingerprint_before_lhs="[0-9a-f]+"', "", text)
        programs.append(text.replace(AUTOTUNER_RECORD, ""))
    assert "gemm_fusion" in programs[0] or "cublas" in programs[0]
    assert programs[0] == programs[1]
