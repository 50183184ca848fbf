"""The 1F1B pipeline schedule: forwards and backwards of different microbatches interleaved.

GPipe ([`shardax.pipeline`][shardax.pipeline]) runs every microbatch forward, then
autodiff runs them all backward, so each stage keeps the activations of all M
microbatches. In 1F1B each stage runs, on every tick, the forward of one microbatch and
the backward of an earlier one, so a microbatch's activations die as soon as its backward
is done: a stage holds the inputs of at most ``2S - 1`` microbatches, whatever M.

Backward needs the loss's cotangent for each microbatch while later ones are still going
forward, so 1F1B takes the loss too: ``pipeline_1f1b(layer_fn, stacked, x, loss_fn,
loss_params, targets, microbatches=M)`` is the mean over microbatches of
``loss_fn(loss_params, h, targets)`` with ``h`` the L layers applied to the microbatch.
It is a ``jax.custom_vjp`` whose forward pass runs the whole schedule (hand-scheduled
``jax.vjp`` per stage inside one ``lax.scan``) and keeps the gradients, so ``jax.grad``
and ``sx.make_train_step`` use it like any loss.

>>> def head(p, h, y):                          # the part after the layers, per microbatch
...     return jnp.mean((h @ p["w"] - y) ** 2)
>>> def loss_fn(model, batch):
...     params = model.keywords["params"] if hasattr(model, "keywords") else model.params
...     return sx.pipeline_1f1b(layer, params["blocks"], batch["x"], head, params["head"],
...                             batch["y"], microbatches=8)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from shardax.checks import as_count, as_function, public
from shardax.parallel.gpipe import (
    STAGE_AXIS,
    batch_size,
    check_layer_fn,
    pad_ticks,
    scan_layers,
    shapes_text,
    split_microbatches,
    stage_mesh,
    vary,
)

LossHead = Callable[[Any, Any, Any], jax.Array]


def _mean_over_microbatches(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    micro: Any,
    loss_fn: LossHead,
    loss_params: Any,
    targets: Any,
) -> jax.Array:
    """The reference: every microbatch through the scan and the loss, averaged."""

    def one(xy: Any) -> jax.Array:
        x, y = xy
        return loss_fn(loss_params, scan_layers(layer_fn, stacked_params, x), y)

    return jnp.mean(lax.map(one, (micro, targets)))


@public("sx.pipeline_1f1b")
def pipeline_1f1b(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    loss_fn: LossHead,
    loss_params: Any,
    targets: Any,
    *,
    microbatches: int,
    axis: str = STAGE_AXIS,
) -> jax.Array:
    """The mean over M microbatches of ``loss_fn(loss_params, layers(x_mb), targets_mb)``,
    with the layers pipelined over ``axis`` in the 1F1B schedule.

    Args:
        layer_fn, stacked_params, microbatches, axis: as in [`shardax.pipeline`][shardax.pipeline]
            (same checks and errors; no ``repeats``).
        x: the layers' input, leading batch dimension (an array or a pytree).
        loss_fn: ``loss_fn(loss_params, h, targets) -> scalar``, the mean loss of one
            microbatch given the layers' output ``h``.
        loss_params: the loss head's params (gradients flow to them).
        targets: a pytree with the same leading batch size as ``x`` (no gradient).

    With equal microbatches and a per-example mean loss this is the loss of the whole
    batch. Without a stage axis it is the same mean computed with plain scans.
    Gradients reach ``stacked_params``, ``x`` and ``loss_params``.
    """
    where = stage_mesh(stacked_params, x, microbatches, axis)
    _check_inputs(layer_fn, stacked_params, x, loss_fn, loss_params, targets, microbatches)
    if where is None:
        return _mean_over_microbatches(
            layer_fn,
            stacked_params,
            split_microbatches(x, microbatches),
            loss_fn,
            loss_params,
            split_microbatches(targets, microbatches),
        )
    mesh, axis, stages, batch_axes = where
    split = functools.partial(split_microbatches, m=microbatches, mesh=mesh, batch_axes=batch_axes)
    run = _one_f_one_b(layer_fn, loss_fn, axis, stages, microbatches)
    return run(stacked_params, split(x), loss_params, split(targets))


def _check_inputs(
    layer_fn: Any,
    stacked_params: Any,
    x: Any,
    loss_fn: Any,
    loss_params: Any,
    targets: Any,
    microbatches: Any,
) -> None:
    """The inputs checked against each other, naming the shapes: the batch rows of ``x``
    and ``targets``, ``layer_fn`` keeping ``h``'s shape, and a scalar loss per microbatch."""
    m = as_count("microbatches", microbatches)
    rows = batch_size(x)
    if rows % m:
        raise ValueError(f"the batch of x ({rows} rows) is not divisible by microbatches={m}")
    target_rows = batch_size(targets, "targets")
    if target_rows != rows:
        raise ValueError(
            f"targets have {target_rows} rows but x has {rows}; they must hold one "
            f"row per example (targets {shapes_text(jax.eval_shape(lambda t: t, targets))}, x "
            f"{shapes_text(jax.eval_shape(lambda h: h, x))})"
        )
    check_layer_fn(layer_fn, stacked_params, x)
    as_function("loss_fn", loss_fn, "a function loss_fn(loss_params, h, targets) -> loss")
    one = jax.tree.map(lambda a: a[: rows // m], (x, targets))
    loss = jax.eval_shape(loss_fn, loss_params, *one)
    if not (hasattr(loss, "shape") and loss.shape == ()):
        raise ValueError(
            f"loss_fn(loss_params, h, targets) must return a scalar, the mean loss of "
            f"one microbatch (its gradient starts the backward pass); it returned "
            f"{shapes_text(loss)} for a microbatch of {rows // m} rows. Average it, e.g. jnp.mean"
        )


def _one_f_one_b(
    layer_fn: Callable[[Any, Any], Any],
    loss_fn: LossHead,
    axis: str,
    stages: int,
    m: int,
) -> Callable[..., jax.Array]:
    """``run(stacked, micro_x, loss_params, micro_targets) -> loss``, a custom_vjp."""
    slots = 2 * stages - 1  # microbatches a stage has started and not finished, at most

    def schedule(stacked: Any, micro: Any, loss_params: Any, targets: Any):
        """Inside shard_map over ``axis``: loss and gradients, one F and one B per tick.

        Stage s runs the forward of microbatch f = t - s and the backward of microbatch
        b = t - (2S - 2 - s) on tick t: the last stage runs both for the same microbatch,
        with the loss in between, and cotangents flow back one stage per tick.
        """
        stage = lax.axis_index(axis)
        first, last = stage == 0, stage == stages - 1
        # Varying, so the head's gradient is this stage's own (the gradient of an
        # invariant input would be summed over the stages, garbage included).
        loss_params = vary(loss_params, axis)

        def forward(params: Any, h: Any) -> Any:
            return scan_layers(layer_fn, params, h)

        def tick(carry: Any, xs: Any):
            fwd_in, bwd_in, stash, grads, head_grads, loss = carry
            t, fresh = xs
            f, b = t - stage, t - (2 * stages - 2 - stage)
            f_ok, b_ok = (f >= 0) & (f < m), (b >= 0) & (b < m)
            # Forward of microbatch f: keep its input until its backward.
            h_in = jax.tree.map(lambda a, r: jnp.where(first, a, r), fresh, fwd_in)
            stash = jax.tree.map(lambda s, h: s.at[t % slots].set(h), stash, h_in)
            h_out = forward(stacked, h_in)
            # The last stage: the loss of microbatch f and its cotangent, now.
            y = jax.tree.map(lambda a: a[jnp.clip(f, 0, m - 1)], targets)
            value, (g_head, g_h) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                loss_params, h_out, y
            )
            use_head = last & f_ok
            loss = loss + jnp.where(use_head, value, 0)
            head_grads = jax.tree.map(
                lambda a, g: a + jnp.where(use_head, g, 0), head_grads, g_head
            )
            # Backward of microbatch b, from its stashed input (recomputed forward).
            ct = jax.tree.map(lambda g, r: jnp.where(last, g, r), g_h, bwd_in)
            saved = jax.tree.map(lambda s: s[(t - (2 * stages - 2 - 2 * stage)) % slots], stash)
            _, vjp = jax.vjp(forward, stacked, saved)
            g_params, g_in = vjp(ct)
            grads = jax.tree.map(lambda a, g: a + jnp.where(b_ok, g, 0), grads, g_params)
            fwd_next = lax.ppermute(h_out, axis, [(s, s + 1) for s in range(stages - 1)])
            bwd_next = lax.ppermute(g_in, axis, [(s + 1, s) for s in range(stages - 1)])
            carry = (fwd_next, bwd_next, stash, grads, head_grads, loss)
            return carry, jax.tree.map(lambda g: jnp.where(first & b_ok, g, 0), g_in)

        ticks = m + 2 * stages - 2
        one = jax.tree.map(lambda a: jnp.zeros_like(a[0]), micro)
        init = (
            vary(one, axis),
            vary(one, axis),
            vary(jax.tree.map(lambda a: jnp.zeros_like(a[:1]).repeat(slots, 0), micro), axis),
            jax.tree.map(jnp.zeros_like, stacked),
            jax.tree.map(jnp.zeros_like, loss_params),
            vary(jnp.zeros((), jnp.float32), axis),
        )
        xs = (jnp.arange(ticks), pad_ticks(micro, ticks))
        (_, _, _, grads, head_grads, loss), g_x = lax.scan(tick, init, xs)
        scale = 1.0 / m
        # Stage 0 finishes microbatch b's backward on tick b + 2S - 2.
        g_x = jax.tree.map(lambda g: lax.psum(g[2 * stages - 2 :], axis) * scale, g_x)
        return (
            lax.psum(loss, axis) * scale,
            jax.tree.map(lambda g: g * scale, grads),
            g_x,
            jax.tree.map(lambda g: lax.psum(g, axis) * scale, head_grads),
        )

    def forward_and_grads(stacked: Any, micro: Any, loss_params: Any, targets: Any):
        replicated = PartitionSpec()
        return jax.shard_map(
            schedule,
            in_specs=(PartitionSpec(axis), replicated, replicated, replicated),
            out_specs=(replicated, PartitionSpec(axis), replicated, replicated),
            axis_names={axis},
        )(stacked, micro, loss_params, targets)

    @jax.custom_vjp
    def run(stacked: Any, micro: Any, loss_params: Any, targets: Any) -> jax.Array:
        return forward_and_grads(stacked, micro, loss_params, targets)[0]

    def run_fwd(stacked: Any, micro: Any, loss_params: Any, targets: Any):
        loss, *grads = forward_and_grads(stacked, micro, loss_params, targets)
        return loss, (grads, targets)

    def run_bwd(res: Any, ct: jax.Array):
        (g_stacked, g_micro, g_head), targets = res

        def scale(tree: Any) -> Any:
            return jax.tree.map(lambda g: g * ct.astype(g.dtype), tree)

        no_grad = jax.tree.map(
            lambda a: (
                jnp.zeros_like(a)
                if jnp.issubdtype(a.dtype, jnp.inexact)
                else jnp.zeros(a.shape, jax.dtypes.float0)
            ),
            targets,
        )
        return scale(g_stacked), scale(g_micro), scale(g_head), no_grad

    run.defvjp(run_fwd, run_bwd)
    return run
