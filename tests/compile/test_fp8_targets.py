"""precision="fp8" in the GPT's compiled step for an 8xH100 node (``sx.target``, no GPU):
every GEMM of a block matmul (q, k, v, out, up, down: forward and both gradients) has fp8
operands (E4M3 x E4M3 forward; E5M2 x E4M3 and E4M3 x E5M2 for the gradients), none is a
bf16 GEMM over dequantized values, and the only bf16 GEMMs left are the LM head's. Counted
by FLOPs (XLA merges the q, k, v matmuls that share their input), so a layer that falls
back to bf16 moves its FLOPs out of the fp8 total and fails the test. With the step's
``compiler_options="auto"`` XLA:GPU emits them as Triton GEMM fusions (its default
without autotuning); with Triton GEMMs off, as cuBLASLt fp8 calls (``__cublas$lt$matmul$f8``).
CI leg 3."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import shardax as sx
from shardax.cost.calibration import H100
from shardax.cost.hlo import arrays
from shardax.cost.opcost import price_hlo
from shardax.cost.ops import FUSIONS, HloIndex, classify
from shardax.cost.step_cost import format_cost
from shardax.models import gpt

pytestmark = pytest.mark.compile_only("gpu")

D, LAYERS, SEQ, BATCH, DEVICES = 256, 1, 256, 16, 8
TOKENS = BATCH * SEQ // DEVICES  # per device: the batch over "data"
FP8_FLOPS = 6 * TOKENS * 12 * D * D * LAYERS  # the blocks' matmuls, forward + backward
HEAD_FLOPS = 6 * TOKENS * D * 256


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def gemms(hlo):
    """``[(target or "triton", operand dtypes, FLOPs)]`` of every GEMM of ``hlo``: a
    cuBLAS call's operands, or those of the dot a GEMM fusion calls."""
    index = HloIndex(hlo)
    fused = {i.called for i in index.by_name.values() if i.called and i.opcode in FUSIONS}
    out = []
    for comp, instrs in index.by_comp.items():
        if comp in fused:
            continue
        for instr in instrs.values():
            if classify(instr) != "gemm":
                continue
            gemm, kind = instr, instr.target
            if instr.called and instr.opcode in FUSIONS:
                inner = [i for i in index.by_comp[instr.called].values() if i.opcode == "dot"]
                gemm, kind = inner[0], "triton"
            types = [index._type(gemm.computation, op) for op in gemm.operands[:2]]
            dtypes = tuple(arrays(t)[0][0] for t in types)
            out.append((kind, dtypes, index.flops(instr) * index.runs_of(instr)))
    return out


@pytest.fixture(scope="module")
def compiled():
    target = sx.target("8xH100")
    mesh = sx.make_mesh({"data": DEVICES}, devices=target)
    cfg = gpt.GPTConfig(layers=LAYERS, d_model=D, heads=D // 128, max_seq_len=SEQ)
    state = nnx.eval_shape(lambda: sx.TrainState.create(gpt.make_gpt(cfg), optax.adam(1e-3)))
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32) for k in ("inputs", "targets")}

    def get(options):
        step = sx.make_train_step(lm_loss, mesh=mesh, precision="fp8", compiler_options=options)
        return step.lower(step.abstract(state), batch).compile().as_text()

    auto = sx.train.compiler_options(mesh, "auto")
    return {"auto": get("auto"), "cublas": get({**auto, "xla_gpu_enable_triton_gemm": False})}


@pytest.mark.parametrize("options, kind", [("auto", "triton"), ("cublas", "__cublas$lt$matmul$f8")])
def test_the_gpt_blocks_gemms_have_fp8_operands_and_only_the_head_stays_bf16(
    compiled, options, kind
):
    found = gemms(compiled[options])
    fp8 = [g for g in found if all(d.startswith("f8") for d in g[1])]
    rest = [g for g in found if g not in fp8]
    assert {g[0] for g in fp8} == {kind}
    # E5M2 x E5M2 has no Hopper tensor-core path: one gradient operand is always E4M3
    pairs = {g[1] for g in fp8}
    assert pairs <= {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}
    assert len(pairs) == 3
    assert sum(g[2] for g in fp8) == pytest.approx(FP8_FLOPS, rel=1e-6)
    # no GEMM mixes fp8 with a wider operand, and the bf16 ones are the head's
    assert all(not any(d.startswith("f8") for d in g[1]) for g in rest)
    assert all(g[1] == ("bf16", "bf16") for g in rest)
    assert sum(g[2] for g in rest) == pytest.approx(HEAD_FLOPS, rel=1e-6)


def test_the_per_op_model_prices_the_fp8_gemms_at_the_datasheets_fp8_peak_and_says_so(compiled):
    cost = price_hlo(compiled["auto"], H100, num_devices=DEVICES)
    assert cost.fp8_datasheet_flops == pytest.approx(FP8_FLOPS, rel=1e-6)
    assert "priced at the datasheet's fp8 peak, 2x the measured bf16 rates" in format_cost(cost)
    assert cost.to_dict()["fp8_datasheet_flops"] == cost.fp8_datasheet_flops


def test_once_a_card_has_fp8_rows_they_price_the_fp8_gemms_and_the_report_says_so(compiled):
    import dataclasses

    rows = tuple((m, n, k, "f8", t * 1.6) for m, n, k, d, t in H100.gemm if d == "bf16")
    measured = dataclasses.replace(H100, gemm=(*H100.gemm, *rows))
    cost = price_hlo(compiled["auto"], measured, num_devices=DEVICES)
    datasheet = price_hlo(compiled["auto"], H100, num_devices=DEVICES)
    assert cost.fp8_measured_flops == pytest.approx(FP8_FLOPS, rel=1e-6)
    assert cost.fp8_datasheet_flops == 0
    text = format_cost(cost)
    assert "priced by the tables' measured fp8 rows" in text and "datasheet's fp8" not in text
    # at this small shape the GEMMs are bound by their bytes: no rate moves them
    assert cost.classes["gemm"].seconds >= datasheet.classes["gemm"].seconds
