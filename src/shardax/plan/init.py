"""Creating state already sharded: no leaf is ever built whole on one device.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 8})
>>> init = lambda key: {"w": jax.random.normal(key, (1024, 64))}
>>> params = sx.plan.init_sharded(init, sx.fsdp(mesh), jax.random.key(0))
>>> params["w"].sharding.spec
P('data', None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from shardax.checks import public
from shardax.plan.core import Plan, as_plan
from shardax.plan.tree import is_array


@public("sx.plan.init_sharded")
def init_sharded(
    init_fn: Callable[..., Any], plan: Plan | Callable[[Any], Any], *args: Any, **kwargs: Any
) -> Any:
    """Runs ``init_fn(*args, **kwargs)`` under ``jax.jit`` with outputs laid out by ``plan``.

    Array arguments are traced; any other argument (a size, a flag) is static.

    The output shapes come from ``jax.eval_shape`` (nothing is allocated), the plan gives
    their shardings (raising any error before allocating), and each device then computes
    only its own shards (random initialisers included, as ``jax_threefry_partitionable``
    is on by default).
    """
    as_plan("plan", plan)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [i for i, x in enumerate(leaves) if is_array(x)]

    def run(*dynamic: Any) -> Any:  # non-array arguments (sizes, flags) stay static
        full = list(leaves)
        for i, x in zip(arrays, dynamic, strict=True):
            full[i] = x
        a, k = jax.tree.unflatten(treedef, full)
        return init_fn(*a, **k)

    dynamic = [leaves[i] for i in arrays]
    abstract = jax.eval_shape(run, *dynamic)
    return jax.jit(run, out_shardings=plan(abstract))(*dynamic)
