"""Seed 001's "complete training example", made to work for real.

The seed sketches an NNX model, ``DeviceMeshManager``, ``DataParallel`` and an optimizer,
then leaves the training step as "wrap this in @jax.jit". Here the step is shardax's:
``TrainState.create(model, tx)`` splits the NNX module, ``make_train_step`` compiles one
data-parallel update, and the seed's ``DataParallel`` places the batches. The data is a
synthetic classification task, so the script runs anywhere and shows the loss falling
and the accuracy rising.

    python examples/nnx_data_parallel.py                # small (seconds on CPU)
    python examples/nnx_data_parallel.py --full         # larger model, more steps
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator, Sequence

SMALL = {"batch_size": 64, "hidden": 64, "steps": 60, "features": 16}
FULL = {"batch_size": 1024, "hidden": 1024, "steps": 500, "features": 256}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="larger sizes")
    for name, value in SMALL.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"default {value} (full: {FULL[name]})",
        )
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present",
    )
    args = parser.parse_args(argv)
    for name, value in (FULL if args.full else SMALL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def dataloader(features: int, classes: int, batch_size: int, seed: int = 0) -> Iterator[dict]:
    """Gaussian clusters, one per class: ``{"x": (B, features), "y": (B,)}``, forever."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, features)).astype(np.float32)
    while True:
        y = rng.integers(0, classes, size=batch_size)
        x = centers[y] + 0.8 * rng.normal(size=(batch_size, features)).astype(np.float32)
        yield {"x": x.astype(np.float32), "y": y.astype(np.int32)}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Trains; returns the first and last loss and the last accuracy."""
    args = parse_args(argv)
    import optax
    from flax import nnx

    import shardax as sx

    class MyModel(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.hidden = nnx.Linear(args.features, args.hidden, rngs=rngs)
            self.norm = nnx.LayerNorm(args.hidden, rngs=rngs)
            self.out = nnx.Linear(args.hidden, args.classes, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.gelu(self.norm(self.hidden(x))))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    # Setup, as in the seed.
    manager = sx.DeviceMeshManager()
    mesh = manager.create_data_parallel_mesh()
    dp = sx.DataParallel()

    # Create model and optimizer; the state replicates the model (seed: shard_model_state).
    model = MyModel(rngs=nnx.Rngs(0))
    step = sx.make_train_step(loss_fn, mesh=mesh)
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-3)))

    # Create shardings.
    data_sharding = dp.create_data_parallel_sharding(mesh)

    # Training loop.
    history = []
    batches = dataloader(args.features, args.classes, args.batch_size)
    for i, batch in enumerate(itertools.islice(batches, args.steps)):
        sharded_batch = dp.shard_batch(batch, data_sharding)
        state, metrics = step(state, sharded_batch)
        history.append({k: float(v) for k, v in metrics.items()})
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(
                f"step {i:4d}  loss {history[-1]['loss']:.4f}  "
                f"accuracy {history[-1]['accuracy']:.3f}"
            )

    kernel = state.params["hidden"]["kernel"][...]
    print(
        f"{mesh.size} devices; batch spec {sharded_batch['x'].sharding.spec}, "
        f"hidden kernel spec {kernel.sharding.spec}"
    )
    trained = state.model  # an nnx.Module again, for evaluation
    x = next(batches)["x"]
    print(f"trained model: {type(trained).__name__}, logits {trained(x).shape}")
    return {
        "first_loss": history[0]["loss"],
        "last_loss": history[-1]["loss"],
        "accuracy": history[-1]["accuracy"],
    }


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
