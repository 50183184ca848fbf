"""``shardax plan --target``: the built-in GPT at any size, compiled for a cluster this
machine does not have (:func:`shardax.target`), with its memory, predicted speed, plan
and launch command.

Example: ``shardax plan --target 64xH100 --layers 32 --d-model 4096 --heads 32 --seq-len
4096 --batch 256`` (``--plan auto``: the candidates are compiled and ranked by predicted
step time among those that fit with headroom). The model is abstract
(``nnx.eval_shape``): nothing is allocated. The mesh, unless ``--mesh`` is given:
``replica`` over the hosts (GPU hosts, TPU slices) × ``data`` within one, so the plans
include HSDP (FSDP within a host, data parallel over hosts); ``--tp M`` splits each host
into ``data × model=M`` for a ``fsdp+tp`` candidate; ``--plans a,b`` limits auto to
those candidates. Every time and MFU printed is a
**prediction** (:mod:`shardax.cost.predict`), never a measurement.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardax.cli.common import UsageError, console, print_json
from shardax.mesh.axes import DATA_AXIS, MODEL_AXIS, REPLICA_AXIS
from shardax.plan.named import MESH_PLANS

TARGET_PLANS = ("auto", *MESH_PLANS, "hsdp", "fsdp+tp")


def load_target(name: str) -> Any:
    """``sx.target(name)``; its errors (unknown name, missing extra, JAX 0.10) as one-line
    usage errors."""
    import shardax as sx

    try:
        return sx.target(name)
    except (ValueError, ImportError, RuntimeError, NotImplementedError) as e:
        first = " ".join(str(e).split())
        raise UsageError(f"--target {name}: {first}") from None


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


def train_flags(plan: str, mesh: dict[str, int]) -> str:
    """The ``shardax train`` flags of ``plan`` on ``mesh``: ``hsdp`` is ``--plan fsdp`` on
    a mesh with a replica axis (the GPT's FSDP splits over ``data`` only); ``fsdp`` (over
    every data axis) and the ZeRO plans fold the replica axis into ``data``."""
    mesh = dict(mesh)
    if plan != "hsdp" and REPLICA_AXIS in mesh:
        mesh[DATA_AXIS] = mesh.pop(REPLICA_AXIS) * mesh[DATA_AXIS]
        mesh = {DATA_AXIS: mesh.pop(DATA_AXIS), **mesh}
    name = "fsdp" if plan == "hsdp" else plan
    return f"--mesh {','.join(f'{k}={v}' for k, v in mesh.items())} --plan {name}"


def launch_command(target: Any, train: str) -> str:
    """How to start ``train`` (a ``shardax train ...`` command) on every host of
    ``target``: one process per GPU host with Slurm's ``srun`` (``sx.initialize`` reads
    its environment), ``gcloud ... --worker=all`` on a TPU slice's hosts."""
    if target.platform == "tpu":
        hosts = len({d.process_index for d in target.devices})
        slices = f" (each of the {target.slices} slices)" if target.slices > 1 else ""
        return (
            f"gcloud compute tpus tpu-vm ssh $TPU_NAME --worker=all{slices} "
            f"--command='{train}'  # {hosts} hosts"
        )
    if target.hosts == 1:
        return train
    return (
        f"srun --nodes={target.hosts} --ntasks-per-node=1 "
        f"--gpus-per-node={target.devices_per_host} {train}"
    )


def _model(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, float, str]:
    """The GPT (abstract), its abstract train state, loss, batch, model FLOPs and text."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.cost.flops import transformer_flops_per_token
    from shardax.models import gpt

    layers = args.layers or 2
    try:
        cfg = gpt.GPTConfig(layers, args.d_model, args.heads, args.seq_len, vocab=args.vocab,
                            scan_layers=True)  # fmt: skip
    except (TypeError, ValueError) as e:
        raise UsageError(f"--layers/--d-model/--heads/--seq-len/--vocab: {e}") from None
    remat = args.remat or "full"

    def make() -> Any:
        return gpt.make_gpt(cfg, 0, remat=remat)

    model = nnx.eval_shape(make)
    state = nnx.eval_shape(lambda: sx.TrainState.create(make(), optax.adam(1e-4)))

    def loss_fn(m: Any, b: dict[str, Any]) -> Any:
        logits = m(b["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    n = gpt.param_count(model, embeddings=False)
    per_token = transformer_flops_per_token(n, layers, args.seq_len, args.d_model)
    size = gpt.param_count(model) / 1e9
    what = (f"gpt {layers} x {args.d_model} ({args.heads} heads), seq {args.seq_len}, "
            f"vocab {args.vocab}, {size:.3g} B params, remat {remat}")  # fmt: skip
    return model, state, loss_fn, {"inputs": tokens, "targets": tokens}, per_token, what


def _precision(args: argparse.Namespace, platform: str) -> Any:
    """``--param-dtype bf16``: params and moments in bf16; else ``--precision``, by
    default what ``shardax train`` takes on the target's platform (bf16 for the GPT on a
    GPU or TPU)."""
    import jax.numpy as jnp

    import shardax as sx
    from shardax.cli.train import default_precision

    if args.param_dtype == "bf16":  # params and Adam's moments in bf16: 6 bytes/param
        return sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    return args.precision or default_precision("gpt", platform)


def plan_for_target(args: argparse.Namespace) -> tuple[dict[str, Any], Any, Any]:
    """Compiles and estimates; returns the result as plain data, the estimate and the
    auto report (None for a named plan)."""
    import shardax as sx
    from shardax.models import gpt

    if args.batch is None:
        raise UsageError("--target needs --batch (the global batch, in sequences)")
    if args.model not in (None, "gpt"):
        raise UsageError(f"--target plans the built-in GPT; got --model {args.model}")
    target = load_target(args.target)
    spec = dict(args.mesh) if args.mesh else default_mesh(target, args.tp)
    try:
        mesh = sx.make_mesh(spec, devices=target)
    except ValueError as e:
        raise UsageError(f"--mesh {spec}: {e}") from None
    data_axes = tuple(a for a in (REPLICA_AXIS, DATA_AXIS) if a in mesh.shape)
    if DATA_AXIS not in mesh.shape:
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {dict(mesh.shape)}")
    rows = 1
    for a in data_axes:
        rows *= mesh.shape[a]
    if args.batch % rows:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the data axes "
            f"{' × '.join(data_axes)} = {rows} of mesh {dict(mesh.shape)}"
        )
    model, state, loss_fn, batch, per_token, what = _model(args)
    params = gpt.param_count(model)
    precision = _precision(args, target.platform)
    axis: Any = data_axes if len(data_axes) > 1 else DATA_AXIS
    tp = gpt.plan(mesh, model, "tp") if MODEL_AXIS in mesh.shape else None
    report = None
    try:
        if args.plan == "auto":
            candidates = _candidates(args.plans, mesh, axis, tp)
            report = sx.auto_plan(
                mesh, state, loss_fn=loss_fn, batch=batch, axis=axis, tp_rules=tp,
                precision=precision, candidates=candidates,
            )  # fmt: skip
            plan, name = report.plan, report.name
        else:
            plan, name = _named_plan(args.plan, mesh, model, axis, tp), args.plan
        step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, precision=precision,
                                  data_axis=axis)  # fmt: skip
        tokens = args.batch * args.seq_len
        est = sx.estimate(step, state, batch, model_flops=per_token * tokens,
                          model_flops_note="6N + attention, causal halved")  # fmt: skip
    except ValueError as e:
        raise UsageError(
            f"--plan {args.plan} on {args.target}, mesh {dict(mesh.shape)}: {e}"
        ) from None
    flags = train_flags(name, dict(mesh.shape))
    train = (f"shardax train --model gpt --layers {args.layers or 2} --d-model {args.d_model} "
             f"--heads {args.heads} --seq-len {args.seq_len} --batch-size {args.batch} "
             f"--remat {args.remat or 'full'} {flags}")  # fmt: skip
    result = {
        "target": target.name,
        "device_kind": target.device_kind,
        "devices": len(target.devices),
        "hosts": target.hosts,
        "slices": target.slices,
        "model": what,
        "params": params,
        "batch": args.batch,
        "precision": str(precision) if not isinstance(precision, str) else precision,
        "plan": name,
        "mesh": dict(mesh.shape),
        "fits_with_headroom": est.fits,
        "mesh_flags": flags,
        "launch": launch_command(target, train),
        "estimate": est.to_dict(),
        "auto": None if report is None else {**report.to_dict(), "reasons": report.reasons()},
    }
    return result, est, report


def _candidates(names: list[str] | None, mesh: Any, axis: Any, tp: Any) -> Any:
    """``--plans a,b``: those of :func:`shardax.train.auto.candidate_plans` (None: all)."""
    from shardax.train.auto import candidate_plans

    if not names:
        return None
    plans = candidate_plans(mesh, axis, tp_rules=tp)
    unknown = [n for n in names if n not in plans]
    if unknown:
        raise UsageError(
            f"--plans {','.join(names)}: {', '.join(unknown)} not among the candidates for "
            f"mesh {dict(mesh.shape)}: {', '.join(plans)}"
        )
    return {n: plans[n] for n in names}


def _named_plan(name: str, mesh: Any, model: Any, axis: Any, tp: Any) -> Any:
    """The candidate ``name`` of :func:`shardax.train.auto.candidate_plans`."""
    from shardax.train.auto import candidate_plans

    plans = candidate_plans(mesh, axis, tp_rules=tp)
    if name not in plans:
        raise UsageError(
            f"--plan {name} is not a candidate on mesh {dict(mesh.shape)}: "
            f"{', '.join(plans)} (hsdp needs hosts or a replica axis; fsdp+tp needs --tp)"
        )
    return plans[name]


def run(args: argparse.Namespace) -> int:
    """Prints the ranking (``--plan auto``), the estimate, the flags and the launch."""
    out = console(args)
    result, est, report = plan_for_target(args)
    if args.png:
        est.plot(args.png)
        result["png"] = str(args.png)
    if args.json:
        print_json(result)
        return 0
    if report is not None:
        out.print(report)
    out.print(est)
    out.print(f"plan: [bold]{result['plan']}[/] on {result['target']}; mesh flags: "
              f"[bold]{result['mesh_flags']}[/]")  # fmt: skip
    if est.fits is False:
        out.print("[red]does not fit[/] with 10% of HBM to spare: shrink --batch, remat more "
                  "or add devices before launching")  # fmt: skip
    out.print(f"launch: {result['launch']}", soft_wrap=True)
    if args.png:
        out.print(f"wrote {args.png}")
    return 0
