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
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax._extras import is_equinox
from shardax.checks import check_mesh, public
from shardax.plan.core import Leaves, Plan
from shardax.plan.tree import path_str

AxisRules = Mapping[str, Any] | Sequence[tuple[str, Any]]

_AXIS_RULES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "shardax_axis_rules", default=None
)


@contextlib.contextmanager
@public("sx.plan.axis_rules")
def axis_rules(rules: AxisRules) -> Iterator[dict[str, Any]]:
    """Sets the logical-to-mesh axis mapping for [`from_nnx`][shardax.from_nnx] and
    [`constrain`][shardax.constrain].

    It is read when a function is traced and, unlike ``jax.set_mesh``, is not part of
    ``jax.jit``'s cache key: a function already traced under one mapping keeps it, so
    build a new ``jax.jit`` per mapping.

    >>> with sx.plan.axis_rules({"batch": "data", "mlp": "model"}):
    ...     print(current_axis_rules()["mlp"])  # in a model: sx.constrain(h, P("mlp"))
    model
    """
    token = _AXIS_RULES.set(dict(rules))
    try:
        yield _AXIS_RULES.get()
    finally:
        _AXIS_RULES.reset(token)


def current_axis_rules() -> dict[str, Any] | None:
    """The mapping set by the innermost [`axis_rules`][shardax.plan.axis_rules], or ``None``."""
    return _AXIS_RULES.get()


def logical_to_mesh(
    spec: Any, mesh: Any, rules: AxisRules | None = None, where: str = "spec"
) -> PartitionSpec:
    """``spec``'s logical names mapped to mesh axes (names already in the mesh pass through).

    >>> logical_to_mesh(P("batch", "mlp"), mesh, {"batch": "data", "mlp": None})
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


Table = dict[str, tuple[tuple[int, ...], PartitionSpec, str]]
"""``{leaf path: (shape, spec, the box's own leaf path)}``."""


def _boxes_table(
    tree: Any,
    mesh: Mesh,
    axis_rules: AxisRules | None,
    is_box: Any,
    names_of: Any,
    collections: bool = False,
) -> Table:
    """``{leaf path: (shape, spec)}`` for every annotated box (an NNX variable, a Linen
    ``Partitioned`` box) of ``tree``. A box with one leaf is also keyed by its own path
    (so ``kernel`` matches an unboxed tree as ``kernel/value`` matches a boxed one); with
    ``collections``, each top-level collection's boxes are also keyed without its name
    (``params/Dense_0/kernel`` and ``Dense_0/kernel``)."""
    table: Table = {}
    for box_path, box in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        if not is_box(box):
            continue
        names = names_of(box)
        if not names:
            continue
        if isinstance(names, NamedSharding):
            names = names.spec
        where = f"variable {path_str(box_path)!r}"
        spec = logical_to_mesh(names, mesh, _box_rules(box, axis_rules), where)
        leaves = jax.tree_util.tree_flatten_with_path(box)[0]
        for sub_path, leaf in leaves:
            entry = (tuple(np.shape(leaf)), spec, path_str(box_path + sub_path))
            keys = [box_path + sub_path] + ([box_path] if len(leaves) == 1 else [])
            for key in keys:
                table.setdefault(path_str(key), entry)
                if collections and len(key) > 1:
                    table.setdefault(path_str(key[1:]), entry)
    return table


def _box_rules(box: Any, axis_rules: AxisRules | None) -> AxisRules | None:
    """``axis_rules``, else the rules a Linen ``LogicallyPartitioned`` box carries."""
    if axis_rules is not None:
        return axis_rules
    own = getattr(box, "rules", None)
    return dict(own) if own and current_axis_rules() is None else None


def annotated_specs(model: Any, mesh: Mesh, axis_rules: AxisRules | None = None) -> Table:
    """``{leaf path: (shape, PartitionSpec)}`` for every annotated NNX variable in ``model``.

    ``model`` is an NNX module (concrete or from ``nnx.eval_shape``) or its state.
    """
    return _boxes_table(
        model,
        mesh,
        axis_rules,
        lambda x: isinstance(x, nnx.Variable),
        lambda var: var.get_metadata().get("out_sharding"),
    )


def optimizer_sharding(node: Any, specs: Any, mesh: Mesh) -> Any:
    """``specs`` (the specs of ``node``, an optimizer state's mirror of the params) with
    the spec of flax's ``optimizer_sharding`` metadata for each NNX variable of ``node``
    that has it (flax's optimization cookbook: the optimizer state of a variable sharded
    otherwise than the variable). Logical names go through
    [`axis_rules`][shardax.plan.axis_rules]."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def one(var: Any, spec: Any) -> Any:
        names = var.get_metadata().get("optimizer_sharding") if is_var(var) else None
        if not names:
            return spec
        if isinstance(names, NamedSharding):
            names = names.spec
        where = f"optimizer_sharding of a {type(var).__name__}"
        new = logical_to_mesh(names, mesh, None, where)
        return jax.tree.map(lambda _: new, spec, is_leaf=lambda x: isinstance(x, PartitionSpec))

    return jax.tree.map(one, node, specs, is_leaf=is_var)


def linen_specs(variables: Any, mesh: Mesh, axis_rules: AxisRules | None = None) -> Table:
    """``{leaf path: (shape, PartitionSpec)}`` for every ``nn.Partitioned`` box (made by
    ``nn.with_partitioning`` or ``nn.with_logical_partitioning``) in ``variables``."""
    return _boxes_table(
        variables,
        mesh,
        axis_rules,
        lambda x: isinstance(x, nn.Partitioned),
        lambda box: box.names if any(n is not None for n in box.names) else None,
        collections=isinstance(variables, Mapping),
    )


def found_framework(tree: Any) -> str:
    """What kind of model ``tree`` is, in words, for a warning that found no annotation."""
    kinds = (nnx.Module, nnx.Variable, nn.Partitioned)
    nodes = [tree, *jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kinds))]
    if any(isinstance(x, nn.Partitioned) for x in nodes):
        return "Flax Linen boxes (nn.Partitioned / nn.LogicallyPartitioned): use sx.from_linen"
    if any(isinstance(x, nnx.Module | nnx.Variable) for x in nodes):
        return (
            "Flax NNX variables, none annotated: give them logical names with "
            "nnx.with_partitioning(init, names) and use sx.from_nnx, or use sx.fsdp / sx.rules"
        )
    if is_equinox(tree):
        return "an Equinox module, which has no sharding annotations: use sx.fsdp or sx.rules"
    return "a plain pytree, which has no sharding annotations: use sx.fsdp or sx.rules"


def _annotation_plan(
    name: str, mesh: Mesh, table: Table, default: PartitionSpec | Plan | None, tree: Any
) -> Plan:
    """The plan giving each leaf the spec of the annotated box whose path is the longest
    "/"-suffix of the leaf's path and whose shape is the leaf's shape, else ``default``."""
    if isinstance(default, Plan) and default.mesh != mesh:
        raise ValueError(f"default plan {default.name!r} is on another mesh than {name}'s")
    if not table:
        warnings.warn(
            f"sx.{name}: no variable of the tree has a sharding annotation, so every leaf "
            f"gets the default ({'replicated' if default is None else default}); found "
            f"{found_framework(tree)}",
            UserWarning,
            stacklevel=3,
        )

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
        used = {table[key][2] for key in (lookup(p, s) for p, s in leaves) if key is not None}
        notes = {
            box: f"sx.{name}: annotated variable {box!r} with shape {shape} (spec {spec}) "
            "matches no leaf of the tree by path suffix and shape, so nothing gets its spec"
            for shape, spec, box in table.values()
            if box not in used
        }
        if isinstance(default, Plan) and default.unmatched:
            notes.update({f"default {k}": v for k, v in default.unmatched(leaves).items()})
        return notes

    return Plan(mesh, spec_fn, name, unmatched=unmatched)


@public("sx.from_nnx")
def from_nnx(
    mesh: Mesh,
    model: Any,
    axis_rules: AxisRules | None = None,
    default: PartitionSpec | Plan | None = None,
) -> Plan:
    """A plan from the ``out_sharding`` annotations of ``model``'s NNX variables.

    ``axis_rules`` maps each logical name to a mesh axis, a tuple of axes, or ``None``
    (replicate); a name that is already a mesh axis may be left out. Default: the
    mapping set by [`axis_rules`][shardax.plan.axis_rules]. A leaf gets the
    spec of the annotated variable whose path is the longest "/"-suffix of the leaf's
    path and whose shape is the leaf's shape, so the plan applies to the model, its
    ``nnx.state``, a train state holding it, and Adam's ``mu``/``nu`` alike. Other
    leaves get ``default`` (a ``PartitionSpec``, a plan on the same mesh, or ``None``
    to replicate). A tree with no annotation at all is warned about, naming what it is
    (Linen boxes, an Equinox module...).

    With logical names, build the model with ``nnx.use_eager_sharding(False)`` (flax
    otherwise shards variables at creation and needs its own mesh and rules).
    """
    check_mesh("mesh", mesh)
    table = annotated_specs(model, mesh, axis_rules)
    return _annotation_plan("from_nnx", mesh, table, default, model)


@public("sx.from_linen")
def from_linen(
    mesh: Mesh,
    variables: Any,
    axis_rules: AxisRules | None = None,
    default: PartitionSpec | Plan | None = None,
) -> Plan:
    """A plan from the ``nn.LogicallyPartitioned`` (and ``nn.Partitioned``) boxes of a
    Linen model's variables, as [`from_nnx`][shardax.from_nnx] does for NNX.

    ``variables`` is ``module.init(...)``'s result (or ``jax.eval_shape`` of it, or its
    ``"params"``), built with ``nn.with_logical_partitioning(init, names)``; ``axis_rules``
    maps the logical names to mesh axes (default: [`axis_rules`][shardax.plan.axis_rules]' mapping,
    else
    the rules a box carries). The plan matches leaves by path suffix and shape, so it
    applies to the variables, their ``"params"``, a ``flax.training`` train state, a
    shardax ``TrainState`` and Adam's ``mu``/``nu``, boxed (paths ending in ``/value``)
    or unboxed (``nn.unbox``).

    >>> import flax.linen as nn
    >>> dense = nn.Dense(32, kernel_init=nn.with_logical_partitioning(
    ...     nn.initializers.lecun_normal(), ("embed", "mlp")))
    >>> variables = jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((1, 16)))
    >>> plan = sx.from_linen(sx.make_mesh({"data": 4, "model": 2}), variables,
    ...                      {"embed": None, "mlp": "model"})
    >>> specs = plan.specs(nn.unbox(variables))["params"]
    >>> specs["kernel"]
    P(None, 'model')
    """
    check_mesh("mesh", mesh)
    table = linen_specs(variables, mesh, axis_rules)
    return _annotation_plan("from_linen", mesh, table, default, variables)
