"""The per-op cost model (cost/opcost.py) and its calibration tables (cost/calibration.py).

The pure functions run on HLO text; the ``compile_only`` tests price a small GPT compiled
for compile-only H200 and H100 devices (the full 24-layer configurations measured on the
H200 are ``benchmarks/cost_model_accuracy.py``'s).
"""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import shardax as sx
from shardax.cost.calibration import H100, H200, calibration_for, nearest
from shardax.cost.kernel_prices import attention_seconds, gemm_rate
from shardax.cost.measurements import gemm_rows
from shardax.cost.opcost import price_hlo
from shardax.cost.ops import HloIndex, program_flops
from shardax.cost.step_cost import breakdown

GEMM = "  %d = bf16[8192,8192]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
PARAMS = "  %a = bf16[8192,2048]{1,0} parameter(0)\n  %b = bf16[2048,8192]{1,0} parameter(1)\n"


def test_calibrations_name_their_provenance():
    assert H200.name == "calibrated: H200, JAX 0.11.2, 2026-11-27" and H200.derived is None
    assert "session.json" in H200.source
    assert H100.name == "calibrated: H100, JAX 0.11.2, 2026-11-27" and H100.derived is None
    assert "2026-11-27-h100-1/session.json" in H100.source
    assert calibration_for("NVIDIA H100 80GB HBM3") is H100 and calibration_for("cpu") is None
    calib, why = nearest(2.25e15, 8e12)  # a B200-like datasheet: the measured H200
    assert calib is H200 and why.startswith("uncalibrated: the nearest calibrated kind, H200")


def test_gemm_rows_drop_dispatch_bound_rows_and_the_rate_is_the_nearest_shape():
    shapes = {r[:3] for r in gemm_rows(H200)}
    assert (1024, 1024, 1024) not in shapes and (2048, 2048, 2048) not in shapes
    assert (8192, 8192, 8192) in shapes
    assert gemm_rate(H200, 8192, 8192, 2048) == pytest.approx(659.32e12, rel=1e-4)
    assert gemm_rate(H200, 8192, 8192, 2048, "f32") == pytest.approx(659.32e12 / 2, rel=1e-4)
    assert gemm_rate(H100, 8192, 8192, 8192) == pytest.approx(690.42e12, rel=1e-4)
    assert gemm_rate(H100, 8192, 8192, 8192, "f32") == pytest.approx(
        359.75e12, rel=1e-4
    )  # measured
    # cuBLAS's own fp32 rows (Triton GEMMs off) price a cuBLAS call where a table has them
    row = (8192, 8192, 8192, "f32-cublas", 250.0)
    with_library = dataclasses.replace(H100, gemm=(*H100.gemm, row))
    assert gemm_rate(with_library, 8192, 8192, 8192, "f32", cublas=True) == pytest.approx(250e12)
    assert gemm_rate(with_library, 8192, 8192, 8192, "f32") == pytest.approx(359.75e12, rel=1e-4)
    assert gemm_rate(H100, 8192, 8192, 8192, "f32", cublas=True) == pytest.approx(
        359.75e12, rel=1e-4
    )


def test_a_gemm_is_priced_at_its_shape_rate_times_its_loop_trips():
    hlo = (
        "%body (p: bf16[8192,2048]) -> bf16[8192,8192] {\n" + PARAMS + GEMM + "\n}\n"
        "ENTRY %main (x: bf16[8192,2048]) -> bf16[8192,8192] {\n" + PARAMS +
        '  %w = (s32[], bf16[8192,8192]) while(%t), condition=%cond, body=%body, '
        'backend_config={"known_trip_count":{"n":"3"}}\n}'
    )  # fmt: skip
    cost = price_hlo(hlo, H200)
    gemm = cost.classes["gemm"]
    assert gemm.kernels == 3 and gemm.flops == 3 * 2 * 8192 * 8192 * 2048
    assert gemm.seconds == pytest.approx(gemm.flops / 659.32e12, rel=1e-4)
    assert gemm.low < gemm.seconds < gemm.high
    assert cost.launch_s == pytest.approx(3 * H200.launch_us * 1e-6)
    assert cost.low_s < cost.step_s < cost.high_s


def test_memory_bound_work_at_the_stream_bandwidth_and_remat_as_its_own_line():
    hlo = "ENTRY %main {\n" + PARAMS + GEMM + (
        "\n  %c = f32[8192,8192]{1,0} fusion(%d), kind=kLoop, calls=%f, "
        'metadata={op_name="jit(step)/optimizer/add"}\n}'
    )  # fmt: skip
    cost = price_hlo(hlo, H200)
    moved = 8192 * 8192 * (2 + 4)
    assert cost.classes["optimizer"].bytes == moved
    assert cost.classes["optimizer"].seconds == pytest.approx(moved / 3952.75e9, rel=1e-4)  # median
    rows = dict((label, s) for label, s, _ in breakdown(cost, model_flops=cost.executed_flops / 2))
    assert rows["GEMMs: beyond model FLOPs (remat, recompute)"] == pytest.approx(
        rows["GEMMs: model work"]
    )


def test_cudnn_attention_by_its_kernel_table():
    fwd = (
        "%o = (bf16[4,16,2048,128]{3,1,2,0}, f32[4,16,2048]{2,1,0}) custom-call(%q, %k, %v), "
        'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={'
        "bf16[4,2048,16,128]{3,2,1,0}, bf16[4,2048,16,128]{3,2,1,0}}, "
        'backend_config={"mask_type":"CAUSAL"}'
    )
    assert attention_seconds(H200, fwd) == pytest.approx(0.17894e-3, rel=1e-4)  # measured
    bwd = fwd.replace("fmhaSoftmax", "fmhaSoftmaxBackward")
    assert attention_seconds(H200, bwd) == pytest.approx((0.73624 - 0.17894) * 1e-3, rel=1e-4)
    assert attention_seconds(H200, "%x = f32[2] add(%a, %b)") is None


@pytest.fixture(scope="module")
def small_gpt():
    from shardax.models import gpt

    def build(target, mesh_shape, plan, remat):
        mesh = sx.make_mesh(mesh_shape, devices=sx.target(target))
        cfg = gpt.GPTConfig(2, 256, 2, 256, vocab=256, scan_layers=False)
        make = lambda: gpt.make_gpt(cfg, remat=remat)  # noqa: E731
        model = nnx.eval_shape(make)
        state = nnx.eval_shape(lambda: sx.TrainState.create(make(), optax.adamw(1e-4)))

        def loss_fn(m, b):
            logits = m(b["inputs"]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

        step = sx.make_train_step(loss_fn, mesh=mesh, plan=gpt.plan(mesh, model, plan),
                                  precision="bf16")  # fmt: skip
        tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)
        return sx.estimate(step, state, {"inputs": tokens, "targets": tokens})

    return build


@pytest.mark.compile_only
def test_estimate_prices_a_gpt_on_an_h200_op_by_op(small_gpt):
    report = small_gpt("1xH200", {"data": 1}, "replicate", "full")
    cost = report.per_op
    assert cost is not None and cost.calibration == H200.name
    assert cost.classes["gemm"].kernels > 0 and cost.classes["gemm"].flops > 0
    assert cost.classes["attention"].kernels == 6  # cuDNN: 2 forward, 2 recomputed, 2 backward
    assert cost.executed_flops == pytest.approx(report.flops_hlo)
    assert cost.collective_s == 0 and report.interval_s == (cost.low_s, cost.high_s)
    text = str(report)
    shows = ("model per-op, calibrated: H200, JAX 0.11.2, 2026-11-27", "interval",
             "GEMMs: beyond model FLOPs (remat, recompute)", "exposed collective time")  # fmt: skip
    for shown in shows:
        assert shown in text, shown
    assert report.to_dict()["per_op"]["calibration"] == H200.name


@pytest.mark.compile_only
def test_estimate_prices_the_collectives_of_fsdp_on_an_h100(small_gpt):
    report = small_gpt("2xH100", {"data": 2}, "fsdp", "none")
    cost = report.per_op
    assert cost is not None and cost.calibration.startswith("calibrated: H100")
    assert 0 < cost.exposed_s <= cost.collective_s
    assert cost.low_s <= cost.step_s <= cost.high_s


def test_a_gpu_without_a_calibration_is_priced_by_the_nearest_and_says_so():
    from types import SimpleNamespace as NS

    from shardax.cost.estimation import per_op_price
    from shardax.cost.hardware import device_spec

    b200 = NS(platform="gpu", device_kind="NVIDIA B200", process_index=0)
    spec = device_spec(b200)
    hlo = "ENTRY %main {\n" + PARAMS + GEMM + "\n}"
    cost = per_op_price(hlo, [b200], spec, {}, [], [])
    assert cost is not None and cost.calibration.startswith(
        "uncalibrated: the nearest calibrated kind, H200, has 0.44× its peak FLOP/s"
    )
    assert cost.classes["gemm"].kernels == 1 and cost.widen == 0.25  # another kind's tables
    assert price_hlo(hlo, H100).widen == 0 and price_hlo(hlo, H200).widen == 0
    cpu = NS(platform="cpu", device_kind="cpu", process_index=0)
    assert per_op_price(hlo, [cpu], spec, {}, [], []) is None  # tables for GPUs only


def test_the_accuracy_benchmark_reads_every_measured_configuration():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "cost_model_accuracy.py"
    spec = importlib.util.spec_from_file_location("benchmarks_cost_model_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.configurations()
    assert len(rows) == 27 and all(r["measured_ms"] > 0 for r in rows)
    assert sum(r["card"] == "H100" for r in rows) == 9
    assert rows[0]["config"]["impl"] == "shardax" and rows[1]["config"]["impl"] == "jit"
    assert sum(r["config"]["model"] == "stage4" for r in rows) == 7
    rows[0]["prediction"] = price_hlo("ENTRY %main {\n" + PARAMS + GEMM + "\n}", H200).to_dict()
    line = bench.markdown(rows[:1]).splitlines()[-1]
    assert line.startswith("| default (shardax) | 130.3 | 0.4 |") and line.endswith("| no |")


def test_a_kernel_that_reduces_is_priced_at_the_measured_reductions():
    """A reduction fusion (a norm, a softmax) at the median of the calibration's reduce
    rows where it has them; an elementwise one, or any on tables without them, at the
    median stream pass."""
    hlo = (
        "%sum (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
        "  %b = f32[] parameter(1)\n  ROOT %c = f32[] add(%a, %b)\n}\n"
        "%fr (p: f32[8192,2048]) -> f32[8192] {\n  %p = f32[8192,2048]{1,0} parameter(0)\n"
        "  %z = f32[] constant(0)\n"
        "  ROOT %r = f32[8192]{0} reduce(%p, %z), dimensions={1}, to_apply=%sum\n}\n"
        "%fe (q: f32[8192,2048]) -> f32[8192,2048] {\n  %q = f32[8192,2048]{1,0} parameter(0)\n"
        "  ROOT %e = f32[8192,2048]{1,0} exponential(%q)\n}\n"
        "ENTRY %main (x: f32[8192,2048]) -> f32[8192] {\n"
        "  %x = f32[8192,2048]{1,0} parameter(0)\n"
        "  %y = f32[8192,2048]{1,0} fusion(%x), kind=kLoop, calls=%fe\n"
        "  ROOT %s = f32[8192]{0} fusion(%y), kind=kInput, calls=%fr\n}"
    )
    read, elementwise = 8192 * 2048 * 4, 2 * 8192 * 2048 * 4
    reduced = read + 8192 * 4
    priced = price_hlo(hlo, H100).classes["elementwise"]
    assert priced.kernels == 2 and priced.bytes == elementwise + reduced
    stream, reduce = (statistics.median(t) * 1e9 for t in (H100.stream, H100.reduce))
    assert len(H100.reduce) == 4 and reduce != stream
    assert priced.seconds == pytest.approx(elementwise / stream + reduced / reduce)
    none = dataclasses.replace(H100, reduce=())
    assert price_hlo(hlo, none).classes["elementwise"].seconds == pytest.approx(
        (elementwise + reduced) / stream
    )


def test_an_async_fusion_is_one_kernel_priced_by_its_body():
    """XLA runs a scan's update of its stacked outputs as an async fusion
    (``fusion-start``/``fusion-done``): one kernel that writes its update in place; its
    body is not a second kernel, and the stacked buffer is neither read nor rewritten."""
    hlo = (
        "%dus (p0: bf16[24,4096,2048], p1: bf16[1,4096,2048], p2: s32[]) -> "
        "bf16[24,4096,2048] {\n  %p0 = bf16[24,4096,2048]{2,1,0} parameter(0)\n"
        "  %p1 = bf16[1,4096,2048]{2,1,0} parameter(1)\n  %p2 = s32[] parameter(2)\n"
        "  %z = s32[] constant(0)\n  ROOT %u = bf16[24,4096,2048]{2,1,0} "
        "dynamic-update-slice(%p0, %p1, %p2, %z, %z)\n}\n"
        "ENTRY %main (a: bf16[24,4096,2048], b: bf16[1,4096,2048], i: s32[]) -> "
        "bf16[24,4096,2048] {\n  %a = bf16[24,4096,2048]{2,1,0} parameter(0)\n"
        "  %b = bf16[1,4096,2048]{2,1,0} parameter(1)\n  %i = s32[] parameter(2)\n"
        "  %s = ((bf16[24,4096,2048]{2,1,0}, bf16[1,4096,2048]{2,1,0}, s32[]), "
        "bf16[24,4096,2048]{2,1,0}, u32[]) fusion-start(%a, %b, %i), kind=kLoop, calls=%dus\n"
        "  ROOT %d = bf16[24,4096,2048]{2,1,0} fusion-done(%s)\n}"
    )
    cost = price_hlo(hlo, H200)
    assert cost.kernels == 1
    update = 4096 * 2048 * 2
    assert cost.classes["copies"].kernels == 1
    assert cost.classes["copies"].bytes == 2 * update + 4


def test_a_cublas_call_in_a_dynamic_slice_fusion_is_priced_as_cublas():
    """XLA wraps a cuBLAS GEMM whose operand is a slice of a stacked buffer in a
    ``dynamic_slice_fusion`` (kind=kCustom): the call is priced by the cuBLAS fp32 rows."""
    call = (
        "  ROOT %g = f32[8192,8192]{1,0} custom-call(%x, %y), "
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
        '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"]}}}\n'
    )
    hlo = (
        "%dsf (p: f32[8192,8192], q: f32[8192,8192]) -> f32[8192,8192] {\n"
        "  %x = f32[8192,8192]{1,0} parameter(0)\n  %y = f32[8192,8192]{1,0} parameter(1)\n"
        + call
        + "}\n"
        "ENTRY %main (a: f32[8192,8192], b: f32[8192,8192]) -> f32[8192,8192] {\n"
        "  %a = f32[8192,8192]{1,0} parameter(0)\n  %b = f32[8192,8192]{1,0} parameter(1)\n"
        "  ROOT %f = f32[8192,8192]{1,0} fusion(%a, %b), kind=kCustom, calls=%dsf, "
        'backend_config={"fusion_backend_config":{"kind":"__custom_fusion"}}\n}'
    )
    row = (8192, 8192, 8192, "f32-cublas", 250.0)
    with_library = dataclasses.replace(H100, gemm=(*H100.gemm, row))
    gemm = price_hlo(hlo, with_library).classes["gemm"]
    assert gemm.kernels == 1 and gemm.flops == 2 * 8192**3
    assert gemm.seconds == pytest.approx(gemm.flops / 250e12)


def test_wrapped_work_is_counted_once():
    """A computation an ``async-start`` runs is counted by its own instructions, not again
    through the wrapper; a ``copy-start`` moves its source once (read and written), not
    its tuple of copy, source and context."""
    hlo = (
        "%body (p: f32[1024,1024], q: f32[1024,1024]) -> f32[1024,1024] {\n"
        "  %x = f32[1024,1024]{1,0} parameter(0)\n  %y = f32[1024,1024]{1,0} parameter(1)\n"
        "  ROOT %g = f32[1024,1024]{1,0} custom-call(%x, %y), "
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
        '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"]}}}\n}\n'
        "ENTRY %main (a: f32[1024,1024], b: f32[1024,1024]) -> f32[1024,1024] {\n"
        "  %a = f32[1024,1024]{1,0} parameter(0)\n  %b = f32[1024,1024]{1,0} parameter(1)\n"
        "  %s = ((f32[1024,1024]{1,0}, f32[1024,1024]{1,0}), f32[1024,1024]{1,0}, u32[]) "
        "async-start(%a, %b), calls=%body\n"
        "  %d = f32[1024,1024]{1,0} async-done(%s)\n"
        "  %c = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[]) copy-start(%d)\n"
        "  ROOT %e = f32[1024,1024]{1,0} copy-done(%c)\n}"
    )
    assert program_flops(HloIndex(hlo))["gemm"] == 2 * 1024**3
    cost = price_hlo(hlo, H100)
    assert cost.classes["gemm"].kernels == 1 and cost.classes["gemm"].flops == 2 * 1024**3
    assert cost.classes["copies"].kernels == 1 and cost.classes["copies"].bytes == 2 * 4 * 1024**2


def test_an_fp8_gemm_is_priced_by_fp8_rows_where_measured_else_by_the_datasheet_and_says_which():
    from shardax.cost.step_cost import format_cost

    params = PARAMS.replace("bf16[8192,2048]", "f8e4m3fn[8192,2048]").replace(
        "bf16[2048,8192]", "f8e4m3fn[2048,8192]"
    )
    hlo = "ENTRY %main (x: f8e4m3fn[8192,2048]) -> bf16[8192,8192] {\n" + params + GEMM + "\n}"
    flops = 2 * 8192 * 8192 * 2048
    datasheet = price_hlo(hlo, H200)
    assert datasheet.fp8_datasheet_flops == flops and datasheet.fp8_measured_flops == 0
    assert datasheet.classes["gemm"].seconds == pytest.approx(flops / (2 * 659.32e12), rel=1e-4)
    assert "the datasheet's fp8 peak, 2x the measured bf16 rates" in format_cost(datasheet)
    measured = dataclasses.replace(H200, gemm=(*H200.gemm, (8192, 8192, 2048, "f8", 1100.0)))
    cost = price_hlo(hlo, measured)
    assert cost.fp8_measured_flops == flops and cost.fp8_datasheet_flops == 0
    assert cost.classes["gemm"].seconds == pytest.approx(flops / 1100e12, rel=1e-4)
    text = format_cost(cost)
    assert "priced by the tables' measured fp8 rows" in text and "datasheet's fp8" not in text
    assert cost.to_dict()["fp8_measured_flops"] == flops
