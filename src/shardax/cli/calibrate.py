"""``shardax calibrate``: measure this GPU's kernels and write them as a calibration.

The per-op cost model (``sx.estimate``, ``shardax plan --target``) prices a compiled step
with one device kind's measured tables: GEMM rates by shape, stream bandwidth, cuDNN
attention times and the launch cost (``shardax.cost.calibrate``; about a minute on a
GPU). The H100 and H200 ship with shardax; for another kind, or your own driver and JAX:

    shardax calibrate --out a100.json
    shardax plan --target 64xA100 --layers 32 --d-model 4096 --heads 32 --batch 256 \\
        --calibration a100.json

In Python: ``sx.cost.calibration.register(sx.cost.calibration.load("a100.json"))``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
from rich.table import Table

from shardax.cli.common import UsageError, add_json_flag, console, print_json
from shardax.cost import calibrate
from shardax.cost.calibration import fit_collectives, from_tables, kind_of
from shardax.cost.compile_target import GPU_KINDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax calibrate``."""
    parser.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="the JSON file to write (default: calibration-<kind>-<date>.json here)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes: a smoke test (e.g. on a CPU); the tables price nothing",
    )
    add_json_flag(parser)


def _out_path(out: str | None, device_kind: str, date: str) -> Path:
    if out is None:
        slug = "".join(ch if ch.isalnum() else "-" for ch in kind_of(device_kind).lower())
        return Path(f"calibration-{slug.strip('-')}-{date}.json")
    path = Path(out)
    if path.is_dir():
        raise UsageError(f"--out {out}: is a directory; give the file to write")
    if not path.parent.is_dir():
        raise UsageError(f"--out {out}: cannot write it, {path.parent} does not exist")
    return path


def run(args: argparse.Namespace) -> int:
    """Measures the tables on the first device, writes them, prints their summary."""
    device = jax.devices()[0]
    if device.platform == "cpu" and not args.quick:
        raise UsageError(
            "the per-op cost model prices GPU programs, and this process's devices are CPUs: "
            "run shardax calibrate on the GPU to calibrate (--quick runs the small shapes "
            "here, as a smoke test)"
        )
    path = _out_path(args.out, str(device.device_kind), "today")  # checked before measuring
    tables = calibrate.tables(quick=args.quick)
    if args.out is None:
        path = _out_path(None, tables["device"], tables["date"])
    path.write_text(json.dumps(tables, indent=1) + "\n")
    failed = {k: v["error"] for k, v in tables.items() if isinstance(v, dict) and "error" in v}
    usable = None
    if not args.quick:
        try:
            usable = from_tables(tables, where=str(path))
        except ValueError as e:  # a required table failed on this device: say which
            raise UsageError(f"wrote {path}, but it cannot price steps: {e}") from None
    summary = calibrate.summary(tables)
    if args.json:
        print_json({"path": str(path), **summary, "failed": failed,
                    "calibration": usable.to_dict() if usable else None})  # fmt: skip
        return 0
    out = console(args)
    quick = " (--quick: a smoke test)" if args.quick else ""
    table = Table(title=f"calibration of {tables['device']}, JAX {tables['jax']}, "
                  f"{tables['date']}{quick}")  # fmt: skip
    table.add_column("table")
    table.add_column("rows", justify="right")
    table.add_column("summary")
    best = {"gemm": f"best {summary['matmul_tflops'] or 0:.3g} TFLOP/s bf16",
            "stream": f"best {summary['bandwidth_gbs'] or 0:.4g} GB/s"}  # fmt: skip
    launch = {r.get("key"): r.get("us") for r in tables.get("launch") or [] if isinstance(r, dict)}
    if launch.get("per_kernel") is not None:
        best["launch"] = f"{launch['per_kernel']:.3g} µs per kernel in a program"
    rows = tables.get("collectives")
    fits = fit_collectives(rows) if isinstance(rows, list) else ()
    best["collectives"] = "; ".join(
        f"{op} over {n}: {latency * 1e6:.3g} µs + bytes at {bandwidth / 1e9:.4g} GB/s"
        for op, n, latency, bandwidth in fits
    ) or ("one device: none" if rows == [] else "")
    for name in ("gemm", "gemm_f32", "gemm_f32_cublas", "stream", "reduce", "attention",
                 "launch", "collectives"):  # fmt: skip
        rows = tables.get(name)
        shown = "failed: " + rows["error"][:60] if isinstance(rows, dict) else best.get(name, "")
        table.add_row(name, str(len(rows)) if isinstance(rows, list) else "-", shown)
    out.print(table)
    out.print(f"wrote {path}")
    if usable is not None:
        out.print(f"use it: {use_line(usable.device, path)}", soft_wrap=True)
    return 0


def use_line(device_kind: str, path: Path) -> str:
    """How to price steps with the tables at ``path``, measured on ``device_kind``.

    >>> use_line("NVIDIA A100-SXM4-80GB", Path("a.json"))
    'shardax plan --target 8xA100-80GB ... --calibration a.json'
    """
    names = [name for name, kind in GPU_KINDS.items() if kind == device_kind]
    if names:
        return f"shardax plan --target 8x{names[0]} ... --calibration {path}"
    return (f"sx.cost.calibration.register(sx.cost.calibration.load({str(path)!r})), then "
            f"sx.estimate on these devices (no compile-only target has this kind)")  # fmt: skip
