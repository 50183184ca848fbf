"""``sx.estimate``'s report, per device: [`Estimate`][shardax.cost.Estimate] (printed as
tables, ``to_dict()`` for JSON, ``plot(path)``), with the compiler options and the
collectives' exposed time in a line each.

>>> format_options({"xla_gpu_enable_triton_gemm": False})
'1 set: xla_gpu_enable_triton_gemm=False'
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from rich.console import Group

from shardax._extras import pyplot
from shardax._format import format_bytes, rich_text, titled_table
from shardax.checks import public, user_stacklevel
from shardax.cost.predict import StepPrediction
from shardax.cost.step_cost import StepCost, breakdown

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
            (``shardax.cost.budget.device_memory``).
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
        mem = titled_table(
            f"{self.devices} × {self.device_kind}, mesh {self.mesh}: memory "
            f"per device (compiled), HBM {hbm}"
        )
        mem.add_column("component")
        mem.add_column("bytes", justify="right")
        for name, value in self.memory.items():
            mem.add_row(("[bold]" if name == "peak" else "") + name, format_bytes(value))
        if self.headroom is not None:
            verdict = "fits" if self.fits else "[red]does not fit[/]"
            mem.caption = (
                f"headroom {self.headroom:.1%} of the budget: {verdict} (rule: ≥ "
                f"{HEADROOM:.0%} free)"
            )
        if self.compile_error is not None:
            return Group(
                mem,
                f"[red]the compiler refused the step:[/] {self.compile_error}",
                f"compiler options: {format_options(self.compiler_options)}",
                *[f"note: {n}" for n in self.notes],
            )
        work = titled_table(f"work per step (compiled in {self.compile_s:.1f} s)")
        work.add_column("figure")
        work.add_column("value", justify="right")
        work.add_row("matmul FLOPs per device (HLO)", f"{self.flops_hlo:.3g}")
        if self.flops_backend is not None:
            work.add_row("FLOPs per device (backend)", f"{self.flops_backend:.3g}")
        work.add_row(
            f"model FLOPs per device ({self.model_flops_note})",
            f"{self.model_flops / self.devices:.3g}",
        )
        for c in self.collectives:
            work.add_row(
                f"{c['op']} × {c['runs']} ({c['link']})", f"{format_bytes(c['sent_bytes'])} sent"
            )
        parts: list[Any] = [mem, work]
        p = self.roofline
        if p is not None:
            title = f"PREDICTED (not measured), model {p.model}"
            if self.per_op is not None:  # a GPU target: the per-op model below is the prediction
                title = f"model {p.model} (a rough guide; the per-op model below is the prediction)"
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
            line += (
                f", PREDICTED {o.predicted_s * 1e3:.2f} ms once every {h} steps: "
                f"{self.per_step_s * 1e3:.2f} ms per step with it"
            )
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
        interval = f"interval {low * 1e3:.1f}–{high * 1e3:.1f} ms"
        table.add_row("[bold]step", f"[bold]{c.step_s * 1e3:.1f}", interval)
        caption = []
        if self.tokens:
            per = self.tokens / self.devices
            caption.append(
                f"{self.unit}/s per device {per / c.step_s:,.0f} ({per / high:,.0f}–"
                f"{per / low:,.0f})"
            )
        if per_device and self.roofline is not None:
            peak = self.roofline.peak_flops
            caption.append(
                f"MFU {per_device / c.step_s / peak:.1%} ({per_device / high / peak:.1%}"
                f"–{per_device / low / peak:.1%})"
            )
        caption.append(
            f"executed matmul FLOPs {c.executed_flops:.3g} against model "
            f"{per_device or 0:.3g} per device"
        )
        if c.unpriced:
            names = ", ".join(f"{k} × {v:.0f}" for k, v in c.unpriced.items())
            caption.append(f"not in the tables (priced by their bytes): {names}")
        if c.fp8_datasheet_flops:
            caption.append("fp8 GEMMs at the datasheet's fp8 peak over bf16 (no fp8 rows)")
        if c.fp8_measured_flops:
            caption.append("fp8 GEMMs by the measured fp8 rows")
        table.caption = "; ".join(caption)
        return table

    def __str__(self) -> str:
        return rich_text(self, width=110)

    def plot(self, path: Any) -> None:
        """A PNG at ``path``: one bar per memory component; the peak, the memory budget
        and HBM as lines."""
        plt = pyplot("the memory plot")
        names = [n for n in self.memory if n != "peak"]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(names, [self.memory[n] / 2**30 for n in names])
        ax.axhline(self.memory["peak"] / 2**30, color="k", ls=":", label="compiled peak")
        if self.hbm_bytes:
            ax.axhline(self.hbm_bytes / 2**30, color="r", ls="--", label="HBM")
        if self.memory_budget and self.memory_budget != self.hbm_bytes:
            budget = f"budget ({self.budget_note})"
            ax.axhline(self.memory_budget / 2**30, color="tab:orange", ls="-.", label=budget)
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
        f"Estimate.predicted_s and interval_s, and .{old} goes in shardax 0.3.0",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
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
    if cost is None:
        exposed, total = o["exposed_s"], o["collective_s"]
        inter, inter_exposed = o.get("inter_host_s", 0.0), o.get("exposed_inter_host_s", 0.0)
    else:
        exposed, total = cost.exposed_s, cost.collective_s
        inter, inter_exposed = cost.inter_host_s, cost.exposed_inter_host_s
    line = (
        f"exposed collective time: {exposed * 1e3:.2f} ms per step of "
        f"{total * 1e3:.2f} ms of collectives ({o['overlapped']} of "
        f"{o['collectives']} overlap matmuls, {o['synchronous']} synchronous; from the "
        "compiled schedule)"
    )
    if inter:
        line += (
            f"\nexposed inter-host time: {inter_exposed * 1e3:.2f} ms per step of "
            f"{inter * 1e3:.2f} ms of collectives across hosts (priced level by level: "
            "NVLink within a host, the NICs between; from the compiled schedule)"
        )
    return line
