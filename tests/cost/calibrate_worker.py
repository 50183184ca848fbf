"""One process of the two-host calibration test (tests/cost/test_network.py): measures
``shardax.cost.calibrate.collectives`` within this process's devices and across both
processes' (gloo on 127.0.0.1), and prints its rows as one JSON line.

Usage: python calibrate_worker.py PORT PROCESS_ID NUM_PROCESSES
"""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

port, pid, nproc = (int(a) for a in sys.argv[1:4])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

from shardax.cost import calibrate  # noqa: E402

rows = calibrate.collectives([2**16, 2**21], calls=1)
print(json.dumps({"process": jax.process_index(), "rows": rows}), flush=True)
