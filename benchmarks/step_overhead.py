"""Overhead of shardax's train step against a hand-written ``jax.jit`` step.

On 8 simulated CPU devices (or the accelerators present), one MLP is trained by:

- ``hand``: a hand-written ``jax.jit`` step with the plan's in/out shardings, the batch
  sharding and donation: what a careful JAX user writes;
- ``hand+norm``: the same, also returning ``optax.global_norm(grads)``;
- ``jit``, ``shard_map``, ``pmap``: ``sx.make_train_step(..., stats=())`` in those modes:
  the bare step, which does the hand-written step's work;
- ``default``: ``sx.make_train_step`` with its defaults (statistics: the learning rate
  when the optimizer injects one, which is free), against ``hand``;
- ``jit+stats``: the ``jit`` step asked for the grad norm on every step, against
  ``hand+norm``, which does the same work;
- ``jit+norm/10``: the grad norm asked for with ``stats_every=10`` (a loop logging every
  10 steps: computed under ``lax.cond`` on one step in ten), against ``hand``;
- ``jit+log``: ``default`` with tracking on: ``sx.track.StepClock`` ticks every step and
  ``sx.MetricWriter`` (JSONL + TensorBoard event files) gets the step's metrics and the
  clock's window every ``--log-every`` steps (default 1, the worst case).

The steps run interleaved (one of each per round, in alternating order, so drift hits
all alike) on the same device-resident global batch; each step is timed to
``block_until_ready``. The table gives the median over the warm rounds and each
median's ratio to the row named in "versus". Goals: jit / hand <= 1.03,
default / hand <= 1.03, jit+stats / hand+norm <= 1.03, jit+log / default <= 1.03.
jit+stats / jit is what the grad norm costs: one more pass over the gradients on every
device, which 8 simulated devices on a few CPU cores pay 8 times over.

    python benchmarks/step_overhead.py                 # table
    python benchmarks/step_overhead.py --json          # one JSON object
    python benchmarks/step_overhead.py --framework nnx --steps 200
    python benchmarks/step_overhead.py --model gpt     # the GPT, fsdp and fsdp+tp

With ``--model gpt`` it times the GPT of :mod:`shardax.models.gpt` instead: the shardax
jit step against a hand-written ``jax.jit`` step with the same state and batch shardings
and donation, for the ``fsdp`` and ``fsdp+tp`` plans, bare and with the grad norm on both
sides (goal <= 1.03); the shardax step
in bf16 against fp32 (a CPU figure: report only); and the compiled step's temporary
memory (``memory_analysis().temp_size_in_bytes``) per remat policy, layers in
``lax.scan`` (XLA:CPU keeps remat's savings only inside a loop body) and unrolled.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from _common import mlp, mse, parse_steps, regression_batch, step_parser, time_in_turns


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = step_parser(__doc__)
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--framework", choices=("pytree", "nnx"), default="pytree")
    parser.add_argument("--gpt-batch", type=int, default=16, help="GPT global batch")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    parser.add_argument("--log-every", type=int, default=1, help="jit+log: write every N steps")
    return parse_steps(parser, argv)


VERSUS = {
    "hand+norm": "hand",
    "jit": "hand",
    "shard_map": "jit",
    "pmap": "jit",
    "default": "hand",
    "jit+stats": "hand+norm",
    "jit+norm/10": "hand",
    "jit+log": "default",
}
"""The row each step's median is divided by: the one doing the same work."""


def hand_step(loss: Callable, tx: Any, shardings: Any, mesh: Any, norm: bool) -> Callable:
    """A hand-written ``jax.jit`` step ``((params, opt_state), batch) -> (state, metrics)``
    with ``shardings`` in and out, the batch split over ``data`` and the state donated;
    with ``norm`` its metrics carry ``optax.global_norm(grads)``, as shardax's default."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx

    def update(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": value}
        if norm:
            metrics["grad_norm"] = optax.global_norm(grads)
        return (optax.apply_updates(params, updates), opt_state), metrics

    scalar = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        update,
        in_shardings=(shardings, sx.batch_sharding(mesh)),
        out_shardings=(shardings, scalar),
        donate_argnums=0,
    )


def run(args: argparse.Namespace) -> dict:
    import jax
    import optax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    tx = optax.adam(1e-3)
    sizes = [args.width] * (args.depth + 1) + [10]
    batch = regression_batch(mesh, args.batch_size, args.width)
    model = mlp(sizes, args.framework)

    def new_state():
        return model.new_state(tx)

    def hand_init():
        params = model.params()
        return params, tx.init(params)

    hand_loss, loss_fn = model.loss, mse

    plan = sx.replicate(mesh)
    steps, states = {}, {}
    for name, norm in (("hand", False), ("hand+norm", True)):
        states[name] = sx.shard(hand_init(), plan)
        steps[name] = hand_step(hand_loss, tx, plan(states[name]), mesh, norm)
    for mode in ("jit", "shard_map", "pmap"):
        steps[mode] = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, mode=mode, stats=())
        states[mode] = steps[mode].shard(new_state())
    for name, kw in (
        ("default", {}),
        ("jit+stats", {"stats": ("grad_norm",)}),
        ("jit+norm/10", {"stats": ("grad_norm",), "stats_every": 10}),
    ):
        steps[name] = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, **kw)
        states[name] = steps[name].shard(new_state())

    # jit+log: its own jit step and state, logging through the async writer.
    log_dir = tempfile.mkdtemp(prefix="shardax-step-overhead-")
    writer = sx.MetricWriter(log_dir, log_dir=log_dir)
    clock = sx.track.StepClock(args.batch_size)
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

    medians, outs = time_in_turns(steps, states, batch, args.steps, args.warmup)
    losses = {name: float(out["loss"]) for name, out in outs.items()}
    writer.close()
    shutil.rmtree(log_dir)
    rows = [
        {
            "step": name,
            "median_ms": 1e3 * medians[name],
            "versus": VERSUS.get(name, ""),
            "ratio": medians[name] / medians[VERSUS[name]] if name in VERSUS else 1.0,
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


def run_gpt(args: argparse.Namespace) -> dict:
    """The GPT rows: overhead per plan, bf16 / fp32, remat temporary memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.data.text import lm_batch
    from shardax.models import gpt

    cfg = gpt.GPTConfig(layers=2, d_model=64, heads=4, max_seq_len=64)
    tx = optax.adam(1e-3)
    text = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
    host_batch = lm_batch(text, args.gpt_batch, 64, 0, 1)

    def loss_fn(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def make(cfg, remat="none"):
        return gpt.make_gpt(cfg, 0, remat=remat)

    graphdef = nnx.graphdef(make(cfg))

    def hand_loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    overhead = []
    for plan_name in ("fsdp", "fsdp+tp"):
        mesh = sx.make_mesh({"data": -1} if plan_name == "fsdp" else {"data": -1, "model": 2})
        batch = sx.distribute_batch(host_batch, sx.batch_sharding(mesh))
        plan = gpt.plan(mesh, make(cfg), plan_name)
        params = nnx.state(make(cfg), nnx.Param)
        steps, states = {}, {}
        for norm in (False, True):
            # from_nnx matches path suffixes: Adam's moments follow their params.
            states[f"hand{norm}"] = sx.shard((params, tx.init(params)), plan)
            shardings = plan(states[f"hand{norm}"])
            steps[f"hand{norm}"] = hand_step(hand_loss, tx, shardings, mesh, norm)
            kw = {"stats": ("grad_norm",)} if norm else {}  # else: the defaults
            steps[f"sx{norm}"] = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, **kw)
            states[f"sx{norm}"] = steps[f"sx{norm}"].shard(sx.TrainState.create(make(cfg), tx))
        with jax.sharding.set_mesh(mesh):
            medians, _ = time_in_turns(steps, states, batch, args.steps, args.warmup)
        for norm in (False, True):
            hand, shardax = medians[f"hand{norm}"], medians[f"sx{norm}"]
            overhead.append(
                {
                    "plan": plan_name,
                    "stats": "grad_norm" if norm else "default",
                    "mesh": dict(mesh.shape),
                    "hand_ms": 1e3 * hand,
                    "shardax_ms": 1e3 * shardax,
                    "ratio": shardax / hand,
                }
            )

    mesh = sx.make_mesh({"data": -1})
    batch = sx.distribute_batch(host_batch, sx.batch_sharding(mesh))
    plan = gpt.plan(mesh, make(cfg), "fsdp")
    steps, states = {}, {}
    for name in ("fp32", "bf16"):
        steps[name] = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, precision=name)
        states[name] = steps[name].shard(sx.TrainState.create(make(cfg), tx))
    medians, _ = time_in_turns(steps, states, batch, args.steps, args.warmup)
    precision = {
        "fp32_ms": 1e3 * medians["fp32"],
        "bf16_ms": 1e3 * medians["bf16"],
        "ratio": medians["bf16"] / medians["fp32"],
    }

    remat = []
    deep = gpt.GPTConfig(layers=4, d_model=64, heads=4, max_seq_len=64)
    for scan in (True, False):
        layout = gpt.GPTConfig(**{**vars(deep), "scan_layers": scan})
        base = None
        for policy in sx.parallel.REMAT_POLICIES:
            try:
                model = make(layout, remat=policy)
            except ValueError as e:  # offload where the backend has no host memory
                remat.append({"scan_layers": scan, "policy": policy, "error": str(e)})
                continue
            step = sx.make_train_step(loss_fn, mesh=mesh, plan=gpt.plan(mesh, model, "fsdp"))
            state = step.shard(sx.TrainState.create(model, tx))
            temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
            base = temp if policy == "none" else base
            remat.append(
                {"scan_layers": scan, "policy": policy, "temp_bytes": temp, "ratio": temp / base}
            )
    return {
        "model": "gpt",
        "gpt": {"layers": cfg.layers, "d_model": cfg.d_model, "heads": cfg.heads, "seq_len": 64},
        "batch_size": args.gpt_batch,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "timed_rounds": args.steps,
        "overhead": overhead,
        "precision": precision,
        "remat": remat,
    }


def print_gpt(result: dict) -> None:
    print(
        f"GPT {result['gpt']}, batch {result['batch_size']}, {result['devices']} "
        f"{result['platform']} devices, JAX {result['jax']}, median of "
        f"{result['timed_rounds']} interleaved warm steps"
    )
    print(f"{'plan':<10} {'stats':<10} {'hand ms':>9} {'shardax ms':>11} {'ratio':>7}")
    for row in result["overhead"]:
        print(
            f"{row['plan']:<10} {row['stats']:<10} {row['hand_ms']:>9.2f} "
            f"{row['shardax_ms']:>11.2f} {row['ratio']:>7.3f}"
        )
    p = result["precision"]
    if p:
        print(f"bf16 / fp32 step time: {p['bf16_ms']:.2f} / {p['fp32_ms']:.2f} ms = "
              f"{p['ratio']:.3f} (CPU: no claim)")  # fmt: skip
    print(f"{'layers':<9} {'remat':<22} {'temp MiB':>9} {'vs none':>8}")
    for row in result["remat"]:
        layout = "scan" if row["scan_layers"] else "unrolled"
        if "error" in row:
            print(f"{layout:<9} {row['policy']:<22} {row['error']}")
        else:
            print(
                f"{layout:<9} {row['policy']:<22} {row['temp_bytes'] / 2**20:>9.2f} "
                f"{row['ratio']:>8.3f}"
            )


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model == "gpt":
        result = run_gpt(args)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_gpt(result)
        return result
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
