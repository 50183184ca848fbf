"""Seed 003's notebook, through shardax: one Linen MLP trained in every mode.

The notebook compares single-device jit, jit over a sharded batch, and pmap on a deep MLP
with a Linen ``TrainState`` and optax adam. Here the same model and loss go through
``sx.TrainState.from_linen`` and ``sx.make_train_step`` in the modes "single", "jit",
"pmap" and "shard_map"; the script prints the median step time per mode and checks that
every mode's losses agree with "single".

    python examples/seed_notebook_modes.py            # small sizes (seconds, on CPU)
    python examples/seed_notebook_modes.py --full     # the notebook's sizes (a GPU job)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

SMALL = {"batch_size": 256, "input_dim": 64, "hidden_dim": 128, "n_layers": 4}
FULL = {"batch_size": 256 * 27, "input_dim": 1024, "hidden_dim": 2056, "n_layers": 90}
MODES = ("single", "jit", "pmap", "shard_map")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the notebook's sizes")
    for name, value in SMALL.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"default {value} (full: {FULL[name]})",
        )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present",
    )
    args = parser.parse_args(argv)
    sizes = FULL if args.full else SMALL
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    """Trains in each mode; returns the losses per mode."""
    args = parse_args(argv)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardax as sx

    class MLP(nn.Module):
        """The notebook's multilayer perceptron."""

        n_layers: int
        hidden_dim: int
        output_dim: int

        def setup(self) -> None:
            self.layers = [nn.Dense(self.hidden_dim) for _ in range(self.n_layers)]
            self.output_layer = nn.Dense(self.output_dim)

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = nn.relu(layer(x))
            return self.output_layer(x)

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    mesh = sx.make_mesh({"data": -1})
    model = MLP(n_layers=args.n_layers, hidden_dim=args.hidden_dim, output_dim=10)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, args.input_dim)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x[:, :10]).astype(np.float32)}
    variables = jax.jit(model.init)(jax.random.key(0), x[:1])

    print(
        f"{mesh.size} {jax.devices()[0].platform} devices; batch {args.batch_size}, "
        f"{args.n_layers} layers of {args.hidden_dim}"
    )
    losses: dict[str, list[float]] = {}
    for mode in args.modes:
        step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode)
        state = step.shard(sx.TrainState.from_linen(model, variables, optax.adam(1e-4)))
        state, metrics = step(state, batch)  # compiles
        jax.block_until_ready(metrics)
        times, losses[mode] = [], [float(metrics["loss"])]
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - start)
            losses[mode].append(float(metrics["loss"]))
        print(
            f"{mode:>9}: {1e3 * statistics.median(times):9.2f} ms/step (median of "
            f"{len(times)}), loss {losses[mode][0]:.5f} -> {losses[mode][-1]:.5f}"
        )

    reference = np.asarray(losses[args.modes[0]])
    for mode in args.modes[1:]:
        diff = float(np.max(np.abs(np.asarray(losses[mode]) - reference) / np.abs(reference)))
        print(f"{mode:>9}: losses agree with {args.modes[0]} to {diff:.1e} (relative)")
        if diff > 1e-3:
            raise SystemExit(f"{mode} losses differ from {args.modes[0]} by {diff:.1e}")
    return losses


if __name__ == "__main__":
    _args = parse_args(sys.argv[1:])
    import jax

    jax.config.update("jax_num_cpu_devices", _args.cpu_devices)  # before any backend starts
    main(sys.argv[1:])
