"""Your own step function's side of verify (the keep-your-loop path).

``verify(train_step, (model, optimizer), batch)`` runs the function on copies of the
state, placed as given and on the first device (or ``reference=``, your own one-device
step). A functional step returns the new state first (``(state, metrics)`` or
``(*state, metrics)``); an NNX step updates its arguments in place and returns its
metrics. An ``nnx.Optimizer`` among them hands verify the gradients (``recording``);
otherwise the update is judged at its noise floor (``noise``).

>>> @jax.jit
... def sgd_step(params, batch):
...     grads = jax.grad(lambda p: jnp.mean((batch["x"] @ p - batch["y"]) ** 2))(params)
...     return params - 0.1 * grads, {"grad_norm": jnp.linalg.norm(grads)}
>>> side = FunctionSide(sgd_step, jnp.ones((4, 2)), {"x": np.ones((8, 4)), "y": np.zeros((8, 2))})
>>> run = side.step()
>>> sorted(run.got), side.updated("state/0"), side.second(run)
(['returned', 'state'], True, None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.training.optimizer import OptState
from jax.sharding import Mesh, NamedSharding

from shardax.plan.tree import is_key, path_str
from shardax.train.verification.comparison import TOLERANCES
from shardax.train.verification.noise import noise_floor, unread
from shardax.train.verification.per_device import Slices
from shardax.train.verification.reads import reached
from shardax.train.verification.recording import applied, optimizer_view, recorded, recorded_pairs
from shardax.train.verification.reference import Reference, one_device_mesh
from shardax.train.verification.rows import devices_over_rows, rows
from shardax.train.verification.side import Run
from shardax.train.verification.user_state import arrays, copied, fresh, has_batchnorm, is_graph

RECORDED = (
    "what the step returned, the gradients its nnx.Optimizer was given and the "
    "non-trainable state against one device's over the whole batch; the params and "
    "optimizer state against one device's, or, where they differ, against the "
    "optimizer applied on one device to the distributed gradients"
)
"""What verify compares for a step whose ``nnx.Optimizer`` hands it the gradients."""

FLOORED = (
    "what the step returned and the updated state against one device's over the whole "
    "batch; where an updated leaf differs, at a tolerance raised to twice the spread of "
    "the one-device step itself over row-permuted copies of the batch (the same "
    "examples, another order of the sums: rounding noise an optimizer like Adam "
    "amplifies), used only when the permutations leave what the step returns unchanged"
)
"""What verify compares for a step whose optimizer it cannot see."""


REJITTED = (
    "the reference is {name}'s function jitted again without its shardings (they name "
    "the mesh's devices), on the first device"
)
"""What the reference is for a ``jax.jit`` step bound to its mesh by its shardings."""

_BOUND = (
    "Received incompatible devices for jitted computation",
    "Sharding passed to jit does not match the sharding",
)


def bound_to_devices(error: Exception) -> bool:
    """Whether JAX refused the reference's call for devices or shardings its program
    names (a ``jax.jit`` with the mesh's ``in_shardings``, a constraint on the mesh)."""
    return any(text in str(error) for text in _BOUND)


def unbound(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """A ``jax.jit`` step's own function jitted again with no shardings, else None."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None or not hasattr(fn, "lower"):
        return None
    return jax.jit(inner)


def _bound_message(name: str, mesh: Mesh | None, error: Exception) -> str:
    size = f"{mesh.size}-device " if mesh is not None else ""
    return (
        f"the step {name} is bound to its {size}mesh's devices (a sharding or constraint "
        "in its body names them), so verify cannot run it on one device as the "
        "reference: pass reference=, the same step for one device (e.g. built with the "
        "mesh sx.train.verification.one_device_mesh(mesh), or with no shardings). "
        f"JAX: {str(error).splitlines()[0]}"
    )


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh of the first array of ``tree`` placed on a named sharding."""
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def spread(state: Any) -> tuple[Any, ...]:
    """The step's state arguments: a plain tuple is spread (``fn(*state, batch)``, e.g.
    ``(model, optimizer)``); anything else is one argument, a ``NamedTuple`` included (a
    Haiku-style ``TrainingState(params, opt_state)`` is one state, as ``sx.prepare``,
    ``sx.keep_plan`` and ``sx.loop.run`` take it).

    >>> from typing import NamedTuple
    >>> class TrainingState(NamedTuple):
    ...     params: Any
    ...     step: Any
    >>> len(spread((1, 2))), len(spread(TrainingState(1, 2)))
    (2, 1)
    """
    return state if type(state) is tuple else (state,)


def split_out(out: Any, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """``(state after the step, what else it returned)``: a functional step returns the
    new state first (``(state, metrics)`` or ``(*state, metrics)``, a plain tuple); an NNX
    step updates its arguments in place and returns its metrics."""
    n = len(args)
    if not is_graph(args) and type(out) is tuple and len(out) > n:
        head = out[:n]
        if jax.tree.structure(head) == jax.tree.structure(args):
            rest = out[n:]
            return head, rest[0] if len(rest) == 1 else rest
    return args, out


def tolerance_of(args: Any) -> tuple[float, float]:
    """``(rtol, atol)`` by the state's dtypes: the lowest precision among its leaves."""
    dtypes = {
        jnp.dtype(x.dtype)
        for x in jax.tree.leaves(arrays(args))
        if hasattr(x, "dtype") and not is_key(x)
    }
    if jnp.dtype(jnp.float16) in dtypes:
        return TOLERANCES["fp16"]
    if jnp.dtype(jnp.bfloat16) in dtypes:
        return TOLERANCES["bf16"]
    return TOLERANCES["fp32"]


def _shown(tree: Any) -> str:
    text = str(jax.tree.structure(tree))
    return text if len(text) <= 300 else text[:297] + "..."


def check_structure(got: Any, want: Any, given: bool) -> None:
    """Refuses a reference (or a one-device run) that returned another structure than the
    distributed step: its leaves could not be compared."""
    if jax.tree.structure(got) == jax.tree.structure(want):
        return
    paths = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)}
    other = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)}
    only = sorted(paths - other)[:3] or sorted(other - paths)[:3]
    who = "reference=" if given else "the step on one device"
    raise ValueError(
        f"{who} must return the structure the distributed step returns (its state and what "
        f"else it returns), so that every leaf is compared; the step gave {_shown(got)} and "
        f"{who} gave {_shown(want)} (first differing leaves: {', '.join(only) or '-'})"
    )


class FunctionSide:
    """Your own step function as a ``Side``; ``run.start`` is a copy of the state the step
    started from."""

    precision = "the state's dtype"

    def __init__(
        self,
        fn: Callable[..., Any],
        state: Any,
        batch: Any,
        reference: Callable[..., Any] | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        args = spread(state)
        mesh = mesh or mesh_of(arrays(args)) or mesh_of(batch)
        mesh1 = one_device_mesh(mesh) if mesh is not None else None
        self.reference = Reference.on(mesh1, mesh, batch)
        self.reference.check_fits(arrays(args), batch)
        self.what = getattr(fn, "__name__", type(fn).__name__)
        self.batch, self._rbatch, self._mesh = batch, self.reference.put(batch), mesh
        self._fn, self._ref, self._given = fn, reference or fn, reference is not None
        self.tolerance = tolerance_of(args)
        self._state = args
        self._args = copied(args, fresh)  # the user's step may donate: never the original
        self._recorded = bool(recorded(self._args))
        self.judged = RECORDED if self._recorded else FLOORED
        self._rest = self._not_optimized() if self._recorded else None

    def _not_optimized(self) -> Any:
        """The filter of the state's variables neither optimized nor optimizer state."""
        wrt = nnx.Any(OptState, *[opt.wrt for opt, _ in recorded_pairs(self._args)])
        return nnx.Not(wrt)

    def _observe(self, args: tuple[Any, ...], out: Any) -> dict[str, Any]:
        seen = {"returned": out, "state": arrays(args, self._rest)}
        if self._recorded:
            seen["optimizer"] = optimizer_view(recorded_pairs(args))
        return seen

    def _distributed(self, start: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        out = self._fn(*start, self.batch)
        if out is None and not is_graph(start):  # nothing came back and nothing changed
            raise ValueError(
                f"step {self.what} returned None, but its state holds no NNX object to "
                "update in place (only arrays), so the state comes back unchanged and "
                "verify would compare nothing; a functional step returns the new state "
                "first: (state, metrics)"
            )
        return split_out(out, start)

    def _on_one(self, start: tuple[Any, ...], batch: Any) -> dict[str, Any]:
        """The reference step on a copy of ``start`` on the device, over ``batch``
        (placed there). A ``jax.jit`` step bound to its mesh's devices (its shardings)
        is re-jitted once without them (``unbound``); one bound in its body is refused,
        naming ``reference=``."""
        while True:
            copy = copied(start, self.reference.copy)
            try:
                out = self.reference(lambda c=copy: split_out(self._ref(*c, batch), c))
            except ValueError as e:
                if self._given or not bound_to_devices(e):
                    raise
                rebuilt = unbound(self._fn) if self._ref is self._fn else None
                if rebuilt is None:
                    raise ValueError(_bound_message(self.what, self._mesh, e)) from None
                self._ref = rebuilt
                self.judged = f"{self.judged}; {REJITTED.format(name=self.what)}"
                continue
            return self._observe(*out)

    def step(self) -> Run:
        # The state the step gave last (a copy of yours at first) is the start, kept as it
        # is: the step runs on a copy of it (it may donate, or update NNX objects in place)
        # and every later use copies it again (the reference, the reruns), so one copy a
        # step, not two.
        start = self._args
        self._args, out = self._distributed(copied(start, fresh))
        got, want = self._observe(self._args, out), self._on_one(start, self._rbatch)
        check_structure(got, want, self._given)
        return Run(start, got, want)

    def updated(self, path: str) -> bool:
        if not self._recorded:
            return path.startswith("state/")
        parts = path.split("/")
        return parts[0] == "optimizer" and len(parts) > 2 and parts[2] in ("params", "opt_state")

    def second(self, run: Run) -> dict[str, Any] | None:
        if not self._recorded:
            return None
        before = recorded_pairs(self.reference(copied, run.start, self.reference.copy))
        grads = {i: self.reference.put(v["grads"]) for i, v in run.got["optimizer"].items()}
        update = self.reference(applied, before, grads)
        want = run.want["optimizer"]
        return {**run.want, "optimizer": {i: {**want[i], **update[i]} for i in want}}

    def floor(self, run: Run, rtol: float, atol: float) -> dict[str, float] | None:
        def reference(batch: Any) -> dict[str, Any]:
            return self._on_one(run.start, self.reference.put(batch))

        return None if self._recorded else noise_floor(reference, self.batch, run.want, rtol, atol)

    def unread(self, run: Run, paths: list[str], rtol: float, atol: float) -> set[str]:
        if self._recorded or is_graph(self._args):
            return set()  # recorded: judged from the gradients; NNX objects: not shifted
        if not self._read_elsewhere(run.start, set(paths)):
            return set()  # carried along, not read: its difference is the step's own
        reference = lambda start: self._on_one(start, self._rbatch)  # noqa: E731
        return unread(reference, run.start, run.want, paths, rtol, atol)

    def _read_elsewhere(self, start: tuple[Any, ...], paths: set[str]) -> bool:
        """Whether the step reads each leaf of ``paths`` (``state/...``): it reaches an
        output other than the leaf's own new value (the loss, another leaf's update),
        in the reference's jaxpr (``reads.reached``)."""
        flat = jax.tree_util.tree_flatten_with_path(start)[0]
        names = [f"state/{path_str(p)}" for p, _ in flat]
        inputs = [i for i, name in enumerate(names) if name in paths]
        if len(inputs) != len(paths):
            return False
        fn = lambda state, batch: self._ref(*state, batch)  # noqa: E731
        try:
            copy = copied(start, self.reference.copy)
            reach = self.reference(lambda: reached(fn, (copy, self._rbatch), inputs))
            out = self.reference(lambda: jax.eval_shape(fn, copy, self._rbatch))
        except Exception:  # a step make_jaxpr cannot trace gives no evidence
            return False
        outs = [f"state/{path_str(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
        return all(
            any(hit and outs[j] != names[i] for j, hit in enumerate(row))
            for i, row in zip(inputs, reach, strict=True)
        )

    def rerun(self, run: Run) -> dict[str, Any]:
        return self._observe(*self._distributed(copied(run.start, fresh)))

    def accumulated(self, run: Run) -> None:
        return None

    def reseeded(self, run: Run) -> None:
        return None

    slices_may_fail = True  # the user's function may take one batch size only

    def slices(self, run: Run) -> Slices:
        keep = ("returned", "optimizer") if self._recorded else ("returned", "state")

        def picked(seen: dict[str, Any]) -> dict[str, Any]:
            out = {k: seen[k] for k in keep}
            if self._recorded:
                out["optimizer"] = {i: {"grads": v["grads"]} for i, v in out["optimizer"].items()}
            return out

        def run_slice(part: Any) -> Any:
            return picked(self._on_one(run.start, self.reference.put(part)))

        def reordered() -> Any:
            flipped = self.reference.put(rows(self.batch, lambda x: x[::-1]))
            return {"returned": self._on_one(run.start, flipped)["returned"]}

        n = devices_over_rows(self.batch, self._mesh)
        batchnorm = has_batchnorm(self._state)
        return Slices(run_slice, reordered, n, picked(run.got), picked(run.want), batchnorm)
