"""Runtime layer: processes, multi-host initialize, rendezvous, agreement, the watchdog,
the compile cache."""

from shardax.runtime.agreement import AgreementError, check_agreement, fingerprint
from shardax.runtime.cache import (
    CompileStats,
    compile_cache,
    compile_stats,
    disable_compile_cache,
)
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
    "CompileStats",
    "StepWatchdog",
    "backend_started",
    "check_agreement",
    "compile_cache",
    "compile_stats",
    "device_put_global",
    "disable_compile_cache",
    "fingerprint",
    "host_reduce",
    "host_value",
    "initialize",
    "is_main_process",
    "print0",
    "resolve_coordinates",
]
