"""Calibration tables: what one device kind's kernels measured, with where the figures came from.

A ``Calibration`` holds, for one device kind and JAX version, the microbenchmark
tables the per-op cost model (``shardax.cost.opcost``) prices a compiled step with:

- ``gemm``: ``(m, k) @ (k, n)`` rates by shape and operand dtype (TFLOP/s: bf16, and
  fp32 at JAX's default precision where measured; ``"f32-cublas"``: fp32 with Triton
  GEMMs off, what a cuBLAS call runs);
- ``stream``: GB/s of elementwise passes (bytes read + written), slowest to fastest;
  ``reduce``: the same of reductions (a norm's, a softmax's), where measured;
- ``attention``: cuDNN fused attention, ms per call by (batch, seq, heads, head_dim,
  causal, pass);
- ``launch_us``: the device's cost per kernel inside one program;
- ``dispatch_us``: one program's dispatch, back to back (a table row no longer than about
  this measured the host, not the kernel: ``gemm_rows`` drops it).

``shardax calibrate`` measures them on a GPU (``shardax.cost.calibrate``) and writes a
JSON file; ``load`` reads one, ``register`` makes it the tables of its kind for every
estimate and plan of this process, and ``using`` for a block of this thread only. The
shipped ones (``shardax/cost/tables/*.json``,
measured on GPUs lent to this project) are in ``CALIBRATIONS``, by kind;
``calibration_for`` finds one for a device kind (or says none fits).

No step time is an input: the tables are microbenchmarks only, so a step predicted with
them is predicted "leave-one-out" by construction.

>>> c = calibration_for("NVIDIA H200")
>>> c.name
'calibrated: H200, JAX 0.11.2, 2026-11-27'
>>> calibration_for("NVIDIA H100 80GB HBM3").name
'calibrated: H100, JAX 0.11.2, 2026-11-27'
>>> calibration_for("TPU v5p") is None
True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import re
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from shardax.cost.network import fit_levels, named_network

if TYPE_CHECKING:
    from shardax.cost.hardware import HardwareSpec


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
            (``shardax.cost.network.fit_levels``; across hosts only where the tables were
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
        return {"name": self.name, "kind": self.kind, "device": self.device, "jax": self.jax,
                "date": self.date, "source": self.source, "derived": self.derived,
                "network": self.network, "levels": [list(r) for r in self.levels]}  # fmt: skip


def gemm_rows(c: Calibration) -> list[tuple[int, int, int, str, float]]:
    """``c``'s GEMM rows that timed the kernel: a row no longer than 1.5 × the dispatch
    of a one-kernel program timed the host's dispatch (the H200's 1024³ and 2048³ both
    took ~40 µs), and is dropped; shapes measured twice are averaged.

    >>> [r[:3] for r in gemm_rows(H200) if r[0] == r[1] == r[2]]
    [(4096, 4096, 4096), (8192, 8192, 8192)]
    """
    floor = 1.5 * c.dispatch_us * 1e-3  # ms
    seen: dict[tuple[int, int, int, str], list[float]] = {}
    for m, n, k, dtype, tflops in c.gemm:
        if 2.0 * m * n * k / tflops / 1e9 > floor:
            seen.setdefault((m, n, k, dtype), []).append(tflops)
    return [(*key, sum(v) / len(v)) for key, v in seen.items()]


TABLES = Path(__file__).with_name("tables")
"""The shipped tables: one JSON file per device kind and date (``shardax calibrate``'s
output, with the ``source`` they came from)."""
_KIND = re.compile(r"\b(H100|H200|H800|H20|A100|B200|GB200|GH200)\b", re.IGNORECASE)
_GEMMS = ("gemm", "gemm_f32", "gemm_f32_cublas")
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


def kind_of(device_kind: str) -> str:
    """The kind a calibration is filed under: the GPU's model with the variants that run
    at other rates (``"NVIDIA H100 80GB HBM3"`` → ``"H100"``, ``"NVIDIA H100 PCIe"`` →
    ``"H100 PCIe"``, ``"NVIDIA A100-SXM4-40GB"`` → ``"A100-40GB"``), else the device kind
    as JAX names it.

    >>> kind_of("NVIDIA H100 80GB HBM3"), kind_of("NVIDIA H100 NVL"), kind_of("NVIDIA L4")
    ('H100', 'H100 NVL', 'NVIDIA L4')
    """
    text = str(device_kind)
    found = _KIND.search(text)
    if not found:
        return text
    kind = found.group(1).upper()
    if kind == "A100" and re.search(r"40\s*GB", text, re.IGNORECASE):
        kind += "-40GB"
    for variant in ("PCIe", "NVL"):
        if re.search(rf"\b{variant}\b", text, re.IGNORECASE):
            kind += f" {variant}"
    return kind


_REDUCE_ROWS = ("row sum fp32", "row sum of squares bf16->fp32", "rms norm bf16",
                "column sum fp32")  # fmt: skip
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
    raise ValueError(f"{where}: the {name!r} table is {shown}; 'shardax calibrate' on the "
                     "device measures it (required: gemm, stream, launch)")  # fmt: skip


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
                ok = (isinstance(value, int | float) and not isinstance(value, bool)
                      and math.isfinite(value) and value > 0)  # fmt: skip
                rule = "a finite number > 0"
            elif kind is bool:
                ok, rule = isinstance(value, bool), "true or false"
            elif isinstance(kind, tuple):
                ok, rule = value in kind, f"one of {list(kind)}"
            else:
                ok, rule = isinstance(value, str), "a string"
            if not ok:
                raise ValueError(f"{where}: the {name!r} table's row {i} has {field}={value!r}; "
                                 f"it must be {rule} (rows need {', '.join(fields)})")  # fmt: skip
            values.append(kind(value) if kind in (int, float) else value)
        out.append(tuple(values))
    return out


def from_tables(tables: Mapping[str, Any], *, where: str = "calibration tables") -> Calibration:
    """A ``Calibration`` from what ``shardax calibrate`` measured
    (``shardax.cost.calibrate.tables``' dict, or a GPU session's ``core.calibration``).
    The ``gemm``, ``stream`` and ``launch`` tables are required; ``gemm_f32``,
    ``gemm_f32_cublas`` and ``attention`` are used where measured. A table that failed
    on the device (``{"error": ...}``) counts as not measured. ``where`` names the
    tables in errors (a file's path).

    >>> c = from_tables({"device": "NVIDIA L4", "jax": "0.12.0", "date": "2026-12-01",
    ...     "gemm": [{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 90.0}],
    ...     "stream": [{"gbs": 250.0}], "launch": [{"key": "per_kernel", "us": 2.0},
    ...     {"key": "one_kernel_program", "us": 20.0}]})
    >>> c.name, c.kind, c.stream, c.launch_us
    ('calibrated: NVIDIA L4, JAX 0.12.0, 2026-12-01', 'NVIDIA L4', (250.0,), 2.0)
    """
    if not isinstance(tables, Mapping):
        raise ValueError(f"{where}: a calibration is a JSON object of tables, as "
                         f"'shardax calibrate' writes; got {type(tables).__name__}")  # fmt: skip
    if tables.get("quick"):
        raise ValueError(f"{where}: measured with --quick (small shapes: a smoke test), "
                         "these tables price nothing; run 'shardax calibrate' without "
                         "--quick")  # fmt: skip
    device = tables.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(f"{where}: no 'device' (the device kind the tables were measured on); "
                         f"got {device!r}")  # fmt: skip
    platform, said = str(tables.get("platform", "")).lower(), ""
    if not platform:  # older tables: the device kind tells a CPU's ('cpu') or a TPU's
        lower = device.lower()
        platform = "cpu" if lower == "cpu" else "tpu" if "tpu" in lower else "gpu"
        said = f" (it has no 'platform': its device is {device!r})"
    if platform not in ("gpu", "cuda", "rocm"):
        raise ValueError(f"{where}: measured on a {platform} device{said}; the per-op model "
                         "prices GPU programs, so its tables come from a GPU")  # fmt: skip
    gemm_fields = {"m": int, "n": int, "k": int, "dtype": str, "tflops": float}
    gemm = tuple(row for name in _GEMMS
                 for row in _parse(_rows(tables, name, where, name == "gemm"), name, where,
                                   gemm_fields))  # fmt: skip
    stream = tuple(sorted(r[0] for r in _parse(_rows(tables, "stream", where, True), "stream",
                                               where, {"gbs": float})))  # fmt: skip
    single = [r for r in _rows(tables, "reduce", where, False) if r.get("op") in _REDUCE_ROWS]
    reduce = tuple(sorted(r[0] for r in _parse(single, "reduce", where, {"gbs": float})))
    attention = tuple(_parse(_rows(tables, "attention", where, False), "attention", where, {
        "batch": int, "seq": int, "heads": int, "head_dim": int, "causal": bool,
        "pass": ("fwd", "fwd+bwd"), "ms": float}))  # fmt: skip
    launch: dict[str, float] = {}
    for i, r in enumerate(_rows(tables, "launch", where, True)):
        for key, words in _LAUNCH.items():
            if r.get("key") == key or str(r.get("what", "")).startswith(words):
                us = r.get("us")
                if not isinstance(us, int | float) or not math.isfinite(us) or us < 0:
                    raise ValueError(f"{where}: the 'launch' table's row {i} has us={us!r}; "
                                     "it must be a finite number >= 0")  # fmt: skip
                launch[key] = float(us)
    if missing := [k for k in _LAUNCH if k not in launch]:
        raise ValueError(f"{where}: the 'launch' table has no {missing[0]!r} row "
                         f"('shardax calibrate' measures it)")  # fmt: skip
    bf16_rows = [r for r in gemm if r[3] == "bf16"]
    floor = 1.5 * launch["one_kernel_program"] * 1e-3  # gemm_rows' rule, in ms
    if not any(2.0 * m * n * k / t / 1e9 > floor for m, n, k, _, t in bf16_rows):
        raise ValueError(f"{where}: the 'gemm' table has no bf16 row that timed the kernel "
                         "(the rate every GEMM is priced from; rows no longer than 1.5x a "
                         "one-kernel program's dispatch timed the host)")  # fmt: skip
    from shardax.cost.hardware import device_spec  # hardware imports nothing of this

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
        kind=kind_of(device), jax=str(tables.get("jax", "?")),
        date=str(tables.get("date", "undated")), source=str(tables.get("source", where)),
        gemm=gemm, stream=stream, attention=attention, launch_us=launch["per_kernel"],
        dispatch_us=launch["one_kernel_program"], peak_flops=peak, device=device,
        collectives=fit_collectives(collective_rows), reduce=reduce,
        levels=tuple((k, *v) for k, v in fit_levels(collective_rows).items()), network=network,
    )  # fmt: skip


def load(path: str | Path) -> Calibration:
    """The calibration in a JSON file: ``shardax calibrate --out``'s, or a GPU session's
    ``session.json`` (its ``core.calibration``).

    >>> load(TABLES / "h200-2026-11-27.json").name
    'calibrated: H200, JAX 0.11.2, 2026-11-27'
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"calibration {str(path)!r}: not a JSON file ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("core"), dict):  # a session's record
        if not isinstance(data["core"].get("calibration"), dict):
            raise ValueError(f"calibration {str(path)!r}: a session record without "
                             "core.calibration (its core stage measured no "
                             "tables)")  # fmt: skip
        data = {"source": f"{path} (core.calibration)", **data["core"]["calibration"]}
    if isinstance(data, dict):
        data = {"source": str(path), **data}
    return from_tables(data, where=f"calibration {str(path)!r}")


def register(calibration: Calibration) -> Calibration | None:
    """Makes ``calibration`` the tables of its kind (``calibration.kind``) for this
    process's estimates and plans; returns the one it replaced (None if none).

    >>> mine = load(TABLES / "h100-2026-11-27.json")  # e.g. shardax calibrate --out h100.json
    >>> register(mine) is H100, calibration_for("NVIDIA H100 80GB HBM3") is mine
    (True, True)
    >>> register(H100) is mine
    True
    """
    if not isinstance(calibration, Calibration):
        raise TypeError(f"register(calibration): a Calibration (load(path) reads one); got "
                        f"{type(calibration).__name__}")  # fmt: skip
    previous = CALIBRATIONS.get(calibration.kind)
    CALIBRATIONS[calibration.kind] = calibration
    return previous


@contextlib.contextmanager
def using(calibration: Calibration | None) -> Iterator[Calibration | None]:
    """``calibration`` as the tables of its kind for the block, in this thread (or asyncio
    task) only: estimates another thread runs meanwhile keep the process's tables
    (``register``'s). None: no change. The block must end in the context it began in
    (not across a generator's ``yield`` resumed elsewhere: Python's context variables
    refuse that).

    >>> mine = load(TABLES / "h100-2026-11-27.json")  # shardax calibrate --out h100.json
    >>> with using(mine):  # sx.estimate on an H100 target prices with mine here
    ...     calibration_for("NVIDIA H100 80GB HBM3") is mine
    True
    >>> calibration_for("NVIDIA H100 80GB HBM3") is H100
    True
    """
    if calibration is None:
        yield None
        return
    if not isinstance(calibration, Calibration):
        raise TypeError(f"using(calibration): a Calibration (load(path) reads one) or None; "
                        f"got {type(calibration).__name__}")  # fmt: skip
    token = _SCOPED.set({**_SCOPED.get(), calibration.kind: calibration})
    try:
        yield calibration
    finally:
        _SCOPED.reset(token)


def _shipped() -> dict[str, Calibration]:
    out: dict[str, Calibration] = {}
    for path in sorted(TABLES.glob("*.json")):  # kind-date.json: the latest date wins
        c = load(path)
        out[c.kind] = c
    return out


CALIBRATIONS: dict[str, Calibration] = _shipped()
"""The calibrations by kind: the shipped ones, and any ``register``ed."""
_SCOPED: contextvars.ContextVar[Mapping[str, Calibration]] = contextvars.ContextVar(
    "shardax_calibrations", default=types.MappingProxyType({})
)
"""The calibrations ``using`` blocks put over ``CALIBRATIONS`` in this context (replaced,
never changed in place)."""


def _active() -> dict[str, Calibration]:
    """The calibrations by kind that this thread's estimates price with."""
    return {**CALIBRATIONS, **_SCOPED.get()}


H200 = CALIBRATIONS["H200"]
H100 = CALIBRATIONS["H100"]


def calibration_for(device_kind: str) -> Calibration | None:
    """The calibration of ``device_kind`` (``"NVIDIA H200"``, ``"H100"``: its kind's,
    shipped or ``register``ed), else None (``nearest`` then says how far the nearest
    calibrated kind is).

    >>> calibration_for("NVIDIA H200").kind
    'H200'
    """
    return _active().get(kind_of(device_kind))


def measured_spec(device: Any) -> HardwareSpec | None:
    """Figures of a GPU with no datasheet row, from its kind's calibration (``shardax
    calibrate``'s, ``register``ed): the best measured GEMM rate as its peak, the fastest
    measured stream as its memory bandwidth, its allocator's limit as its memory
    (``shardax.cost.compile_target.device_memory``), and the collectives fitted over one
    host's devices as its link within a host (none between hosts). None where the kind has
    no calibration, or no memory figure is known. ``sx.estimate`` prices such a GPU with
    these (MFU then counts against the measured peak, not a datasheet's; the memory is the
    allocator's budget, not the card's; the link within a host is the median of the fitted
    collectives' bandwidths).

    >>> from types import SimpleNamespace
    >>> l4 = dataclasses.replace(H100, kind="NVIDIA L4", device="NVIDIA L4", peak_flops=1.2e14)
    >>> gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4",
    ...                       memory_stats=lambda: {"bytes_limit": 2e10})
    >>> with using(l4):
    ...     spec = measured_spec(gpu)
    >>> spec.peak_flops, spec.memory_bytes, spec.source
    (120000000000000.0, 20000000000.0, 'measured: calibrated: NVIDIA L4, JAX 0.11.2, 2026-11-27')
    >>> measured_spec(gpu) is None  # no calibration registered for the kind
    True
    """
    from shardax.cost.compile_target import device_memory  # neither imports this module
    from shardax.cost.hardware import HardwareSpec, is_gpu

    c = calibration_for(str(device.device_kind)) if is_gpu(device) else None
    # the allocator's limit (another process's device: this process's of the kind, so
    # every process plans alike); a kind with no datasheet has no other figure
    memory = device_memory(device) if c is not None else None
    if c is None or memory is None:
        return None
    links = sorted(bandwidth for _, _, _, bandwidth in c.collectives)
    return HardwareSpec(
        peak_flops=c.peak_flops, hbm_bandwidth=max(c.stream) * 1e9,
        memory_bytes=memory[0],
        ici_bandwidth=links[len(links) // 2] if links else None,
        source=MEASURED + c.name,
    )  # fmt: skip


def device_figures(device: Any) -> HardwareSpec | None:
    """``device``'s figures for a prediction: its datasheet row (``device_spec``), else
    those its kind's calibration measured (``measured_spec``), else None."""
    from shardax.cost.hardware import device_spec

    return device_spec(device) or measured_spec(device)


MEASURED = "measured: "
"""How ``measured_spec``'s figures name their source (then the calibration's name)."""


def nearest(peak_flops: float | None, hbm_bandwidth: float | None) -> tuple[Calibration, str]:
    """The measured calibration (shipped or registered) closest to a device of ``peak_flops``
    and ``hbm_bandwidth`` (its datasheet), and a sentence on how far off it is.

    >>> c, why = nearest(2.25e15, 8e12)
    >>> print(c.kind, why)  # doctest: +NORMALIZE_WHITESPACE
    H200 uncalibrated: the nearest calibrated kind, H200, has 0.44× its peak FLOP/s and 0.51×
    its HBM bandwidth
    """

    def gap(c: Calibration) -> float:
        ratios = [c.peak_flops / peak_flops if peak_flops else 1.0,
                  max(c.stream) * 1e9 / hbm_bandwidth if hbm_bandwidth else 1.0]  # fmt: skip
        return sum(abs(_log(r)) for r in ratios)

    measured = [c for c in _active().values() if not c.derived]
    best = min(measured, key=gap)
    flops = f"{best.peak_flops / peak_flops:.2f}× its peak FLOP/s" if peak_flops else "?"
    bw = (
        f"{max(best.stream) * 1e9 / hbm_bandwidth:.2f}× its HBM bandwidth" if hbm_bandwidth else "?"
    )
    return best, f"uncalibrated: the nearest calibrated kind, {best.kind}, has {flops} and {bw}"


def _log(x: float) -> float:
    return math.log(x) if x > 0 else 0.0


__all__ = [
    "CALIBRATIONS", "MEASURED", "Calibration", "calibration_for", "device_figures",
    "from_tables", "kind_of", "load", "measured_spec", "nearest", "register", "using",
]  # fmt: skip
