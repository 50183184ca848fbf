"""``shardax tune-batch``: measure train-step throughput over batch sizes and find the knee.

For each batch size the step ([`shardax.make_train_step`][shardax.make_train_step] in
``jit`` mode over a ``data`` mesh, state replicated, batch split) is compiled and warmed
up; then the sizes are timed in turns, ``--repeats`` rounds, and throughput is the batch
divided by the median step time. The knee is the smallest batch within ``--tolerance``
(default 10%) of the peak throughput: past it a larger batch buys little speed per
example. It is shown per device beside the recommendation table's critical batch size and,
where the datasheet figures exist, the roofline's ``B*``.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np
import optax

import shardax as sx
from shardax.cli.bench import (
    Stepper,
    add_mlp_arguments,
    add_timing_arguments,
    mlp_shape,
    mse_loss,
    random_batch,
)
from shardax.cli.common import (
    UsageError,
    console,
    int_list,
    machine,
    median,
    positive_int,
    pyplot,
    rows_table,
    save_figure,
    time_interleaved,
    write_results,
)
from shardax.cost.hardware import HARDWARE_SPECS
from shardax.cost.roofline import hardware_roofline, knee_batch_size
from shardax.models.mlp import make_mlp


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) such as 0.1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax tune-batch``."""
    parser.add_argument(
        "--batch-sizes",
        type=int_list,
        default=None,
        help="global batch sizes to try, e.g. 64,128,256 (default: devices × 1, 2, 4, … 2048)",
    )
    add_mlp_arguments(parser, "MLP size, as in shardax bench")
    parser.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="devices to use (default: all; 1 on CPU, where simulated devices share the "
        "same cores)",
    )
    parser.add_argument(
        "--tolerance", type=_tolerance, default=0.1, help="knee: within this of peak (0.1)"
    )
    add_timing_arguments(parser, warmup=2, repeats=7, each="size", name="tune")


def tune(args: argparse.Namespace, out: Any) -> dict[str, Any]:
    """Times the step at every batch size; returns the curve and the knee."""
    cpu = jax.devices()[0].platform == "cpu"
    n = args.devices or (1 if cpu else jax.device_count())
    if n > jax.device_count():
        raise UsageError(f"--devices {n} is more than the {jax.device_count()} devices at hand")
    mesh = sx.make_mesh({"data": n}, devices=jax.devices()[:n])
    sizes = args.batch_sizes or [n * 2**k for k in range(12)]
    bad = [b for b in sizes if b % n]
    if bad:
        raise UsageError(f"--batch-sizes {bad} are not divisible by the {n} devices")
    sizes = sorted(set(sizes))
    layers, hidden, input_dim, output_dim, _ = mlp_shape(args)
    model = make_mlp(input_dim, hidden, layers, output_dim, args.seed)
    # One state, threaded through the steps of every size: memory for one copy only.
    stepper = Stepper(
        sx.make_train_step(mse_loss, mesh=mesh),
        sx.TrainState.create(model, optax.adam(1e-4), rng=args.seed),
    )
    rng = np.random.default_rng(args.seed)
    hw = sx.cost.detect_hardware_type()
    out.print(
        f"tune-batch: MLP {layers} × {hidden} on {input_dim} inputs, {n} × "
        f"{jax.devices()[0].device_kind}, batch sizes {sizes}; warm-up {args.warmup}, "
        f"median of {args.repeats}, sizes timed in turns"
    )
    data = sx.batch_sharding(mesh)
    fns = []
    for b in sizes:
        batch = random_batch(rng, b, input_dim, output_dim)
        fns.append(stepper.bind(sx.distribute_batch(batch, data)))
    all_times = time_interleaved(fns, args.warmup, args.repeats)
    del fns
    rows = []
    for b, times in zip(sizes, all_times, strict=True):
        t = median(times)
        rows.append(
            {
                "batch_size": b,
                "per_device": b // n,
                "median_s": t,
                "times_s": times,
                "examples_per_s": b / t,
            }
        )
    knee = knee_batch_size(
        [r["batch_size"] for r in rows], [r["median_s"] for r in rows], args.tolerance
    )
    rec = sx.get_batch_size_recommendation(hw)
    roof = hardware_roofline(hw).critical_batch if hw in HARDWARE_SPECS else None
    return {
        "command": "tune-batch",
        **machine(),
        "hardware": hw.value,
        "devices": n,
        "layers": layers,
        "hidden": hidden,
        "input_dim": input_dim,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "tolerance": args.tolerance,
        "results": rows,
        "peak_examples_per_s": max(r["examples_per_s"] for r in rows),
        "knee_batch_size": knee,
        "knee_per_device": knee // n,
        "table_critical_batch_size": rec.critical_batch_size,
        "roofline_critical_batch": roof,
        "knee_is_largest_tried": knee == sizes[-1],
    }


def render(result: dict[str, Any], out: Any) -> None:
    """The throughput table and the knee beside the table's critical batch."""
    peak = result["peak_examples_per_s"]
    knee = result["knee_batch_size"]
    columns = {
        "batch": lambda r: str(r["batch_size"]) + (" ◀ knee" if r["batch_size"] == knee else ""),
        "per device": lambda r: str(r["per_device"]),
        "median ms": lambda r: f"{r['median_s'] * 1e3:.2f}",
        "spread": lambda r: f"±{(max(r['times_s']) - min(r['times_s'])) / 2 / r['median_s']:.0%}",
        "examples/s": lambda r: f"{r['examples_per_s']:,.0f}",
        "of peak": lambda r: f"{r['examples_per_s'] / peak:.0%}",
    }
    table = rows_table(
        f"throughput, {result['devices']} × {result['device_kind']}",
        columns,
        result["results"],
        "spread: half the min–max range of the timed steps, relative to the median",
        style=lambda r: "bold green" if r["batch_size"] == knee else None,
    )
    out.print(table)
    roof = result["roofline_critical_batch"]
    out.print(
        f"knee (smallest batch within {result['tolerance']:.0%} of peak): "
        f"[bold]{result['knee_batch_size']}[/] = {result['knee_per_device']} per device; "
        f"the table's critical batch for {result['hardware']} is "
        f"{result['table_critical_batch_size']} per device"
        + ("" if roof is None else f", the roofline's B* is {roof:.0f}")
    )
    if result["knee_is_largest_tried"]:
        out.print(
            "[yellow]warning:[/] the knee is the largest batch tried: throughput was still "
            "rising; try larger --batch-sizes"
        )


def plot(result: dict[str, Any], path: Any) -> None:
    """Throughput against batch size, with the knee and the table's critical batch."""
    plt = pyplot("tune-batch")
    n = result["devices"]
    batches = [r["batch_size"] for r in result["results"]]
    rates = [r["examples_per_s"] for r in result["results"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(batches, rates, "o-", label="median throughput")
    ax.axhline(
        (1 - result["tolerance"]) * result["peak_examples_per_s"],
        color="gray",
        ls=":",
        label=f"{1 - result['tolerance']:.0%} of peak",
    )
    ax.axvline(
        result["knee_batch_size"],
        color="green",
        ls="--",
        label=f"knee: {result['knee_batch_size']}",
    )
    ax.axvline(
        n * result["table_critical_batch_size"],
        color="red",
        ls="-.",
        label=f"table critical × {n} devices: {n * result['table_critical_batch_size']}",
    )
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="global batch size",
        ylabel="examples / s",
        title=f"{n} × {result['device_kind']}: MLP {result['layers']} × {result['hidden']}",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(plt, fig, path)


def run(args: argparse.Namespace) -> int:
    """Measures, prints the table, writes ``tune.json`` and ``tune.png``."""
    out = console(args)
    write_results(args, out, tune(args, out), "tune-batch", "tune", plot, render)
    return 0
