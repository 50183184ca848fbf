"""``shardax calibrate``: measure this GPU's kernels and write them as a calibration.

The per-op cost model (``sx.estimate``, ``shardax plan --target``) prices a compiled step
with one device kind's measured tables: GEMM rates by shape, stream bandwidth, cuDNN
attention times and the launch cost (``shardax.cost.calibrate``; about a minute on a
GPU), and fp8 GEMM rates on a GPU with fp8 tensor cores (elsewhere that table is skipped,
saying why: until a kind has fp8 rows, an fp8 GEMM is priced at the datasheet's fp8 peak
over bf16 times its bf16 rate, and the estimate says so). The H100 and H200 ship with
shardax; for another kind, or your own driver and JAX:

    shardax calibrate --out a100.json
    shardax plan --target 64xA100-80GB --layers 32 --d-model 4096 --heads 32 --batch 256 \\
        --calibration a100.json

In Python: ``sx.cost.calibration.register(sx.cost.calibration.load("a100.json"))``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from types import SimpleNamespace

import jax

from shardax._format import titled_table
from shardax.cli.common import UsageError, add_json_flag, console, print_json
from shardax.cost import calibrate
from shardax.cost.accelerators import gpu_targets, kind_of
from shardax.cost.hardware import device_spec, is_gpu
from shardax.cost.measurements import fit_collectives, from_tables
from shardax.cost.nccl import fit_levels
from shardax.cost.network import named_network


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax calibrate``."""
    parser.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="the JSON file to write (default: calibration-<kind>-<date>.json here; "
        "an existing file only with --force)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes: a smoke test (e.g. on a CPU); the tables price nothing",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--network",
        default=None,
        metavar="NAME",
        help="the named network between the hosts (shardax launch: one process per host), "
        "e.g. ib-ndr or a3-megagpu-8g: the collectives across hosts are fitted per level "
        "and replace that network's documented figures when the file is used",
    )
    add_json_flag(parser)


def default_out(device_kind: str, date: str, quick: bool) -> Path:
    """``calibration-<kind>-<date>.json`` here (``-quick`` before ``.json`` for a smoke
    test, so that it never takes a real calibration's name).

    >>> default_out("NVIDIA H100 80GB HBM3", "2026-12-01", False).name
    'calibration-h100-2026-12-01.json'
    """
    slug = "".join(ch if ch.isalnum() else "-" for ch in kind_of(device_kind).lower())
    return Path(f"calibration-{slug.strip('-')}-{date}{'-quick' if quick else ''}.json")


def check_out(path: Path, force: bool) -> None:
    """A usage error where ``path`` cannot be written, or holds a file and not ``force``."""
    if path.is_dir():
        raise UsageError(f"--out {path}: is a directory; give the file to write")
    if not path.parent.is_dir():
        raise UsageError(f"--out {path}: cannot write it, {path.parent} does not exist")
    if path.exists() and not force:
        raise UsageError(f"--out {path}: exists; --force replaces it")


def run(args: argparse.Namespace) -> int:
    """Measures the tables on the first device, writes them, prints their summary."""
    device = jax.devices()[0]
    if not is_gpu(device) and not args.quick:
        raise UsageError(
            f"the per-op cost model prices GPU programs, and this process's devices are "
            f"{device.platform} devices: run shardax calibrate on the GPU to calibrate "
            "(--quick runs the small shapes here, as a smoke test)"
        )
    today = datetime.date.today().isoformat()
    path = Path(args.out) if args.out else default_out(str(device.device_kind), today, args.quick)
    network = getattr(args, "network", None)
    if network is not None:
        try:
            network = named_network(network).name
        except ValueError as e:
            raise UsageError(f"--network {network}: {e}") from None
    if jax.process_index() == 0:
        check_out(path, args.force)  # before a minute of measuring
    tables = calibrate.tables(quick=args.quick, network=network)
    if jax.process_index() != 0:  # every host measured; the first one writes
        return 0
    path.write_text(json.dumps(tables, indent=1) + "\n")
    failed = {k: v["error"] for k, v in tables.items() if isinstance(v, dict) and "error" in v}
    skipped = {k: v["skipped"] for k, v in tables.items() if isinstance(v, dict) and "skipped" in v}
    usable = None
    if not args.quick:
        try:
            usable = from_tables(tables, where=str(path))
        except ValueError as e:  # a required table failed on this device: say which
            raise UsageError(f"wrote {path}, but it cannot price steps: {e}") from None
    summary = calibrate.summary(tables)
    if args.json:
        print_json(
            {
                "path": str(path),
                **summary,
                "failed": failed,
                "skipped": skipped,
                "calibration": usable.to_dict() if usable else None,
            }
        )
        return 0
    out = console(args)
    quick = " (--quick: a smoke test)" if args.quick else ""
    table = titled_table(
        f"calibration of {tables['device']}, JAX {tables['jax']}, {tables['date']}{quick}"
    )
    table.add_column("table")
    table.add_column("rows", justify="right")
    table.add_column("summary")
    best = {
        "gemm": f"best {summary['matmul_tflops'] or 0:.3g} TFLOP/s bf16",
        "stream": f"best {summary['bandwidth_gbs'] or 0:.4g} GB/s",
    }
    if summary["fp8_matmul_tflops"]:
        best["gemm_fp8"] = f"best {summary['fp8_matmul_tflops']:.3g} TFLOP/s fp8"
    fp8_errors = [r["error"] for r in tables.get("gemm_fp8") or [] if "error" in r]
    if isinstance(tables.get("gemm_fp8"), list) and fp8_errors:
        best["gemm_fp8"] = f"{best.get('gemm_fp8', 'no row timed')}; {len(fp8_errors)} failed: "
        best["gemm_fp8"] += fp8_errors[0][:80]
    launch = {r.get("key"): r.get("us") for r in tables.get("launch") or [] if isinstance(r, dict)}
    if launch.get("per_kernel") is not None:
        best["launch"] = f"{launch['per_kernel']:.3g} µs per kernel in a program"
    rows = tables.get("collectives")
    fits = fit_collectives(rows) if isinstance(rows, list) else ()
    best["collectives"] = "; ".join(
        f"{op} over {n}: {latency * 1e6:.3g} µs + bytes at {bandwidth / 1e9:.4g} GB/s"
        for op, n, latency, bandwidth in fits
    ) or ("one device: none" if rows == [] else "")
    levels = fit_levels(rows) if isinstance(rows, list) else {}
    if levels:
        best["collectives"] += (
            "; per level (ring): "
            + ", ".join(
                f"{level} {lat * 1e6:.3g} µs a step + bytes at {bw / 1e9:.4g} GB/s"
                for level, (lat, bw) in levels.items()
            )
            + (f" (network {network})" if network and "inter-host" in levels else "")
        )
    for name in (
        "gemm",
        "gemm_f32",
        "gemm_f32_cublas",
        "gemm_fp8",
        "stream",
        "reduce",
        "attention",
        "launch",
        "collectives",
    ):
        rows = tables.get(name)
        shown = best.get(name, "")
        if isinstance(rows, dict):
            shown = (
                f"skipped: {rows['skipped']}"
                if "skipped" in rows
                else ("failed: " + str(rows.get("error"))[:60])
            )
        table.add_row(name, str(len(rows)) if isinstance(rows, list) else "-", shown)
    out.print(table)
    out.print(f"wrote {path}", soft_wrap=True, markup=False)
    if usable is not None:
        out.print(f"use it: {use_line(usable.device, path)}", soft_wrap=True, markup=False)
    return 0


def use_line(device_kind: str, path: Path) -> str:
    """How to price steps with the tables at ``path``, measured on ``device_kind``.

    >>> use_line("NVIDIA A100-SXM4-80GB", Path("a.json"))
    'shardax plan --target 8xA100-80GB ... --calibration a.json'
    """
    names = [row.kind for row in gpu_targets() if row.kind == kind_of(device_kind)]
    if names:
        return f"shardax plan --target 8x{names[0]} ... --calibration {path}"
    register = f"sx.cost.calibration.register(sx.cost.calibration.load({str(path)!r}))"
    if device_spec(SimpleNamespace(platform="gpu", device_kind=device_kind)) is None:
        return (
            f"{register}, then sx.estimate on these devices (this kind has no datasheet "
            "row and no compile-only target: its peak and memory bandwidth are the "
            "measured ones)"
        )
    return f"{register}, then sx.estimate on these devices (no compile-only target has this kind)"
