"""``sx.search_plans`` with precision in its space (``SearchSpace(precisions=...)``) on
compile-only targets (``sx.target``, no GPU): on one H100 of ``8xH100`` the bf16 and fp8
steps of a small GPT are each compiled once and ranked by the per-op model's prediction
(fp8 GEMMs at the datasheet's fp8 peak: the H100 tables have no fp8 rows), named by their
precision, the pick's flags giving ``--precision``; fp8 is refused by name on an A100 (compute
capability 8.0) and a TPU, before anything compiles. CI leg 3."""

import jax
import jax.numpy as jnp
import optax
import pytest

import shardax as sx
from shardax.models import gpt

LAYERS, D, SEQ, BATCH = 1, 512, 512, 4
CFG = gpt.GPTConfig(layers=LAYERS, d_model=D, heads=D // 128, max_seq_len=SEQ)
TOKENS = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32) for k in ("inputs", "targets")}


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def init():
    return sx.TrainState.create(gpt.make_gpt(CFG), optax.adamw(1e-3))


@pytest.mark.compile_only("gpu")
def test_search_plans_ranks_bf16_against_fp8_on_an_h100_by_predicted_step():
    one = sx.target("8xH100").devices[:1]
    space = sx.SearchSpace(
        meshes=[{"data": 1}], devices=one, plans=("replicate",), precisions=("bf16", "fp8")
    )
    report = sx.search_plans(space, init, loss_fn=lm_loss, batch=TOKENS)
    by = {c.name: c for c in report.candidates}
    assert set(by) == {"replicate·bf16", "replicate·fp8"}, list(by)
    bf16, fp8 = by["replicate·bf16"], by["replicate·fp8"]
    assert bf16.config.precision.matmul == "default" and fp8.config.precision.matmul == "fp8"
    assert fp8.precision == "fp8" and bf16.precision == "bf16"
    # each priced by the per-op model; the fp8 GEMMs at the datasheet's fp8 peak, said so
    assert fp8.estimate.per_op.fp8_datasheet_flops > 0 == bf16.estimate.per_op.fp8_datasheet_flops
    assert fp8.predicted_s != bf16.predicted_s
    pick = min((bf16, fp8), key=lambda c: c.predicted_s)
    assert report.name == pick.name and report.flags.endswith(f"--precision {pick.precision}")
    assert report.to_dict()["candidates"][0]["precision"] in ("bf16", "fp8")


@pytest.mark.compile_only("gpu")
def test_fp8_is_refused_by_name_on_an_a100():
    a100 = sx.target("8xA100-80GB")
    space = sx.SearchSpace(devices=a100, precisions=("bf16", "fp8"))
    says = r"'fp8' does not apply here: .*NVIDIA A100-SXM4-80GB, compute capability 8\.0"
    with pytest.raises(ValueError, match=says):
        sx.search_plans(space, init, loss_fn=lm_loss, batch=TOKENS)


@pytest.mark.compile_only("tpu")
def test_fp8_is_refused_by_name_on_a_tpu():
    space = sx.SearchSpace(devices=sx.target("v5e-8"), precisions=("fp8",))
    with pytest.raises(ValueError, match=r"'fp8' does not apply here: .*these are tpu devices"):
        sx.search_plans(space, init, loss_fn=lm_loss, batch=TOKENS)
