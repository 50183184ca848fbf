"""The private JAX APIs of shardax.runtime.compat exist in the installed JAX and do what
shardax relies on; a failure names the JAX version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardax.runtime import compat

VERSION = f"JAX {jax.__version__}"


def test_every_private_api_is_where_shardax_expects_it():
    assert compat.missing() == [], f"{VERSION} moved private APIs shardax uses"


def test_a_moved_api_is_an_import_error_naming_the_jax_version(monkeypatch):
    monkeypatch.setitem(compat.PRIVATE_APIS, "gone", ("jax._src.core", "NoSuchThing"))
    with pytest.raises(
        ImportError, match=rf"jax._src.core.NoSuchThing, which JAX {jax.__version__}"
    ):
        compat.private("gone")
    assert len(compat.missing()) == 1


def test_private_apis_behave_as_shardax_relies_on(monkeypatch):
    jax.devices()
    assert compat.backends_are_initialized() is True, VERSION
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    for name in (*slurm, "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert not compat.cluster_env("slurm").is_env_present(), VERSION
    for name in slurm:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert compat.cluster_env("slurm").is_env_present(), VERSION
    with pytest.raises(ValueError, match="must be one of"):
        compat.cluster_env("k8s")

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data")))
    w = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P(None, "data")))
    with pytest.raises(Exception) as error, jax.set_mesh(mesh):
        jax.jit(jnp.matmul)(x, w)  # both operands' "data" on the result: a type error
    assert compat.is_sharding_type_error(error.value), f"{VERSION}: {error.value!r}"
    assert not compat.is_sharding_type_error(ValueError("other"))


def test_cudnn_backward_primitive_takes_the_parameters_shardax_binds():
    """The ring's cuDNN backward binds JAX's private primitive with parameters that move
    between versions; its shapes come out of JAX's abstract rule (no GPU needed): the
    gradients shaped like q, k and v (GQA: 4 query heads over 2 kv heads)."""
    q = jax.ShapeDtypeStruct((2, 32, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 4, 32), jnp.float32)
    for causal in (False, True):
        grads = jax.eval_shape(
            lambda q, k, v, o, lse, do, c=causal: compat.cudnn_attention_bwd(
                q, k, v, o, lse, do, scale=0.125, causal=c
            ),
            q, kv, kv, q, lse, q,
        )  # fmt: skip
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, kv, kv)], (
            VERSION
        )
