"""ZeRO-1 and ZeRO-2: optimizer state (and gradients) sharded; params replicated, or kept
sharded and gathered in the compute dtype at the step's start (``gather="forward"``).

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

With ``gather="forward"`` (a distributed optimizer, as Megatron's
``--use-distributed-optimizer --overlap-param-gather``) the params in the state are the
master copy, split as Adam's moments are, and the train step gathers their
compute-dtype copy (bf16 under ``precision="bf16"``) at its start, ahead of the forward
pass: half the bytes of a float32 gather, no replicated params between steps, and XLA's
latency-hiding scheduler hides each layer's gather behind the matmuls before it.

>>> sx.zero1(mesh, gather="forward").specs(state)["params"]["w"]
P('data', None)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jax.sharding import Mesh

from shardax.checks import public, received
from shardax.mesh.axes import DATA_AXIS
from shardax.plan.core import DEFAULT_FSDP_MIN_SIZE, AxisNames, fsdp, replicate
from shardax.plan.follow import FollowParams, ParamsSelector, check_selector

GATHERS = ("update", "forward")
"""``zero1(gather=...)``: the updated params gathered after the update, or the params kept
split and their compute-dtype copy gathered at the step's start."""


@public("sx.zero1")
def zero1(
    mesh: Mesh,
    axis: AxisNames = DATA_AXIS,
    min_size: int = DEFAULT_FSDP_MIN_SIZE,
    params: ParamsSelector = "params",
    gather: str = "update",
) -> FollowParams:
    """ZeRO-1: the optimizer state split over ``axis`` (a name or tuple), params replicated.

    A plan for a whole train state (``params`` locates the params in it, as in
    [`sx.plan.follow_params`][shardax.plan.follow_params]). Under ``make_train_step`` the
    update runs on each device's slice of the optimizer state. Leaves below ``min_size``
    elements, or with no dimension the axis divides, stay replicated. Only ``mode="jit"``.

    ``gather`` says where the params are gathered:

    - ``"update"`` (default): the params are replicated in the state (in ``param_dtype``)
      and the new params come back replicated, an all-gather in ``param_dtype`` after
      the update, at the step's end, with no matmul left to hide it.
    - ``"forward"``: the params (the master copy, in ``param_dtype``) stay split over
      ``axis`` as Adam's moments are; the step casts them to the precision's
      ``compute_dtype`` and gathers that copy at its start, once per step (the forward
      and backward passes share it; microbatches too), where XLA's latency-hiding
      scheduler overlaps each layer's gather with the matmuls of the layers before it.
      The gradients are reduced and handed to the optimizer as under ``"update"``, so
      the update is the same: under ``"bf16"`` the losses equal ``"update"``'s to the
      order of floating-point sums (``tests/plan/test_plan_zero.py``). Per device the
      state holds ``1/N`` of the params, not all of them; the gathered copy is a
      temporary of the step. Under ``"fp32"`` the gather is in float32 (at the start,
      still off the step's end).
    """
    check_selector("params", params)
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {GATHERS}, got {received(gather)}")
    base, mirror = replicate(mesh), fsdp(mesh, axis, min_size)
    return FollowParams(mesh, base.spec_fn, "zero1", base, params, mirror=mirror, gather=gather)


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
