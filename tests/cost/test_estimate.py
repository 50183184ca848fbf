"""sx.estimate, the HLO's FLOPs and replica groups, and the step-time prediction.

The pure functions run on plain numbers and HLO text; sx.estimate runs on the 8 simulated
CPU devices (no datasheet: figures, no predicted time). The tests marked ``compile_only``
compile for compile-only GPU devices and skip where the compile extras are missing.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.flops import (
    compiled_flops,
    hlo_flops,
    library_call_flops,
    transformer_flops_per_token,
)
from shardax.cost.hlo import attention_kernel, collectives, replica_groups
from shardax.cost.links import link_bandwidths
from shardax.cost.memory import estimate as formula
from shardax.cost.predict import link_of, predict_step
from shardax.cost.report import HEADROOM
from shardax.train.auto import Candidate, choose


def test_replica_groups_forms():
    assert replica_groups("replica_groups=[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert replica_groups("replica_groups={{0,2},{1,3}}") == ((0, 2), (1, 3))
    assert replica_groups("replica_groups={}", 4) == ((0, 1, 2, 3),)
    assert replica_groups("source_target_pairs={{0,1},{1,2}}") == ((0, 1), (1, 2))
    mesh = "replica_groups=mesh['a'=2,'b'=4] {'a'}"
    assert replica_groups(mesh) == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_collective_groups_match_the_mesh(mesh_2d):
    """An all-reduce over one axis of a 2-D mesh: each group is that axis's devices."""
    x = jax.ShapeDtypeStruct(
        (8, 8), jnp.float32, sharding=NamedSharding(mesh_2d, P(*mesh_2d.axis_names))
    )
    hlo = jax.jit(lambda a: a.sum(0)).lower(x).compile().as_text()
    ops = collectives(hlo, mesh_2d.size)
    assert ops and all(len(g) == c.group for c in ops for g in c.groups)
    first_axis = mesh_2d.axis_names[0]
    ids = {d.id: i for i, d in enumerate(mesh_2d.devices.flat)}
    column = tuple(sorted(ids[d.id] for d in mesh_2d.devices[:, 0]))
    assert mesh_2d.shape[first_axis] == len(ops[0].groups[0])
    assert column in {tuple(sorted(g)) for g in ops[0].groups}


def test_hlo_flops_counts_dots_and_loop_trips():
    a, b = jnp.ones((32, 64)), jnp.ones((64, 16))
    hlo = jax.jit(lambda x, y: x @ y).lower(a, b).compile().as_text()
    assert hlo_flops(hlo) == 2 * 32 * 64 * 16

    def looped(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    ws = jnp.ones((5, 64, 64))
    compiled = jax.jit(looped).lower(jnp.ones((8, 64)), ws).compile()
    assert hlo_flops(compiled.as_text()) == 5 * 2 * 8 * 64 * 64
    # XLA's cost_analysis() counts the loop body once; compiled_flops adds the other 4
    # trips' matmuls (and keeps XLA's count of the tanh and the rest, a few %).
    assert 5 * 2 * 8 * 64 * 64 <= compiled_flops(compiled) <= 1.05 * 5 * 2 * 8 * 64 * 64


def test_a_conditional_counts_its_costliest_branch_as_xla_does():
    """A lax.switch in a 6-trip scan: branches of 1, 2 and 0 matmuls. A static count
    cannot know which runs, so each trip counts the costliest (2), never all three."""

    def switched(x, ws):
        def body(h, i):
            branches = [lambda h: h @ ws[0], lambda h: h @ ws[1] @ ws[1], jnp.tanh]
            return jax.lax.switch(i % 3, branches, h), None

        return jax.lax.scan(body, x, jnp.arange(6))[0]

    compiled = jax.jit(switched).lower(jnp.ones((64, 256)), jnp.ones((2, 256, 256))).compile()
    matmul = 2 * 64 * 256 * 256
    assert hlo_flops(compiled.as_text()) == 6 * 2 * matmul
    assert 6 * 2 * matmul <= compiled_flops(compiled) <= 1.01 * 6 * 2 * matmul


GEMM_LINE = (  # as XLA:GPU writes a cuBLAS matmul: the product and a workspace, a tuple
    "%custom-call.3 = (bf16[64,512]{1,0}, s8[4194304]{0}) custom-call(%p.1, %p.2), "
    'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,'
    '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":'
    '["0"]}}}'
)


def test_cublas_gemms_count_in_the_hlo_and_beside_xla_cost_analysis():
    """XLA:GPU's cost_analysis() counts a cuBLAS call as zero FLOPs (on an H200 it gave
    1.22e10 for a step of 1.57e13): compiled_flops adds the library calls' matmuls."""
    hlo = f"%p.1 = bf16[64,256]{{1,0}} parameter(0)\n{GEMM_LINE}"
    assert hlo_flops(hlo) == library_call_flops(hlo) == 2 * 64 * 512 * 256
    lt = hlo.replace("__cublas$gemm", "__cublas$lt$matmul")
    assert library_call_flops(lt) == 2 * 64 * 512 * 256

    class GPUCompiled:  # what a jax.stages.Compiled for a GPU answers, for this program
        def cost_analysis(self):
            return {"flops": 1000.0}  # the elementwise ops XLA counts

        def as_text(self):
            return hlo

    assert compiled_flops(GPUCompiled()) == 1000.0 + 2 * 64 * 512 * 256
    # On the CPU nothing is a library call: XLA's own count, unchanged.
    compiled = jax.jit(lambda x, y: x @ y).lower(jnp.ones((32, 64)), jnp.ones((64, 16))).compile()
    assert library_call_flops(compiled.as_text()) == 0.0
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis  # older JAX
    assert compiled_flops(compiled) == analysis["flops"]


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs a GPU (JAX_PLATFORMS=cuda,cpu): XLA:GPU's own count is what it checks",
)
def test_compiled_flops_of_gpu_matmuls_plain_and_scanned_are_2mnk():
    """compiled_flops adds what XLA:GPU's cost_analysis() leaves out (cuBLAS calls, loop
    trips); should a JAX count them itself, this catches the double count."""
    x, w = jnp.ones((1024, 2048), jnp.bfloat16), jnp.ones((2048, 2048), jnp.bfloat16)
    plain = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    assert compiled_flops(plain) == pytest.approx(2 * 1024 * 2048 * 2048, rel=0.05)
    ws = jnp.stack([w] * 4)
    scan = jax.jit(lambda x, ws: jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0])
    scanned = scan.lower(x, ws).compile()
    assert compiled_flops(scanned) == pytest.approx(4 * 2 * 1024 * 2048 * 2048, rel=0.05)


def test_transformer_flops_halve_causal_attention():
    dense = transformer_flops_per_token(1e9, 32, 4096, 4096, causal=False)
    causal = transformer_flops_per_token(1e9, 32, 4096, 4096)
    assert dense - causal == pytest.approx(6 * 32 * 4096 * 4096)
    assert causal == pytest.approx(6e9 + 6 * 32 * 4096 * 4096)


def test_prediction_with_and_without_overlap():
    p = predict_step(
        flops=1e15, hbm_bytes=3e12, link_bytes={"intra-host": 9e11, "inter-host": 1e11},
        peak_flops=1e15, hbm_bandwidth=3e12, link_bandwidth={"intra-host": 4.5e11,
        "inter-host": 5e10}, compute_efficiency=0.5, tokens=8000, model_flops=8e15, devices=8,
    )  # fmt: skip
    assert (p.compute_s, p.memory_s, p.link_s) == (2.0, 1.0, {"intra-host": 2.0, "inter-host": 2.0})
    assert p.overlapped_s == 2.0 and p.serial_s == 6.0
    assert p.tokens_per_s_per_device(True) == 500.0
    assert p.mfu(True) == pytest.approx(0.5) and p.mfu(False) == pytest.approx(1 / 6)
    unknown = predict_step(flops=1, hbm_bytes=1, link_bytes={"inter-host": 5.0}, peak_flops=1,
                           hbm_bandwidth=1, link_bandwidth={})  # fmt: skip
    assert unknown.link_s == {"inter-host": None} and unknown.mfu() is None
    assert json.dumps(p.to_dict())
    with pytest.raises(ValueError, match="compute_efficiency must be in"):
        predict_step(flops=1, hbm_bytes=1, link_bytes={}, peak_flops=1, hbm_bandwidth=1,
                     link_bandwidth={}, compute_efficiency=1.5)  # fmt: skip


def test_links_by_hosts_and_slices():
    assert link_of({0}, {0}) == "intra-host"
    assert link_of({0, 1}, {0}) == "inter-host"
    assert link_of({0, 1}, {0, 1}) == "inter-slice"
    spec = type("S", (), {"ici_bandwidth": 4.5e11, "dcn_bandwidth": 5e10})()
    assert link_bandwidths(spec, None)["inter-host"] == 5e10
    assert link_bandwidths(spec, None, "tpu")["inter-host"] == 4.5e11  # ICI spans a slice
    assert link_bandwidths(spec, {"inter-host": 1.0})["inter-host"] == 1.0


def _candidate(name, total, predicted_s, mesh):
    return Candidate(name, sx.replicate(mesh), total, 0, 0, 0, 1.0, {}, None, predicted_s)


def test_auto_picks_the_fastest_predicted_that_fits_with_headroom(mesh):
    budget = 100.0
    cands = [
        _candidate("fast_but_tight", 95, 1.0, mesh),  # fits, but not with 10% headroom
        _candidate("slow", 50, 3.0, mesh),
        _candidate("quick", 80, 2.0, mesh),
    ]
    report = choose(cands, budget, "train step")
    assert report.name == "quick" and HEADROOM == 0.1
    assert "fastest predicted step" in report.reason
    why = report.reasons()
    assert why["quick"] == "picked" and why["slow"] == "predicted +50% slower"
    assert "predicted step (s)" in str(report)


@pytest.fixture(scope="module")
def small_train(mesh):
    from shardax.models.mlp import make_mlp

    def init():
        return sx.TrainState.create(make_mlp(16, 256, 2, 4, 0), optax.adam(1e-3))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    batch = {"x": jax.ShapeDtypeStruct((64, 16), jnp.float32),
             "y": jax.ShapeDtypeStruct((64, 4), jnp.float32)}  # fmt: skip
    return jax.eval_shape(init), loss_fn, batch


def test_estimate_train_step_memory_against_formula(mesh, small_train):
    state, loss_fn, batch = small_train
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=0))
    report = sx.estimate(step, state, batch)
    n = sum(x.size for x in jax.tree.leaves(state.params))
    expected = formula(n, "fp32", data=8, shard_data=True)
    got = report.memory["params"] + report.memory["optimizer"]
    assert got == pytest.approx(expected.params_bytes + expected.optimizer_bytes, rel=0.1)
    assert report.memory["peak"] >= got
    assert report.flops_hlo > 0 and report.roofline is None  # a CPU: no datasheet
    assert report.model_flops == 6.0 * n * 64
    d = report.to_dict()
    assert json.loads(json.dumps(d))["memory"] == report.memory
    assert "no datasheet" in str(report)


def test_estimate_errors(mesh, small_train):
    state, loss_fn, batch = small_train
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=0))
    other = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    placed = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(other, P("a") if x.ndim else P())
        ),
        state,
    )
    with pytest.raises(ValueError, match="sharded over mesh axis 'a', which the step's mesh"):
        sx.estimate(step, placed, batch)
    odd = {k: jax.ShapeDtypeStruct((60, v.shape[1]), v.dtype) for k, v in batch.items()}
    with pytest.raises(ValueError, match="60"):
        sx.estimate(step, state, odd)
    with pytest.raises(TypeError, match="step must be a make_train_step step"):
        sx.estimate(lambda s, b: s, state, batch)


def test_estimate_plot(mesh, small_train, tmp_path):
    pytest.importorskip("matplotlib")
    state, loss_fn, batch = small_train
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.zero2(mesh, min_size=0))
    report = sx.estimate(step, state, batch)
    assert report.memory["gradients"] < report.memory["params"]  # ZeRO-2 splits the grads
    report.plot(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 1000
    assert dataclasses.asdict(report)["devices"] == 8


H100 = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
clock_rate_ghz: 1.98 device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@pytest.fixture(scope="module")
def h100_2x4():
    """2 hosts × 4 compile-only H100s (sx.target where this shardax has it)."""
    try:
        if hasattr(sx, "target"):
            devices = sx.target("2x4xH100")
            return list(getattr(devices, "devices", devices))
        from jax.experimental import topologies

        return topologies.get_topology_desc(
            "", platform="cuda", topology="1 x 2 x 4", target_config=H100
        ).devices
    except Exception as e:  # the compile extras are missing, or JAX is older than 0.12
        pytest.skip(f"no compile-only GPU devices here: {e}")


@pytest.mark.compile_only
def test_estimate_for_an_h100_target_splits_links(h100_2x4, small_train):
    state, loss_fn, batch = small_train
    mesh = jax.sharding.Mesh(np.array(h100_2x4).reshape(2, 4), ("replica", "data"))
    step = sx.make_train_step(
        loss_fn, mesh=mesh, plan=sx.fsdp(mesh, "data", min_size=0), data_axis=("replica", "data")
    )
    report = sx.estimate(step, state, batch, links={"intra-host": 4.5e11, "inter-host": 5e10})
    assert report.device_kind == "NVIDIA H100 80GB HBM3" and report.fits
    assert report.flops_backend is None and report.flops_hlo > 0  # counted from the HLO
    links = report.link_bytes()
    assert links.get("inter-host", 0) > 0 and links.get("intra-host", 0) > 0
    p = report.roofline
    assert p is not None and p.serial_s >= p.overlapped_s > 0
    assert "PREDICTED (not measured)" in str(report)
    o = report.overlap  # from the compiled schedule, priced at the links' bandwidths
    assert 0 <= o["exposed_s"] <= o["collective_s"] and o["collectives"] >= o["overlapped"]
    assert "exposed collective time: " in str(report)
    assert "(a rough guide; the per-op model below is the prediction)" in " ".join(
        str(report).split()
    )  # the roofline's table, beside the per-op model on a GPU target
    c = report.per_op  # on a GPU target the line gives the per-op model's figures, as its table
    assert (f"exposed collective time: {c.exposed_s * 1e3:.2f} ms per step of "
            f"{c.collective_s * 1e3:.2f} ms") in " ".join(str(report).split())  # fmt: skip
    n = sum(x.size for x in jax.tree.leaves(state.params))
    expected = formula(n, "fp32", data=4, shard_data=True)  # FSDP over a host's 4
    got = report.memory["params"] + report.memory["optimizer"]
    assert got == pytest.approx(expected.params_bytes + expected.optimizer_bytes, rel=0.1)
    # Model FLOPs above the HLO's count (work in a kernel the HLO does not show, as TPU
    # splash attention's): compute is the model's, and the report says why.
    floor = 100 * report.flops_hlo
    above = sx.estimate(step, state, batch, model_flops=8 * floor)  # 8 devices
    assert above.roofline.compute_s == pytest.approx(100 * p.compute_s, rel=1e-6)
    assert not any("misses a kernel's work" in n for n in report.notes)
    assert any("misses a kernel's work" in n for n in above.notes)


@pytest.mark.compile_only
def test_a_gpu_targets_fit_is_judged_in_the_memory_jax_would_have(small_train):
    """A GPU target compiles in memory_fraction of its memory; the report's headroom and
    the auto plan's budget are that share, not the whole HBM."""
    from shardax.train.auto import default_device_memory

    state, loss_fn, batch = small_train
    target = sx.target("1xH100", memory_fraction=0.5)
    mesh = sx.make_mesh({"data": 1}, devices=target)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.replicate(mesh))
    report = sx.estimate(step, state, batch)
    hbm = target.spec.memory_bytes
    assert report.hbm_bytes == hbm and report.memory_budget == 0.5 * hbm
    assert report.budget_note == "memory_fraction 0.5 of 81,559 MiB"
    assert report.headroom == pytest.approx(1 - report.memory["peak"] / (0.5 * hbm))
    assert default_device_memory(target[0]) == 0.5 * hbm
    text = " ".join(str(report).split())
    assert "HBM 79.65 GiB, budget 39.82 GiB (memory_fraction 0.5 of 81,559 MiB)" in text
    assert f"headroom {report.headroom:.1%} of the budget: fits" in text
    assert report.to_dict()["memory_budget"] == 0.5 * hbm
    # Without a budget (a device no figure describes) the headroom is HBM's.
    assert dataclasses.replace(report, memory_budget=None).headroom == pytest.approx(
        1 - report.memory["peak"] / hbm
    )


OOM = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
       "memory required for HLO temporaries (24.00G) exceeds available HBM (15.75G).")  # fmt: skip


def test_a_candidate_the_compiler_refused_does_not_fit(mesh):
    from shardax.train.auto import refused_candidate

    assert refused_candidate("x", None, RuntimeError("INVALID_ARGUMENT: bad")) is None
    refused = refused_candidate("big", None, RuntimeError(OOM))
    assert refused.temp_bytes == 24 * 2**30 and refused.refused.startswith("RESOURCE_EXHAUSTED")
    cands = [_candidate("slow", 50, 3.0, mesh), dataclasses.replace(refused, plan=sx.fsdp(mesh))]
    report = choose(cands, 100.0, "train step")
    assert report.name == "slow"
    assert report.reasons()["big"].startswith("does not fit: the compiler refused it")


@pytest.mark.compile_only("tpu")
def test_an_out_of_memory_compile_is_a_does_not_fit_report():
    """libtpu refuses a step whose temporaries exceed HBM; sx.estimate says it does not
    fit, with the bytes the error names, instead of raising."""
    mesh = sx.make_mesh({"data": 4}, devices=sx.target("v5e-4"))
    x = jax.ShapeDtypeStruct((4 * 32768, 65536), jnp.float32,
                             sharding=NamedSharding(mesh, P("data")))  # fmt: skip
    report = sx.estimate(jax.jit(lambda w, x: jnp.sum(jnp.exp(x) @ w.T)), x, x)
    assert report.fits is False and report.roofline is None
    assert report.compile_error.startswith("RESOURCE_EXHAUSTED")
    need = report.memory["temporaries"]
    assert need > 16e9 and report.memory["peak"] >= need  # more than the chip's 16 GB
    assert "the compiler refused the step" in str(report)
    assert json.loads(json.dumps(report.to_dict()))["compile_error"] == report.compile_error


def test_async_reduce_scatter_counts_its_results_not_its_operands():
    """XLA:GPU's reduce-scatter-start returns (operands, results): 8 × the result each;
    counting both made a 70B's gradient reduce-scatter ~9× too large."""
    hlo = """HloModule m

ENTRY %main (p: f32[256,64]) -> f32[32,64] {
  %p = f32[256,64]{1,0} parameter(0)
  %rs = ((f32[256,64]{1,0}, f32[256]{0}), (f32[32,64]{1,0}, f32[32]{0})) reduce-scatter-start(%p, %p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  ROOT %d = (f32[32,64]{1,0}, f32[32]{0}) reduce-scatter-done(%rs)
}
"""  # noqa: E501
    (found,) = collectives(hlo, 8)
    assert (found.op, found.bytes, found.group) == ("reduce-scatter", (32 * 64 + 32) * 4, 8)
    assert found.sent_bytes == 7 * (32 * 64 + 32) * 4


@pytest.mark.compile_only("tpu")
def test_tpu_matmuls_in_a_scan_are_counted_from_the_hlo():
    """XLA:TPU writes matmuls as ``convolution`` and its loops carry no known trip count
    (the condition's ``i < 3`` tells it); its cost_analysis() counts the body once."""
    mesh = sx.make_mesh({"data": 4}, devices=sx.target("v5e-4"))
    w = jax.ShapeDtypeStruct((3, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def f(w, x):
        return jnp.sum(jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0])

    compiled = jax.jit(f).lower(w, x).compile()
    assert hlo_flops(compiled.as_text()) == 3 * 2 * 16 * 512 * 512  # 16 rows per device


@pytest.mark.compile_only("tpu")
def test_tpu_gpt_flops_from_the_hlo_follow_6n_plus_attention(abstract_gpt_step):
    """XLA:TPU writes batched matmuls (attention, heads) as convolutions whose padded,
    dilated or reversed window dimensions are batch dimensions: one tap, not the size."""
    from shardax.models import gpt

    cfg = gpt.GPTConfig(2, 256, 4, 128, vocab=256, scan_layers=True)
    _, model, state, step = abstract_gpt_step("v5e-4", cfg, data=4)
    tok = jax.ShapeDtypeStruct((16, 96), jnp.int32)
    hlo = step.lower(state, {"inputs": tok, "targets": tok}).compile().as_text()
    n = gpt.param_count(model, embeddings=False)  # XLA computes the whole causal square
    # 96 tokens: not a multiple of splash attention's 128-token blocks, so attention is
    # XLA's own (its batched matmuls are convolutions too), said once by name.
    assert attention_kernel(hlo) == "dense"
    expected = transformer_flops_per_token(n, 2, 96, 256, causal=False) * 16 * 96 / 4
    assert hlo_flops(hlo) == pytest.approx(expected, rel=0.15)


def test_cudnn_attention_flops_are_counted_from_its_custom_calls():
    """cuDNN's fused attention is a custom call: 2 matmuls forward, 5 backward (scores
    recomputed), halved under a causal mask; read from its operand shapes (BTNH)."""
    line = (
        "%fwd = (bf16[2,8,1024,64]{3,1,2,0}, f32[2,8,1024]{2,1,0}) custom-call(%q, %k, %v), "
        'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints='
        "{bf16[2,1024,8,64]{3,2,1,0}, bf16[2,512,8,64]{3,2,1,0}, bf16[2,512,8,64]{3,2,1,0}}, "
        'backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}'
    )
    matmul = 2 * 2 * 8 * 1024 * 512 * 64
    assert hlo_flops(line) == 2 * matmul * 0.5
    backward = line.replace("fmhaSoftmax", "fmhaSoftmaxBackward").replace("CAUSAL", "NO_MASK")
    assert hlo_flops(backward) == 5 * matmul


def test_one_byte_formatter_serves_the_estimate_and_the_plan_reports():
    from shardax import _format
    from shardax.cost import report as estimation
    from shardax.plan import report

    # defined once, below both layers: the plan's report does not import cost for it
    assert report.format_bytes is estimation.format_bytes is _format.format_bytes
    assert not hasattr(estimation, "fb")
    got = [estimation.format_bytes(n) for n in (512, 1536, 5 * 2**30, 3 * 2**40, 2**52)]
    assert got == ["512 B", "1.50 KiB", "5.00 GiB", "3.00 TiB", "4096.00 TiB"]
