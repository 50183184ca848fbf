"""The GPT's elementwise options on a compile-only H100 (one device of ``sx.target("8xH100")``,
no GPU): ``GPTConfig(residual="bf16", elementwise="recompute")`` under precision="bf16"
shrinks the per-op model's elementwise class by more than a fifth, the GEMMs unchanged,
and the MLP-width fusions (the GELU and its gradient) move a third fewer bytes. A
2-layer d_model 1024 GPT (sequence 1024, batch 4) stands in for the 1.21B one, whose
figures (21.6 -> 14.3 ms, ``benchmarks/elementwise_estimate.py``) are in docs/results.md.
CI leg 3."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import shardax as sx
from shardax.cost.calibration import H100
from shardax.cost.opcost import moved_bytes, price_hlo
from shardax.cost.ops import FUSIONS, HloIndex, classify
from shardax.models import gpt

pytestmark = pytest.mark.compile_only("gpu")

LAYERS, D, SEQ, BATCH = 2, 1024, 1024, 4


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@pytest.fixture(scope="module")
def compiled():
    target = sx.target("8xH100")
    mesh = sx.make_mesh({"data": 1}, devices=target.devices[:1])
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32) for k in ("inputs", "targets")}
    step = sx.make_train_step(lm_loss, mesh=mesh, precision="bf16")
    out = {}
    for name, options in [
        ("default", {}),
        ("both", {"residual": "bf16", "elementwise": "recompute"}),
    ]:
        cfg = gpt.GPTConfig(layers=LAYERS, d_model=D, heads=D // 128, max_seq_len=SEQ, **options)
        state = nnx.eval_shape(
            lambda cfg=cfg: sx.TrainState.create(gpt.make_gpt(cfg), optax.adamw(1e-3))
        )
        out[name] = step.lower(step.abstract(state), batch).compile().as_text()
    return out


def mlp_width_bytes(hlo):
    """Bytes the elementwise kernels with an output of the MLP's width (4·d) move."""
    index = HloIndex(hlo)
    fused = {i.called for i in index.by_name.values() if i.called and i.opcode in FUSIONS}
    total = 0.0
    for comp, instrs in index.by_comp.items():
        if comp in fused:
            continue
        for instr in instrs.values():
            if classify(instr) == "elementwise" and f",{4 * D}]" in instr.out:
                total += index.runs_of(instr) * moved_bytes(index, instr)
    return total


def test_bf16_residual_and_recompute_shrink_the_elementwise_class(compiled):
    default, both = (price_hlo(compiled[k], H100, num_devices=1) for k in ("default", "both"))
    ew, ew_both = default.classes["elementwise"], both.classes["elementwise"]
    assert ew_both.seconds < 0.8 * ew.seconds  # 0.54 -> 0.40 ms when written
    assert ew_both.bytes < 0.8 * ew.bytes
    assert both.classes["gemm"].flops == pytest.approx(default.classes["gemm"].flops, rel=1e-9)
    assert both.step_s < default.step_s
    # the GELU saves only its input: no second tensor of the MLP's width, written and read
    assert mlp_width_bytes(compiled["both"]) < 0.75 * mlp_width_bytes(compiled["default"])
