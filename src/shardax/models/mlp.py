"""The digits MLP: the model ``shardax train`` fits by default, its plans and TP rules.

``bench`` and ``tune-batch`` time the same MLP at other sizes on synthetic data, as the
data-parallel notebook of the seed documents does. Copy it as a template for an NNX model.

>>> model = make_mlp(64, 32, 2, 10, seed=0)
>>> model(jax.numpy.ones((4, 64))).shape
(4, 10)
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardax.mesh.axes import DATA_AXIS, MODEL_AXIS
from shardax.plan.named import MESH_PLANS
from shardax.plan.regex import rules

PLANS: tuple[str, ...] = (*MESH_PLANS, "tp")
"""The plans ``make_plan`` builds: the mesh's own (``sx.plan`` ``MESH_PLANS``) and
``tp`` (``tp_rules``)."""


class MLP(nnx.Module):
    """``layers`` ReLU layers of width ``hidden``, then a linear output layer.

    >>> MLP(64, 32, 2, 10, nnx.Rngs(0))(jax.numpy.ones((4, 64))).shape
    (4, 10)
    """

    def __init__(self, in_dim: int, hidden: int, layers: int, out_dim: int, rngs: nnx.Rngs) -> None:
        dims = [in_dim] + [hidden] * layers
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(dims)])
        self.out = nnx.Linear(dims[-1], out_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.out(x)


def make_mlp(in_dim: int, hidden: int, layers: int, out_dim: int, seed: int) -> MLP:
    """An ``MLP`` initialised from ``seed``."""
    return MLP(in_dim, hidden, layers, out_dim, nnx.Rngs(seed))


def tp_rules(num_layers: int) -> list[tuple[str, Any]]:
    """Megatron-style tensor parallelism for ``MLP``, as ``sx.rules`` pairs.

    Even layers split their kernel's columns (and bias) over ``model``; odd layers, and
    the output layer when it follows an even one, split the kernel's rows, so hidden
    activations stay split within a pair and one all-reduce per pair joins them. Other
    leaves are replicated; ``make_train_step`` shards Adam's moments like their params.

    >>> tp_rules(1)[0]
    ('layers/0/kernel', P(None, 'model'))
    """
    rules: list[tuple[str, Any]] = []
    for i in range(num_layers):
        if i % 2 == 0:
            rules += [
                (f"layers/{i}/kernel", P(None, MODEL_AXIS)),
                (f"layers/{i}/bias", P(MODEL_AXIS)),
            ]
        else:
            rules.append((f"layers/{i}/kernel", P(MODEL_AXIS, None)))
    if num_layers % 2:
        rules.append((r"(^|/)out/kernel", P(MODEL_AXIS, None)))
    return rules


def make_plan(name: str, mesh: Any, num_layers: int = 1) -> Any:
    """The plan ``name`` (one of ``PLANS``) over ``mesh``.

    >>> make_plan("zero1", sx.make_mesh({"data": 8})).name
    'zero1'
    """
    if name in MESH_PLANS:
        return MESH_PLANS[name](mesh, DATA_AXIS, 1024)
    if name == "tp":
        if MODEL_AXIS not in mesh.shape:
            raise ValueError(
                f"plan 'tp' needs a mesh with a {MODEL_AXIS!r} axis, got {dict(mesh.shape)}; "
                "e.g. {'data': -1, 'model': 2}"
            )
        return rules(mesh, tp_rules(num_layers))
    raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {name!r}")
