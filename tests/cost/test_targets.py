"""sx.target: names, datasheet rows, GPU configs (every leg), and the compile-only
devices themselves (``compile_only``: CI leg 3, JAX 0.12 with the compile extras)."""

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost import budget, gpu_config, plugins, target_names
from shardax.cost.accelerators import gpu_targets, named, tpu_targets

JAX_012 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12)


# --- names (no compiler needed) ----------------------------------------------------------


@pytest.mark.parametrize(
    "name,hosts,per_host",
    [("8xH100", 1, 8), ("4xH200", 1, 4), ("2x4xH100", 2, 4), ("64xH100", 8, 8),
     ("16xB200", 2, 8), ("8xA100-80GB", 1, 8), ("4x8xh100", 4, 8)],
)  # fmt: skip
def test_gpu_names_give_hosts_of_8_unless_told(name, hosts, per_host):
    parsed = target_names.parse_target(name)
    assert (parsed["platform"], parsed["hosts"], parsed["devices_per_host"]) == (
        "gpu",
        hosts,
        per_host,
    )


@pytest.mark.parametrize(
    "name,chips,slices,topology",
    [("v5p-8", 4, 1, "v5p:2x2x1"), ("v5p-128", 64, 1, "v5p:4x4x4"), ("v5e-16", 16, 1, "v5e:4x4"),
     ("v5litepod-256", 256, 1, "v5e:16x16"), ("v6e-16", 16, 1, "v6e:4x4"),
     ("2xv5p-128", 64, 2, "v5p:4x4x4")],
)  # fmt: skip
def test_tpu_names_count_as_cloud_does(name, chips, slices, topology):
    # v5p-N counts TensorCores (2 per chip); v5e-N, v5litepod-N and v6e-N count chips.
    parsed = target_names.parse_target(name)
    assert (parsed["chips"], parsed["slices"], parsed["topology"]) == (chips, slices, topology)


@pytest.mark.parametrize(
    "name,part",
    [("8xH900", "GPU one of ['A100-80GB', 'B200', 'H100', 'H200']"),
     ("v5p-129", "v5p-N counts TensorCores (2 per chip) and N must be one of [8, 16, 32"),
     ("v5e-3", "v5e-N counts chips and N must be one of [1, 4, 8, 16"),
     ("12xH100", "12 GPUs do not fill hosts of 8; write '<hosts>x<GPUs per host>xH100'"),
     ("tpu", "e.g. '8xH100'")],
)  # fmt: skip
def test_unknown_names_list_the_known_ones(name, part):
    with pytest.raises(ValueError) as caught:
        sx.target(name)
    text = str(caught.value)
    assert text.startswith("sx.target: name must name a GPU cluster") and part in text, text
    assert text.endswith(f"got {name!r}")


def test_known_targets_parse():
    names = target_names.known_targets()
    assert {"8xH100", "64xH100", "v5p-128", "v5e-16", "v6e-16", "2xv5p-128"} <= set(names)
    assert all(target_names.parse_target(n)["platform"] in ("gpu", "tpu") for n in names)


# --- the rows of the table of accelerators and the configs written from them ------------


def test_gpu_configs_are_written_from_the_rows():
    configs = gpu_config.gpu_target_configs()
    assert sorted(configs) == ["a100-80gb.txtpb", "b200.txtpb", "h100.txtpb", "h200.txtpb"]
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in configs["h100.txtpb"]
    assert "core_count: 148" in configs["b200.txtpb"]


@pytest.mark.parametrize("kind", [*(r.device_kind for r in gpu_targets() + tpu_targets())])
def test_every_target_kind_has_a_full_datasheet_row(kind):
    platform = "tpu" if kind.startswith("TPU") else "gpu"
    spec = sx.cost.device_spec(SimpleNamespace(platform=platform, device_kind=kind))
    assert spec.peak_flops > 1e14 and spec.hbm_bandwidth > 5e11 and spec.memory_bytes >= 16e9
    assert spec.ici_bandwidth > spec.dcn_bandwidth > 0 and spec.source
    assert (spec.gpu is not None) == (platform == "gpu")
    assert named(sx.cost.accelerators.kind_of(kind)).spec is spec  # the device's own row


# --- what a leg without the compilers says ------------------------------------------------


@pytest.mark.skipif(JAX_012, reason="JAX 0.10 leg: what sx.target says there")
def test_jax_010_says_targets_need_jax_012():
    with pytest.raises(RuntimeError, match=r"^sx.target: target '8xH100' needs JAX >= 0.12 \(Py"):
        sx.target("8xH100")


@pytest.mark.skipif(
    not JAX_012 or plugins.installed("jax_plugins.xla_cuda12"),
    reason="JAX 0.12 without the gpu-compile extra: what sx.target says there",
)
def test_missing_gpu_extra_names_the_install():
    with pytest.raises(ImportError, match=r"pip install 'shardax\[gpu-compile\]'"):
        sx.target("8xH100")


@pytest.mark.skipif(
    not JAX_012 or plugins.installed("libtpu"),
    reason="JAX 0.12 without the tpu-compile extra: what sx.target says there",
)
def test_missing_tpu_extra_names_the_install():
    with pytest.raises(ImportError, match=r"pip install 'shardax\[tpu-compile\]'"):
        sx.target("v5e-16")


def test_gpu_memory_fraction_is_what_jax_takes_on_the_gpu(monkeypatch):
    """JAX compiles a program on a GPU within its allocator's share of the memory: the
    environment's fraction (XLA_CLIENT_MEM_FRACTION first, as jaxlib reads them), else 0.75;
    a compile-only GPU target plans in the same budget (XLA takes 80% of a config's
    device_memory_size when no device gives it one)."""
    for variable in budget.MEMORY_FRACTION_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    fraction = budget.gpu_memory_fraction
    assert fraction() == 0.75 and fraction(0.95) == 0.95
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert fraction() == 0.9
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.8")
    assert fraction() == 0.8 and fraction(0.5) == 0.5
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "most")
    with pytest.raises(ValueError, match=r"sx.target: XLA_CLIENT_MEM_FRACTION .* in \(0, 1\] "
                       r".*got 'most'"):  # fmt: skip
        fraction()
    for bad in (0, 1.5, "half", "0.9", True):  # a string only from the environment
        with pytest.raises(ValueError, match=r"sx.target: memory_fraction .*got"):
            fraction(bad)
    config = gpu_config.gpu_target_configs()["h100.txtpb"]
    text = budget.budgeted_gpu_config(config, 81559 * 2**20, 0.75)
    assert "  device_memory_size: 80175759360\n" in text  # x 0.8 = 75% of 81,559 MiB
    assert text.replace("80175759360", "85520809984") == config
    with pytest.raises(ValueError, match="one device_memory_size field; found 0"):
        budget.budgeted_gpu_config("gpu_device_info {\n}\n", 1, 0.5)


def test_device_memory_reads_the_allocator_on_this_process_for_any_device():
    """Every process plans in the same budget: another process's GPU reports no allocator
    figures to this one, so they are read on this process's device of its kind."""
    device_memory = budget.device_memory
    mine = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", process_index=0,
                           memory_stats=lambda: {"bytes_limit": 6e10})  # fmt: skip
    client = SimpleNamespace(local_devices=lambda: [mine])
    theirs = SimpleNamespace(platform="gpu", device_kind=mine.device_kind, client=client,
                             process_index=jax.process_index() + 1,
                             memory_stats=lambda: None)  # fmt: skip
    mine.client = client
    limit = "the allocator's limit: 57,220 MiB"
    assert device_memory(mine) == device_memory(theirs) == (6e10, limit)

    def not_addressable() -> None:
        raise RuntimeError("FAILED_PRECONDITION: not an addressable device")

    refusing = SimpleNamespace(**{**vars(theirs), "memory_stats": not_addressable})
    assert device_memory(refusing) == (6e10, limit)
    # No device of that kind here (a compile-only target's other hosts): the datasheet.
    lonely = SimpleNamespace(**{**vars(theirs), "client": SimpleNamespace(local_devices=list)})
    assert device_memory(lonely) == (81559 * 2**20, "datasheet: 81,559 MiB")


# --- compile-only devices (leg 3) -----------------------------------------------------------


@pytest.mark.compile_only
def test_a_gpu_target_compiles_within_the_memory_jax_would_have():
    """A step that needs more than the budget is rematerialized (XLA recomputes
    activations), as on a GPU whose JAX takes that fraction; with room it is not."""

    def loss(w, x):
        for i in range(8):
            x = jnp.tanh(x @ w[i])
        return x.sum()

    clones = {}
    for fraction in (0.95, 0.05):
        target = sx.target("1xH100", memory_fraction=fraction)
        assert target.memory_fraction == fraction
        rep = NamedSharding(sx.make_mesh({"data": 1}, devices=target), P())
        w = jax.ShapeDtypeStruct((8, 4096, 4096), jnp.float32, sharding=rep)
        x = jax.ShapeDtypeStruct((65536, 4096), jnp.float32, sharding=rep)  # 1 GiB
        text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
        clones[fraction] = text.count(".remat")
    assert clones[0.05] > 8 * max(clones[0.95], 1)
    with pytest.raises(ValueError, match=r"memory_fraction .* for GPU targets; 'v5e-8' is a TPU"):
        sx.target("v5e-8", memory_fraction=0.9)


@pytest.mark.compile_only
@pytest.mark.parametrize(
    "name,kind,n,hosts,slices",
    [("8xH100", "NVIDIA H100 80GB HBM3", 8, 1, 1), ("2x4xH100", "NVIDIA H100 80GB HBM3", 8, 2, 1),
     ("16xH200", "NVIDIA H200", 16, 2, 1), ("8xB200", "NVIDIA B200", 8, 1, 1),
     ("8xA100-80GB", "NVIDIA A100-SXM4-80GB", 8, 1, 1), ("v5e-16", "TPU v5 lite", 16, 4, 1),
     ("v5e-8", "TPU v5 lite", 8, 1, 1), ("v5p-16", "TPU v5", 8, 2, 1),
     ("v6e-16", "TPU v6 lite", 16, 4, 1), ("2xv5p-8", "TPU v5", 8, 2, 2)],
)  # fmt: skip
def test_target_devices_have_the_kind_and_hosts(name, kind, n, hosts, slices):
    target = sx.target(name)
    assert len(target) == n and target.device_kind == kind
    assert (target.hosts, target.devices_per_host, target.slices) == (hosts, n // hosts, slices)
    per_host = [d.process_index for d in target]
    assert per_host == sorted(per_host) and len(set(per_host)) == hosts
    assert target.spec is sx.cost.device_spec(target[0])


@pytest.mark.compile_only
def test_hybrid_mesh_follows_the_targets_hosts_and_slices():
    gpu = sx.make_mesh({"replica": 2, "fsdp": 4}, devices=sx.target("2x4xH100"))
    assert [{d.process_index for d in row} for row in gpu.devices] == [{0}, {1}]
    tpu = sx.make_mesh({"data": 2, "fsdp": 4}, devices=sx.target("2xv5p-8"))
    assert [{d.slice_index for d in row} for row in tpu.devices] == [{0}, {1}]


@pytest.mark.compile_only
def test_a_mesh_larger_than_the_target_says_so():
    with pytest.raises(ValueError) as caught:
        sx.make_mesh({"data": 16}, devices=sx.target("8xH100"))
    assert str(caught.value).startswith(
        "sx.make_mesh: Not enough devices: mesh requires 16 devices but only 8 available of "
        "target Target('8xH100': 8 x NVIDIA H100 80GB HBM3, 1 host x 8)"
    )


@pytest.mark.compile_only
@pytest.mark.parametrize("name", ["8xH100", "v5e-8"])
def test_a_sharded_jit_compiles_for_the_target_from_abstract_inputs(name):
    mesh = sx.make_mesh({"data": 8}, devices=sx.target(name))
    sharding = NamedSharding(mesh, P("data"))
    x = jax.ShapeDtypeStruct((8 * 256, 1024), jnp.bfloat16, sharding=sharding)
    compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(x).compile()
    # Each device holds its 256 x 1024 bf16 rows of the argument.
    assert compiled.memory_analysis().argument_size_in_bytes == 256 * 1024 * 2


_LAPTOP = """
    import os, jax, shardax as sx
    {before}
    try:
        print(len(sx.target("8xH100")), os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"))
        print(jax.devices()[0].platform, len(sx.target("2x4xH100")))  # after: no variable needed
    except RuntimeError as e:
        print(e)
"""


@pytest.mark.compile_only("gpu")
@pytest.mark.skipif(plugins.cuda_driver_present(), reason="a machine with an NVIDIA driver")
@pytest.mark.parametrize(
    "before,says",
    [("", "8 None\ncpu 8"),
     ("jax.devices()", "Set JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK")],
)  # fmt: skip
def test_a_laptop_needs_no_environment_until_jax_has_started(before, says):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.pop("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", None)
    code = textwrap.dedent(_LAPTOP.format(before=before))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert says in out.stdout, out.stdout + out.stderr[-2000:]
