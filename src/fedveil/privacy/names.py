"""Names and defaults of the privacy accounting, free of heavy imports (the CLI builds its options from
them without loading dp-accounting); :mod:`fedveil.privacy.accounting` and :mod:`fedveil.privacy.ledger`
re-export them."""

from __future__ import annotations

ACCOUNTANTS = ("pld", "rdp")
"""The accountants of :class:`fedveil.privacy.accounting.Accountant`."""

MECHANISMS = ("gaussian", "laplace")
"""The mechanisms ``fedveil privacy epsilon`` accounts for."""

DEFAULT_DELTA = 1e-5
"""The delta whole-training epsilons are reported at unless a run says otherwise."""

AUDITED = ("gaussian", "fdml", "polifl")
"""The mechanisms ``fedveil privacy audit`` audits (:mod:`fedveil.attacks.dp_audit`)."""

BROKEN = ("noise", "clip")
"""The deliberate breakages an audit can run (:class:`fedveil.attacks.dp_audit.Miscalibration`)."""
