"""The train step's side of verify: its own program, on its mesh and on one device.

Both sides run the step's program (its loss function, plan, mode and precision), built
without donation and returning the unscaled gradients, the loss and the aux metrics
beside the updated state; the reference is jit on the one-device mesh, replicated, and
never accumulates: one device, the whole batch. The programs are kept while the step
lives, so verifying it again compiles nothing new for the same shapes.

>>> side = TrainStepSide(step, state, {"x": np.ones((16, 4)), "y": np.zeros((16, 2))})
>>> run = side.step()
>>> sorted(run.got) == sorted(run.want)
True
>>> sorted(run.got)
['grads', 'loss_scale', 'metrics', 'model_state', 'opt_state', 'params']
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
from jax.sharding import Mesh

from shardax.plan.core import axis_size
from shardax.plan.tree import is_key
from shardax.train.precision import policy_name, unscale
from shardax.train.rng import fold_in_each
from shardax.train.state import TrainState
from shardax.train.step import TrainStep
from shardax.train.verification.comparison import tolerance
from shardax.train.verification.per_device import Slices
from shardax.train.verification.reference import Reference, one_device_mesh
from shardax.train.verification.rows import rows
from shardax.train.verification.side import Run

JUDGED = (
    "the loss, aux metrics, gradients and model state against one device's over the whole "
    "batch; the params and optimizer state against one device's, or, where they differ, "
    "against the optimizer applied on one device to the distributed gradients"
)
"""What a train step's verification compares, in words."""

UPDATE = ("params", "opt_state", "loss_scale")
"""The leaves of the update: judged a second way."""


class _Probe(TrainStep):
    """The train step's program, not donating, returning the unscaled gradients, the
    loss and the aux metrics beside the updated state."""

    def finish(self, state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any):
        new, metrics = super().finish(state, grads, loss, aux, model_state)
        if self._scaling is not None:
            grads = unscale(grads, state.loss_scale)
        return new, {"metrics": metrics, "grads": grads}

    @classmethod
    def like(cls, step: TrainStep, mesh: Mesh | None = None, accumulate: int = 1) -> _Probe:
        """The probe of ``step``; with ``mesh``, the reference: jit on that (one-device)
        mesh, replicated, with ``accumulate`` (one device over the whole batch: 1)."""
        one = mesh is not None
        config = dataclasses.replace(
            step.config, donate=False, stats=(), stats_every=1, batch_spec=None
        )
        if one:
            config = dataclasses.replace(
                config, mesh=mesh, plan=None, mode="jit", accumulate=accumulate, seq_axis=None
            )
        return cls(step.loss_fn, config)


_PROBES: weakref.WeakKeyDictionary[TrainStep, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _probes(step: TrainStep) -> dict[Any, Any]:
    """The programs verify builds for ``step``, kept while the step lives."""
    cached = _PROBES.get(step)
    if cached is None:
        mesh1 = one_device_mesh(step.mesh)
        ref = _Probe.like(step, mesh1)
        cached = _PROBES[step] = {
            "mesh1": mesh1,
            "dist": _Probe.like(step),
            "ref": ref,
            "update": jax.jit(ref.update),
        }
    return cached


def _observed(state: TrainState, out: dict[str, Any]) -> dict[str, Any]:
    """What distribution can change: the metrics, the gradients, the model state, and
    the update."""
    return {
        "metrics": out["metrics"],
        "grads": out["grads"],
        "model_state": state.model_state,
        **_update(state),
    }


def _update(state: TrainState) -> dict[str, Any]:
    return {"params": state.params, "opt_state": state.opt_state, "loss_scale": state.loss_scale}


def _fold_keys(tree: Any) -> Any:
    """Every typed key of ``tree`` (a key array of a layer-stacked stream key by key)
    with 1 folded in: another seed of the model's own generators."""
    return jax.tree.map(lambda x: fold_in_each(x, 1) if is_key(x) else x, tree)


class TrainStepSide:
    """A [`TrainStep`][shardax.train.TrainStep] as a ``Side``; ``run.start`` is
    ``(the distributed state, the reference's copy of it)``."""

    judged = JUDGED

    def __init__(self, step: TrainStep, state: TrainState, batch: Any) -> None:
        self._step, self.batch, self._probes = step, batch, _probes(step)
        self.what = repr(step)
        self.tolerance = tolerance(step.precision)
        self.precision = policy_name(step.precision)
        self.reference = Reference.on(self._probes["mesh1"], step.mesh, batch)
        self._dstate = self._probes["dist"].shard(state)
        self.reference.check_fits(state, batch)
        self._rbatch = self.reference.put(batch)

    def step(self) -> Run:
        dist, ref = self._probes["dist"], self._probes["ref"]
        rstart = self.reference(ref.shard, self._dstate)  # both sides start from one state
        dnew, dout = dist(self._dstate, self.batch)
        rnew, rout = self.reference(ref, rstart, self._rbatch)
        run = Run((self._dstate, rstart), _observed(dnew, dout), _observed(rnew, rout))
        self._dstate = dnew
        return run

    def updated(self, path: str) -> bool:
        return path.split("/")[0] in UPDATE

    def second(self, run: Run) -> dict[str, Any]:
        grads, model_state = self.reference.put((run.got["grads"], run.got["model_state"]))
        update = self.reference(self._probes["update"], run.start[1], grads, model_state)
        return {**run.want, **_update(update)}

    def floor(self, run: Run, rtol: float, atol: float) -> None:
        return None

    def unread(self, run: Run, paths: list[str], rtol: float, atol: float) -> set[str]:
        return set()  # the update is judged from the gradients (second)

    def rerun(self, run: Run) -> dict[str, Any]:
        return _observed(*self._probes["dist"](run.start[0], self.batch))

    def accumulated(self, run: Run) -> dict[str, Any] | None:
        if self._step.accumulate <= 1:
            return None
        same = self._probes.get("accumulated")
        if same is None:
            same = _Probe.like(self._step, self._probes["mesh1"], self._step.accumulate)
            self._probes["accumulated"] = same
        new, out = self.reference(same, run.start[1], self._rbatch)
        return {k: v for k, v in _observed(new, out).items() if k not in UPDATE}

    def reseeded(self, run: Run) -> dict[str, Any] | None:
        if self._step.mode not in ("shard_map", "pmap"):
            return None
        rstart = run.start[1]
        key = jax.random.fold_in(jax.random.wrap_key_data(rstart.rng), 1)
        other = rstart.replace(
            rng=jax.random.key_data(key), model_state=_fold_keys(rstart.model_state)
        )
        return {"metrics": self.reference(self._probes["ref"], other, self._rbatch)[1]["metrics"]}

    slices_may_fail = False  # a shardax step runs on any rows: an error is a bug

    def slices(self, run: Run) -> Slices | None:
        if self._step.mode not in ("shard_map", "pmap"):
            return None
        ref, rstart = self._probes["ref"], run.start[1]

        def run_slice(part: Any) -> Any:
            out = self.reference(ref, rstart, self.reference.put(part))[1]
            return {"metrics": out["metrics"], "grads": out["grads"]}

        def reordered() -> Any:
            flipped = self.reference.put(rows(self.batch, lambda x: x[::-1]))
            return {"metrics": self.reference(ref, rstart, flipped)[1]["metrics"]}

        loss_and_grads = ("metrics", "grads")
        return Slices(
            run_slice,
            None if "rng" in self._step._filled else reordered,
            axis_size(self._step.mesh, self._step.data_axis),
            {k: run.got[k] for k in loss_and_grads},
            {k: run.want[k] for k in loss_and_grads},
        )
