"""The version of fedveil, in a module of its own so that any layer can name it without importing the
public API (:mod:`fedveil`) that sits above them all."""

__version__ = "0.1.0"
