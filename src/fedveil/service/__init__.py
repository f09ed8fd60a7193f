"""PoliFL's server as a web service: the Access Service API, the policy dashboard and the job runner
(:mod:`fedveil.service.app`), on a migrated database (:mod:`fedveil.service.db`) with hashed secrets
(:mod:`fedveil.service.auth`). ``fedveil serve`` starts it (:mod:`fedveil.service.serve`); docs/service.md
is the operator's guide."""
