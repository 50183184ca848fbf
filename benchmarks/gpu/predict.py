"""The GPU session's new rows predicted before a GPU measures them: each configuration of
``session.predicted_configs`` compiled for one compile-only device of the card
(``sx.target("1x<card>")``, planned in the session's memory share) and priced by
``sx.estimate`` (the per-op model with the card's shipped calibration), written to
``predictions.json`` beside this file with the date, JAX version and calibration. The
session reads the file and sets each row's prediction beside its measurement; a row with
no prediction written down says so.

    UV_PROJECT_ENVIRONMENT=.venv-compile uv run --python 3.12 --extra gpu-compile \\
        python benchmarks/gpu/predict.py --card H200 --card H100        # about 2 min a row
    ... python benchmarks/gpu/predict.py --size tiny --out /tmp/p.json  # a smoke test

A card's rows are replaced where computed again, the others kept. What a row holds:
``step_ms`` and its interval, ``tokens_per_s``, ``classes_ms`` (the per-op model's time per
op class, beside the session's profile of the same classes), how the fp8 GEMMs were priced
(``fp8``: ``"datasheet"``, 2x the measured bf16 rows where the card's tables have no fp8
rows, or ``"measured"``), and whether the step fits the memory share (``fits``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PREDICTIONS = HERE / "predictions.json"


def predict_one(config: Any, card: str, memory_fraction: float) -> dict[str, Any]:
    """``sx.estimate`` of ``config``'s shardax step on one compile-only ``card``."""
    import jax
    import jax.numpy as jnp
    import jax_gpt
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx

    target = sx.target(f"1x{card}", memory_fraction=memory_fraction)
    mesh = sx.make_mesh({"data": 1}, devices=target)
    step, make, plan = jax_gpt.shardax_step(config, mesh)
    tokens = jax.ShapeDtypeStruct(
        (config.batch, config.seq_len),
        jnp.int32,
        sharding=NamedSharding(mesh, PartitionSpec("data")),
    )
    state = nnx.eval_shape(lambda: sx.TrainState.create(make(), optax.adamw(**jax_gpt.ADAMW)))
    flops, _ = jax_gpt.model_flops_per_step(config)
    began = time.perf_counter()
    report = sx.estimate(
        step, step.abstract(state), {"inputs": tokens, "targets": tokens}, model_flops=flops
    )
    cost = report.per_op
    out: dict[str, Any] = {
        "config": dataclasses.asdict(config),
        "plan": plan,
        "compile_s": time.perf_counter() - began,
        "fits": report.fits,
    }
    if cost is None:
        return {**out, "error": "no per-op prediction (the estimate has no GPU calibration)"}
    out.update(
        step_ms=cost.step_s * 1e3,
        low_ms=cost.low_s * 1e3,
        high_ms=cost.high_s * 1e3,
        tokens_per_s=config.tokens / cost.step_s,
        calibration=cost.calibration,
        classes_ms={k: v.seconds * 1e3 for k, v in cost.classes.items()},
        exposed_collectives_ms=cost.exposed_s * 1e3,
        fp8="measured"
        if cost.fp8_measured_flops
        else "datasheet"
        if cost.fp8_datasheet_flops
        else None,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    import session

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--card", action="append", choices=("H200", "H100"), default=None)
    p.add_argument("--size", choices=tuple(session.SIZES), default="1b")
    p.add_argument("--only", action="append", help="rows whose name holds this")
    p.add_argument("--out", type=Path, default=PREDICTIONS)
    args = p.parse_args(argv)
    import jax

    written = json.loads(args.out.read_text()) if args.out.exists() else {}
    base = session.base_config(args.size, 1)
    rows = [
        (n, c)
        for n, c in [("default (shardax)", base), *session.predicted_configs(base)]
        if not args.only or any(w in n for w in args.only)
    ]
    fraction = float(session.MEMORY_FRACTION)
    for card in args.card or ["H200"]:
        by = written.setdefault(card, {})
        for name, config in rows:
            try:
                row = predict_one(config, card, fraction)
            except Exception as e:  # keep the other rows: say which failed and why
                row = {"config": dataclasses.asdict(config), "error": f"{type(e).__name__}: {e}"}
            row.update(
                made=datetime.date.today().isoformat(),
                jax=jax.__version__,
                by=f"sx.estimate (per-op model) of the step compiled for a compile-only "
                f"1x{card}, memory fraction {fraction}",
                size=args.size,
            )
            by[name] = row
            shown = f"{row['step_ms']:.1f} ms" if "step_ms" in row else row["error"][:120]
            print(f"{card} {name}: {shown}", flush=True)
            args.out.write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
