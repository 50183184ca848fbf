"""Train layer: TrainState, the train and eval steps, precision, auto plans, the loss rules,
verify (the step against one device)."""

from shardax.train.auto import AutoPlan, AutoPlanOptions, AutoStep, Candidate, auto_plan
from shardax.train.config import MODES, StepConfig
from shardax.train.eval import EvalStep
from shardax.train.guard import NonFiniteLossError, check_finite
from shardax.train.keep import keep_plan
from shardax.train.make import make_eval_step, make_train_step
from shardax.train.masks import masked_mean
from shardax.train.precision import LossScaleState, LossScaling, Precision
from shardax.train.prepare import prepare
from shardax.train.program import Program
from shardax.train.rng import dropout, example_keys
from shardax.train.state import TrainState
from shardax.train.step import TrainStep
from shardax.train.verify import VerifyReport, verify

__all__ = [
    "MODES",
    "AutoPlan",
    "AutoPlanOptions",
    "AutoStep",
    "Candidate",
    "EvalStep",
    "LossScaleState",
    "LossScaling",
    "NonFiniteLossError",
    "Precision",
    "Program",
    "StepConfig",
    "TrainState",
    "TrainStep",
    "VerifyReport",
    "auto_plan",
    "check_finite",
    "dropout",
    "example_keys",
    "keep_plan",
    "make_eval_step",
    "make_train_step",
    "masked_mean",
    "prepare",
    "verify",
]
