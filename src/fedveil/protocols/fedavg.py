"""The one FedAvg engine (McMahan et al. 2017), its hooks, and the systems built on it.

**The engine.** :class:`FedAvgEngine` is the server's round loop shared by every FedAvg-style protocol in
fedveil: select a cohort, send each selected client its request, gather the replies through the
:class:`~fedveil.core.communicator.Communicator` (late, missing or invalid replies are dropouts), aggregate
and apply. On the client side :mod:`fedveil.protocols.local` holds the one local-training loop
(SGD with momentum, Adam; one client or a ``vmap``-batched cohort). The twists of the systems are hooks,
plain functions in the style of Flower's strategies (wrap them, do not fork the loop):

- ``select(rnd, rng, connected) -> cohort``: among the devices connected now (``connected``:
  ``Communicator.available()``; a device that is down is never selected), uniform without replacement
  (:func:`select_connected`; FedUV Alg. 1), or by group (FDML's phone model; FL-traditional);
- ``configure(rnd, cohort, weights) -> {client: request}``: what each client receives (FedAwS sends each
  user only its own class embedding);
- ``aggregate(rnd, results, current) -> new``: the server's combination of the uploads, sample-weighted
  FedAvg by default (:func:`fedavg_aggregate`), or in an enclave, or followed by FedAwS' spreadout;
- ``server_lr``: PoliFL Eq. 1, ``G_{t+1} = G_t + eta * (avg_i L_i - G_t)`` (with sample weights; the
  paper's unweighted ``eta / n`` sum is the case of equal sample counts); ``1`` is plain FedAvg;
- on the client (:class:`ModelClients`): a :class:`ParameterPlan` of which parameters are shared (the rest
  stay on the device: AIoT's private projector) and which train (PPFL's frozen layers), and an update
  transform applied before upload (:class:`ClipAndNoise`, PoliFL Alg. 3).

**Image FedAvg** (:class:`ModelServer`, :class:`ModelClients`): any ``torch.nn.Module`` classifier on any
:class:`~fedveil.data.federated.FederatedDataset` whose users hold ``x`` and ``y`` arrays, with the global
model evaluated on a test split every ``eval_every`` rounds (:func:`evaluate_model`).

**FL-traditional**, FDML's baseline (Sec. VIII-B1 of [FDML]), runs on the same engine:
"We replace the DML loss with the cross-entropy loss, and the last layer of the original embedding network
is connected with a fully connected layer whose output has as many dimensions as the number of
participants. The participant of FL-traditional will only perform one training iteration in each training
round." Each round selects a phone model and ``clients_per_round`` of its devices (as FDML does); each
device takes ``local_steps`` SGD steps on ``samples_per_client`` freshly sampled training samples labelled
with its own class; the server averages the returned models weighted by sample counts. Evaluation uses the
embedding network only (the head is dropped).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedveil.core import codec
from fedveil.core.aggregation import FedAvgSum, weighted_average
from fedveil.core.communicator import ClientId, Communicator, Fold
from fedveil.data.federated import FederatedDataset
from fedveil.enclave.aggregate import DEFAULT_MAX_UPLOAD_NORM, check_max_upload_norm, check_upload
from fedveil.enclave.secure_noise import SecureNoise
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.device import module_device, resolve_device
from fedveil.models.flat import FlatModel
from fedveil.protocols.common import (
    ClientData,
    RoundReport,
    as_tensor,
    client_rng,
    connected_groups,
    connected_members,
    expect,
    fill_traffic,
)
from fedveil.protocols.common import select_group_cohort as select_cohort
from fedveil.protocols.local import LocalOptimizer, epoch_batches, local_train, local_train_cohort
from fedveil.protocols.messages import (
    FitReply,
    FitRequest,
    Register,
    RegistrationCall,
    TrainReply,
    TrainRequest,
)
from fedveil.protocols.registration import register_clients, rejoin_groups
from fedveil.protocols.settings import FedAvgConfig

__all__ = [
    "ClipAndNoise",
    "EmbeddingClassifier",
    "FedAvgClients",
    "FedAvgConfig",
    "FedAvgEngine",
    "FedAvgServer",
    "FitResult",
    "ImageFedAvgConfig",
    "ModelClients",
    "ModelServer",
    "ParameterPlan",
    "evaluate_model",
    "fedavg_aggregate",
    "select_connected",
    "select_uniform",
]


# --- hooks --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitResult:
    """One client's upload as the aggregation hook sees it (decoded and validated): its ``weights``, or,
    when the update travels encrypted to an enclave, the opaque ``record`` (and no weights)."""

    weights: np.ndarray | None
    num_samples: int
    loss: float | None = None
    record: bytes | None = None


def _fit_result(msg: Any, weights: np.ndarray | None) -> FitResult:
    """The :class:`FitResult` of a validated reply, with ``weights`` (``None``: folded, or sealed)."""
    return FitResult(weights, int(msg.num_samples), getattr(msg, "loss", None), getattr(msg, "record", None))


Select = Callable[[int, np.random.Generator, Sequence[ClientId]], list[ClientId]]
Configure = Callable[[int, Sequence[ClientId], np.ndarray], dict[ClientId, object]]
Aggregate = Callable[[int, Mapping[ClientId, FitResult], Any], Any]
ReplyCheck = Callable[[ClientId, Any], None]


def fedavg_aggregate(rnd: int, results: Mapping[ClientId, FitResult], current: np.ndarray) -> np.ndarray:
    """FedAvg (McMahan et al. 2017, Alg. 1): ``sum_k (n_k / n) w_k`` over the uploads, on as many threads
    as torch has (``runtime.threads``; the same bits on any number).

    :class:`FedAvgEngine` with this hook does not call it: it folds each upload into a
    :class:`~fedveil.core.aggregation.FedAvgSum` as the runtime accepts it, the same mean within the
    tolerance stated there (one or two float32 ulps where the uploads share a sign), without holding the
    uploads; called directly (FedUV's server does), it averages uploads held all at once."""
    return weighted_average(
        {c: r.weights for c, r in results.items()},
        {c: float(r.num_samples) for c, r in results.items()},
        workers=torch.get_num_threads(),
    )


def select_uniform(members: Sequence[ClientId], size: int, rng: np.random.Generator) -> list[ClientId]:
    """``size`` of ``members`` uniformly without replacement (all of them when fewer), in member order."""
    if not members:
        raise ConfigError("no clients to select from: register or list the clients before training")
    take = min(size, len(members))
    picked = rng.choice(len(members), size=take, replace=False)
    return [members[i] for i in sorted(picked)]


def select_connected(
    members: Sequence[ClientId], connected: Sequence[ClientId], size: int, rng: np.random.Generator
) -> list[ClientId]:
    """:func:`select_uniform` among the ``members`` connected now (``connected``:
    ``Communicator.available()``); none of them connected: an empty cohort, a round not applied."""
    now = connected_members(members, connected)
    if members and not now:
        return []
    return select_uniform(now, size, rng)


# --- the engine ---------------------------------------------------------------------------------------


class FedAvgEngine:
    """The server's FedAvg round loop over a :class:`Communicator` (module docstring).

    ``weights`` is the vector the server keeps (flat float32). ``upload_index`` (default: all of it) says
    which of its entries the clients upload and the aggregation replaces. Replies must be of
    ``reply_type`` and carry ``round``, ``num_samples`` (>= 1) and ``weights`` (the uploaded entries),
    and may carry ``loss``; ``check`` adds a protocol's own validation. An upload whose change to the
    weights it was sent has an L2 norm above ``max_upload_norm`` is refused, a dropout with its reason
    (:func:`~fedveil.enclave.aggregate.check_upload`, the check FDML applies to local gradients; the
    default bound is far above any honest update), so no single client can swamp the average. A round
    with fewer than ``min_replies`` valid replies leaves the model unchanged. With the default ``aggregate``
    (:func:`fedavg_aggregate`) each valid upload is folded into a running sum as the runtime accepts it
    (``Communicator.request``'s ``fold``), so no runtime holds the cohort's weights until the last arrived.

    ``weights=None`` is a model the server's host never holds (PPFL's layer in training lives in the
    server's enclave): ``configure`` then seals it to the cohort, replies carry an opaque ``record``
    instead of weights, and ``aggregate`` averages inside the enclave and returns ``None`` (the enclave
    applies the same bound there: :meth:`fedveil.enclave.layerwise.LayerwiseState.average`).
    """

    def __init__(
        self,
        weights: np.ndarray | None,
        rng: np.random.Generator,
        *,
        select: Select,
        configure: Configure,
        reply_type: type,
        aggregate: Aggregate = fedavg_aggregate,
        upload_index: np.ndarray | None = None,
        server_lr: float = 1.0,
        timeout: float = 60.0,
        min_replies: int = 1,
        check: ReplyCheck | None = None,
        phase: str = "train",
        max_upload_norm: float = DEFAULT_MAX_UPLOAD_NORM,
    ) -> None:
        if not (math.isfinite(server_lr) and server_lr > 0):
            raise ConfigError(f"server_lr {server_lr!r} must be a finite number > 0 (1 is plain FedAvg)")
        if min_replies < 1:
            raise ConfigError(f"min_replies {min_replies!r} must be >= 1")
        if not timeout > 0:
            raise ConfigError(f"timeout {timeout!r} must be > 0 seconds")
        self.current = None if weights is None else np.array(weights, dtype=np.float32)
        if self.current is not None and self.current.ndim != 1:
            raise ConfigError(f"weights must be a flat vector, got shape {self.current.shape}")
        if self.current is None and (upload_index is not None or server_lr != 1.0):
            raise ConfigError("a model held in an enclave (weights=None) takes no upload_index or server_lr")
        self.rng = rng
        self.select = select
        self.configure = configure
        self.reply_type = reply_type
        self.aggregate = aggregate
        self.upload_index = None if upload_index is None else np.asarray(upload_index, dtype=np.int64)
        self.server_lr = server_lr
        self.timeout = timeout
        self.min_replies = min_replies
        self.check = check
        self.phase = phase
        self.max_upload_norm = check_max_upload_norm(max_upload_norm)

    def _fold(self, shape: tuple[int, ...] | None) -> tuple[FedAvgSum | None, Fold | None]:
        """With the default aggregate, a running sum and the fold that adds each accepted upload to it and
        keeps the upload's :class:`FitResult` without weights; otherwise neither (the hook gets the
        uploads)."""
        if shape is None or self.aggregate is not fedavg_aggregate:
            return None, None
        total = FedAvgSum(shape)

        def fold(cid: ClientId, msg: Any) -> FitResult:
            total.add(cid, np.asarray(msg.weights), int(msg.num_samples))
            return _fit_result(msg, None)

        return total, fold

    def _held(self) -> np.ndarray:
        if self.current is None:
            raise ConfigError("this engine's model is held in an enclave; the host has no weights")
        return self.current

    @property
    def weights(self) -> np.ndarray:
        """The server's current vector (a copy)."""
        return self._held().copy()

    def _uploaded(self) -> np.ndarray:
        current = self._held()
        return current if self.upload_index is None else current[self.upload_index]

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The weights and the selection generator's state, for a resumed run."""
        return {"weights": self.weights}, {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (shape checked)."""
        weights = np.array(arrays["weights"], dtype=np.float32)
        self._held()
        if weights.shape != self.current.shape:
            raise ConfigError(f"checkpoint weights of shape {weights.shape}, model has {self.current.shape}")
        self.current = weights
        self.rng.bit_generator.state = dict(meta["rng"])

    async def run_round(self, rnd: int, comm: Communicator) -> RoundReport:
        """Select, request local training, validate, aggregate, apply (with ``server_lr``)."""
        before = comm.stats().copy()
        cohort = self.select(rnd, self.rng, comm.available())
        msgs = self.configure(rnd, cohort, self.current)
        sent = None if self.current is None else self._uploaded()
        shape = None if sent is None else sent.shape

        def check(cid: ClientId, msg: Any) -> None:
            expect(msg.round == rnd, f"reply for round {msg.round}, expected {rnd}")
            if sent is not None:
                expect(msg.weights.shape == shape, f"weights of shape {msg.weights.shape}, expected {shape}")
                check_upload(msg.weights, self.max_upload_norm, reference=sent, what="update")
            expect(msg.num_samples >= 1, f"num_samples {msg.num_samples} must be >= 1")
            if self.check is not None:
                self.check(cid, msg)

        total, fold = self._fold(shape)
        replies = await comm.request(
            msgs,
            phase=self.phase,
            min_replies=len(msgs),
            timeout=self.timeout,
            expected=self.reply_type,
            validate=check,
            fold=fold,
        )
        applied = len(replies) >= self.min_replies
        loss = None
        if applied:
            if total is None:
                held = shape is not None
                results = {
                    c: _fit_result(m, np.asarray(m.weights) if held else None) for c, m in replies.items()
                }
            elif total.count == len(replies):
                results = replies
            else:
                raise ConfigError(
                    f"the communicator returned {len(replies)} replies but folded {total.count}: a "
                    "Communicator must pass each reply it returns through request()'s fold"
                )
            if shape is None:
                self.aggregate(rnd, results, None)
                report = RoundReport(rnd, applied, None, 1, len(msgs), len(replies))
                return fill_traffic(report, before, comm.stats())
            current = self._uploaded()
            if total is not None:
                new = total.result()
            else:
                new = np.asarray(self.aggregate(rnd, results, current), dtype=np.float32)
            if self.server_lr != 1.0:
                new = (current + self.server_lr * (new - current)).astype(np.float32)
            if self.upload_index is None:
                self.current = new
            else:
                self.current = self.current.copy()
                self.current[self.upload_index] = new
            losses = [(r.loss, r.num_samples) for r in results.values() if r.loss is not None]
            if losses:
                loss = sum(v * n for v, n in losses) / sum(n for _, n in losses)
        report = RoundReport(rnd, applied, loss, 1, len(msgs), len(replies))
        return fill_traffic(report, before, comm.stats())


# --- which parameters travel and train ------------------------------------------------------------------


def _matcher(spec: Iterable[str] | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if spec is None:
        return lambda name: False
    if callable(spec):
        return spec
    prefixes = tuple(spec)
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


class ParameterPlan:
    """Which parameters of a model are shared with the server and which train (flat-vector indices).

    ``private`` parameters never leave the device: the server neither sends nor receives them (AIoT's
    private projector). ``frozen`` parameters are sent but not trained, and so not uploaded (PPFL's layers
    released to the REE). Each may be a list of parameter names or module prefixes (``"head"`` covers
    ``"head.weight"`` and ``"head.bias"``) or a predicate on the name. The upload is the shared, trainable
    parameters; a plan in which nothing would be uploaded is refused.
    """

    def __init__(
        self,
        flat: FlatModel,
        *,
        private: Iterable[str] | Callable[[str], bool] | None = None,
        frozen: Iterable[str] | Callable[[str], bool] | None = None,
    ) -> None:
        is_private, is_frozen = _matcher(private), _matcher(frozen)
        for spec in (private, frozen):
            if spec is not None and not callable(spec):
                for prefix in spec:
                    if not any(n == prefix or n.startswith(prefix + ".") for n in flat.names):
                        raise ConfigError(
                            f"parameter or module {prefix!r} is not in the model; it has {flat.names[:6]}..."
                        )
        offsets = np.cumsum([0, *flat.sizes])
        shared, upload, trainable = [], [], np.zeros(flat.num_params, dtype=np.float32)
        self.private_names = [n for n in flat.names if is_private(n)]
        self.frozen_names = [n for n in flat.names if is_frozen(n)]
        for i, name in enumerate(flat.names):
            span = np.arange(offsets[i], offsets[i + 1], dtype=np.int64)
            if not is_frozen(name):
                trainable[span] = 1.0
            if not is_private(name):
                shared.append(span)
                if not is_frozen(name):
                    upload.append(span)
        if not upload:
            raise ConfigError("the parameter plan uploads nothing: every parameter is private or frozen")
        self.num_params = flat.num_params
        self.shared_index = np.concatenate(shared)
        self.upload_index = np.concatenate(upload)
        private = np.ones(flat.num_params, dtype=bool)
        private[self.shared_index] = False
        self.private_index = np.flatnonzero(private)  # = setdiff1d(arange, shared): linear, not a sort
        self.upload_in_shared = np.searchsorted(self.shared_index, self.upload_index)
        self.train_mask = None if trainable.all() else torch.from_numpy(trainable)

    @property
    def everything_shared(self) -> bool:
        """True when no parameter is private."""
        return self.private_index.size == 0


# --- client-side update transform ---------------------------------------------------------------------


@dataclass(frozen=True)
class ClipAndNoise:
    """PoliFL Alg. 3, ``train_local_dp``: ``Clip(L, S) + N(0, sigma^2) / m`` applied to the local update.

    The update ``Delta = L - G`` (trained minus received, uploaded entries only) is scaled to L2 norm at
    most ``clip_norm`` ``S``; Gaussian noise of standard deviation ``noise_std / cohort_size``
    (``sigma / m``) is added to each coordinate, drawn from the client's own seeded generator. With
    ``noise_std = z S`` the sum over the ``m`` clients of a round is the Gaussian mechanism with
    L2 sensitivity ``S`` (neighbouring relation: one client's whole update added or removed) and noise
    multiplier ``z / sqrt(m)`` on the mean; accounting is the caller's (:mod:`fedveil.privacy`).

    ``secure_noise`` (for deployments): the noise is instead exact discrete Gaussian noise of the same
    standard deviation on a power-of-two grid, from the OS's CSPRNG, added to the clipped update snapped
    to that grid (:class:`~fedveil.enclave.secure_noise.SecureNoise`; it resists the attack on the
    low-order bits of floating-point noise, and its epsilon is the ``rdp`` accountant's); a simulation
    keeps the seeded generator, so its runs are reproducible.
    """

    clip_norm: float
    noise_std: float
    cohort_size: int = 1
    secure_noise: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ConfigError(f"clip_norm {self.clip_norm!r} must be a finite number > 0")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ConfigError(f"noise_std {self.noise_std!r} must be a finite number >= 0")
        if self.cohort_size < 1:
            raise ConfigError(f"cohort_size {self.cohort_size!r} must be >= 1")

    def __call__(self, delta: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """The clipped, noised update."""
        norm = float(torch.linalg.vector_norm(delta))
        clipped = delta * min(1.0, self.clip_norm / norm) if norm > 0 else delta
        if self.noise_std == 0:
            return clipped
        std = self.noise_std / self.cohort_size
        if self.secure_noise:
            noisy = SecureNoise().add_normal(clipped.detach().cpu().numpy(), std)
            return torch.from_numpy(noisy.astype(np.float32))
        noise = rng.normal(0.0, std, size=delta.shape).astype(np.float32)
        return clipped + torch.from_numpy(noise)


UpdateTransform = Callable[[torch.Tensor, np.random.Generator], torch.Tensor]

BATCH_BELOW_PARAMS = 100_000
"""Models up to this many parameters train a cohort batched by default (measured, :class:`ModelClients`)."""


# --- image FedAvg: any module, any federated dataset ---------------------------------------------------


@dataclass(frozen=True)
class ImageFedAvgConfig:
    """Settings of image FedAvg: ``clients_per_round`` (or all when larger than the population), local
    ``local_epochs`` and ``batch_size``, the client ``optimizer``, ``server_lr`` (PoliFL Eq. 1's ``eta``),
    the simulated ``timeout``, ``min_replies``, ``eval_every`` rounds (0: never) and ``max_upload_norm``
    (the engine's bound on one client's update, :class:`FedAvgEngine`)."""

    clients_per_round: int = 10
    local_epochs: int = 1
    batch_size: int = 16
    optimizer: LocalOptimizer = field(default_factory=LocalOptimizer)
    server_lr: float = 1.0
    timeout: float = 60.0
    min_replies: int = 1
    eval_every: int = 1
    max_upload_norm: float = DEFAULT_MAX_UPLOAD_NORM

    def __post_init__(self) -> None:
        for name in ("clients_per_round", "local_epochs", "batch_size", "min_replies"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} must be an integer >= 1")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval_every {self.eval_every!r} must be an integer >= 0")
        check_max_upload_norm(self.max_upload_norm)


def evaluate_model(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, batch_size: int = 1000
) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` (eval mode, no gradients) on ``x`` with labels ``y``
    (moved batch by batch to the device of ``model``'s parameters)."""
    if len(x) != len(y) or len(x) == 0:
        raise ValidationError(f"evaluation needs matching non-empty inputs and labels: {len(x)}, {len(y)}")
    was_training = model.training
    model.eval()
    device = module_device(model)
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for s in range(0, len(x), batch_size):
            xb = torch.from_numpy(np.ascontiguousarray(x[s : s + batch_size], dtype=np.float32)).to(device)
            yb = torch.from_numpy(np.asarray(y[s : s + batch_size], dtype=np.int64)).to(device)
            logits = model(xb)
            total_loss += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return {"accuracy": correct / len(x), "loss": total_loss / len(x)}


class ModelServer:
    """The image FedAvg server: :class:`FedAvgEngine` with uniform selection and :class:`FitRequest`.

    ``initial`` is the model's full flat vector; the server keeps only its shared part (``plan``).
    :meth:`evaluate` loads the shared part (and ``initial``'s values of private parameters, which the
    server never learns) into ``model`` and scores it on a test split.
    """

    def __init__(
        self,
        cfg: ImageFedAvgConfig,
        flat: FlatModel,
        rng: np.random.Generator,
        *,
        plan: ParameterPlan | None = None,
        initial: np.ndarray | None = None,
        aggregate: Aggregate = fedavg_aggregate,
    ) -> None:
        self.cfg = cfg
        self.flat = flat
        self.plan = plan or ParameterPlan(flat)
        full = flat.initial() if initial is None else np.asarray(initial, dtype=np.float32)
        if full.shape != (flat.num_params,):
            raise ConfigError(f"initial weights of shape {full.shape}, expected ({flat.num_params},)")
        self._full = full.copy()
        self.members: list[ClientId] = []
        self.engine = FedAvgEngine(
            full[self.plan.shared_index],
            rng,
            select=lambda rnd, r, now: select_connected(self.members, now, cfg.clients_per_round, r),
            configure=self._configure,
            reply_type=FitReply,
            aggregate=aggregate,
            upload_index=None if self.plan.frozen_names == [] else self.plan.upload_in_shared,
            server_lr=cfg.server_lr,
            timeout=cfg.timeout,
            min_replies=cfg.min_replies,
            max_upload_norm=cfg.max_upload_norm,
        )

    def _configure(self, rnd: int, cohort: Sequence[ClientId], weights: np.ndarray) -> dict[ClientId, object]:
        cfg = self.cfg
        request = FitRequest(rnd, cfg.optimizer.lr_at(rnd), cfg.local_epochs, cfg.batch_size, weights)
        return {c: request for c in cohort}

    @property
    def weights(self) -> np.ndarray:
        """The shared parameters (flat, a copy)."""
        return self.engine.weights

    def full_weights(self) -> np.ndarray:
        """The whole model as the server can assemble it: shared parameters, private ones at ``initial``."""
        full = self._full.copy()
        full[self.plan.shared_index] = self.engine.current
        return full

    def setup(self, comm: Communicator) -> list[ClientId]:
        """Take every available client as a member (FedAvg's population ``K``)."""
        self.members = list(comm.available())
        if not self.members:
            raise ConfigError("no clients are available; nothing to train")
        return self.members

    async def run_round(self, rnd: int, comm: Communicator) -> RoundReport:
        """One FedAvg round; ``report.extra["lr"]`` is the round's client learning rate."""
        report = await self.engine.run_round(rnd, comm)
        report.extra["lr"] = self.cfg.optimizer.lr_at(rnd)
        return report

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Accuracy and loss of the global model on a test split (:func:`evaluate_model`)."""
        return evaluate_model(self.flat.load_into_module(self.full_weights()), x, y)

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The engine's state, for a resumed run."""
        return self.engine.state_dict()

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.engine.load_state_dict(arrays, meta)


class ModelClients:
    """The devices of image FedAvg: each trains the model on its own ``x``/``y`` (a ``ClientPool``).

    Each :class:`FitRequest` runs ``local_epochs`` passes over the client's examples, reshuffled every
    epoch by its own generator (``client_rng(seed, i)``), in batches of ``batch_size`` (the last one may be
    smaller), with ``optimizer`` on ``loss`` (cross-entropy by default). Private parameters (``plan``) are
    the client's own, initialised from ``initial`` and kept across rounds; frozen ones do not change.
    ``transform`` (e.g. :class:`ClipAndNoise`) is applied to the update before upload.

    ``batched=True`` trains the clients of a request whose data sizes agree together (one ``vmap``);
    ``batched=False`` one by one; both give equal numbers (``tests/test_protocols_fedavg_engine.py``).
    ``batched=None`` (default) batches where it is faster: models of at most :data:`BATCH_BELOW_PARAMS`
    parameters (``fedveil bench fedavg``: the 13k-parameter sigmoid LeNet trains 1.6x faster batched,
    the 0.3M AlexNet and the 1.3M LeNet 0.7-0.85x as fast, docs/benchmarks.md).
    Models with BatchNorm are trained and evaluated with batch statistics (running statistics are not
    federated here: :func:`torch.func.replace_all_batch_norm_modules_` is applied); models with dropout
    draw different masks on the two paths.

    ``device`` (:func:`~fedveil.models.device.resolve_device`: ``cpu``, ``cuda[:N]`` or ``auto``) is where
    the clients train: the module moves there, and each client's examples move there once, at their first
    round; messages stay host numpy arrays.
    """

    def __init__(
        self,
        flat: FlatModel,
        data: FederatedDataset,
        *,
        optimizer: LocalOptimizer,
        seed: int,
        plan: ParameterPlan | None = None,
        initial: np.ndarray | None = None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
        transform: UpdateTransform | None = None,
        batched: bool | None = None,
        x_key: str = "x",
        y_key: str = "y",
        device: str | torch.device = "cpu",
    ) -> None:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in flat.module.modules()):
            torch.func.replace_all_batch_norm_modules_(flat.module)
        self.device = resolve_device(device)
        flat.module.to(self.device)
        self.flat = flat
        self.data = data
        self.optimizer = optimizer
        self.plan = plan or ParameterPlan(flat)
        self._uploads_all = self.plan.upload_index.size == self.plan.num_params
        self.loss_fn = loss
        self.transform = transform
        self.batched = flat.num_params <= BATCH_BELOW_PARAMS if batched is None else batched
        self.x_key, self.y_key = x_key, y_key
        self.ids = list(data.user_ids)
        self.rngs = {cid: client_rng(seed, i) for i, cid in enumerate(self.ids)}
        full = flat.initial() if initial is None else np.asarray(initial, dtype=np.float32)
        self._private = {cid: full[self.plan.private_index].copy() for cid in self.ids}
        self._cache: dict[ClientId, tuple[torch.Tensor, torch.Tensor]] = {}

    def client_ids(self) -> list[ClientId]:
        """Every client of the data set."""
        return self.ids

    def private_weights(self, cid: ClientId) -> np.ndarray:
        """Client ``cid``'s private parameters (a copy; for that client's own evaluation and spy tests)."""
        return self._private[cid].copy()

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Local training for every addressed client."""
        out: dict[ClientId, object] = {}
        fit: dict[ClientId, FitRequest] = {}
        for cid, m in msgs.items():
            if isinstance(m, FitRequest):
                fit[cid] = m
            else:
                out[cid] = ValidationError(f"a FedAvg client cannot handle {type(m).__name__}")
        if fit:
            out.update(self._fit(fit))
        return out

    def _objective(self, p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.flat(p, x), y)

    def _full(self, cid: ClientId, received: np.ndarray) -> torch.Tensor:
        """Client ``cid``'s whole vector on the device, the shared part ``received``: a new tensor, the
        one its local training steps in place (one copy of ``received`` when nothing is private)."""
        shared = as_tensor(received).to(self.device)
        if self.plan.everything_shared:
            return shared
        p = torch.empty(self.plan.num_params, dtype=torch.float32, device=self.device)
        p[torch.from_numpy(self.plan.shared_index).to(self.device)] = shared
        p[torch.from_numpy(self.plan.private_index).to(self.device)] = as_tensor(self._private[cid]).to(
            self.device
        )
        return p

    def _tensors(self, cid: ClientId) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's examples as tensors on the device, converted and moved once (the data set's arrays
        are read-only)."""
        if cid not in self._cache:
            x = self.data.array(cid, self.x_key)
            y = self.data.array(cid, self.y_key)
            if len(x) == 0 or len(x) != len(y):
                raise ValidationError(
                    f"client {cid} has {len(x)} inputs and {len(y)} labels; needs >= 1 of each"
                )
            self._cache[cid] = (
                torch.tensor(x, dtype=torch.float32).to(self.device),
                torch.tensor(y, dtype=torch.int64).to(self.device),
            )
        return self._cache[cid]

    def _batches(self, cid: ClientId, m: FitRequest) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        xt, yt = self._tensors(cid)
        return len(xt), epoch_batches(xt, yt, self.rngs[cid], epochs=m.local_epochs, batch_size=m.batch_size)

    def _fit(self, msgs: Mapping[ClientId, FitRequest]) -> dict[ClientId, object]:
        expected = (self.plan.shared_index.size,)
        jobs: dict[ClientId, tuple[FitRequest, int, list[tuple[torch.Tensor, torch.Tensor]]] | Exception] = {}
        for cid, m in msgs.items():
            if m.weights.shape != expected:
                jobs[cid] = ValidationError(f"weights of shape {m.weights.shape}, expected {expected}")
                continue
            n, batches = self._batches(cid, m)
            jobs[cid] = (m, n, batches)
        trained: dict[ClientId, tuple[torch.Tensor, float]] = {}
        runnable = {c: j for c, j in jobs.items() if not isinstance(j, Exception)}
        mask = None if self.plan.train_mask is None else self.plan.train_mask.to(self.device)
        self.flat.module.train()
        if self.batched:
            groups: dict[tuple[int, int, int, float], list[ClientId]] = {}
            for cid, (m, n, _) in runnable.items():
                groups.setdefault((n, m.local_epochs, m.batch_size, m.lr), []).append(cid)
            for (_, _, _, lr), group in groups.items():
                p = torch.stack([self._full(c, runnable[c][0].weights) for c in group])
                steps = len(runnable[group[0]][2])
                batches = [
                    tuple(torch.stack([runnable[c][2][s][k] for c in group]) for k in range(2))
                    for s in range(steps)
                ]
                p, losses = local_train_cohort(
                    self._objective, p, batches, self.optimizer, lr, mask, inplace=True
                )
                trained.update({c: (p[i], float(losses[i])) for i, c in enumerate(group)})
        else:
            for cid, (m, _, batches) in runnable.items():
                p0, shapes = self._full(cid, m.weights), self.flat.shapes
                p, loss = local_train(
                    self._objective, p0, batches, self.optimizer, m.lr, mask, inplace=True, shapes=shapes
                )
                trained[cid] = (p, float(loss))
        out: dict[ClientId, object] = {}
        for cid, job in jobs.items():
            if isinstance(job, Exception):
                out[cid] = job
                continue
            m, n, _ = job
            p, loss = trained[cid]
            out[cid] = FitReply(m.round, n, loss, self._upload(cid, m.weights, p))
        return out

    def _upload(self, cid: ClientId, received: np.ndarray, p: torch.Tensor) -> np.ndarray:
        """Client ``cid``'s upload from its trained vector ``p`` (keeping its private part): the trained
        values of the uploaded parameters, after the update transform. When every parameter is uploaded
        and nothing transforms them, that is ``p``'s own memory, with no copy."""
        p = p.detach()
        if not self.plan.everything_shared:
            private = torch.from_numpy(self.plan.private_index).to(self.device)
            self._private[cid] = p[private].cpu().numpy().copy()
        new = p if self._uploads_all else p[torch.from_numpy(self.plan.upload_index).to(self.device)]
        new = new.cpu()
        if self.transform is not None:
            sent = as_tensor(received[self.plan.upload_in_shared])
            new = sent + self.transform(new - sent, self.rngs[cid])
        return np.asarray(new.numpy(), dtype=np.float32)


# --- FL-traditional (FDML's baseline) -----------------------------------------------------------------


class EmbeddingClassifier(nn.Module):
    """An embedding network followed by a linear softmax head with one output per training user."""

    def __init__(self, embedding: nn.Module, embedding_dim: int, num_classes: int) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = nn.Linear(embedding_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)``."""
        return self.head(self.embedding(x))


class FedAvgServer:
    """The server of FL-traditional: selection as FDML, FedAvg of the returned models (on the engine)."""

    def __init__(self, cfg: FedAvgConfig, initial_weights: np.ndarray, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.groups: dict[str, list[ClientId]] = {}

        def check(cid: ClientId, msg: TrainReply) -> None:
            expect(
                msg.num_samples == cfg.samples_per_client,
                f"num_samples {msg.num_samples}, expected {cfg.samples_per_client}",
            )

        self.engine = FedAvgEngine(
            initial_weights,
            rng,
            select=lambda rnd, r, connected: self._select(r, connected),
            configure=self._configure,
            reply_type=TrainReply,
            timeout=cfg.timeout,
            min_replies=cfg.min_replies,
            check=check,
            max_upload_norm=cfg.max_upload_norm,
        )

    def _select(self, rng: np.random.Generator, connected: Sequence[ClientId]) -> list[ClientId]:
        """FDML's selection among the registered devices ``connected`` now (none: an empty cohort, a
        round not applied)."""
        groups = connected_groups(self.groups, connected)
        if self.groups and not groups:
            return []
        return select_cohort(groups, self.cfg.clients_per_round, rng)[1]

    def _configure(self, rnd: int, cohort: Sequence[ClientId], weights: np.ndarray) -> dict[ClientId, object]:
        cfg = self.cfg
        request = TrainRequest(rnd, cfg.lr, cfg.samples_per_client, cfg.local_steps, weights)
        return {c: request for c in cohort}

    @property
    def rng(self) -> np.random.Generator:
        """The selection generator."""
        return self.engine.rng

    @property
    def weights(self) -> np.ndarray:
        """The global model's flat parameters (embedding network first, then the head)."""
        return self.engine.weights

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The global weights and the selection generator's state, for a resumed run."""
        return self.engine.state_dict()

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (shape checked)."""
        self.engine.load_state_dict(arrays, meta)

    async def register(
        self, comm: Communicator, *, group_by: str = "phone_model", clients: Sequence[ClientId] | None = None
    ) -> None:
        """Registration, as FDML's step 1 (``clients``: only these, into the existing groups, as
        :meth:`FDMLServer.register <fedveil.protocols.fdml.FDMLServer.register>`)."""
        groups, _ = await register_clients(comm, "fedavg", group_by=group_by, clients=clients)
        self.groups = groups if clients is None else rejoin_groups(self.groups, groups, clients)

    async def run_round(self, rnd: int, comm: Communicator) -> RoundReport:
        """Select among the connected devices, train locally, average."""
        return await self.engine.run_round(rnd, comm)


STEP_CHUNK = 4
"""Devices whose weight gradients :meth:`FedAvgClients._traced_sgd_step` computes at a time (a layer's
buffer of them stays in cache: 3.7 MB for the TouchAuth net's last layer)."""


class FedAvgClients:
    """Devices of FL-traditional: ``local_steps`` of SGD on cross-entropy with their own class label.

    Local training is the engine's (:func:`~fedveil.protocols.local.local_train`, or
    :func:`~fedveil.protocols.local.local_train_cohort` when ``batched``: all addressed devices together);
    both paths give equal numbers (``tests/test_protocols_fedavg.py``).

    The paper's FL-traditional devices take one step per round (FDML Sec. VIII-B1). When ``batched``
    devices that received the same weights take that single step, and the model is an
    :class:`EmbeddingClassifier` whose embedding writes out its own backward pass (``trace`` and
    ``layer_deltas``, as :class:`~fedveil.models.touchauth.TouchAuthNet`), the step is
    :meth:`_traced_sgd_step`: one forward and one backward pass for the whole cohort, instead of
    ``vmap`` over per-device autograd, with the same numbers (tested). ``written_backward=False`` always
    takes the ``vmap`` path (the reference in tests and ``benchmarks/fl_traditional_backward.py``).

    With ``encoded_replies`` (the in-process simulation) the devices of such a step reply with their
    messages' bytes: the new weights are written straight into the ``weights`` fields of the cohort's
    :class:`TrainReply` frames (:func:`fedveil.core.codec.encode_frames_with_slot`), which are then
    exactly ``encode`` of the replies (tested), instead of into a matrix that each reply's encoding
    copies again. The runtime meters and decodes them as any reply; a non-finite weight is refused there.

    ``device`` (:func:`~fedveil.models.device.resolve_device`) is where the devices train: the module, each
    round's samples and the received weights move there; the new weights come back as host arrays.
    """

    def __init__(
        self,
        data: ClientData,
        flat: FlatModel,
        *,
        attributes: Mapping[ClientId, Mapping[str, str]],
        seed: int,
        batched: bool = True,
        input_shape: tuple[int, ...] = (1, 30, 10),
        written_backward: bool = True,
        encoded_replies: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        flat.module.to(self.device)
        self.data = data
        self.encoded_replies = encoded_replies
        self.flat = flat
        self.attributes = attributes
        self.ids = list(data.train_user_ids())
        self.label = {cid: i for i, cid in enumerate(self.ids)}
        self.rngs = {cid: client_rng(seed, i) for i, cid in enumerate(self.ids)}
        self.batched = batched
        self.input_shape = input_shape
        module = flat.module
        self.written_backward = (
            written_backward
            and not flat.buffer_names
            and isinstance(module, EmbeddingClassifier)
            and hasattr(module.embedding, "trace")
            and hasattr(module.embedding, "layer_deltas")
        )

    def client_ids(self) -> list[ClientId]:
        """Every device of the population."""
        return self.ids

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Registration or local training for the addressed devices."""
        out: dict[ClientId, object] = {}
        train: dict[ClientId, TrainRequest] = {}
        for cid, m in msgs.items():
            if isinstance(m, RegistrationCall):
                out[cid] = Register("fedavg", dict(self.attributes[cid]))
            elif isinstance(m, TrainRequest):
                train[cid] = m
            else:
                out[cid] = ValidationError(f"device cannot handle {type(m).__name__}")
        if train:
            out.update(self._train(train))
        return out

    def _loss(self, p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.flat(p, x), y)

    def _traced_sgd_step(
        self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One SGD step of each of ``K`` devices from the same weights ``w`` (FDML Sec. VIII-B1's
        FL-traditional iteration) with a written-out backward: ``(K, P)`` new weights, written into
        ``out`` when given (any row stride: the rows may be the weights fields of the replies' frames).

        ``x`` ``(K, n, ...)`` and ``y`` ``(K, n)`` are each device's samples and labels; device ``k``'s loss
        is ``L_k = (1/n) sum_j CE(W_h e_kj + b_h, y_kj)``, ``e = f(x)`` the embedding network. The chain rule,
        for all ``K n`` samples at once:

        - one traced forward pass of the embedding network (:meth:`TouchAuthNet.trace`) and the head's
          logits ``z = W_h e + b_h``;
        - the cross-entropy's derivative ``dL_k/dz_kj = (softmax(z_kj) - onehot(y_kj)) / n``;
        - the head's gradients ``dL_k/dW_h = sum_j (dL_k/dz_kj)^T e_kj``, ``dL_k/db_h = sum_j dL_k/dz_kj``;
        - ``dL_k/de_kj = (dL_k/dz_kj) W_h``, back-propagated through the embedding network
          (:meth:`TouchAuthNet.layer_deltas`) to every affine layer's input ``h`` and output derivative
          ``δ``, whose per-device gradients are ``sum δ^T h`` and ``sum δ`` over the device's own samples.

        The step is ``LocalOptimizer(lr=lr)``'s first (plain SGD, ``p - lr g``): a few devices at a time,
        their gradients ``δ^T h`` by one batched matrix product into a cache-sized buffer, then
        ``W - lr g`` written straight into their rows of the result, in the flat model's parameter order
        (the embedding's layers, then the head). (One ``baddbmm`` over all devices into the rows, the
        first version, wrote them through a strided fallback: 57 against 48 ms a cohort here.)
        """
        module = self.flat.module
        k, n = y.shape
        self.flat.load_into_module(w.cpu().numpy())
        trace = module.embedding.trace(x.reshape(k * n, *x.shape[2:]))
        params = list(self.flat.unflatten(w).values())
        head_w, head_b = params[-2], params[-1]
        d_logits = torch.softmax(nn.functional.linear(trace.out, head_w, head_b), dim=1)
        d_logits[torch.arange(k * n, device=w.device), y.reshape(-1)] -= 1.0
        d_logits /= n
        layers = module.embedding.layer_deltas(trace, slice(0, k * n), d_logits @ head_w)
        layers.append((trace.out.unsqueeze(1), d_logits.unsqueeze(1)))
        new = torch.empty(k, self.flat.num_params, dtype=w.dtype, device=w.device) if out is None else out
        start = 0
        for (h, delta), weight, bias in zip(layers, params[0::2], params[1::2], strict=True):
            rows, cols = delta.shape[-1], h.shape[-1]
            h_k = h.reshape(k, -1, cols)
            d_k = delta.reshape(k, -1, rows)
            d_t = d_k.transpose(1, 2)
            out_w = new[:, start : start + rows * cols].view(k, rows, cols)
            grads = torch.empty(min(k, STEP_CHUNK), rows, cols, dtype=w.dtype, device=w.device)
            for lo in range(0, k, STEP_CHUNK):
                hi = min(k, lo + STEP_CHUNK)
                torch.bmm(d_t[lo:hi], h_k[lo:hi], out=grads[: hi - lo])
                torch.add(weight.reshape(rows, cols), grads[: hi - lo], alpha=-lr, out=out_w[lo:hi])
            start += rows * cols
            torch.add(bias, d_k.sum(1), alpha=-lr, out=new[:, start : start + rows])
            start += rows
        return new

    def _train(self, msgs: Mapping[ClientId, TrainRequest]) -> dict[ClientId, object]:
        weights: dict[int, torch.Tensor] = {}
        data = {}
        for cid, m in msgs.items():
            if id(m.weights) not in weights:  # devices sent the same array share one copy
                weights[id(m.weights)] = as_tensor(m.weights).to(self.device)
            x = self.data.sample_training(cid, m.num_samples, self.rngs[cid])
            x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(
                m.num_samples, *self.input_shape
            )
            labels = torch.full((m.num_samples,), self.label[cid], dtype=torch.long)
            data[cid] = (x.to(self.device), labels.to(self.device))
        new: dict[ClientId, np.ndarray] = {}
        replies: dict[ClientId, memoryview] = {}
        if self.batched:
            groups: dict[tuple[int, int, float, int, int], list[ClientId]] = {}
            for cid, m in msgs.items():
                key = (id(m.weights), m.num_samples, m.lr, m.local_steps, m.round)
                groups.setdefault(key, []).append(cid)
            for (wid, samples, lr, steps, rnd), group in groups.items():
                batch = (torch.stack([data[c][0] for c in group]), torch.stack([data[c][1] for c in group]))
                if steps == 1 and self.written_backward and self.encoded_replies:
                    replies.update(self._encoded_step(group, rnd, samples, weights[wid], batch, lr))
                    continue
                if steps == 1 and self.written_backward:
                    p = self._traced_sgd_step(weights[wid], *batch, lr)
                else:
                    p = weights[wid].expand(len(group), -1).clone()
                    p, _ = local_train_cohort(self._loss, p, [batch] * steps, LocalOptimizer(lr=lr), lr)
                new.update({c: p[i].detach().cpu().numpy() for i, c in enumerate(group)})
        else:
            for cid, m in msgs.items():
                p0 = weights[id(m.weights)].clone()
                opt = LocalOptimizer(lr=m.lr)
                p, _ = local_train(self._loss, p0, [data[cid]] * m.local_steps, opt, m.lr)
                new[cid] = p.detach().cpu().numpy()
        return {
            cid: replies[cid] if cid in replies else TrainReply(m.round, m.num_samples, new[cid])
            for cid, m in msgs.items()
        }

    def _encoded_step(
        self,
        group: list[ClientId],
        rnd: int,
        samples: int,
        w: torch.Tensor,
        batch: tuple[torch.Tensor, torch.Tensor],
        lr: float,
    ) -> dict[ClientId, memoryview]:
        """:meth:`_traced_sgd_step` for ``group``, its new weights written into the ``weights`` fields of
        the devices' :class:`TrainReply` frames: each device's reply is the bytes of its message (computed
        on the device, then copied into the frames, when the device is not the host)."""
        template = TrainReply(rnd, samples, np.zeros(self.flat.num_params, np.float32))
        frames, slots = codec.encode_frames_with_slot(template, "weights", len(group))
        target = torch.from_numpy(slots.view(np.float32))
        if w.device == target.device:
            self._traced_sgd_step(w, *batch, lr, out=target)
        else:
            target.copy_(self._traced_sgd_step(w, *batch, lr))
        return {cid: memoryview(frames[i]) for i, cid in enumerate(group)}
