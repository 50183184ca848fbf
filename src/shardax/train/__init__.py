"""Train layer: TrainState, the train step, collectives, metrics and the data-parallel facade."""

from shardax.train.auto import AutoPlan, AutoPlanOptions, Candidate, auto_plan
from shardax.train.collectives import (
    all_gather,
    all_reduce,
    bound_axes,
    reduce,
    require_bound,
    weighted_mean,
)
from shardax.train.data_parallel import DataParallel
from shardax.train.eval import EvalStep, make_eval_step
from shardax.train.loss import masked_mean
from shardax.train.metrics import DistributedMetrics
from shardax.train.precision import LossScaleState, LossScaling, Precision
from shardax.train.rng import dropout, example_keys
from shardax.train.state import TrainState
from shardax.train.step import MODES, TrainStep, make_train_step

__all__ = [
    "MODES",
    "AutoPlan",
    "AutoPlanOptions",
    "Candidate",
    "DataParallel",
    "DistributedMetrics",
    "EvalStep",
    "LossScaleState",
    "LossScaling",
    "Precision",
    "TrainState",
    "TrainStep",
    "all_gather",
    "all_reduce",
    "auto_plan",
    "bound_axes",
    "dropout",
    "example_keys",
    "make_eval_step",
    "make_train_step",
    "masked_mean",
    "reduce",
    "require_bound",
    "weighted_mean",
]
