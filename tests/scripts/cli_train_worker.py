"""One of 2 processes running `shardax train` together (tests/test_cli.py)."""

import sys

import jax

rank, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)

from shardax.cli import main  # noqa: E402

sys.exit(main(sys.argv[3:]))
