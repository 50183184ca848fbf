"""Memory per device of Adam training under DP, FSDP, TP, PP and their hybrids.

Model states only: parameters, gradients, an fp32 master copy where the precision keeps
one, and Adam's two moments. Activations, which grow with the batch and depend on the
architecture, are not counted: the headroom left is what activations may use.

Bytes per parameter (Adam; ``m`` and ``v`` are the two moments), by the precision names
of ``make_train_step(precision=...)`` and ``shardax train --precision``:

============  ========  =====  ============  ===========  =====  ===============
precision     params    grads  fp32 master   Adam m + v   total  matmuls read
============  ========  =====  ============  ===========  =====  ===============
``fp32``      4         4      0             4 + 4        16     4
``bf16``      4         4      0             4 + 4        16     2 (bf16 copy)
``fp16``      4         4      0             4 + 4        16     2 (fp16 copy)
``fp8``       4         4      0             4 + 4        16     2 (bf16 copy; 1 in fp8)
============  ========  =====  ============  ===========  =====  ===============

shardax's policies keep the params and Adam's moments in the state in float32 and cast
the params to the compute dtype inside the step, so bf16 and fp16 halve the bytes the
matmuls read (the roofline's figure) and the activations, not the model states. A
custom [`shardax.Precision`][shardax.Precision] with ``param_dtype=jnp.bfloat16`` keeps everything
in
bf16: 2 + 2 + 0 + 2 + 2 = 8 bytes per parameter (``state_bytes`` takes it too).

On ``data × model`` devices, with ``S`` the bytes per parameter above and ``P`` parameters:

- DP (``data = N``): every device holds everything, ``S·P``.
- FSDP (``data = N``): every state is split over the data axis, ``S·P / N``.
- TP (``model = N``): every weight is split over the model axis, ``S·P / N``.
- PP (``stage = N``, ``sx.pipeline``): each stage holds its layers, ``S·P / N``.
- DP × TP: ``S·P / model``; FSDP × TP: ``S·P / (data·model)``; likewise DP × PP and
  FSDP × PP with ``stage`` in place of ``model``.
- ZeRO-1 (``data = N``): the master copy (if any) and Adam's moments split, params and grads whole;
  ZeRO-2 also splits the grads (``estimate`` with ``zero=1`` or ``2``). With
  ``gather="forward"`` (``sx.zero1(mesh, gather="forward")``: the params kept split, their
  compute-dtype copy gathered in the step) the params are split too: ``(params + master +
  optimizer)·P / N + grads·P`` (ZeRO-1), ``S·P / N`` (ZeRO-2); the gathered copy
  (``compute·P``) is one of the step's temporaries, as activations are.

These are ideal splits (every weight divisible, nothing replicated: for PP, the layers
hold all the parameters); FSDP also needs room for one gathered layer at a time, and PP
for its microbatches' activations, which are not counted.

>>> [e.strategy for e in plan_memory(7e9, 4)]
['DP', 'ZeRO-1', 'ZeRO-2', 'FSDP', 'TP', 'PP', 'DP×TP', 'FSDP×TP', 'DP×PP', 'FSDP×PP']
>>> plan_memory(7e9, 4, "bf16")[0].total_bytes / 1e9
112.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from shardax.checks import as_bool, as_count, as_float


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state under one precision policy, for Adam.

    Attributes:
        name: the policy's name (``"fp32"``, ``"bf16"``, ``"fp16"``) or ``"custom"``.
        params, grads, master, optimizer: bytes per parameter of each state.
        compute: bytes per parameter the matmuls read (the compute dtype's size).
    """

    name: str
    params: float
    grads: float
    master: float
    optimizer: float
    compute: float

    @property
    def total(self) -> float:
        """Bytes per parameter of all model states."""
        return self.params + self.grads + self.master + self.optimizer


def _itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def _of_policy(name: str, param_dtype: Any, compute_dtype: Any) -> StateBytes:
    """Adam under a policy: grads and both moments in the params' dtype, no master copy."""
    p = _itemsize(param_dtype)
    return StateBytes(
        name, params=p, grads=p, master=0, optimizer=2 * p, compute=_itemsize(compute_dtype)
    )


STATE_BYTES: dict[str, StateBytes] = {
    "fp32": _of_policy("fp32", np.float32, np.float32),
    "bf16": _of_policy("bf16", np.float32, jnp.bfloat16),
    "fp16": _of_policy("fp16", np.float32, np.float16),
    "fp8": _of_policy("fp8", np.float32, jnp.bfloat16),  # bf16's: fp8 copies are transient
}
"""The train policies' bytes (``shardax.train.precision.PRECISIONS``, by the same names)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one strategy on a ``data × model`` mesh.

    Attributes:
        strategy: ``"DP"``, ``"FSDP"``, ``"TP"``, ``"PP"`` or a hybrid (``"FSDP×TP"``).
        data: devices on the data axis (replicas, or FSDP shards).
        model: devices on the model (tensor-parallel) axis.
        stage: devices on the stage (pipeline-parallel) axis.
        params_bytes, grads_bytes, master_bytes, optimizer_bytes: per device.
        total_bytes: their sum.
    """

    strategy: str
    data: int
    model: int
    params_bytes: float
    grads_bytes: float
    master_bytes: float
    optimizer_bytes: float
    stage: int = 1

    @property
    def total_bytes(self) -> float:
        """All model states on one device."""
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes


def state_bytes(precision: Any) -> StateBytes:
    """The bytes per parameter of ``precision``: a train policy's name (``"fp32"``,
    ``"bf16"``, ``"fp16"``), a [`shardax.Precision`][shardax.Precision] (its ``param_dtype`` and
    ``compute_dtype``), or a ``StateBytes``.

    >>> state_bytes("bf16").total, state_bytes("bf16").compute
    (16, 2)
    """
    if isinstance(precision, StateBytes):
        return precision
    if isinstance(precision, str):
        if precision not in STATE_BYTES:
            raise ValueError(
                f"precision must be one of {list(STATE_BYTES)} or an sx.Precision, got "
                f"{precision!r}"
            )
        return STATE_BYTES[precision]
    if hasattr(precision, "param_dtype") and hasattr(precision, "compute_dtype"):
        return _of_policy("custom", precision.param_dtype, precision.compute_dtype)
    raise TypeError(
        f"precision must be one of {list(STATE_BYTES)} or an sx.Precision, got "
        f"{type(precision).__name__} {precision!r}"
    )


def estimate(
    num_params: float,
    precision: Any = "bf16",
    *,
    data: int = 1,
    model: int = 1,
    shard_data: bool = False,
    stage: int = 1,
    zero: int = 0,
    gather: str = "update",
) -> MemoryEstimate:
    """Per-device model-state bytes on a ``data × model × stage`` mesh.

    Every state is split over ``model`` (tensor parallelism) and ``stage`` (pipeline
    parallelism), and also over ``data`` when ``shard_data`` (FSDP); otherwise it is
    replicated over ``data``. ``zero`` (ZeRO stage) splits over ``data`` only the
    optimizer state and master copy (1), those and the grads (2), or everything (3, the
    same as ``shard_data``).

    >>> estimate(1e9, "fp32", data=8, shard_data=True).total_bytes / 1e9
    2.0
    >>> estimate(1e9, "fp32", data=8, zero=1).total_bytes / 1e9  # 4 + 4 + 8 / 8
    9.0

    ``gather="forward"`` (ZeRO-1 and 2 only) splits the params over ``data`` as well:

    >>> estimate(1e9, "bf16", data=8, zero=1, gather="forward").total_bytes / 1e9  # 4 + 12 / 8
    5.5
    """
    num_params = as_float("num_params", num_params, above=0)
    data, model, stage = (
        as_count(n, v) for n, v in (("data", data), ("model", model), ("stage", stage))
    )
    zero = as_count("zero (a ZeRO stage)", zero, minimum=0, maximum=3)
    shard_data = as_bool("shard_data", shard_data)
    p = state_bytes(precision)
    zero = 3 if shard_data else zero
    if gather not in ("update", "forward"):
        raise ValueError(f"gather must be 'update' or 'forward', got {gather!r}")
    if gather == "forward" and zero not in (1, 2):
        raise ValueError(
            f"gather='forward' is a ZeRO-1/2 setting (sx.zero1(mesh, gather=...)), got zero={zero}"
        )
    forward = gather == "forward"

    def split(level: int) -> int:
        return model * stage * (data if zero >= level else 1)

    kinds = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}
    kind = kinds[zero] + " (gather forward)" * forward if data > 1 or model == stage == 1 else ""
    name = "×".join(s for s in (kind, "TP" * (model > 1), "PP" * (stage > 1)) if s)
    return MemoryEstimate(
        strategy=name,
        data=data,
        model=model,
        params_bytes=num_params * p.params / split(1 if forward else 3),
        grads_bytes=num_params * p.grads / split(2),
        master_bytes=num_params * p.master / split(1),
        optimizer_bytes=num_params * p.optimizer / split(1),
        stage=stage,
    )


def plan_memory(
    num_params: float, num_devices: int, precision: Any = "bf16"
) -> list[MemoryEstimate]:
    """DP, ZeRO-1, ZeRO-2, FSDP, TP and PP over all ``num_devices``, then DP×TP and
    FSDP×TP, DP×PP and FSDP×PP for every split.

    Hybrids use each ``model`` (or ``stage``) size that divides ``num_devices`` strictly
    between 1 and ``num_devices``, with ``data = num_devices / model``.
    """
    n = num_devices = as_count("num_devices", num_devices)
    out = [estimate(num_params, precision, data=n)]
    if n > 1:
        out += [estimate(num_params, precision, data=n, zero=z) for z in (1, 2)]
        out.append(estimate(num_params, precision, data=n, shard_data=True))
        out.append(estimate(num_params, precision, model=n))
        out.append(estimate(num_params, precision, stage=n))
    splits = [m for m in range(2, n) if n % m == 0]
    for axis in ("model", "stage"):
        for size in splits:
            for fsdp in (False, True):
                out.append(
                    estimate(num_params, precision, data=n // size, shard_data=fsdp, **{axis: size})
                )
    return out
