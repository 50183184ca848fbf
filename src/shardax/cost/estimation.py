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
import math
import re
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from rich.console import Group

from shardax._format import format_bytes, rich_text, titled_table
from shardax.checks import as_float, public, refused_compiler_option
from shardax.cost.calibration import MEASURED, calibration_for, device_figures, nearest
from shardax.cost.compile_target import device_memory
from shardax.cost.flops import compiled_flops, format_unpriced, hlo_flops, unpriced_calls
from shardax.cost.hardware import HardwareSpec, is_gpu
from shardax.cost.model_flops import CONVENTION, batch_unit, default_model_flops
from shardax.cost.network import (
    LevelPrice,
    layout_of,
    network_levels,
    network_of,
    price_collective,
    with_fitted,
)
from shardax.cost.opcost import StepCost, breakdown, price_hlo
from shardax.cost.predict import (
    DEFAULT_COMPUTE_EFFICIENCY,
    LINKS,
    StepPrediction,
    check_figures,
    host_share,
    link_of,
    predict_step,
    wire_seconds,
)
from shardax.cost.schedule import exposed_seconds, schedule

HEADROOM = 0.1
"""The share of the memory budget (``Estimate.memory_budget``) a plan must leave free to
count as fitting with headroom: the allocator's fragmentation, and what the compiler's
peak leaves out (library workspaces, collectives' scratch, buffers the runtime adds)."""


@public("sx.cost.Estimate")
@dataclasses.dataclass(frozen=True)
class Estimate:
    """What [`estimate`][shardax.estimate] compiled and predicted, per device. Print it for a table;
    ``to_dict()`` for JSON; ``plot(path)`` for a PNG of the memory against HBM and the
    budget.

    Attributes:
        device_kind, devices, mesh: the target.
        memory: bytes per device of ``params``, ``optimizer``, ``other_state``,
            ``batch``, ``gradients`` (inside the temporaries), ``other_temporaries``
            and ``peak`` (the compiler's: arguments + outputs - aliased + temporaries).
        hbm_bytes: the device's memory (None: unknown).
        memory_budget: the bytes JAX's programs may use on the device, which
            ``headroom`` and ``fits`` measure the peak against: a live GPU's allocator
            limit (``XLA_CLIENT_MEM_FRACTION`` of its memory), a GPU target's
            ``memory_fraction`` of ``hbm_bytes`` (the budget XLA compiled it in), else
            ``hbm_bytes``; ``budget_note`` says which
            (``shardax.cost.compile_target.device_memory``).
        flops_hlo: matmul FLOPs per device per step counted from the compiled HLO;
            flops_backend: the backend's count (``compiled_flops``:
            ``cost_analysis()`` with library calls and loop trips; None on GPU targets).
        model_flops: model FLOPs per step over all devices; model_flops_note: its formula.
        tokens: tokens per step over all devices (images or rows where ``unit`` says so).
        unit: what ``tokens`` counts: ``"tokens"``, ``"images"`` or ``"rows"``
            (``batch_unit``).
        unpriced_calls: custom calls the FLOP count cannot price, by target, with their
            calls per step (``unpriced_calls``).
        collectives: one dict per collective kind and link: op, link, runs, bytes sent.
        compile_s: seconds to lower and compile (measured on this machine).
        roofline: model ``roofline+links``'s figures (``StepPrediction``), a rough
            guide beside the prediction (``predicted_s``, ``interval_s``), and the
            prediction itself where no per-op model priced the step; None where the
            device has no datasheet, or the compiler refused the step.
        notes: what the figures assume or could not know.
        compile_error: the backend's out-of-memory error where it refused to compile
            the step (libtpu does when the temporaries exceed HBM): then ``memory``
            holds the state's bytes and the temporaries the error names, the peak is
            their sum and the step does not fit.
        compiler_options: the XLA options the step compiled with (a
            ``make_train_step`` step's ``step.compiler_options``, resolved for the
            target's platform: on a GPU target shardax's GPU set); None for a
            ``jax.jit`` of your own, whose options shardax does not know.
        overlap: from the compiled schedule (``shardax.cost.schedule``):
            ``exposed_s`` (per step, the collectives' time on the wire less the matmuls
            scheduled under each, clamped at 0 per collective), ``collective_s`` (all of
            their time on the wire), ``collectives`` (async pairs and synchronous ops),
            ``overlapped`` (those with matmuls between start and done) and
            ``synchronous``; None without a prediction.
        per_op: the per-op model's price of the compiled program on a GPU target, the
            prediction there (``StepCost``: seconds per class of kernels, launches,
            collectives on the wire and exposed, the step with its interval, and the
            calibration's name); None on other platforms or without a datasheet.
        compiled_bytes: the compiler's ``memory_analysis()`` as it gave it, bytes per
            device: ``arguments``, ``outputs``, ``aliased`` (donated) and ``temporaries``
            (None where it refused the step).
        network: the network between the hosts of a GPU target or cluster
            (``shardax.cost.network.Network.to_dict``, with ``why``: the target's, or
            its kind's default; ``fitted`` names a calibration whose figures replaced
            the documented ones); None on one host, a TPU or a CPU.
        outer, inner_steps: a DiLoCo step's (``sx.DiLoCo``): the outer step's own
            ``Estimate`` and H, the inner steps per outer step; the report above them is
            the inner step's, and [`per_step_s`][shardax.cost.Estimate.per_step_s] and
            [`per_step_link_bytes`][shardax.cost.Estimate.per_step_link_bytes] add the
            outer step's share (1/H). None for any other step.
    """

    device_kind: str
    devices: int
    mesh: dict[str, int]
    memory: dict[str, int]
    hbm_bytes: float | None
    flops_hlo: float
    flops_backend: float | None
    model_flops: float
    model_flops_note: str
    tokens: float
    collectives: tuple[dict[str, Any], ...]
    compile_s: float
    roofline: StepPrediction | None
    notes: tuple[str, ...] = ()
    compile_error: str | None = None
    compiler_options: dict[str, Any] | None = None
    overlap: dict[str, Any] | None = None
    per_op: StepCost | None = None
    unit: str = "tokens"
    unpriced_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    compiled_bytes: dict[str, int] | None = None
    memory_budget: float | None = None
    budget_note: str = ""
    network: dict[str, Any] | None = None
    outer: Estimate | None = None
    inner_steps: int | None = None

    @property
    def predicted_s(self) -> float | None:
        """The predicted time of one run of the compiled program: the per-op model's
        step where it priced it (a GPU target), else the roofline's with overlap; None
        without a prediction."""
        if self.per_op is not None:
            return self.per_op.step_s
        return None if self.roofline is None else self.roofline.overlapped_s

    @property
    def per_step_s(self) -> float | None:
        """The predicted time per training step: ``predicted_s``, plus, for a DiLoCo
        step, its outer step's ``predicted_s`` / H (one outer step every H)."""
        inner = self.predicted_s
        if self.outer is None or inner is None or self.outer.predicted_s is None:
            return inner if self.outer is None else None
        return inner + self.outer.predicted_s / self.inner_steps

    def per_step_link_bytes(self) -> dict[str, float]:
        """``link_bytes()`` per training step: for a DiLoCo step, the inner step's plus
        the outer step's / H."""
        out = self.link_bytes()
        if self.outer is not None:
            for link, sent in self.outer.link_bytes().items():
                out[link] = out.get(link, 0.0) + sent / self.inner_steps
        return out

    @property
    def interval_s(self) -> tuple[float, float] | None:
        """The per-op model's predicted step time as ``(low, high)`` seconds (None
        without it: a device with no datasheet, a CPU or TPU)."""
        return None if self.per_op is None else (self.per_op.low_s, self.per_op.high_s)

    @property
    def headroom(self) -> float | None:
        """The share of the memory budget (``memory_budget``, else HBM) the peak leaves
        free (negative: it does not fit)."""
        budget = self.memory_budget or self.hbm_bytes
        if not budget:
            return None
        return 1 - self.memory["peak"] / budget

    @property
    def fits(self) -> bool | None:
        """The peak fits the memory budget with ``HEADROOM`` of it to spare (None:
        neither the budget nor HBM is known)."""
        room = self.headroom
        return None if room is None else room >= HEADROOM

    def link_bytes(self) -> dict[str, float]:
        """Bytes each device sends per step, by the link its collectives' groups span (a
        group across GPU hosts counts whole under ``"inter-host"``; the prediction moves
        ``host_share`` of it between hosts and the rest over NVLink)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c["link"]] = out.get(c["link"], 0.0) + c["sent_bytes"]
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able). ``prediction`` holds the predicted step (``model``,
        ``step_s``, the interval ``low_s``–``high_s``, ``tokens_per_s_per_device``,
        ``mfu``): the per-op model's where it priced the step, else the roofline's;
        ``per_op`` the per-op model's classes, ``roofline_guide`` the roofline's figures
        (a rough guide)."""
        hidden = ("roofline", "per_op", "outer")
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in hidden}
        if self.outer is not None:
            out["outer"] = self.outer.to_dict()
            out.update(per_step_s=self.per_step_s, per_step_link_bytes=self.per_step_link_bytes())
        out["collectives"] = [dict(c) for c in self.collectives]
        out["notes"] = list(self.notes)
        out.update(headroom=self.headroom, fits_with_headroom=self.fits, headroom_rule=HEADROOM)
        out["prediction"] = self._predicted()
        out["per_op"] = None if self.per_op is None else self.per_op.to_dict()
        out["roofline_guide"] = None if self.roofline is None else self.roofline.to_dict()
        return out

    def _predicted(self) -> dict[str, Any] | None:
        """``to_dict()``'s ``prediction``: the step, its interval, tokens/s and MFU."""
        step = self.predicted_s
        if step is None:
            return None
        low, high = self.interval_s or (None, None)
        per_device = self._model_flops_per_device()
        roofline = self.roofline
        peak = None if roofline is None else roofline.peak_flops
        return {
            "model": "per-op" if self.per_op is not None or roofline is None else roofline.model,
            "step_s": step,
            "low_s": low,
            "high_s": high,
            "tokens_per_s_per_device": self.tokens / self.devices / step if self.tokens else None,
            "mfu": per_device / step / peak if per_device and peak else None,
        }

    def _model_flops_per_device(self) -> float | None:
        """The model FLOPs per device MFU counts: at most the matmul FLOPs the step runs
        (where every call is priced)."""
        per_device = self.model_flops / self.devices if self.model_flops else None
        if per_device and not self.unpriced_calls and self.flops_hlo:
            per_device = min(per_device, self.flops_hlo)
        return per_device

    @property
    def prediction(self) -> StepPrediction | None:
        """Deprecated: ``roofline`` (the prediction is ``predicted_s``, ``interval_s``)."""
        return _renamed("prediction", "roofline (the roofline+links model: a rough guide)", self)

    @property
    def cost(self) -> StepCost | None:
        """Deprecated: ``per_op`` (the per-op model's price of the step)."""
        return _renamed("cost", "per_op (the per-op model's price of the step)", self)

    def __rich__(self) -> Any:
        hbm = "unknown" if not self.hbm_bytes else format_bytes(self.hbm_bytes)
        if self.memory_budget and self.memory_budget != self.hbm_bytes:
            hbm += f", budget {format_bytes(self.memory_budget)} ({self.budget_note})"
        mem = titled_table(f"{self.devices} × {self.device_kind}, mesh {self.mesh}: memory "
                           f"per device (compiled), HBM {hbm}")  # fmt: skip
        mem.add_column("component")
        mem.add_column("bytes", justify="right")
        for name, value in self.memory.items():
            mem.add_row(("[bold]" if name == "peak" else "") + name, format_bytes(value))
        if self.headroom is not None:
            verdict = "fits" if self.fits else "[red]does not fit[/]"
            mem.caption = (f"headroom {self.headroom:.1%} of the budget: {verdict} (rule: ≥ "
                           f"{HEADROOM:.0%} free)")  # fmt: skip
        if self.compile_error is not None:
            return Group(mem, f"[red]the compiler refused the step:[/] {self.compile_error}",
                         f"compiler options: {format_options(self.compiler_options)}",
                         *[f"note: {n}" for n in self.notes])  # fmt: skip
        work = titled_table(f"work per step (compiled in {self.compile_s:.1f} s)")
        work.add_column("figure")
        work.add_column("value", justify="right")
        work.add_row("matmul FLOPs per device (HLO)", f"{self.flops_hlo:.3g}")
        if self.flops_backend is not None:
            work.add_row("FLOPs per device (backend)", f"{self.flops_backend:.3g}")
        work.add_row(f"model FLOPs per device ({self.model_flops_note})",
                     f"{self.model_flops / self.devices:.3g}")  # fmt: skip
        for c in self.collectives:
            work.add_row(
                f"{c['op']} × {c['runs']} ({c['link']})", f"{format_bytes(c['sent_bytes'])} sent"
            )
        parts: list[Any] = [mem, work]
        p = self.roofline
        if p is not None:
            title = f"PREDICTED (not measured), model {p.model}"
            if self.per_op is not None:  # a GPU target: the per-op model below is the prediction
                title = (f"model {p.model} (a rough guide; the per-op model below is "
                         "the prediction)")  # fmt: skip
            pred = titled_table(title)
            pred.add_column("predicted")
            pred.add_column("with overlap", justify="right")
            pred.add_column("without overlap", justify="right")
            pred.add_row("step time (s)", f"{p.overlapped_s:.3f}", f"{p.serial_s:.3f}")
            for label, fn, fmt in (
                (f"{self.unit}/s per device", p.tokens_per_s_per_device, "{:,.0f}"),
                ("model TFLOP/s per device", p.model_tflops_per_device, "{:.0f}"),
                ("MFU", p.mfu, "{:.1%}"),
            ):
                pred.add_row(label, *(fmt.format(fn(o)) for o in (True, False)))
            links = ", ".join(
                f"{k} {'bandwidth unknown' if v is None else f'{v:.3f} s'}"
                for k, v in p.link_s.items()
            )
            pred.caption = (
                f"compute {p.compute_s:.3f} s, memory {p.memory_s:.3f} s, collectives: "
                f"{links or 'none'}"
            )
            parts.append(pred)
        if self.per_op is not None:
            parts.append(self._cost_table())
        if self.overlap is not None:
            parts.append(exposed_line(self.overlap, self.per_op))
        parts.append(f"compiler options: {format_options(self.compiler_options)}")
        parts += [f"note: {n}" for n in self.notes]
        if self.outer is not None:
            parts.append(self._outer_line())
        return Group(*parts)

    def _outer_line(self) -> str:
        """A DiLoCo step's outer step and what it adds per training step."""
        o, h = self.outer, self.inner_steps
        assert o is not None and h is not None
        sent = ", ".join(f"{k} {format_bytes(v)}" for k, v in o.link_bytes().items()) or "nothing"
        per = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.per_step_link_bytes().items())
        line = f"DiLoCo, H={h}: the outer step sends {sent} per device"
        if o.predicted_s is not None and self.per_step_s is not None:
            line += (f", PREDICTED {o.predicted_s * 1e3:.2f} ms once every {h} steps: "
                     f"{self.per_step_s * 1e3:.2f} ms per step with it")  # fmt: skip
        return f"{line}; sent per step: {per or 'nothing'}"

    def _cost_table(self) -> Any:
        c = self.per_op
        assert c is not None
        per_device = self._model_flops_per_device()
        table = titled_table(f"PREDICTED (not measured), model per-op, {c.calibration}")
        table.add_column("class")
        table.add_column("ms per step", justify="right")
        table.add_column("priced by")
        for label, seconds, basis in breakdown(c, per_device):
            table.add_row(label, f"{seconds * 1e3:.2f}", basis)
        low, high = c.low_s, c.high_s
        table.add_row("[bold]step", f"[bold]{c.step_s * 1e3:.1f}",
                      f"interval {low * 1e3:.1f}–{high * 1e3:.1f} ms")  # fmt: skip
        caption = []
        if self.tokens:
            per = self.tokens / self.devices
            caption.append(f"{self.unit}/s per device {per / c.step_s:,.0f} ({per / high:,.0f}–"
                           f"{per / low:,.0f})")  # fmt: skip
        if per_device and self.roofline is not None:
            peak = self.roofline.peak_flops
            caption.append(f"MFU {per_device / c.step_s / peak:.1%} ({per_device / high / peak:.1%}"
                           f"–{per_device / low / peak:.1%})")  # fmt: skip
        caption.append(f"executed matmul FLOPs {c.executed_flops:.3g} against model "
                       f"{per_device or 0:.3g} per device")  # fmt: skip
        if c.unpriced:
            names = ", ".join(f"{k} × {v:.0f}" for k, v in c.unpriced.items())
            caption.append(f"not in the tables (priced by their bytes): {names}")
        table.caption = "; ".join(caption)
        return table

    def __str__(self) -> str:
        return rich_text(self, width=110)

    def plot(self, path: Any) -> None:
        """A PNG at ``path``: one bar per memory component; the peak, the memory budget
        and HBM as lines."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [n for n in self.memory if n != "peak"]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(names, [self.memory[n] / 2**30 for n in names])
        ax.axhline(self.memory["peak"] / 2**30, color="k", ls=":", label="compiled peak")
        if self.hbm_bytes:
            ax.axhline(self.hbm_bytes / 2**30, color="r", ls="--", label="HBM")
        if self.memory_budget and self.memory_budget != self.hbm_bytes:
            ax.axhline(self.memory_budget / 2**30, color="tab:orange", ls="-.",
                       label=f"budget ({self.budget_note})")  # fmt: skip
        title = f"{self.devices} × {self.device_kind}, mesh {self.mesh} (compiled)"
        ax.set(ylabel="GiB per device", title=title)
        ax.tick_params(axis="x", labelrotation=20)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _renamed(old: str, new: str, report: Estimate) -> Any:
    """``Estimate.<old>``, renamed ``<new>``: its value, with a ``DeprecationWarning``."""
    warnings.warn(
        f"sx.cost.Estimate.{old} is now Estimate.{new}; the prediction is "
        f"Estimate.predicted_s and interval_s, and .{old} goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(report, new.split()[0])


def format_options(options: Mapping[str, Any] | None) -> str:
    """XLA compiler options in one line (None: unknown, ``{}``: XLA's defaults).

    >>> format_options({"xla_gpu_enable_triton_gemm": False}), format_options({})
    ('1 set: xla_gpu_enable_triton_gemm=False', "none (XLA's defaults)")
    """
    if options is None:
        return "unknown (a jax.jit of your own: its own)"
    if not options:
        return "none (XLA's defaults)"
    return f"{len(options)} set: " + ", ".join(f"{k}={v}" for k, v in options.items())


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


def _refused(
    step: Any, state: Any, batch: Any, mesh: Any, error: BaseException, compile_s: float,
    tokens: float | None,
) -> Estimate:  # fmt: skip
    """The [`Estimate`][shardax.cost.Estimate] of a step the compiler refused for lack of memory."""
    need, have = out_of_memory(error) or (0.0, 0.0)
    devices = list(mesh.devices.flat)
    spec = device_figures(devices[0])
    plan = getattr(step, "state_plan", None)
    shardings = plan(state) if plan is not None else None
    memory, _ = _state_bytes(state, shardings)
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
        **_budget(devices[0]),
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


def _budget(device: Any) -> dict[str, Any]:
    """An [`Estimate`][shardax.cost.Estimate]'s ``memory_budget`` and ``budget_note`` on
    ``device``."""
    found = device_memory(device)
    return {"memory_budget": None, "budget_note": ""} if found is None else {
        "memory_budget": found[0], "budget_note": found[1]}  # fmt: skip


def _mesh_of(step: Any, leaves: list[Any]) -> Any:
    mesh = getattr(step, "mesh", None)
    if mesh is not None:
        return mesh
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    raise ValueError(
        "step has no mesh and no leaf of state or batch carries a NamedSharding; pass a "
        "make_train_step step, or abstract values placed with sx.prepare (or "
        "jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec)))"
    )


def check_axes(tree: Any, mesh: Any, what: str) -> None:
    """Every NamedSharding in ``tree`` names only axes of ``mesh``; else ValueError naming
    the leaf, the axis and the mesh's axes."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            continue
        for entry in sharding.spec:
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                if axis not in mesh.shape:
                    raise ValueError(
                        f"{what} leaf {jax.tree_util.keystr(path)} is sharded over mesh axis "
                        f"{axis!r}, which the step's mesh {dict(mesh.shape)} lacks; place "
                        "it with the step's mesh (sx.prepare(..., mesh=mesh)) or use its axes"
                    )


def _abstract(tree: Any) -> Any:
    """Arrays as ShapeDtypeStructs (keeping their shardings); other leaves as they are."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(one, tree)


def _per_device(leaf: Any, sharding: Any) -> int:
    shape = tuple(leaf.shape)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = sharding.shard_shape(shape)
    # a typed PRNG key's dtype (key<fry>) is no NumPy dtype; it gives its own itemsize
    itemsize = getattr(leaf.dtype, "itemsize", None) or np.dtype(leaf.dtype).itemsize
    return math.prod(shape) * itemsize


def _kind(path: str) -> str:
    low = path.lower()
    if "opt_state" in low or "optimizer" in low:
        return "optimizer"
    if any(k in low for k in ("model_state", "rng", ".step", "loss_scale", "batch_stats")):
        return "other_state"
    return "params"


def _state_bytes(state: Any, shardings: Any) -> tuple[dict[str, int], int]:
    """Bytes per device of params, optimizer and other state, and the params' global
    element count."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = [(jax.tree_util.keystr(p), x) for p, x in leaves if hasattr(x, "shape")]
    flat = [s for s in jax.tree.leaves(shardings) if hasattr(s, "shard_shape")]
    if len(flat) != len(arrays):
        flat = [getattr(x, "sharding", None) for _, x in arrays]
    out = {"params": 0, "optimizer": 0, "other_state": 0}
    count = 0
    for (path, leaf), sharding in zip(arrays, flat, strict=True):
        kind = _kind(path)
        out[kind] += _per_device(leaf, sharding)
        if kind == "params":
            count += math.prod(leaf.shape)
    return out, count


def _param_shapes(state: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, global shape)`` of each parameter leaf of ``state`` (as ``_kind``)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [(jax.tree_util.keystr(p), tuple(x.shape)) for p, x in leaves
            if hasattr(x, "shape") and _kind(jax.tree_util.keystr(p)) == "params"]  # fmt: skip


def _grad_bytes(step: Any, state: Any, params_bytes: int, mesh: Any) -> int:
    """Gradients per device: as the params, or (ZeRO-2: ``plan.shard_grads``) split like
    the optimizer state."""
    plan = getattr(step, "plan", None)
    if not getattr(plan, "shard_grads", False) or not hasattr(state, "params"):
        return params_bytes
    specs = plan.mirror_specs(state.params)
    total = 0
    for leaf, spec in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        strict=False,
    ):
        total += _per_device(leaf, jax.sharding.NamedSharding(mesh, spec))
    return total


def default_tokens(batch: Any) -> float:
    """Tokens per step: rows × sequence of the batch's first 2-D integer leaf (a token
    batch), else the rows of its first leaf."""
    leaves = [x for x in jax.tree.leaves(batch) if hasattr(x, "shape") and len(x.shape)]
    for x in leaves:
        if len(x.shape) == 2 and np.issubdtype(np.dtype(x.dtype), np.integer):
            return float(x.shape[0] * x.shape[1])
    return float(leaves[0].shape[0]) if leaves else 0.0


def link_bandwidths(
    spec: Any, links: Mapping[str, float] | None, platform: str = "gpu"
) -> dict[str, float | None]:
    """Bytes/s per link: ``links`` where given, else the datasheet's ``ici_bandwidth``
    (NVLink within a GPU host; ICI anywhere within a TPU slice, across its hosts too) and
    ``dcn_bandwidth`` (InfiniBand between GPU hosts, DCN between TPU slices).

    >>> from types import SimpleNamespace as NS
    >>> link_bandwidths(NS(ici_bandwidth=4.5e11, dcn_bandwidth=5e10), None)["inter-host"]
    50000000000.0
    >>> link_bandwidths(NS(ici_bandwidth=4.5e11, dcn_bandwidth=5e10), None, "tpu")["inter-host"]
    450000000000.0
    """
    ici, dcn = getattr(spec, "ici_bandwidth", None), getattr(spec, "dcn_bandwidth", None)
    tpu = platform == "tpu"
    out: dict[str, float | None] = {
        "intra-host": ici,
        "inter-host": ici if tpu else dcn,
        "inter-slice": dcn,
    }
    out.update(links or {})
    return out


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
    """The [`Estimate`][shardax.cost.Estimate] of an already compiled step (``sx.estimate`` and the
    auto
    plan's search call this once per compiled program)."""
    devices = list(mesh.devices.flat)
    spec = device_figures(devices[0]) if spec is None else spec
    notes = []
    if spec is not None and spec.source.startswith(MEASURED):
        notes.append(
            f"no datasheet for device kind {devices[0].device_kind!r}: its figures are its "
            f"calibration's ({spec.source.removeprefix(MEASURED)}): peak {spec.peak_flops:.3g} "
            f"FLOP/s (the best GEMM rate measured; MFU counts against it, and the roofline's "
            f"compute_efficiency discounts it again), memory bandwidth "
            f"{spec.hbm_bandwidth:.3g} B/s (the fastest stream), memory "
            f"{spec.memory_bytes / 2**30:.1f} GiB (the allocator's budget), and a link within "
            "a host only where it measured collectives"
        )
    m = compiled.memory_analysis()
    args, outs = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    memory, _ = _state_bytes(state, shardings) if state is not None else ({"params": 0}, 0)
    state_total = sum(memory.values())
    memory["batch"] = max(0, args - state_total)
    grads = memory["params"] if grads_bytes is None else grads_bytes
    training = memory.get("optimizer", 0) > 0  # a train step: it makes gradients
    grads = grads if training else 0
    memory["gradients"] = min(grads, temp)
    memory["other_temporaries"] = temp - memory["gradients"]
    memory["peak"] = args + outs - alias + temp
    hlo = compiled.as_text()
    flops = hlo_flops(hlo)
    backend = compiled_flops(compiled)
    unpriced = unpriced_calls(hlo)
    if unpriced:
        notes.append(format_unpriced(unpriced))
    unbounded = _unknown_trips(hlo)
    if unbounded:
        notes.append(
            f"{unbounded} while loop(s) of the step run a number of trips decided at run time "
            "(a jax.lax.while_loop on data, not a fori_loop or scan): each is priced as one "
            "trip of its body, so the step's FLOPs, bytes and time are a lower bound"
        )
    unit = "tokens" if tokens is not None else batch_unit(batch)
    tokens = default_tokens(batch) if tokens is None else float(tokens)
    if model_flops is None:
        executed = (flops or backend or 0.0) * len(devices)
        params = _param_shapes(state) if state is not None else []
        model_flops, model_flops_note, statement = default_model_flops(
            params, batch, tokens, unit, executed
        )
        notes.append(f"{statement}. Convention: {CONVENTION}")
    else:
        notes.append(f"model FLOPs: given ({model_flops_note or 'no formula named'}). "
                     f"Convention: {CONVENTION}")  # fmt: skip
    note = model_flops_note or "given"
    timed = schedule(hlo, len(devices))
    grouped: dict[tuple[str, str], dict[str, Any]] = {}
    slowest: dict[tuple[tuple[int, ...], ...], list[Any]] = {}  # collectives share groups

    def members(groups: tuple[tuple[int, ...], ...]) -> list[Any]:
        if groups not in slowest:
            slowest[groups] = _members(groups, devices)
        return slowest[groups]

    links_of = [_link_of(members(s.collective.groups)) for s in timed]
    for s, link in zip(timed, links_of, strict=True):
        c = s.collective
        row = grouped.setdefault((c.op, link), {"op": c.op, "link": link, "runs": 0,
                                                "sent_bytes": 0.0})  # fmt: skip
        row["runs"] += c.count
        row["sent_bytes"] += c.sent_bytes
    rows = tuple(grouped.values())
    hbm = None if spec is None else float(spec.memory_bytes)
    prediction = overlap = cost = network = None
    if spec is None:
        why = f"no datasheet for device kind {devices[0].device_kind!r}: no predicted time"
        if is_gpu(devices[0]):
            why += (" ('shardax calibrate' measures this GPU's tables, and "
                    "sx.cost.calibration.register(sx.cost.calibration.load(FILE)) prices "
                    "with them)")  # fmt: skip
        notes.append(why)
    else:
        cost = compiled.cost_analysis() if backend is not None else None
        if isinstance(cost, list | tuple):
            cost = cost[0] if cost else None
        accessed = (cost or {}).get("bytes accessed")
        hbm_traffic = float(accessed) if accessed else float(args + outs + 2 * temp)
        bandwidths = link_bandwidths(spec, links, str(devices[0].platform).lower())
        levels, network = _levels(devices, spec, bandwidths, links)
        if network is not None:
            bandwidths["inter-host"] = levels["inter-host"].bandwidth
            notes.append(f"network: {network['line']}; {network['why']}")
        priced = [_level_price(s, link, levels, members(s.collective.groups))
                  for s, link in zip(timed, links_of, strict=True)]  # fmt: skip
        wires = [_wire(s, link, devices, bandwidths, members(s.collective.groups)) if p is None
                 else {k: v * s.collective.count for k, v in p.bytes.items()}
                 for s, link, p in zip(timed, links_of, priced, strict=True)]  # fmt: skip
        sent: dict[str, float] = {}  # bytes per link (a group across GPU hosts: split)
        for wire in wires:
            for link, nbytes in wire.items():
                sent[link] = sent.get(link, 0.0) + nbytes
        compute = flops
        if not flops and backend:  # e.g. TPU: its matmuls are not plain dots in the HLO
            compute = float(backend)
            notes.append(
                "compute: the backend's cost_analysis() FLOPs (no matmul found in the HLO)"
            )
        floor = model_flops / len(devices) if model_flops else 0.0
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
        mfu_flops = model_flops
        if not unpriced and model_flops > compute * len(devices) > 0:
            notes.append(
                f"MFU: the model's FLOPs per device ({floor:.3g}) exceed the compiled step's "
                f"({compute:.3g}); MFU counts the executed ones"
            )
            mfu_flops = compute * len(devices)
        prediction = predict_step(
            flops=compute,
            hbm_bytes=hbm_traffic,
            link_bytes=sent,
            peak_flops=spec.peak_flops,
            hbm_bandwidth=spec.hbm_bandwidth,
            link_bandwidth=bandwidths,
            compute_efficiency=compute_efficiency,
            tokens=tokens,
            model_flops=mfu_flops,
            devices=len(devices),
        )
        overlap = _overlap(timed, wires, bandwidths, compute_efficiency * spec.peak_flops,
                           priced)  # fmt: skip
        cost = _price(hlo, devices, spec, bandwidths, timed, wires, priced)
        missing = [k for k, v in prediction.link_s.items() if v is None]
        if missing:
            notes.append(
                f"no bandwidth for link(s) {', '.join(missing)} in the datasheet (or "
                "calibration): their "
                "collectives are not in the predicted time; pass links={...} (bytes/s)"
            )
        if not accessed:
            notes.append("HBM traffic: arguments + outputs + 2 × temporaries (no backend figure)")
    if training:
        notes.append("gradients: the params' bytes and sharding, part of the temporaries")
    return Estimate(
        device_kind=str(devices[0].device_kind),
        devices=len(devices),
        mesh={str(k): int(v) for k, v in mesh.shape.items()},
        memory=memory,
        hbm_bytes=hbm,
        **_budget(devices[0]),
        flops_hlo=flops,
        flops_backend=backend,
        model_flops=float(model_flops),
        model_flops_note=note,
        tokens=tokens,
        unit=unit,
        unpriced_calls=unpriced,
        collectives=rows,
        compile_s=compile_s,
        roofline=prediction,
        notes=tuple(notes),
        overlap=overlap,
        per_op=cost,
        compiled_bytes={"arguments": args, "outputs": outs, "aliased": alias, "temporaries": temp},
        network=None if network is None else {k: v for k, v in network.items() if k != "line"},
    )


def _levels(
    devices: list[Any], spec: HardwareSpec, bandwidths: Mapping[str, float | None],
    links: Mapping[str, float] | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:  # fmt: skip
    """The network levels of GPUs on several hosts (``shardax.cost.network``): the
    target's network (else the kind's default), with the kind's calibration's fitted
    per-level figures where it measured them (across hosts: on that network), and the
    report's words for it; ``({}, None)`` on one host, a TPU or where no network is known."""
    if not is_gpu(devices[0]) or len({d.process_index for d in devices}) < 2:
        return {}, None
    network, why = network_of(devices[0])
    nvlink = bandwidths.get("intra-host")
    if network is None or not nvlink:
        return {}, None
    calibration = calibration_for(str(devices[0].device_kind))
    network = with_fitted(network, calibration)
    fitted = {k: (lat, bw) for k, lat, bw in getattr(calibration, "levels", ())}
    if network.fitted is None:  # measured on another network: its NICs are not these
        fitted.pop("inter-host", None)
    levels = network_levels(network, nvlink, fitted, (links or {}).get("inter-host"))
    words = network.describe()
    if "intra-host" in fitted:
        words += f"; NVLink per level fitted ({calibration.name})"  # type: ignore[union-attr]
    if levels["inter-host"].source == "links= given":
        words += f"; between hosts at the given {levels['inter-host'].bandwidth:.3g} B/s"
    return levels, {**network.to_dict(), "why": why, "line": words}


def _level_price(
    s: Any, link: str, levels: Mapping[str, Any], members: list[Any]
) -> LevelPrice | None:
    """One run of the scheduled collective ``s`` priced level by level where its group
    (``members``: its slowest group's devices) spans GPU hosts; else None."""
    if not levels or link != "inter-host":
        return None
    c = s.collective
    layout = layout_of(members)
    if layout.hosts < 2:
        return None
    return price_collective(c.op, c.bytes, layout, levels)


def _price(
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


_LINK_ORDER = {"intra-host": 0, "inter-host": 1, "inter-slice": 2}


def _members(groups: tuple[tuple[int, ...], ...], devices: list[Any]) -> list[Any]:
    """The devices of a collective's slowest group (all ``devices`` where not known): the
    one over the widest link (slices, then hosts), of those the one whose fewest devices
    on a host carry the most between hosts. Every group runs the op at once, so the
    slowest sets its time: a pipeline's permute between stages on one host and stages on
    two is priced by the pair that crosses hosts."""
    if not groups:
        return devices

    def slowness(group: tuple[int, ...]) -> tuple[int, int]:
        members = [devices[i] for i in group if i < len(devices)]
        hosts = Counter(d.process_index for d in members)
        return _LINK_ORDER[_link_of(members)], -min(hosts.values(), default=0)

    slowest = max(groups, key=slowness)
    return [devices[i] for i in slowest if i < len(devices)]


def _link_of(members: list[Any]) -> str:
    return link_of(
        {d.process_index for d in members}, {getattr(d, "slice_index", 0) for d in members}
    )


def _wire(
    s: Any, link: str, devices: list[Any], bandwidths: Mapping[str, float | None],
    members: list[Any] | None = None,
) -> dict[str, float]:  # fmt: skip
    """The bytes per step the scheduled collective ``s`` moves over each link: all it
    sends over ``link``, except a group across GPU hosts with NVLink within them (an
    ``"intra-host"`` bandwidth), whose devices send ``host_share`` of it between hosts
    and the rest within their host. ``members``: its slowest group's devices, where the
    caller has them (``_members``)."""
    c = s.collective
    if not is_gpu(devices[0]) or link != "inter-host" or not bandwidths.get("intra-host"):
        return {link: c.sent_bytes}
    members = _members(c.groups, devices) if members is None else members
    per_host = Counter(d.process_index for d in members)
    share = host_share(c.op, c.group, min(per_host.values()))
    split = {"inter-host": share * c.sent_bytes, "intra-host": (1 - share) * c.sent_bytes}
    return {k: v for k, v in split.items() if v}


def _overlap(
    timed: list[Any], wires: list[Mapping[str, float]], bandwidths: Mapping[str, float | None],
    flop_rate: float, priced: list[LevelPrice | None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``Estimate.overlap`` of the scheduled collectives ``timed``, moving ``wires``
    (collectives over a link of unknown bandwidth are left out, as in the prediction);
    ``priced``: each one's run priced level by level where its group spans GPU hosts
    (``_level_price``), whose time and exposure also count as ``inter_host_s`` and
    ``exposed_inter_host_s``."""
    exposed = total = inter = inter_exposed = 0.0
    for i, (s, moved) in enumerate(zip(timed, wires, strict=True)):
        runs = s.collective.count
        if not runs:
            continue
        level = priced[i] if priced else None
        wire = (wire_seconds({k: v / runs for k, v in moved.items()}, bandwidths)
                if level is None else level.seconds)  # fmt: skip
        if wire is None:
            continue
        total += wire * runs
        left = exposed_seconds(s, wire, flop_rate)
        exposed += left
        if level is not None:
            inter += wire * runs
            inter_exposed += left
    return {
        "exposed_s": exposed,
        "collective_s": total,
        "inter_host_s": inter,
        "exposed_inter_host_s": inter_exposed,
        "collectives": len(timed),
        "overlapped": sum(s.overlapped for s in timed),
        "synchronous": sum(s.synchronous for s in timed),
    }


def exposed_line(overlap: Mapping[str, Any], cost: StepCost | None = None) -> str:
    """The report's line for ``Estimate.overlap``: with the per-op model's ``cost`` (a GPU
    target), its exposed and wire times (each collective's latency included, the matmuls
    under it at the calibrated rate: the figures of its table); else the roofline's.

    >>> print(exposed_line({"exposed_s": 0.0021, "collective_s": 0.0105, "collectives": 9,
    ...                     "overlapped": 6, "synchronous": 1}))
    exposed collective time: 2.10 ms per step of 10.50 ms of collectives (6 of 9 overlap
    matmuls, 1 synchronous; from the compiled schedule)
    """
    o = overlap
    exposed, total = (o["exposed_s"], o["collective_s"]) if cost is None else (
        cost.exposed_s, cost.collective_s)  # fmt: skip
    inter, inter_exposed = (o.get("inter_host_s", 0.0), o.get("exposed_inter_host_s", 0.0)) if (
        cost is None) else (cost.inter_host_s, cost.exposed_inter_host_s)  # fmt: skip
    line = (
        f"exposed collective time: {exposed * 1e3:.2f} ms per step of "
        f"{total * 1e3:.2f} ms of collectives ({o['overlapped']} of "
        f"{o['collectives']} overlap matmuls, {o['synchronous']} synchronous; from the "
        "compiled schedule)"
    )
    if inter:
        line += (f"\nexposed inter-host time: {inter_exposed * 1e3:.2f} ms per step of "
                 f"{inter * 1e3:.2f} ms of collectives across hosts (priced level by level: "
                 "NVLink within a host, the NICs between; from the compiled schedule)")  # fmt: skip
    return line


def _unknown_trips(hlo: str) -> int:
    """How many ``while`` instructions of ``hlo`` XLA could not give a trip count
    (``known_trip_count`` in their backend config)."""
    return sum(
        1 for line in hlo.splitlines() if " while(" in line and "known_trip_count" not in line
    )


def _check_priceable(state: Any, batch: Any, train_step: bool) -> None:
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
            for images, the compiled step's matmul FLOPs
            (``default_model_flops``).
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
    state, batch = _abstract(state), _abstract(batch)
    _check_priceable(state, batch, hasattr(step, "abstract"))
    mesh = _mesh_of(step, jax.tree.leaves((state, batch)))
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
        refused = _refused(step, state, batch, mesh, e, time.perf_counter() - start, tokens)
        return dataclasses.replace(refused, compiler_options=options)
    compile_s = time.perf_counter() - start
    try:
        shardings = compiled.input_shardings[0][0]
    except (AttributeError, IndexError, TypeError):
        shardings = None
    memory, _ = _state_bytes(state, shardings)
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
        grads_bytes=_grad_bytes(step, state, memory["params"], mesh),
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


__all__ = ["HEADROOM", "LINKS", "Estimate", "analyse", "estimate", "out_of_memory"]
