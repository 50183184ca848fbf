"""Plans from the sharding annotations of a Flax NNX model, through logical axis rules.

Annotate once with logical names (``nnx.with_partitioning(init, ("embed", "mlp"))``,
stored by flax 0.12 as the variable's ``out_sharding`` metadata; the older
``sharding``/``sharding_names`` spellings map to it), then map the names onto any mesh:

>>> import shardax as sx
>>> with nnx.use_eager_sharding(False):
...     model = nnx.eval_shape(lambda: nnx.Linear(
...         16, 32, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
...                                                   ("embed", "mlp")), rngs=nnx.Rngs(0)))
>>> mesh = sx.make_mesh({"data": 4, "model": 2})
>>> plan = sx.from_nnx(mesh, model, {"embed": None, "mlp": "model"})
>>> plan.specs(nnx.state(model))["kernel"].get_value()
P(None, 'model')
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.checks import check_mesh
from shardax.plan.core import Leaves, Plan
from shardax.plan.tree import path_str

AxisRules = Mapping[str, Any] | Sequence[tuple[str, Any]]

_AXIS_RULES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "shardax_axis_rules", default=None
)


@contextlib.contextmanager
def axis_rules(rules: AxisRules) -> Iterator[dict[str, Any]]:
    """Sets the logical-to-mesh axis mapping for :func:`from_nnx` and :func:`constrain`.

    It is read when a function is traced and, unlike ``jax.set_mesh``, is not part of
    ``jax.jit``'s cache key: a function already traced under one mapping keeps it, so
    build a new ``jax.jit`` per mapping.

    >>> with sx.plan.axis_rules({"batch": "data", "mlp": "model"}):
    ...     print(sx.plan.current_axis_rules()["mlp"])  # in a model: sx.constrain(h, P("mlp"))
    model
    """
    token = _AXIS_RULES.set(dict(rules))
    try:
        yield _AXIS_RULES.get()
    finally:
        _AXIS_RULES.reset(token)


def current_axis_rules() -> dict[str, Any] | None:
    """The mapping set by the innermost :func:`axis_rules`, or ``None``."""
    return _AXIS_RULES.get()


def logical_to_mesh(
    spec: Any, mesh: Any, rules: AxisRules | None = None, where: str = "spec"
) -> PartitionSpec:
    """``spec``'s logical names mapped to mesh axes (names already in the mesh pass through).

    >>> sx.plan.logical_to_mesh(P("batch", "mlp"), mesh, {"batch": "data", "mlp": None})
    P('data', None)
    """
    rules = dict((current_axis_rules() or {}) if rules is None else rules)
    return PartitionSpec(*(_mesh_entry(e, rules, mesh, where) for e in spec))


def _mesh_entry(entry: Any, rules: dict[str, Any], mesh: Mesh, where: str) -> Any:
    """One annotation entry (None, a name, or a tuple of names) as mesh axes."""
    if entry is None:
        return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    axes: list[str] = []
    for name in names:
        if name in rules:
            target = rules[name]
        elif name in mesh.shape:
            target = name
        else:
            raise ValueError(
                f"{where}: logical axis {name!r} has no entry in axis_rules {rules} and is "
                f"not a mesh axis (mesh axes {dict(mesh.shape)}); map it to a mesh axis, "
                "a tuple of axes, or None to replicate"
            )
        if target is None:
            continue
        axes.extend((target,) if isinstance(target, str) else target)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def annotated_specs(model: Any, mesh: Mesh, axis_rules: AxisRules | None = None) -> dict:
    """``{leaf path: (shape, PartitionSpec)}`` for every annotated NNX variable in ``model``.

    ``model`` is an NNX module (concrete or from ``nnx.eval_shape``) or its state.
    """
    from flax import nnx

    table: dict[str, tuple[tuple[int, ...], PartitionSpec]] = {}
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    for var_path, var in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_var)[0]:
        if not is_var(var):
            continue
        names = var.get_metadata().get("out_sharding")
        if not names:
            continue
        if isinstance(names, NamedSharding):
            names = names.spec
        where = f"variable {path_str(var_path)!r}"
        spec = logical_to_mesh(names, mesh, axis_rules, where)
        for sub_path, leaf in jax.tree_util.tree_flatten_with_path(var)[0]:
            table[path_str(var_path + sub_path)] = (tuple(leaf.shape), spec)
    return table


def from_nnx(
    mesh: Mesh,
    model: Any,
    axis_rules: AxisRules | None = None,
    default: PartitionSpec | Plan | None = None,
) -> Plan:
    """A plan from the ``out_sharding`` annotations of ``model``'s NNX variables.

    ``axis_rules`` maps each logical name to a mesh axis, a tuple of axes, or ``None``
    (replicate); a name that is already a mesh axis may be left out. Default: the
    mapping set by :func:`axis_rules`. A leaf gets the
    spec of the annotated variable whose path is the longest "/"-suffix of the leaf's
    path and whose shape is the leaf's shape, so the plan applies to the model, its
    ``nnx.state``, a train state holding it, and Adam's ``mu``/``nu`` alike. Other
    leaves get ``default`` (a ``PartitionSpec``, a plan on the same mesh, or ``None``
    to replicate).

    With logical names, build the model with ``nnx.use_eager_sharding(False)`` (flax
    otherwise shards variables at creation and needs its own mesh and rules).
    """
    check_mesh("from_nnx: mesh", mesh)
    table = annotated_specs(model, mesh, axis_rules)
    if isinstance(default, Plan) and default.mesh != mesh:
        raise ValueError(f"default plan {default.name!r} is on another mesh than from_nnx's")

    def lookup(path: str, shape: tuple[int, ...]) -> str | None:
        parts = path.split("/")
        for i in range(len(parts)):
            key = "/".join(parts[i:])
            found = table.get(key)
            if found is not None and found[0] == shape:
                return key
        return None

    def spec_fn(path: str, shape: tuple[int, ...]) -> PartitionSpec:
        key = lookup(path, shape)
        if key is not None:
            return table[key][1]
        if isinstance(default, Plan):
            return default.spec_fn(path, shape)
        return PartitionSpec() if default is None else default

    def unmatched(leaves: Leaves) -> dict[str, str]:
        used = {lookup(path, shape) for path, shape in leaves}
        notes = {
            key: f"sx.from_nnx: annotated variable {key!r} with shape {shape} (spec {spec}) "
            "matches no leaf of the tree by path suffix and shape, so nothing gets its spec"
            for key, (shape, spec) in table.items()
            if key not in used
        }
        if isinstance(default, Plan) and default.unmatched:
            notes.update({f"default {k}": v for k, v in default.unmatched(leaves).items()})
        return notes

    return Plan(mesh, spec_fn, "from_nnx", unmatched=unmatched)
