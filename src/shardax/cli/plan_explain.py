"""``shardax plan --explain``: the built-in GPT's train step, compiled for a ``--target``
(``sx.target``) or on the devices at hand, explained by [`sx.explain`][shardax.explain]:
the buffers at its memory peak with the lines that made them, the collectives its plan did
not ask for, the state's placement against the plan's intent, and, where the step does not
fit its budget, the changes that fit, each compiled and ranked by predicted step time
(plans × microbatches × the remat policies).

Example: ``shardax plan --explain --target 8xH100 --batch 64 --plan fsdp``, or on this
machine's devices ``shardax plan --explain --mesh data=8 --plan zero1``.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax

import shardax as sx
from shardax.cli.common import UsageError, console, print_json, refuse_given
from shardax.cli.plan_target import (
    REMATS,
    TARGET_DEFAULTS,
    data_rows,
    default_mesh,
    gpt_for_target,
    load_calibration,
    load_target,
    named_candidate,
    plan_axis,
    plan_for_target,
    refuse_ignored,
    target_precision,
)
from shardax.cost import calibration
from shardax.mesh.axes import DATA_AXIS, MODEL_AXIS
from shardax.models import gpt

NOT_WITH_EXPLAIN = {
    "png": "which draws --target's estimate; --explain prints its tables (--json for data)",
}
"""Options ``shardax plan --explain`` would ignore, and why: each is refused."""

LIVE_ONLY_WITH_TARGET = ("memory_fraction", "calibration", "network")
"""Options that describe a ``--target``'s devices: refused on the devices at hand."""


def refuse(args: argparse.Namespace) -> None:
    """A usage error naming the first option ``--explain`` would ignore."""
    for dest, why in NOT_WITH_EXPLAIN.items():
        value = getattr(args, dest, None)
        if value is not None:
            shown = ",".join(value) if isinstance(value, list) else value
            raise UsageError(f"--{dest} {shown}: not with --explain, {why}")
    if args.target is None:
        rule = "only with --target (it describes the target's devices); --explain without it "
        refuse_given(args, LIVE_ONLY_WITH_TARGET, rule + "compiles on the devices at hand")
        if args.plan == "auto":
            raise UsageError(
                "--plan auto: only with --target (it ranks plans by the per-op model's "
                "predicted time, which the devices at hand have no datasheet for); name a plan"
            )
    try:
        refuse_ignored(args)
    except UsageError as e:  # its reasons name --target, which this command may not have
        if args.target is not None:
            raise
        raise UsageError(str(e).replace("not with --target", "not with --explain")) from None


def _mesh(args: argparse.Namespace, target: Any) -> Any:
    spec = dict(args.mesh) if args.mesh else None
    if spec is None:
        spec = default_mesh(target, args.tp) if target is not None else {DATA_AXIS: -1}
        if target is None and args.tp > 1:
            spec = {DATA_AXIS: -1, MODEL_AXIS: args.tp}
    try:
        mesh = sx.make_mesh(spec, devices=target) if target is not None else sx.make_mesh(spec)
    except ValueError as e:
        raise UsageError(f"--mesh {spec}: {e}") from None
    if DATA_AXIS not in mesh.shape:
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {dict(mesh.shape)}")
    return mesh


def explained(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """Builds the GPT's step as ``--target`` or the devices at hand say and explains it;
    returns the result as plain data and the ``Explanation``."""
    for dest, default in {**TARGET_DEFAULTS, "plan": "fsdp"}.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    refuse(args)
    target = None
    if args.target is not None:
        target = load_target(args.target, args.memory_fraction, getattr(args, "network", None))
    accumulate, remat = 1, args.remat or "full"
    if args.plan == "auto":  # the ranking's pick, then its step explained
        picked, _, _ = plan_for_target(args)
        args.mesh = list(picked["mesh"].items())
        args.plan, remat, accumulate = picked["plan"], picked["remat"], picked["accumulate"]
    mesh = _mesh(args, target)
    axes, rows = data_rows(mesh)
    if args.batch is None:
        args.batch = 2 * rows
    if args.batch % rows:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the data axes "
            f"{' × '.join(axes)} = {rows} of mesh {dict(mesh.shape)}"
        )
    model, state, loss_fn, batch, _, what = gpt_for_target(args, remat)
    platform = target.platform if target is not None else jax.devices()[0].platform
    tp = gpt.plan(mesh, model, "tp") if MODEL_AXIS in mesh.shape else None
    plan = named_candidate(args.plan, mesh, model, plan_axis(axes), tp)
    precision = target_precision(args, platform)
    step = sx.make_train_step(
        loss_fn,
        mesh=mesh,
        plan=plan,
        accumulate=accumulate,
        precision=precision,
        data_axis=plan_axis(axes),
    )
    budget = None if args.device_memory is None else args.device_memory * 2**30
    variants = {r: gpt_for_target(args, r)[1] for r in REMATS}  # the fixes' remat policies
    tables = load_calibration(args.calibration, target) if target is not None else None
    try:
        with calibration.using(tables):
            report = sx.explain(step, state, batch, budget=budget, variants=variants)
    except ValueError as e:
        raise UsageError(f"--plan {args.plan} on mesh {dict(mesh.shape)}: {e}") from None
    result = {
        "target": None if target is None else target.name,
        "devices": int(mesh.devices.size),
        "device_kind": target.device_kind if target is not None else jax.devices()[0].device_kind,
        "model": f"{what}, remat {remat}",
        "plan": args.plan,
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
        "accumulate": accumulate,
        "batch": args.batch,
        "explain": report.to_dict(),
    }
    return result, report


def run(args: argparse.Namespace) -> int:
    """Prints the three tables (and the fixes, where the step does not fit)."""
    result, report = explained(args)
    if args.json:
        print_json(result)
        return 0
    out = console(args)
    where = result["target"] or f"{result['devices']} × {result['device_kind']} (this machine)"
    out.print(
        f"{result['model']}, batch {result['batch']}, plan [bold]{result['plan']}[/] "
        f"on {where}, mesh {result['mesh']}"
    )
    out.print(report)
    return 0
