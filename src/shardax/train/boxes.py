"""Linen's partitioning boxes while the step traces the model: unboxed, not constrained.

A Linen model that shards itself (``nn.with_partitioning``, ``nn.with_logical_partitioning``)
keeps each variable in a box; flax's ``Partitioned.unbox()`` applies the box's names as a
``with_sharding_constraint`` whenever a global mesh is set. The step traces the loss under
its mesh (so that ``sx.constrain`` and ``nn.with_logical_constraint`` on activations know
it), and there the boxes' constraints are wrong three ways:

- under ``"shard_map"`` and ``"pmap"`` the values are per device (Manual axes), where JAX
  refuses any constraint;
- ``nn.DenseGeneral`` re-runs its initializer at every apply for its shape check and
  unboxes the flat 2-D kernel it draws under the 3-D names (flax issue #3676), which no
  mesh accepts;
- the state is already placed by the step's plan: a box's constraint would only move a
  param the plan placed elsewhere.

So while the step calls a Linen module, ``unconstrained_boxes()`` has every box unbox
without its constraint (flax's own ``apply_constraint=False``); activations keep theirs.
The boxes' names become the plan with ``plan=sx.from_linen(mesh, variables)``.

>>> import flax.linen as nn
>>> box = nn.with_partitioning(nn.initializers.ones, ("data", None, None))(None, (4, 6))
>>> with jax.set_mesh(sx.make_mesh({"data": 8})), unconstrained_boxes():
...     jax.jit(lambda b: b.unbox() * 2)(box).shape
(4, 6)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

from flax.core import meta
from flax.linen import spmd

_UNCONSTRAINED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardax_unconstrained_boxes", default=False
)

BOXES: tuple[type, ...] = (meta.Partitioned, spmd.LogicallyPartitioned)
"""flax's boxes whose ``unbox(apply_constraint=True)`` constrains under a global mesh."""


def _gated(unbox: Any) -> Any:
    """``unbox``, its constraint skipped inside ``unconstrained_boxes()``."""

    @functools.wraps(unbox)
    def gated(self: Any, apply_constraint: bool = True) -> Any:
        return unbox(self, apply_constraint=apply_constraint and not _UNCONSTRAINED.get())

    gated.__shardax_gated__ = True  # type: ignore[attr-defined]
    return gated


def _install() -> None:
    """Gates each box class's own ``unbox`` once (outside the context nothing changes:
    the gate passes ``apply_constraint`` through)."""
    for cls in BOXES:
        own = cls.__dict__.get("unbox")
        if own is not None and not getattr(own, "__shardax_gated__", False):
            cls.unbox = _gated(own)  # type: ignore[method-assign]


@contextlib.contextmanager
def unconstrained_boxes() -> Iterator[None]:
    """Within the block (this thread or task only), flax's partitioning boxes unbox to
    their value without applying their names as a sharding constraint."""
    _install()
    token = _UNCONSTRAINED.set(True)
    try:
        yield
    finally:
        _UNCONSTRAINED.reset(token)
