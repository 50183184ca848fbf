"""Which layers the ``matmul="fp8"`` precision policy runs as fp8 GEMMs, and routing them.

Under ``sx.Precision(matmul="fp8")`` (the named policy ``"fp8"``: bf16 compute, fp8
matmuls) the step hands ``loss_fn`` the model with its dense layers' ``dot_general``
hooks set to ``shardax.parallel.fp8.fp8_dot_general``:

- NNX: every module whose ``dot_general`` attribute is ``jax.lax.dot_general``
  (``nnx.Linear``, ``nnx.LinearGeneral``, the GPT's attention and MLP projections);
- Linen: every ``nn.Dense`` and ``nn.DenseGeneral`` without a ``dot_general`` or
  ``dot_general_cls`` of the user's, through ``nn.intercept_methods``;
- Equinox: every ``eqx.nn.Linear``, as an ``Fp8Linear`` over the same arrays.

A layer the user gave a ``dot_general`` of their own keeps it. A layer whose path (its
attribute names joined by "/", as ``sx.describe`` prints them) matches a regex of
``Precision.keep`` (``re.search``) stays in the compute dtype: the LM head and the first
layer, as mixed-precision recipes keep them (the GPT's head is a plain matmul and its
first layer an embedding lookup: neither is routed). A layer kind that computes a
contraction fp8 does not cover (a convolution, an ``Einsum``) is refused by name with its
path, unless ``keep`` names it: nothing meant to run in fp8 runs in bf16 unnoticed.

>>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
>>> routed = route(model, keep=("layers/1",))
>>> [layer.dot_general.__name__ for layer in routed.layers]
['fp8_dot_general', 'dot_general']
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import jax
from flax import linen, nnx

from shardax._extras import equinox, is_equinox
from shardax.parallel.fp8 import fp8_dot_general

NNX_REFUSED = ("Conv", "ConvTranspose", "Einsum")
"""``nnx`` layer kinds with weights and a contraction that fp8 matmuls do not cover."""
LINEN_REFUSED = ("Conv", "ConvTranspose", "ConvLocal", "Einsum")
"""``flax.linen`` layer kinds refused as ``NNX_REFUSED`` (``nn.<kind>``)."""
EQX_REFUSED = ("Conv", "ConvTranspose")
"""``eqx.nn`` layer kinds refused (their subclasses ``Conv1d`` ... too)."""


def _path(parts: Any) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in parts)


def _kept(path: str, keep: tuple[str, ...]) -> bool:
    return any(re.search(pattern, path) for pattern in keep)


def _refuse(kind: str, path: str) -> None:
    raise ValueError(
        f"precision matmul='fp8' does not cover {kind} layers, found at {path or '(root)'!r}; "
        f"add a regex matching its path to Precision(keep=...) to run it in the compute "
        "dtype, or use a precision without matmul='fp8'"
    )


def _kind_of(node: Any, module: Any, names: tuple[str, ...]) -> str | None:
    """``prefix.Kind`` when ``node`` is an instance of one of ``module``'s ``names``."""
    for name in names:
        cls = getattr(module, name, None)
        if cls is not None and isinstance(node, cls):
            return name
    return None


def route(model: Any, keep: tuple[str, ...] = ()) -> Any:
    """``model`` (an NNX or Equinox module, as the step binds it) with its dense layers'
    matmuls in fp8 (module docstring); other models as they are. An NNX model is changed
    in place (the step binds a fresh copy in every trace); an Equinox model is rebuilt."""
    if isinstance(model, nnx.Module):
        return _route_nnx(model, keep)
    if is_equinox(model):
        return _route_equinox(model, keep)
    return model


def _route_nnx(model: nnx.Module, keep: tuple[str, ...]) -> nnx.Module:
    for parts, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        path = _path(parts)
        kind = _kind_of(node, nnx, NNX_REFUSED)
        if kind is not None and not _kept(path, keep):
            _refuse(f"nnx.{kind}", path)
        if getattr(node, "dot_general", None) is jax.lax.dot_general and not _kept(path, keep):
            node.dot_general = fp8_dot_general
    return model


def _route_equinox(model: Any, keep: tuple[str, ...]) -> Any:
    # fp8_equinox subclasses eqx.Module, so importing it imports equinox (an optional
    # extra that import shardax must not load): imported once a model is an Equinox one
    from shardax.train.fp8_equinox import Fp8Linear

    eqx = equinox()

    kinds = tuple(getattr(eqx.nn, name) for name in EQX_REFUSED)

    def one(parts: Any, node: Any) -> Any:
        path = _path(parts)
        if isinstance(node, kinds) and not _kept(path, keep):
            _refuse(f"eqx.nn.{type(node).__name__}", path)
        if type(node) is eqx.nn.Linear and not _kept(path, keep):
            return Fp8Linear(node)
        return node

    def is_layer(node: Any) -> bool:
        return isinstance(node, (eqx.nn.Linear, *kinds))

    return jax.tree_util.tree_map_with_path(one, model, is_leaf=is_layer)


@contextlib.contextmanager
def linen_fp8(keep: tuple[str, ...] = ()) -> Iterator[None]:
    """Within it, every Linen ``nn.Dense`` and ``nn.DenseGeneral`` call (with no hook of
    the user's) runs its matmul in fp8, and a refused kind (``LINEN_REFUSED``) raises
    naming its path; ``keep`` as in the module docstring.

    >>> layer = linen.Dense(3)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> with linen_fp8():
    ...     y = layer.apply(variables, jnp.ones((2, 4)))
    >>> y.shape
    (2, 3)
    """
    dense = (linen.Dense, linen.DenseGeneral)
    refused = tuple(getattr(linen, name) for name in LINEN_REFUSED if hasattr(linen, name))

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, (*dense, *refused)):
            return next_fun(*args, **kwargs)
        path = "/".join(module.path) if module.scope is not None else ""
        if _kept(path, keep):
            return next_fun(*args, **kwargs)
        if isinstance(module, refused):
            _refuse(f"nn.{type(module).__name__}", path)
        if module.dot_general is not None or module.dot_general_cls is not None:
            return next_fun(*args, **kwargs)  # the user's own hook
        object.__setattr__(module, "dot_general", fp8_dot_general)
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "dot_general", None)

    with linen.intercept_methods(interceptor):
        yield


def matmul_routing(matmul: str, keep: tuple[str, ...] = ()) -> contextlib.AbstractContextManager:
    """``linen_fp8(keep)`` under ``matmul="fp8"`` (Linen layers are routed as they are
    called), else a context that does nothing."""
    return linen_fp8(keep) if matmul == "fp8" else contextlib.nullcontext()
