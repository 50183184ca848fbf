"""The per-op cost model against every GPU step time measured: leave-one-out accuracy.

Each configuration of the GPT measured on one NVIDIA H200 and one H100 SXM
(``docs/results.md``: the sessions of 2026-11-27 and the H200's stage-4 rows of
2026-11-26) is compiled here for a compile-only ``1xH200`` or ``1xH100`` target
(``sx.target``, no GPU needed) with the compiler options it ran with, and its compiled
program priced by :func:`shardax.cost.opcost.price_hlo` with that card's calibration
(microbenchmark tables only: no step time is a calibration input, so every prediction is
leave-one-out by construction). The table gives the predicted interval and point against
the measured median.

    UV_PROJECT_ENVIRONMENT=.venv-compile uv run --python 3.12 --extra gpu-compile \\
        python benchmarks/cost_model_accuracy.py --hlo-dir /tmp/hlo --json accuracy.json

``--hlo-dir`` keeps each compiled program's text (a 24-layer unrolled step compiles in
25-90 s on a 2-core machine), so a second run only prices.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from shardax.cost.budget import JAX_MEMORY_FRACTION

HERE = Path(__file__).resolve().parent
SESSIONS = {"H200": HERE / "gpu/results/2026-11-27-h200-1/session.json",
            "H100": HERE / "gpu/results/2026-11-27-h100-1/session.json"}  # fmt: skip
STAGE4 = "measured 2026-11-26 (docs/results.md, stage 4; XLA's default options)"
SESSION_FRACTION = 0.95
"""The memory fraction the sessions' JAX stages ran with (``session.MEMORY_FRACTION``,
set since the script's first version; sessions record it as ``core.memory.fraction``).
The stage-4 runs set none: JAX's default, 0.75."""


def configurations() -> list[dict[str, Any]]:
    """Every measured configuration: ``name``, ``card`` (``"H200"``), ``config``
    (``jax_gpt.Config`` fields), ``options`` (the compiler options it ran with),
    ``memory_fraction`` (of the GPU's memory, that JAX ran it with), ``measured_ms`` and
    ``source``."""
    out = []
    for card, path in SESSIONS.items():
        session = json.loads(path.read_text())
        rows = [("default (shardax)", session["core"]["shardax"]),
                ("hand-written jax.jit", session["core"]["jit"])]  # fmt: skip
        rows += [(s["name"], s) for s in session["sweep"] if "seconds_per_step" in s]
        prefix = "" if card == "H200" else f"{card}: "
        fraction = session["core"].get("memory", {}).get("fraction") or SESSION_FRACTION
        for name, r in rows:
            config = {k: v for k, v in r["config"].items() if k != "compiler"}
            kept = path.parent / "hlo" / f"{slug(name)}.hlo.gz"
            out.append(dict(name=prefix + name, card=card, config=config,
                            options=r["compiler_options"], memory_fraction=fraction,
                            measured_ms=1e3 * r["seconds_per_step"],
                            source=f"{path.parent.name}/session.json",
                            device_hlo=str(kept) if kept.exists() else None))  # fmt: skip
    base = dict(layers=24, d_model=2048, heads=16, seq_len=2048, batch=4, remat="none",
                scan=False, kernel="auto", impl="shardax", model="stage4")  # fmt: skip
    for name, change, ms in (
        ("stage 4: default", {}, 207.0),
        ("stage 4: attention dense", {"kernel": "dense"}, 289.0),
        ("stage 4: layers scanned", {"scan": True}, 261.0),
        ("stage 4: scanned, dense", {"scan": True, "kernel": "dense"}, 395.0),
        ("stage 4: 8 x 2048, remat minimal", {"batch": 8, "remat": "dots_no_batch"}, 420.0),
        ("stage 4: 8 x 2048, remat minimal, scanned",
         {"batch": 8, "remat": "dots_no_batch", "scan": True}, 454.0),
    ):  # fmt: skip
        out.append(dict(name=name, card="H200", config={**base, **change}, options={},
                        memory_fraction=JAX_MEMORY_FRACTION, measured_ms=ms,
                        source=STAGE4))  # fmt: skip
    return out


def compile_hlo(row: dict[str, Any]) -> str:
    """The compiled program's text of ``row`` for a compile-only ``1x<card>``, planned in
    the memory the run had (``row["memory_fraction"]``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx
    from shardax.models import gpt

    sys.path.insert(0, str(HERE / "gpu"))
    import jax_gpt

    c = jax_gpt.Config(**row["config"], compiler=row["options"])
    card = sx.target(f"1x{row['card']}", memory_fraction=row["memory_fraction"])
    mesh = sx.make_mesh({"data": 1}, devices=card)
    tokens = jax.ShapeDtypeStruct((c.batch, c.seq_len), jnp.int32,
                                  sharding=NamedSharding(mesh, PartitionSpec("data")))  # fmt: skip
    batch = {"inputs": tokens, "targets": tokens}
    tx = optax.adamw(**jax_gpt.ADAMW)
    with jax_gpt.model_version(c.model):
        cfg = jax_gpt.gpt_config(c)
        make = lambda: gpt.make_gpt(cfg, remat=c.remat)  # noqa: E731
        if c.impl == "shardax":
            model = nnx.eval_shape(make)
            plan = gpt.plan(mesh, model, "replicate")
            step = sx.make_train_step(jax_gpt.loss_fn, mesh=mesh, plan=plan, precision="bf16",
                                      compiler_options=row["options"])  # fmt: skip
            state = step.abstract(nnx.eval_shape(lambda: sx.TrainState.create(make(), tx)))
            return step.lower(state, batch).compile().as_text()
        graphdef, params = nnx.split(nnx.eval_shape(make))
        opt = jax.eval_shape(tx.init, params)
        rep = NamedSharding(mesh, PartitionSpec())
        place = lambda t: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), t
        )

        def step_fn(state: Any, batch: Any) -> Any:
            params, opt_state = state

            def loss(p: Any) -> Any:
                cast = jax.tree.map(
                    lambda x: x.astype(jnp.bfloat16)
                    if jnp.issubdtype(x.dtype, jnp.floating) else x, p,
                )  # fmt: skip
                return jax_gpt.loss_fn(nnx.merge(graphdef, cast), batch)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        jitted = jax.jit(step_fn, donate_argnums=(0,), compiler_options=row["options"] or None)
        # under the target's mesh, as on the GPU: attention "auto" picks the GPU's kernel
        with (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh):
            return jitted.lower((place(params), place(opt)), batch).compile().as_text()


def slug(name: str) -> str:
    """The file name the GPU session keeps ``name``'s program under (``session.slug``)."""
    sys.path.insert(0, str(HERE / "gpu"))
    from session import slug as session_slug

    return session_slug(name)


def hlo_of(row: dict[str, Any], directory: Path | None) -> str:
    """``row``'s compiled text, from ``directory`` where it was kept, else compiled (and
    kept there)."""
    path = None if directory is None else directory / f"{slug(row['name'])}.hlo"
    if path is not None and path.exists():
        return path.read_text()
    began = time.perf_counter()
    text = compile_hlo(row)
    print(f"compiled {row['name']} in {time.perf_counter() - began:.0f} s", flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hlo-dir", type=Path, default=None, help="keep/reuse compiled text")
    parser.add_argument("--json", type=Path, default=None, help="write the table here")
    parser.add_argument("--compile-only", action="store_true", help="compile, do not price")
    parser.add_argument("--only", action="append", help="configurations whose name has this")
    args = parser.parse_args(argv)
    rows = configurations()
    if args.only:
        rows = [r for r in rows if any(s in r["name"] for s in args.only)]
    for row in rows:
        text = hlo_of(row, args.hlo_dir)
        if args.compile_only:
            continue
        row["prediction"] = predict(text, row["card"])
        if row.get("device_hlo"):  # the program as it ran on the GPU (session.py keeps it)
            import gzip

            with gzip.open(row["device_hlo"], "rt") as f:
                row["prediction_device"] = predict(f.read(), row["card"])
    if not args.compile_only:
        import jax

        from shardax.cost.calibration import CALIBRATIONS

        print(f"compiled with JAX {jax.__version__} for a compile-only 1xH200 or 1xH100; "
              "priced with " + "; ".join(f"{c.name} ({c.source})"
                                         for c in CALIBRATIONS.values()))  # fmt: skip
        print(markdown(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


def predict(text: str, card: str = "H200") -> dict[str, Any]:
    """``card``'s calibration's price of one compiled program."""
    from shardax.cost.calibration import CALIBRATIONS
    from shardax.cost.opcost import price_hlo

    return price_hlo(text, CALIBRATIONS[card]).to_dict()


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: predicted point and interval against measured, the error."""
    device = any(r.get("prediction_device") for r in rows)
    extra = " from the program that ran, ms (error) |" if device else ""
    out = ["| configuration | measured ms | predicted ms | interval ms | error | in interval |"
           + extra, "|---|---|---|---|---|---|" + ("---|" if device else "")]  # fmt: skip
    for r in rows:
        p, ms = r["prediction"], r["measured_ms"]
        point, low, high = (1e3 * p[k] for k in ("step_s", "low_s", "high_s"))
        inside = "yes" if low <= ms <= high else "no"
        line = (f"| {r['name']} | {ms:.1f} | {point:.1f} | {low:.1f}–{high:.1f} | "
                f"{point / ms - 1:+.1%} | {inside} |")  # fmt: skip
        if device:
            q = r.get("prediction_device")
            ran = 1e3 * q["step_s"] if q else None
            line += f" {ran:.1f} ({ran / ms - 1:+.1%}) |" if ran else " – |"
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
