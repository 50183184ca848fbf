"""The compiled-program cache of a step: one program per state structure.

A ``CompiledCache`` builds a program for each state structure it is called with
(``build(state)``) and keeps the ``COMPILED_CACHE_SIZE`` most recently used. The hot
path flattens nothing: the state a call gets is most likely the one a cached program
returned last (or, for an eval step, the one it was given), which each entry remembers
weakly.

>>> cache = CompiledCache(lambda state: jax.jit(lambda s, b: (s + b, b)), returns_state=True)
>>> state, _ = cache(jnp.zeros(2), 1.0)
>>> state, _ = cache(state, 2.0)  # the state the program returned: found without flattening
>>> len(cache), state.tolist()
(1, [3.0, 3.0])
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any

import jax

COMPILED_CACHE_SIZE = 8
"""Compiled programs kept per step (one per state structure), most recent first."""

SHARDING_MISMATCH = "Sharding passed to jit does not match"
"""What jit's error says when an argument is placed otherwise than the program takes it."""


class _Compiled:
    """One compiled program, its state structure, and the last state it returned (weakly)."""

    __slots__ = ("fn", "last", "treedef")

    def __init__(self, fn: Callable[..., Any], treedef: Any) -> None:
        self.fn, self.treedef = fn, treedef
        self.last: weakref.ref[Any] | None = None


class CompiledCache:
    """``cache(state, batch)``: the program built for ``state``'s structure, called.

    ``build(state)`` compiles (jits) the program for a state; ``returns_state``: whether
    the program returns ``(state, metrics)`` (a train step) or only the metrics; and
    ``mismatch(state)``, if given, the error to raise when jit refuses an argument's
    sharding (the caller knows whether the state or the batch is misplaced).
    """

    def __init__(
        self,
        build: Callable[[Any], Callable[..., Any]],
        *,
        returns_state: bool,
        mismatch: Callable[[Any], Exception] | None = None,
    ) -> None:
        self._build, self._returns_state, self._mismatch = build, returns_state, mismatch
        self._entries: collections.OrderedDict[Any, _Compiled] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, state: Any) -> _Compiled:
        """The compiled program for ``state``'s structure, from a bounded most-recently-used
        cache. Hot path: ``state`` is what one of the cached programs returned last, so its
        structure is known without flattening it."""
        for entry in self._entries.values():
            if entry.last is not None and entry.last() is state:
                break
        else:
            treedef = jax.tree.structure(state)
            entry = self._entries.get(treedef)  # type: ignore[assignment]
            if entry is None:
                entry = self._entries[treedef] = _Compiled(self._build(state), treedef)
                if len(self._entries) > COMPILED_CACHE_SIZE:
                    self._entries.popitem(last=False)
        self._entries.move_to_end(entry.treedef)
        return entry

    def __call__(self, state: Any, batch: Any) -> Any:
        entry = self.lookup(state)
        try:
            out = entry.fn(state, batch)
        except ValueError as e:
            if self._mismatch is None or SHARDING_MISMATCH not in str(e):
                raise
            raise self._mismatch(state) from e
        # The state the next call most likely gets: the new one, or (an eval step, which
        # returns only the metrics) the same one.
        entry.last = weakref.ref(out[0] if self._returns_state else state)
        return out
