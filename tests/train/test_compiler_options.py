"""compiler_options: the XLA options a step compiles with, resolved per platform, checked,
and passed to every jit the step builds (shardax.train.compiler)."""

import dataclasses

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.train import compiler

GPU = sx.train.gpu_options()


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def state():
    return sx.TrainState.from_params({"w": jnp.zeros(3)}, lambda p, x: x @ p["w"], optax.sgd(0.1))


BATCH = {"x": np.ones((16, 3), np.float32), "y": np.ones(16, np.float32)}


def test_auto_is_the_gpu_set_on_gpus_and_nothing_on_cpus_and_tpus(mesh):
    assert sx.train.compiler_options("gpu") == GPU == sx.train.compiler_options("cuda")
    assert GPU["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert "xla_gpu_enable_triton_gemm" not in GPU  # measured faster on (docs/results.md)
    assert GPU.get("xla_gpu_all_gather_combine_threshold_bytes") == compiler.COMBINE_THRESHOLD_BYTES
    assert sx.train.compiler_options("tpu") == sx.train.compiler_options(mesh) == {}
    step = sx.make_train_step(loss_fn, mesh=mesh)
    assert step.config.compiler_options == "auto" and step.compiler_options == {}
    assert "compiler_options='auto' (cpu: none)" in repr(step)
    assert sx.make_eval_step(loss_fn, mesh=mesh).compiler_options == {}


def test_xla_is_nothing_and_a_dict_passes_through_to_every_variant(mesh):
    assert sx.train.compiler_options("gpu", "xla") == {}
    step = sx.make_train_step(loss_fn, mesh=mesh, compiler_options="xla")
    assert step.compiler_options == {} and "compiler_options='xla'" in repr(step)
    given = {"xla_cpu_enable_fast_math": False, "xla_gpu_all_gather_combine_threshold_bytes": 7}
    step = sx.make_train_step(loss_fn, mesh=mesh, compiler_options=given)
    assert step.compiler_options == given and step.config.compiler_options is not given
    assert f"compiler_options={given!r}" in repr(step)
    single = sx.train.TrainStep(loss_fn, dataclasses.replace(step.config, mode="single"))
    assert single.compiler_options == given
    assert sx.make_eval_step(loss_fn, mesh=mesh, compiler_options=given).compiler_options == given
    auto = sx.make_train_step(loss_fn, mesh=mesh, plan="auto", compiler_options=given)
    assert auto.compiler_options == given and f"compiler_options={given!r}" in repr(auto)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (["xla_x"], TypeError, r"compiler_options must be 'auto', 'xla' or a dict of XLA "
                               r"options \{name: value\}, got \['xla_x'\] \(a builtins.list\)"),
        ("fast", ValueError, r"compiler_options must be 'auto' .* got 'fast'"),
        ({"gpu_enable_triton_gemm": False}, ValueError,
         r"compiler_options names XLA options, which start with 'xla_' .*; got key "
         r"'gpu_enable_triton_gemm'"),
        ({1: True}, ValueError, r"compiler_options names XLA options, .*; got key 1"),
        ({"xla_x": [1]}, TypeError, r"compiler_options\['xla_x'\] must be a bool, int, float or "
                                    r"str \(XLA takes scalars\), got \[1\] \(a builtins.list\)"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_the_argument_rule_and_value(mesh, bad, error, match):
    with pytest.raises(error, match=r"^sx\.make_train_step: " + match):
        sx.make_train_step(loss_fn, mesh=mesh, compiler_options=bad)
    with pytest.raises(error, match=match):
        sx.train.StepConfig(mesh=mesh, compiler_options=bad)
    with pytest.raises(error, match=r"^sx\.train\.compiler_options: " + match):
        sx.train.compiler_options("gpu", bad)
    with pytest.raises(ValueError, match=r"pass a mesh, a device or a platform name"):
        sx.train.compiler_options("gpux")


def test_pmap_takes_none_and_says_so(mesh):
    step = sx.make_train_step(loss_fn, mesh=mesh, mode="pmap")
    assert step.compiler_options == {} and "(pmap: none, jax.pmap takes no" in repr(step)
    with pytest.raises(
        ValueError,
        match=r"mode='pmap' compiles with jax.pmap, which takes no "
        r"compiler options; got compiler_options=\{'xla_x': 1\}",
    ):
        sx.make_train_step(loss_fn, mesh=mesh, mode="pmap", compiler_options={"xla_x": 1})


@pytest.mark.parametrize("mode", ["jit", "shard_map", "single"])
def test_the_options_reach_the_compiled_program(mesh, mode):
    """XLA refuses an option it does not know when it compiles: the step's jit got it."""
    bad = {"xla_shardax_no_such_option": True}
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode, compiler_options=bad)
    placed = step.shard(state())
    with pytest.raises(Exception, match="No such compile option: 'xla_shardax_no_such_option'"):
        step.lower(placed, BATCH).compile()
    with pytest.raises(Exception, match="No such compile option"):
        step(placed, BATCH)
    evaluate = sx.make_eval_step(loss_fn, mesh=mesh, mode=mode, compiler_options=bad)
    with pytest.raises(Exception, match="No such compile option"):
        evaluate(evaluate.shard(state()), BATCH)


def test_every_gpu_name_is_one_this_jaxlib_knows_and_the_other_generation_is_not():
    """GPU option names are fields of XLA's DebugOptions, which every backend parses: the
    CPU compiler accepts or refuses them by name. jaxlib 0.10 has the boolean
    xla_gpu_enable_pipelined_*, 0.11 and later the enum xla_gpu_pipeline_*."""
    fn = jax.jit(lambda x: x * 2)
    fn.lower(jnp.ones(2)).compile(compiler_options=GPU)
    installed = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
    other = sx.train.gpu_options(jaxlib_version=(0, 12) if installed < (0, 11) else (0, 10))
    foreign = sorted(set(other) - set(GPU))
    assert len(foreign) == 3
    for name in foreign:
        with pytest.raises(Exception, match=f"No such compile option: '{name}'"):
            fn.lower(jnp.ones(2)).compile(compiler_options={name: other[name]})


def test_set_environment_sets_only_what_is_missing():
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert compiler.set_gpu_environment(env) == {} and env == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    env = {}
    assert compiler.set_gpu_environment(env) == compiler.ENVIRONMENT == env


def test_estimate_records_the_options_the_step_compiled_with(mesh):
    given = {"xla_cpu_enable_fast_math": False}
    step = sx.make_train_step(loss_fn, mesh=mesh, compiler_options=given)
    report = sx.estimate(step, state(), BATCH)
    assert report.compiler_options == given == report.to_dict()["compiler_options"]
    assert "compiler options: 1 set: xla_cpu_enable_fast_math=False" in str(report)
    w = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    mine = sx.estimate(jax.jit(lambda w, x: jnp.sum(x @ w)), w, x)
    assert mine.compiler_options is None and "compiler options: unknown" in str(mine)


def test_combine_thresholds_are_sized_from_the_state_under_auto_on_gpus():
    """About 1/16 of the weights (in the compute dtype) per all-gather and all-reduce, 1/16
    of a device's share per reduce-scatter, within [1 MiB, 1 GiB]; only for "auto" on a
    GPU mesh of several devices (tests/compile/test_overlap_targets.py shows the overlap)."""
    t = sx.train.combine_thresholds(2.4e9, 8)
    assert t == {
        "xla_gpu_all_gather_combine_threshold_bytes": 150_000_000,
        "xla_gpu_all_reduce_combine_threshold_bytes": 150_000_000,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 18_750_000,
    }
    assert set(sx.train.combine_thresholds(1e3, 8).values()) == {1 << 20}  # the floor
    assert set(sx.train.combine_thresholds(1e12, 8).values()) == {1 << 30}  # the ceiling
    params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
              "step": jax.ShapeDtypeStruct((), jnp.int32)}  # fmt: skip
    auto = compiler.for_state(GPU, "auto", "gpu", params, jnp.bfloat16, 8)
    assert auto == {**GPU, **sx.train.combine_thresholds(2 * 1024 * 1024, 8)}
    # bf16 params count as floating (NumPy's issubdtype says bfloat16 is not: the 70B
    # target's bf16 state once got the 1 MiB floor, and hundreds of small collectives)
    bf16 = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)}
    assert compiler.for_state(GPU, "auto", "gpu", bf16, jnp.bfloat16, 8) == {
        **GPU,
        **sx.train.combine_thresholds(2 * 4096 * 4096, 8),
    }
    for value, platform, shards in (("xla", "gpu", 8), ("auto", "cpu", 8), ("auto", "gpu", 1)):
        assert compiler.for_state({}, value, platform, params, jnp.bfloat16, shards) == {}
    # A dict is taken as given, thresholds or not.
    mine = {"xla_gpu_enable_latency_hiding_scheduler": False}
    assert compiler.for_state(mine, mine, "gpu", params, jnp.bfloat16, 8) == mine


def test_a_step_reports_the_options_its_program_compiles_with(mesh):
    step = sx.make_train_step(loss_fn, mesh=mesh)
    assert step.compiler_options_for(state()) == step.compiler_options == {}  # CPU
