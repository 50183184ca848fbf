"""``shardax train``: an NNX MLP on scikit-learn's digits, data-parallel on all devices."""

from __future__ import annotations

import argparse
import time

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax train``."""
    parser.add_argument("--epochs", type=int, default=20, help="passes over the data")
    parser.add_argument(
        "--batch-size", type=int, default=128, help="global batch size (default: 128)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def load_digits(seed: int) -> tuple[np.ndarray, ...]:
    """The 8×8 digits shipped inside scikit-learn, split 80/20, scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "shardax train needs scikit-learn for its demo data: pip install 'shardax[demo]'"
        ) from e
    x, y = _load(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def run(args: argparse.Namespace) -> int:
    """Trains and prints the loss per epoch and the test accuracy."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    if args.batch_size % mesh.size:
        raise SystemExit(
            f"shardax train: error: --batch-size {args.batch_size} is not divisible by the "
            f"{mesh.size} devices of the data axis"
        )
    x_train, y_train, x_test, y_test = load_digits(args.seed)

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.hidden = nnx.Linear(64, 256, rngs=rngs)
            self.out = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(nnx.relu(self.hidden(x)))

    def loss_fn(model, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    step = sx.make_train_step(loss_fn, mesh=mesh)
    state = step.shard(sx.TrainState.create(MLP(nnx.Rngs(args.seed)), optax.adam(3e-3)))
    data = sx.batch_sharding(mesh)

    print(f"training on {mesh.size} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}")
    rng = np.random.default_rng(args.seed)
    steps_per_epoch = len(x_train) // args.batch_size
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            batch = sx.distribute_batch((x_train[idx], y_train[idx]), data)
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        print(f"epoch {epoch + 1:3d}  loss {float(jnp.mean(jnp.stack(losses))):.4f}")
    model = state.model
    accuracy = float(jnp.mean(jnp.argmax(model(jnp.asarray(x_test)), -1) == y_test))
    print(f"test accuracy {accuracy:.4f} in {time.perf_counter() - start:.1f} s")
    return 0
