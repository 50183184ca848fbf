"""Two trees of one structure, leaf by leaf, at a tolerance for the order of float sums.

A leaf differs when its largest difference is above ``atol + rtol * max|reference leaf|``:
relative to the leaf's scale, not elementwise, so elements near zero raise no false alarm.
Integer leaves and typed PRNG keys (by their key data) must be equal.

>>> got, want = {"w": np.array([1.0, 2.0])}, {"w": np.array([1.0, 2.00001])}
>>> [(d.path, d.ok) for d in compare(got, want, 1, *tolerance("fp32"))]
[('w', True)]
>>> compare({"n": np.array(3)}, {"n": np.array(4)}, 1, 1e-4, 1e-6)[0].ok  # exact
False
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.plan.tree import is_array, is_key, path_str
from shardax.train.precision import Precision, resolve

TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-6),
    "fp16": (2e-2, 1e-4),
    "bf16": (5e-2, 1e-3),
}
"""``(rtol, atol)`` by compute precision. A leaf differs when its largest difference is
above ``atol + rtol * max|reference|``: relative to the leaf's scale, not elementwise,
so elements near zero do not raise false alarms."""


def tolerance(precision: str | Precision) -> tuple[float, float]:
    """``(rtol, atol)`` for a precision: by its compute dtype (``TOLERANCES``)."""
    dtype = jnp.dtype(resolve(precision).compute_dtype)
    name = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16"}.get(dtype, "fp32")
    return TOLERANCES[name]


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """One leaf's difference at one step: ``max_abs`` (largest absolute difference),
    ``max_rel`` (that over ``scale``, the reference leaf's largest magnitude), ``limit``
    (the tolerance ``atol + rtol * scale``); ``index``, ``got`` and ``want``: where the
    largest difference is, the distributed value and the reference's there; ``shapes``:
    the distributed and the reference leaf's shapes where they differ (else None);
    ``noise``: an update of rounding noise (``noise.unread``), not a difference."""

    path: str
    step: int
    max_abs: float
    max_rel: float
    limit: float
    scale: float
    index: tuple[int, ...] = ()
    got: float = 0.0
    want: float = 0.0
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    noise: bool = False

    def within(self, rtol: float, atol: float) -> bool:
        """Whether the leaf is within another tolerance."""
        return bool(self.max_abs <= atol + rtol * self.scale)

    @property
    def ok(self) -> bool:
        return self.noise or bool(self.max_abs <= self.limit)

    @property
    def ratio(self) -> float:
        """The difference over the tolerance (above 1: the leaf differs)."""
        return self.max_abs / self.limit if self.limit > 0 else float(self.max_abs > 0) * np.inf

    def where(self) -> str:
        """``path[index]: got (distributed) vs want (one device), step k``."""
        if self.shapes is not None:
            got, want = self.shapes
            return f"{self.path} at step {self.step}: shape {got} distributed, {want} on one device"
        at = f"[{', '.join(map(str, self.index))}]" if self.index else ""
        return (
            f"{self.path}{at} at step {self.step}: {self.got:.6g} distributed, "
            f"{self.want:.6g} on one device"
        )


def numeric(x: Any) -> bool:
    """Whether ``x`` is an array of numbers or booleans (not a string)."""
    if not is_array(x) or isinstance(x, str):
        return False
    dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
    return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


def values(x: Any) -> np.ndarray:
    """A leaf as float64 NumPy: a typed PRNG key by its key data."""
    if is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float64)


def _diff(path: str, step: int, got: Any, want: Any, rtol: float, atol: float) -> LeafDiff:
    a, b = values(got), values(want)
    if a.shape != b.shape:
        return LeafDiff(path, step, np.inf, np.inf, atol, 0.0, shapes=(a.shape, b.shape))
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    if a.size == 0:
        return LeafDiff(path, step, 0.0, 0.0, atol, 0.0)
    nan = np.isnan(a) != np.isnan(b)
    err = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    err = np.where(nan, np.inf, err)
    flat = int(np.argmax(err))
    index = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.ndim else ()
    max_abs = float(err.flat[flat])
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    exact = is_key(want) or jnp.issubdtype(np.asarray(want).dtype, jnp.integer)
    limit = 0.0 if exact else atol + rtol * scale
    return LeafDiff(
        path, step, max_abs, max_rel, limit, scale, index, float(a.flat[flat]), float(b.flat[flat])
    )


def compare(got: Any, want: Any, step: int, rtol: float, atol: float) -> list[LeafDiff]:
    """The differences of the numeric leaves of two trees of one structure; typed PRNG
    keys are compared by their key data, and integer leaves (and keys) exactly. Paths
    are joined by "/"."""
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(got):
        y = want_leaves.get(path)
        if y is None or not (is_key(x) or numeric(x)):
            continue
        out.append(_diff(path_str(path), step, x, y, rtol, atol))
    return out


def close(got: Any, want: Any, rtol: float, atol: float) -> bool:
    """Whether every leaf of ``got`` is within the tolerance of ``want``'s."""
    return all(d.ok for d in compare(got, want, 1, rtol, atol))


def either(first: list[LeafDiff], second: list[LeafDiff], which: Callable[[str], bool]):
    """Leaf by leaf (both lists in one order), the closer of two references for the
    leaves ``which`` selects, the first's for the others."""
    return [
        min(a, b, key=lambda d: d.ratio) if which(a.path) else a
        for a, b in zip(first, second, strict=True)
    ]
