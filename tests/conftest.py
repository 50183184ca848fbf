"""Every test sees 8 simulated CPU devices, set before any JAX backend starts.

The session shares one persistent compilation cache (JAX's own, in a fresh temporary
directory deleted at the end) with the CLI and multi-process tests it starts, which
inherit it through the environment: most of the suite's time is XLA compiling the same
small programs again, in this process and in each subprocess.
"""

import os
import shutil
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

CACHE_DIR = tempfile.mkdtemp(prefix="shardax-tests-jax-cache-")
CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": CACHE_DIR,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(CACHE_ENV)
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
