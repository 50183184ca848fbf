"""What a target's name means: the GPU cluster or TPU slices ``sx.target`` builds.

- GPUs: ``"<GPUs per host>x<GPU>"`` (one host) or ``"<hosts>x<GPUs per host>x<GPU>"``, for
  the GPU kinds of the table of accelerators with a host size (H100, H200, B200,
  A100-80GB). A single number above the kind's host (8, the GPUs of an HGX/DGX server) is
  split into hosts of it: ``"64xH100"`` is 8 hosts of 8; ``"4xH100"`` is one host of 4. A
  host holds at most its kind's ``host_devices``, so ``"2x16xH100"`` is refused.
- TPU slices as Google Cloud names them: ``"v5p-N"`` counts TensorCores (2 per chip, so
  ``"v5p-128"`` is 64 chips), ``"v5e-N"``/``"v5litepod-N"`` and ``"v6e-N"`` count chips.
  ``"Kx<slice>"`` is K slices over the data-center network (multislice): ``"2xv5p-128"``.

>>> parse_target("64xH100")["hosts"], parse_target("v5p-128")["chips"]
(8, 64)
"""

from __future__ import annotations

import re
from typing import Any

from shardax.cost.accelerators import ACCELERATORS, Accelerator, gpu_targets, tpu_targets

_EXAMPLES = "'8xH100', '2x8xH200', '64xB200', '8xA100-80GB', 'v5p-128', 'v5e-16', '2xv5p-128'"


def _tpu_names() -> dict[str, Accelerator]:
    return {name: row for row in tpu_targets() for name in (row.kind, *row.aliases)}


def _sizes(row: Accelerator) -> list[int]:
    assert row.tpu is not None
    return sorted(c * row.tpu.cores_per_chip for c in row.tpu.topologies)


def known_targets() -> list[str]:
    """Examples of every kind of name [`target`][shardax.target] takes (the rules are in
    this module's doc).

    >>> "v5p-128" in known_targets()
    True
    """
    gpus = [f"8x{row.kind}" for row in gpu_targets()] + ["2x4xH100", "64xH100"]
    tpus = [f"{name}-{n}" for name, row in _tpu_names().items() for n in _sizes(row)]
    return gpus + tpus + ["2xv5p-128"]


def _unknown(name: str, why: str) -> ValueError:
    families = ", ".join(f"{f}-N (N in {_sizes(row)})" for f, row in _tpu_names().items())
    gpus = sorted(row.kind for row in gpu_targets())
    return ValueError(
        f"name must name a GPU cluster '<GPUs per host>x<GPU>' or '<hosts>x<GPUs per host>"
        f"x<GPU>' with GPU one of {gpus}, or a TPU slice {families}, with "
        f"'<K>x' before a TPU slice for K slices (e.g. {_EXAMPLES}); {why}, got {name!r}"
    )


def _gpu(name: str, row: Accelerator, hosts_text: str | None, count: int) -> dict[str, Any]:
    most, model = int(row.host_devices or 0), row.kind
    hosts, per_host = (int(hosts_text), count) if hosts_text else (1, count)
    if not hosts_text and count > most:
        if count % most:
            write = f"write '<hosts>x<GPUs per host>x{model}'"
            raise _unknown(name, f"{count} GPUs do not fill hosts of {most}; {write}")
        hosts, per_host = count // most, most
    if hosts < 1 or per_host < 1:
        raise _unknown(name, "the counts must be >= 1")
    if per_host > most:
        total = hosts * per_host
        way = f"'<hosts>x<GPUs per host>x{model}' with at most {most} per host"
        if total % most == 0:
            way = f"'{total}x{model}' ({total // most} hosts of {most}), or " + way
        raise ValueError(
            f"name {name!r} puts {per_host} {model} GPUs on one host, but an HGX/DGX {model} "
            f"host (one NVLink domain, the server the datasheet's figures describe) "
            f"holds at most {most}; write {way}"
        )
    found = {"platform": "gpu", "model": model, "kind": row.device_kind, "hosts": hosts}
    return {**found, "devices_per_host": per_host}


def parse_target(name: str) -> dict[str, Any]:
    """What a target's name means, without building devices: ``platform``, ``kind`` (the
    devices' kind), ``model`` (the row's kind) and ``hosts``/``devices_per_host`` (GPUs),
    or ``family``/``chips``/``slices``/``topology`` (TPUs)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str such as '8xH100' or 'v5p-128', got {name!r}")
    text = name.strip()
    gpu = re.fullmatch(r"(?:(\d+)x)?(\d+)x([A-Za-z0-9-]+)", text)
    rows = {row.kind.upper(): row for row in gpu_targets()}
    if gpu and gpu.group(3).upper() in rows:
        return _gpu(name, rows[gpu.group(3).upper()], gpu.group(1), int(gpu.group(2)))
    tpu = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)-(\d+)", text.lower())
    families = _tpu_names()
    if tpu and tpu.group(2) in families:
        row = families[tpu.group(2)]
        assert row.tpu is not None
        info = row.tpu
        slices, count = int(tpu.group(1) or 1), int(tpu.group(3))
        chips, odd = divmod(count, info.cores_per_chip)
        if odd or chips not in info.topologies:
            unit = "TensorCores (2 per chip)" if info.cores_per_chip == 2 else "chips"
            sizes = _sizes(row)
            raise _unknown(name, f"{tpu.group(2)}-N counts {unit} and N must be one of {sizes}")
        if slices < 1:
            raise _unknown(name, "the number of slices must be >= 1")
        topology = f"{info.prefix}:{info.topologies[chips]}"
        found = {"platform": "tpu", "family": tpu.group(2), "kind": row.device_kind}
        return {**found, "chips": chips, "slices": slices, "topology": topology}
    raise _unknown(name, "this is neither")


# Views of the table under the names they replaced (shardax._names.MOVED), for a release.
GPUS_PER_HOST = 8
GPU_KINDS = {row.kind: row.device_kind for row in gpu_targets()}
TPU_FAMILIES = {
    name: row.tpu
    for row in ACCELERATORS.values()
    if row.tpu is not None
    for name in (row.kind, *row.aliases)
}
