"""Stops training at the first non-finite loss, before anything is saved for that step."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from shardax.checks import public


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; ``step`` is the step that produced it."""

    def __init__(self, step: int, value: float) -> None:
        super().__init__(
            f"loss is {value} at step {step}: training stopped and no checkpoint was written "
            f"for step {step}; lower the learning rate or check the data of that step "
            "(a batch whose 'mask' is all False, padding only, reads NaN)"
        )
        self.step, self.value = step, value


@public("sx.train.check_finite")
def check_finite(loss: Any, step: int) -> float:
    """Returns ``loss`` as a float, or raises [`NonFiniteLossError`][shardax.NonFiniteLossError]
    naming ``step``.

    Call it on the step's loss before saving a checkpoint for that step. It reads the
    value back to the host, so it synchronises with the device.

    >>> check_finite(jnp.float32(0.5), step=3)
    0.5
    """
    value = float(np.asarray(jax.device_get(loss)))
    if not math.isfinite(value):
        raise NonFiniteLossError(step, value)
    return value
