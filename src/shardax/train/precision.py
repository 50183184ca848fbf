"""Mixed precision: a dtype policy and dynamic loss scaling, as pure functions.

A [`Precision`][shardax.Precision] says in which dtype the state's params are kept
(``param_dtype``), in which dtype the forward and backward passes run
(``compute_dtype``: params and floating batch leaves are cast to it) and in which
dtype the loss and metrics come out (``output_dtype``). Gradients are taken with
respect to the stored params, so they reach the optimizer in ``param_dtype``.

**Where the gradients are summed across devices**, the bytes are in the dtype the backward
pass makes them in: XLA reduces (``reduce-scatter``, ``all-reduce``) where the gradient is
computed, before it is widened to ``param_dtype``. So under ``"bf16"`` the matmul weights'
gradients are reduced in bfloat16 (``compute_dtype``), as PyTorch FSDP's
``reduce_dtype=bfloat16`` does, and gradients computed in float32 (norm scales, the
embedding's scatter) in float32. Under FSDP the weights are gathered in ``compute_dtype``
too (the cast runs before the gather); ZeRO-1/2 gather the updated params in
``param_dtype``, or, with ``gather="forward"``, their ``compute_dtype`` copy at the step's
start. ``tests/compile/test_overlap_targets.py`` checks these dtypes in the GPT's compiled
step for an 8xH100 target. There is no float32-reduction option yet.

With float16 compute, small gradients underflow;
[`LossScaling`][shardax.train.LossScaling] multiplies the loss by a scale before
differentiating and divides the gradients by it after. The scale lives in a
``LossScaleState`` in the train state: a step whose gradients are not finite is skipped
and halves the scale; ``period`` finite steps in a row double it (the schedule of
``jmp.DynamicLossScale``).

>>> policy = resolve("bf16")
>>> cast_floating({"w": jnp.ones(2), "n": jnp.arange(2)}, policy.compute_dtype)["w"].dtype
dtype(bfloat16)
>>> scale = init_loss_scale(LossScaling(initial=8.0))
>>> adjust_loss_scale(scale, jnp.bool_(False), LossScaling(initial=8.0)).scale
Array(4., dtype=float32)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardax.checks import as_count, as_float, public
from shardax.plan.tree import is_array


@public("sx.train.LossScaling")
@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling settings, checked when built.

    Attributes:
        initial: the scale of the first step, a finite number >= ``minimum``.
        period: finite steps in a row after which the scale is multiplied by ``factor``.
        factor: growth factor (and the divisor after a non-finite step), > 1.
        minimum: the scale never goes below it, > 0.
    """

    initial: float = 2.0**15
    period: int = 2000
    factor: float = 2.0
    minimum: float = 1.0

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("initial", as_float("initial", self.initial, above=0))
        put("period", as_count("period", self.period))
        put("factor", as_float("factor", self.factor, above=1))
        put("minimum", as_float("minimum", self.minimum, above=0))
        if self.initial < self.minimum:
            raise ValueError(
                f"initial must be >= minimum, got initial={self.initial:g} and "
                f"minimum={self.minimum:g}"
            )


class LossScaleState(NamedTuple):
    """The loss scale carried in the train state."""

    scale: jax.Array  # f32[], the scale the next step multiplies the loss by
    good_steps: jax.Array  # i32[], finite steps since the scale last changed


@public("sx.Precision")
class Precision(NamedTuple):
    """A mixed-precision policy for ``make_train_step(..., precision=...)``.

    Attributes:
        param_dtype: dtype of the floating params in the state (``step.shard`` and
            ``step.init`` cast them); gradients reach the optimizer in it.
        compute_dtype: params and floating batch leaves are cast to it for the forward
            and backward passes.
        output_dtype: the loss and the metrics are cast to it.
        loss_scaling: dynamic loss scaling settings, or None for no scaling.
        matmul: ``"default"`` (the matmuls in ``compute_dtype``) or ``"fp8"``: the dense
            layers' matmuls as fp8 GEMMs (E4M3 forward, E5M2 gradients, one current
            scale per tensor; ``shardax.parallel.fp8``), the rest in ``compute_dtype``
            (which layers: ``shardax.train.fp8_layers``).
        keep: under ``matmul="fp8"``, regexes of layer paths (``re.search``) that stay in
            ``compute_dtype``, e.g. ``("head", "layers/0")`` for an LM head and a first
            layer of your own.

    >>> sx.Precision(compute_dtype=jnp.bfloat16, matmul="fp8", keep=("head",)).matmul
    'fp8'
    >>> policy = Precision(compute_dtype=jnp.float16, loss_scaling=LossScaling(period=500))
    >>> policy.loss_scaling.initial, policy.param_dtype == jnp.float32
    (32768.0, True)
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    loss_scaling: LossScaling | None = None
    matmul: str = "default"
    keep: tuple[str, ...] = ()


MATMULS = ("default", "fp8")
"""``Precision.matmul``: the matmuls in the compute dtype, or as fp8 GEMMs."""

PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(),
    "bf16": Precision(compute_dtype=jnp.bfloat16),
    "fp16": Precision(compute_dtype=jnp.float16, loss_scaling=LossScaling()),
    "fp8": Precision(compute_dtype=jnp.bfloat16, matmul="fp8"),
}


def resolve(precision: str | Precision) -> Precision:
    """The [`Precision`][shardax.Precision] for ``"fp32"``, ``"bf16"``, ``"fp16"``,
    ``"fp8"`` or a ``Precision``, with its dtypes as NumPy dtypes; raises naming the value
    for anything else."""
    if isinstance(precision, str):
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {list(PRECISIONS)} or an sx.Precision, got {precision!r}"
            )
        precision = PRECISIONS[precision]
    elif not isinstance(precision, Precision):
        raise TypeError(
            f"precision must be one of {list(PRECISIONS)} or an sx.Precision, got "
            f"{type(precision).__name__} {precision!r}"
        )
    dtypes = {}
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        value = getattr(precision, field)
        try:
            dtype = jnp.dtype(value)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"Precision.{field} must be a floating dtype (e.g. jnp.bfloat16), got {value!r}"
            )
        dtypes[field] = dtype
    scaling = precision.loss_scaling
    if scaling is not None and not isinstance(scaling, LossScaling):
        raise TypeError(
            f"Precision.loss_scaling must be an sx.train.LossScaling or None, got {scaling!r}"
        )
    if precision.matmul not in MATMULS:
        raise ValueError(f"Precision.matmul must be one of {MATMULS}, got {precision.matmul!r}")
    keep = precision.keep
    if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
        raise TypeError(f"Precision.keep must be a tuple of regex strings, got {keep!r}")
    for pattern in keep:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"Precision.keep: {pattern!r} is not a regex ({error})") from None
    return precision._replace(**dtypes, keep=tuple(keep))


def policy_name(precision: Precision) -> str:
    """``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"`` for the named policies, else the repr."""
    for key, value in PRECISIONS.items():
        if resolve(value) == precision:
            return key
    return repr(precision)


def _floating(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating array leaf cast to ``dtype``; other leaves as they are."""
    return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) and x.dtype != dtype else x, tree)


def narrow_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating array leaf of one dimension or more that is wider than
    ``dtype`` cast to it; scalars (an optimizer's count or learning rate) and narrower
    leaves as they are. The optimizer state follows the params' ``param_dtype`` this way:
    Adam's moments are bf16 beside bf16 params (6 bytes per parameter, not 10).

    >>> tree = {"mu": jnp.ones(2), "lr": jnp.float32(0.1), "n": jnp.arange(2)}
    >>> {k: str(v.dtype) for k, v in narrow_floating(tree, jnp.bfloat16).items()}
    {'lr': 'float32', 'mu': 'bfloat16', 'n': 'int32'}
    """
    dtype = jnp.dtype(dtype)

    def one(x: Any) -> Any:
        if not _floating(x) or not jnp.ndim(x) or jnp.dtype(x.dtype).itemsize <= dtype.itemsize:
            return x
        return x.astype(dtype)

    return jax.tree.map(one, tree)


def cast_like(tree: Any, like: Any) -> Any:
    """``tree`` with each floating leaf cast to the dtype of the same leaf of ``like``."""
    return jax.tree.map(
        lambda x, y: x.astype(y.dtype) if _floating(x) and x.dtype != y.dtype else x, tree, like
    )


def init_loss_scale(scaling: LossScaling) -> LossScaleState:
    """The loss scale state of the first step."""
    return LossScaleState(jnp.float32(scaling.initial), jnp.int32(0))


def scale_loss(loss: jax.Array, state: LossScaleState | None) -> jax.Array:
    """``loss * scale`` (``loss`` itself without scaling)."""
    return loss if state is None else loss * state.scale.astype(loss.dtype)


def unscale(grads: Any, state: LossScaleState | None) -> Any:
    """``grads / scale`` (``grads`` themselves without scaling)."""
    if state is None:
        return grads
    return jax.tree.map(lambda g: (g / state.scale.astype(g.dtype)).astype(g.dtype), grads)


def all_finite(tree: Any) -> jax.Array:
    """bool[]: every element of every floating leaf of ``tree`` is finite."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _floating(x)]
    return jnp.stack(flags).all() if flags else jnp.bool_(True)


def adjust_loss_scale(
    state: LossScaleState, finite: jax.Array, scaling: LossScaling
) -> LossScaleState:
    """The scale after a step: divided by ``factor`` (not below ``minimum``) when the
    gradients were not finite, multiplied by it after ``period`` finite steps in a row."""
    grow = state.good_steps + 1 >= scaling.period
    grown = state.scale * scaling.factor
    grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
    scale = jnp.where(
        finite,
        jnp.where(grow, grown, state.scale),
        jnp.maximum(state.scale / scaling.factor, jnp.float32(scaling.minimum)),
    )
    good = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
    return LossScaleState(scale.astype(jnp.float32), good)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``jnp.where(pred, on_true, on_false)`` over two trees of one structure."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
