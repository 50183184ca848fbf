"""``shardax plan --target``: the built-in GPT at any size, compiled for a cluster this
machine does not have ([`shardax.target`][shardax.target]), with its memory, predicted speed, plan
and launch command.

Example:
``shardax plan --target 64xH100 --layers 32 --d-model 4096 --heads 32 --seq-len 4096 --batch 256``
(``--plan auto``: the candidates, plans × remat policies (``REMATS``, or ``--remat``'s) ×
microbatch counts (``COUNTS``), plus pipeline over hosts and context parallelism where
they apply, are compiled, at most ``MAX_COMPILES`` and pruned as
``shardax.train.auto.compile_candidates`` does, and ranked by predicted step time among
those that fit with headroom). The model is abstract (``nnx.eval_shape``): nothing is
allocated. The mesh, unless ``--mesh`` is given: ``replica`` over the hosts (GPU hosts,
TPU slices) × ``data`` within one, so the plans include HSDP (FSDP within a host, data
parallel over hosts); ``--tp M`` splits each host into ``data × model=M`` for a
``fsdp+tp`` candidate; ``--plans a,b`` limits auto to those candidates. Every time and MFU
printed is a **prediction** (``shardax.cost.predict``), never a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from rich.console import Group

import shardax as sx
from shardax._format import format_bytes, titled_table
from shardax.cli.common import UsageError, console, print_json
from shardax.cost import calibration
from shardax.cost.accelerators import kind_of
from shardax.cost.calibration import Calibration
from shardax.cost.flops import transformer_flops_per_token
from shardax.mesh.axes import CONTEXT_AXIS, DATA_AXIS, MODEL_AXIS, REPLICA_AXIS, STAGE_AXIS
from shardax.models import gpt
from shardax.parallel.context import zigzag_layout
from shardax.parallel.gpipe import stage_mesh
from shardax.plan.named import MESH_PLANS
from shardax.train.auto import Layout, candidate_plans, launch_command, train_flags

TARGET_PLANS = ("auto", *MESH_PLANS, "hsdp", "fsdp+tp")
REMATS = ("none", "dots_no_batch", "full")
"""``--plan auto``'s remat policies without ``--remat``, least to most memory-saving."""
COUNTS = (1, 2, 4)
"""``--plan auto``'s microbatch counts (``--accumulate``), those dividing the rows per
data shard."""
DEFAULT_ROWS = 2
"""``--batch``'s default with ``--target``: this many sequences per data shard."""
LONG_SEQ = 8192
"""From this ``--seq-len`` on, ``--plan auto`` ranks a ``context`` candidate too."""
MAX_COMPILES = 24
"""At most this many candidates are compiled (an H100 GPT compile takes 10-25 s); the
rest are listed as not compiled."""
PLAN_RULES = {
    "pipeline": "it needs 2 or more hosts whose count divides --layers, and the batch "
    "rows per data shard divisible by the hosts",
    "context": f"it needs --seq-len >= {LONG_SEQ}, divisible by 2 x the context axis",
}


NOT_WITH_TARGET = {
    "measure": "which compiles the built-in model on the devices at hand; --target compiles "
    "the GPT for the target's devices",
    "params": "which sizes the GPT by --layers, --d-model, --heads, --seq-len and --vocab",
    "devices": "whose name gives the devices (their kind and count)",
    "hardware": "whose name gives the devices (their kind and count)",
    "microbatches": "whose --plan auto picks the pipeline's microbatches itself",
    "run_dir": "which writes no run directory (--json for the result, --png for the figure)",
    "hidden": "the MLP's width (--measure); the GPT's is --d-model",
}
"""Options of ``shardax plan`` that ``--target`` would ignore, and why: each is refused."""


def refuse_ignored(args: argparse.Namespace) -> None:
    """A usage error naming the first option ``--target`` would ignore: those of
    ``NOT_WITH_TARGET``, ``--plans`` beside a named ``--plan``, and ``--precision``
    beside ``--param-dtype bf16`` (which sets the precision itself)."""
    for dest, why in NOT_WITH_TARGET.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:
            shown = (
                "" if value is True else f" {value:g}" if isinstance(value, float) else f" {value}"
            )
            raise UsageError(f"--{dest.replace('_', '-')}{shown}: not with --target, {why}")
    if args.memory_fraction is not None and args.device_memory is not None:
        raise UsageError(
            f"--memory-fraction {args.memory_fraction:g}: not with --device-memory "
            f"{args.device_memory:g}, the budget the plan must fit in place of the fraction's "
            "share of each device's memory; give one of them"
        )
    if args.plans is not None and args.plan != "auto":
        raise UsageError(
            f"--plans {','.join(args.plans)}: only with --plan auto (the candidates it "
            f"ranks), got --plan {args.plan}"
        )
    if args.param_dtype == "bf16" and args.precision is not None:
        raise UsageError(
            f"--precision {args.precision}: not with --param-dtype bf16, which keeps params "
            "and Adam's moments in bf16 and computes in bf16; give one of them"
        )
    if args.tp is not None and args.tp > 1 and args.mesh:
        mesh = ",".join(f"{k}={v}" for k, v in args.mesh)
        raise UsageError(
            f"--tp {args.tp}: not with --mesh {mesh}, which gives the whole mesh; add "
            f"model={args.tp} to --mesh instead"
        )
    if args.tp is not None and args.tp > 1 and args.plan not in (None, "auto", "fsdp+tp"):
        raise UsageError(
            f"--tp {args.tp}: only with --plan fsdp+tp, or --plan auto (which ranks a fsdp+tp "
            f"candidate); --plan {args.plan} splits no weight over the model axis, so its "
            f"{args.tp} devices per group would repeat each other's work"
        )
    if args.png:
        check_png(args.png)


def check_png(path: str) -> None:
    """``--png``'s file checked before anything compiles: not a directory, in an existing
    directory this user can write (the figure is saved there, no directory made)."""
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise UsageError(f"--png {path}: is a directory; name a file such as memory.png")
    parent = target.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"--png {path}: cannot write it, {parent} {why}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--png {path}: cannot write it, {parent} is not writable")


def load_target(name: str, memory_fraction: float | None = None, network: str | None = None) -> Any:
    """``sx.target(name, memory_fraction=..., network=...)``; its errors (unknown name or
    network, missing extra, JAX 0.10, a fraction out of range or for a TPU) as one-line
    usage errors."""
    try:
        return sx.target(name, memory_fraction=memory_fraction, network=network)
    except (ValueError, ImportError, RuntimeError, NotImplementedError) as e:
        first = " ".join(str(e).split())
        option = f"--target {name}"
        if memory_fraction is not None and "memory_fraction" in first:
            option += f" --memory-fraction {memory_fraction:g}"
        if network is not None and "network" in first:
            option = f"--network {network}"
        raise UsageError(f"{option}: {first}") from None


def load_calibration(path: str | None, target: Any) -> Calibration | None:
    """``--calibration FILE``'s tables (None without it), checked against the target: a
    GPU target of the kind they were measured on."""
    if path is None:
        return None
    try:
        tables = calibration.load(path)
    except ValueError as e:
        said = str(e).replace(f"calibration {str(path)!r}", f"--calibration {path}", 1)
        raise UsageError(said) from None
    if target.platform != "gpu":
        raise UsageError(
            f"--calibration {path}: {target.name} is a TPU target, priced by its "
            "roofline; calibrations are GPU kernel tables"
        )
    if kind_of(target.device_kind) != tables.kind:
        raise UsageError(
            f"--calibration {path}: measured on {tables.device} ({tables.kind}), and "
            f"{target.name}'s GPUs are {target.device_kind}: tables price their own kind's "
            "kernels only"
        )
    return tables


def default_mesh(target: Any, tp: int) -> dict[str, int]:
    """``replica`` over the hosts (GPU) or slices (TPU) and ``data`` (× ``model=tp``)
    within one; one axis ``data`` when there is a single host or slice."""
    groups = target.hosts if target.platform == "gpu" else target.slices
    within = len(target.devices) // groups
    if within % tp:
        raise UsageError(f"--tp {tp} must divide the {within} devices of a host")
    spec = {REPLICA_AXIS: groups} if groups > 1 else {}
    spec[DATA_AXIS] = within // tp
    if tp > 1:
        spec[MODEL_AXIS] = tp
    return spec


def gpt_for_target(
    args: argparse.Namespace, remat: str, pipeline: int | None = None, layout: str = "contiguous"
) -> tuple[Any, Any, Any, Any, float, str]:
    """The GPT (abstract) with ``remat`` (and ``sx.pipeline`` in ``pipeline``
    microbatches), its abstract train state, loss (the sequence laid out ``layout``),
    batch, model FLOPs and text."""
    layers = args.layers or 2
    try:
        cfg = gpt.GPTConfig(
            layers,
            args.d_model,
            args.heads,
            args.seq_len,
            vocab=args.vocab,
            scan_layers=True,
            pipeline_microbatches=pipeline,
        )
    except (TypeError, ValueError) as e:
        raise UsageError(f"--layers/--d-model/--heads/--seq-len/--vocab: {e}") from None

    def make() -> Any:
        return gpt.make_gpt(cfg, 0, remat=remat)

    model = nnx.eval_shape(make)
    state = nnx.eval_shape(lambda: sx.TrainState.create(make(), optax.adam(1e-4)))

    def loss_fn(m: Any, b: dict[str, Any]) -> Any:
        logits = m(b["inputs"], layout=layout).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    n = gpt.param_count(model, embeddings=False)
    per_token = transformer_flops_per_token(n, layers, args.seq_len, args.d_model)
    size = gpt.param_count(model) / 1e9
    what = (
        f"gpt {layers} x {args.d_model} ({args.heads} heads), seq {args.seq_len}, "
        f"vocab {args.vocab}, {size:.3g} B params"
    )
    return model, state, loss_fn, {"inputs": tokens, "targets": tokens}, per_token, what


def target_precision(args: argparse.Namespace, platform: str) -> Any:
    """``--param-dtype bf16``: params and moments in bf16; else ``--precision``, by
    default what ``shardax train`` takes on the target's platform (bf16 for the GPT on a
    GPU or TPU)."""
    from shardax.cli.train import default_precision  # another command's module: --target only

    if args.param_dtype == "bf16":  # params and Adam's moments in bf16: 6 bytes/param
        return sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    return args.precision or default_precision("gpt", platform)


def data_rows(mesh: Any) -> tuple[tuple[str, ...], int]:
    """The mesh's batch axes (replica, data) and the data shards they make."""
    axes = tuple(a for a in (REPLICA_AXIS, DATA_AXIS) if a in mesh.shape)
    return axes, math.prod(mesh.shape[a] for a in axes)


def plan_axis(axes: tuple[str, ...]) -> Any:
    """The data axis a plan shards over: the batch axes, or ``data`` alone."""
    return axes if len(axes) > 1 else DATA_AXIS


def _counts(rows: int) -> tuple[int, ...]:
    """The microbatch counts of ``COUNTS`` that divide ``rows`` per data shard."""
    return tuple(k for k in COUNTS if rows % k == 0)


def _pipeline_group(args: argparse.Namespace, target: Any, remats: tuple[str, ...]) -> Any:
    """``pipeline`` over hosts: a ``stage`` axis over the target's hosts (GPU hosts, TPU
    slices) × ``data`` within one, the GPT's blocks run by ``sx.pipeline`` in the most
    microbatches of 4S, 2S, S that divide the rows per data shard; None where it does
    not apply (one host, layers not divisible by the hosts, no such count)."""
    stages = target.hosts if target.platform == "gpu" else target.slices
    layers = args.layers or 2
    if stages < 2 or layers % stages:
        return None
    mesh = sx.make_mesh(
        {STAGE_AXIS: stages, DATA_AXIS: len(target.devices) // stages}, devices=target
    )
    if args.batch % mesh.shape[DATA_AXIS]:
        return None
    rows = args.batch // mesh.shape[DATA_AXIS]
    for micro in (4 * stages, 2 * stages, stages):
        if rows % micro:
            continue
        models = {r: gpt_for_target(args, r, pipeline=micro)[:3] for r in remats}
        model = next(iter(models.values()))[0]
        x = jax.ShapeDtypeStruct((args.batch, args.seq_len, args.d_model), "float32")
        try:
            with jax.sharding.set_mesh(mesh):
                stage_mesh(model.layers()[1], x, micro, STAGE_AXIS)
            plan = gpt.plan(mesh, model, "pipeline")
        except ValueError:
            continue
        return Layout(
            mesh,
            plans={"pipeline": plan},
            model=_states(models),
            loss_fn=_loss(models),
            accumulate=1,
            microbatches=micro,
        )
    return None


def _context_group(args: argparse.Namespace, target: Any, remats: tuple[str, ...]) -> Any:
    """``context``: for sequences of ``LONG_SEQ`` tokens or more, a ``context`` axis
    of C devices within a host (C the smallest power of two that leaves at most
    LONG_SEQ / 2 tokens per device, at least 2), the GPT's context-parallel attention,
    FSDP over ``data`` as ``shardax train --plan fsdp``; None where it does not apply."""
    within = len(target.devices) // (target.hosts if target.platform == "gpu" else target.slices)
    groups = len(target.devices) // within
    c = 2
    while args.seq_len // c > LONG_SEQ // 2 and within % (2 * c) == 0:
        c *= 2
    if args.seq_len < LONG_SEQ or within % c or args.seq_len % (2 * c):
        return None
    spec = {REPLICA_AXIS: groups} if groups > 1 else {}
    spec.update({DATA_AXIS: within // c, CONTEXT_AXIS: c})
    mesh = sx.make_mesh(spec, devices=target)
    _, rows = data_rows(mesh)
    if args.batch % rows:
        return None
    models = {r: gpt_for_target(args, r, layout=zigzag_layout(c))[:3] for r in remats}
    plan = gpt.plan(mesh, next(iter(models.values()))[0], "fsdp")
    return Layout(
        mesh,
        plans={"context": plan},
        model=_states(models),
        loss_fn=_loss(models),
        accumulate=_counts(args.batch // rows),
    )


def _layouts(args: argparse.Namespace, target: Any, mesh: Any, tp: Any) -> list[Any]:
    """The candidates of ``--plan auto``: the plans on ``mesh``, then (without
    ``--mesh``) pipeline over hosts and context parallelism where they apply; each
    × the remat policies × the microbatch counts. ``--plans`` keeps those named."""
    remats = (args.remat,) if args.remat else REMATS
    axes, rows = data_rows(mesh)
    names = args.plans
    extra = ("pipeline", "context")
    groups = []
    main = [n for n in names if n not in extra] if names else None
    if main is None or main:
        plans = _candidates(main, mesh, plan_axis(axes), tp)
        models = {r: gpt_for_target(args, r)[:3] for r in remats}
        groups.append(
            Layout(
                mesh,
                plans=plans,
                model=_states(models),
                loss_fn=_loss(models),
                accumulate=_counts(args.batch // rows),
            )
        )
    if not args.mesh:
        for name, build in (("pipeline", _pipeline_group), ("context", _context_group)):
            if names and name not in names:
                continue
            group = build(args, target, remats)
            if group is None and names:
                raise UsageError(
                    f"--plans {','.join(names)}: {name} does not apply to {target.name} "
                    f"with --layers {args.layers or 2} --seq-len {args.seq_len} --batch "
                    f"{args.batch} ({PLAN_RULES[name]})"
                )
            if group is not None:
                groups.append(group)
    elif names and any(n in extra for n in names):
        raise UsageError(
            f"--plans {','.join(names)}: pipeline and context build their own mesh; drop "
            "--mesh to rank them"
        )
    return groups


def _states(models: dict[str, tuple[Any, Any, Any]]) -> dict[str, Any]:
    return {remat: state for remat, (_, state, _) in models.items()}


def _loss(models: dict[str, tuple[Any, Any, Any]]) -> Any:
    return next(iter(models.values()))[2]


def rank(
    args: argparse.Namespace, target: Any, mesh: Any, tp: Any, precision: Any, figures: Any
) -> Any:
    """The library's search ([`shardax.search_plans`][shardax.search_plans]) over the
    GPT's layouts, at most ``MAX_COMPILES`` compiles; returns its report."""
    layouts = _layouts(args, target, mesh, tp)
    budget = None if args.device_memory is None else args.device_memory * 2**30
    config = sx.train.StepConfig(mesh=mesh, precision=precision)
    space = sx.SearchSpace(
        meshes=layouts, config=config, device_memory=budget, max_compiles=MAX_COMPILES
    )
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    first = layouts[0]
    return sx.search_plans(space, first.model, loss_fn=first.loss_fn, batch=batch, **figures)


def plan_for_target(args: argparse.Namespace) -> tuple[dict[str, Any], Any, Any]:
    """Compiles and estimates; returns the result as plain data, the estimate and the
    auto report (None for a named plan)."""
    refuse_ignored(args)
    if args.model not in (None, "gpt"):
        raise UsageError(f"--target plans the built-in GPT; got --model {args.model}")
    target = load_target(args.target, args.memory_fraction, getattr(args, "network", None))
    tables = load_calibration(args.calibration, target)
    spec = dict(args.mesh) if args.mesh else default_mesh(target, args.tp)
    try:
        mesh = sx.make_mesh(spec, devices=target)
    except ValueError as e:
        raise UsageError(f"--mesh {spec}: {e}") from None
    if DATA_AXIS not in mesh.shape:
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {dict(mesh.shape)}")
    data_axes, rows = data_rows(mesh)
    if args.batch is None:  # the default: DEFAULT_ROWS sequences per data shard
        args.batch, args.batch_default = DEFAULT_ROWS * rows, True
    if args.batch % rows:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the data axes "
            f"{' × '.join(data_axes)} = {rows} of mesh {dict(mesh.shape)}"
        )
    remat = args.remat or "full"
    model, state, loss_fn, batch, per_token, what = gpt_for_target(args, remat)
    params = gpt.param_count(model)
    precision = target_precision(args, target.platform)
    axis: Any = plan_axis(data_axes)
    tp = gpt.plan(mesh, model, "tp") if MODEL_AXIS in mesh.shape else None

    figures = {
        "model_flops": per_token * args.batch * args.seq_len,
        "model_flops_note": "6N + attention, causal halved",
    }
    report, rank_s, microbatches = None, 0.0, None
    try:
        with calibration.using(tables):
            if args.plan == "auto":
                start = time.perf_counter()
                report = rank(args, target, mesh, tp, precision, figures)
                rank_s = time.perf_counter() - start
                est, name, remat = report.estimate, report.name, report.variant
                mesh, microbatches, flags = (
                    report.candidate.mesh,
                    report.candidate.microbatches,
                    report.flags,
                )
            else:
                plan, name = named_candidate(args.plan, mesh, model, axis, tp), args.plan
                step = sx.make_train_step(
                    loss_fn, mesh=mesh, plan=plan, precision=precision, data_axis=axis
                )
                est = sx.estimate(step, state, batch, **figures)
                flags = train_flags(name, dict(mesh.shape), remat)
    except ValueError as e:
        raise UsageError(
            f"--plan {args.plan} on {args.target}, mesh {dict(mesh.shape)}: {e}"
        ) from None
    if args.device_memory is not None:  # the user's budget, as the ranking's
        note = f"--device-memory {args.device_memory:g}"
        est = dataclasses.replace(est, memory_budget=args.device_memory * 2**30, budget_note=note)
    train = (
        f"shardax train --model gpt --layers {args.layers or 2} --d-model {args.d_model} "
        f"--heads {args.heads} --seq-len {args.seq_len} --batch-size {args.batch} "
        f"{flags}"
    )
    result = {
        "target": target.name,
        "device_kind": target.device_kind,
        "devices": len(target.devices),
        "hosts": target.hosts,
        "slices": target.slices,
        "model": f"{what}, remat {remat}",
        "params": params,
        "batch": args.batch,
        "batch_default": bool(getattr(args, "batch_default", False)),
        "precision": str(precision) if not isinstance(precision, str) else precision,
        "plan": name if report is None else report.name,
        "remat": remat,
        "accumulate": 1 if report is None else report.accumulate,
        "microbatches": microbatches,
        "mesh": dict(mesh.shape),
        "fits_with_headroom": est.fits,
        "memory_fraction": target.memory_fraction,
        "mesh_flags": flags,
        "launch": launch_command(target.devices, train),
        "estimate": est.to_dict(),
        "auto": None,
    }
    if report is not None:
        result["auto"] = {
            **report.to_dict(),
            "reasons": report.reasons(),
            "compiles": sum(not c.skipped for c in report.candidates),
            "rank_s": round(rank_s, 1),
        }
    return result, est, report


def _candidates(names: list[str] | None, mesh: Any, axis: Any, tp: Any) -> Any:
    """``--plans a,b``: those of ``shardax.train.auto.candidate_plans`` (None: all)."""
    plans = candidate_plans(mesh, axis, tp_rules=tp)
    if not names:
        return plans
    unknown = [n for n in names if n not in plans]
    if unknown:
        raise UsageError(
            f"--plans {','.join(names)}: {', '.join(unknown)} not among the candidates for "
            f"mesh {dict(mesh.shape)}: {', '.join(plans)}, pipeline, context"
        )
    return {n: plans[n] for n in names}


def named_candidate(name: str, mesh: Any, model: Any, axis: Any, tp: Any) -> Any:
    """The candidate ``name`` of ``shardax.train.auto.candidate_plans``."""
    plans = candidate_plans(mesh, axis, tp_rules=tp)
    if name not in plans:
        raise UsageError(
            f"--plan {name} is not a candidate on mesh {dict(mesh.shape)}: "
            f"{', '.join(plans)} (hsdp needs hosts or a replica axis; fsdp+tp needs --tp)"
        )
    return plans[name]


TARGET_DEFAULTS = {"plan": "auto", "vocab": 32000, "tp": 1, "param_dtype": "fp32"}
"""The ``--target`` options' defaults (None on the parser, so that ``shardax plan``
without ``--target`` can refuse them by name)."""


def run(args: argparse.Namespace) -> int:
    """Prints the ranking (``--plan auto``), the estimate, the flags and the launch."""
    for dest, default in TARGET_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    out = console(args)
    result, est, report = plan_for_target(args)
    if args.png:
        est.plot(args.png)
        result["png"] = str(args.png)
    if args.json:
        print_json(result)
        return 0
    if result["batch_default"]:
        out.print(
            f"--batch {result['batch']}: the default, {DEFAULT_ROWS} sequences per data "
            "shard (give --batch for yours)"
        )
    if report is not None:
        out.print(candidates_table(report))
        auto = result["auto"]
        out.print(
            f"{auto['compiles']} of {len(report.candidates)} candidates compiled in "
            f"{auto['rank_s']:.0f} s (at most {MAX_COMPILES}; the others could not "
            "win or are over the limit)"
        )
    if args.roofline:
        out.print(est)
    out.print(f"model: {result['model']}", soft_wrap=True, markup=False)
    out.print(headline(est), soft_wrap=True)
    out.print(
        f"plan: [bold]{result['plan']}[/] on {result['target']}; mesh flags: "
        f"[bold]{result['mesh_flags']}[/]"
    )
    if not args.roofline:
        out.print("(--roofline: the whole estimate, memory by component and every table)")
    if est.fits is False:
        raise_it = " raise --memory-fraction," if result["memory_fraction"] else ""
        out.print(
            f"[red]does not fit[/] with 10% of its memory budget to spare "
            f"({est.budget_note}): shrink --batch, remat more,{raise_it} or add devices "
            "before launching"
        )
    out.print(f"launch: {result['launch']}", soft_wrap=True, markup=False)
    if args.png:
        out.print(f"wrote {args.png}", soft_wrap=True, markup=False)
    return 0


def _ms(seconds: float | None) -> str:
    """``0.01234`` -> ``'12.3'``: milliseconds, three significant figures."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g}"


def _interval_ms(c: Any) -> str:
    """A candidate's (or estimate's) predicted step in ms, with its interval."""
    low_high = c.interval_s
    point = _ms(c.predicted_s)
    return point if low_high is None else f"{point} ({_ms(low_high[0])}-{_ms(low_high[1])})"


def candidates_table(report: Any) -> Any:
    """The ranked candidates: one row per compiled one (plan, peak and bytes sent per
    device, fits, predicted step in ms with its interval, why it ranks there), and the
    pruned ones folded into one line by reason."""
    why = report.reasons()
    table = titled_table(f"candidate plans, {report.compiled} compiled, per device")
    for col in ("plan", "peak", "sent", "fits", "predicted step ms (interval)", "why"):
        left = col in ("plan", "why")
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "why")
    pruned: dict[tuple[bool, str], list[str]] = {}
    for c in report.candidates:
        if c.skipped:  # "fsdp·none·mb1 fits; more microbatches only add work": by its rule
            head, sep, rule = c.skipped.partition("; ")
            key = (True, rule) if sep and head.endswith(" fits") else (False, c.skipped)
            pruned.setdefault(key, []).append(c.name)
            continue
        fits = {None: "?", True: "yes", False: "[red]no[/]"}[c.fits]
        name = f"[bold]{c.name}[/]" if c.name == report.name else c.name
        table.add_row(
            name,
            format_bytes(c.total_bytes),
            format_bytes(c.collective_bytes),
            fits,
            _interval_ms(c),
            why[c.name],
        )
    table.caption = f"pick: {report.name}: {report.reason}"
    lines = []
    for (by_rule, reason), names in pruned.items():
        if by_rule:  # one line for every plan: its candidate compiled above fits
            plans = ", ".join(dict.fromkeys(n.split("·")[0] for n in names))
            lines.append(
                f"not compiled ({len(names)}): candidates of {plans} beside the one "
                f"of each that fits with headroom above; {reason}"
            )
        else:
            lines.append(f"not compiled ({len(names)}): {', '.join(names)}: {reason}")
    return Group(table, *lines)


def headline(est: Any) -> str:
    """The pick's prediction in one line: the step in ms with its interval (the per-op
    model's on a GPU target), tokens/s, MFU against the datasheet peak, the memory peak
    against the budget."""
    step = est.predicted_s
    if step is None:
        return f"PREDICTED step: n/a (no datasheet or calibration for {est.device_kind})"
    per_device = est.model_flops / est.devices / step
    peak = None if est.roofline is None else est.roofline.peak_flops
    mfu = "" if not peak else f", MFU {per_device / peak:.1%}"
    room = "" if est.headroom is None else f", {est.headroom:.0%} of the memory budget free"
    return (
        f"PREDICTED (not measured) step: [bold]{_interval_ms(est)} ms[/], "
        f"{est.tokens / step:,.0f} {est.unit}/s{mfu}; peak "
        f"{format_bytes(est.memory['peak'])} per device{room}"
    )
