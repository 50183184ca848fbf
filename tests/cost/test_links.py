"""Collectives across GPU hosts: the bytes each device moves between hosts and within its
host (cost/predict.py's host_share), and their time in the per-op model (cost/opcost.py)
and in sx.estimate's overlap line (cost/estimation.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from shardax.cost.calibration import H100
from shardax.cost.hlo import Collective
from shardax.cost.kernel_prices import LATENCY_S
from shardax.cost.links import overlap_of, wire_bytes
from shardax.cost.opcost import price_hlo
from shardax.cost.predict import host_share, wire_seconds
from shardax.cost.schedule import Scheduled

NVLINK, IB = 4.5e11, 5e10
LINKS = {"intra-host": NVLINK, "inter-host": IB}


def ring_bytes_between_hosts(n: int, hosts: int, size: float) -> float:
    """A ring all-gather of ``size`` bytes (the gathered result) over ``hosts`` hosts of
    ``n / hosts`` GPUs, one ring per NIC (each ring's order within a host rotated, so a
    different GPU takes its hop to the next host): the most bytes a GPU sends between
    hosts, counted hop by hop."""
    g = n // hosts
    ranks = np.arange(n)
    rings = [np.roll(ranks.reshape(hosts, g), -r, axis=1).reshape(-1) for r in range(g)]
    crossing = np.zeros(n)
    for ring in rings:  # each ring carries size / g, in n - 1 steps of one block each
        for i, rank in enumerate(ring):
            nxt = ring[(i + 1) % n]
            if rank // g != nxt // g:
                crossing[rank] += (n - 1) * size / g / n
    return float(crossing.max())


@pytest.mark.parametrize("n,hosts", [(128, 16), (16, 2), (8, 2), (16, 16)])
def test_a_ring_sends_host_share_of_its_bytes_between_hosts(n, hosts):
    size = 1e9
    sent = Collective("all-gather", size, n).sent_bytes  # (n-1)/n of the result
    expected = ring_bytes_between_hosts(n, hosts, size)
    g = n // hosts
    assert host_share("all-gather", n, g) * sent == pytest.approx(expected)
    assert host_share("reduce-scatter", n, g) == host_share("all-gather", n, g)
    assert host_share("all-to-all", 16, 8) == pytest.approx(8 / 15)  # 8 of 15 peers away
    assert host_share("collective-permute", 16, 8) == 1.0
    assert host_share("all-gather", 8, 8) == 0.0  # all on one host


def scheduled(op: str, size: float, group: int, runs: int = 1) -> Scheduled:
    c = Collective(op, size, group, count=runs, groups=(tuple(range(group)),))
    return Scheduled(c, "ag", "main", 0, 1, True, 0, 0.0, None)


def test_a_group_across_gpu_hosts_splits_its_bytes_and_takes_the_slower_link():
    devices = [SimpleNamespace(process_index=i // 8, slice_index=0, platform="gpu")
               for i in range(128)]  # fmt: skip
    s = scheduled("all-gather", 1.28e9, 128, runs=2)
    wire = wire_bytes(s, "inter-host", devices, LINKS)
    share = 1 / 8  # one ring per NIC: each GPU carries one ring's hop between hosts
    assert wire["inter-host"] == pytest.approx(share * s.sent_bytes)
    assert wire["intra-host"] + wire["inter-host"] == pytest.approx(s.sent_bytes)
    # within a host, on a TPU (ICI within a slice), or on GPUs with no NVLink figure (a
    # PCIe part): every byte on the group's link
    assert wire_bytes(s, "intra-host", devices, LINKS) == {"intra-host": s.sent_bytes}
    tpus = [SimpleNamespace(**{**vars(d), "platform": "tpu"}) for d in devices]
    assert wire_bytes(s, "inter-host", tpus, LINKS) == {"inter-host": s.sent_bytes}
    assert wire_bytes(s, "inter-host", devices, {"inter-host": IB}) == {"inter-host": s.sent_bytes}
    # one GPU per host: every byte crosses, and nothing is left on NVLink
    one_each = [SimpleNamespace(process_index=i, slice_index=0, platform="gpu") for i in range(4)]
    r = scheduled("all-gather", 4e8, 4)
    assert wire_bytes(r, "inter-host", one_each, LINKS) == {"inter-host": r.sent_bytes}
    # hosts holding 8 and 4 of a group of 12: the 4's GPUs carry a quarter each
    uneven = [SimpleNamespace(process_index=int(i >= 8), slice_index=0, platform="gpu")
              for i in range(12)]  # fmt: skip
    u = scheduled("all-gather", 1.2e9, 12)
    assert wire_bytes(u, "inter-host", uneven, LINKS)["inter-host"] == pytest.approx(
        u.sent_bytes / 4
    )
    one = max(share * s.sent_bytes / 2 / IB, (1 - share) * s.sent_bytes / 2 / NVLINK)
    assert wire_seconds({k: v / 2 for k, v in wire.items()}, LINKS) == pytest.approx(one)
    assert wire_seconds(wire, {"inter-host": IB}) is None  # a link without a bandwidth
    # sx.estimate's overlap line and the per-op model price it alike (synchronous: all
    # of it exposed); the per-op model adds the inter-host latency per run
    o = overlap_of([s], [wire], LINKS, flop_rate=1e15)
    assert o["collective_s"] == pytest.approx(2 * one) and o["exposed_s"] == o["collective_s"]
    cost = price_hlo("ENTRY %main {\n}", H100, wire_of=lambda _: wire, link_bandwidth=LINKS,
                     scheduled=[s])  # fmt: skip
    assert cost.collective_s == pytest.approx(2 * (one + LATENCY_S["inter-host"]))
    assert cost.exposed_s == pytest.approx(cost.collective_s)
    # an eighth of every byte over one NIC, which the model charged before
    assert cost.collective_s == pytest.approx(s.sent_bytes / IB / 8 + 2 * LATENCY_S["inter-host"])


def test_a_permute_is_priced_by_the_pair_that_crosses_hosts():
    """A pipeline over 8 GPUs on 2 hosts of 4 sends stage to stage: three pairs within a
    host, one between them. All pairs run at once, so the crossing pair sets the time."""
    from shardax.cost.links import group_link, group_members

    def _link(groups, devices):  # the link a collective's slowest group crosses
        return group_link(group_members(groups, devices))

    devices = [SimpleNamespace(process_index=i // 4, slice_index=0, platform="gpu")
               for i in range(8)]  # fmt: skip
    pairs = tuple((i, i + 1) for i in range(7))
    assert _link(pairs, devices) == "inter-host"
    assert _link(pairs[:3], devices) == "intra-host"  # the first host's stages only
    permute = Collective("collective-permute", 4e8, 2, groups=pairs)
    s = Scheduled(permute, "cp", "main", 0, 1, True, 0, 0.0, None)
    assert wire_bytes(s, "inter-host", devices, LINKS) == {"inter-host": permute.sent_bytes}
    assert _link(pairs[3:4] + pairs[:3], devices) == "inter-host"  # wherever it is listed


def test_a_calibrations_measured_collectives_price_those_within_one_host():
    """A calibration that measured all-gather over 8 GPUs of a host prices an 8-device
    all-gather within a host at its fitted latency and bandwidth; one across hosts, or of
    another group size, at the assumed latency and the datasheet's links."""
    import dataclasses

    mine = dataclasses.replace(H100, collectives=(("all-gather", 8, 3e-5, 3.6e11),))
    s = scheduled("all-gather", 8e8, 8, runs=3)
    per_run = s.sent_bytes / 3
    cost = price_hlo("ENTRY %main {\n}", mine, link_bandwidth=LINKS, scheduled=[s])
    assert cost.collective_s == pytest.approx(3 * (3e-5 + per_run / 3.6e11))
    shipped = price_hlo("ENTRY %main {\n}", H100, link_bandwidth=LINKS, scheduled=[s])
    assert shipped.collective_s == pytest.approx(3 * (LATENCY_S["intra-host"] + per_run / NVLINK))
    across = {"inter-host": per_run * 3 / 8, "intra-host": per_run * 3 * 7 / 8}
    cost = price_hlo("ENTRY %main {\n}", mine, wire_of=lambda _: across, link_bandwidth=LINKS,
                     scheduled=[s])  # fmt: skip
    assert cost.collective_s == pytest.approx(3 * (LATENCY_S["inter-host"] + per_run / 8 / IB))
    four = scheduled("all-gather", 8e8, 4)
    cost = price_hlo("ENTRY %main {\n}", mine, link_bandwidth=LINKS, scheduled=[four])
    assert cost.collective_s == pytest.approx(LATENCY_S["intra-host"] + four.sent_bytes / NVLINK)
