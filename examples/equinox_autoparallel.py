"""Seed 004, "Autoparallelism", through shardax: an Equinox MLP trained data-parallel.

The Equinox example shards each batch over 8 devices with the (now removed)
``PositionalSharding`` and lets jit follow the data. Here the same model, loss and
data loader go through ``sx.TrainState.create`` and ``sx.make_train_step``: the batch is
split over the mesh's data axis, the state is replicated, and the state's buffers are
donated (the example's ``filter_jit(donate="all")`` tip). The script checks that the
8-device run matches the same training on one device.

    python examples/equinox_autoparallel.py                      # the example's sizes
    python examples/equinox_autoparallel.py --dataset-size 65536 --batch-size 1024 \\
        --hidden-size 1024 --depth 4 --steps 200                 # bigger
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator, Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-size", type=int, default=64)
    parser.add_argument("--channel-size", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="global batch; a multiple of the number of devices",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present",
    )
    return parser.parse_args(argv)


def dataloader(arrays: Sequence, batch_size: int, seed: int = 0) -> Iterator[tuple]:
    """The example's loader: shuffled slices of NumPy arrays, forever."""
    import numpy as np

    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = np.arange(dataset_size)
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(indices)
        for start in range(0, dataset_size - batch_size + 1, batch_size):
            batch_perm = perm[start : start + batch_size]
            yield tuple(array[batch_perm] for array in arrays)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Trains on all devices and on one; returns the multi-device losses."""
    args = parse_args(argv)
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardax as sx

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(args.dataset_size, args.channel_size)).astype(np.float32)
    ys = np.sin(xs)

    def compute_loss(model, batch):
        x, y = batch
        pred_y = jax.vmap(model)(x)
        return jnp.mean((y - pred_y) ** 2)

    mesh = sx.make_mesh({"data": -1})
    results = {}
    for mode in ("jit", "single"):
        model = eqx.nn.MLP(
            args.channel_size,
            args.channel_size,
            args.hidden_size,
            args.depth,
            key=jax.random.key(6789),
        )
        step = sx.make_train_step(compute_loss, mesh=mesh, mode=mode)
        state = step.shard(sx.TrainState.create(model, optax.adam(args.learning_rate)))
        losses = []
        for batch in itertools.islice(dataloader((xs, ys), args.batch_size), args.steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results[mode] = (state, losses)

    state, losses = results["jit"]
    print(
        f"{mesh.size} devices, params {state.params.layers[0].weight.sharding.spec} "
        f"(replicated), loss {losses[0]:.5f} -> {losses[-1]:.5f}"
    )
    single = results["single"][1]
    diff = float(np.max(np.abs(np.asarray(losses) - single) / np.abs(single)))
    print(f"matches one device to {diff:.1e} (relative, per-step losses)")
    if diff > 1e-4:
        raise SystemExit(f"the {mesh.size}-device losses differ from one device by {diff:.1e}")
    return losses


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
