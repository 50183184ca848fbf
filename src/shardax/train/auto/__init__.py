"""The auto-planning search, by concept: ``options`` (what may be ranked on one mesh),
``space`` (the search space: meshes, plans, variants, counts, the step's settings),
``candidates`` (each compiled and analysed once), ``choice`` (the ranking, the pick, its
flags and launch command), ``search`` ([`auto_plan`][shardax.auto_plan],
[`search_plans`][shardax.search_plans]) and ``step`` (``plan="auto"``'s
[`AutoStep`][shardax.train.AutoStep])."""

from shardax.train.auto.candidates import (
    Candidate,
    abstract,
    compile_candidates,
    measure,
    refused_candidate,
)
from shardax.train.auto.choice import (
    AutoPlan,
    choose,
    default_device_memory,
    launch_command,
    train_flags,
)
from shardax.train.auto.options import (
    AutoPlanOptions,
    candidate_plans,
    check_accumulate,
    check_candidates,
    check_options,
    check_stage_axis,
)
from shardax.train.auto.search import auto_plan, search_plans
from shardax.train.auto.space import Layout, SearchSpace
from shardax.train.auto.step import AutoStep

__all__ = [
    "AutoPlan",
    "AutoPlanOptions",
    "AutoStep",
    "Candidate",
    "Layout",
    "SearchSpace",
    "abstract",
    "auto_plan",
    "candidate_plans",
    "check_accumulate",
    "check_candidates",
    "check_options",
    "check_stage_axis",
    "choose",
    "compile_candidates",
    "default_device_memory",
    "launch_command",
    "measure",
    "refused_candidate",
    "search_plans",
    "train_flags",
]
