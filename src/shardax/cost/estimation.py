"""``sx.estimate``: compile a step for abstract values and predict what it costs per device.

The step is lowered and compiled for its mesh, which may be a mesh of compile-only target
devices (``sx.target("8xH100")``): nothing is allocated, so a 70B model is planned on a
laptop. The report, per device:

- memory: params, optimizer state, other state and the batch (from the state's
  shardings), gradients (the params' dtype, sharded like the params or, under ZeRO-2,
  like the optimizer state; they live in the temporaries), the other temporaries and the
  compiler's peak (``memory_analysis()``), against the memory JAX's programs may use on
  the device (a GPU's allocator share, else HBM), with the headroom;
- FLOPs: matmul FLOPs counted from the compiled HLO (``cost_analysis()`` is None when
  compiling for a GPU target; custom calls it cannot price are named), beside the model
  FLOPs given (``model_flops=``, e.g. the GPT's ``6·N + attention``, causal halved) or by
  default (``shardax.cost.model_flops``: ``6·N·tokens`` with ``N`` without the
  embedding lookup; for images, the compiled count, labelled so), by the convention
  every report states;
- collectives: the bytes each sends per step, and over which link (within a host or
  between hosts, from the replica groups against the devices' ``process_index`` and
  ``slice_index``);
- compile time;
- a **predicted** step time from ``shardax.cost.predict``'s named model, with and
  without overlap, and from it predicted tokens (images, rows: what the batch holds) per
  second per device and predicted MFU, which counts at most the FLOPs the step executes;
- the exposed collective time: what the compiled schedule leaves of the collectives' time
  once the matmuls XLA scheduled between each one's start and done are taken off
  (``shardax.cost.schedule``);
- on a GPU target, the per-op model's prediction (``shardax.cost.opcost``): each
  kernel of the compiled program priced by the device kind's calibration tables
  (``shardax.cost.calibration``), by class, with the step's interval.

Works for a ``make_train_step`` step (the plan places the abstract state) and for any
``jax.jit`` function ``step(state, batch)`` whose abstract state carries its shardings
(``sx.prepare`` on ``ShapeDtypeStruct``s, or the jit's ``in_shardings``).

>>> step = jax.jit(lambda w, x: jnp.sum((x @ w) ** 2))
>>> w = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
>>> x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
>>> report = sx.estimate(step, w, x, links={"intra-host": 1e11})
>>> report.memory["params"], report.flops_hlo  # doctest: +ELLIPSIS
(2048, 2048.0)
>>> report.predicted_s is None  # a CPU has no datasheet: figures, no predicted time
True
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from shardax.checks import as_float, public, refused_compiler_option
from shardax.cost.accounting import (
    abstract_tree,
    budget_fields,
    check_axes,
    compiled_memory,
    default_tokens,
    grad_bytes,
    mesh_of,
    param_shapes,
    state_bytes,
)
from shardax.cost.calibration import calibration_for, nearest
from shardax.cost.figures import MEASURED, device_figures
from shardax.cost.flops import compiled_flops, format_unpriced, hlo_flops, unpriced_calls
from shardax.cost.hardware import HardwareSpec, is_gpu
from shardax.cost.links import (
    collective_rows,
    group_link,
    group_members_of,
    level_price,
    levels_of,
    link_bandwidths,
    overlap_of,
    wire_bytes,
)
from shardax.cost.model_flops import CONVENTION, batch_unit, default_model_flops
from shardax.cost.nccl import LevelPrice
from shardax.cost.opcost import price_hlo
from shardax.cost.predict import DEFAULT_COMPUTE_EFFICIENCY, check_figures, predict_step
from shardax.cost.refusal import check_priceable, out_of_memory, refused_estimate, unknown_trips
from shardax.cost.report import Estimate
from shardax.cost.schedule import schedule
from shardax.cost.step_cost import StepCost


def analyse(
    compiled: Any,
    mesh: Any,
    *,
    state: Any = None,
    shardings: Any = None,
    batch: Any = None,
    tokens: float | None = None,
    model_flops: float | None = None,
    model_flops_note: str | None = None,
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
    links: Mapping[str, float] | None = None,
    grads_bytes: int | None = None,
    spec: HardwareSpec | None = None,
    compile_s: float = 0.0,
) -> Estimate:
    """The [`Estimate`][shardax.cost.Estimate] of an already compiled step (``sx.estimate``
    and the auto plan's search call this once per compiled program): the memory, the
    work read from the HLO, then, where the device has figures, its price."""
    devices = list(mesh.devices.flat)
    spec = device_figures(devices[0]) if spec is None else spec
    measured = spec is not None and spec.source.startswith(MEASURED)
    notes = [_measured(devices[0].device_kind, spec)] if measured else []
    memory, compiled_bytes, training = compiled_memory(compiled, state, shardings, grads_bytes)
    hlo = compiled.as_text()
    flops, backend, unpriced = hlo_flops(hlo), compiled_flops(compiled), unpriced_calls(hlo)
    notes += [format_unpriced(unpriced)] if unpriced else []
    notes += _unknown_trips_note(unknown_trips(hlo))
    unit = "tokens" if tokens is not None else batch_unit(batch)
    tokens = default_tokens(batch) if tokens is None else float(tokens)
    if model_flops is None:
        executed = (flops or backend or 0.0) * len(devices)
        params = param_shapes(state) if state is not None else []
        model_flops, model_flops_note, statement = default_model_flops(
            params, batch, tokens, unit, executed
        )
        notes.append(f"{statement}. Convention: {CONVENTION}")
    else:
        given = model_flops_note or "no formula named"
        notes.append(f"model FLOPs: given ({given}). Convention: {CONVENTION}")
    timed = schedule(hlo, len(devices))
    members = group_members_of(devices)
    links_of = [group_link(members(s.collective.groups)) for s in timed]
    priced: dict[str, Any] = {"roofline": None, "overlap": None, "per_op": None}
    network = None
    if spec is None:
        notes.append(_no_datasheet(devices[0]))
    else:
        work = _Work(compiled, hlo, flops, backend, unpriced, model_flops, tokens, compiled_bytes)
        wiring = (timed, links_of, members, links)
        priced, network = _price(work, devices, spec, wiring, compute_efficiency, notes)
    if training:
        notes.append("gradients: the params' bytes and sharding, part of the temporaries")
    return Estimate(
        device_kind=str(devices[0].device_kind),
        devices=len(devices),
        mesh={str(k): int(v) for k, v in mesh.shape.items()},
        memory=memory,
        hbm_bytes=None if spec is None else float(spec.memory_bytes),
        **budget_fields(devices[0]),
        flops_hlo=flops,
        flops_backend=backend,
        model_flops=float(model_flops),
        model_flops_note=model_flops_note or "given",
        tokens=tokens,
        unit=unit,
        unpriced_calls=unpriced,
        collectives=collective_rows(timed, links_of),
        compile_s=compile_s,
        notes=tuple(notes),
        compiled_bytes=compiled_bytes,
        network=None if network is None else {k: v for k, v in network.items() if k != "line"},
        **priced,
    )


def _measured(kind: str, spec: HardwareSpec) -> str:
    """The note of a device whose figures are its calibration's (no datasheet row)."""
    return (
        f"no datasheet for device kind {kind!r}: its figures are its "
        f"calibration's ({spec.source.removeprefix(MEASURED)}): peak {spec.peak_flops:.3g} "
        f"FLOP/s (the best GEMM rate measured; MFU counts against it, and the roofline's "
        f"compute_efficiency discounts it again), memory bandwidth "
        f"{spec.hbm_bandwidth:.3g} B/s (the fastest stream), memory "
        f"{spec.memory_bytes / 2**30:.1f} GiB (the allocator's budget), and a link within "
        "a host only where it measured collectives"
    )


def _unknown_trips_note(unbounded: int) -> list[str]:
    if not unbounded:
        return []
    return [
        f"{unbounded} while loop(s) of the step run a number of trips decided at run time "
        "(a jax.lax.while_loop on data, not a fori_loop or scan): each is priced as one "
        "trip of its body, so the step's FLOPs, bytes and time are a lower bound"
    ]


def _no_datasheet(device: Any) -> str:
    why = f"no datasheet for device kind {device.device_kind!r}: no predicted time"
    if is_gpu(device):
        why += (
            " ('shardax calibrate' measures this GPU's tables, and "
            "sx.cost.calibration.register(sx.cost.calibration.load(FILE)) prices with them)"
        )
    return why


class _Work(NamedTuple):
    """What the compiled step does, as ``analyse`` read it, for its price."""

    compiled: Any
    hlo: str
    flops: float  # matmul FLOPs per device (HLO)
    backend: float | None  # cost_analysis() FLOPs
    unpriced: dict[str, int]
    model_flops: float  # per step, all devices
    tokens: float
    compiled_bytes: dict[str, int]


def _price(
    work: _Work,
    devices: list[Any],
    spec: HardwareSpec,
    wiring: tuple[list[Any], list[str], Any, Mapping[str, float] | None],
    compute_efficiency: float,
    notes: list[str],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The step priced on ``spec``: the roofline, the overlap and the per-op model
    (``Estimate``'s fields of those names), and the network; notes appended. ``wiring``:
    the scheduled collectives, the link of each, their groups' members and ``links=``."""
    timed, links_of, members, links = wiring
    b = work.compiled_bytes
    cost = work.compiled.cost_analysis() if work.backend is not None else None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    accessed = (cost or {}).get("bytes accessed")
    written = b["arguments"] + b["outputs"] + 2 * b["temporaries"]
    hbm_traffic = float(accessed) if accessed else float(written)
    bandwidths = link_bandwidths(spec, links, str(devices[0].platform).lower())
    levels, network = levels_of(devices, spec, bandwidths, links)
    if network is not None:
        bandwidths["inter-host"] = levels["inter-host"].bandwidth
        notes.append(f"network: {network['line']}; {network['why']}")
    priced = [
        level_price(s, link, levels, members(s.collective.groups))
        for s, link in zip(timed, links_of, strict=True)
    ]
    wires = [
        wire_bytes(s, link, devices, bandwidths, members(s.collective.groups))
        if p is None
        else {k: v * s.collective.count for k, v in p.bytes.items()}
        for s, link, p in zip(timed, links_of, priced, strict=True)
    ]
    sent: dict[str, float] = {}  # bytes per link (a group across GPU hosts: split)
    for wire in wires:
        for link, nbytes in wire.items():
            sent[link] = sent.get(link, 0.0) + nbytes
    compute, mfu_flops = _compute(work, len(devices), notes)
    roofline = predict_step(
        flops=compute,
        hbm_bytes=hbm_traffic,
        link_bytes=sent,
        peak_flops=spec.peak_flops,
        hbm_bandwidth=spec.hbm_bandwidth,
        link_bandwidth=bandwidths,
        compute_efficiency=compute_efficiency,
        tokens=work.tokens,
        model_flops=mfu_flops,
        devices=len(devices),
    )
    rate = compute_efficiency * spec.peak_flops
    overlap = overlap_of(timed, wires, bandwidths, rate, priced)
    per_op = per_op_price(work.hlo, devices, spec, bandwidths, timed, wires, priced)
    missing = [k for k, v in roofline.link_s.items() if v is None]
    if missing:
        notes.append(
            f"no bandwidth for link(s) {', '.join(missing)} in the datasheet (or "
            "calibration): their collectives are not in the predicted time; pass "
            "links={...} (bytes/s)"
        )
    if not accessed:
        notes.append("HBM traffic: arguments + outputs + 2 × temporaries (no backend figure)")
    return {"roofline": roofline, "overlap": overlap, "per_op": per_op}, network


def _compute(work: _Work, devices: int, notes: list[str]) -> tuple[float, float]:
    """The FLOPs per device the roofline computes, and the model FLOPs MFU counts."""
    compute, model_flops = work.flops, work.model_flops
    if not compute and work.backend:  # e.g. TPU: its matmuls are not plain dots in the HLO
        compute = float(work.backend)
        notes.append("compute: the backend's cost_analysis() FLOPs (no matmul found in the HLO)")
    floor = model_flops / devices if model_flops else 0.0
    # Below half the model's FLOPs, the HLO count misses work (a Pallas kernel's, as
    # TPU splash attention's, is not in the HLO); closer, it is the program's own
    # count (6N overstates a step that needs no gradient of its input).
    if compute < 0.5 * floor:
        notes.append(
            f"compute: the model's FLOPs per device ({floor:.3g}), over twice the HLO's "
            f"count ({compute:.3g}), which misses a kernel's work (a Pallas kernel's, as "
            "splash attention's, is not in the HLO)"
        )
        compute = floor
    # MFU counts at most the FLOPs the step executes (a model FLOP it does not run is
    # not utilisation), where the HLO's count is whole (no unpriced kernel).
    if not work.unpriced and model_flops > compute * devices > 0:
        notes.append(
            f"MFU: the model's FLOPs per device ({floor:.3g}) exceed the compiled step's "
            f"({compute:.3g}); MFU counts the executed ones"
        )
        model_flops = compute * devices
    return compute, model_flops


def per_op_price(
    hlo: str,
    devices: list[Any],
    spec: HardwareSpec,
    bandwidths: Mapping[str, float | None],
    timed: list[Any],
    wires: list[Mapping[str, float]],
    priced: list[LevelPrice | None] | None = None,
) -> StepCost | None:
    """The per-op model's price of ``hlo`` (``shardax.cost.opcost``) on a GPU, each of
    the scheduled collectives ``timed`` moving ``wires`` (bytes per link): with
    the device kind's calibration, else the nearest calibrated kind's, named
    "uncalibrated" with how far off it is; None on other platforms (no tables)."""
    if not is_gpu(devices[0]):
        return None
    calibration = calibration_for(str(devices[0].device_kind))
    name, widen = None, None
    if calibration is None:  # another kind's tables: a wider interval
        (calibration, name), widen = nearest(spec.peak_flops, spec.hbm_bandwidth), 0.25
    moved = {id(s): wire for s, wire in zip(timed, wires, strict=True)}
    seconds = {id(s): p.seconds for s, p in zip(timed, priced or [], strict=True) if p}
    return price_hlo(
        hlo, calibration, name=name, num_devices=len(devices),
        wire_of=lambda s: moved[id(s)], link_bandwidth=bandwidths, scheduled=timed,
        widen=widen, seconds_of=lambda s: seconds.get(id(s)),
    )  # fmt: skip


@public("sx.estimate")
def estimate(
    step: Any,
    state: Any,
    batch: Any,
    *,
    tokens: float | None = None,
    model_flops: float | None = None,
    model_flops_note: str | None = None,
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
    links: Mapping[str, float] | None = None,
) -> Estimate:
    """Compiles ``step(state, batch)`` for abstract values and reports its cost per device.

    Args:
        step: a ``make_train_step`` step (``plan="auto"`` picks its plan first), or a
            ``jax.jit`` function of ``(state, batch)``.
        state, batch: abstract (``jax.ShapeDtypeStruct``, ``jax.eval_shape``,
            ``nnx.eval_shape``) or concrete values; only shapes, dtypes and shardings
            are used.
        tokens: tokens per step (default: rows × sequence of a 2-D integer batch leaf,
            else the rows of the first leaf: images or rows, and the report says so).
        model_flops: model FLOPs per step over all devices, by the convention of
            ``CONVENTION`` (for a transformer:
            ``shardax.cost.flops.transformer_flops_per_token`` × tokens). Default:
            ``6·N·tokens`` with ``N`` without the embedding lookup, attention not counted;
            for images, the compiled step's matmul FLOPs (``default_model_flops``).
        model_flops_note: the formula of ``model_flops``, for the report.
        compute_efficiency: the fraction of peak the prediction assumes, in (0, 1].
        links: bytes/s per link (``"intra-host"``, ``"inter-host"``, ``"inter-slice"``),
            over the datasheet's figures.

    Raises:
        ValueError: a sharding names an axis the step's mesh lacks; the batch's rows do
            not divide over the data axis (the step says so); XLA refuses one of the
            step's compiler options (named).

    A backend's out-of-memory compile error (libtpu's ``CompileTimeHbmOom``) is not
    raised: the report says the step does not fit, with the bytes the error names.

    A ``make_train_step`` step compiles with its XLA options (``step.compiler_options``),
    which ``"auto"`` resolves for its mesh's platform, so a step on ``sx.target("8xH100")``
    compiles with the GPU set it would run with; the report records them
    (``compiler_options``) and prints them.
    """
    if not hasattr(step, "lower"):
        raise TypeError(
            f"step must be a make_train_step step or a jax.jit function (with .lower), got "
            f"{type(step).__name__}"
        )
    tokens, model_flops, links = check_figures(tokens, model_flops, links)
    compute_efficiency = as_float("compute_efficiency", compute_efficiency, above=0)
    if compute_efficiency > 1:
        raise ValueError(
            f"compute_efficiency must be the fraction of peak the prediction assumes, in "
            f"(0, 1], got {compute_efficiency!r}"
        )
    state, batch = abstract_tree(state), abstract_tree(batch)
    check_priceable(state, batch, hasattr(step, "abstract"))
    mesh = mesh_of(step, jax.tree.leaves((state, batch)))
    check_axes(state, mesh, "state")
    check_axes(batch, mesh, "batch")
    if getattr(step, "plan", 0) is None and hasattr(step, "pick"):  # plan="auto"
        step = step.pick(state, batch)
    if hasattr(step, "abstract"):  # a make_train_step step: its precision's dtypes
        state = step.abstract(state)
    # A make_train_step step's jit carries its options, resolved for its mesh's (the
    # target's) platform; the report records them.
    options = getattr(step, "compiler_options", None)
    if hasattr(step, "compiler_options_for"):  # with the thresholds sized for this state
        options = step.compiler_options_for(state)
    options = dict(options) if isinstance(options, Mapping) else None
    start = time.perf_counter()
    try:
        compiled = step.lower(state, batch).compile()
    except RuntimeError as e:  # jax.errors.JaxRuntimeError; only out-of-memory is a report
        if out_of_memory(e) is None:
            refused = refused_compiler_option(e, options)
            if refused is not None:
                raise refused from None
            raise
        refused = refused_estimate(step, state, batch, mesh, e, time.perf_counter() - start, tokens)
        return dataclasses.replace(refused, compiler_options=options)
    compile_s = time.perf_counter() - start
    try:
        shardings = compiled.input_shardings[0][0]
    except (AttributeError, IndexError, TypeError):
        shardings = None
    memory, _ = state_bytes(state, shardings)
    report = analyse(
        compiled,
        mesh,
        state=state,
        shardings=shardings,
        batch=batch,
        tokens=tokens,
        model_flops=model_flops,
        model_flops_note=model_flops_note,
        compute_efficiency=compute_efficiency,
        links=links,
        grads_bytes=grad_bytes(step, state, memory["params"], mesh),
        compile_s=compile_s,
    )
    lower_outer = getattr(step, "lower_outer", None)  # a DiLoCo step (sx.DiLoCo)
    if lower_outer is not None:
        outer = analyse(
            lower_outer(state).compile(), mesh, state=state, shardings=shardings, tokens=0.0,
            model_flops=0.0, model_flops_note="the outer step", links=links,
            grads_bytes=0, compile_s=0.0,
        )  # fmt: skip
        report = dataclasses.replace(report, outer=outer, inner_steps=step.inner_steps)
    return dataclasses.replace(report, compiler_options=options)


__all__ = ["analyse", "estimate"]
