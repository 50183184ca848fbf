"""The XLA compiler options a step compiles with: ``compiler_options``.

The fastest JAX stacks on GPUs (MaxText, NVIDIA's JAX-Toolbox, the public H100/H200
recipes) turn on XLA:GPU options that a pip install of JAX leaves off: the latency-hiding
scheduler, collective pipelining and combining, cuBLAS for the matmuls. They set them with
``XLA_FLAGS`` for the whole process; shardax compiles the step, so it sets them per step
(``jax.jit(..., compiler_options=...)``), and
[`shardax.make_train_step`][shardax.make_train_step] takes ``compiler_options``:

- ``"auto"`` (the default): shardax's settings for the platform of the step's mesh: on
  GPUs [`gpu_options`][shardax.train.gpu_options]; on CPUs and TPUs none for now (XLA's defaults);
- ``"xla"``: XLA's own defaults, nothing set (the way back);
- a mapping ``{name: value}``: exactly those (names of XLA's ``DebugOptions``, starting
  with ``"xla_"``; values bool, int, float or str; a ``*_bytes`` size an integer >= 0). An
  option XLA reads only when the backend starts (``AT_START``:
  ``xla_force_host_platform_device_count``) is refused: per step it has no effect.

The options resolved for a step are ``step.compiler_options`` (a dict), shown in its repr.
Under ``mode="pmap"`` they are none: ``jax.pmap`` takes no compiler options, so ``"auto"``
resolves to ``{}`` there and a mapping is refused.

One setting is not a compiler option: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``ENVIRONMENT``)
keeps the GPU's work queues in the order XLA scheduled them, which the recipes set so that
collectives overlap compute. CUDA reads it when the GPU backend starts, so it must be in the
environment before JAX uses the GPU: ``shardax launch`` sets it for the processes it starts,
``shardax train`` when not set and no GPU backend has started yet; a process started
otherwise sets it itself (``export CUDA_DEVICE_MAX_CONNECTIONS=1``, or
[`set_gpu_environment`][shardax.train.set_gpu_environment] first thing).

>>> sx.train.compiler_options("gpu")["xla_gpu_enable_latency_hiding_scheduler"]
True
>>> sx.train.compiler_options("cpu"), sx.train.compiler_options("gpu", "xla")
({}, {})
>>> mesh = sx.make_mesh({"data": -1})
>>> step = sx.make_train_step(lambda model, batch: jnp.mean(model(batch["x"])), mesh=mesh,
...                           compiler_options={"xla_cpu_enable_fast_math": False})
>>> step.compiler_options
{'xla_cpu_enable_fast_math': False}
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import Mesh

from shardax.checks import as_count, public, received

AUTO, XLA = "auto", "xla"
"""The two named settings: shardax's options for the platform, and XLA's own defaults."""

Value = bool | int | float | str

COMBINE_THRESHOLD_BYTES: int | None = None
"""The collective combine thresholds of [`gpu_options`][shardax.train.gpu_options] alone:
None leaves XLA's own. Under ``"auto"`` a step sets them from the state it compiles for
([`combine_thresholds`][shardax.train.combine_thresholds]). The recipes' fixed 1 GiB
joined every layer's all-gather of an unrolled GPT into one at the step's start, and every
gradient reduce-scatter into one after the backward pass, so nothing overlapped
(``tests/compile/ test_overlap_targets.py``, 8xH100)."""

COMBINE_PARTS = 16
"""[`combine_thresholds`][shardax.train.combine_thresholds] sizes each combined collective to about
1/16 of the step's
weights (or of a device's gradient shard): a layer or less in a model of 16 layers or more,
so each layer's gather can start ahead of the layer and each layer's reduction run under
the next layer's backward pass."""

_MIB, _GIB = 1 << 20, 1 << 30

ENVIRONMENT: dict[str, str] = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
"""Environment variables the GPU settings need before JAX starts a GPU backend (CUDA
reads them then): one hardware work queue, so that kernels and collectives run in the
order XLA's latency-hiding scheduler put them (NVIDIA advises against it on Blackwell)."""

_PIPELINED = ("all_gather", "reduce_scatter", "all_reduce")


def _jaxlib_version() -> tuple[int, int]:
    major, minor = jaxlib.__version__.split(".")[:2]
    return int(major), int(minor)


@public("sx.train.gpu_options")
def gpu_options(
    *,
    combine_threshold_bytes: int | None = COMBINE_THRESHOLD_BYTES,
    jaxlib_version: tuple[int, int] | None = None,
) -> dict[str, Value]:
    """shardax's XLA:GPU options (``"auto"`` on GPUs), for ``jaxlib_version`` (default: the
    installed jaxlib's). From the settings MaxText and NVIDIA's JAX-Toolbox run with:

    - the latency-hiding scheduler, async collectives on the highest-priority stream, and
      while-loop double buffering (a scanned layer's collectives overlap the previous
      layer's compute);
    - collective pipelining of all-gathers, reduce-scatters and all-reduces out of loops;
      jaxlib 0.10 names these ``xla_gpu_enable_pipelined_<op>=True``, and jaxlib 0.11 and
      later refuse those names, taking ``xla_gpu_pipeline_<op>="COLLECTIVE_PIPELINING_MODE_ON"``;
    - collectives combined across dimensions, up to ``combine_threshold_bytes`` where
      given (None: XLA's own thresholds; see ``COMBINE_THRESHOLD_BYTES``).

    Triton GEMMs stay on (XLA's autotuner picks Triton or cuBLAS per matmul): the
    recipes' ``xla_gpu_enable_triton_gemm=False`` made the 1.2B GPT's step 2.7% slower
    on one H200 (130.3 ms against 126.8 ms, medians of 8 steps, JAX 0.11.2;
    ``benchmarks/gpu/results/2026-11-27-h200-1``).

    Every name is checked against jaxlib 0.10.2, 0.11.2 and 0.12 (``tests/train/
    test_compiler_options.py`` compiles with the set on the installed one).

    >>> options = sx.train.gpu_options(jaxlib_version=(0, 10))
    >>> options["xla_gpu_enable_pipelined_all_gather"], len(options)
    (True, 8)
    >>> sx.train.gpu_options(jaxlib_version=(0, 12))["xla_gpu_pipeline_all_gather"]
    'COLLECTIVE_PIPELINING_MODE_ON'
    """
    version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
    options: dict[str, Value] = {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_enable_all_gather_combine_by_dim": False,
        "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    }
    if combine_threshold_bytes is not None:
        threshold = int(combine_threshold_bytes)
        for op in _PIPELINED:
            options[f"xla_gpu_{op}_combine_threshold_bytes"] = threshold
    for op in _PIPELINED:
        if version >= (0, 11):  # the enum generation; the booleans are "No such option"
            options[f"xla_gpu_pipeline_{op}"] = "COLLECTIVE_PIPELINING_MODE_ON"
        else:  # jaxlib 0.10 has the booleans only
            options[f"xla_gpu_enable_pipelined_{op}"] = True
    return options


@public("sx.train.combine_thresholds")
def combine_thresholds(
    weight_bytes: float, shards: int, parts: int = COMBINE_PARTS
) -> dict[str, int]:
    """XLA:GPU's collective combine thresholds for a step whose floating params take
    ``weight_bytes`` in the compute dtype, split over ``shards`` devices: an all-gather
    or all-reduce of about ``1/parts`` of the weights, a reduce-scatter of ``1/parts`` of
    a device's share, each between 1 MiB and 1 GiB (see ``COMBINE_PARTS``).

    >>> t = sx.train.combine_thresholds(2.4e9, 8)  # a 1.2B model's bf16 weights, 8 GPUs
    >>> tuple(t[f"xla_gpu_{op}_combine_threshold_bytes"] for op in ("all_gather", "reduce_scatter"))
    (150000000, 18750000)
    """
    shards = max(int(shards), 1)

    def clamp(x: float) -> int:
        return int(min(max(x, _MIB), _GIB))

    whole, share = clamp(weight_bytes / parts), clamp(weight_bytes / shards / parts)
    return {
        "xla_gpu_all_gather_combine_threshold_bytes": whole,
        "xla_gpu_all_reduce_combine_threshold_bytes": whole,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": share,
    }


def for_state(
    options: Mapping[str, Value],
    value: Any,
    platform: str,
    state: Any,
    compute_dtype: Any,
    shards: int,
) -> dict[str, Value]:
    """``options`` (a step's, resolved from ``value``) with, under ``"auto"`` on a GPU
    mesh of several devices, the [`combine_thresholds`][shardax.train.combine_thresholds]
    of ``state``'s floating params in ``compute_dtype``; otherwise ``options`` as they
    are."""
    options = dict(options)
    if value != AUTO or platform != "gpu" or shards <= 1:
        return options

    params = getattr(state, "params", state)
    itemsize = np.dtype(compute_dtype).itemsize
    weights = sum(
        int(np.prod(leaf.shape)) * itemsize
        for leaf in jax.tree.leaves(params)
        if hasattr(leaf, "shape") and jnp.issubdtype(getattr(leaf, "dtype", np.int32), jnp.floating)
    )
    return {**options, **combine_thresholds(weights, shards)}


def platform_of(where: Any) -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) of a mesh, a device or a name."""
    if isinstance(where, Mesh):
        where = where.devices.flat[0]
    platform = where if isinstance(where, str) else getattr(where, "platform", None)
    known = ("cpu", "gpu", "tpu", "cuda", "rocm")
    if not isinstance(platform, str) or (isinstance(where, str) and where.lower() not in known):
        raise ValueError(
            f"compiler options are for a platform: pass a mesh, a device or a platform name "
            f"('gpu', 'cpu', 'tpu'), got {received(where)}"
        )
    platform = platform.lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def auto_options(platform: str) -> dict[str, Value]:
    """What ``"auto"`` sets on ``platform``: [`gpu_options`][shardax.train.gpu_options] on
    GPUs, nothing elsewhere (on CPUs and TPUs XLA's defaults are shardax's for now)."""
    return gpu_options() if platform == "gpu" else {}


DEVICELESS_GPU: dict[str, Value] = {"xla_gpu_experimental_enable_fusion_autotuner": False}
"""What ``"auto"`` adds on compile-only GPUs (``sx.target``'s): XLA:GPU's fusion autotuner
compiles every fusion on its own to time its configurations on the GPU, and a deviceless
compile has no GPU to time them on, so it keeps XLA's default configurations after those
compiles. Without it the optimized program is the same but for the autotuner's empty
records (``tests/compile/test_compiler_options_target.py``; every figure of the default
GPT's ``shardax plan --target 8xH100`` estimate equal) and the compile takes half the time
(that GPT's step: 33.4 s -> 15.5 s under load, 125 -> 15 LLVM modules built)."""


def compile_only(where: Any) -> str | None:
    """The device kind of ``where`` (a mesh or a device) when it is compile-only
    (``sx.target``'s, which hold no arrays and run nothing), else None.

    >>> compile_only(mesh), compile_only("gpu")
    (None, None)
    """
    device = where.devices.flat[0] if isinstance(where, Mesh) else where
    runtime = getattr(getattr(device, "client", None), "runtime_type", "")
    return str(device.device_kind) if runtime == "compile_only_runtime" else None


AT_START = {
    "xla_force_host_platform_device_count": "the number of CPU devices is fixed when the "
    "CPU backend starts; set it before: jax.config.update('jax_num_cpu_devices', n), or "
    "XLA_FLAGS=--xla_force_host_platform_device_count=n",
}
"""XLA options ``compiler_options`` refuses: ``DebugOptions`` fields that XLA accepts per
compile but reads only when a backend starts (from ``XLA_FLAGS``), with what to do."""


def check(value: Any, name: str = "compiler_options") -> str | dict[str, Value]:
    """``value`` checked: ``"auto"``, ``"xla"``, or a mapping from names starting with
    ``"xla_"`` to bool, int, float or str values (returned as a new dict).

    >>> check({"xla_gpu_enable_triton_gemm": False})
    {'xla_gpu_enable_triton_gemm': False}
    >>> check({"gpu_enable_triton_gemm": False})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: compiler_options names XLA options, which start with 'xla_' ...; got key ...
    """
    if isinstance(value, str):
        if value in (AUTO, XLA):
            return value
        raise ValueError(
            f"{name} must be 'auto' (shardax's options for the mesh's platform), 'xla' "
            f"(XLA's defaults) or a dict of XLA options, got {value!r}"
        )
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be 'auto', 'xla' or a dict of XLA options {{name: value}}, got "
            f"{received(value)}"
        )
    out: dict[str, Value] = {}
    for key, option in value.items():
        if not isinstance(key, str) or not key.startswith("xla_"):
            raise ValueError(
                f"{name} names XLA options, which start with 'xla_' (e.g. "
                f"'xla_gpu_enable_triton_gemm'); got key {received(key)}"
            )
        if key in AT_START:
            raise ValueError(
                f"{name}[{key!r}] is read once, when the process starts JAX's backend, not "
                f"when a step compiles, so it would have no effect here: {AT_START[key]}"
            )
        if not isinstance(option, bool | int | float | str):
            raise TypeError(
                f"{name}[{key!r}] must be a bool, int, float or str (XLA takes scalars), got "
                f"{received(option)}"
            )
        if key.endswith("_bytes"):  # a size: XLA takes a negative one without a word
            option = as_count(f"{name}[{key!r}] (a size in bytes)", option, minimum=0)
        out[key] = option
    return out


def resolve(
    value: Any, platform: str, mode: str = "jit", deviceless: bool = False
) -> dict[str, Value]:
    """The options a step in ``mode`` on ``platform`` compiles with, for the setting
    ``value`` (checked: see ``check``); ``"auto"`` on ``deviceless`` (compile-only) GPUs
    adds ``DEVICELESS_GPU``. Under ``"pmap"`` none: ``jax.pmap`` takes no
    compiler options, so ``"auto"`` gives ``{}`` and a mapping is refused.

    >>> resolve("xla", "gpu"), resolve({"xla_dump_to": "/tmp/x"}, "cpu")
    ({}, {'xla_dump_to': '/tmp/x'})
    >>> resolve("auto", "gpu", mode="pmap")
    {}
    """
    value = check(value)
    if value == XLA:
        return {}
    if mode == "pmap":
        if isinstance(value, dict) and value:
            raise ValueError(
                f"mode='pmap' compiles with jax.pmap, which takes no compiler options; got "
                f"compiler_options={value!r}. Use mode='jit' or 'shard_map' (the same "
                "program, per-device code under shard_map), or set them in XLA_FLAGS"
            )
        return {}
    if value != AUTO:
        return dict(value)
    extra = DEVICELESS_GPU if deviceless and platform == "gpu" else {}
    return {**auto_options(platform), **extra}


def describe(value: Any, resolved: Mapping[str, Value], platform: str, mode: str) -> str:
    """A short account of a step's options, for its repr and the run summaries:
    ``'auto' (gpu: 12 options)``, ``'auto' (cpu: none)``, ``'xla'``, or the dict."""
    if value == XLA:
        return repr(XLA)
    if value == AUTO:
        if mode == "pmap":
            return "'auto' (pmap: none, jax.pmap takes no compiler options)"
        count = f"{len(resolved)} options" if resolved else "none"
        return f"'auto' ({platform}: {count})"
    return repr(dict(resolved))


@public("sx.train.compiler_options")
def compiler_options(where: Any, value: Any = AUTO) -> dict[str, Value]:
    """The XLA options a step on ``where`` (a mesh, a device, or ``"gpu"``, ``"cpu"``,
    ``"tpu"``) compiles with for the setting ``value`` (``"auto"``, ``"xla"`` or a dict),
    for a ``jax.jit`` of your own, so that it compiles as shardax's steps do.

    >>> fn = jax.jit(lambda x: x * 2, compiler_options=sx.train.compiler_options(mesh))
    >>> int(fn(jnp.ones(()))), sx.train.compiler_options(jax.devices()[0])
    (2, {})
    >>> sx.train.compiler_options("gpu") == sx.train.gpu_options()
    True
    """
    return resolve(value, platform_of(where), deviceless=compile_only(where) is not None)


@public("sx.train.set_gpu_environment")
def set_gpu_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets ``ENVIRONMENT``'s variables in ``environ`` (default ``os.environ``) where
    they are not set, and returns those it set. For ``os.environ`` call it before JAX
    starts a GPU backend: CUDA reads the variables then (``shardax train`` does, and skips
    it when a GPU backend is up).

    >>> env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    >>> set_gpu_environment(env), env
    ({}, {'CUDA_DEVICE_MAX_CONNECTIONS': '8'})
    >>> set_gpu_environment({})
    {'CUDA_DEVICE_MAX_CONNECTIONS': '1'}
    """
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in ENVIRONMENT.items() if k not in environ}
    environ.update(added)
    return added
