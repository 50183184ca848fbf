"""``sx.remat``: activation rematerialisation by named policy, for any kind of block.

The backward pass needs the forward pass's activations. A remat policy decides which of
them a block saves and which it recomputes during the backward pass, trading FLOPs for
memory:

============================  ============================================================
policy                        saved for the backward pass (the rest is recomputed)
============================  ============================================================
``"none"``                    everything (no remat; the block is returned unchanged)
``"full"``                    only the block's inputs (``nothing_saveable``)
``"dots"``                    matmul outputs (``dots_saveable``)
``"dots_no_batch"``           matmul outputs without batch dims, i.e. weight-only
                              contractions (``dots_with_no_batch_dims_saveable``)
``"offload_dots_no_batch"``   as ``"dots_no_batch"``, but held in pinned host memory
                              (``offload_dot_with_no_batch_dims``); backends with a
                              ``pinned_host`` memory (GPU, TPU, and CPU in JAX 0.10+)
============================  ============================================================

A ``jax.checkpoint_policies`` function may be passed instead of a name.

>>> block = sx.remat(lambda w, x: jnp.tanh(x @ w), policy="dots")
>>> jax.grad(lambda w: block(w, jnp.ones((2, 3))).sum())(jnp.ones((3, 3))).shape
(3, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from shardax._extras import equinox, is_equinox
from shardax.checks import public, received

POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots_no_batch")
OFFLOAD = {"offload_dots_no_batch"}


def check_policy(policy: str | Callable[..., Any]) -> str | Callable[..., Any]:
    """``policy`` if it is a known name or a callable, else ``ValueError`` naming it."""
    if callable(policy) or policy in POLICIES:
        return policy
    raise ValueError(
        f"remat policy must be one of {list(POLICIES)} or a jax.checkpoint_policies "
        f"function, got {policy!r}"
    )


def _host_memory_kind() -> str | None:
    """The pinned host memory kind of the default backend's devices, if it has one."""
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def checkpoint_policy(policy: str | Callable[..., Any]) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy of ``policy`` (None for ``"none"``: no remat).

    Offload policies need a backend whose devices have a ``pinned_host`` memory; elsewhere
    they raise ``ValueError`` naming the backend.
    """
    check_policy(policy)
    if callable(policy):
        return policy
    cp = jax.checkpoint_policies
    if policy in OFFLOAD:
        host = _host_memory_kind()
        if host is None:
            platform = jax.devices()[0].platform
            raise ValueError(
                f"remat policy {policy!r} offloads to pinned host memory, which the "
                f"{platform!r} backend does not support; use 'dots_no_batch' or 'full'"
            )
        return cp.offload_dot_with_no_batch_dims("device", host)
    return {
        "full": cp.nothing_saveable,
        "dots": cp.dots_saveable,
        "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    }.get(policy)


@public("sx.remat")
def remat(block: Any, policy: str | Callable[..., Any] = "full", prevent_cse: bool = True) -> Any:
    """``block`` with its activations rematerialised by ``policy`` (see the table above).

    ``block`` may be:

    - a function: returns ``jax.checkpoint(block, policy=...)``;
    - a Flax NNX module: returns a function ``(*args) -> block(*args)`` under
      ``nnx.remat``, which carries the module's state updates through;
    - an Equinox module: returns an Equinox module (``eqx.filter_checkpoint``), still a
      pytree, so it may stay a field of the enclosing model.

    ``policy="none"`` returns ``block`` itself. ``prevent_cse`` is ``jax.checkpoint``'s;
    False is safe (and faster) under ``lax.scan``.

    >>> from flax import nnx
    >>> layer = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    >>> sx.remat(layer, policy="full")(jnp.ones((2, 3))).shape
    (2, 3)
    """
    fn_policy = checkpoint_policy(policy)
    if not callable(block):
        raise TypeError(
            f"block must be a function, an NNX module or an Equinox module, got {received(block)}"
        )
    if policy == "none":
        return block

    if isinstance(block, nnx.Module):
        call = nnx.remat(
            lambda module, *a, **k: module(*a, **k), policy=fn_policy, prevent_cse=prevent_cse
        )
        return lambda *args, **kwargs: call(block, *args, **kwargs)
    if is_equinox(block):
        return equinox().filter_checkpoint(block, policy=fn_policy, prevent_cse=prevent_cse)
    return jax.checkpoint(block, policy=fn_policy, prevent_cse=prevent_cse)
