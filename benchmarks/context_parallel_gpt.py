"""The GPT at 4× the sequence length in the same memory per device, with equal losses.

Three runs of the ``shardax train --model gpt`` job (its model, data, plan and step), on
8 simulated CPU devices:

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


def run_job(argv: list[str], steps: int) -> dict[str, Any]:
    """Builds the GPT job from ``shardax train`` options; returns its compiled memory per
    device and the losses of ``steps`` steps."""
    import jax
    import numpy as np
    from rich.console import Console

    import shardax as sx
    import shardax.cli.train_gpt  # registers the job
    from shardax.cli.job import JOBS
    from shardax.cli.train import add_arguments
    from shardax.train.auto import measure

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "gpt", *argv])
    job = JOBS["gpt"].make(args, Console(quiet=True))
    batches = iter(job.loader)
    first = next(batches)
    # arguments + outputs - donated aliases + temporaries, as sx.auto_plan measures plans
    measured = measure("gpt", job.step.lower(job.state, first).compile(), job.step.plan)
    memory = {"arguments": measured.argument_bytes, "temporaries": measured.temp_bytes,
              "total": measured.total_bytes}  # fmt: skip
    state, losses, batch = job.state, [], first
    sharding = sx.batch_sharding(job.mesh)
    for _ in range(steps):
        state, metrics = job.step(state, sx.distribute_batch(batch, sharding))
        losses.append(float(metrics["loss"]))
        batch = next(batches)
    jax.block_until_ready(state)
    return {"argv": argv, "mesh": dict(job.mesh.shape), "memory": memory,
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
    common = ["--layers", str(args.layers), "--d-model", str(args.d_model),
              "--heads", str(args.heads), "--max-seq-len", str(4 * length),
              "--steps", str(args.steps), "--compile-cache", "off"]  # fmt: skip
    runs = {
        "base": ["--mesh", "data=8", "--seq-len", str(length), "--batch-size", "8"],
        "context": [
            "--mesh",
            "data=2,context=4",
            "--attention",
            args.attention,
            "--seq-len",
            str(4 * length),
            "--batch-size",
            "2",
        ],
        "data_only": ["--mesh", "data=2", "--seq-len", str(4 * length), "--batch-size", "2"],
        "reference": ["--mode", "single", "--seq-len", str(4 * length), "--batch-size", "2"],
    }
    results = {name: run_job([*common, *opts], args.steps) for name, opts in runs.items()}
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
