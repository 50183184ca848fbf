"""The GPT at 4× the sequence length in the same memory per device, with equal losses.

Four runs of the GPT that ``shardax train --model gpt`` trains (its model, corpus,
replicated plan and optimizer, built here from the public API), on 8 simulated CPU
devices:

- **base**: ``--mesh data=8 --seq-len L --batch-size 8``, one row of L tokens per
  device: the longest sequence that fits a per-device budget of this run's memory;
- **context**: ``--mesh data=2,context=4 --seq-len 4L --batch-size 2``, ring attention:
  each row of 4L tokens split over 4 devices, again L tokens per device;
- **data_only**: ``--mesh data=2 --seq-len 4L --batch-size 2``: the same rows on a
  data-only mesh;
- **reference**: ``--mode single --seq-len 4L --batch-size 2``, the same rows and model
  on one device, without context parallelism.

For each: the compiled step's memory per device (``memory_analysis()``: arguments +
temporaries + outputs not aliased to arguments), then ``--steps`` steps from the same
initial state. The claim: the context run needs at most the base run's memory (within
15%), where the same rows without a context axis need several times as much per device
(``data_only``: ``--mesh data=2``, the data-only mesh that can split 2 rows; the
attention scores grow with the square of the length), and its losses equal the
reference's to rtol 1e-5.

    uv run python benchmarks/context_parallel_gpt.py
    uv run python benchmarks/context_parallel_gpt.py --seq-len 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

WARMUP_STEPS = 10  # as ``shardax train --model gpt``: linear warm-up, then the peak rate


def run_job(run: dict[str, Any], model: dict[str, int], steps: int, lr: float = 3e-3) -> dict:
    """The GPT of ``shardax train --model gpt`` (its corpus, model, replicated plan and
    optimizer) from the public API: ``run`` gives ``mesh`` (None: one device, mode
    ``"single"``), ``seq_len``, ``batch_size`` and ``attention``; ``model`` the
    ``GPTConfig`` sizes. Returns its compiled memory per device and the losses of
    ``steps`` steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.data.text import LMBatches, batch_layout, load_corpus
    from shardax.models import gpt
    from shardax.train.auto import measure

    single = run["mesh"] is None
    mesh = sx.make_mesh(run["mesh"] or {"data": 1}, devices=jax.devices()[:1] if single else None)
    context = mesh.shape.get("context", 1)
    layout = batch_layout(context)
    cfg = gpt.GPTConfig(**model, attention=run.get("attention", "auto"))
    loader = LMBatches(load_corpus().train, run["batch_size"], run["seq_len"], 0,
                       context=context)  # fmt: skip

    def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
        logits = model(batch["inputs"], positions=batch.get("positions"), layout=layout)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    schedule = optax.linear_schedule(0.0, lr, WARMUP_STEPS)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    if single:
        step = sx.make_train_step(loss_fn, mesh=mesh, mode="single")
    else:
        abstract = nnx.eval_shape(lambda: gpt.make_gpt(cfg, 0))
        step = sx.make_train_step(loss_fn, mesh=mesh, plan=gpt.plan(mesh, abstract, "replicate"),
                                  seq_axis="context" if context > 1 else None)  # fmt: skip
    state = step.init(lambda: sx.TrainState.create(gpt.make_gpt(cfg, 0), tx, rng=0))
    batches = iter(loader)
    first = next(batches)
    # arguments + outputs - donated aliases + temporaries, as sx.auto_plan measures plans
    measured = measure("gpt", step.lower(state, first).compile(), step.plan)
    memory = {"arguments": measured.argument_bytes, "temporaries": measured.temp_bytes,
              "total": measured.total_bytes}  # fmt: skip
    losses, batch = [], first
    sharding = sx.batch_sharding(mesh)
    for _ in range(steps):
        state, metrics = step(state, sx.distribute_batch(batch, sharding))
        losses.append(float(metrics["loss"]))
        batch = next(batches)
    jax.block_until_ready(state)
    return {"run": run, "mesh": dict(mesh.shape), "memory": memory,
            "losses": np.asarray(losses).tolist()}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512, help="L, the base run's length")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--attention", default="ring", help="the context run's scheme")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    length = args.seq_len
    model = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
             "max_seq_len": 4 * length}  # fmt: skip
    long = {"seq_len": 4 * length, "batch_size": 2}
    runs = {
        "base": {"mesh": {"data": 8}, "seq_len": length, "batch_size": 8},
        "context": {"mesh": {"data": 2, "context": 4}, "attention": args.attention, **long},
        "data_only": {"mesh": {"data": 2}, **long},
        "reference": {"mesh": None, **long},
    }
    results = {name: run_job(run, model, args.steps) for name, run in runs.items()}
    base = results["base"]["memory"]["total"]
    print(f"GPT layers={args.layers} d={args.d_model} heads={args.heads}, fp32, per device "
          f"(memory_analysis: arguments + temporaries + outputs not donated)")  # fmt: skip
    print(f"{'run':<10}{'mesh':<22}{'seq':>6}{'MiB':>9}{'× base':>8}  losses")
    for name, r in results.items():
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        seq = length if name == "base" else 4 * length
        total = r["memory"]["total"]
        r["ratio_to_base"] = total / base
        shown = " ".join(f"{x:.5f}" for x in r["losses"])
        print(f"{name:<10}{mesh:<22}{seq:>6}{total / 2**20:>9.2f}{total / base:>8.2f}  {shown}")
    diff = np.abs(np.subtract(results["context"]["losses"], results["reference"]["losses"]))
    rel = float(np.max(diff / np.abs(results["reference"]["losses"])))
    results["context_vs_reference_max_rel"] = rel
    print(f"context vs one device at 4L: max relative loss difference {rel:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "jax": jax.__version__, **results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
