"""The keep-loop step: a user's ``@nnx.jit`` step after ``sx.prepare``, against the same
step on arrays placed by hand.

On 8 simulated CPU devices (or the accelerators present), one NNX MLP with an
``nnx.Optimizer`` (Adam) is trained by the same ``@nnx.jit`` step, written as flax's
examples write it, in two copies:

- ``prepare``: model and optimizer placed by ``sx.prepare(model, optimizer, mesh=mesh,
  plan=...)``;
- ``hand``: model and optimizer placed by ``jax.device_put`` of every variable with the
  same shardings (what a careful JAX user writes by hand).

The steps run interleaved (one of each per round, in alternating order) on the same
device-resident global batch, each timed to ``block_until_ready``; the table gives the
medians and their ratio. Goal: prepare / hand <= 1.03 (``sx.prepare`` only places).

    python benchmarks/keep_loop.py                     # fsdp, table
    python benchmarks/keep_loop.py --plan replicate --json
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from _common import parse_steps, step_parser, time_in_turns


def main(argv: Sequence[str] | None = None) -> dict:
    parser = step_parser(__doc__)
    parser.add_argument("--plan", choices=["replicate", "fsdp", "zero1"], default="fsdp")
    args = parse_steps(parser, argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import numpy as np
    import optax
    from flax import nnx

    import shardax as sx

    width = args.width

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(width, width, rngs=rngs)
            self.linear2 = nnx.Linear(width, width, rngs=rngs)
            self.linear3 = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x):
            return self.linear3(nnx.relu(self.linear2(nnx.relu(self.linear1(x)))))

    def loss_fn(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    def new():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    mesh = sx.make_mesh({"data": -1})
    plan = {"replicate": sx.replicate, "fsdp": sx.fsdp, "zero1": sx.zero1}[args.plan](mesh)
    prepared = sx.prepare(*new(), mesh=mesh, plan=plan)
    hand = new()
    # By hand: every variable device_put with the sharding sx.prepare chose for it.
    for ours, theirs in zip(prepared, hand, strict=True):
        shardings = jax.tree.map(lambda x: x.sharding, nnx.state(ours))
        nnx.update(theirs, jax.device_put(nnx.state(theirs), shardings))
    rng = np.random.default_rng(0)
    batch = sx.distribute_batch(
        {
            "x": rng.normal(size=(args.batch_size, width)).astype(np.float32),
            "y": rng.normal(size=(args.batch_size, 10)).astype(np.float32),
        },
        sx.batch_sharding(mesh),
    )

    def step(state, batch):
        return state, train_step(*state, batch)

    medians, outs = time_in_turns(
        {"prepare": step, "hand": step},
        {"prepare": prepared, "hand": hand},
        batch,
        args.steps,
        args.warmup,
    )
    np.testing.assert_allclose(float(outs["prepare"]), float(outs["hand"]), rtol=1e-5)
    result = {
        "plan": args.plan,
        "devices": mesh.size,
        "width": width,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "prepare_ms": medians["prepare"] * 1e3,
        "hand_ms": medians["hand"] * 1e3,
        "ratio": medians["prepare"] / medians["hand"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"plan {args.plan}, {mesh.size} devices, MLP width {width}, batch {args.batch_size}")
        print(f"  prepare  {result['prepare_ms']:8.3f} ms   (sx.prepare, then the user's step)")
        print(f"  hand     {result['hand_ms']:8.3f} ms   (jax.device_put by hand)")
        print(f"  ratio    {result['ratio']:8.3f}      (goal <= 1.03)")
    return result


if __name__ == "__main__":
    main()
