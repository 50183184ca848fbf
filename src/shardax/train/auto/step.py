"""``make_train_step(..., plan="auto")``: a step whose plan [`auto_plan`][shardax.auto_plan]
picks on the first ``step(state, batch)``.

>>> step = sx.make_train_step(loss_fn, mesh=mesh, plan="auto")
>>> step.plan is None, step.mode
(True, 'jit')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shardax.checks import public
from shardax.train.auto.choice import AutoPlan
from shardax.train.auto.options import AutoPlanOptions, check_auto_step
from shardax.train.auto.search import auto_plan
from shardax.train.compiler import describe as describe_options
from shardax.train.config import StepConfig
from shardax.train.state import TrainState
from shardax.train.step import TrainStep


@public("sx.train.AutoStep")
class AutoStep:
    """A train step whose plan [`auto_plan`][shardax.auto_plan] picks on the first
    ``step(state, batch)``.

    ``make_train_step(..., plan="auto")`` (or ``plan=sx.AutoPlanOptions(...)``) returns
    one. The first call compiles the candidates for that state and batch, keeps the
    report in ``auto_report``, places the state on the winner and runs the
    [`TrainStep`][shardax.train.TrainStep] built with it; later calls go straight to
    that step. ``step.shard`` and ``step.init`` have no batch to decide with, so they
    work only once the plan is picked.
    """

    def __init__(self, loss_fn: Callable[..., Any], options: AutoPlanOptions, **step_kw: Any):
        # Everything the step checks (loss_fn, mesh, accumulate, ...) is checked now,
        # on the settings alone: the step is built once the plan is picked.
        self.config = check_auto_step(loss_fn, StepConfig(plan=None, **step_kw))
        options.check(self.config.mesh)
        self.loss_fn, self.options = loss_fn, options
        self.auto_report: AutoPlan | None = None
        self.step: TrainStep | None = None
        self._unplaced = False  # picked, and no state placed on the plan yet

    def _picked(self, what: str) -> TrainStep:
        if self.step is None:
            raise ValueError(
                f"plan='auto' picks the plan by compiling the step for a state and a batch, "
                f"and {what} has no batch to build abstract values from: pass the unplaced "
                "state to the first step(state, batch), which places it, or pick beforehand "
                "with sx.auto_plan(mesh, init_or_state, loss_fn=..., batch=...).plan"
            )
        return self.step

    def pick(self, state: TrainState, batch: Any) -> TrainStep:
        """The step with the plan picked for ``state`` and ``batch`` (compiling the
        candidates once; ``sx.verify`` calls it). The next ``step(state, batch)`` places
        its state on the plan, as the first call does."""
        if self.step is None:
            config = self.config
            self.auto_report = auto_plan(
                config.mesh,
                state,
                loss_fn=self.loss_fn,
                batch=batch,
                config=config,
                **vars(self.options),
            )
            config = dataclasses.replace(config, plan=self.auto_report.plan)
            self.step = TrainStep(self.loss_fn, config)
            self.step.plan_name = f"auto:{self.auto_report.plan.name}"
            self._unplaced = True
        return self.step

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """Picks the plan on the first call (placing ``state`` on it), then steps."""
        step = self.pick(state, batch)
        if self._unplaced:
            self._unplaced = False
            state = step.shard(state)
        return step(state, batch)

    def shard(self, state: TrainState) -> TrainState:
        """``state`` placed on the picked plan (after the first call)."""
        step = self._picked("step.shard(state)")
        self._unplaced = False
        return step.shard(state)

    def init(self, init_fn: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
        """``init_fn`` run onto the picked plan (after the first call)."""
        return self._picked("step.init(...)").init(init_fn, *args, **kwargs)

    def lower(self, state: TrainState, batch: Any) -> Any:
        """The picked step, lowered (after the first call)."""
        return self._picked("step.lower(...)").lower(state, batch)

    @property
    def plan(self) -> Any:
        """The picked plan (None before the first call)."""
        return None if self.step is None else self.step.plan

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The XLA options the step compiles with (the candidates too), resolved."""
        return self.config.resolved_compiler_options

    @property
    def compiler_summary(self) -> str:
        """The XLA options in a few words, as ``Program``'s."""
        config = self.config
        return describe_options(
            config.compiler_options, self.compiler_options, config.platform, config.mode
        )

    def __getattr__(self, name: str) -> Any:
        # mode, mesh, accumulate, donate, data_axis, precision, stats: as the step's.
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        if self.step is not None:
            return repr(self.step)
        config = self.config
        return (
            f"TrainStep(mode='jit', plan='auto', mesh={dict(config.mesh.shape)}, "
            f"accumulate={config.accumulate}, donate={config.donate}, "
            f"compiler_options={self.compiler_summary})"
        )
