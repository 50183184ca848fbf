"""sx.attention refuses inputs it would otherwise read silently: a boolean bias, a
non-bool ``causal``, integer q/k/v, and q/k/v of different dtypes (on a context mesh
too)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

from shardax.parallel import attention

Q = jnp.ones((2, 16, 4, 8))


def test_boolean_bias_is_refused_pointing_to_the_masks():
    with pytest.raises(
        TypeError, match=r"bias must be a floating array.*got dtype bool.*segment_ids="
    ):
        attention(Q, Q, Q, bias=jnp.ones((1, 1, 16, 16), bool))


def test_causal_must_be_a_bool():
    with pytest.raises(TypeError, match=r"causal must be True or False, got 'no'"):
        attention(Q, Q, Q, causal="no")


def test_integer_inputs_are_refused():
    qi = jnp.ones((2, 16, 4, 8), jnp.int32)
    with pytest.raises(TypeError, match=r"q must be a floating array.*got dtype int32"):
        attention(qi, qi, qi)


def test_mixed_dtypes_are_refused_on_a_context_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    kb = Q.astype(jnp.bfloat16)
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            TypeError,
            match=r"q, k and v must share one dtype, got q float32, k bfloat16, v float32",
        ),
    ):
        attention(Q, kb, Q, causal=True, impl="ring")
    with pytest.raises(TypeError, match="must share one dtype"):
        attention(Q, Q, kb)
