"""Step time of ``sx.make_train_step`` in fp32, bf16 and fp16 (loss scaling).

One MLP (pytree params, Adam) is trained by three ``jit``-mode steps that differ only
in ``precision=``. The steps run interleaved (one of each per round, in alternating
order, so drift hits all alike) on the same device-resident global batch; each is
timed to ``block_until_ready``. The table gives the median over the warm rounds and
each median's ratio to fp32. On CPU, bfloat16 and float16 matmuls are not faster than
float32 (XLA:CPU often converts them), so the figure is a report, not a claim.

    python benchmarks/precision.py                 # table
    python benchmarks/precision.py --json          # one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from _common import mlp, mse, parse_steps, regression_batch, step_parser, time_in_turns

PRECISIONS = ("fp32", "bf16", "fp16")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = step_parser(__doc__, width=512, min_steps=20)
    parser.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    return parse_steps(parser, argv)


def run(args: argparse.Namespace) -> dict:
    import jax
    import optax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    sizes = [args.width] * (args.depth + 1) + [10]
    batch = regression_batch(mesh, args.batch_size, args.width)
    model = mlp(sizes)

    def new_state():
        return model.new_state(optax.adam(1e-3))

    loss_fn = mse

    steps = {p: sx.make_train_step(loss_fn, mesh=mesh, precision=p) for p in PRECISIONS}
    states = {p: steps[p].shard(new_state()) for p in PRECISIONS}
    medians, outs = time_in_turns(steps, states, batch, args.steps, args.warmup)
    losses = {p: float(out["loss"]) for p, out in outs.items()}
    return {
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "batch_size": args.batch_size,
        "mlp": sizes,
        "timed_rounds": args.steps,
        "rows": [
            {"precision": p, "median_ms": 1e3 * medians[p], "ratio": medians[p] / medians["fp32"]}
            for p in PRECISIONS
        ],
        "final_loss": losses,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(
        f"MLP {result['mlp']}, batch {result['batch_size']}, {result['devices']} "
        f"{result['platform']} devices, JAX {result['jax']}, median of "
        f"{result['timed_rounds']} interleaved warm steps"
    )
    print(f"{'precision':<10} {'median ms':>10} {'ratio':>8}")
    for row in result["rows"]:
        print(f"{row['precision']:<10} {row['median_ms']:>10.3f} {row['ratio']:>8.3f}")
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
