"""Every private JAX API shardax uses, in one place (JAX 0.10.x to 0.12.x).

Each has no public equivalent in the supported versions:

- ``backends_are_initialized()``: whether a JAX backend has started. ``sx.initialize``
  must run before that (``jax.distributed.initialize`` says so only by failing later);
  ``jax.devices()`` would itself start a backend.
- ``cluster_env(method)``: JAX's cluster detection classes (SLURM, Open MPI), whose
  ``is_env_present()`` tells ``sx.initialize`` which cluster it runs in, by the same
  rules ``jax.distributed.initialize`` then applies.
- ``ClusterEnv``: the base of those classes; the tests check through it that JAX's
  SLURM detection fills in what ``sx.initialize`` leaves to it.
- ``ShardingTypeError``: the error JAX raises when an operation's output sharding does
  not follow from its inputs' types on a mesh with Explicit axes. shardax adds a note
  to it saying what to change; JAX raises it, so it can only be caught by its class.

``tests/test_compat.py`` checks each against the installed JAX and fails naming the
JAX version when one moves.

>>> from shardax.runtime import compat
>>> compat.cluster_env("slurm").__name__
'SlurmCluster'
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src import clusters as _clusters
from jax._src import core as _core
from jax._src import xla_bridge as _xla_bridge

JAX_VERSION = jax.__version__

ShardingTypeError: type[Exception] = _core.ShardingTypeError
ClusterEnv: Any = _clusters.ClusterEnv

_CLUSTERS = {"slurm": "SlurmCluster", "ompi": "OmpiCluster"}
CLUSTER_METHODS: tuple[str, ...] = tuple(_CLUSTERS)
"""The cluster environments ``sx.initialize`` recognises without being told."""


def backends_are_initialized() -> bool:
    """True once any JAX backend (CPU, GPU, TPU) has been created in this process."""
    return _xla_bridge.backends_are_initialized()


def cluster_env(method: str) -> Any:
    """JAX's cluster-detection class for ``method`` (``"slurm"`` or ``"ompi"``)."""
    if method not in _CLUSTERS:
        raise ValueError(f"cluster_env: method must be one of {list(_CLUSTERS)}, got {method!r}")
    return getattr(_clusters, _CLUSTERS[method])
