"""The step's settings in one validated object: [`StepConfig`][shardax.train.StepConfig].

[`shardax.make_train_step`][shardax.make_train_step] and
[`shardax.make_eval_step`][shardax.make_eval_step] build one from their
keywords, and the step keeps it as ``step.config``. Whatever derives a variant of a step
(the auto plan's pick, [`shardax.verify`][shardax.verify]'s one-device reference, the CLI's eval
step) does it with ``dataclasses.replace(step.config, ...)``, which checks the result
again, rather than restating each setting. A new setting is a field here and a keyword
of the two doors.

>>> import dataclasses
>>> mesh = sx.make_mesh({"data": -1})
>>> config = sx.train.StepConfig(mesh=mesh, accumulate=2)
>>> config.mode, config.accumulate, config.donate, config.data_axis
('jit', 2, True, 'data')
>>> dataclasses.replace(config, mode="shard_map").mode
'shard_map'
>>> step = sx.train.TrainStep(lambda model, batch: jnp.mean(model(batch["x"])), config)
>>> step.config is config
True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from shardax.checks import as_bool, as_count, check_mesh, public, public_name
from shardax.data.spec import check_batch_spec
from shardax.mesh.axes import DATA_AXIS
from shardax.plan.core import Plan, axis_size, check_plan_mesh, replicate
from shardax.train.compiler import check as check_compiler_options
from shardax.train.compiler import compile_only, platform_of
from shardax.train.compiler import resolve as resolve_compiler_options
from shardax.train.precision import Precision, resolve
from shardax.train.stats import DEFAULT_STATS, check_stats

MODES: tuple[str, ...] = ("jit", "shard_map", "pmap", "single")


def check_data_axis(data_axis: Any, mesh: Mesh, mode: str) -> str | tuple[str, ...]:
    """``data_axis`` (a mesh axis name, or a tuple of them for HSDP), checked."""
    names = (data_axis,) if isinstance(data_axis, str) else data_axis
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(n, str) for n in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"data_axis must be a mesh axis name or a tuple of distinct names, got {data_axis!r}"
        )
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        which = "" if isinstance(data_axis, str) else f": {', '.join(map(repr, missing))}"
        raise ValueError(
            f"data_axis {data_axis!r}{which} is not in the mesh, whose axes are {dict(mesh.shape)}"
        )
    if mode == "pmap" and len(names) > 1:
        raise ValueError(
            f"mode='pmap' maps over one axis, got data_axis {data_axis!r}; use mode='jit' or "
            "'shard_map' to split the batch over several axes"
        )
    return data_axis if isinstance(data_axis, str) or len(names) > 1 else names[0]


def as_config(config: StepConfig | None, settings: dict[str, Any]) -> StepConfig:
    """``config``, or the [`StepConfig`][shardax.train.StepConfig] built from ``settings`` (not
    both)."""
    if config is None:
        return StepConfig(**settings)
    if settings:
        raise TypeError(
            f"pass the step's settings in config or as keywords, not both; got config and "
            f"{sorted(settings)}"
        )
    if not isinstance(config, StepConfig):
        raise TypeError(f"config must be a sx.train.StepConfig, got {type(config).__name__}")
    return config


def _refuse_plan_factory(plan: Any) -> None:
    """A ``TypeError`` for a function that makes a plan from a mesh (``sx.fsdp``, not
    ``sx.fsdp(mesh)``), which would be called with the state as its mesh."""
    if isinstance(plan, Plan) or not callable(plan):
        return
    try:
        first = next(iter(inspect.signature(plan).parameters), None)
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return
    if first == "mesh":
        name = public_name(plan) or getattr(plan, "__name__", "the plan's function")
        raise TypeError(
            f"plan must be a shardax Plan, got {name}, the function that makes one from a "
            f"mesh: call it, plan={name}(mesh)"
        )


def _set(config: StepConfig, **values: Any) -> None:
    for name, value in values.items():
        object.__setattr__(config, name, value)


class from_config:
    """A read-only attribute of an object holding a [`StepConfig`][shardax.train.StepConfig]
    as ``config``: reads the config's field ``name`` (default: the attribute's own name),
    so the settings are held once, not copied onto the objects built from them.

    >>> class Holder:
    ...     accumulate = from_config()
    ...     microbatches = from_config("accumulate")
    ...     def __init__(self, config): self.config = config
    >>> import shardax as sx
    >>> Holder(StepConfig(mesh=sx.make_mesh({"data": 8}), accumulate=2)).microbatches
    2
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.config, self.name)


@public("sx.train.StepConfig")
@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The settings of a train or eval step, checked once when it is made.

    The fields are [`shardax.make_train_step`][shardax.make_train_step]'s keywords (``loss_fn`` and
    ``plan="auto"`` aside), with its defaults; each is normalized as the step uses it:
    ``precision`` an [`Precision`][shardax.Precision], ``stats`` a tuple, ``data_axis`` a name
    or a tuple of two or more, ``compiler_options`` ``"auto"``, ``"xla"`` or a dict.
    ``plan`` stays as given (None: replicate, see
    [`resolved_plan`][shardax.train.StepConfig.resolved_plan]), and so does
    ``compiler_options`` (resolved for the mesh's platform by
    [`resolved_compiler_options`][shardax.train.StepConfig.resolved_compiler_options]). Derive a
    variant with ``dataclasses.replace``.

    >>> config = sx.train.StepConfig(mesh=sx.make_mesh({"data": -1}), precision="bf16")
    >>> config.precision.compute_dtype
    dtype(bfloat16)
    """

    mesh: Mesh
    plan: Plan | None = None
    mode: str = "jit"
    accumulate: int = 1
    donate: bool = True
    data_axis: str | tuple[str, ...] = DATA_AXIS
    precision: str | Precision = "fp32"
    stats: Sequence[str] = DEFAULT_STATS
    stats_every: int = 1
    seq_axis: str | None = None
    batch_spec: Any = None
    rng_per_device: bool = False
    compiler_options: str | Mapping[str, Any] = "auto"

    def __post_init__(self) -> None:
        # The checks in the order the steps made them, so each error is the one it was.
        _set(self, donate=as_bool("donate", self.donate), stats=check_stats(self.stats))
        _set(self, stats_every=as_count("stats_every", self.stats_every))
        mode, mesh, plan = self.mode, self.mesh, self.plan
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        _set(self, precision=resolve(self.precision))
        check_mesh("mesh", mesh)
        data_axis = check_data_axis(self.data_axis, mesh, mode)
        _set(self, data_axis=data_axis, accumulate=as_count("accumulate", self.accumulate))
        if mode == "single" and plan is not None and getattr(plan, "name", None) != "replicate":
            raise ValueError(
                f"mode='single' keeps the whole state on one device, so it takes no sharding "
                f"plan; got plan {getattr(plan, 'name', plan)!r}. Drop plan= or use mode='jit'"
            )
        plan = self.resolved_plan
        if not callable(plan):
            raise TypeError(
                f"plan must be a shardax Plan (a callable from a tree to its shardings, e.g. "
                f"sx.fsdp(mesh)), got {plan!r}"
            )
        _refuse_plan_factory(plan)
        check_plan_mesh(plan, mesh, "the step's ", f"plan {self.plan_name!r}")
        if mode == "pmap" and axis_size(mesh, data_axis) != mesh.size:
            raise ValueError(
                f"mode='pmap' maps over one axis, but the mesh {dict(mesh.shape)} has devices "
                f"outside data axis {data_axis!r}; use mode='jit' for multi-axis meshes"
            )
        if self.seq_axis is not None and (
            not isinstance(self.seq_axis, str) or self.seq_axis not in mesh.shape
        ):
            raise ValueError(
                f"seq_axis must be a mesh axis name (the axis that splits each sequence, "
                f"e.g. 'context'), one of {dict(mesh.shape)}, or None; got {self.seq_axis!r}"
            )
        if self.seq_axis is not None and mode != "jit":
            raise ValueError(
                f"seq_axis splits the batch's sequence dimension under mode='jit' only; "
                f"got mode={mode!r}"
            )
        _set(self, batch_spec=self._check_batch_spec())
        _set(self, rng_per_device=as_bool("rng_per_device", self.rng_per_device))
        _set(self, compiler_options=check_compiler_options(self.compiler_options))
        resolve_compiler_options(self.compiler_options, self.platform, mode)  # pmap refuses a dict

    def _check_batch_spec(self) -> Any:
        """A batch whose leaves are not examples (``shardax.data.spec``) is placed as
        it says under ``"jit"`` and ``"single"``; the modes that split rows as examples
        refuse it. (Whether ``loss_fn`` takes per-example keys the step checks.)"""
        batch_spec = check_batch_spec(self.batch_spec)
        if batch_spec is None:
            return None
        how = [f"mode={self.mode!r}"] if self.mode in ("shard_map", "pmap") else []
        how += [f"accumulate={self.accumulate}"] if self.accumulate > 1 else []
        how += [f"seq_axis={self.seq_axis!r}"] if self.seq_axis is not None else []
        if how:
            raise ValueError(
                f"batch_spec={batch_spec!r} says the batch's leaves are not examples (a "
                f"graph batch, say), but {' and '.join(how)} splits every leaf's rows as if "
                "they were: each device or microbatch would get rows of every leaf that "
                "do not make whole examples, and train a different model. Use mode='jit' "
                "(any split, computed as one device would) with accumulate=1"
            )
        return batch_spec

    @functools.cached_property
    def resolved_plan(self) -> Any:
        """The plan the step places the state with: ``plan``, or replicate over ``mesh``
        (made once: the config is immutable, so every reader gets the same plan)."""
        return replicate(self.mesh) if self.plan is None else self.plan

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
        return platform_of(self.mesh)

    @functools.cached_property
    def resolved_compiler_options(self) -> dict[str, Any]:
        """The XLA options every jit of the step compiles with: ``compiler_options``
        resolved for the mesh's platform and the mode (``shardax.train.compiler``), and
        for compile-only devices (an ``sx.target``'s)."""
        deviceless = compile_only(self.mesh) is not None
        return resolve_compiler_options(self.compiler_options, self.platform, self.mode, deviceless)

    @property
    def plan_name(self) -> str:
        """The plan's name (its class name for a plan without one)."""
        plan = self.resolved_plan
        return getattr(plan, "name", type(plan).__name__)

    def for_eval(self) -> StepConfig:
        """These settings for the eval step: no donation, no update statistics and no
        loss scaling (it only protects gradients, and evaluation has none)."""
        precision = self.precision._replace(loss_scaling=None)  # type: ignore[union-attr]
        return dataclasses.replace(self, donate=False, stats=(), stats_every=1, precision=precision)
