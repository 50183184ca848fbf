"""Calibrations by device kind: the shipped ones, those ``register``ed, and those a block
is ``using``.

``shardax calibrate`` measures a GPU's kernels (``shardax.cost.calibrate``) and writes a
JSON file; ``load`` reads one (``shardax.cost.measurements``), ``register`` makes it the
tables of its kind for every estimate and plan of this process, and ``using`` for a block of
this thread only. The shipped ones (``shardax/cost/tables/*.json``, measured on GPUs lent to
this project) are their kinds' rows' ``calibration`` in the table of accelerators
(``shardax.cost.accelerators``); ``calibration_for`` finds one for a device kind (or
``nearest`` says how far the nearest is).

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
import functools
import json
import math
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

from shardax.cost.accelerators import ACCELERATORS, kind_of
from shardax.cost.measurements import Calibration, from_tables

TABLES = Path(__file__).with_name("tables")
"""The shipped tables: one JSON file per device kind and date (``shardax calibrate``'s
output, with the ``source`` they came from), each named by its kind's row."""


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
            raise ValueError(
                f"calibration {str(path)!r}: a session record without "
                "core.calibration (its core stage measured no "
                "tables)"
            )
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
        raise TypeError(
            f"register(calibration): a Calibration (load(path) reads one); got "
            f"{type(calibration).__name__}"
        )
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
        raise TypeError(
            f"using(calibration): a Calibration (load(path) reads one) or None; "
            f"got {type(calibration).__name__}"
        )
    token = _SCOPED.set({**_SCOPED.get(), calibration.kind: calibration})
    try:
        yield calibration
    finally:
        _SCOPED.reset(token)


@functools.cache
def _shipped_file(path: Path) -> Calibration:
    return load(path)


def _shipped() -> dict[str, Calibration]:
    """The calibrations the table's rows name, by kind (read once per file)."""
    return {
        row.kind: _shipped_file(TABLES / row.calibration)
        for row in ACCELERATORS.values()
        if row.calibration is not None
    }


CALIBRATIONS: dict[str, Calibration] = _shipped()
"""The calibrations by kind: the shipped ones, and any ``register``ed."""
_SCOPED: contextvars.ContextVar[Mapping[str, Calibration]] = contextvars.ContextVar(
    "shardax_calibrations", default=types.MappingProxyType({})
)
"""The calibrations ``using`` blocks put over ``CALIBRATIONS`` in this context (replaced,
never changed in place)."""


def _active() -> dict[str, Calibration]:
    """The calibrations by kind that this thread's estimates price with: those of the
    table's rows (a row added since import too), under the ``register``ed, under this
    context's ``using``."""
    return {**_shipped(), **CALIBRATIONS, **_SCOPED.get()}


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


def nearest(peak_flops: float | None, hbm_bandwidth: float | None) -> tuple[Calibration, str]:
    """The measured calibration (shipped or registered) closest to a device of ``peak_flops``
    and ``hbm_bandwidth`` (its datasheet), and a sentence on how far off it is.

    >>> c, why = nearest(2.25e15, 8e12)
    >>> print(c.kind, why)  # doctest: +NORMALIZE_WHITESPACE
    H200 uncalibrated: the nearest calibrated kind, H200, has 0.44× its peak FLOP/s and 0.51×
    its HBM bandwidth
    """

    def gap(c: Calibration) -> float:
        ratios = [
            c.peak_flops / peak_flops if peak_flops else 1.0,
            max(c.stream) * 1e9 / hbm_bandwidth if hbm_bandwidth else 1.0,
        ]
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
    "CALIBRATIONS",
    "TABLES",
    "Calibration",
    "calibration_for",
    "load",
    "nearest",
    "register",
    "using",
]
