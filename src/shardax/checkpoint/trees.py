"""The checks of what a save stores and a restore reads, before anything is written or
read: the JSON parts, the arrays not donated away, and the saved tree against ``like``
(the params named before the optimizer state that mirrors them).

>>> check_json("data_state", {"epoch": np.int64(1)})
Traceback (most recent call last):
...
TypeError: data_state['epoch'] is a numpy.int64, which JSON cannot store ...
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardax.checkpoint.convert import array_leaves
from shardax.plan.tree import path_str


def check_not_donated(state: Any) -> None:
    """Raises ``ValueError`` naming the first leaf of ``state`` whose buffer was deleted
    (donated to a jitted step), before anything is written."""
    deleted = sorted(
        (
            path_str(path)
            for path, leaf in array_leaves(state)
            if isinstance(leaf, jax.Array) and leaf.is_deleted()
        ),
        key=_params_first,
    )
    if deleted:
        more = f" (and {len(deleted) - 1} more)" if len(deleted) > 1 else ""
        raise ValueError(
            f"state leaf {deleted[0]!r}{more} has been deleted: its buffer was "
            "donated to a step (donate=True, donate_argnums) that consumed it. Save the "
            "state the step returned, not the one passed into it. Nothing was written"
        )


def check_json(name: str, value: Any, path: str = "") -> None:
    """Raises ``TypeError`` naming the first entry of ``value`` that JSON cannot store
    as it is (a NumPy array or scalar, an object, a non-string key), before anything is
    written."""
    where = f"{name}{path}"
    if value is None or isinstance(value, str | int | float):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}); JSON keys must be "
                    f"strings (it would come back as {str(key)!r})"
                )
            check_json(name, item, f"{path}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json(name, item, f"{path}[{i}]")
        return
    hint = (
        "; convert it with .tolist() or int()/float()"
        if isinstance(value, np.ndarray | np.generic)
        else ""
    )
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which JSON "
        f"cannot store (it takes dicts, lists, strings, numbers, bools and None){hint}. "
        "Nothing was written"
    )


def _params_first(path: str) -> tuple[bool, str]:
    """Sort key: the model's leaves before the optimizer's mirrors of them."""
    return ("opt_state" in path.split("/"), path)


def check_same_tree(saved: dict[str, Any], target: dict[str, Any], step: int) -> None:
    """Raises ``ValueError`` naming the first path whose presence, shape or dtype differ
    (the params before the optimizer state that mirrors them) and how many others do."""
    missing = sorted(set(target) - set(saved), key=_params_first)
    extra = sorted(set(saved) - set(target), key=_params_first)
    if missing or extra:
        raise ValueError(
            f"checkpoint step {step} does not match the tree of `like`: "
            + (f"not in the checkpoint: {missing}; " if missing else "")
            + (f"in the checkpoint but not in `like`: {extra}" if extra else "")
        )
    differ = []
    for path in sorted(target, key=_params_first):
        want, got = target[path], saved[path]
        if tuple(got.shape) != tuple(np.shape(want)):
            differ.append(
                f"leaf {path!r} has shape {tuple(got.shape)} in the checkpoint but "
                f"{tuple(np.shape(want))} in `like`"
            )
        elif np.dtype(got.dtype) != np.dtype(want.dtype):
            differ.append(
                f"leaf {path!r} has dtype {np.dtype(got.dtype)} in the checkpoint but "
                f"{np.dtype(want.dtype)} in `like`"
            )
    if differ:
        more = f" ({len(differ) - 1} more leaves differ)" if len(differ) > 1 else ""
        raise ValueError(f"checkpoint step {step}: {differ[0]}{more}")
