"""``python -m fedveil``: the same as the ``fedveil`` command (used to start local device agents).

Guarded: the sandbox's fork server imports the main module in its children, which must not run the CLI
again."""

from fedveil.cli import entry

if __name__ == "__main__":
    entry()
