"""The seed's classes are thin facades: each method is a plain function, written once.

:func:`facade` adds every function to a class twice: as an instance method with the
seed's signature (``self`` first) that calls the function, and as the ``*_static`` twin,
which *is* the function.

>>> def double(x: int) -> int:
...     return 2 * x
>>> @facade(double)
... class Tool:
...     pass
>>> Tool().double(2), Tool.double_static is double
(4, True)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def as_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An instance method ``(self, ...)`` that calls ``fn(...)``; ``__wrapped__`` is ``fn``."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = sig.replace(parameters=[this, *sig.parameters.values()])  # type: ignore[attr-defined]
    return method


def facade(*fns: Callable[..., Any]) -> Callable[[T], T]:
    """A class decorator adding each of ``fns`` as a method and as its ``*_static`` twin."""

    def decorate(cls: T) -> T:
        for fn in fns:
            setattr(cls, fn.__name__, as_method(fn))
            setattr(cls, f"{fn.__name__}_static", staticmethod(fn))
        return cls

    return decorate
