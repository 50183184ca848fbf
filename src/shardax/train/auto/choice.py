"""The choice: the candidates ranked, the pick, why, and how to run it.

Of the candidates that fit the budget, the one whose devices send the fewest bytes per
step wins (ties: fewer microbatches, then the fewest bytes per device). Where every
candidate has a predicted step time (devices with a datasheet or a registered
calibration: GPUs, TPUs, and the compile-only devices of ``sx.target``), the fastest
predicted of those that fit with 10% headroom wins instead; its interval (the per-op
model's, on a GPU) is printed beside. The pick's settings come back as ``shardax train``
flags and a launch command for the devices' hosts.

>>> train_flags("fsdp", {"replica": 2, "data": 8}, "full", 2)
'--mesh data=16 --plan fsdp --accumulate 2 --remat full'
>>> train_flags("zero1", {"data": 8}, precision="fp8")
'--mesh data=8 --plan zero1 --precision fp8'
>>> launch_command(jax.devices(), "python train.py")  # one host: the command itself
'python train.py'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from shardax._format import format_bytes, rich_text, titled_table
from shardax.checks import public
from shardax.cost.budget import device_memory
from shardax.cost.report import HEADROOM, Estimate
from shardax.mesh.axes import DATA_AXIS, REPLICA_AXIS
from shardax.plan.core import Plan
from shardax.plan.named import MESH_PLANS
from shardax.train.auto.candidates import Candidate
from shardax.train.config import StepConfig


@public("sx.train.AutoPlan")
@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """What [`auto_plan`][shardax.auto_plan] measured, and its pick. Print it for a table."""

    plan: Plan
    candidates: tuple[Candidate, ...]
    device_memory: float | None
    reason: str
    compiled: str
    pick: str | None = None
    """The picked candidate's name (None: the one candidate of ``plan``)."""

    @property
    def candidate(self) -> Candidate:
        """The picked candidate."""
        if self.pick is not None:
            return next(c for c in self.candidates if c.name == self.pick)
        return next(c for c in self.candidates if c.plan is self.plan)

    @property
    def name(self) -> str:
        """The picked candidate's name, e.g. ``"fsdp"``, or ``"fsdp·mb2"`` when several
        microbatch counts were ranked."""
        return self.candidate.name

    @property
    def accumulate(self) -> int:
        """The picked candidate's microbatches (``make_train_step``'s ``accumulate``)."""
        return self.candidate.accumulate

    @property
    def variant(self) -> str | None:
        """The picked model variant's name (None when one model was given)."""
        return self.candidate.variant

    @property
    def config(self) -> StepConfig | None:
        """The settings the picked step compiled with (mesh, plan, count, ...): build it
        with ``sx.train.TrainStep(loss_fn, report.config)``; None for the update alone."""
        return self.candidate.config

    @property
    def estimate(self) -> Estimate | None:
        """The picked candidate's analysis, what ``sx.estimate`` reports for its step."""
        return self.candidate.estimate

    @property
    def interval_s(self) -> tuple[float, float] | None:
        """The pick's predicted step time as ``(low, high)`` seconds, None without it."""
        return self.candidate.interval_s

    @property
    def flags(self) -> str:
        """The pick as ``shardax train`` flags (``train_flags``; a variant is its
        ``--remat``)."""
        c = self.candidate
        if c.plan.name not in FLAG_PLANS:
            raise ValueError(
                f"the pick's plan {c.plan.name!r} is one of your own (candidates= or a "
                f"Layout's plans), for which shardax train has no --plan (it builds "
                f"{', '.join(FLAG_PLANS)}): build its step with make_train_step(..., "
                "plan=report.plan), or rank the default plans under their own names"
            )
        shape = {str(k): int(v) for k, v in c.mesh.shape.items()}
        return train_flags(c.plan.name, shape, c.variant, c.accumulate, c.microbatches,
                           c.precision)  # fmt: skip

    def launch(self, command: str) -> str:
        """``command`` started on every host of the pick's devices
        (``launch_command``)."""
        return launch_command(list(self.candidate.mesh.devices.flat), command)

    def to_dict(self) -> dict[str, Any]:
        """Candidates, budget, pick and reason as plain data."""
        return {
            "pick": self.name,
            "accumulate": self.accumulate,
            "variant": self.variant,
            "flags": self.flags if self.candidate.plan.name in FLAG_PLANS else None,
            "interval_s": self.interval_s,
            "reason": self.reason,
            "compiled": self.compiled,
            "device_memory_bytes": self.device_memory,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def __rich__(self) -> Any:
        table = titled_table(f"candidate plans, compiled ({self.compiled}), per device")
        predicted = any(c.predicted_s is not None for c in self.candidates)
        # With predictions the reason column needs the room: the arguments and
        # temporaries stay in to_dict() and the pick's estimate.
        step = "predicted step (s), interval"
        cols = (
            ["plan", "total", "sent", "fits", step, "why"]
            if predicted
            else ["plan", "arguments", "temporaries", "total", "collective bytes", "fits"]
        )
        for col in cols:
            left = col in ("plan", "why")
            table.add_column(col, justify="left" if left else "right", no_wrap=col != "why")
        why = self.reasons()
        picked = self.name
        for c in self.candidates:
            name = f"[bold]{c.name}[/]" if c.name == picked else c.name
            fits = {None: "?", True: "yes", False: "[red]no[/]"}[c.fits]
            total, sent = format_bytes(c.total_bytes), format_bytes(c.collective_bytes)
            if c.skipped:
                fits = total = sent = "-"
            if predicted:
                table.add_row(name, total, sent, fits, _seconds(c), why[c.name])
            else:
                args, temps = format_bytes(c.argument_bytes), format_bytes(c.temp_bytes)
                if c.skipped:
                    args = temps = "-"
                table.add_row(name, args, temps, total, sent, fits)
        table.caption = f"pick: {self.name}: {self.reason}"
        return table

    def reasons(self) -> dict[str, str]:
        """One line per candidate: why it ranks where it does."""
        pick = self.candidate
        out = {}
        for c in self.candidates:
            if c.name == pick.name:
                out[c.name] = "picked"
            elif c.skipped:
                out[c.name] = f"not compiled: {c.skipped}"
            elif c.refused:
                out[c.name] = f"does not fit: the compiler refused it ({c.refused})"
            elif c.fits is False:
                out[c.name] = f"does not fit: {format_bytes(c.total_bytes)} per device"
            elif c.predicted_s is not None and pick.predicted_s:
                out[c.name] = f"predicted {c.predicted_s / pick.predicted_s - 1:+.0%} slower"
            else:
                out[c.name] = f"sends {format_bytes(c.collective_bytes)} per step"
        return out

    def __str__(self) -> str:
        return rich_text(self, width=140)


def default_device_memory(device: Any = None) -> float | None:
    """Bytes of memory of ``device`` (default: the first) that its programs may use: its
    allocator's limit (``memory_stats()["bytes_limit"]``), a GPU target's
    ``memory_fraction`` of its memory, else the hardware table's figure, else None
    (``shardax.cost.budget.device_memory``)."""
    found = device_memory(device)
    return None if found is None else found[0]


def _seconds(c: Candidate) -> str:
    """The predicted step of ``c`` with its interval, for the table."""
    if c.skipped:
        return "-"
    if c.predicted_s is None:
        return "n/a"
    low_high = c.interval_s
    return f"{c.predicted_s:.3f}" + (
        "" if low_high is None else f" ({low_high[0]:.3f}-{low_high[1]:.3f})"
    )


FLAG_PLANS = (*MESH_PLANS, "hsdp", "context", "fsdp+tp", "pipeline")
"""The search's plans that ``shardax train --plan`` builds (``train_flags``); a plan of
the user's own has no flag."""


def train_flags(
    plan: str,
    mesh: Mapping[str, int],
    remat: str | None = None,
    accumulate: int = 1,
    microbatches: int | None = None,
    precision: str | None = None,
) -> str:
    """The ``shardax train`` flags of ``plan`` on ``mesh``: ``hsdp`` is ``--plan fsdp`` on
    a mesh with a replica axis (the GPT's FSDP splits over ``data`` only); ``fsdp`` (over
    every data axis) and the ZeRO plans fold the replica axis into ``data``; ``context``
    is ``--plan fsdp`` on a mesh with a context axis; ``pipeline`` takes
    ``--microbatches``. Then ``--accumulate`` (above 1), ``--remat`` and ``--precision``."""
    mesh = dict(mesh)
    if plan not in ("hsdp", "context") and REPLICA_AXIS in mesh and DATA_AXIS in mesh:
        mesh[DATA_AXIS] = mesh.pop(REPLICA_AXIS) * mesh[DATA_AXIS]
        mesh = {DATA_AXIS: mesh.pop(DATA_AXIS), **mesh}
    name = "fsdp" if plan in ("hsdp", "context") else plan
    flags = f"--mesh {','.join(f'{k}={v}' for k, v in mesh.items())} --plan {name}"
    if microbatches:
        flags += f" --microbatches {microbatches}"
    if accumulate > 1:
        flags += f" --accumulate {accumulate}"
    flags += f" --remat {remat}" if remat else ""
    return flags + (f" --precision {precision}" if precision else "")


def launch_command(devices: Sequence[Any], command: str) -> str:
    """How to start ``command`` on every host of ``devices`` (a target's, or the mesh's):
    itself on one host; one process per GPU host with Slurm's ``srun``
    (``sx.initialize`` reads its environment); ``gcloud ... --worker=all`` on a TPU
    slice's hosts."""
    hosts = len({d.process_index for d in devices})
    platform = str(devices[0].platform).lower()
    if platform == "tpu":
        slices = len({getattr(d, "slice_index", 0) or 0 for d in devices})
        each = f" (each of the {slices} slices)" if slices > 1 else ""
        return (
            f"gcloud compute tpus tpu-vm ssh $TPU_NAME --worker=all{each} "
            f"--command='{command}'  # {hosts} hosts"
        )
    if hosts == 1:
        return command
    gpus = (
        f" --gpus-per-node={len(devices) // hosts}" if platform in ("gpu", "cuda", "rocm") else ""
    )
    return f"srun --nodes={hosts} --ntasks-per-node=1{gpus} {command}"


def choose(
    measured: Sequence[Candidate], budget: float | None, compiled: str, note: str = ""
) -> AutoPlan:
    """Of the ``measured`` candidates that fit ``budget`` bytes per device (all of them
    when ``budget`` is None), the one that sends the fewest bytes per step (ties: fewer
    microbatches, then the fewest bytes per device). Where every candidate has a predicted
    step time (devices with a datasheet or a registered calibration: GPUs, TPUs,
    compile-only targets), the fastest predicted of those that fit with
    ``shardax.cost.report.HEADROOM`` to spare instead. Candidates not compiled
    (``skipped``) stay in the report and are never picked. Raises ``ValueError`` when none
    fits. ``note`` (what the candidates share) ends the reason."""
    measured = [
        dataclasses.replace(
            c,
            fits=None
            if c.skipped or (budget is None and not c.refused)
            else (not c.refused and c.total_bytes <= budget),
        )
        for c in measured
    ]
    compiled_ = [c for c in measured if not c.skipped]
    count = f"{len(compiled_)} compiled" + (
        f", {len(measured) - len(compiled_)} not" if len(compiled_) < len(measured) else ""
    )
    fitting = [c for c in compiled_ if c.fits is not False]
    timed = all(c.predicted_s is not None for c in compiled_ if not c.refused)
    if timed and budget is not None:  # predicted: fit with headroom, then fastest
        roomy = [c for c in fitting if c.total_bytes <= budget * (1 - HEADROOM)]
        if roomy:
            pick = min(roomy, key=lambda c: (c.predicted_s, c.total_bytes))
            reason = (
                f"fastest predicted step, {pick.predicted_s * 1e3:.3g} ms (a prediction: "
                f"from the devices' datasheet or calibration), of the {len(roomy)} of "
                f"{len(measured)} candidates ({count}) that fit {format_bytes(budget)} with "
                f"{HEADROOM:.0%} headroom ({format_bytes(pick.total_bytes)} per device){note}"
            )
            return AutoPlan(pick.plan, tuple(measured), budget, reason, compiled, pick.name)
    if not fitting:
        best = min(compiled_, key=lambda c: c.total_bytes)
        raise ValueError(
            f"no plan fits device_memory {format_bytes(budget or 0)} "
            f"({budget:.0f} bytes) per device; the smallest, {best.name!r}, needs "
            f"{format_bytes(best.total_bytes)} ({best.total_bytes} bytes: arguments "
            f"{best.argument_bytes} + outputs {best.output_bytes} - aliased "
            f"{best.alias_bytes} + temporaries {best.temp_bytes}). Add devices, shard over "
            "more axes, or shrink the batch"
        )
    pick = min(fitting, key=lambda c: (round(c.collective_bytes), c.accumulate, c.total_bytes))
    if budget is None:
        where = (
            "no device memory figure (pass device_memory=, or --device-memory), so all "
            "count as fitting"
        )
    else:
        where = f"{len(fitting)} of {len(measured)} fit {format_bytes(budget)}"
    reason = (
        f"least communication, {format_bytes(pick.collective_bytes)} sent per device per "
        f"step ({format_bytes(pick.total_bytes)} per device); {where}{note}"
    )
    return AutoPlan(pick.plan, tuple(measured), budget, reason, compiled, pick.name)
