"""``shardax info``: devices, hardware, batch-size recommendation and the default mesh."""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np

import shardax as sx
from shardax._format import titled_table
from shardax.cli.common import UsageError, add_json_flag, console, mesh_spec, print_json
from shardax.cli.hardware import roofline
from shardax.cost.hardware import BATCH_SIZE_TABLE, HARDWARE_SPECS
from shardax.cost.roofline import hardware_roofline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax info``."""
    parser.add_argument(
        "--mesh",
        type=mesh_spec,
        default=None,
        help="mesh to draw, e.g. data=4,model=2 (default: data=-1, all devices)",
    )
    add_json_flag(parser)


def collect(mesh_pairs: list[tuple[str, int]] | None) -> dict[str, Any]:
    """Everything ``shardax info`` shows, as plain data."""
    info = sx.cost.device_info()
    hw = sx.HardwareType(info["hardware_type"])
    rec = sx.get_batch_size_recommendation(hw)
    table = []
    for h, r in BATCH_SIZE_TABLE.items():
        row: dict[str, Any] = {
            "hardware": h.value,
            "min_batch_size": r.min_batch_size,
            "optimal_batch_size": r.optimal_batch_size,
            "critical_batch_size": r.critical_batch_size,
            "notes": r.notes,
        }
        if h in HARDWARE_SPECS:
            roof = hardware_roofline(h)
            row |= {
                "peak_flops": roof.peak_flops,
                "hbm_bandwidth": roof.hbm_bandwidth,
                "roofline_critical_batch": roof.critical_batch,
            }
        table.append(row)
    for name in ("h200", "b200"):  # kinds the recommendation table lacks (as --target knows)
        roof = roofline(name)
        table.append(
            {
                "hardware": name,
                "min_batch_size": None,
                "optimal_batch_size": None,
                "critical_batch_size": None,
                "notes": "not in the recommendation table: roofline only",
                "peak_flops": roof["peak_flops"],
                "hbm_bandwidth": roof["hbm_bandwidth"],
                "roofline_critical_batch": roof["critical_batch"],
            }
        )
    try:
        mesh = sx.make_mesh(mesh_pairs)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None
    return {
        **info,
        "local_device_count": jax.local_device_count(),
        "recommendation": {
            "hardware": hw.value,
            "min_batch_size": rec.min_batch_size,
            "optimal_batch_size": rec.optimal_batch_size,
            "critical_batch_size": rec.critical_batch_size,
            "max_memory_batch_size": rec.max_memory_batch_size,
            "notes": rec.notes,
        },
        "batch_size_table": table,
        "mesh": sx.mesh.mesh_info(mesh),
    }


def mesh_picture(device_ids: Any, axes: dict[str, int]) -> Any:
    """A rich table drawing the mesh: rows = leading axes, columns = last axis."""
    ids = np.asarray(device_ids)
    names = list(axes)
    last = names[-1]
    rows = ids.reshape(-1, ids.shape[-1])
    lead = names[:-1]
    title = " × ".join(f"{n}={s}" for n, s in axes.items())
    grid = titled_table(f"mesh {title} (cells: device ids)", show_lines=True)
    grid.add_column(" × ".join(lead) if lead else "", style="dim")
    for j in range(rows.shape[1]):
        grid.add_column(f"{last} {j}", justify="center")
    for i, row in enumerate(rows):
        label = ",".join(str(k) for k in np.unravel_index(i, ids.shape[:-1])) if lead else ""
        grid.add_row(label, *[f"[bold]{d}[/]" for d in row])
    return grid


def render(data: dict[str, Any], out: Any) -> None:
    """Prints ``data`` as rich tables on ``out``."""
    devices = titled_table(f"{data['num_devices']} devices, {data['process_count']} process(es)")
    for col in ("id", "platform", "kind", "process"):
        devices.add_column(col)
    for d in data["devices"]:
        devices.add_row(str(d["id"]), d["platform"], d["device_kind"], str(d["process_index"]))
    out.print(devices)

    rec = data["recommendation"]
    out.print(f"\nhardware type: [bold]{rec['hardware']}[/]")
    out.print(
        f"recommended batch: min {rec['min_batch_size']}, optimal {rec['optimal_batch_size']}, "
        f"critical {rec['critical_batch_size']} per device — {rec['notes']}"
    )

    table = titled_table(
        "batch size per device: sx.get_batch_size_recommendation's table, and the roofline "
        "B* = peak ÷ bandwidth",
        caption="B* = (bytes per weight / 2) × peak FLOP/s ÷ HBM bytes/s, here bf16 (2 bytes): "
        "a dense layer's FLOPs per byte equal its batch, so below B* it waits on memory.",
    )
    for col in ("hardware", "min", "optimal", "critical (table)", "peak TFLOP/s", "HBM TB/s"):
        table.add_column(col, justify="right")
    table.add_column("B* = peak ÷ HBM", justify="right")
    for row in data["batch_size_table"]:
        here = row["hardware"] == rec["hardware"]
        style = "bold green" if here else None
        if "peak_flops" in row:
            figures = [
                f"{row['peak_flops'] / 1e12:.0f}",
                f"{row['hbm_bandwidth'] / 1e12:.2f}",
                f"{row['roofline_critical_batch']:.0f}",
            ]
        else:
            figures = ["—", "—", "— (measure: shardax tune-batch)"]
        table.add_row(
            row["hardware"] + (" ◀" if here else ""),
            *(
                "—" if row[k] is None else str(row[k])
                for k in ("min_batch_size", "optimal_batch_size", "critical_batch_size")
            ),
            *figures,
            style=style,
        )
    out.print()
    out.print(table)
    out.print()
    out.print(mesh_picture(data["mesh"]["device_ids"], data["mesh"]["axes"]))


def run(args: argparse.Namespace) -> int:
    """Prints the device inventory, the batch-size recommendation and the mesh."""
    data = collect(args.mesh)
    if args.json:
        print_json(data)
    else:
        render(data, console(args))
    return 0
