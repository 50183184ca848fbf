"""Overhead of shardax's train step against a hand-written ``jax.jit`` step.

On 8 simulated CPU devices (or the accelerators present), one MLP is trained by:

- ``hand``: a hand-written ``jax.jit`` step with the plan's in/out shardings, the batch
  sharding and donation: what a careful JAX user writes;
- ``jit``, ``shard_map``, ``pmap``: ``sx.make_train_step`` in those modes;
- ``jit+log``: the ``jit`` step with tracking on: ``sx.StepClock`` ticks every step and
  ``sx.MetricWriter`` (JSONL + TensorBoard event files) gets the step's metrics and the
  clock's window every ``--log-every`` steps (default 1, the worst case).

The steps run interleaved (one of each per round, in alternating order, so drift hits
all alike) on the same device-resident global batch; each step is timed to
``block_until_ready``. The table gives the median over the warm rounds and each
median's ratio to ``hand`` (jit) or to ``jit`` (shard_map, pmap, jit+log). Goals: shardax
jit / hand <= 1.03, jit+log / jit <= 1.03.

    python benchmarks/step_overhead.py                 # table
    python benchmarks/step_overhead.py --json          # one JSON object
    python benchmarks/step_overhead.py --framework nnx --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("pytree", "nnx"), default="pytree")
    parser.add_argument("--steps", type=int, default=100, help="timed rounds (>= 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    parser.add_argument("--log-every", type=int, default=1, help="jit+log: write every N steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present",
    )
    args = parser.parse_args(argv)
    if args.steps < 50:
        parser.error(f"--steps must be >= 50 for a stable median, got {args.steps}")
    return args


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    tx = optax.adam(1e-3)
    sizes = [args.width] * (args.depth + 1) + [10]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, args.width)).astype(np.float32)
    y = rng.normal(size=(args.batch_size, 10)).astype(np.float32)
    batch = sx.distribute_batch({"x": x, "y": y}, sx.batch_sharding(mesh))

    if args.framework == "pytree":

        def apply_fn(params, x):
            for i, (w, b) in enumerate(params):
                x = x @ w + b
                x = jax.nn.relu(x) if i < len(params) - 1 else x
            return x

        def init():
            keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
            return [
                (jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n))
                for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
            ]

        def new_state():
            return sx.TrainState.from_params(init(), apply_fn, tx)

        def hand_init():
            params = init()
            return params, tx.init(params)

        def hand_loss(params, batch):
            return jnp.mean((apply_fn(params, batch["x"]) - batch["y"]) ** 2)

        def hand_update(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(hand_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

    else:

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List(
                    [nnx.Linear(m, n, rngs=rngs) for m, n in itertools.pairwise(sizes)]
                )

            def __call__(self, x):
                for i, layer in enumerate(self.layers):
                    x = layer(x)
                    x = jax.nn.relu(x) if i < len(self.layers) - 1 else x
                return x

        graphdef = nnx.graphdef(MLP(nnx.Rngs(0)))

        def new_state():
            return sx.TrainState.create(MLP(nnx.Rngs(0)), tx)

        def hand_init():
            params = nnx.state(MLP(nnx.Rngs(0)), nnx.Param)
            return params, tx.init(params)

        def hand_loss(params, batch):
            model = nnx.merge(graphdef, params)
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        def hand_update(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(hand_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    plan = sx.replicate(mesh)
    hand_state = sx.shard(hand_init(), plan)
    hand_shardings = plan(hand_state)
    hand_step = jax.jit(
        hand_update,
        in_shardings=(hand_shardings, sx.batch_sharding(mesh)),
        out_shardings=(hand_shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
    steps = {"hand": hand_step}
    states = {"hand": hand_state}
    for mode in ("jit", "shard_map", "pmap"):
        steps[mode] = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, mode=mode)
        states[mode] = steps[mode].shard(new_state())

    # jit+log: its own jit step and state, logging through the async writer.
    log_dir = tempfile.mkdtemp(prefix="shardax-step-overhead-")
    writer = sx.MetricWriter(log_dir, log_dir=log_dir)
    clock = sx.StepClock(args.batch_size)
    logged_step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, mode="jit")
    count = itertools.count(1)

    def logged(state, batch):
        state, metrics = logged_step(state, batch)
        clock.tick()
        n = next(count)
        if n % args.log_every == 0:
            writer.write(n, {**metrics, **clock.lap().scalars()})
        return state, metrics

    steps["jit+log"] = logged
    states["jit+log"] = logged_step.shard(new_state())

    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, float] = {}
    names = list(steps)
    for round_ in range(args.warmup + args.steps):
        # Alternate the order each round, so no step always runs first or last.
        for name in names if round_ % 2 == 0 else names[::-1]:
            step = steps[name]
            start = time.perf_counter()
            states[name], out = step(states[name], batch)
            jax.block_until_ready((states[name], out))
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
            losses[name] = float(out if name == "hand" else out["loss"])

    writer.close()
    shutil.rmtree(log_dir)
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = [
        {
            "step": name,
            "median_ms": 1e3 * medians[name],
            "versus": "hand" if name == "jit" else ("" if name == "hand" else "jit"),
            "ratio": medians[name] / medians["hand" if name == "jit" else "jit"]
            if name != "hand"
            else 1.0,
        }
        for name in steps
    ]
    return {
        "framework": args.framework,
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "batch_size": args.batch_size,
        "mlp": sizes,
        "timed_rounds": args.steps,
        "log_every": args.log_every,
        "rows": rows,
        "final_loss": losses,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(
        f"{result['framework']} MLP {result['mlp']}, batch {result['batch_size']}, "
        f"{result['devices']} {result['platform']} devices, median of "
        f"{result['timed_rounds']} interleaved warm steps"
    )
    print(f"{'step':<10} {'median ms':>10} {'ratio':>8}  versus")
    for row in result["rows"]:
        versus = row["versus"] or "-"
        print(f"{row['step']:<10} {row['median_ms']:>10.3f} {row['ratio']:>8.3f}  {versus}")
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
