"""The ``shardax`` command line: ``shardax train`` and friends."""

from shardax.cli.main import main

__all__ = ["main"]
