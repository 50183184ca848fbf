"""``shardax plan --measure``: every candidate plan compiled, beside the formula's estimate.

The model is built abstractly (``jax.eval_shape``: nothing is allocated) and each
candidate's train step is compiled for it by [`shardax.auto_plan`][shardax.auto_plan]. One row per
candidate: the compiler's bytes per device (arguments, temporaries, peak), the formula's
params + optimizer state (``shardax.cost.memory.estimate``), the bytes each device
sends per step (from the HLO), and whether it fits; then the pick and its reason.

Examples: ``shardax plan --measure --mesh data=4,model=2 --hidden 1024 --batch 512`` (the
digits MLP); ``shardax plan --measure --params 1e8 --seq-len 256`` (a GPT of about that
many parameters, from ``shardax.models.gpt``, built abstractly).

With a ``stage`` axis (``--model gpt --mesh data=2,stage=4``) the GPT is built with
``pipeline_microbatches`` (``--microbatches``, default the stage size) for *every*
candidate, so all compile the same program (``sx.pipeline``'s schedule over ``stage``)
and differ only in where the state lives; the ``pipeline`` candidate
(``gpt.plan(mesh, model, "pipeline")``) is the one that splits the blocks over
``stage``, the others replicate the state there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import shardax as sx
from shardax.cli.common import (
    UsageError,
    console,
    machine,
    pyplot,
    rows_table,
    save_figure,
    write_results,
)
from shardax.cost.memory import estimate
from shardax.models import gpt
from shardax.models.gpt import GPTConfig
from shardax.models.mlp import make_mlp, tp_rules
from shardax.parallel.gpipe import stage_mesh
from shardax.plan.report import format_bytes as fb
from shardax.train.auto import candidate_plans

GIB = 1024**3
MODELS = ("mlp", "gpt")
# Each candidate's formula: its ZeRO stage (3 = FSDP), and the mesh axes besides "data"
# that split it too (tensor, pipeline); hsdp and user plans have none ("n/a").
FORMULAS = {
    "replicate": (0, ()),
    "zero1": (1, ()),
    "zero2": (2, ()),
    "fsdp": (3, ()),
    "fsdp+tp": (3, ("model",)),
    "pipeline": (0, ("stage",)),
}


def _mlp(args: argparse.Namespace) -> tuple[Any, Any, Any, list[tuple[str, Any]]]:
    """The digits MLP of ``shardax train`` at ``--hidden`` × ``--layers``: an init
    function, its loss, an abstract batch, and its tensor-parallel rules."""

    def init() -> Any:
        return sx.TrainState.create(make_mlp(64, args.hidden, args.layers, 10, 0), optax.adam(1e-3))

    def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    batch = {
        "x": jax.ShapeDtypeStruct((args.batch, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((args.batch,), jnp.int32),
    }
    return init, loss_fn, batch, tp_rules(args.layers)


def gpt_config(num_params: float, max_seq_len: int) -> Any:
    """A ``GPTConfig`` of about ``num_params`` parameters: ``12·L·d²`` in the blocks,
    with ``L = d / 64`` layers and 64-wide heads (``d`` a multiple of 64)."""
    d_model = max(64, round((num_params * 64 / 12) ** (1 / 3) / 64) * 64)
    layers = max(1, round(num_params / (12 * d_model**2)))
    return GPTConfig(layers, d_model, d_model // 64, max_seq_len)


def _gpt(args: argparse.Namespace, mesh: Any) -> tuple[Any, Any, Any, Any, Any, str]:
    """The GPT of ``shardax train --model gpt`` (``--params`` sets its size): an init
    function, its loss, an abstract batch, its tensor-parallel plan (with a ``model``
    axis), its pipeline plan (with a ``stage`` axis; the model then runs its blocks with
    ``sx.pipeline`` in ``--microbatches``) and a description."""
    if args.params is not None:
        cfg = gpt_config(args.params, args.seq_len)
    else:
        cfg = gpt.GPTConfig(args.layers, args.d_model, args.heads, args.seq_len)
    stages = mesh.shape.get("stage", 1)
    if stages > 1:
        micro = args.microbatches or stages
        cfg = dataclasses.replace(cfg, pipeline_microbatches=micro)
    elif args.microbatches is not None:
        raise UsageError(
            f"--microbatches {args.microbatches} pipelines the GPT's blocks over a 'stage' "
            f"axis, but --mesh {dict(mesh.shape)} has none of size > 1; e.g. data=2,stage=4"
        )

    def init() -> Any:
        return sx.TrainState.create(gpt.make_gpt(cfg, 0), optax.adam(1e-3))

    def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    tp = pp = None
    abstract = nnx.eval_shape(lambda: gpt.make_gpt(cfg, 0))
    try:
        if "model" in mesh.shape:
            tp = gpt.plan(mesh, abstract, "tp")
        if stages > 1:
            pp = gpt.plan(mesh, abstract, "pipeline")
            x = jax.ShapeDtypeStruct((args.batch, args.seq_len, cfg.d_model), jnp.float32)
            with jax.sharding.set_mesh(mesh):  # sx.pipeline's rules, before compiling
                stage_mesh(abstract.layers()[1], x, cfg.pipeline_microbatches, "stage")
    except ValueError as e:
        flags = f"--layers {cfg.layers} --batch {args.batch}"
        if stages > 1:
            flags += f" --microbatches {cfg.pipeline_microbatches}"
        raise UsageError(f"{flags} --mesh {dict(mesh.shape)}: {e}") from None
    what = f"gpt {cfg.layers} x {cfg.d_model} ({cfg.heads} heads), seq {args.seq_len}"
    if stages > 1:
        what += f", sx.pipeline in {cfg.pipeline_microbatches} microbatches"
    return init, loss_fn, batch, tp, pp, what


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Compiles the candidates and returns the table as plain data."""
    if args.params is not None and args.model != "gpt":
        raise UsageError(
            f"--measure with --params builds a GPT of that size; got --model {args.model}, "
            "which takes --hidden and --layers instead (or pass --model gpt)"
        )
    try:
        mesh = sx.make_mesh(args.mesh or {"data": -1})
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None
    if "data" not in mesh.shape:
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {dict(mesh.shape)}")
    data, model = mesh.shape["data"], mesh.shape.get("model", 1)
    split = {"model": model, "stage": mesh.shape.get("stage", 1)}
    if args.batch % data:
        raise UsageError(f"--batch {args.batch} is not divisible by the data axis size {data}")
    pp = None
    if args.model == "gpt":
        init, loss_fn, batch, tp, pp, what = _gpt(args, mesh)
    else:
        if args.microbatches is not None:
            raise UsageError("--microbatches pipelines the GPT's blocks: pass --model gpt")
        init, loss_fn, batch, tp = _mlp(args)
        tp = tp if model > 1 else None
        what = f"mlp {args.layers} x {args.hidden}"
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(init).params))
    memory = None if args.device_memory is None else args.device_memory * GIB
    plans = candidate_plans(mesh, tp_rules=tp, pipeline_rules=pp)
    if args.plans:
        unknown = [p for p in args.plans if p not in plans]
        if unknown:
            raise UsageError(
                f"--plans {','.join(args.plans)}: {', '.join(unknown)} not among the "
                f"candidates for mesh {dict(mesh.shape)}: {', '.join(plans)}"
            )
        plans = {name: plans[name] for name in args.plans}
    report = sx.auto_plan(
        mesh,
        init,
        loss_fn=loss_fn,
        batch=batch,
        device_memory=memory,
        candidates=plans,
        precision=args.precision,
    )
    rows = []
    for c in report.candidates:
        formula = None
        if c.name in FORMULAS:
            zero, axes = FORMULAS[c.name]
            e = estimate(num_params, "fp32", data=data, zero=zero, **{a: split[a] for a in axes})
            formula = {
                "strategy": e.strategy,
                "params_and_optimizer_bytes": e.params_bytes + e.master_bytes + e.optimizer_bytes,
                "total_bytes": e.total_bytes,
            }
        rows.append({**c.to_dict(), "formula": formula})
    return {
        "model": what,
        "params": num_params,
        "batch": args.batch,
        "mesh": dict(mesh.shape),
        "precision": args.precision,
        **machine(),
        "jax": jax.__version__,
        "device_memory_bytes": report.device_memory,
        "pick": report.name,
        "reason": report.reason,
        "candidates": rows,
    }


def render(result: dict[str, Any], out: Any) -> None:
    """The table of candidates and the pick."""
    columns = {
        "plan": lambda r: ("[bold]" if r["name"] == result["pick"] else "") + r["name"],
        "arguments": lambda r: fb(r["argument_bytes"]),
        "formula": lambda r: (
            "n/a" if r["formula"] is None else fb(r["formula"]["params_and_optimizer_bytes"])
        ),
        "temporaries": lambda r: fb(r["temp_bytes"]),
        "peak": lambda r: fb(r["total_bytes"]),
        "sent": lambda r: fb(r["collective_bytes"]),
        "fits": lambda r: {None: "?", True: "yes", False: "[red]no[/]"}[r["fits"]],
    }
    title = (
        f"{result['model']} ({result['params'] / 1e6:.2f} M params, Adam fp32), batch "
        f"{result['batch']}, mesh {result['mesh']}: compiled per device"
    )
    caption = (
        "arguments = state + batch slice; formula = params + Adam state, "
        "runtime/memory.py; sent = bytes per device per step from the HLO's collectives"
    )
    out.print(rows_table(title, columns, result["candidates"], caption, left=1))
    out.print(f"pick: [bold]{result['pick']}[/]: {result['reason']}")


def plot(result: dict[str, Any], path: Any) -> None:
    """Bars of compiled peak bytes and the formula's, per candidate, and the budget."""
    plt = pyplot("plan")
    rows = result["candidates"]
    names = [r["name"] for r in rows]
    x = range(len(rows))
    fig, (mem, comm) = plt.subplots(1, 2, figsize=(10, 4))
    mem.bar(
        [i - 0.2 for i in x],
        [r["argument_bytes"] / 2**20 for r in rows],
        0.4,
        label="compiled arguments",
    )
    formula = [(r["formula"] or {}).get("params_and_optimizer_bytes", 0) / 2**20 for r in rows]
    mem.bar([i + 0.2 for i in x], formula, 0.4, label="formula: params + Adam")
    mem.plot(list(x), [r["total_bytes"] / 2**20 for r in rows], "k_", ms=20, label="peak")
    if result["device_memory_bytes"]:
        mem.axhline(result["device_memory_bytes"] / 2**20, color="r", ls="--", label="budget")
    mem.set(xticks=list(x), xticklabels=names, ylabel="MiB per device", title="memory")
    mem.legend(fontsize=8)
    comm.bar(names, [r["collective_bytes"] / 2**20 for r in rows])
    comm.set(ylabel="MiB sent per device per step", title=f"communication (pick: {result['pick']})")
    for ax in (mem, comm):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{result['model']}, batch {result['batch']}, mesh {result['mesh']}")
    save_figure(plt, fig, path)


def run(args: argparse.Namespace) -> int:
    """Measures, prints, writes ``plan.json`` and ``plan.png``."""
    out = console(args)
    try:
        result = measure(args)
    except ValueError as e:  # no plan fits: the error names the smallest and the budget
        raise UsageError(str(e)) from None
    write_results(args, out, result, "plan", "plan", plot, render)
    return 0
