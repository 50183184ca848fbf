"""The seam between ``shardax train`` and its jobs: what a job is, and what every job uses.

A job (``shardax.cli.train_mlp``, ``shardax.cli.train_gpt``) registers itself
with ``register`` under its ``--model`` name, declaring its own options
(``option``: flag, default, ``argparse`` keywords), its defaults for the shared ones
and the plans it builds, and builds a ``Job``: its mesh, placed state, step,
batches and evaluation. The command (``shardax.cli.train``) builds its parser from
the declarations (``add_job_arguments``), refuses an option or plan the chosen job
does not take (``check_model_options``), fills in the job's defaults
(``apply_options``), builds the job and hands it to the loop
(``shardax.cli.loop``). This module imports neither the loop nor the jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

import shardax as sx
from shardax.cli.common import UsageError, check_batch_divides
from shardax.mesh.axes import DATA_AXIS, MODEL_AXIS, REPLICA_AXIS, STAGE_AXIS
from shardax.train.stats import STATS

MakeJob = Callable[[argparse.Namespace, Any], "Job"]


@dataclasses.dataclass(frozen=True)
class Option:
    """An option only some jobs take: its flag, its default and ``argparse``'s keywords.

    The parser gives it ``default=None``, so that an option given is told from one left
    out; the job's ``default`` is filled in once the job is chosen (``apply_options``).
    """

    flag: str
    default: Any = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dest(self) -> str:
        """The ``argparse`` attribute, e.g. ``"seq_len"`` for ``--seq-len``."""
        return self.flag.removeprefix("--").replace("-", "_")


def option(flag: str, default: Any = None, **kwargs: Any) -> Option:
    """An ``Option``: ``option("--steps", 200, type=positive_int, help="...")``.

    >>> option("--seq-len", 64).dest
    'seq_len'
    """
    return Option(flag, default, kwargs)


@dataclasses.dataclass(frozen=True)
class Registered:
    """A job under its ``--model`` name: its builder, the options only it and the jobs
    declaring them take, its defaults for the command's shared options (``batch_size``,
    ``lr``), the ``--plan`` names it builds, and the modules it needs beyond shardax's
    dependencies, each with the extra that installs it (``{"sklearn": "demo"}``)."""

    make: MakeJob
    options: tuple[Option, ...]
    defaults: dict[str, Any]
    plans: tuple[str, ...]
    needs: dict[str, str] = dataclasses.field(default_factory=dict)


JOBS: dict[str, Registered] = {}
"""The registered jobs, by ``--model`` name, in registration order."""


def register(
    name: str,
    options: tuple[Option, ...] = (),
    defaults: dict[str, Any] | None = None,
    plans: tuple[str, ...] = (),
    needs: dict[str, str] | None = None,
) -> Callable[[MakeJob], MakeJob]:
    """Registers ``make_job(args, console) -> Job`` as ``shardax train --model name``.

    ``options`` are the job's own options (``option``): the parser adds them, and
    giving one to a job that does not declare it is a usage error naming the option and
    the jobs that take it. ``defaults`` fill the command's shared options left out
    (``{"batch_size": 16}``); ``plans`` are the ``--plan`` names the job builds;
    ``needs`` the modules it imports beyond shardax's dependencies, by the extra that
    installs each (checked before the job is built: ``shardax.cli.train``)."""

    def decorate(make: MakeJob) -> MakeJob:
        JOBS[name] = Registered(
            make, tuple(options), dict(defaults or {}), tuple(plans), dict(needs or {})
        )
        return make

    return decorate


def job_options() -> dict[str, Option]:
    """Every job's options by ``dest``, each once; one flag declared twice must be
    declared alike (the parser has one ``--flag``)."""
    out: dict[str, Option] = {}
    for model, job in JOBS.items():
        for opt in job.options:
            seen = out.setdefault(opt.dest, opt)
            if seen.kwargs != opt.kwargs:
                raise ValueError(f"{opt.flag} is declared differently by --model {model}")
    return out


def takers(dest: str) -> list[str]:
    """The ``--model`` names whose job declares the option ``dest``."""
    return [m for m, job in JOBS.items() if any(o.dest == dest for o in job.options)]


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The jobs' own options, one ``--model NAME`` group each (an option several jobs
    take is in the first one's group), every default None (the jobs' come later)."""
    added: set[str] = set()
    job_options()  # one declaration per flag
    for model, job in JOBS.items():
        group = parser.add_argument_group(f"--model {model}")
        for opt in job.options:
            if opt.dest not in added:
                added.add(opt.dest)
                kwargs = dict(opt.kwargs)
                if opt.default not in (None, False) and "help" in kwargs:
                    kwargs["help"] += f" (default: {opt.default})"
                group.add_argument(opt.flag, default=None, **kwargs)


def plan_names() -> tuple[str, ...]:
    """``--plan``'s choices: every job's plans, each once, in registration order."""
    return tuple(dict.fromkeys(p for job in JOBS.values() for p in job.plans))


def check_model_options(args: argparse.Namespace) -> None:
    """An option of another job is an error (it would be silently ignored), and so is a
    ``--plan`` the job does not build."""
    own = {o.dest for o in JOBS[args.model].options}
    for dest, opt in job_options().items():
        if dest not in own and getattr(args, dest, None) is not None:
            models = ", ".join(takers(dest))
            raise UsageError(f"{opt.flag}: only for --model {models}, got --model {args.model}")
    plans = JOBS[args.model].plans
    if args.plan not in plans:
        models = ", ".join(m for m, job in JOBS.items() if args.plan in job.plans)
        raise UsageError(
            f"--plan {args.plan}: only for --model {models}; --model {args.model} takes "
            f"{', '.join(plans)}"
        )
    gather = getattr(args, "zero_gather", "update")
    if gather != "update" and args.plan not in ("zero1", "zero2"):
        raise UsageError(
            f"--zero-gather {gather}: only with --plan zero1 or zero2, got --plan {args.plan}"
        )
    if args.save_every is not None and args.checkpoint_dir is None:
        raise UsageError(f"--save-every {args.save_every} needs --checkpoint-dir")


def apply_options(args: argparse.Namespace) -> None:
    """Fills in the chosen job's defaults: its own options' and the shared ones' it sets."""
    job = JOBS[args.model]
    defaults = {**{o.dest: o.default for o in job.options}, **job.defaults}
    for dest, value in defaults.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


def make_mesh(args: argparse.Namespace) -> Any:
    """The mesh of ``--mesh`` (default: ``data`` over every device, plus ``model=2`` for
    a TP plan), or the first device for ``--mode single``."""
    if args.mode == "single":
        if args.mesh is not None or args.plan != "replicate":
            raise UsageError("--mode single runs on one device: drop --mesh and --plan")
        return sx.make_mesh({DATA_AXIS: 1}, devices=jax.devices()[:1])
    tp = "tp" in args.plan.split("+")
    spec = args.mesh or ([(DATA_AXIS, -1), (MODEL_AXIS, 2)] if tp else [(DATA_AXIS, -1)])
    if args.plan == "pipeline" and args.mesh is None:
        spec = [(DATA_AXIS, -1), (STAGE_AXIS, 2)]
    if DATA_AXIS not in dict(spec):
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {args.mesh}")
    try:
        return sx.make_mesh(spec)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None


def data_axes(mesh: Any) -> str | tuple[str, str]:
    """The axes the batch splits over: ``data``, or ``("replica", "data")`` on an HSDP
    mesh (``--mesh replica=HOSTS,data=8 --plan fsdp``: FSDP within a host, data parallel
    over the hosts)."""
    return (REPLICA_AXIS, DATA_AXIS) if REPLICA_AXIS in mesh.shape else DATA_AXIS


def data_size(mesh: Any) -> int:
    """The number of batch shards: the product of ``data_axes``' sizes."""
    axes = data_axes(mesh)
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def check_batch_fits(args: argparse.Namespace, mesh: Any) -> None:
    """The global batch must split evenly over the data axis; the error names both sizes
    and the ways out (a resumed run keeps its batch size, so only the mesh can change)."""
    size, batch = data_size(mesh), args.batch_size
    if batch % size == 0:
        check_batch_divides(batch, size, args.accumulate)  # and the microbatches
        return
    fits = [d for d in range(mesh.size, 0, -1) if batch % d == 0 and mesh.size % d == 0]
    meshes = ", ".join(
        f"data={d}" + (f",model={mesh.size // d}" if d < mesh.size else "") for d in fits[:3]
    )
    if args.resume:
        way = (
            f"a resumed run keeps the checkpoint's global batch (its data position counts "
            f"batches of {batch}), so pass a --mesh whose data axis divides {batch} on these "
            f"{mesh.size} devices ({meshes}), or run on a device count it divides"
        )
    else:
        way = (
            f"pass a --batch-size that is a multiple of {size}, or a --mesh whose data "
            f"axis divides {batch} ({meshes})"
        )
    raise UsageError(
        f"--batch-size {batch} is not divisible by the data axis size {size} of mesh "
        f"{dict(mesh.shape)}; {way}"
    )


def job_mesh(
    args: argparse.Namespace, rules: Callable[[Any], Any] = lambda mesh: None
) -> tuple[Any, int, Any]:
    """A job's mesh (``make_mesh``), its number of batch shards (``data_size``) and what
    ``rules(mesh)`` returns: the job's own checks of its options against the mesh (the
    GPT's pipeline and config), made before the global batch is checked to split evenly
    over the shards (``check_batch_fits``)."""
    mesh = make_mesh(args)
    checked = rules(mesh)
    size = data_size(mesh)
    check_batch_fits(args, mesh)
    return mesh, size, checked


def eval_batch(mesh: Any, batch: Any, seq_axis: str | None = None) -> Any:
    """A held-out ``batch`` placed as the steps place theirs: its rows over ``data_axes``
    (and its sequences over ``seq_axis``, the eval step's)."""
    return sx.distribute_batch(batch, sx.batch_sharding(mesh, data_axes(mesh), seq_axis=seq_axis))


@dataclasses.dataclass
class Job:
    """What a model brings to the shared loop.

    Attributes:
        title: what is trained, e.g. "an MLP on digits" (printed, and the plot's title).
        mesh: the mesh.
        state: the placed train state.
        step: the ``sx.make_train_step`` step.
        loader: an iterator of process-local batches with ``get_state()``/``set_state()``.
        steps: total steps of the run.
        eval_every: steps between evaluations (and default checkpoints).
        evaluate: ``state -> {name: float}`` on the held-out data.
        records: ``(first step, per-step metrics as floats, evaluation, seconds) ->``
            history entries (each with ``step``) for the steps since the last evaluation.
        unit: what ``items_per_step`` counts ("examples" or "tokens").
        items_per_step: examples or tokens in one global batch.
        progress: ``metrics -> str`` shown on the progress bar.
        summary: ``common summary -> job-specific entries`` (added to it).
        estimate_flops: a FLOPs-per-step estimate from the model's sizes, if it has one.
        plot: ``(summary, path) ->`` writes ``curves.png``.
        report: ``(summary, console) ->`` prints the result.
    """

    title: str
    mesh: Any
    state: Any
    step: Any
    loader: Any
    steps: int
    eval_every: int
    evaluate: Callable[[Any], dict[str, float]]
    records: Callable[[int, list[dict[str, float]], dict[str, float], float], list[dict]]
    unit: str
    items_per_step: int
    progress: Callable[[dict[str, float]], str]
    summary: Callable[[dict[str, Any]], dict[str, Any]] = lambda common: {}
    estimate_flops: float | None = None
    plot: Callable[[dict[str, Any], Path], None] | None = None
    report: Callable[[dict[str, Any], Any], None] | None = None


def build_steps(
    args: argparse.Namespace, loss_fn: Any, mesh: Any, plan: Any, seq_axis: str | None = None
) -> tuple[Any, Any]:
    """The train step (``sx.make_train_step``) and its no-update twin for validation
    (``sx.make_eval_step``, the model in inference mode), with the CLI's mode,
    accumulation and precision (and ``seq_axis`` under ``--mode jit``: the batch's
    sequences split over it); bad combinations are usage errors naming the options."""
    plan = None if args.mode == "single" else plan  # one device: no sharding plan
    gather = getattr(args, "zero_gather", "update")
    if gather != "update" and plan is not None:  # --plan zero1/zero2 (check_model_options)
        plan = dataclasses.replace(plan, gather=gather)
    seq_axis = seq_axis if args.mode == "jit" else None
    try:
        # The CLI logs every update statistic, param norm included, computed only on the
        # steps it logs (--log-every): the other steps pay nothing for them.
        step = sx.make_train_step(
            loss_fn,
            mesh=mesh,
            plan=plan,
            mode=args.mode,
            accumulate=args.accumulate,
            precision=args.precision,
            data_axis=data_axes(mesh),
            stats=STATS,
            stats_every=args.log_every,
            seq_axis=seq_axis,
        )
        # The eval step: the train step's settings, the whole batch at once.
        evaluate = dataclasses.replace(step.config.for_eval(), accumulate=1)
        return step, sx.train.EvalStep(loss_fn, evaluate)
    except ValueError as e:
        raise UsageError(f"--plan {args.plan} --mode {args.mode}: {e}") from None


def place(args: argparse.Namespace, step: Any, state: Any) -> Any:
    """``step.shard(state)``, a bad plan/mode/mesh combination being a usage error."""
    try:
        return step.shard(state)
    except ValueError as e:
        raise UsageError(
            f"--plan {args.plan} --mode {args.mode} on mesh {dict(step.mesh.shape)}: {e}"
        ) from None
