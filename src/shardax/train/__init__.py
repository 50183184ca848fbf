"""Train layer: TrainState, the train and eval steps, precision, auto plans, the loss rules,
verify (the step against one device)."""

from shardax._names import exports as _exports
from shardax.checks import moved as _moved
from shardax.train.auto import (
    AutoPlan,
    AutoPlanOptions,
    AutoStep,
    Candidate,
    Layout,
    SearchSpace,
    auto_plan,
    search_plans,
)
from shardax.train.compiler import (
    combine_thresholds,
    compiler_options,
    gpu_options,
    set_gpu_environment,
)
from shardax.train.config import StepConfig
from shardax.train.diloco import DiLoCo
from shardax.train.eval import EvalStep
from shardax.train.explanation.explain import Explanation, explain
from shardax.train.guard import NonFiniteLossError, check_finite
from shardax.train.islands import IslandStep
from shardax.train.keep import keep_plan
from shardax.train.make import make_eval_step, make_train_step
from shardax.train.masks import masked_mean
from shardax.train.precision import LossScaling, Precision
from shardax.train.preparation import prepare
from shardax.train.rng import dropout, example_keys
from shardax.train.state import TrainState
from shardax.train.step import TrainStep
from shardax.train.verification import VerifyReport, verify

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
