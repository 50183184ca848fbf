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

from _common import gpt_loss_parser, gpt_losses_side_by_side

PRECISIONS = ("bf16", "fp8")
TOLERANCE = 0.01
"""The issue's bar: fp8's loss within 0.01 nats per byte of bf16's."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return gpt_loss_parser(__doc__).parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    result = gpt_losses_side_by_side(args, {p: ({}, p) for p in PRECISIONS})
    losses = result.pop("losses")
    bf16, fp8 = losses["bf16"], losses["fp8"]
    return {
        **result,
        "rows": [{"precision": p, **losses[p]} for p in PRECISIONS],
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
