"""Round settings of FDML and FL-traditional: plain dataclasses with no torch, so configs load fast.

:mod:`fedveil.protocols.fdml` and :mod:`fedveil.protocols.fedavg` re-export them under the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedveil.enclave.aggregate import DEFAULT_MAX_UPLOAD_NORM, check_max_upload_norm
from fedveil.errors import ConfigError

STRATEGIES = ("batch-all", "semi-hard")
ON_MISSING = ("continue", "abandon")


@dataclass(frozen=True)
class FDMLConfig:
    """Settings of FDML rounds (defaults: Sec. VIII-A).

    ``num_required`` participants per round, ``k`` >= 1 the selection multiplier of Alg. 3 (the
    server addresses ``ceil(num_required * k)`` devices), ``rate_p`` the expected response rate,
    ``samples_per_client`` training samples per device per round, Adam with ``lr`` on the server,
    triplet ``margin`` and ``strategy``, timeouts ``t_embed`` / ``t_grad`` in simulated seconds,
    ``max_attempts`` restarts of Alg. 3 line 5 before a round is given up. ``max_upload_norm`` bounds
    the L2 norm of one device's local gradient: a larger one (or one not finite) is refused, a dropout
    with its reason, before Eq. 2 (:func:`~fedveil.enclave.aggregate.check_upload`), so no single
    device can swamp the aggregate or turn Adam's moments infinite.
    """

    num_required: int = 64
    k: float = 1.0
    rate_p: float = 1.0
    samples_per_client: int = 8
    lr: float = 1e-4
    margin: float = 1.0
    strategy: str = "batch-all"
    on_missing_gradients: str = "continue"
    min_gradients: int = 3
    t_embed: float = 30.0
    t_grad: float = 30.0
    max_attempts: int = 20
    max_upload_norm: float = DEFAULT_MAX_UPLOAD_NORM

    def __post_init__(self) -> None:
        if self.num_required < 2:
            raise ConfigError(f"num_required {self.num_required!r} must be >= 2 (a triplet needs two users)")
        if not self.k >= 1:
            raise ConfigError(f"k {self.k!r} must be >= 1 (Alg. 3 addresses num_required * k devices)")
        if not 0 < self.rate_p <= 1:
            raise ConfigError(f"rate_p {self.rate_p!r} must be in (0, 1]")
        if self.samples_per_client < 2:
            raise ConfigError(
                f"samples_per_client {self.samples_per_client!r} must be >= 2 (anchor and positive)"
            )
        if not self.lr > 0:
            raise ConfigError(f"lr {self.lr!r} must be > 0")
        if not self.margin > 0:
            raise ConfigError(f"margin {self.margin!r} must be > 0")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.on_missing_gradients not in ON_MISSING:
            raise ConfigError(
                f"on_missing_gradients {self.on_missing_gradients!r} is not one of {', '.join(ON_MISSING)} "
                "(continue = Strategy-UC, abandon = Strategy-AS)"
            )
        if self.min_gradients < 1:
            raise ConfigError(f"min_gradients {self.min_gradients!r} must be >= 1")
        if not (self.t_embed > 0 and self.t_grad > 0):
            raise ConfigError(
                f"timeouts t_embed={self.t_embed!r}, t_grad={self.t_grad!r} must be > 0 seconds"
            )
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts {self.max_attempts!r} must be >= 1")
        check_max_upload_norm(self.max_upload_norm)

    @property
    def num_addressed(self) -> int:
        """Devices addressed per attempt: ``ceil(num_required * k)``."""
        return math.ceil(self.num_required * self.k - 1e-9)

    @property
    def num_gradients(self) -> int:
        """Gradients after which a round goes on: ``ceil(num_required * rate_p)`` (Alg. 3 line 9)."""
        return math.ceil(self.num_required * self.rate_p - 1e-9)


@dataclass(frozen=True)
class FedAvgConfig:
    """Settings of FL-traditional rounds: cohort size, samples, local SGD learning rate and steps,
    the simulated reply ``timeout`` in seconds, the fewest replies a round needs, and the bound on the L2
    norm of one client's change to the weights it was sent (``max_upload_norm``: a larger upload is
    refused, a dropout with its reason, as in FDML)."""

    clients_per_round: int = 64
    samples_per_client: int = 8
    lr: float = 0.1
    local_steps: int = 1
    timeout: float = 30.0
    min_replies: int = 1
    max_upload_norm: float = DEFAULT_MAX_UPLOAD_NORM

    def __post_init__(self) -> None:
        if self.clients_per_round < 1:
            raise ConfigError(f"clients_per_round {self.clients_per_round!r} must be >= 1")
        if self.samples_per_client < 1:
            raise ConfigError(f"samples_per_client {self.samples_per_client!r} must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"lr {self.lr!r} must be > 0")
        if self.local_steps < 1:
            raise ConfigError(f"local_steps {self.local_steps!r} must be >= 1")
        if not self.timeout > 0:
            raise ConfigError(f"timeout {self.timeout!r} must be > 0 seconds")
        if self.min_replies < 1:
            raise ConfigError(f"min_replies {self.min_replies!r} must be >= 1")
        check_max_upload_norm(self.max_upload_norm)
