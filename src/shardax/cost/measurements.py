"""What ``shardax calibrate`` measured on one device kind, read into a ``Calibration``: the
tables' rules, and the fit of its collectives.

A ``Calibration`` holds, for one device kind and JAX version, the microbenchmark
tables the per-op cost model (``shardax.cost.opcost``) prices a compiled step with:

- ``gemm``: ``(m, k) @ (k, n)`` rates by shape and operand dtype (TFLOP/s: bf16, and
  fp32 at JAX's default precision where measured; ``"f32-cublas"``: fp32 with Triton
  GEMMs off, what a cuBLAS call runs; ``"f8"``: E4M3 operands, a GPU with fp8 tensor cores);
- ``stream``: GB/s of elementwise passes (bytes read + written), slowest to fastest;
  ``reduce``: the same of reductions (a norm's, a softmax's), where measured;
- ``attention``: cuDNN fused attention, ms per call by (batch, seq, heads, head_dim,
  causal, pass);
- ``launch_us``: the device's cost per kernel inside one program;
- ``dispatch_us``: one program's dispatch, back to back (a table row no longer than about
  this measured the host, not the kernel: ``gemm_rows`` drops it).

No step time is an input: the tables are microbenchmarks only, so a step predicted with
them is predicted "leave-one-out" by construction. ``shardax.cost.calibration`` holds the
shipped and registered ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from shardax.cost.accelerators import kind_of
from shardax.cost.hardware import device_spec
from shardax.cost.nccl import fit_levels
from shardax.cost.network import named_network


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One device kind's measured kernel tables (see the module).

    Attributes:
        kind: the device kind it was measured on (``"H200"``); jax: the JAX version;
        date: when; source: the file or page the figures are from.
        gemm: ``(m, n, k, dtype, TFLOP/s)`` rows; stream: GB/s per pass, sorted;
        attention: ``(batch, seq, heads, head_dim, causal, pass, ms)`` rows, ``pass``
        ``"fwd"`` or ``"fwd+bwd"``.
        launch_us: µs per kernel in a program; dispatch_us: µs per one-kernel program.
        peak_flops: the dense bf16 peak it was measured against (FLOP/s): the datasheet's,
            or the best measured GEMM rate for a kind with no datasheet row.
        derived: None where measured; else how the tables were derived (scaled from
            another kind's): then ``name`` says so.
        device: the device kind as JAX named it (``"NVIDIA H100 80GB HBM3"``).
        reduce: GB/s of single-pass reductions (row sums, a norm, softmax), sorted;
            empty where not measured (reductions then priced at ``stream``).
        collectives: ``(op, devices, latency s, bytes/s)`` fitted per op to the
            collectives measured over one host's devices (``fit_collectives``); empty
            where one device was measured.
        levels: ``(level, per-step latency s, bytes/s)`` of the network's levels
            (``"intra-host"``, ``"inter-host"``) fitted to the measured collectives
            (``shardax.cost.nccl.fit_levels``; across hosts only where the tables were
            measured over several hosts); empty where not measured.
        network: the named network the tables were measured on (``shardax calibrate
            --network``): its ``"inter-host"`` fit replaces that network's documented
            figures (``shardax.cost.network.with_fitted``); None where not named.
    """

    kind: str
    jax: str
    date: str
    source: str
    gemm: tuple[tuple[int, int, int, str, float], ...]
    stream: tuple[float, ...]
    attention: tuple[tuple[int, int, int, int, bool, str, float], ...]
    launch_us: float
    dispatch_us: float
    peak_flops: float
    derived: str | None = None
    device: str = ""
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    reduce: tuple[float, ...] = ()
    levels: tuple[tuple[str, float, float], ...] = ()
    network: str | None = None

    @property
    def name(self) -> str:
        """``"calibrated: H200, JAX 0.11.2, 2026-11-27"`` (``"derived: ..."`` where the
        tables were scaled from another kind's)."""
        word = "derived" if self.derived else "calibrated"
        return f"{word}: {self.kind}, JAX {self.jax}, {self.date}"

    def to_dict(self) -> dict[str, Any]:
        """The name and provenance (not the tables)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "device": self.device,
            "jax": self.jax,
            "date": self.date,
            "source": self.source,
            "derived": self.derived,
            "network": self.network,
            "levels": [list(r) for r in self.levels],
        }


def gemm_rows(c: Calibration) -> list[tuple[int, int, int, str, float]]:
    """``c``'s GEMM rows that timed the kernel: a row no longer than 1.5 × the dispatch
    of a one-kernel program timed the host's dispatch (the H200's 1024³ and 2048³ both
    took ~40 µs), and is dropped; shapes measured twice are averaged.

    >>> from shardax.cost.calibration import H200
    >>> [r[:3] for r in gemm_rows(H200) if r[0] == r[1] == r[2]]
    [(4096, 4096, 4096), (8192, 8192, 8192)]
    """
    floor = 1.5 * c.dispatch_us * 1e-3  # ms
    seen: dict[tuple[int, int, int, str], list[float]] = {}
    for m, n, k, dtype, tflops in c.gemm:
        if 2.0 * m * n * k / tflops / 1e9 > floor:
            seen.setdefault((m, n, k, dtype), []).append(tflops)
    return [(*key, sum(v) / len(v)) for key, v in seen.items()]


_GEMMS = ("gemm", "gemm_f32", "gemm_f32_cublas", "gemm_fp8")
_LAUNCH = {  # launch rows by key, or by the words of tables measured before rows had keys
    "per_kernel": "per kernel, a chain",
    "one_kernel_program": "one program of one kernel",
}


def fit_collectives(rows: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, int, float, float], ...]:
    """``(op, devices, latency s, bytes/s)`` per op and group size: the line
    ``ms = latency + sent_bytes / bandwidth`` through the measured sizes, least squares in
    relative error (small and large messages count alike). Rows with an error, or an op
    whose fit is not a latency ≥ 0 and a bandwidth > 0, are left out.

    >>> rows = [{"op": "all-gather", "devices": 8, "sent_bytes": b,
    ...          "ms": 1e3 * (2e-5 + b / 2e11)} for b in (2**16, 2**20, 2**24, 2**28)]
    >>> [(op, n, round(t * 1e6, 3), round(bw / 1e9, 3)) for op, n, t, bw in fit_collectives(rows)]
    [('all-gather', 8, 20.0, 200.0)]
    """
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        if "ms" in r and r.get("sent_bytes"):
            key = (str(r["op"]), int(r["devices"]))
            groups.setdefault(key, []).append((float(r["sent_bytes"]), float(r["ms"]) * 1e-3))
    out = []
    for (op, n), points in sorted(groups.items()):
        if len(points) < 2:
            continue
        # minimise sum(((a + s * g) - t) / t)^2 over a (latency) and g (1 / bandwidth)
        saa = sum(1 / t**2 for _, t in points)
        sag = sum(s / t**2 for s, t in points)
        sgg = sum((s / t) ** 2 for s, t in points)
        sa, sg = sum(1 / t for _, t in points), sum(s / t for s, t in points)
        det = saa * sgg - sag**2
        if det <= 0:
            continue
        a, g = (sa * sgg - sg * sag) / det, (saa * sg - sag * sa) / det
        if a < 0:  # no latency the sizes can resolve: the bandwidth alone
            a, g = 0.0, sg / sgg
        if g > 0:
            out.append((op, n, a, 1 / g))
    return tuple(out)


_REDUCE_ROWS = ("row sum fp32", "row sum of squares bf16->fp32", "rms norm bf16", "column sum fp32")
"""The reductions whose median prices a kernel that reduces: a fixed set, so that a new
calibration moves prices only where the device differs (the softmax rows are for reading)."""


def _rows(tables: Mapping[str, Any], name: str, where: str, required: bool) -> list[Any]:
    table = tables.get(name)
    if isinstance(table, list) and table and all(isinstance(r, Mapping) for r in table):
        return list(table)
    if not required:
        return []
    if table is None:
        shown = "missing"
    elif table == []:
        shown = "empty"
    elif isinstance(table, Mapping) and "error" in table:
        shown = f"a failure on the device ({str(table['error'])[:160]})"
    else:
        shown = f"not a list of rows: {str(table)[:120]!r}"
    raise ValueError(
        f"{where}: the {name!r} table is {shown}; 'shardax calibrate' on the "
        "device measures it (required: gemm, stream, launch)"
    )


def _parse(rows: list[Any], name: str, where: str, fields: dict[str, Any]) -> list[tuple]:
    """``rows`` as tuples of ``fields`` (name → type: ``int``/``float`` must be finite and
    > 0, ``bool`` a JSON boolean, a tuple one of its strings, ``str`` any), rows with an
    ``"error"`` skipped; a bad row is named with its index and the rule."""
    out = []
    for i, row in enumerate(rows):
        if "error" in row:
            continue
        values = []
        for field, kind in fields.items():
            value = row.get(field)
            if kind in (int, float):
                ok = (
                    isinstance(value, int | float)
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                    and value > 0
                )
                rule = "a finite number > 0"
            elif kind is bool:
                ok, rule = isinstance(value, bool), "true or false"
            elif isinstance(kind, tuple):
                ok, rule = value in kind, f"one of {list(kind)}"
            else:
                ok, rule = isinstance(value, str), "a string"
            if not ok:
                raise ValueError(
                    f"{where}: the {name!r} table's row {i} has {field}={value!r}; "
                    f"it must be {rule} (rows need {', '.join(fields)})"
                )
            values.append(kind(value) if kind in (int, float) else value)
        out.append(tuple(values))
    return out


def from_tables(tables: Mapping[str, Any], *, where: str = "calibration tables") -> Calibration:
    """A ``Calibration`` from what ``shardax calibrate`` measured
    (``shardax.cost.calibrate.tables``' dict, or a GPU session's ``core.calibration``).
    The ``gemm``, ``stream`` and ``launch`` tables are required; ``gemm_f32``,
    ``gemm_f32_cublas``, ``gemm_fp8`` and ``attention`` are used where measured. A table
    that failed on the device (``{"error": ...}``) or was skipped there
    (``{"skipped": why}``) counts as not measured. ``where`` names the tables in errors
    (a file's path).

    >>> c = from_tables({"device": "NVIDIA L4", "jax": "0.12.0", "date": "2026-12-01",
    ...     "gemm": [{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 90.0}],
    ...     "stream": [{"gbs": 250.0}], "launch": [{"key": "per_kernel", "us": 2.0},
    ...     {"key": "one_kernel_program", "us": 20.0}]})
    >>> c.name, c.kind, c.stream, c.launch_us
    ('calibrated: NVIDIA L4, JAX 0.12.0, 2026-12-01', 'NVIDIA L4', (250.0,), 2.0)
    """
    if not isinstance(tables, Mapping):
        raise ValueError(
            f"{where}: a calibration is a JSON object of tables, as "
            f"'shardax calibrate' writes; got {type(tables).__name__}"
        )
    if tables.get("quick"):
        raise ValueError(
            f"{where}: measured with --quick (small shapes: a smoke test), "
            "these tables price nothing; run 'shardax calibrate' without "
            "--quick"
        )
    device = tables.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(
            f"{where}: no 'device' (the device kind the tables were measured on); got {device!r}"
        )
    platform, said = str(tables.get("platform", "")).lower(), ""
    if not platform:  # older tables: the device kind tells a CPU's ('cpu') or a TPU's
        lower = device.lower()
        platform = "cpu" if lower == "cpu" else "tpu" if "tpu" in lower else "gpu"
        said = f" (it has no 'platform': its device is {device!r})"
    if platform not in ("gpu", "cuda", "rocm"):
        raise ValueError(
            f"{where}: measured on a {platform} device{said}; the per-op model "
            "prices GPU programs, so its tables come from a GPU"
        )
    gemm_fields = {"m": int, "n": int, "k": int, "dtype": str, "tflops": float}
    gemm = tuple(
        row
        for name in _GEMMS
        for row in _parse(_rows(tables, name, where, name == "gemm"), name, where, gemm_fields)
    )
    stream = tuple(
        sorted(
            r[0]
            for r in _parse(_rows(tables, "stream", where, True), "stream", where, {"gbs": float})
        )
    )
    single = [r for r in _rows(tables, "reduce", where, False) if r.get("op") in _REDUCE_ROWS]
    reduce = tuple(sorted(r[0] for r in _parse(single, "reduce", where, {"gbs": float})))
    attention = tuple(
        _parse(
            _rows(tables, "attention", where, False),
            "attention",
            where,
            {
                "batch": int,
                "seq": int,
                "heads": int,
                "head_dim": int,
                "causal": bool,
                "pass": ("fwd", "fwd+bwd"),
                "ms": float,
            },
        )
    )
    launch: dict[str, float] = {}
    for i, r in enumerate(_rows(tables, "launch", where, True)):
        for key, words in _LAUNCH.items():
            if r.get("key") == key or str(r.get("what", "")).startswith(words):
                us = r.get("us")
                if not isinstance(us, int | float) or not math.isfinite(us) or us < 0:
                    raise ValueError(
                        f"{where}: the 'launch' table's row {i} has us={us!r}; "
                        "it must be a finite number >= 0"
                    )
                launch[key] = float(us)
    if missing := [k for k in _LAUNCH if k not in launch]:
        raise ValueError(
            f"{where}: the 'launch' table has no {missing[0]!r} row "
            f"('shardax calibrate' measures it)"
        )
    bf16_rows = [r for r in gemm if r[3] == "bf16"]
    floor = 1.5 * launch["one_kernel_program"] * 1e-3  # gemm_rows' rule, in ms
    if not any(2.0 * m * n * k / t / 1e9 > floor for m, n, k, _, t in bf16_rows):
        raise ValueError(
            f"{where}: the 'gemm' table has no bf16 row that timed the kernel "
            "(the rate every GEMM is priced from; rows no longer than 1.5x a "
            "one-kernel program's dispatch timed the host)"
        )
    spec = device_spec(SimpleNamespace(platform="gpu", device_kind=device))
    peak = spec.peak_flops if spec else max(r[4] for r in gemm) * 1e12
    collective_rows = _rows(tables, "collectives", where, False)
    network = tables.get("network")
    if network is not None:
        try:
            network = named_network(network).name
        except ValueError as e:
            raise ValueError(f"{where}: its 'network' names no known network: {e}") from None
    return Calibration(
        kind=kind_of(device),
        jax=str(tables.get("jax", "?")),
        date=str(tables.get("date", "undated")),
        source=str(tables.get("source", where)),
        gemm=gemm,
        stream=stream,
        attention=attention,
        launch_us=launch["per_kernel"],
        dispatch_us=launch["one_kernel_program"],
        peak_flops=peak,
        device=device,
        collectives=fit_collectives(collective_rows),
        reduce=reduce,
        levels=tuple((k, *v) for k, v in fit_levels(collective_rows).items()),
        network=network,
    )
