"""Runtime layer: processes, multi-host initialize, rendezvous, agreement, the watchdog,
the compile cache."""

from shardax._names import exports as _exports
from shardax.checks import moved as _moved
from shardax.runtime.agreement import AgreementError, check_agreement
from shardax.runtime.cache import CompileStats, compile_cache, compile_stats
from shardax.runtime.distributed import initialize
from shardax.runtime.processes import host_reduce, host_value, is_main_process, print0
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE, StepWatchdog

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
