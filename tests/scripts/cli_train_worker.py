"""One of 2 processes running `shardax train` together (tests/test_cli.py)."""

import sys

import jax

rank, port, cpu_devices = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", cpu_devices)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)

from shardax.cli import main  # noqa: E402

sys.exit(main([*sys.argv[4:], "--cpu-devices", str(cpu_devices)]))
