"""``python -m fedveil``: the same as the ``fedveil`` command (used to start local device agents)."""

import sys

from fedveil.cli import main

sys.exit(main())
