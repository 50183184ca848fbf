"""Runtime layer: processes, multi-host initialize, rendezvous, agreement, the watchdog."""

from shardax.runtime.agreement import AgreementError, check_agreement, fingerprint
from shardax.runtime.distributed import backend_started, initialize, resolve_coordinates
from shardax.runtime.processes import (
    device_put_global,
    host_reduce,
    host_value,
    is_main_process,
    print0,
)
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE, StepWatchdog

__all__ = [
    "WATCHDOG_EXIT_CODE",
    "AgreementError",
    "StepWatchdog",
    "backend_started",
    "check_agreement",
    "device_put_global",
    "fingerprint",
    "host_reduce",
    "host_value",
    "initialize",
    "is_main_process",
    "print0",
    "resolve_coordinates",
]
