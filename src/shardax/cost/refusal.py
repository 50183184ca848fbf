"""What ``sx.estimate`` refuses, and the report of a step the compiler refused: a batch of
no rows, integer params of a train step, a backend's out-of-memory compile error (the
step does not fit), while loops of unknown trip count (a note: the figures are a lower
bound).
"""

from __future__ import annotations

import re
from typing import Any

import jax

from shardax._format import format_bytes
from shardax.cost.accounting import budget_fields, default_tokens, state_bytes
from shardax.cost.figures import device_figures
from shardax.cost.model_flops import batch_unit
from shardax.cost.report import Estimate

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM = (  # libtpu's CompileTimeHbmOom, two wordings: (required, available)
    re.compile(r"\(([\d.]+)\s*([KMGT]?)i?B?\) exceeds available HBM \(([\d.]+)\s*([KMGT]?)"),
    re.compile(r"Used ([\d.]+)\s*([KMGT]?)i?B? of ([\d.]+)\s*([KMGT]?)i?B? hbm"),
)


def out_of_memory(error: BaseException) -> tuple[float, float] | None:
    """``(bytes required, bytes available)`` from a backend's out-of-memory compile error
    (``RESOURCE_EXHAUSTED``, libtpu's ``CompileTimeHbmOom``), else None.

    >>> out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out "
    ...     "of memory on HBM, the total memory required for HLO temporaries (24.00G) "
    ...     "exceeds available HBM (15.75G)."))
    (25769803776.0, 16911433728.0)
    """
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return None
    for pattern in _OOM:
        m = pattern.search(text)
        if m:
            need, nu, have, hu = m.groups()
            return float(need) * _UNITS[nu], float(have) * _UNITS[hu]
    return None


def refused_estimate(
    step: Any,
    state: Any,
    batch: Any,
    mesh: Any,
    error: BaseException,
    compile_s: float,
    tokens: float | None,
) -> Estimate:
    """The [`Estimate`][shardax.cost.Estimate] of a step the compiler refused for lack of memory."""
    need, have = out_of_memory(error) or (0.0, 0.0)
    devices = list(mesh.devices.flat)
    spec = device_figures(devices[0])
    plan = getattr(step, "state_plan", None)
    shardings = plan(state) if plan is not None else None
    memory, _ = state_bytes(state, shardings)
    state_total = sum(memory.values())
    memory["temporaries"] = int(need)
    memory["peak"] = state_total + int(need)
    message = str(error).strip().splitlines()[0]
    return Estimate(
        device_kind=str(devices[0].device_kind),
        devices=len(devices),
        mesh={str(k): int(v) for k, v in mesh.shape.items()},
        memory=memory,
        hbm_bytes=float(spec.memory_bytes) if spec is not None else (have or None),
        **budget_fields(devices[0]),
        flops_hlo=0.0,
        flops_backend=None,
        model_flops=0.0,
        model_flops_note="not compiled",
        tokens=default_tokens(batch) if tokens is None else float(tokens),
        unit="tokens" if tokens is not None else batch_unit(batch),
        collectives=(),
        compile_s=compile_s,
        roofline=None,
        notes=(
            f"the backend refused to compile: temporaries {format_bytes(need)} > the "
            f"{format_bytes(have)} of HBM it leaves for them; peak = state + those "
            "temporaries (a lower bound)",
            "shrink the batch per device, remat more, or shard over more devices",
        ),
        compile_error=message,
    )


def unknown_trips(hlo: str) -> int:
    """How many ``while`` instructions of ``hlo`` XLA could not give a trip count
    (``known_trip_count`` in their backend config)."""
    return sum(
        1 for line in hlo.splitlines() if " while(" in line and "known_trip_count" not in line
    )


def check_priceable(state: Any, batch: Any, train_step: bool) -> None:
    """A batch of no rows (nothing to price) and, for a ``make_train_step`` step, an
    integer leaf among the state's params (the step differentiates them, which JAX
    refuses without naming the leaf) raise, naming the leaf."""
    rows = [
        (path, tuple(leaf.shape))
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]
        if len(getattr(leaf, "shape", ()))
    ]
    if rows and all(shape[0] == 0 for _, shape in rows):
        path, shape = rows[0]
        raise ValueError(
            f"batch{jax.tree_util.keystr(path)} has 0 rows (shape {shape}): a step of an "
            "empty batch prices nothing; give the batch the step will run on"
        )
    params = getattr(state, "params", None) if train_step else None
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
            raise TypeError(
                f"state.params{jax.tree_util.keystr(path)} is {dtype}, but the step "
                "differentiates the params, which must be floating point; keep counters "
                "and integer tables out of the params (in a non-trainable variable, or a "
                "static field)"
            )
