"""Track layer: metrics to JSONL / TensorBoard / W&B / MLflow, step timing, profiler traces,
the goodput ledger."""

from shardax._names import exports as _exports
from shardax.checks import moved as _moved
from shardax.track.clock import StepClock, Window
from shardax.track.goodput import Ledger
from shardax.track.profile import StepProfiler, profile_steps
from shardax.track.writer import MetricWriter

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
