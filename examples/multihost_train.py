"""The many-hosts guide's ``train.py``: one script, run alone or as N processes of one run.

Every process runs the same program. ``sx.initialize()`` joins the run (from ``shardax
launch``, SLURM, Open MPI or ``JAX_COORDINATOR_ADDRESS``; alone, it does nothing), the mesh
spans every device of every process, each process reads its own rows of each global batch,
and ``sx.global_batch`` assembles them into one ``jax.Array`` over the mesh. The step is
FSDP: the parameters and Adam's state are split over all devices of all processes. The data
is a synthetic regression, the same on every host, so it runs anywhere:

    python examples/multihost_train.py --cpu-devices 8                     # one process
    shardax launch -n 2 --cpu-devices 4 -- python examples/multihost_train.py   # 2 x 4 devices
    srun --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 python examples/multihost_train.py
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data (3)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size (256)")
    parser.add_argument("--rows", type=int, default=2048, help="rows of synthetic data (2048)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (256)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (3e-3)")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="simulated CPU devices per process without an accelerator (default: "
        "$SHARDAX_CPU_DEVICES, which shardax launch --cpu-devices sets, else JAX's)",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "rows", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains (after ``sx.initialize()``, which the script calls first); returns the first
    and last loss, the number of processes and devices, and a kernel's sharding spec."""
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import shardax as sx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(16, args.hidden, rngs=rngs)
            self.down = nnx.Linear(args.hidden, 1, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    # The same data on every host (a real loader reads its own files: sx.batches then
    # takes this process's rows of each global batch either way).
    x = np.random.default_rng(0).normal(size=(args.rows, 16)).astype(np.float32)
    data = {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True))}

    mesh = sx.make_mesh({"data": -1})  # every device of every process
    # The same setup everywhere, or an error naming what differs (not a hang later).
    sx.runtime.check_agreement(config=vars(args), mesh=mesh)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=1024))
    state = step.shard(sx.TrainState.create(MLP(nnx.Rngs(0)), optax.adam(args.lr)))
    sx.print0(
        f"{jax.process_count()} process(es), {jax.device_count()} devices "
        f"({jax.local_device_count()} here), mesh {dict(mesh.shape)}"
    )

    losses = []
    loader = sx.batches(data, args.batch_size, shuffle=True, num_epochs=args.epochs)
    for local in loader:  # this process's rows of each global batch
        state, metrics = step(state, sx.global_batch(local, mesh))  # metrics: global means
        losses.append(float(metrics["loss"]))
        if len(losses) % 8 == 1:
            sx.print0(f"step {len(losses):3d}  loss {losses[-1]:.4f}")  # once, by process 0
    spec = state.params["up"]["kernel"][...].sharding.spec
    sx.print0(f"step {len(losses):3d}  loss {losses[-1]:.4f}; up kernel spec {spec}")
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": len(losses),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "spec": spec,
    }


if __name__ == "__main__":
    import sys

    import shardax as sx

    sx.initialize(cpu_devices=parse_args(sys.argv[1:]).cpu_devices)  # first, before JAX runs
    main(sys.argv[1:])
