"""ZeRO-1 and ZeRO-2: params replicated, optimizer state (and gradients) sharded.

ZeRO stage 1 splits only the optimizer state over the data axis; stage 2 also has the
train step constrain the gradients to that split before the update, so the gradient
all-reduce becomes a reduce-scatter where the backend emits one; stage 3 is
[`shardax.fsdp`][shardax.fsdp]. Each leaf of the optimizer state that mirrors a param (Adam's
``mu`` and ``nu``) is split as ``fsdp`` would split the param (largest divisible
dimension); scalars (``count``) and the params stay replicated.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 8})
>>> params = {"w": np.zeros((1024, 16), np.float32)}
>>> state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
>>> specs = sx.zero1(mesh).specs(state)
>>> specs["params"]["w"], specs["opt_state"][0].mu["w"], specs["opt_state"][0].count
(P(), P('data', None), P())
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jax.sharding import Mesh

from shardax.checks import public
from shardax.mesh.axes import DATA_AXIS
from shardax.plan.core import DEFAULT_FSDP_MIN_SIZE, AxisNames, fsdp, replicate
from shardax.plan.follow import FollowParams, ParamsSelector, check_selector


@public("sx.zero1")
def zero1(
    mesh: Mesh,
    axis: AxisNames = DATA_AXIS,
    min_size: int = DEFAULT_FSDP_MIN_SIZE,
    params: ParamsSelector = "params",
) -> FollowParams:
    """ZeRO-1: the optimizer state split over ``axis`` (a name or tuple), params replicated.

    A plan for a whole train state (``params`` locates the params in it, as in
    [`sx.plan.follow_params`][shardax.plan.follow_params]). Under ``make_train_step`` the update
    runs on each
    device's slice of the optimizer state and the new params come back replicated
    (an all-gather of the updated params per step). Leaves below ``min_size`` elements,
    or with no dimension the axis divides, stay replicated. Only ``mode="jit"``.
    """
    check_selector("params", params)
    base, mirror = replicate(mesh), fsdp(mesh, axis, min_size)
    return FollowParams(mesh, base.spec_fn, "zero1", base, params, mirror=mirror)


@public("sx.zero2")
@functools.wraps(zero1, assigned=(), updated=())  # zero1's signature, for inspect and help
def zero2(*args: Any, **kwargs: Any) -> FollowParams:
    """ZeRO-2: [`zero1`][shardax.zero1] (the same arguments), and ``make_train_step`` constrains the
    gradients to the optimizer state's sharding before the update, so each device keeps
    only its slice of the reduced gradients (a reduce-scatter where the backend emits one).

    >>> sx.zero2(mesh).shard_grads
    True
    """
    return dataclasses.replace(zero1(*args, **kwargs), name="zero2", shard_grads=True)
