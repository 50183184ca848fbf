"""``shardax plan``: memory per device of DP, FSDP, TP, PP and hybrids, and the roofline batch.

Example: ``shardax plan --params 7e9 --devices 8 --hardware h100 --batch 1024``.
The formulas are in ``shardax.cost.memory`` and ``shardax.cost.roofline``.
``--measure`` compiles each candidate plan instead (``shardax.cli.plan_measure``);
``--target 64xH100`` compiles the built-in GPT for a cluster this machine does not have,
with its predicted speed, the plan and the launch command (``shardax.cli.plan_target``).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax

import shardax as sx
from shardax._format import titled_table
from shardax.cli import plan_explain, plan_measure, plan_target
from shardax.cli.common import (
    UsageError,
    add_json_flag,
    add_run_dir,
    console,
    float_type,
    mesh_spec,
    positive_int,
    print_json,
    refuse_given,
)
from shardax.cli.hardware import NAMES, roofline, spec_of
from shardax.cli.plan_measure import MODELS
from shardax.cli.plan_target import TARGET_PLANS
from shardax.cost.memory import STATE_BYTES, plan_memory, state_bytes
from shardax.parallel.remat_policy import OFFLOAD
from shardax.parallel.remat_policy import POLICIES as REMAT_POLICIES

GIB = 1024**3


_params = float_type("a finite parameter count >= 1 such as 7e9", lambda v: v >= 1)
_gib = float_type("a finite GiB > 0 such as 80", lambda v: v > 0)
_fraction = float_type("a share in (0, 1] such as 0.9", lambda v: 0 < v <= 1)


def plan_names(text: str) -> list[str]:
    """An argparse type: comma-separated plan names, at least one.

    >>> plan_names("zero1, fsdp")
    ['zero1', 'fsdp']
    """
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated plan names such as zero1,fsdp, got {text!r} (leave "
            "--plans out for every candidate)"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax plan``."""
    parser.add_argument(
        "--params",
        type=_params,
        default=None,
        help="model parameters, e.g. 7e9 (required without --measure)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="compile replicate, zero1, zero2, fsdp (fsdp+tp with a model axis, pipeline with "
        "a stage axis and --model gpt) for "
        "--model on these devices; pick the one that fits and communicates least",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="with --measure: the digits MLP (default), or a GPT (implied by --params)",
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=None, help="MLP width (--measure; default 512)"
    )
    parser.add_argument(
        "--layers", type=positive_int, default=None, help="layers (--measure; mlp 4, gpt 2)"
    )
    parser.add_argument("--d-model", type=positive_int, default=128, help="GPT width (--measure)")
    parser.add_argument("--heads", type=positive_int, default=4, help="GPT heads (--measure)")
    parser.add_argument(
        "--seq-len", type=positive_int, default=128, help="GPT sequence length (--measure)"
    )
    parser.add_argument(
        "--mesh",
        type=mesh_spec,
        default=None,
        help="with --measure or --target: e.g. data=4,model=2",
    )
    parser.add_argument(
        "--plans",
        type=plan_names,
        default=None,
        help="with --measure or --target --plan auto: the candidates to compile, e.g. "
        "zero1,fsdp (--target also: pipeline, context; default: all)",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="with --measure --model gpt and a stage axis: sx.pipeline microbatches per data "
        "shard (default: the stage size)",
    )
    add_run_dir(parser, "where --measure writes plan.json/png")

    parser.add_argument(
        "--target",
        default=None,
        help="compile the GPT for compile-only devices of this cluster (sx.target): e.g. "
        "8xH100, 32x8xH200, v5p-128, 2xv5p-128 (needs JAX >= 0.12 and shardax[gpu-compile] "
        "or shardax[tpu-compile]); prints memory, PREDICTED speed, plan and launch command. "
        "Its cost is the compiles: --plan auto compiles the cheapest candidate of each plan "
        "(at most 24; a GPU compile of the default GPT takes 10-25 s on a 2-core machine, "
        "more under load), a named --plan one; --plans a,b and --remat narrow the ranking",
    )
    parser.add_argument(
        "--plan",
        choices=TARGET_PLANS,
        default=None,
        help="with --target: the plan, or auto (default: rank the candidates by predicted "
        "step time among those that fit with 10%% headroom)",
    )
    parser.add_argument(
        "--vocab", type=positive_int, default=None, help="GPT vocab (--target; default 32000)"
    )
    parser.add_argument(
        "--remat",
        choices=[p for p in REMAT_POLICIES if p not in OFFLOAD],  # device memory only
        default=None,
        help="with --target: the GPT's remat policy per block (default: --plan auto ranks "
        "none, dots_no_batch and full; a named plan takes full)",
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="with --target: split each host into data x model=TP (a fsdp+tp candidate)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="with --target: the params' (and Adam moments') dtype in the state; bf16: "
        "6 bytes per parameter, as MaxText's bf16 runs (default fp32: 12)",
    )
    parser.add_argument("--png", default=None, help="with --target: a PNG of memory vs HBM")
    parser.add_argument(
        "--roofline",
        action="store_const",
        const=True,
        default=None,
        help="with --target: print the pick's whole estimate (memory by component, work, "
        "the roofline and the per-op model's tables), not only its headline prediction",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="explain the GPT's step (sx.explain), compiled for --target or on the devices at "
        "hand: the buffers at its memory peak with your lines, the collectives the plan did "
        "not ask for, the placement against the plan's intent, and the fixes that fit, each "
        "compiled (--plan: default fsdp)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=_fraction,
        default=None,
        metavar="F",
        help="with a GPU --target: the share of each GPU's memory the run's JAX will take "
        "(XLA_CLIENT_MEM_FRACTION), which the step compiles and must fit in (default: that "
        "variable here, else JAX's 0.75)",
    )
    parser.add_argument(
        "--network",
        default=None,
        metavar="NAME",
        help="with a GPU --target of several hosts: what joins them, a named network or "
        "cloud shape (ib-ndr, ib-hdr, gcp-a3-high, gcp-a3-mega, gcp-a3-ultra, aws-p5-efa, "
        "aws-p5e-efa, ethernet-100g; a3-megagpu-8g, p5.48xlarge, ...); default: the GPU's "
        "DGX network (InfiniBand NDR; HDR for A100), which the report names",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="with a GPU --target: the kernel tables to price the step with, as `shardax "
        "calibrate --out FILE` wrote them on a GPU of the target's kind (default: the ones "
        "shardax ships for the H100 and H200)",
    )
    parser.add_argument(
        "--devices", type=positive_int, default=None, help="devices (default: those at hand)"
    )
    parser.add_argument(
        "--hardware",
        choices=NAMES,
        default=None,
        help="device type for memory and roofline figures (default: detected): "
        "sx.HardwareType's values and the kinds --target knows (h200, b200, ...)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="global batch (rows per step: examples, or tokens for a transformer; with "
        "--target, sequences, default 2 per data shard)",
    )
    parser.add_argument(
        "--precision",
        choices=list(STATE_BYTES),
        default=None,
        help="the train policy, as for `shardax train --precision`: fp32, bf16 or fp16 keep "
        "params and Adam in fp32 (16 B/param); bf16 and fp16 matmuls read 2-byte copies "
        "(default: bf16; with --measure, fp32 as `shardax train`)",
    )
    parser.add_argument(
        "--device-memory",
        type=_gib,
        default=None,
        metavar="GIB",
        help="memory of one device in GiB (default: the hardware's datasheet figure; with "
        "--target, the budget the plan must fit, in place of --memory-fraction's share)",
    )
    add_json_flag(parser)


def make_plan(
    num_params: float,
    num_devices: int,
    hardware: str,
    precision: str = "bf16",
    batch: int | None = None,
    device_memory: float | None = None,
) -> dict[str, Any]:
    """The plan as plain data: one row per strategy, the roofline and the warnings."""
    if hardware not in NAMES:
        raise ValueError(f"--hardware: expected one of {', '.join(NAMES)}, got {hardware!r}")
    prec = state_bytes(precision)
    memory = device_memory
    spec = spec_of(hardware)
    if memory is None and spec is not None:
        memory = spec.memory_bytes
    roof = roofline(hardware, prec.compute)
    warnings = []
    if memory is None:
        warnings.append(
            f"no memory figure for {hardware}: pass --device-memory GIB to check what fits"
        )
    if roof is None:
        warnings.append(f"no roofline figures for {hardware}: measure with `shardax tune-batch`")
    rows = []
    for e in plan_memory(num_params, num_devices, prec):
        row: dict[str, Any] = {
            "strategy": e.strategy,
            "data": e.data,
            "model": e.model,
            "stage": e.stage,
            "params_bytes": e.params_bytes,
            "grads_bytes": e.grads_bytes,
            "master_bytes": e.master_bytes,
            "optimizer_bytes": e.optimizer_bytes,
            "total_bytes": e.total_bytes,
            "fits": None if memory is None else e.total_bytes <= memory,
            "per_replica_batch": None if batch is None else batch / e.data,
            "global_critical_batch": None if roof is None else roof["critical_batch"] * e.data,
        }
        stage = f", stage={e.stage}" if e.stage > 1 else ""
        name = f"{e.strategy} (data={e.data}, model={e.model}{stage})"
        if row["fits"] is False:
            warnings.append(
                f"{name} does not fit: {e.total_bytes / GIB:.1f} GiB of model states per device "
                f"> {memory / GIB:.1f} GiB on {hardware}"
            )
        if batch is not None and roof is not None:
            row["compute_bound"] = batch / e.data >= roof["critical_batch"]
            if batch % e.data:
                warnings.append(f"{name}: --batch {batch} is not divisible by data={e.data}")
        rows.append(row)
    return {
        "params": num_params,
        "devices": num_devices,
        "hardware": hardware,
        "precision": {
            "name": prec.name,
            "params": prec.params,
            "grads": prec.grads,
            "master": prec.master,
            "optimizer": prec.optimizer,
            "total": prec.total,
            "compute": prec.compute,
        },
        "device_memory_bytes": memory,
        "batch": batch,
        "roofline": roof,
        "strategies": rows,
        "warnings": warnings,
    }


def render(plan: dict[str, Any], out: Any) -> None:
    """Prints ``plan`` as a rich table and its warnings on ``out``."""
    p = plan["precision"]
    memory = plan["device_memory_bytes"]
    mem_text = "unknown" if memory is None else f"{memory / GIB:.0f} GiB"
    out.print(
        f"{plan['params']:.3g} parameters on {plan['devices']} × {plan['hardware']} "
        f"({mem_text} each), Adam, {p['name']}: params {p['params']:g} + grads {p['grads']:g} "
        f"+ master {p['master']:g} + Adam {p['optimizer']:g} = {p['total']:g} bytes/param"
    )
    table = titled_table(
        "model states per device (activations not counted)",
        caption="GiB per device; B* = roofline-critical batch per data-parallel replica",
    )
    for col in (
        "strategy",
        "data",
        "model",
        "stage",
        "params",
        "grads",
        "master",
        "Adam",
        "total",
        "fits",
    ):
        table.add_column(col, justify="right")
    if plan["batch"] is not None:
        table.add_column("batch/replica", justify="right")
    if plan["roofline"] is not None:
        table.add_column("global batch for B*", justify="right")
    for r in plan["strategies"]:
        fits = {None: "?", True: "[green]yes[/]", False: "[red]no[/]"}[r["fits"]]
        cells = [r["strategy"], str(r["data"]), str(r["model"]), str(r["stage"])]
        cells += [
            f"{r[k] / GIB:.1f}"
            for k in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes")
        ]
        cells += [f"[bold]{r['total_bytes'] / GIB:.1f}[/]", fits]
        if plan["batch"] is not None:
            b = f"{r['per_replica_batch']:g}"
            if "compute_bound" in r and not r["compute_bound"]:
                b = f"[yellow]{b} < B*[/]"
            cells.append(b)
        if plan["roofline"] is not None:
            cells.append(f"{r['global_critical_batch']:.0f}")
        table.add_row(*cells)
    out.print(table)
    roof = plan["roofline"]
    if roof is not None:
        out.print(
            f"roofline: B* = ({roof['bytes_per_param']:g} bytes/weight ÷ 2) × "
            f"{roof['peak_flops'] / 1e12:.0f} TFLOP/s ÷ {roof['hbm_bandwidth'] / 1e12:.2f} TB/s = "
            f"[bold]{roof['critical_batch']:.0f}[/] rows per replica; below it a step is "
            "memory-bound"
        )
    for w in plan["warnings"]:
        out.print(f"[yellow]warning:[/] {w}")


TARGET_ONLY = (
    "plan",
    "vocab",
    "remat",
    "tp",
    "param_dtype",
    "png",
    "memory_fraction",
    "calibration",
    "network",
    "roofline",
)
"""Options of ``shardax plan`` that only ``--target`` reads: refused without it."""


def refuse_target_only(args: argparse.Namespace) -> None:
    """A usage error naming the first option given that only ``--target`` reads."""
    rule = "only with --target (the GPT compiled for a cluster's devices); without it, this "
    refuse_given(args, TARGET_ONLY, rule + "option would be ignored")


def run(args: argparse.Namespace) -> int:
    """Prints the memory table and the warnings."""
    if getattr(args, "explain", False):
        return plan_explain.run(args)
    if args.target is not None:
        return plan_target.run(args)
    refuse_target_only(args)
    if args.measure:
        for option, value in (("--devices", args.devices), ("--hardware", args.hardware)):
            if value is not None:
                raise UsageError(
                    f"{option} {value}: only without --measure, which compiles on the devices "
                    "at hand (choose them with --cpu-devices and --mesh)"
                )
        if args.precision is None:
            args.precision = "fp32"

        if args.model is None:
            args.model = "gpt" if args.params is not None else "mlp"
        if args.batch is None:
            args.batch = 256 if args.model == "mlp" else 16
        if args.layers is None:
            args.layers = 4 if args.model == "mlp" else 2
        if args.hidden is None:
            args.hidden = 512
        return plan_measure.run(args)
    if args.params is None:
        raise UsageError("--params is required (or --measure to compile the built-in model)")
    if args.precision is None:
        args.precision = "bf16"
    num_devices = args.devices
    hardware = args.hardware
    if num_devices is None or hardware is None:
        num_devices = num_devices or jax.device_count()
        hardware = hardware or sx.cost.detect_hardware_type().value
    try:
        plan = make_plan(
            args.params, num_devices, hardware, args.precision, args.batch, args.device_memory
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print_json(plan)
    else:
        render(plan, console(args))
    return 0
