"""The attack suite: one module per published attack, each run against an observer view (:mod:`.views`)."""
