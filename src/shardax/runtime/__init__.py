"""Runtime layer: processes, multi-host initialize, rendezvous, agreement, the watchdog,
the compile cache."""

from shardax.checks import moved as _moved
from shardax.runtime.agreement import AgreementError, check_agreement
from shardax.runtime.cache import CompileStats, compile_cache, compile_stats
from shardax.runtime.distributed import initialize
from shardax.runtime.processes import host_reduce, host_value, is_main_process, print0
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE, StepWatchdog

__all__ = [
    "WATCHDOG_EXIT_CODE",
    "AgreementError",
    "CompileStats",
    "StepWatchdog",
    "check_agreement",
    "compile_cache",
    "compile_stats",
    "host_reduce",
    "host_value",
    "initialize",
    "is_main_process",
    "print0",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "backend_started": "shardax.runtime.distributed.backend_started",
        "device_put_global": "shardax.runtime.processes.device_put_global",
        "disable_compile_cache": "shardax.runtime.cache.disable_compile_cache",
        "fingerprint": "shardax.runtime.agreement.fingerprint",
        "resolve_coordinates": "shardax.runtime.distributed.resolve_coordinates",
    },
)
