"""Track layer: metrics to JSONL / TensorBoard / W&B / MLflow, step timing, profiler traces,
the goodput ledger."""

from shardax.track.clock import INPUT_BOUND, StepClock, Window
from shardax.track.goodput import Ledger
from shardax.track.profile import StepProfiler, parse_steps, profile_steps
from shardax.track.sinks import BACKENDS, check_writable
from shardax.track.writer import MetricWriter

__all__ = [
    "BACKENDS",
    "INPUT_BOUND",
    "Ledger",
    "MetricWriter",
    "StepClock",
    "StepProfiler",
    "Window",
    "check_writable",
    "parse_steps",
    "profile_steps",
]
