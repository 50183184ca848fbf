"""``shardax bench``: seed 003's comparison of data-parallel modes, on the devices at hand.

One Adam step of an MLP with a mean-squared-error loss on a synthetic batch, as in the
seed notebook, in four modes:

- ``single``: ``jax.jit`` on one device, the whole batch there;
- ``jit``: ``jax.jit`` over a ``data`` mesh of all devices, state replicated, batch split;
- ``shard_map``: the same placement, per-device code with an explicit gradient ``pmean``;
- ``pmap``: the state stacked per device, the batch reshaped to ``(devices, batch/devices)``.

Each mode is warmed up (compilation included), then the modes are timed in turns,
``--repeats`` rounds, so load from elsewhere falls on all of them alike; the table gives
the median and the speedup over ``single``. ``--size seed`` is the notebook's
90 × 2056 MLP on 1024 inputs with batch 6912 (for a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

from shardax.cli.common import (
    UsageError,
    add_json_flag,
    console,
    median,
    positive_int,
    print_json,
    pyplot,
    run_dir,
    time_interleaved,
    time_step,
)
from shardax.cli.demo import make_mlp

MODES = ("single", "jit", "shard_map", "pmap")
SIZES = {
    # layers, hidden, input, output, batch
    "small": (4, 512, 256, 10, 2048),
    "seed": (90, 2056, 1024, 10, 256 * 27),
}


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
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="small: 4 × 512 MLP, batch 2048 (CPU, about a minute); "
        "seed: 90 × 2056 MLP, batch 6912, as in seed 003 (GPU)",
    )
    parser.add_argument("--layers", type=positive_int, help="hidden layers (overrides --size)")
    parser.add_argument("--hidden", type=positive_int, help="hidden width (overrides --size)")
    parser.add_argument("--input-dim", type=positive_int, help="input width (overrides --size)")
    parser.add_argument("--batch-size", type=positive_int, help="global batch (overrides --size)")
    parser.add_argument(
        "--modes", type=_modes, default=list(MODES), help=f"subset of {','.join(MODES)}"
    )
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed steps per mode")
    parser.add_argument("--repeats", type=positive_int, default=9, help="timed steps per mode")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time one mode after another, holding one mode's state at a time (less memory); "
        "default: modes timed in turns, so background load falls on all alike",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--run-dir", default=None, help="where to write bench.json and bench.png")
    add_json_flag(parser)


def make_steps(
    graphdef: Any, tx: Any, mesh: Any
) -> dict[str, tuple[Callable[..., Any], Callable[[Any, Any, Any], tuple[Any, ...]]]]:
    """For each mode, ``(step, place)``: ``place(params, x, y)`` puts the inputs where the
    mode wants them and ``step(params, opt_state, x, y)`` runs one Adam step."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    def step(params: Any, opt_state: Any, x: Any, y: Any, axis: str | None = None) -> Any:
        def loss_fn(params: Any) -> Any:
            return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        if axis is not None:
            loss, grads = jax.lax.pmean((loss, grads), axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    n = mesh.size
    one = sx.make_mesh({"data": 1}, devices=jax.devices()[:1])

    def placed(target_mesh: Any) -> Callable[..., tuple[Any, ...]]:
        def place(params: Any, x: Any, y: Any) -> tuple[Any, ...]:
            params = sx.shard(params, sx.replicate(target_mesh))
            opt_state = sx.shard(tx.init(params), sx.replicate(target_mesh))
            data = sx.batch_sharding(target_mesh)
            return params, opt_state, *sx.distribute_batch((x, y), data)

        return place

    def place_pmap(params: Any, x: Any, y: Any) -> tuple[Any, ...]:
        stacked = NamedSharding(mesh, P("data"))
        params = sx.shard(params, sx.replicate(mesh))
        opt_state = tx.init(params)

        def stack(tree: Any) -> Any:
            return jax.tree.map(
                lambda a: jax.device_put(jnp.broadcast_to(a, (n, *a.shape)), stacked), tree
            )

        per = x.shape[0] // n
        x, y = (jax.device_put(a.reshape(n, per, *a.shape[1:]), stacked) for a in (x, y))
        return stack(params), stack(opt_state), x, y

    sharded = jax.shard_map(
        lambda p, o, x, y: step(p, o, x, y, "data"),
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
    )
    return {
        "single": (jax.jit(step), placed(one)),
        "jit": (jax.jit(step), placed(mesh)),
        "shard_map": (jax.jit(sharded), placed(mesh)),
        "pmap": (
            jax.pmap(lambda p, o, x, y: step(p, o, x, y, "data"), axis_name="data"),
            place_pmap,
        ),
    }


def bench(args: argparse.Namespace, out: Any) -> dict[str, Any]:
    """Times every mode; returns the result as plain data."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import shardax as sx

    layers, hidden, input_dim, output_dim, batch = SIZES[args.size]
    layers = args.layers or layers
    hidden = args.hidden or hidden
    input_dim = args.input_dim or input_dim
    batch = args.batch_size or batch
    mesh = sx.make_mesh({"data": -1})
    if batch % mesh.size:
        raise UsageError(f"--batch-size {batch} is not divisible by the {mesh.size} devices")
    model = make_mlp(input_dim, hidden, layers, output_dim, args.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((batch, input_dim), np.float32)
    y = np.ones((batch, output_dim), np.float32)
    steps = make_steps(graphdef, optax.adam(1e-4), mesh)
    out.print(
        f"bench: MLP {layers} × {hidden} on {input_dim} inputs ({num_params / 1e6:.1f} M params), "
        f"batch {batch}, {mesh.size} {jax.devices()[0].platform} device(s); "
        f"warm-up {args.warmup}, median of {args.repeats}, "
        + ("one mode at a time" if args.sequential else "modes timed in turns")
    )

    def call(mode: str, inputs: tuple[Any, ...]) -> Callable[[], Any]:
        return functools.partial(steps[mode][0], *inputs)

    if args.sequential:  # one mode's state on the devices at a time
        all_times, losses = [], []
        for mode in args.modes:
            fn = call(mode, steps[mode][1](params, x, y))
            all_times.append(time_step(fn, args.warmup, args.repeats))
            losses.append(float(np.mean(fn()[2])))
            del fn
    else:
        fns = [call(mode, steps[mode][1](params, x, y)) for mode in args.modes]
        all_times = time_interleaved(fns, args.warmup, args.repeats)
        losses = [float(np.mean(fn()[2])) for fn in fns]
        del fns
    rows = [
        {
            "mode": mode,
            "devices": 1 if mode == "single" else mesh.size,
            "median_s": median(times),
            "min_s": min(times),
            "max_s": max(times),
            "times_s": times,
            "loss": loss,
        }
        for mode, times, loss in zip(args.modes, all_times, losses, strict=True)
    ]
    base = next((r["median_s"] for r in rows if r["mode"] == "single"), None)
    for r in rows:
        r["speedup_vs_single"] = None if base is None else base / r["median_s"]
    return {
        "command": "bench",
        "platform": jax.devices()[0].platform,
        "device_kind": str(jax.devices()[0].device_kind),
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
    from rich.table import Table

    table = Table(
        title=f"train-step time, {result['devices']} × {result['device_kind']}, MLP "
        f"{result['layers']} × {result['hidden']}, batch {result['batch_size']}"
    )
    for col in ("mode", "devices", "median ms", "min ms", "max ms", "speedup vs single"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        speed = r["speedup_vs_single"]
        table.add_row(
            r["mode"],
            str(r["devices"]),
            f"{r['median_s'] * 1e3:.2f}",
            f"{r['min_s'] * 1e3:.2f}",
            f"{r['max_s'] * 1e3:.2f}",
            "—" if speed is None else f"{speed:.2f}×",
        )
    out.print(table)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Runs the comparison, prints the table, writes ``bench.json`` and ``bench.png``."""
    out = console(args)
    result = bench(args, out)
    directory = run_dir(args.run_dir, "bench")
    result["plot"] = str(directory / "bench.png")
    plot(result, directory / "bench.png")
    (directory / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print_json(result)
    else:
        render(result, out)
        out.print(f"wrote {directory}/bench.json and bench.png")
    return 0
