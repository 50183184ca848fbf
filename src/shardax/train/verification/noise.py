"""The update's noise floor, for a step whose optimizer verify cannot see.

Where an updated leaf differs and no optimizer hands verify the gradients (an optax
transformation closed over, as Equinox's examples and plain ``jax.jit`` steps write it),
the one-device step runs again on row-permuted copies of the batch (reversed, rolled):
the same examples in another order of the sums. A leaf within ``NOISE_MARGIN`` times its
own largest spread over those runs is reduction noise the optimizer amplified (Adam, Lion),
not a distribution difference. A leaf with a real gradient (a weight) barely moves between
reorderings, so a doubled update, unreduced gradients or per-device statistics still
exceed its floor. The floor is used only when the reorderings leave what the step returns
unchanged (they are a symmetry of the step) and the batch's leaves share one leading size.

A leaf still differing may be one that the step reads but does not depend on (``unread``):
its exact gradient is zero, so its update is the optimizer's reading of rounding noise
alone. Shifted in the start state, it changes neither what the step returns nor any other
leaf.

>>> from shardax.train.verification.comparison import compare
>>> diffs = compare({"state": {"b": np.ones(1)}}, {"state": {"b": np.full(1, 1.01)}}, 1, 1e-4, 0)
>>> diffs[0].ok, floored(diffs, {"state/b": 0.006})[0].ok
(False, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardax.plan.tree import path_str
from shardax.train.verification.comparison import LeafDiff, close, compare
from shardax.train.verification.rows import rows, rows_are_examples

PERMUTATIONS: tuple[Callable[[np.ndarray], np.ndarray], ...] = (
    lambda x: x[::-1],
    lambda x: np.roll(x, x.shape[0] // 2, axis=0),
    lambda x: np.roll(x, 1, axis=0),
)
"""The reorderings of the batch's rows the floor is measured over."""

NOISE_MARGIN = 2.0
"""A leaf within this many times the reference's own spread is reduction noise."""


def noise_floor(
    reference: Callable[[Any], dict[str, Any]],
    batch: Any,
    want: dict[str, Any],
    rtol: float,
    atol: float,
) -> dict[str, float] | None:
    """Per leaf of the update (``state/...``), the largest difference between ``want`` (the
    reference on ``batch``) and ``reference`` (what the one-device step returned and its
    state, ``{"returned", "state"}``) on row-permuted copies of the batch. None when the
    rows are not examples, the step does not run on them, or a permutation changed what
    the step returned (the reordering is not a symmetry of the step: no floor)."""
    if not rows_are_examples(batch):
        return None
    try:
        alts = [reference(rows(batch, p)) for p in PERMUTATIONS]
    except Exception:  # the step may not run on a reordered batch
        return None
    floor: dict[str, float] = {}
    for alt in alts:
        if not close(alt["returned"], want["returned"], rtol, atol):
            return None
        for d in compare(alt["state"], want["state"], 1, rtol, atol):
            path = f"state/{d.path}"
            floor[path] = max(floor.get(path, 0.0), d.max_abs)
    return floor


SHIFT = 0.1
"""``unread`` shifts a leaf by this much of its largest magnitude (at least 1) times a
standard normal draw per element."""


def _shifted(start: Any, paths: set[str]) -> Any:
    """``start`` with each floating leaf at ``state/<path>`` in ``paths`` shifted."""
    draw = np.random.default_rng(0)

    def one(path: Any, x: Any) -> Any:
        if f"state/{path_str(path)}" not in paths:
            return x
        values = np.asarray(x)
        scale = SHIFT * max(1.0, float(np.max(np.abs(values))) if values.size else 1.0)
        return x + (scale * draw.standard_normal(values.shape)).astype(values.dtype)

    return jax.tree_util.tree_map_with_path(one, start)


def unread(
    reference: Callable[[Any], dict[str, Any]],
    start: Any,
    want: dict[str, Any],
    paths: list[str],
    rtol: float,
    atol: float,
) -> set[str]:
    """The update leaves of ``paths`` (``state/...``) whose update is rounding noise: with
    them shifted in ``start``, the one-device step (``reference(start)``, its
    ``{"returned", "state"}``) returns what it returned and updates every other leaf as
    it did (``want``). What the step computes then does not depend on those leaves (the
    caller checks that it reads them, ``reads.reached``): their exact gradient is zero
    (an attention key's bias, which softmax ignores; a bias before a normalisation), and
    an adaptive optimizer (Adam, Lion) makes steps of ±lr out of the order of the sums,
    different on every mesh. All of ``paths`` or none (a set).

    Only floating leaves of a pytree state are shifted; any other leaf among ``paths``
    (an integer count, a key) gives no such evidence (an empty set)."""
    wanted = set(paths)
    leaves = {f"state/{path_str(p)}": x for p, x in jax.tree_util.tree_leaves_with_path(start)}
    if not wanted or any(
        p not in leaves or not np.issubdtype(np.asarray(leaves[p]).dtype, np.floating)
        for p in wanted
    ):
        return set()
    try:
        alt = reference(_shifted(start, wanted))
    except Exception:  # a step that does not run on the shifted state reads it somewhere
        return set()
    if not close(alt["returned"], want["returned"], rtol, atol):
        return set()
    for d in compare(alt["state"], want["state"], 1, rtol, atol):
        if f"state/{d.path}" not in wanted and not d.ok:
            return set()
    return wanted


def floored(diffs: list[LeafDiff], floor: dict[str, float] | None) -> list[LeafDiff]:
    """``diffs``, each update leaf's tolerance raised to ``NOISE_MARGIN`` times its noise
    floor (its own tolerance kept when larger); integer leaves stay exact."""
    if not floor:
        return diffs
    return [
        dataclasses.replace(d, limit=max(d.limit, NOISE_MARGIN * floor[d.path]))
        if d.path in floor and d.limit > 0
        else d
        for d in diffs
    ]
