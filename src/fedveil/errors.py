"""Exceptions fedveil raises for bad input.

Every error a user can cause is a :class:`FedveilError` (a ``ValueError``), whose message names the
offending value and what to do instead. The CLI prints these as one line, without a traceback.
"""

from __future__ import annotations

__all__ = ["CodecError", "ConfigError", "FedveilError", "RunInterrupted", "ValidationError"]


class FedveilError(ValueError):
    """Base class of user-facing errors: the message names the value and the allowed alternative."""


class ConfigError(FedveilError):
    """A configuration key has a value that is not allowed."""


class CodecError(FedveilError):
    """Bytes that do not decode to a valid message; the message names the offending field."""


class ValidationError(FedveilError):
    """A decoded message whose contents a protocol does not accept (shape, round, size, ...)."""


class RunInterrupted(FedveilError):
    """A run stopped by Ctrl-C or SIGTERM; the message says where its checkpoint is and how to resume."""
