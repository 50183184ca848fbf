"""Equality by structure for the static part of a train state: the optax transformation.

A ``TrainState`` holds its optax transformation as pytree metadata, so the
transformation is part of the state's treedef, and ``jax.jit`` compiles once per
treedef. An optax transformation is a NamedTuple of closures, which compare by
identity: two ``optax.adam(1e-3)`` are unequal, and a state rebuilt with a new but equal
one would recompile every step function it meets. ``comparable`` gives the
transformation an equality (and hash) by what it computes: the code of its functions,
the values they close over and their defaults, recursively; arrays by value, anything
else by identity. It is computed once per transformation.

>>> a, b = comparable(optax.adam(1e-3)), comparable(optax.adam(1e-3))
>>> a == b, a == comparable(optax.adam(1e-2)), hash(a) == hash(b)
(True, False, True)
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Hashable
from typing import Any

import numpy as np
import optax

_ATOMS = (type(None), bool, int, complex, str, bytes, type, enum.Enum, np.dtype, np.generic)
_MAX_ARRAY_SIZE = 1 << 16
"""Arrays up to this many elements compare by value; larger ones by identity."""


class _Identity:
    """Equal only to a wrapper of the same object."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and self.obj is other.obj

    def __hash__(self) -> int:
        return id(self.obj)


def structure_key(obj: Any, _stack: dict[int, int] | None = None) -> Hashable:
    """A hashable key, equal for objects that compute the same thing.

    Functions are keyed by their code, their module's globals (by identity), their
    defaults and the contents of their closure; ``functools.partial`` and bound methods
    by their parts; tuples, lists and dicts by their items; NumPy and JAX arrays of up
    to 65536 elements by dtype, shape and bytes; other objects by identity.

    >>> structure_key(lambda x: x + 1.0) == structure_key(lambda x: x + 1.0)
    False
    >>> make = lambda lr: (lambda g: -lr * g)
    >>> structure_key(make(0.1)) == structure_key(make(0.1)) != structure_key(make(0.2))
    True
    """
    if isinstance(obj, float):
        return (float, obj.hex())
    if isinstance(obj, _ATOMS):
        return (type(obj), obj)
    stack = {} if _stack is None else _stack
    if id(obj) in stack:  # a cycle: key it by its depth on the stack
        return ("cycle", stack[id(obj)])
    stack[id(obj)] = len(stack)
    try:
        return _compound_key(obj, lambda x: structure_key(x, stack))
    finally:
        del stack[id(obj)]


def _compound_key(obj: Any, key: Any) -> Hashable:
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(key(x) for x in obj))
    if isinstance(obj, dict):
        return (type(obj), tuple((key(k), key(v)) for k, v in obj.items()))
    if isinstance(obj, functools.partial):
        return (functools.partial, key(obj.func), key(obj.args), key(obj.keywords))
    if isinstance(obj, types.MethodType):
        return (types.MethodType, key(obj.__func__), key(obj.__self__))
    if isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(key(cell.cell_contents))
            except ValueError:  # a cell not filled yet
                cells.append(("empty cell",))
        return (
            types.FunctionType,
            obj.__code__,
            _Identity(obj.__globals__),
            key(obj.__defaults__),
            key(obj.__kwdefaults__),
            tuple(cells),
        )
    is_array = hasattr(obj, "__array__") and hasattr(obj, "dtype") and hasattr(obj, "shape")
    if is_array and int(np.prod(obj.shape)) <= _MAX_ARRAY_SIZE:
        try:
            value = np.asarray(obj)
        except Exception:  # a tracer, or an array spread over other processes
            return _Identity(obj)
        return ("array", value.dtype.str, value.shape, value.tobytes())
    return _Identity(obj)


class _ByStructure:
    """Equality and hash by ``structure_key`` of the tuple's items, computed once."""

    def _structure(self) -> tuple[Hashable, int]:
        cached = self.__dict__.get("_structure_cache")
        if cached is None:
            key = structure_key(tuple(self))  # type: ignore[arg-type]
            cached = self.__dict__["_structure_cache"] = (key, hash(key))
        return cached

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, _ByStructure)
            and type(self) is type(other)
            and self._structure()[0] == other._structure()[0]
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return self._structure()[1]


class GradientTransformation(_ByStructure, optax.GradientTransformation):
    """``optax.GradientTransformation``, equal to any other that computes the same."""


class GradientTransformationExtraArgs(_ByStructure, optax.GradientTransformationExtraArgs):
    """``optax.GradientTransformationExtraArgs``, equal to any other that computes the same."""


_COMPARABLE = {
    optax.GradientTransformation: GradientTransformation,
    optax.GradientTransformationExtraArgs: GradientTransformationExtraArgs,
}


def comparable(tx: Any) -> Any:
    """``tx`` with equality by structure, if it is one of optax's two transformation types;
    any other object is returned as it is (it compares as its own type says)."""
    cls = _COMPARABLE.get(type(tx))
    return tx if cls is None else cls(*tx)
