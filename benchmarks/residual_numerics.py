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

from _common import gpt_loss_parser, gpt_losses_side_by_side

VARIANTS = (("fp32", "autodiff"), ("bf16", "autodiff"), ("bf16", "recompute"))
"""``(residual, elementwise)`` of each run; the first is the default the others meet."""
TOLERANCE = 0.01
"""The documented bar: each variant's loss within 0.01 nats per byte of the default's."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return gpt_loss_parser(__doc__).parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    variants = {v: ({"residual": v[0], "elementwise": v[1]}, "bf16") for v in VARIANTS}
    result = gpt_losses_side_by_side(args, variants)
    losses = result.pop("losses")
    base = losses[VARIANTS[0]]
    rows = [
        {
            "residual": v[0],
            "elementwise": v[1],
            **losses[v],
            "train_gap": losses[v]["train_loss"] - base["train_loss"],
            "val_gap": losses[v]["val_loss"] - base["val_loss"],
        }
        for v in VARIANTS
    ]
    within = all(abs(r["val_gap"]) <= TOLERANCE for r in rows)
    return {**result, "rows": rows, "tolerance": TOLERANCE, "within": within}


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
