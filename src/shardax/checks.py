"""Argument checks shared by every layer: one rule, one function, one wording.

Every public door that takes a count, a type or a coordinator address checks it here, so
the same bad value gets the same answer everywhere, naming the argument, the rule and the
value received. This module imports nothing from shardax (every layer may use it).

>>> as_count("batch_size", np.int64(4))
4
>>> as_count("batch_size", True)
Traceback (most recent call last):
ValueError: batch_size must be an integer >= 1, got True (a bool)
>>> parse_address("coordinator_address", "10.0.0.1:1234")
('10.0.0.1', 1234)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from jax.sharding import Mesh


def received(value: Any) -> str:
    if isinstance(value, bool | np.bool_):
        return f"{value!r} (a bool)"
    if isinstance(value, numbers.Integral | float | str) or value is None:
        return repr(value)
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} (a {type(value).__module__}.{type(value).__qualname__})"


def as_count(
    name: str,
    value: Any,
    *,
    minimum: int | None = 1,
    also: tuple[int, ...] = (),
    maximum: int | None = None,
) -> int:
    """``value`` as a Python ``int``: Python and NumPy integers pass; booleans, floats,
    strings and anything else raise ``ValueError`` naming ``name`` and the rule.

    ``minimum`` is the smallest allowed value (None: no bound); ``also`` lists other
    allowed values below it (e.g. ``(-1,)`` for "the rest"); ``maximum`` the largest.

    >>> as_count("size", -1, also=(-1,)), as_count("step", np.uint8(0), minimum=0)
    (-1, 0)
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    ok = ok and not (hasattr(value, "dtype") and value.dtype == bool)
    if ok:
        value = int(value)
        if (minimum is None or value >= minimum or value in also) and (
            maximum is None or value <= maximum
        ):
            return value
    if maximum is not None and minimum is not None:
        rule = f"an integer in {minimum}..{maximum}"
    elif maximum is not None:
        rule = f"an integer <= {maximum}"
    else:
        rule = "an integer" if minimum is None else f"an integer >= {minimum}"
    if also:
        rule += " or " + " or ".join(map(str, also))
    raise ValueError(f"{name} must be {rule}, got {received(value)}")


def as_float(
    name: str,
    value: Any,
    *,
    above: float | None = None,
    minimum: float | None = None,
    finite: bool = True,
) -> float:
    """``value`` as a Python ``float``: Python and NumPy integers and floats pass;
    booleans, strings, NaN (and infinities unless ``finite=False``) raise ``ValueError``
    naming ``name`` and the rule. ``above`` is an exclusive lower bound, ``minimum`` an
    inclusive one.

    >>> as_float("timeout", np.float32(2)), as_float("scale", 2**15, above=0)
    (2.0, 32768.0)
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if ok:
        number = float(value)
        ok = not math.isnan(number) and (math.isfinite(number) or not finite)
        ok = ok and (above is None or number > above) and (minimum is None or number >= minimum)
        if ok:
            return number
    rule = "a finite number" if finite else "a number"
    if above is not None:
        rule += f" > {above:g}"
    if minimum is not None:
        rule += f" >= {minimum:g}"
    raise ValueError(f"{name} must be {rule}, got {received(value)}")


def as_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (a NumPy bool too), else ``TypeError``
    naming ``name``: a truthy string such as ``"no"`` is never taken for True."""
    return bool(expect_type(name, value, bool | np.bool_, "True or False"))


def as_function(name: str, value: Any, expected: str = "a function") -> Any:
    """``value`` if it is callable, else ``TypeError`` naming ``name`` and what came."""
    if callable(value):
        return value
    raise TypeError(f"{name} must be {expected}, got {received(value)}")


def expect_type(name: str, value: Any, types: Any, expected: str, hint: str = "") -> Any:
    """``value`` if it is an instance of ``types``, else ``TypeError`` naming ``name``,
    ``expected`` and what came (with ``hint`` appended, e.g. the likely fix)."""
    if isinstance(value, types):
        return value
    raise TypeError(
        f"{name} must be {expected}, got {received(value)}" + (f". {hint}" if hint else "")
    )


def check_mesh(name: str, mesh: Any) -> Any:
    """``mesh`` if it is a ``jax.sharding.Mesh``, else ``TypeError`` naming ``name``."""
    return expect_type(name, mesh, Mesh, "a jax.sharding.Mesh", "Build one with sx.make_mesh()")


def parse_address(name: str, address: Any) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) as ``(host, port)``, checked: a
    non-empty host and a port in 1..65535. Raises ``ValueError`` naming ``name``.

    >>> parse_address("address", "[::1]:8476")
    ('::1', 8476)
    """
    rule = f"{name} must be 'host:port' with a port in 1..65535, e.g. '10.0.0.1:8476'"
    if not isinstance(address, str):
        raise ValueError(f"{rule}; got {received(address)}")
    host, sep, port_text = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{rule} (IPv6 hosts in brackets: '[::1]:8476'); got {address!r}")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{rule}; got {address!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{rule}; got {address!r}, whose port {port} is out of range")
    return host, port
