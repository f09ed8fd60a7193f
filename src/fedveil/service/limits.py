"""The PoliFL service's limits and their defaults, in one place (docs/service.md, "Limits"): the service's
settings (:class:`~fedveil.service.app.ServiceSettings`), ``fedveil serve``'s options and its flags all
take their defaults from here. Standard library only, so the command line can read it at start-up."""

from __future__ import annotations

__all__ = [
    "CHECK_SECONDS",
    "JOBS_PER_APPLICATION",
    "JOB_SECONDS",
    "MAX_BODY_BYTES",
    "SIGN_IN_ADDRESS_FAILURES",
    "SIGN_IN_FAILURES",
    "SIGN_IN_LOCKOUT",
    "SUBMISSIONS_PER_MINUTE",
]

MAX_BODY_BYTES = 1 << 20
"""The largest request body, bytes (larger: 413)."""
JOB_SECONDS = 3600.0
"""Each job's wall-clock budget, seconds: its check and its run, host calls included."""
CHECK_SECONDS = 30.0
"""How much of a job's budget its check during the submission may use, seconds."""
JOBS_PER_APPLICATION = 4
"""Jobs an application may have checked, queued or running at once (more: 429)."""
SUBMISSIONS_PER_MINUTE = 30
"""Job submissions per application per minute (more: 429)."""
SIGN_IN_FAILURES = 5
"""Failed sign-ins per account name within :data:`SIGN_IN_LOCKOUT` before the account is locked."""
SIGN_IN_ADDRESS_FAILURES = 20
"""Failed sign-ins per client address within :data:`SIGN_IN_LOCKOUT` before the address is locked."""
SIGN_IN_LOCKOUT = 900.0
"""The window and the back-off of sign-in throttling, seconds (a restart unlocks)."""
