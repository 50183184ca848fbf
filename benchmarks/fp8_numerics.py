"""The GPT's loss under precision="fp8" against "bf16", on the built-in corpus.

Two steps of the ``shardax train --model gpt`` job's defaults (2 layers, d_model 64, 4
heads, sequence 64, batch 16, AdamW at 3e-3 after 10 warmup steps, gradients clipped at
1.0) start from the same params and see the same batches of the standard library's
sources; they differ only in ``precision=``. fp8 runs the blocks' matmuls as fp8 GEMMs
(E4M3 forward, E5M2 gradients, current per-tensor scaling; the head and the embedding in
bf16). On the CPU XLA computes the fp8 dots over widened fp8 values: the numerics are a
GPU's, the speed is not, so this is a loss figure only. The losses are nats per byte: the
training loss averaged over the last 20 steps, and the validation loss (64 windows of
the held-out files) after the last step.

    python benchmarks/fp8_numerics.py              # table, 200 steps
    python benchmarks/fp8_numerics.py --json       # one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

PRECISIONS = ("bf16", "fp8")
TOLERANCE = 0.01
"""The issue's bar: fp8's loss within 0.01 nats per byte of bf16's."""


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
    cfg = gpt.GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.heads,
                        max_seq_len=max(256, args.seq_len))  # fmt: skip
    corpus = load_corpus()
    loader = LMBatches(corpus.train, args.batch_size, args.seq_len, args.seed)
    val = lm_eval_batch(corpus.val, 64, args.seq_len)

    def lm_loss(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    schedule = optax.linear_schedule(0.0, 3e-3, 10)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    steps = {p: sx.make_train_step(lm_loss, mesh=mesh, precision=p) for p in PRECISIONS}
    evals = {p: sx.make_eval_step(lm_loss, mesh=mesh, precision=p) for p in PRECISIONS}
    states = {
        p: steps[p].shard(sx.TrainState.create(gpt.make_gpt(cfg, seed=args.seed), tx))
        for p in PRECISIONS
    }
    losses: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for _, batch in zip(range(args.steps), loader, strict=False):
        for p in PRECISIONS:  # the same batch for both
            states[p], metrics = steps[p](states[p], batch)
            losses[p].append(float(metrics["loss"]))
    tail = min(20, args.steps)
    rows = []
    for p in PRECISIONS:
        val_loss = float(evals[p](states[p], val)["loss"])
        rows.append({"precision": p, "train_loss": float(np.mean(losses[p][-tail:])),
                     "val_loss": val_loss, "first_loss": losses[p][0]})  # fmt: skip
    bf16, fp8 = rows
    return {
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "config": {
            "layers": cfg.layers,
            "d_model": cfg.d_model,
            "heads": cfg.heads,
            "seq_len": args.seq_len,
            "batch": args.batch_size,
            "steps": args.steps,
        },
        "corpus": corpus.source,
        "rows": rows,
        "train_gap": fp8["train_loss"] - bf16["train_loss"],
        "val_gap": fp8["val_loss"] - bf16["val_loss"],
        "tolerance": TOLERANCE,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    c = result["config"]
    print(
        f"GPT {c['layers']} layers × d {c['d_model']}, batch {c['batch']} × {c['seq_len']}, "
        f"{c['steps']} steps, {result['devices']} {result['platform']} devices, JAX "
        f"{result['jax']}; loss in nats per byte (train: mean of the last 20 steps)"
    )
    print(f"{'precision':<10} {'first':>8} {'train':>8} {'val':>8}")
    for row in result["rows"]:
        print(f"{row['precision']:<10} {row['first_loss']:>8.4f} {row['train_loss']:>8.4f} "
              f"{row['val_loss']:>8.4f}")  # fmt: skip
    print(f"fp8 - bf16: train {result['train_gap']:+.4f}, val {result['val_gap']:+.4f} "
          f"(bar: within {result['tolerance']})")  # fmt: skip
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
