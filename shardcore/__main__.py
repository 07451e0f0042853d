"""``python -m shardcore``: the same as the ``shardcore`` command."""

import sys

from .cli import main

sys.exit(main())
