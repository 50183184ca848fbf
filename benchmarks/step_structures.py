"""Per-step cost of alternating two state structures through one ``make_train_step``.

One MLP (8 simulated CPU devices, or the accelerators present), two train states that
compute the same update: ``optax.adam`` and ``optax.chain(optax.adam)``, whose optimizer
states differ in structure only. Each round runs, in alternating order,

- ``one``: two steps on two states of the *same* structure (one compiled step);
- ``two``: one step on each structure (two compiled steps, alternating),

each step timed to ``block_until_ready``. The result is the median per-step time of each
and their ratio ``two / one``. Goal: <= 1.05 (the compiled step is looked up by structure,
so alternating costs nothing extra).

    python benchmarks/step_structures.py [--framework nnx] [--steps 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

from _common import mlp, mse, parse_steps, regression_batch, step_parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = step_parser(__doc__)
    parser.add_argument("--framework", choices=("pytree", "nnx"), default="pytree")
    return parse_steps(parser, argv)


def run(args: argparse.Namespace) -> dict:
    import jax
    import optax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    batch = regression_batch(mesh, args.batch_size, args.width)
    new_state = mlp([args.width] * 4 + [10], args.framework).new_state
    loss_fn = mse

    step = sx.make_train_step(loss_fn, mesh=mesh)
    adam, chained = optax.adam(1e-3), optax.chain(optax.adam(1e-3))
    states = {
        "one": [step.shard(new_state(adam)), step.shard(new_state(adam))],
        "two": [step.shard(new_state(adam)), step.shard(new_state(chained))],
    }
    assert jax.tree.structure(states["two"][0]) != jax.tree.structure(states["two"][1])
    times: dict[str, list[float]] = {"one": [], "two": []}
    for round_ in range(args.warmup + args.steps):
        for name in ("one", "two") if round_ % 2 == 0 else ("two", "one"):
            for i in range(2):
                start = time.perf_counter()
                states[name][i], metrics = step(states[name][i], batch)
                jax.block_until_ready((states[name][i], metrics))
                if round_ >= args.warmup:
                    times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "framework": args.framework,
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "timed_steps_each": 2 * args.steps,
        "median_ms": {name: 1e3 * m for name, m in medians.items()},
        "ratio": medians["two"] / medians["one"],
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    ms = result["median_ms"]
    print(
        f"{result['framework']} MLP, {result['devices']} {result['platform']} devices, "
        f"JAX {result['jax']}, median of {result['timed_steps_each']} steps each"
    )
    print(f"one structure  {ms['one']:8.3f} ms/step")
    print(f"two, alternate {ms['two']:8.3f} ms/step   ratio {result['ratio']:.3f} (goal <= 1.05)")
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
