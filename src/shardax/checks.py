"""Argument checks shared by every layer: one rule, one function, one wording.

Every public door that takes a count, a type or a coordinator address checks it here, so
the same bad value gets the same answer everywhere, naming the argument, the rule and the
value received; `public` marks the doors, so that their errors start with the name
the user called (``sx.fsdp: ...``), a name of the public surface (``shardax._names``). This
module imports nothing else from shardax (every layer may use it).

>>> as_count("batch_size", np.int64(4))
4
>>> as_count("batch_size", True)
Traceback (most recent call last):
ValueError: batch_size must be an integer >= 1, got True (a bool)
>>> parse_address("coordinator_address", "10.0.0.1:1234")
('10.0.0.1', 1234)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from types import CodeType, FrameType
from typing import Any, TypeVar

import numpy as np
from jax.sharding import Mesh

from shardax import _names


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


def as_path(name: str, value: Any, hint: str = "use '.' for the working directory") -> str:
    """``value`` as a path string if it is a non-empty ``str`` or ``os.PathLike``, else
    ``TypeError`` (not a path) or ``ValueError`` (empty: it would mean the working
    directory, or read as no path at all) naming ``name``.

    >>> as_path("directory", "runs/a")
    'runs/a'
    """
    expect_type(name, value, str | os.PathLike, "a path (str or os.PathLike)")
    text = os.fspath(value)
    if not str(text).strip():
        raise ValueError(f"{name} must be a non-empty path, got {text!r} ({hint})")
    return str(text)


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


# -- doors: the public names, whose errors start with the name the user called -----------

T = TypeVar("T")

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The reference models are templates written against the public API: they call doors as a
# user does. (The CLI does not: it names its own options in its one-line errors.)
_CLIENTS = _PACKAGE + "models" + os.sep
# The methods that answer with the class's own name; other public methods add their own.
_DUNDERS = frozenset(
    ("__init__", "__post_init__", "__call__", "__iter__", "__next__", "__enter__", "__exit__")
)


def public(name: str) -> Callable[[T], T]:
    """Marks a public door: an error that shardax raises in a call of it starts with
    ``name`` (``"sx.fsdp"`` gives ``sx.fsdp: mesh must be ...``), the same object re-raised.

    Only shardax's own errors with a plain message are named: what the user's code or JAX
    raises passes untouched, and so does a message another door named already (the
    innermost wins: ``sx.attention`` inside a train step's loss). A call from shardax
    itself is not a door's (the door the user called names the error); one from the
    reference models is, as they are written like the user's code. On a class, each public
    method (a context-manager one too) is a door named ``name.method``; ``__init__``,
    ``__post_init__``, ``__call__``, ``__iter__``, ``__next__``, ``__enter__`` and
    ``__exit__`` are named ``name``. Classes and functions stay the same objects otherwise,
    and nothing more runs unless an error passes.

    ``name`` is how a user reaches the object, by the public names of ``shardax._names``; a
    function that becomes a public class's method (the artifex facades) is
    ``sx.<Class>.<method>``. Shardax's own object named otherwise (a helper no namespace
    exports, or a top-level name spelled with its layer) is left as it is, not a door, and
    noted in ``REFUSED``: no error starts with a name users cannot call.

    >>> @public("sx.double")
    ... def double(n):
    ...     return 2 * as_count("n", n)
    >>> double("2")
    Traceback (most recent call last):
    ValueError: sx.double: n must be an integer >= 1, got '2'
    >>> public("sx.call")(lambda f: f())(lambda: 1 / 0)  # the caller's own error
    Traceback (most recent call last):
    ZeroDivisionError: division by zero
    >>> public_name(double)
    'sx.double'
    """

    def decorate(obj: Any) -> Any:
        if not _named_as_users_call(obj, name):
            return obj  # not a door: its errors name the door the user called
        if isinstance(obj, type):
            _public_class(obj, name)
            obj.__sx_public__ = name
            return obj
        return _door(obj, name)

    return decorate


def public_name(obj: Any) -> str | None:
    """The name `public` gave ``obj`` (a function, or a wrapper of one), else None."""
    if isinstance(obj, type):
        return obj.__dict__.get("__sx_public__")
    while obj is not None:
        if getattr(obj, "__code__", None) in _DOOR_CODES:
            return obj.__sx_public__
        obj = getattr(obj, "__wrapped__", None)
    return None


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the function calling this one
    name the first line outside shardax (the user's, through doors and properties), so the
    default filters show a ``DeprecationWarning`` where ``__main__`` caused it."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def moved(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the names that left ``module``: each still works for a
    minor version, warning ``DeprecationWarning`` naming its home, and is the object found
    there; a retired one (``shardax._names.RETIRED``) is an ``AttributeError`` naming it.

    The homes are ``module``'s row of ``shardax._names.MOVED``: a public one
    (``"shardax.plan.init_sharded"``: ``sx.init_sharded is now sx.plan.init_sharded``) or a
    module's (``"shardax.plan.tree.path_str"``: the name is internal now). A namespace writes
    ``__getattr__ = moved(__name__)`` in its ``__init__``.

    >>> moved("shardax.plan")("path_str")
    Traceback (most recent call last):
    AttributeError: sx.plan.path_str was retired in shardax 0.2.0: it is internal now ...
    """
    homes = _names.MOVED.get(module, {})
    retired = _names.RETIRED.get(module, {})
    spelled = _names.spelled(module)

    def __getattr__(name: str) -> Any:
        home = homes.get(name) or retired.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        parent, _, attr = home.rpartition(".")
        if parent.count(".") <= 1:  # shardax or one of its layer namespaces
            now = f"is now {_names.spelled(home)}"
        else:
            now = f"is internal now ({home})"
        if name not in homes:
            raise AttributeError(
                f"{spelled}.{name} was retired in shardax {_names.RETIRED_IN}: it {now} "
                "(CHANGELOG.md lists the retired names)"
            )
        warnings.warn(
            f"{spelled}.{name} {now}; the old name goes in the next minor version",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(parent), attr)

    __getattr__.homes = dict(homes)  # type: ignore[attr-defined]
    return __getattr__


# The doors of shardax's own code that `public` refused to name (tests/test_names.py pins
# this empty): "@public('sx.plan.is_array') on shardax.plan.tree.is_array: ...".
REFUSED: list[str] = []


def _named_as_users_call(obj: Any, name: str) -> bool:
    """Whether ``name`` is how users reach ``obj``; if it is not (and ``obj`` is shardax's
    own), the refusal is noted in ``REFUSED``."""
    if not _ours(obj):
        return True  # a door of a test or an example: any name
    expected = _names.door_name(obj.__module__, obj.__name__)
    if name == expected or (expected is None and name.rpartition(".")[0] in _names.names()):
        return True
    REFUSED.append(
        f"@public({name!r}) on {obj.__module__}.{obj.__qualname__}: "
        + (f"users call it {expected}" if expected else "no namespace exports it")
    )
    return False


def _public_class(cls: type, name: str) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else ()
    for attr in dir(cls):
        if (attr.startswith("_") and attr not in _DUNDERS) or attr in fields:
            continue
        owner = next(c for c in cls.__mro__ if attr in c.__dict__)
        label = name if attr in _DUNDERS else f"{name}.{attr}"
        value = owner.__dict__[attr]
        if isinstance(value, staticmethod):
            if public_name(value.__func__) is None and _ours(value.__func__):
                setattr(cls, attr, staticmethod(_door(value.__func__, label)))
        elif isinstance(value, classmethod):
            if _ours(value.__func__):
                setattr(cls, attr, classmethod(_door(_unwrap(value.__func__), label)))
        elif isinstance(value, property):
            if _ours(value.fget):
                door = _door(_unwrap(value.fget), label)
                setattr(cls, attr, property(door, value.fset, value.fdel, value.__doc__))
        elif getattr(value, "__code__", None) is _CONTEXT_MANAGER and _ours(value.__wrapped__):
            door = _door(_unwrap(value.__wrapped__), label)  # a door on the generator
            setattr(cls, attr, contextlib.contextmanager(door))
        elif inspect.isfunction(value) and _ours(value):
            setattr(cls, attr, _door(_unwrap(value), label))


def _ours(fn: Any) -> bool:
    """Whether ``fn`` is shardax's own code (not generated by dataclasses, not a library's);
    a class is if its module is shardax's."""
    if isinstance(fn, type):
        return fn.__module__.startswith("shardax.")
    code = getattr(_unwrap(fn), "__code__", None)
    return code is not None and _in_shardax(code)


def _unwrap(fn: Any) -> Any:
    """``fn`` without the doors around it (a method a subclass names again)."""
    while getattr(fn, "__code__", None) in _DOOR_CODES:
        fn = fn.__wrapped__
    return fn


def _in_shardax(code: CodeType) -> bool:
    return code.co_filename.startswith(_PACKAGE)


def _from_library(caller: FrameType | None) -> bool:
    """Whether ``caller`` is shardax's own code (not a reference model or the user's code);
    generated code (a dataclass's ``__init__``) is passed over for the frame that called it."""
    while caller is not None and caller.f_code.co_filename == "<string>":
        caller = caller.f_back
    path = caller.f_code.co_filename if caller is not None else ""
    return path.startswith(_PACKAGE) and not path.startswith(_CLIENTS)


def _label(error: Exception, name: str, caller: FrameType | None) -> None:
    """Prefixes ``error``'s message with ``name`` if shardax's library raised it with a plain
    message in a call from outside the library, and no inner door named it already."""
    args = error.args
    if isinstance(error, Warning | StopIteration | StopAsyncIteration) or _from_library(caller):
        return  # a call from the library: the door the user called names it
    if len(args) != 1 or not isinstance(args[0], str) or args[0].startswith("sx."):
        return
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code in _DOOR_CODES or not _from_library(tb.tb_frame):
        return  # not the library's own error, or the call never got in (a wrong signature)
    try:
        plain = str(error) == args[0]
    except Exception:
        return
    if plain:
        error.args = (f"{name}: {args[0]}",)


def _door(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def door(*args: Any, **kwargs: Any) -> Any:
            thrown: list[BaseException] = []  # raised by the caller (a with block's body)
            try:
                return (yield from _noting_thrown(fn(*args, **kwargs), thrown))
            except Exception as e:
                if not any(e is t for t in thrown):
                    _label(e, name, sys._getframe(1))
                raise

    else:

        @functools.wraps(fn)
        def door(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                _label(e, name, sys._getframe(1))
                raise

    door.__sx_public__ = name  # type: ignore[attr-defined]
    return door


def _noting_thrown(gen: Any, thrown: list[BaseException]) -> Any:
    """``yield from gen``, noting each exception thrown in from outside (the body of a
    ``with`` block around a context manager): it is the caller's, not the door's."""
    try:
        value = next(gen)
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                gen.close()
                raise
            except BaseException as e:
                thrown.append(e)
                value = gen.throw(e)
            else:
                value = gen.send(sent)
    except StopIteration as stop:
        return stop.value


_DOOR_CODES = frozenset(_door(fn, "").__code__ for fn in (lambda: None, lambda: (yield)))
_CONTEXT_MANAGER = contextlib.contextmanager(lambda: (yield)).__code__


REFUSED_OPTION = ("No such compile option", "While setting option")
"""What XLA's error says when it refuses an option's name or value (at compile time)."""


def refused_compiler_option(
    error: BaseException, options: Mapping[str, Any] | None
) -> ValueError | None:
    """The ``ValueError`` to raise for ``error``, XLA refusing one of ``options`` (the
    options a program compiled with) when it compiled, naming the option and the value;
    None for any other error.

    >>> error = RuntimeError("INVALID_ARGUMENT: No such compile option: 'xla_x'")
    >>> str(refused_compiler_option(error, {"xla_x": True}))  # doctest: +ELLIPSIS
    "compiler_options['xla_x'] = True: XLA refused it when compiling: No such compile ..."
    """
    text = str(error)
    if not any(marker in text for marker in REFUSED_OPTION):
        return None
    detail = text.split("INVALID_ARGUMENT: ", 1)[-1].strip().rstrip(".") + "."
    options = dict(options or {})
    named = [k for k in options if f"'{k}'" in text or f" {k}," in text or f" {k} " in text]
    which = (
        f"compiler_options[{named[0]!r}] = {options[named[0]]!r}"
        if named
        else f"compiler_options={options!r}"
    )
    return ValueError(
        f"{which}: XLA refused it when compiling: {detail} Options are XLA's DebugOptions "
        "flags for the mesh's platform (xla_cpu_*, xla_gpu_*, or libtpu's xla_tpu_* on a "
        "TPU) with values of their type; fix or drop it, or pass compiler_options='auto'"
    )
