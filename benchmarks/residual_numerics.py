"""The GPT's loss with a bf16 residual stream and the recomputing norm and GELU, against
the float32 residual stream, all under precision="bf16", on the built-in corpus.

Three runs of the ``shardax train --model gpt`` job's defaults (2 layers, d_model 64, 4
heads, sequence 64, batch 16, AdamW at 3e-3 after 10 warmup steps, gradients clipped at
1.0) start from the same params and see the same batches of the standard library's
sources; they differ only in ``GPTConfig(residual=, elementwise=)``: ``fp32 / autodiff``
(the default), ``bf16 / autodiff`` and ``bf16 / recompute``. The losses are nats per
byte: the training loss averaged over the last 20 steps, and the validation loss (64
windows of the held-out files) after the last step; each gap is against the default.

    python benchmarks/residual_numerics.py              # table, 200 steps
    python benchmarks/residual_numerics.py --json       # one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

VARIANTS = (("fp32", "autodiff"), ("bf16", "autodiff"), ("bf16", "recompute"))
"""``(residual, elementwise)`` of each run; the first is the default the others meet."""
TOLERANCE = 0.01
"""The documented bar: each variant's loss within 0.01 nats per byte of the default's."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardax as sx
    from shardax.data.text import LMBatches, lm_eval_batch, load_corpus
    from shardax.models import gpt

    mesh = sx.make_mesh({"data": -1})
    corpus = load_corpus()
    loader = LMBatches(corpus.train, args.batch_size, args.seq_len, args.seed)
    val = lm_eval_batch(corpus.val, 64, args.seq_len)

    def lm_loss(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    schedule = optax.linear_schedule(0.0, 3e-3, 10)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    step = sx.make_train_step(lm_loss, mesh=mesh, precision="bf16")
    evaluate = sx.make_eval_step(lm_loss, mesh=mesh, precision="bf16")
    cfgs = {
        v: gpt.GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.heads,
                         max_seq_len=max(256, args.seq_len), residual=v[0], elementwise=v[1])
        for v in VARIANTS
    }  # fmt: skip
    states = {v: step.shard(sx.TrainState.create(gpt.make_gpt(c, seed=args.seed), tx))
              for v, c in cfgs.items()}  # fmt: skip
    losses: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    for _, batch in zip(range(args.steps), loader, strict=False):
        for v in VARIANTS:  # the same batch for each
            states[v], metrics = step(states[v], batch)
            losses[v].append(float(metrics["loss"]))
    tail = min(20, args.steps)
    rows = []
    for v in VARIANTS:
        rows.append({"residual": v[0], "elementwise": v[1], "first_loss": losses[v][0],
                     "train_loss": float(np.mean(losses[v][-tail:])),
                     "val_loss": float(evaluate(states[v], val)["loss"])})  # fmt: skip
    base = rows[0]
    for row in rows:
        row["train_gap"] = row["train_loss"] - base["train_loss"]
        row["val_gap"] = row["val_loss"] - base["val_loss"]
    return {
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "config": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                   "seq_len": args.seq_len, "batch": args.batch_size, "steps": args.steps},
        "corpus": corpus.source,
        "rows": rows,
        "tolerance": TOLERANCE,
        "within": all(abs(r["val_gap"]) <= TOLERANCE for r in rows),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    c = result["config"]
    print(
        f"GPT {c['layers']} layers × d {c['d_model']}, batch {c['batch']} × {c['seq_len']}, "
        f"{c['steps']} steps, precision bf16, {result['devices']} {result['platform']} devices, "
        f"JAX {result['jax']}; nats per byte (train: mean of the last 20 steps)"
    )
    print(f"{'residual':<9} {'elementwise':<12} {'first':>8} {'train':>8} {'val':>8} "
          f"{'val gap':>8}")  # fmt: skip
    for r in result["rows"]:
        print(f"{r['residual']:<9} {r['elementwise']:<12} {r['first_loss']:>8.4f} "
              f"{r['train_loss']:>8.4f} {r['val_loss']:>8.4f} {r['val_gap']:>+8.4f}")  # fmt: skip
    print(f"every gap within {result['tolerance']}: {result['within']}")
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
