"""``python -m shardax``: the same as the ``shardax`` command."""

import sys

from shardax.cli import main

sys.exit(main())
