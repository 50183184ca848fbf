"""Optimizer state follows the params: Adam's ``mu``/``nu`` get their param's sharding.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 4, "model": 2})
>>> params = {"w": np.zeros((8, 8))}
>>> state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
>>> plan = sx.plan.follow_params(sx.rules(mesh, [("^params/w$", P(None, "model"))]))
>>> plan.specs(state)["opt_state"][0].mu["w"], plan.specs(state)["opt_state"][0].count
(P(None, 'model'), P())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from shardax.checks import expect_type, public
from shardax.plan.annotations import optimizer_sharding
from shardax.plan.core import Plan, array_paths, leaf_spec
from shardax.plan.specs import spec_errors
from shardax.plan.tree import is_array, map_arrays, path_str

ParamsSelector = str | Callable[[Any], Any]


def select(tree: Any, where: ParamsSelector) -> Any:
    """The subtree of ``tree`` at a "/"-joined path of keys, indices or attributes."""
    if callable(where):
        return where(tree)
    node = tree
    for part in where.split("/"):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, Sequence) and not isinstance(node, str) and part.isdigit():
            node = node[int(part)]
        elif hasattr(node, part):
            node = getattr(node, part)
        else:
            raise ValueError(
                f"params={where!r}: no {part!r} in the {type(node).__name__} of the tree; pass "
                "the path of the params subtree (e.g. 'params' or 'model') or a function"
            )
    # An attribute that is no child of the tree (a property such as TrainState.model)
    # would hand the plan something it cannot place: its leaves must be the tree's own.
    own = {id(x) for x in jax.tree.leaves(tree)}
    leaves = jax.tree.leaves(node)
    if not leaves or not all(id(x) in own for x in leaves):
        raise ValueError(
            f"params={where!r} selects a {type(node).__name__} that is not a subtree of "
            f"arrays of the tree (a computed attribute, or an empty one); pass the path of "
            f"the params subtree, e.g. 'params'"
        )
    return node


def check_selector(name: str, params: Any) -> ParamsSelector:
    """``params`` if it is a "/"-joined path or a function, else ``TypeError``."""
    if isinstance(params, str) or callable(params):
        return params
    return expect_type(name, params, str, "a '/'-joined path such as 'params' or a function")


@dataclasses.dataclass(frozen=True)
class FollowParams(Plan):
    """A plan whose params subtree, and every subtree of the same structure and shapes
    (Adam's ``mu`` and ``nu``, momentum...), gets the params' specs, or ``mirror``'s
    specs for the params' paths when it is given ([`shardax.zero1`][shardax.zero1]). Made by
    [`follow_params`][shardax.plan.follow_params], [`shardax.zero1`][shardax.zero1] and
    [`shardax.zero2`][shardax.zero2]."""

    base: Plan | None = None
    params: ParamsSelector = "params"
    mirror: Plan | None = None
    """The plan of the subtrees that mirror the params (default: ``base``'s specs)."""
    shard_grads: bool = False
    """Whether the train step constrains the gradients to the mirrors' shardings
    ([`shardax.zero2`][shardax.zero2])."""
    gather: str = "update"
    """ZeRO's gather of the params: ``"update"`` (the params placed by ``base``, the
    updated ones gathered back to it after the update) or ``"forward"`` (the params
    placed as their mirrors, the train step gathers their compute-dtype copy at its
    start: [`shardax.zero1`][shardax.zero1])."""

    def _unmatched(self, tree: Any) -> dict[str, str]:
        # With a function selector the rules see the params' paths relative to the params.
        if self.unmatched is None:
            return {}
        leaves = array_paths(tree)
        if callable(self.params):
            leaves += array_paths(select(tree, self.params))
        return self.unmatched(leaves)

    def resolve(self, tree: Any) -> tuple[Any, list[str]]:
        assert self.base is not None
        base, errors = self.base, []

        def spec(path: str, leaf: Any) -> PartitionSpec:
            s = leaf_spec(base.spec_fn, path, leaf)
            errors.extend(spec_errors(path, tuple(np.shape(leaf)), s, self.mesh))
            return s

        params = select(tree, self.params)
        # The params' own paths in the tree, so a rule sees the same path with or
        # without follow_params (a function selector gives paths relative to the params).
        prefix = f"{self.params}/" if isinstance(self.params, str) else ""
        param_specs = map_arrays(lambda p, x: spec(prefix + p, x), params)
        mirror_specs = param_specs
        if self.mirror is not None:
            mirror_specs = self.mirror_specs(params)
            map_arrays(
                lambda p, x, s: errors.extend(spec_errors(p, np.shape(x), s, self.mesh)),
                params,
                mirror_specs,
            )
            if self.gathers_forward:  # the params kept split as their mirrors (the master)
                param_specs = mirror_specs
        treedef = jax.tree.structure(params)
        shapes = [np.shape(x) for x in jax.tree.leaves(params)]

        def mirrors(node: Any) -> bool:
            if jax.tree.structure(node) != treedef:
                return False
            return [np.shape(x) for x in jax.tree.leaves(node)] == shapes

        flat, outer = jax.tree_util.tree_flatten_with_path(tree, is_leaf=mirrors)
        out = []
        for path, node in flat:
            if mirrors(node) and node is params:
                out.append(param_specs)
            elif mirrors(node):
                out.append(optimizer_sharding(node, mirror_specs, self.mesh))
            elif is_array(node):
                out.append(spec(path_str(path), node))
            else:
                out.append(node)
        return jax.tree.unflatten(outer, out), errors

    @property
    def gathers_forward(self) -> bool:
        """Whether the params are kept split and gathered at the step's start
        (``gather="forward"``)."""
        return self.gather == "forward"

    def grad_specs(self, params: Any) -> Any:
        """The specs of the gradients the step hands the optimizer: the mirrors' under
        ZeRO-2, else the ``base`` plan's for the params (whole under ZeRO-1, gathered
        forward or not)."""
        return self._specs_by(self.mirror if self.shard_grads else None, params)

    def mirror_specs(self, params: Any) -> Any:
        """The specs of a tree that mirrors ``params`` (Adam's ``mu``, the gradients)."""
        return self._specs_by(self.mirror, params)

    def _specs_by(self, plan: Plan | None, params: Any) -> Any:
        """``plan``'s specs (``base``'s when None) for the params' paths in the tree."""
        plan = plan if plan is not None else self.base
        assert plan is not None
        prefix = f"{self.params}/" if isinstance(self.params, str) else ""

        def one(path: str, leaf: Any) -> PartitionSpec:
            return leaf_spec(plan.spec_fn, prefix + path, leaf)

        return map_arrays(one, params)


@public("sx.plan.follow_params")
def follow_params(plan: Plan, params: ParamsSelector | None = None) -> Plan:
    """Wraps ``plan`` so optimizer state is sharded like the params, whatever the plan;
    a plan that already follows them (``follow_params``'s, ``sx.zero1``'s) is returned as
    it is, so wrapping twice is wrapping once.

    ``params`` locates the params in the state (a "/"-joined path of keys or attributes,
    or a function of the state; default ``"params"``, or the following plan's own). The
    params get ``plan``'s specs for their paths in the state (``params/layers/0/kernel``;
    relative to the params with a function); every other subtree with the params'
    structure and shapes (optax's ``mu``, ``nu``, ``trace``...) gets the same specs;
    rank-0 leaves (``count``) are replicated; any other leaf gets ``plan``'s spec for its
    own path.
    """
    expect_type("plan", plan, Plan, "a shardax Plan such as sx.fsdp(mesh)")
    if isinstance(plan, FollowParams):
        same = params is None or params == plan.params
        return plan if same else dataclasses.replace(plan, params=check_selector("params", params))
    params = "params" if params is None else check_selector("params", params)
    return FollowParams(
        plan.mesh,
        plan.spec_fn,
        f"{plan.name}+follow_params",
        plan,
        params,
        unmatched=plan.unmatched,
        warned=plan.warned,
    )
