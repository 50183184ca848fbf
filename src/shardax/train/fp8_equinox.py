"""``Fp8Linear``: an ``eqx.nn.Linear``'s arrays with its matmul as fp8 GEMMs.

Equinox's ``Linear`` has no ``dot_general`` hook, so the ``matmul="fp8"`` policy
(``shardax.train.fp8_layers``) hands ``loss_fn`` this module in its place, holding the
same ``Linear`` (so the gradients are the ``Linear``'s). It takes leading batch dims:
called on the batch (``x`` of shape ``(..., in)``) each operand has one scale. Under
``jax.vmap`` the activations' scales are per example, which stays correct but makes the
weight gradient a sum of per-example products: call the model on the batch where you can.

>>> linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
>>> Fp8Linear(linear)(jnp.ones((2, 4))).shape
(2, 3)
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from shardax.parallel.fp8 import fp8_dot_general


class Fp8Linear(eqx.Module):
    """``linear(x)`` with ``x @ weight.T`` as fp8 GEMMs (the bias added in ``x``'s dtype)."""

    linear: eqx.nn.Linear

    def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
        del key
        weight = self.linear.weight  # (out, in), or (in,) / (out,) with "scalar" sizes
        if self.linear.in_features == "scalar":
            x = x[..., None]
        w = weight.reshape(weight.shape[0], -1).T  # (in, out)
        y = fp8_dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
        if self.linear.bias is not None:
            y = y + self.linear.bias.astype(y.dtype)
        if self.linear.out_features == "scalar":
            y = jnp.squeeze(y, -1)
        return y
