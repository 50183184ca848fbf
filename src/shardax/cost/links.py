"""The links a compiled step's collectives cross, and their time: each collective's
slowest group and the link it spans, the bytes it moves over each link (a group across
GPU hosts: ``host_share`` between them, the rest over NVLink), the network's levels
(``shardax.cost.network``) and the part of the wire time the compiled schedule leaves
exposed (``Estimate.overlap``).

>>> wire_seconds({"inter-host": 5e9}, link_bandwidths(None, {"inter-host": 5e10}))
0.1
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from shardax.cost.calibration import calibration_for
from shardax.cost.hardware import HardwareSpec, is_gpu
from shardax.cost.nccl import LevelPrice, layout_of, network_levels, price_collective
from shardax.cost.network import network_of, with_fitted
from shardax.cost.predict import host_share, link_of, wire_seconds
from shardax.cost.schedule import exposed_seconds


def link_bandwidths(
    spec: Any, links: Mapping[str, float] | None, platform: str = "gpu"
) -> dict[str, float | None]:
    """Bytes/s per link: ``links`` where given, else the datasheet's ``ici_bandwidth``
    (NVLink within a GPU host; ICI anywhere within a TPU slice, across its hosts too) and
    ``dcn_bandwidth`` (InfiniBand between GPU hosts, DCN between TPU slices).

    >>> from types import SimpleNamespace as NS
    >>> link_bandwidths(NS(ici_bandwidth=4.5e11, dcn_bandwidth=5e10), None)["inter-host"]
    50000000000.0
    >>> link_bandwidths(NS(ici_bandwidth=4.5e11, dcn_bandwidth=5e10), None, "tpu")["inter-host"]
    450000000000.0
    """
    ici, dcn = getattr(spec, "ici_bandwidth", None), getattr(spec, "dcn_bandwidth", None)
    tpu = platform == "tpu"
    out: dict[str, float | None] = {
        "intra-host": ici,
        "inter-host": ici if tpu else dcn,
        "inter-slice": dcn,
    }
    out.update(links or {})
    return out


def levels_of(
    devices: list[Any],
    spec: HardwareSpec,
    bandwidths: Mapping[str, float | None],
    links: Mapping[str, float] | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The network levels of GPUs on several hosts (``shardax.cost.network``): the
    target's network (else the kind's default), with the kind's calibration's fitted
    per-level figures where it measured them (across hosts: on that network), and the
    report's words for it; ``({}, None)`` on one host, a TPU or where no network is known."""
    if not is_gpu(devices[0]) or len({d.process_index for d in devices}) < 2:
        return {}, None
    network, why = network_of(devices[0])
    nvlink = bandwidths.get("intra-host")
    if network is None or not nvlink:
        return {}, None
    calibration = calibration_for(str(devices[0].device_kind))
    network = with_fitted(network, calibration)
    fitted = {k: (lat, bw) for k, lat, bw in getattr(calibration, "levels", ())}
    if network.fitted is None:  # measured on another network: its NICs are not these
        fitted.pop("inter-host", None)
    levels = network_levels(network, nvlink, fitted, (links or {}).get("inter-host"))
    words = network.describe()
    if "intra-host" in fitted:
        words += f"; NVLink per level fitted ({calibration.name})"  # type: ignore[union-attr]
    if levels["inter-host"].source == "links= given":
        words += f"; between hosts at the given {levels['inter-host'].bandwidth:.3g} B/s"
    return levels, {**network.to_dict(), "why": why, "line": words}


def level_price(
    s: Any, link: str, levels: Mapping[str, Any], members: list[Any]
) -> LevelPrice | None:
    """One run of the scheduled collective ``s`` priced level by level where its group
    (``members``: its slowest group's devices) spans GPU hosts; else None."""
    if not levels or link != "inter-host":
        return None
    c = s.collective
    layout = layout_of(members)
    if layout.hosts < 2:
        return None
    return price_collective(c.op, c.bytes, layout, levels)


_LINK_ORDER = {"intra-host": 0, "inter-host": 1, "inter-slice": 2}


def group_members(groups: tuple[tuple[int, ...], ...], devices: list[Any]) -> list[Any]:
    """The devices of a collective's slowest group (all ``devices`` where not known): the
    one over the widest link (slices, then hosts), of those the one whose fewest devices
    on a host carry the most between hosts. Every group runs the op at once, so the
    slowest sets its time: a pipeline's permute between stages on one host and stages on
    two is priced by the pair that crosses hosts."""
    if not groups:
        return devices

    def slowness(group: tuple[int, ...]) -> tuple[int, int]:
        members = [devices[i] for i in group if i < len(devices)]
        hosts = Counter(d.process_index for d in members)
        return _LINK_ORDER[group_link(members)], -min(hosts.values(), default=0)

    slowest = max(groups, key=slowness)
    return [devices[i] for i in slowest if i < len(devices)]


def group_link(members: list[Any]) -> str:
    return link_of(
        {d.process_index for d in members}, {getattr(d, "slice_index", 0) for d in members}
    )


def wire_bytes(
    s: Any,
    link: str,
    devices: list[Any],
    bandwidths: Mapping[str, float | None],
    members: list[Any] | None = None,
) -> dict[str, float]:
    """The bytes per step the scheduled collective ``s`` moves over each link: all it
    sends over ``link``, except a group across GPU hosts with NVLink within them (an
    ``"intra-host"`` bandwidth), whose devices send ``host_share`` of it between hosts
    and the rest within their host. ``members``: its slowest group's devices, where the
    caller has them (``group_members``)."""
    c = s.collective
    if not is_gpu(devices[0]) or link != "inter-host" or not bandwidths.get("intra-host"):
        return {link: c.sent_bytes}
    members = group_members(c.groups, devices) if members is None else members
    per_host = Counter(d.process_index for d in members)
    share = host_share(c.op, c.group, min(per_host.values()))
    split = {"inter-host": share * c.sent_bytes, "intra-host": (1 - share) * c.sent_bytes}
    return {k: v for k, v in split.items() if v}


def overlap_of(
    timed: list[Any],
    wires: list[Mapping[str, float]],
    bandwidths: Mapping[str, float | None],
    flop_rate: float,
    priced: list[LevelPrice | None] | None = None,
) -> dict[str, Any]:
    """``Estimate.overlap`` of the scheduled collectives ``timed``, moving ``wires``
    (collectives over a link of unknown bandwidth are left out, as in the prediction);
    ``priced``: each one's run priced level by level where its group spans GPU hosts
    (``level_price``), whose time and exposure also count as ``inter_host_s`` and
    ``exposed_inter_host_s``."""
    exposed = total = inter = inter_exposed = 0.0
    for i, (s, moved) in enumerate(zip(timed, wires, strict=True)):
        runs = s.collective.count
        if not runs:
            continue
        level = priced[i] if priced else None
        wire = (
            wire_seconds({k: v / runs for k, v in moved.items()}, bandwidths)
            if level is None
            else level.seconds
        )
        if wire is None:
            continue
        total += wire * runs
        left = exposed_seconds(s, wire, flop_rate)
        exposed += left
        if level is not None:
            inter += wire * runs
            inter_exposed += left
    return {
        "exposed_s": exposed,
        "collective_s": total,
        "inter_host_s": inter,
        "exposed_inter_host_s": inter_exposed,
        "collectives": len(timed),
        "overlapped": sum(s.overlapped for s in timed),
        "synchronous": sum(s.synchronous for s in timed),
    }


def group_members_of(devices: list[Any]) -> Callable[[tuple[tuple[int, ...], ...]], list[Any]]:
    """``group_members`` over ``devices``, once per replica groups (collectives share
    them)."""
    found: dict[tuple[tuple[int, ...], ...], list[Any]] = {}

    def members(groups: tuple[tuple[int, ...], ...]) -> list[Any]:
        if groups not in found:
            found[groups] = group_members(groups, devices)
        return found[groups]

    return members


def collective_rows(timed: list[Any], links: list[str]) -> tuple[dict[str, Any], ...]:
    """``Estimate.collectives``: one row per op and link of the scheduled collectives
    ``timed`` (each over its link in ``links``), with their runs and bytes sent."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for s, link in zip(timed, links, strict=True):
        c = s.collective
        row = rows.setdefault((c.op, link), dict(op=c.op, link=link, runs=0, sent_bytes=0.0))
        row["runs"] += c.count
        row["sent_bytes"] += c.sent_bytes
    return tuple(rows.values())
