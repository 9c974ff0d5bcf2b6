"""``python -m shardflow``: the ``shardflow`` command."""

import sys

from shardflow.cli.main import main

sys.exit(main())
