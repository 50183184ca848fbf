"""``shardax bench``: the data-parallel modes compared, on the devices at hand.

One Adam step of an MLP with a mean-squared-error loss on a synthetic batch, built by
[`shardax.make_train_step`][shardax.make_train_step] in its four modes:

- ``single``: ``jax.jit`` on one device, the whole batch there;
- ``jit``: ``jax.jit`` over a ``data`` mesh of all devices, state replicated, batch split;
- ``shard_map``: the same placement, per-device code with an explicit gradient ``pmean``;
- ``pmap``: the state stacked per device, the batch reshaped to ``(devices, batch/devices)``.

Each mode is warmed up (compilation included), then the modes are timed in turns,
``--repeats`` rounds, so load from elsewhere falls on all of them alike; the table gives
the median and the speedup over ``single``. ``--size large`` is a
90 × 2056 MLP on 1024 inputs with batch 6912 (for a GPU; ``--size seed``, its old name,
still works). On simulated CPU devices, which share the machine's cores, the table
compares the modes' overheads and says so: it is no speed-up measurement.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardax as sx
from shardax.cli.common import (
    UsageError,
    add_json_flag,
    add_run_dir,
    console,
    machine,
    median,
    nonneg_int,
    positive_int,
    pyplot,
    rows_table,
    save_figure,
    step_flops,
    time_interleaved,
    time_step,
    warning,
    write_results,
)
from shardax.cost.flops import utilization
from shardax.models.mlp import make_mlp
from shardax.train.config import MODES as STEP_MODES

MODES = ("single", *(m for m in STEP_MODES if m != "single"))
"""The step's modes (``shardax.train.config.MODES``), one device first: the baseline."""
SIZES = {
    # layers, hidden, input, output, batch
    "small": (4, 512, 256, 10, 2048),
    "large": (90, 2056, 1024, 10, 256 * 27),
}
SIZE_ALIASES = {"seed": "large"}
"""Old ``--size`` names, still taken (with a warning)."""


def _size(text: str) -> str:
    """An argparse type: a ``SIZES`` name, an old name (``SIZE_ALIASES``) as its new one."""
    if text in SIZE_ALIASES:
        warning(f"--size {text} is now --size {SIZE_ALIASES[text]}", "shardax")
        return SIZE_ALIASES[text]
    return text


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(MODES)}, got {text!r}"
        )
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax bench``."""
    add_mlp_arguments(
        parser,
        "small: 4 × 512 MLP, batch 2048 (CPU, about a minute); "
        "large: 90 × 2056 MLP, batch 6912 (a GPU's size)",
    )
    parser.add_argument("--batch-size", type=positive_int, help="global batch (overrides --size)")
    parser.add_argument(
        "--modes", type=_modes, default=list(MODES), help=f"subset of {','.join(MODES)}"
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time one mode after another, holding one mode's state at a time (less memory); "
        "default: modes timed in turns, so background load falls on all alike",
    )
    add_timing_arguments(parser, warmup=3, repeats=9, each="mode", name="bench")


def add_mlp_arguments(parser: argparse.ArgumentParser, size_help: str) -> None:
    """``--size`` (one of ``SIZES``) and the overrides of its MLP's shape."""
    parser.add_argument(
        "--size", type=_size, choices=sorted(SIZES), default="small", help=size_help
    )
    parser.add_argument("--layers", type=positive_int, help="hidden layers (overrides --size)")
    parser.add_argument("--hidden", type=positive_int, help="hidden width (overrides --size)")
    parser.add_argument("--input-dim", type=positive_int, help="input width (overrides --size)")


def add_timing_arguments(
    parser: argparse.ArgumentParser, *, warmup: int, repeats: int, each: str, name: str
) -> None:
    """``--warmup`` and ``--repeats`` steps per ``each``, ``--seed``, and where the
    ``<name>.json`` and ``<name>.png`` go (``--run-dir``, ``--json``)."""
    parser.add_argument(
        "--warmup", type=positive_int, default=warmup, help=f"untimed steps per {each}"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=repeats, help=f"timed steps per {each}"
    )
    parser.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    add_run_dir(parser, f"where to write {name}.json and {name}.png")
    add_json_flag(parser)


def mlp_shape(args: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """``(layers, hidden, input_dim, output_dim, batch)`` of ``--size``, overrides applied."""
    layers, hidden, input_dim, output_dim, batch = SIZES[args.size]
    return (
        args.layers or layers,
        args.hidden or hidden,
        args.input_dim or input_dim,
        output_dim,
        getattr(args, "batch_size", None) or batch,
    )


def random_batch(rng: Any, rows: int, input_dim: int, output_dim: int) -> dict[str, Any]:
    """``rows`` examples of random inputs ``"x"`` and all-ones targets ``"y"`` (float32)."""
    return {
        "x": rng.standard_normal((rows, input_dim), np.float32),
        "y": np.ones((rows, output_dim), np.float32),
    }


def mse_loss(model: Any, batch: dict[str, Any]) -> Any:
    """The loss: mean squared error of the MLP's outputs against ``batch["y"]``."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class Stepper:
    """One train step and its own state, threaded through every call (buffers donated).

    ``stepper.bind(batch)`` is a no-argument function that runs one step on ``batch``
    and returns what it computed, for the timers; ``first_losses[i]`` is the loss of the
    first step on the ``i``-th bound batch.
    """

    def __init__(self, step: Any, state: Any) -> None:
        self.step, self.state = step, step.shard(state)
        self.first_losses: list[float | None] = []

    def bind(self, batch: Any) -> Callable[[], Any]:
        """A function running one step on ``batch`` (already placed)."""
        index = len(self.first_losses)
        self.first_losses.append(None)

        def call() -> Any:
            self.state, metrics = self.step(self.state, batch)
            if self.first_losses[index] is None:
                self.first_losses[index] = float(metrics["loss"])
            return self.state, metrics

        return call


def bench(args: argparse.Namespace, out: Any) -> dict[str, Any]:
    """Times every mode; returns the result as plain data."""
    layers, hidden, input_dim, output_dim, batch = mlp_shape(args)
    mesh = sx.make_mesh({"data": -1})
    if batch % mesh.size:
        raise UsageError(f"--batch-size {batch} is not divisible by the {mesh.size} devices")
    model = make_mlp(input_dim, hidden, layers, output_dim, args.seed)
    state = sx.TrainState.create(model, optax.adam(1e-4), rng=args.seed)
    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state.params))
    data = random_batch(np.random.default_rng(args.seed), batch, input_dim, output_dim)
    one = sx.make_mesh({"data": 1}, devices=jax.devices()[:1])
    out.print(
        f"bench: MLP {layers} × {hidden} on {input_dim} inputs ({num_params / 1e6:.1f} M params), "
        f"batch {batch}, {mesh.size} {jax.devices()[0].platform} device(s); "
        f"warm-up {args.warmup}, median of {args.repeats}, "
        + ("one mode at a time" if args.sequential else "modes timed in turns")
    )

    flops: list[float | None] = []  # of each mode's compiled step

    def bound(mode: str) -> tuple[Stepper, Callable[[], Any]]:
        where = one if mode == "single" else mesh
        stepper = Stepper(sx.make_train_step(mse_loss, mesh=where, mode=mode), state)
        placed = sx.distribute_batch(data, sx.batch_sharding(where))
        flops.append(step_flops(stepper.step, stepper.state, placed))
        return stepper, stepper.bind(placed)

    if args.sequential:  # one mode's state on the devices at a time
        all_times, losses = [], []
        for mode in args.modes:
            stepper, fn = bound(mode)
            all_times.append(time_step(fn, args.warmup, args.repeats))
            losses.append(stepper.first_losses[0])
            del stepper, fn
    else:
        pairs = [bound(mode) for mode in args.modes]
        all_times = time_interleaved([fn for _, fn in pairs], args.warmup, args.repeats)
        losses = [stepper.first_losses[0] for stepper, _ in pairs]
        del pairs
    rows = [
        {
            **utilization(f, median(times), 1 if mode == "single" else mesh.size),
            "mode": mode,
            "devices": 1 if mode == "single" else mesh.size,
            "median_s": median(times),
            "min_s": min(times),
            "max_s": max(times),
            "times_s": times,
            "loss": loss,
        }
        for mode, times, loss, f in zip(args.modes, all_times, losses, flops, strict=True)
    ]
    base = next((r["median_s"] for r in rows if r["mode"] == "single"), None)
    for r in rows:
        r["speedup_vs_single"] = None if base is None else base / r["median_s"]
    return {
        "command": "bench",
        **machine(),
        "caveat": simulated_caveat(mesh),
        "devices": mesh.size,
        "size": args.size,
        "layers": layers,
        "hidden": hidden,
        "input_dim": input_dim,
        "batch_size": batch,
        "params": num_params,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "results": rows,
    }


def render(result: dict[str, Any], out: Any) -> None:
    """The table of median step times and speedups."""
    columns = {
        "mode": lambda r: r["mode"],
        "devices": lambda r: str(r["devices"]),
        "median ms": _shown("median_s", ".2f", scale=1e3),
        "min ms": _shown("min_s", ".2f", scale=1e3),
        "max ms": _shown("max_s", ".2f", scale=1e3),
        "speedup vs single": _shown("speedup_vs_single", ".2f", unit="×"),
        "FLOPs/step": _shown("flops_per_step", ".3g"),
        "TFLOP/s per device": _shown("tflops_per_s_per_device", ".3g"),
        "MFU": lambda r: r["mfu"] if isinstance(r["mfu"], str) else f"{r['mfu']:.1%}",
    }
    title = (
        f"train-step time, {result['devices']} × {result['device_kind']}, MLP "
        f"{result['layers']} × {result['hidden']}, batch {result['batch_size']}"
    )
    out.print(rows_table(title, columns, result["results"]))
    if result.get("caveat"):
        out.print(f"[yellow]note:[/] {result['caveat']}")


def simulated_caveat(mesh: Any) -> str | None:
    """On simulated CPU devices, what the table is not: a speed-up measurement (the
    devices share this machine's cores); None on accelerators or one device.

    >>> simulated_caveat(sx.make_mesh({"data": 1}, devices=jax.devices()[:1])) is None
    True
    """
    if mesh.size == 1 or mesh.devices.flat[0].platform != "cpu":
        return None
    return (
        f"these {mesh.size} devices are simulated CPU devices sharing this machine's "
        f"{os.cpu_count()} cores: the times compare the modes' overheads, not a speed-up "
        "from more devices (measure that on accelerators)"
    )


def _shown(key: str, spec: str, *, scale: float = 1, unit: str = "") -> Any:
    """How a row shows ``row[key]``: scaled, formatted by ``spec``, "—" for None."""
    return lambda row: "—" if row[key] is None else f"{row[key] * scale:{spec}}{unit}"


def plot(result: dict[str, Any], path: Any) -> None:
    """A bar chart of median step times, with min–max whiskers."""
    plt = pyplot("bench")
    rows = result["results"]
    medians = [r["median_s"] * 1e3 for r in rows]
    low = [m - r["min_s"] * 1e3 for m, r in zip(medians, rows, strict=True)]
    high = [r["max_s"] * 1e3 - m for m, r in zip(medians, rows, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [
        r["mode"] + ("" if r["speedup_vs_single"] is None else f"\n{r['speedup_vs_single']:.2f}×")
        for r in rows
    ]
    ax.bar(labels, medians, yerr=[low, high], capsize=4)
    ax.set(
        ylabel="median step time (ms), whiskers min–max",
        title=f"{result['devices']} × {result['device_kind']}: MLP {result['layers']} × "
        f"{result['hidden']}, batch {result['batch_size']}",
    )
    ax.grid(axis="y", alpha=0.3)
    save_figure(plt, fig, path)


def run(args: argparse.Namespace) -> int:
    """Runs the comparison, prints the table, writes ``bench.json`` and ``bench.png``."""
    out = console(args)
    write_results(args, out, bench(args, out), "bench", "bench", plot, render)
    return 0
