"""Which outputs of a function each input reaches, read from its jaxpr.

verify forgives an update leaf as rounding noise only where the step reads the leaf (it
reaches the loss, or another leaf's update) and yet shifting it changes nothing: an exact
zero gradient. A leaf the step never reads but carries along (a running average, a sum
of losses) is no zero gradient: its difference is the step's own. ``reached`` follows
the data flow through nested jaxprs (``jax.jit`` inside, ``custom_jvp``/``custom_vjp``,
``remat``); any other primitive with a body (``scan``, ``while``, ``cond``) counts each of
its inputs as reaching each of its outputs.

>>> def step(params, ema):
...     return params - 0.1 * params.sum(), 0.9 * ema + 0.1 * params
>>> reached(step, (jnp.ones(3), jnp.ones(3)))  # params -> both; ema -> its own only
[[True, True], [False, True]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core

_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")
"""The params under which a call-like primitive keeps the body its inputs enter whole."""


def _body(eqn: Any) -> Any:
    """The open jaxpr a call-like equation runs on exactly its inputs, else None."""
    for name in _BODIES:
        body = eqn.params.get(name)
        body = getattr(body, "jaxpr", body)  # a ClosedJaxpr's open jaxpr
        if (
            isinstance(body, core.Jaxpr)
            and len(body.invars) == len(eqn.invars)
            and len(body.outvars) == len(eqn.outvars)
        ):
            return body
    return None


def _flow(jaxpr: Any, given: list[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether an input marked in ``given`` reaches it."""
    marked = {v for v, m in zip(jaxpr.invars, given, strict=True) if m}

    def hit(v: Any) -> bool:
        return not isinstance(v, core.Literal) and v in marked

    for eqn in jaxpr.eqns:
        ins = [hit(v) for v in eqn.invars]
        if not any(ins):
            continue
        body = _body(eqn)
        outs = _flow(body, ins) if body is not None else [True] * len(eqn.outvars)
        marked.update(v for v, m in zip(eqn.outvars, outs, strict=True) if m)
    return [hit(v) for v in jaxpr.outvars]


def reached(
    fn: Callable[..., Any], args: tuple[Any, ...], inputs: Sequence[int] | None = None
) -> list[list[bool]]:
    """For each leaf of ``args`` (flattened in order; ``inputs``: those indices only),
    which leaves of ``fn(*args)``'s output (flattened in order) it reaches, from
    ``jax.make_jaxpr`` (nothing runs)."""
    closed = jax.make_jaxpr(fn)(*args)
    n = len(closed.jaxpr.invars)
    chosen = range(n) if inputs is None else inputs
    return [_flow(closed.jaxpr, [i == j for j in range(n)]) for i in chosen]
