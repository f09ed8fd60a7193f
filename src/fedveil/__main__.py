"""``python -m fedveil``: the same as the ``fedveil`` command (used to start local device agents).

Guarded: the sandbox's fork server imports the main module in its children, which must not run the CLI
again."""

import sys

from fedveil.cli import main

if __name__ == "__main__":
    sys.exit(main())
