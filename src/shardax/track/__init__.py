"""Track layer: metrics to JSONL / TensorBoard / W&B / MLflow, step timing, profiler traces,
the goodput ledger."""

from shardax.checks import moved as _moved
from shardax.track.clock import StepClock, Window
from shardax.track.goodput import Ledger
from shardax.track.profile import StepProfiler, profile_steps
from shardax.track.writer import MetricWriter

__all__ = [
    "Ledger",
    "MetricWriter",
    "StepClock",
    "StepProfiler",
    "Window",
    "profile_steps",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "BACKENDS": "shardax.track.sinks.BACKENDS",
        "INPUT_BOUND": "shardax.track.clock.INPUT_BOUND",
        "check_writable": "shardax.track.sinks.check_writable",
        "parse_steps": "shardax.track.profile.parse_steps",
    },
)
