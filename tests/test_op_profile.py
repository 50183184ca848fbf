"""benchmarks/gpu/op_profile.py: a profile of a compiled train step read into time per op
class, on the CPU (a real trace of the tiny GPT) and on a GPU-shaped trace written here
(the plane, stream lines and kernel stats XLA:GPU's CUPTI collector writes)."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardax as sx


def load():
    path = Path(__file__).parents[1] / "benchmarks" / "gpu" / "op_profile.py"
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_op_profile", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_cpu_trace_of_the_tiny_gpt_adds_up_to_its_step(tmp_path, mesh):
    """3 steps of the tiny GPT (bf16, FSDP over 8 devices) traced: every class is in the
    table, the GEMMs, the elementwise fusions and the optimizer (its named scope) have
    time, the shares make a whole. The classes' sum is the traced window per step, set
    against the step timed without the profiler: on the CPU each of the step's ~250 ops
    is a host trace event and the steps' collectives wait on 8 threads, so the two differ
    by tens of percent either way; on a GPU they agree within 10%."""
    from shardax.models import gpt

    op_profile = load()
    cfg = gpt.GPTConfig(layers=1, d_model=64, heads=4, max_seq_len=32)
    abstract = jax.eval_shape(lambda: gpt.make_gpt(cfg))

    def loss_fn(model, b):
        logits = model(b["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    step = sx.make_train_step(
        loss_fn, mesh=mesh, plan=gpt.plan(mesh, abstract, "fsdp"), precision="bf16"
    )
    box = {"state": step.init(lambda: sx.TrainState.create(gpt.make_gpt(cfg), optax.adam(1e-3)))}
    tokens = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
    batch = sx.distribute_batch(
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, sx.batch_sharding(mesh)
    )
    text = step.lower(box["state"], batch).compile().as_text()
    assert 'op_name="jit(' in text and "/optimizer/" in text  # TrainState's named scope

    def run() -> None:
        for _ in range(3):
            box["state"], metrics = step(box["state"], batch)
        jax.block_until_ready((box["state"], metrics))

    run()
    times = []
    for _ in range(3):
        began = time.perf_counter()
        run()
        times.append((time.perf_counter() - began) / 3)
    xplane = op_profile.capture(run, tmp_path / "trace")
    assert xplane.name.endswith(".xplane.pb") and xplane.exists()
    table = op_profile.op_table(
        xplane, text, steps=3, step_seconds=min(times), matmul_tflops=0.1, bandwidth_gbs=10.0
    )
    json.dumps(table, allow_nan=False)
    assert table["notes"] == [] or all("not priced" not in n for n in table["notes"])
    assert table["device"].startswith("/host:CPU") and table["module"].startswith("jit_")
    classes = table["classes"]
    assert set(classes) == set(op_profile.CLASSES)
    for name in ("gemm", "elementwise", "optimizer", "copies", "collectives"):
        assert classes[name]["ms_per_step"] > 0 and classes[name]["kernels_per_step"] >= 1, name
    assert classes["attention"]["ms_per_step"] == 0  # no fused kernel on the CPU: dots
    assert sum(c["share"] for c in classes.values()) == pytest.approx(1.0)
    assert table["sum_ms"] == pytest.approx(sum(c["ms_per_step"] for c in classes.values()))
    assert 0.3 < table["sum_over_step"] < 3.0, table["sum_over_step"]
    assert table["sum_ms"] == pytest.approx(
        table["traced_step_ms"] + table["overlap_ms_per_step"], rel=1e-6
    )
    gemm = classes["gemm"]
    assert gemm["floor_basis"] == "flops" and gemm["flops_per_step"] > 0
    assert gemm["floor_ms_per_step"] == pytest.approx(gemm["flops_per_step"] / 0.1e12 * 1e3)
    opt = classes["optimizer"]
    assert opt["floor_basis"] == "bytes" and opt["bytes_per_step"] > 0
    assert 1 <= len(table["top_ops"]) <= 15
    assert all(op["class"] in op_profile.CLASSES for op in table["top_ops"])
    md = op_profile.markdown(table)
    assert "| optimizer update |" in md and "| **sum** |" in md


HLO = """HloModule jit_step, is_scheduled=true

%fused_adam (param_0: f32[1024], param_1: f32[1024]) -> f32[1024] {
  %param_0 = f32[1024]{0} parameter(0)
  %param_1 = f32[1024]{0} parameter(1)
  ROOT %sub.1 = f32[1024]{0} subtract(%param_0, %param_1), metadata={op_name="jit(step)/optimizer/sub"}
}

%fused_convert (param_0.1: f32[64,256]) -> bf16[64,256] {
  %param_0.1 = f32[64,256]{1,0} parameter(0)
  ROOT %convert.1 = bf16[64,256]{1,0} convert(%param_0.1), metadata={op_name="jit(step)/convert_element_type"}
}

%fused_gelu (param_0.2: bf16[64,512]) -> bf16[64,512] {
  %param_0.2 = bf16[64,512]{1,0} parameter(0)
  ROOT %tanh.1 = bf16[64,512]{1,0} tanh(%param_0.2), metadata={op_name="jit(step)/tanh"}
}

%triton_gemm_dot (p0: bf16[64,256], p1: bf16[256,512]) -> bf16[64,512] {
  %p0 = bf16[64,256]{1,0} parameter(0)
  %p1 = bf16[256,512]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,512]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (p.0: f32[1024], p.1: bf16[64,256], p.2: bf16[256,512], q: bf16[2,1024,8,64]) -> f32[1024] {
  %p.0 = f32[1024]{0} parameter(0)
  %p.1 = bf16[64,256]{1,0} parameter(1)
  %p.2 = bf16[256,512]{1,0} parameter(2)
  %q = bf16[2,1024,8,64]{3,2,1,0} parameter(3)
  %custom-call.3 = (bf16[64,512]{1,0}, s8[4194304]{0}) custom-call(%p.1, %p.2), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %gemm_fusion_dot.1 = bf16[64,512]{1,0} fusion(%p.1, %p.2), kind=kCustom, calls=%triton_gemm_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %fmha.1 = (bf16[2,1024,8,64]{3,1,2,0}, f32[2,8,1024]{2,1,0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,1024,8,64]{3,2,1,0}, bf16[2,1024,8,64]{3,2,1,0}, bf16[2,1024,8,64]{3,2,1,0}}, backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}
  %loop_tanh_fusion = bf16[64,512]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_gelu, metadata={op_name="jit(step)/tanh"}
  %loop_convert_fusion = bf16[64,256]{1,0} fusion(%p.0), kind=kLoop, calls=%fused_convert
  %all-gather-start = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p.0), replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[1024]{0} all-gather-done(%all-gather-start)
  ROOT %loop_subtract_fusion = f32[1024]{0} fusion(%p.0, %all-gather-done), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/optimizer/sub"}
}
"""  # noqa: E501

# (line, kernel name, start µs, duration µs, hlo_op): 2 steps of 100 µs on two streams.
KERNELS = [
    (13, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0, 20, "custom-call.3"),
    (13, "gemm_fusion_dot_1", 20, 10, "gemm_fusion_dot.1"),
    (13, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 30, 30, "fmha.1"),
    (13, "loop_tanh_fusion", 60, 5, "loop_tanh_fusion"),
    (13, "Memset", 65, 1, "loop_convert_fusion"),
    (13, "loop_convert_fusion", 66, 4, "loop_convert_fusion"),
    (13, "loop_subtract_fusion", 75, 5, "loop_subtract_fusion"),
    (20, "ncclDevKernel_AllGather_RING_LL", 70, 8, "all-gather-start"),
    (13, "some_unknown_kernel", 90, 2, ""),
    (13, "MemoryAlloc", 93, 3, ""),  # CUPTI's record of an allocation: no kernel
]


def gpu_trace(path: Path) -> Path:
    """An XSpace as XLA:GPU's CUPTI collector writes one: a plane per GPU, a line per
    stream, each kernel an event with the thunk's ``hlo_op``/``hlo_module`` stats."""
    from jax.profiler import ProfileData

    names = sorted({k for _, k, *_ in KERNELS})
    ids = {n: i + 1 for i, n in enumerate(names)}
    lines = {}
    for step in range(2):
        for line, kernel, start, duration, hlo_op in KERNELS:
            stats = 'stats { metadata_id: 2 str_value: "jit_step" }'
            if hlo_op:
                stats += f' stats {{ metadata_id: 1 str_value: "{hlo_op}" }}'
            lines.setdefault(line, []).append(
                f"events {{ metadata_id: {ids[kernel]} offset_ps: {(start + 100 * step) * 10**6} "
                f"duration_ps: {duration * 10**6} {stats} }}"
            )
    kinds = {13: "Compute,Memset", 20: "Compute"}
    text = "planes { id: 1 name: '/host:CPU' }\nplanes { id: 2 name: '/device:GPU:0'\n"
    for line, events in lines.items():
        text += f"lines {{ id: {line} name: 'Stream #{line}({kinds[line]})' timestamp_ns: 5000\n"
        text += "\n".join(events) + "}\n"
    text += "lines { id: 1 name: 'CUPTI overhead' timestamp_ns: 5000 "
    text += "events { metadata_id: 1 offset_ps: 0 duration_ps: 99000000 } }\n"
    for name, i in ids.items():
        text += f"event_metadata {{ key: {i} value {{ id: {i} name: '{name}' }} }}\n"
    text += "stat_metadata { key: 1 value { id: 1 name: 'hlo_op' } }\n"
    text += "stat_metadata { key: 2 value { id: 2 name: 'hlo_module' } }\n}\n"
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
    return path


def test_a_gpu_shaped_trace_is_classed_by_its_hlo(tmp_path):
    op_profile = load()
    xplane = gpu_trace(tmp_path / "gpu.xplane.pb")
    table = op_profile.op_table(
        xplane, HLO, steps=2, step_seconds=100e-6, matmul_tflops=500.0, bandwidth_gbs=3000.0
    )
    json.dumps(table, allow_nan=False)
    assert table["device"].startswith("/device:GPU:0: lines Stream #13")
    assert "CUPTI overhead" not in table["device"] and table["module"] == "jit_step"
    ms = {name: row["ms_per_step"] for name, row in table["classes"].items()}
    us = {name: round(v * 1e3, 6) for name, v in ms.items()}
    assert us == {"gemm": 30, "attention": 30, "elementwise": 5, "optimizer": 5,
                  "copies": 5, "collectives": 8, "other": 2,
                  "idle": 96 - 82}  # fmt: skip
    # idle: the window (192 µs, 96 a step) less the busy union (82 µs a step: the
    # all-gather on its own stream overlaps the optimizer's fusion by 3 µs)
    assert table["traced_step_ms"] == pytest.approx(0.096)
    assert table["busy_ms_per_step"] == pytest.approx(0.082)
    assert table["overlap_ms_per_step"] == pytest.approx(0.003)
    assert table["sum_over_step"] == pytest.approx(99 / 100) and table["adds_up"] is True
    gemm, attention = table["classes"]["gemm"], table["classes"]["attention"]
    assert gemm["flops_per_step"] == 2 * (2 * 64 * 512 * 256)  # cuBLAS + Triton
    assert attention["flops_per_step"] == 2 * (2 * 2 * 8 * 1024 * 1024 * 64) * 0.5  # causal
    assert gemm["floor_ms_per_step"] == pytest.approx(gemm["flops_per_step"] / 500e12 * 1e3)
    opt = table["classes"]["optimizer"]
    assert opt["bytes_per_step"] == 3 * 1024 * 4  # two f32[1024] in, one out
    assert table["classes"]["copies"]["kernels_per_step"] == 2  # the memset and the convert
    top = {op["name"]: op for op in table["top_ops"]}
    assert top["fmha.1"]["class"] == "attention" and top["custom-call.3"]["class"] == "gemm"
    assert top["custom-call.3"]["floor_ms_per_step"] == pytest.approx(2 * 64 * 512 * 256 / 5e11)
    assert top["some_unknown_kernel"]["floor_ms_per_step"] is None
    assert top["loop_subtract_fusion"]["op_name"] == "optimizer/sub"
    assert top["some_unknown_kernel"]["class"] == "other"
    md = op_profile.markdown(table)
    assert "| GEMMs | 0.030 |" in md and "| idle | 0.014 |" in md


def test_what_cannot_be_read_is_said_not_raised(tmp_path):
    op_profile = load()
    missing = op_profile.op_table(tmp_path / "none.xplane.pb", HLO, steps=3, step_seconds=0.1)
    assert missing["notes"] and missing["classes"]["gemm"]["ms_per_step"] == 0
    assert "not rendered" in op_profile.markdown({"classes": 3})
    assert "| **sum** |" in op_profile.markdown({})
    table = op_profile.op_table(gpu_trace(tmp_path / "g.xplane.pb"), "not hlo", steps=0,
                                step_seconds=0)  # fmt: skip
    assert table["classes"]["gemm"]["ms_per_step"] > 0  # by kernel names
    assert any("steps=0" in n for n in table["notes"])
