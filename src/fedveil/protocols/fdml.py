"""FDML: federated deep metric learning with a split model.

Devices hold the embedding network and their data; the server computes the triplet loss and the
derivative of the loss w.r.t. every embedding inside its enclave (Alg. 1), sends each device the
derivatives of its own embeddings, and aggregates the devices' local gradients by Eq. 2 before an
Adam step (Fig. 2, steps 1-9). Rounds follow Alg. 3: a round restarts with a new selection when
fewer than ``num_required`` embeddings arrive in time, and continues once
``ceil(num_required * rate_p)`` gradients arrived or the gradient timeout fires.

Exception handling for Table II: ``on_missing_gradients="continue"`` is Strategy-UC (update while
more than two participants are on schedule, ``min_gradients = 3``), ``"abandon"`` is Strategy-AS
(give the round up as soon as one selected participant's gradient is missing).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.func import grad, vmap

from fedveil.core import codec
from fedveil.core.communicator import ClientId, Communicator, Deferred
from fedveil.enclave.aggregate import aggregate_gradients, check_upload
from fedveil.enclave.channel import sealed_array_bytes, sealed_vector_bytes
from fedveil.enclave.dp import private_derivatives
from fedveil.enclave.triplet import loss_and_derivatives, magnitude_limit, unusable_rows
from fedveil.errors import ConfigError, FedveilError, ValidationError
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.protocols.common import (
    ClientData,
    RoundReport,
    as_tensor,
    client_rng,
    connected_groups,
    expect,
    fill_traffic,
    select_group_cohort,
)
from fedveil.protocols.messages import (
    BackpropRequest,
    EmbedReply,
    EmbedRequest,
    GradReply,
    Register,
    RegistrationCall,
    SealedBackpropRequest,
    SealedEmbedReply,
    SealedGradReply,
    SessionOffer,
    SessionReady,
    sealed_record,
)
from fedveil.protocols.registration import attest_clients, register_clients, rejoin_groups
from fedveil.protocols.settings import FDMLConfig

if TYPE_CHECKING:
    from fedveil.protocols.enclave_relay import AggregateStream

log = logging.getLogger(__name__)


@dataclass
class StepFive:
    """What the enclave released in step 5: the ``loss`` and number of ``active`` triplets (to the
    host), one step-6 message per accepted device (``requests``), the devices it ``rejected``, and, to
    watch training, the ``active_fraction`` of valid triplets and the ``valid_loss`` over all of them
    (:class:`~fedveil.enclave.triplet.TripletResult`; :mod:`fedveil.enclave.service` says what they
    reveal)."""

    loss: float
    active: int
    requests: dict[ClientId, object]
    rejected: dict[ClientId, str] = field(default_factory=dict)
    active_fraction: float = 0.0
    valid_loss: float = 0.0


@dataclass(frozen=True)
class UploadSpec:
    """What every device's uploads must be, known from the model and the round settings (never from
    another device's reply): ``samples`` embeddings of width ``embedding_dim`` in step 4, a local
    gradient of ``num_params`` values in step 8 whose L2 norm is at most ``max_norm``
    (:func:`~fedveil.enclave.aggregate.check_upload`)."""

    samples: int
    embedding_dim: int
    num_params: int
    max_norm: float


class Enclave(Protocol):
    """The server's trusted part, seen from the host: step 5 (loss and derivatives) and step 9 (Eq. 2).

    ``embed_reply`` and ``grad_reply`` are the message types devices upload in steps 4 and 8 (plain
    arrays, or records sealed to the enclave); ``check_embed`` / ``check_grad`` are what the host can
    validate of them before handing them on, against the :class:`UploadSpec` that the server which owns
    the enclave fixed with ``expect``; ``open_session`` answers a device's attestation hello
    (``None`` where there is nothing to attest).
    """

    embed_reply: type
    grad_reply: type
    attested: bool

    def expect(self, uploads: UploadSpec) -> None: ...

    def open_session(self, client_hello: bytes) -> bytes: ...

    def check_embed(self, msg: Any) -> None: ...

    def check_grad(self, msg: Any) -> None: ...

    def step_five(self, rnd: int, attempt: int, replies: Mapping[ClientId, Any]) -> StepFive: ...

    def gradient_stream(self, rnd: int, attempt: int) -> Any: ...

    def step_nine(
        self, rnd: int, attempt: int, replies: Mapping[ClientId, Any], stream: Any = None
    ) -> tuple[np.ndarray | None, dict[ClientId, str]]: ...


@dataclass(frozen=True)
class DPRelease:
    """FDML Alg. 2 settings: embedding ``drop_rate`` r, clipping bound ``bound_T`` (per coordinate in
    ``paper`` mode, per vector in L1 in ``strict`` mode) and Laplace scale ``noise_b``
    (see :mod:`fedveil.enclave.dp` for the mechanism, sensitivity and neighbouring relation)."""

    mode: str
    bound_T: float
    noise_b: float
    drop_rate: float


class _Expecting:
    """The :class:`UploadSpec` an enclave checks uploads against, fixed by the server that owns it."""

    _uploads: UploadSpec | None = None

    def expect(self, uploads: UploadSpec) -> None:
        """Check every later upload against ``uploads``."""
        self._uploads = uploads

    @property
    def uploads(self) -> UploadSpec:
        """The spec fixed by :meth:`expect`."""
        if self._uploads is None:
            raise ConfigError("this enclave does not know what uploads to expect: FDMLServer calls expect()")
        return self._uploads


class LocalEnclave(_Expecting):
    """The enclave maths called in the server's own process, on plaintext messages: no boundary, no
    attestation (``enclave.boundary: none``; :class:`AttestedEnclave` is the emulated TEE).

    With ``dp`` set, step 5 is Alg. 2: drop, Alg. 1 on the kept embeddings, clip, Laplace noise,
    drawn from ``rng`` (the enclave's own seeded stream).
    """

    embed_reply = EmbedReply
    grad_reply = GradReply
    attested = False

    def __init__(
        self,
        *,
        margin: float,
        strategy: str,
        memory_limit_bytes: int | None = 96 * 2**20,
        dp: DPRelease | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        if dp is not None and rng is None:
            raise ConfigError("a DP release needs the enclave's random generator (rng)")
        self.margin = margin
        self.strategy = strategy
        self.memory_limit_bytes = memory_limit_bytes
        self.dp = dp
        self.rng = rng

    def open_session(self, client_hello: bytes) -> bytes:
        """There is no enclave to attest: a device that asks for one is refused."""
        raise ValidationError("this server runs no attested enclave (enclave.boundary is none)")

    def check_embed(self, msg: EmbedReply) -> None:
        """The host sees the embeddings: their shape must be ``(samples, embedding_dim)`` and Alg. 1 must
        accept them (:func:`~fedveil.enclave.triplet.unusable_rows`, the limit Alg. 1 applies), so one
        device's embeddings cannot make step 5 fail for the others."""
        shape = (self.uploads.samples, self.uploads.embedding_dim)
        emb = msg.embeddings
        expect(emb.shape == shape, f"embeddings of shape {emb.shape}, expected {shape}")
        non_finite, too_large = unusable_rows(emb)
        expect(not non_finite.any(), "embeddings contain NaN or infinity")
        if too_large.any():
            raise ValidationError(
                f"embeddings reach magnitude {float(np.abs(emb).max()):.3g}, at or above "
                f"{float(magnitude_limit(emb.dtype, shape[1])):.3g}: too large for float32 squared distances"
            )

    def check_grad(self, msg: GradReply) -> None:
        """The gradient must be a ``(num_params,)`` vector of L2 norm at most ``max_norm``."""
        size = self.uploads.num_params
        expect(msg.gradient.shape == (size,), f"gradient of shape {msg.gradient.shape}, expected {(size,)}")
        check_upload(msg.gradient, self.uploads.max_norm)

    def step_five(self, rnd: int, attempt: int, replies: Mapping[ClientId, EmbedReply]) -> StepFive:
        """Alg. 1 (or Alg. 2) on the stacked embeddings, labelled by the device that uploaded them."""
        order = list(replies)
        stacked = np.concatenate([replies[c].embeddings for c in order])
        counts = [len(replies[c].embeddings) for c in order]
        labels = np.repeat(np.arange(len(order)), counts)
        result: dict[str, float] = {"loss": 0.0, "active": 0, "fraction": 0.0, "valid_loss": 0.0}

        def alg1(emb: np.ndarray, lab: np.ndarray) -> np.ndarray:
            res = loss_and_derivatives(
                emb,
                lab,
                margin=self.margin,
                strategy=self.strategy,
                memory_limit_bytes=self.memory_limit_bytes,
            )
            result["loss"], result["active"] = float(res.loss), int(res.num_active)
            result["fraction"], result["valid_loss"] = res.active_fraction, res.valid_loss
            return res.derivatives

        if self.dp is None:
            released = alg1(stacked, labels)
        else:
            released, _ = private_derivatives(
                stacked,
                labels,
                alg1,
                drop_rate=self.dp.drop_rate,
                mode=self.dp.mode,
                bound_T=self.dp.bound_T,
                noise_b=self.dp.noise_b,
                rng=self.rng,
            )
        blocks = np.split(released.astype(np.float32, copy=False), np.cumsum(counts)[:-1])
        requests = {c: BackpropRequest(rnd, attempt, d) for c, d in zip(order, blocks, strict=True)}
        return StepFive(
            result["loss"],
            int(result["active"]),
            requests,
            active_fraction=result["fraction"],
            valid_loss=result["valid_loss"],
        )

    def gradient_stream(self, rnd: int, attempt: int) -> None:
        """Nothing to stream to: step 9 runs here, on the host's own cores."""
        return None

    def step_nine(
        self, rnd: int, attempt: int, replies: Mapping[ClientId, GradReply], stream: None = None
    ) -> tuple[np.ndarray | None, dict[ClientId, str]]:
        """Eq. 2 over the gradients that arrived (each checked by :meth:`check_grad`)."""
        g = aggregate_gradients(
            {c: m.gradient for c, m in replies.items()}, {c: m.num_samples for c, m in replies.items()}
        )
        return g, {}


class AttestedEnclave(_Expecting):
    """The emulated TEE seen from the untrusted host: every embedding, derivative and gradient crosses
    the host as a record sealed between one device and the enclave (X25519 -> HKDF -> AES-256-GCM),
    and the host only relays bytes to :class:`fedveil.runtime.enclave_host.EnclaveHost`, which runs the
    enclave in its own process (or in-process for tests). The host can check only a record's length
    (exactly that of the expected shape); the enclave checks the shape, values and norm inside.
    """

    embed_reply = SealedEmbedReply
    grad_reply = SealedGradReply
    attested = True

    def __init__(self, host: Any) -> None:
        self.host = host

    def open_session(self, client_hello: bytes) -> bytes:
        """Relay a device's hello to the enclave; return its key and quote for the device."""
        return self.host.open_session(client_hello)

    def check_embed(self, msg: SealedEmbedReply) -> None:
        """Only a record of exactly the length of sealed ``(samples, embedding_dim)`` float32 embeddings
        can hold the right ones: another number of rows is refused here, in step 4."""
        shape = (self.uploads.samples, self.uploads.embedding_dim)
        want = sealed_array_bytes(shape)
        expect(
            len(msg.record) == want,
            f"sealed embeddings of {len(msg.record)} bytes; embeddings of shape {shape} seal to {want}",
        )

    def check_grad(self, msg: SealedGradReply) -> None:
        """Likewise for a sealed gradient of ``num_params`` float32 (its norm is checked inside)."""
        want = sealed_vector_bytes(self.uploads.num_params)
        expect(
            len(msg.record) == want,
            f"sealed gradient of {len(msg.record)} bytes; {self.uploads.num_params} values seal to {want}",
        )

    def step_five(self, rnd: int, attempt: int, replies: Mapping[ClientId, SealedEmbedReply]) -> StepFive:
        """The enclave opens the records, runs Alg. 1 (or Alg. 2), seals each device's derivatives."""
        res = self.host.loss_and_derivatives(
            rnd,
            {c: m.record for c, m in replies.items()},
            shape=(self.uploads.samples, self.uploads.embedding_dim),
            attempt=attempt,
        )
        requests = {
            c: SealedBackpropRequest(rnd, attempt, sealed_record(rec)) for c, rec in res.derivatives.items()
        }
        return StepFive(
            res.loss or 0.0,
            res.num_active,
            requests,
            dict(res.rejected),
            active_fraction=res.active_fraction,
            valid_loss=res.valid_loss or 0.0,
        )

    def gradient_stream(self, rnd: int, attempt: int) -> AggregateStream | None:
        """A step-9 stream the host feeds each valid gradient record as it arrives, so that the
        enclave sums the first requests while the rest are still coming in
        (:meth:`~fedveil.runtime.enclave_host.EnclaveHost.aggregate_stream`), bounded by an honest
        record's length (the only length :meth:`check_grad` lets through)."""
        make = getattr(self.host, "aggregate_stream", None)
        if make is None:
            return None
        size = self.uploads.num_params
        return make(
            rnd, sealed_vector_bytes(size), size=size, max_norm=self.uploads.max_norm, attempt=attempt
        )

    def step_nine(
        self,
        rnd: int,
        attempt: int,
        replies: Mapping[ClientId, SealedGradReply],
        stream: AggregateStream | None = None,
    ) -> tuple[np.ndarray | None, dict[ClientId, str]]:
        """The enclave opens the gradient records and releases only their Eq. 2 aggregate: from
        ``stream`` when it was fed exactly ``replies``, in order (the same requests as the direct call,
        so the same numbers), else by the direct call over ``replies``."""
        if stream is not None and stream.clients == list(replies):
            res = stream.finish()
        else:
            if stream is not None:
                stream.abort()
            res = self.host.aggregate(
                rnd,
                {c: m.record for c, m in replies.items()},
                {c: m.num_samples for c, m in replies.items()},
                size=self.uploads.num_params,
                max_norm=self.uploads.max_norm,
                attempt=attempt,
            )
        return res.gradient, dict(res.rejected)


class FDMLServer:
    """The cloud side of FDML: registration, selection, Alg. 3 rounds, Adam on the global network."""

    def __init__(
        self,
        cfg: FDMLConfig,
        initial_weights: np.ndarray,
        embedding_dim: int,
        enclave: Enclave,
        rng: np.random.Generator,
    ) -> None:
        self.cfg = cfg
        self.embedding_dim = embedding_dim
        self.enclave = enclave
        self.rng = rng
        self.params = torch.nn.Parameter(as_tensor(initial_weights))
        enclave.expect(
            UploadSpec(cfg.samples_per_client, embedding_dim, int(self.params.numel()), cfg.max_upload_norm)
        )
        self.optimizer = torch.optim.Adam([self.params], lr=cfg.lr)
        self.groups: dict[str, list[ClientId]] = {}
        self.before_release: Callable[[int], None] | None = None
        """Called with the round number right before the enclave releases step-5 derivatives, so a
        privacy spend is recorded durably before the release it pays for leaves the enclave."""

    @property
    def weights(self) -> np.ndarray:
        """The global embedding network's flat parameters (a copy)."""
        return self.params.detach().numpy().copy()

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything a resumed run needs: weights and Adam's moments (arrays), Adam's step count and
        the selection generator's state (JSON-ready)."""
        arrays = {"weights": self.weights}
        meta: dict[str, Any] = {"rng": self.rng.bit_generator.state, "adam_step": None}
        state = self.optimizer.state.get(self.params)
        if state:
            arrays["adam_exp_avg"] = state["exp_avg"].numpy().copy()
            arrays["adam_exp_avg_sq"] = state["exp_avg_sq"].numpy().copy()
            meta["adam_step"] = float(state["step"])
        return arrays, meta

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (shapes checked)."""
        weights = np.asarray(arrays["weights"], dtype=np.float32)
        if weights.shape != tuple(self.params.shape):
            raise ConfigError(
                f"checkpoint weights of shape {weights.shape}, model has {tuple(self.params.shape)}"
            )
        with torch.no_grad():
            self.params.copy_(torch.from_numpy(weights.copy()))
        self.rng.bit_generator.state = dict(meta["rng"])
        self.optimizer.state.clear()
        if meta.get("adam_step") is not None:
            self.optimizer.state[self.params] = {
                "step": torch.tensor(float(meta["adam_step"])),
                "exp_avg": torch.from_numpy(np.array(arrays["adam_exp_avg"], dtype=np.float32)),
                "exp_avg_sq": torch.from_numpy(np.array(arrays["adam_exp_avg_sq"], dtype=np.float32)),
            }

    async def register(
        self,
        comm: Communicator,
        *,
        group_by: str = "phone_model",
        timeout: float = 60.0,
        clients: Sequence[ClientId] | None = None,
    ) -> None:
        """Step 1: gather registrations and group the devices by ``group_by`` (the phone model).

        With an attested enclave, each device's hello goes to the enclave and the enclave's quote back
        to the device; a device that does not verify it (or sent no hello) is not selected.
        ``clients``: register only these (devices that joined or reconnected during the run: a device
        whose agent restarted has a new session, which must attest afresh) into the existing groups
        (:func:`~fedveil.protocols.registration.rejoin_groups`).
        """
        groups, regs = await register_clients(
            comm, "fdml", group_by=group_by, timeout=timeout, clients=clients
        )
        if self.enclave.attested:
            done = await attest_clients(comm, self.enclave.open_session, regs, "fdml", timeout=timeout)
            groups = {g: [c for c in members if c in done] for g, members in groups.items()}
            groups = {g: members for g, members in groups.items() if members}
            if not groups and clients is None:
                raise ConfigError("no device completed attestation with the enclave; nothing to train")
        self.groups = groups if clients is None else rejoin_groups(self.groups, groups, clients)

    def _round_check(self, rnd: int, attempt: int) -> Callable[[ClientId, Any], None]:
        def check(cid: ClientId, msg: Any) -> None:
            expect(
                (msg.round, msg.attempt) == (rnd, attempt),
                f"reply for round {msg.round} attempt {msg.attempt}, expected {rnd} attempt {attempt}",
            )

        return check

    async def run_round(self, rnd: int, comm: Communicator) -> RoundReport:
        """One training round: Fig. 2 steps 2-9 under Alg. 3."""
        cfg = self.cfg
        before = comm.stats().copy()
        n = cfg.samples_per_client
        weights = self.weights
        embeds: dict[ClientId, Any] = {}
        attempt = 0
        required = cfg.num_required
        while attempt < cfg.max_attempts:
            attempt += 1
            # only connected devices are selected: one whose agent is down would only be a dropout
            groups = connected_groups(self.groups, comm.available())
            if not groups:
                log.info("round %d attempt %d: no registered device is connected", rnd, attempt)
                embeds = {}
                continue
            _, cohort = select_group_cohort(groups, cfg.num_addressed, self.rng)
            required = min(cfg.num_required, len(cohort))
            request = EmbedRequest(rnd, attempt, n, weights)
            same_round = self._round_check(rnd, attempt)

            def check_embed(cid: ClientId, msg: Any, same_round: Callable[..., None] = same_round) -> None:
                same_round(cid, msg)
                self.enclave.check_embed(msg)

            embeds = await comm.request(
                {c: request for c in cohort},
                phase="embed",
                min_replies=required,
                timeout=cfg.t_embed,
                expected=self.enclave.embed_reply,
                validate=check_embed,
            )
            if len(embeds) >= required:
                break
        else:
            return fill_traffic(RoundReport(rnd, False, None, attempt, len(embeds), 0), before, comm.stats())

        if self.before_release is not None:
            self.before_release(rnd)
        five = self.enclave.step_five(rnd, attempt, embeds)
        same_round = self._round_check(rnd, attempt)
        num_params = int(self.params.numel())
        stream = self.enclave.gradient_stream(rnd, attempt) if five.requests else None

        def check_grad(cid: ClientId, msg: Any) -> None:
            same_round(cid, msg)
            expect(msg.num_samples == n, f"num_samples {msg.num_samples}, expected {n}")
            self.enclave.check_grad(msg)
            # a valid reply goes on to the enclave at once (step 9 overlaps the rest of the uploads);
            # step_nine checks that the stream saw exactly the replies the round kept
            if stream is not None:
                stream.add(cid, msg.record, msg.num_samples)

        try:
            grads = await comm.request(
                five.requests,
                phase="grad",
                min_replies=min(cfg.num_gradients, len(five.requests)),
                timeout=cfg.t_grad,
                expected=self.enclave.grad_reply,
                validate=check_grad,
            )
        except BaseException:
            if stream is not None:
                # collect what the enclave owes for the requests already submitted, so the host's
                # channel to it stays in step; the gradient phase's own error is the one to report
                with contextlib.suppress(Exception):
                    stream.abort()
            raise
        missing = len(embeds) - len(grads)
        applied = len(grads) >= cfg.min_gradients and not (cfg.on_missing_gradients == "abandon" and missing)
        rejected = dict(five.rejected)
        if not applied and stream is not None:
            stream.abort()
        if applied:
            g, late_rejects = self.enclave.step_nine(rnd, attempt, grads, stream)
            rejected.update(late_rejects)
            applied = g is not None and len(grads) - len(late_rejects) >= cfg.min_gradients
            if applied and not _usable_aggregate(g, num_params):
                log.error(
                    "round %d not applied: step 9 released an aggregate of shape %s (finite: %s), "
                    "the model has %d parameters",
                    rnd,
                    np.shape(g),
                    bool(np.isfinite(g).all()),
                    num_params,
                )
                applied = False
            if applied:
                self.optimizer.zero_grad(set_to_none=False)
                self.params.grad = torch.from_numpy(np.asarray(g, dtype=np.float32).copy())
                self.optimizer.step()
        for cid, why in rejected.items():
            log.info("enclave rejected device %s in round %d: %s", cid, rnd, why)
        report = RoundReport(
            rnd,
            applied,
            five.loss,
            attempt,
            len(embeds),
            len(grads),
            extra={
                "active_triplets": five.active,
                "active_fraction": five.active_fraction,
                "valid_loss": five.valid_loss,
                "enclave_rejected": len(rejected),
            },
        )
        return fill_traffic(report, before, comm.stats())


def _usable_aggregate(g: np.ndarray, num_params: int) -> bool:
    """Whether step 9's aggregate can be Adam's gradient: ``num_params`` finite values. Every upload was
    checked against the model's shape and the norm bound, so anything else is an enclave fault; a round
    is then not applied rather than the optimizer failing or its moments turning infinite."""
    g = np.asarray(g)
    return g.shape == (num_params,) and bool(np.isfinite(g).all())


def _sealed_grad_frame(
    session: Any, rnd: int, attempt: int, count: int, gradient: np.ndarray | tuple[np.ndarray, ...]
) -> memoryview:
    """A :class:`SealedGradReply` as the bytes a device sends, its gradient sealed straight into the
    message's record field (:func:`fedveil.core.codec.encode_with_slot`): the bytes of
    ``encode(SealedGradReply(rnd, attempt, count, seal_gradient(...)))`` without copying the record."""
    size = sum(p.size for p in gradient) if isinstance(gradient, tuple) else np.asarray(gradient).size
    placeholder = np.empty(sealed_vector_bytes(size), np.uint8)
    frame, slot = codec.encode_with_slot(SealedGradReply(rnd, attempt, count, placeholder), "record")
    session.seal_gradient(rnd, gradient, attempt=attempt, out=slot)
    return frame


class FDMLClients:
    """The device side of FDML for a simulated population (steps 3 and 7).

    Each device samples its round's training samples with its own seeded generator and random-start
    augmentation, embeds them with the received global network, and later back-propagates the
    received derivatives through the same network to its local gradient. ``batched=True`` computes
    a phase for all addressed devices together (one forward pass; per-device gradients with
    ``torch.func.vmap``); ``batched=False`` runs them one by one. Both give equal numbers
    (``tests/test_protocols_fdml.py``).

    ``device`` (:func:`~fedveil.models.device.resolve_device`) is where the embedding network runs its
    forward and backward passes: the module moves there, each round's samples and the received weights and
    derivatives move there, and embeddings and gradients come back to host numpy arrays before they are
    sealed for the enclave (which stays on the CPU).
    """

    def __init__(
        self,
        data: ClientData,
        flat: FlatModel,
        *,
        attributes: Mapping[ClientId, Mapping[str, str]],
        seed: int,
        batched: bool = True,
        input_shape: Sequence[int] = (1, 30, 10),
        sessions: Mapping[ClientId, Any] | None = None,
        defer_uploads: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        flat.module.to(self.device)
        self.sessions = dict(sessions) if sessions is not None else None
        self.defer_uploads = defer_uploads
        self.data = data
        self.flat = flat
        self.attributes = attributes
        self.ids = list(data.train_user_ids())
        self.rngs = {cid: client_rng(seed, i) for i, cid in enumerate(self.ids)}
        self.batched = batched
        self.input_shape = tuple(input_shape)
        self._pending: dict[ClientId, _Pending] = {}

    def client_ids(self) -> list[ClientId]:
        """Every device of the population."""
        return self.ids

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Dispatch one phase's messages to the devices' handlers; a device's error is its reply."""
        out: dict[ClientId, object] = {}
        by_type: dict[type, dict[ClientId, Any]] = {}
        for cid, msg in msgs.items():
            by_type.setdefault(type(msg), {})[cid] = msg
        for kind, group in by_type.items():
            if kind is RegistrationCall:
                out.update({c: self._register(c) for c in group})
            elif kind is SessionOffer:
                out.update({c: self._attest(c, m) for c, m in group.items()})
            elif kind is EmbedRequest:
                out.update(self._embed(group))
            elif kind in (BackpropRequest, SealedBackpropRequest):
                out.update(self._backprop(group))
            else:
                out.update({c: ValidationError(f"device cannot handle {kind.__name__}") for c in group})
        return out

    def _register(self, cid: ClientId) -> Register:
        """Step 1; with an enclave, every registration opens a new attested session (a restarted
        server runs a new enclave, which the device must attest afresh)."""
        hello = None
        if self.sessions is not None:
            if self.sessions[cid].used:
                self.sessions[cid] = self.sessions[cid].renewed()
            hello = self.sessions[cid].hello()
        return Register("fdml", dict(self.attributes[cid]), hello)

    def _attest(self, cid: ClientId, msg: SessionOffer) -> object:
        """Verify the enclave's quote (platform signature, measurement, own nonce) before anything else."""
        if self.sessions is None:
            return ValidationError("this device was not set up for an attested enclave")
        try:
            self.sessions[cid].establish(msg.server_hello)
        except FedveilError as exc:
            return exc
        return SessionReady("fdml")

    def _inputs(self, cid: ClientId, n: int) -> torch.Tensor:
        x = self.data.sample_training(cid, n, self.rngs[cid])
        x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(n, *self.input_shape)
        return x.to(self.device)

    def _embed(self, msgs: Mapping[ClientId, EmbedRequest]) -> dict[ClientId, object]:
        # Rounds and attempts only move forward: what a device kept for an earlier one can no longer be
        # asked for (Alg. 3 ends a round before the next starts). Without this, the devices whose
        # gradients were not waited for (rate_p < 1, upload failures) kept their inputs and the whole
        # cohort's traced activations alive until they were next selected: gigabytes over a run.
        newest = max((m.round, m.attempt) for m in msgs.values())
        self._pending = {c: p for c, p in self._pending.items() if (p.round, p.attempt) >= newest}
        params: dict[int, torch.Tensor] = {}
        xs = {}
        for cid, m in msgs.items():
            if id(m.weights) not in params:
                params[id(m.weights)] = as_tensor(m.weights).to(self.device)
            xs[cid] = self._inputs(cid, m.num_samples)
        embs: dict[ClientId, np.ndarray] = {}
        traced: dict[ClientId, tuple[object, torch.Tensor]] = {}
        module = self.flat.module
        if self.batched and len(params) == 1:
            p = next(iter(params.values()))
            order = list(msgs)
            x = torch.cat([xs[c] for c in order])
            if hasattr(module, "trace"):
                self.flat.load_into_module(p.cpu().numpy())
                trace = module.trace(x)
                emb = trace.out.cpu().numpy()
            else:
                with torch.no_grad():
                    emb = self.flat(p, x).cpu().numpy()
            bounds = np.cumsum([0] + [len(xs[c]) for c in order])
            for i, cid in enumerate(order):
                embs[cid] = emb[bounds[i] : bounds[i + 1]]
                if hasattr(module, "trace"):
                    traced[cid] = (trace, torch.arange(bounds[i], bounds[i + 1], device=self.device))
        else:
            with torch.no_grad():
                embs = {
                    cid: self.flat(params[id(m.weights)], xs[cid]).cpu().numpy() for cid, m in msgs.items()
                }
        out: dict[ClientId, object] = {}
        for cid, m in msgs.items():
            trace, rows = traced.get(cid, (None, None))
            self._pending[cid] = _Pending(
                m.round, m.attempt, xs[cid], params[id(m.weights)], embs[cid].shape, trace, rows
            )
            if self.sessions is None:
                out[cid] = EmbedReply(m.round, m.attempt, embs[cid])
            else:
                out[cid] = self._sealed(
                    cid,
                    lambda s, m=m, e=embs[cid]: SealedEmbedReply(
                        m.round, m.attempt, sealed_record(s.seal_embeddings(m.round, e, attempt=m.attempt))
                    ),
                )
        return out

    def _sealed(self, cid: ClientId, build: Callable[[Any], object]) -> object:
        """A message built with the device's enclave session, or the session's refusal as the reply."""
        try:
            return build(self.sessions[cid])
        except FedveilError as exc:
            return exc

    def _backprop(self, msgs: Mapping[ClientId, Any]) -> dict[ClientId, object]:
        out: dict[ClientId, object] = {}
        ready: dict[ClientId, _Pending] = {}
        derivs: dict[ClientId, torch.Tensor] = {}
        for cid, m in msgs.items():
            pending = self._pending.pop(cid, None)
            if pending is None or (pending.round, pending.attempt) != (m.round, m.attempt):
                out[cid] = ValidationError(
                    f"derivatives for round {m.round} attempt {m.attempt} without embeddings"
                )
                continue
            d = self._open_derivatives(cid, m)
            if isinstance(d, Exception):
                out[cid] = d
            elif d.shape != pending.shape:
                out[cid] = ValidationError(f"derivatives of shape {d.shape}, embeddings {pending.shape}")
            else:
                ready[cid] = pending
                derivs[cid] = as_tensor(d).to(self.device)
        if self.batched:
            grads = self._batched_gradients(ready, derivs)
        else:
            grads = {cid: self._one_gradient(p.weights, p.inputs, derivs[cid]) for cid, p in ready.items()}
        for cid, g in grads.items():
            m, count = msgs[cid], len(ready[cid].inputs)
            if self.sessions is None:
                out[cid] = GradReply(
                    m.round, m.attempt, count, np.concatenate(g) if isinstance(g, tuple) else g
                )
            else:

                def upload(cid: ClientId = cid, m: Any = m, g: Any = g, count: int = count) -> object:
                    return self._sealed(
                        cid,
                        lambda s: SealedGradReply(
                            m.round,
                            m.attempt,
                            count,
                            sealed_record(s.seal_gradient(m.round, g, attempt=m.attempt)),
                        ),
                    )

                def encoded(cid: ClientId = cid, m: Any = m, g: Any = g, count: int = count) -> object:
                    return self._sealed(cid, lambda s: _sealed_grad_frame(s, m.round, m.attempt, count, g))

                out[cid] = Deferred(encoded) if self.defer_uploads else upload()
        return out

    def _open_derivatives(self, cid: ClientId, msg: Any) -> np.ndarray | Exception:
        """The derivatives of a plain request, or those the enclave sealed to this device alone."""
        if isinstance(msg, BackpropRequest):
            if self.sessions is not None:
                return ValidationError("plaintext derivatives refused: this device only talks to the enclave")
            return msg.derivatives
        if self.sessions is None:
            return ValidationError("sealed derivatives, but this device has no enclave session")
        try:
            return self.sessions[cid].open_derivatives(msg.round, msg.record, attempt=msg.attempt)
        except FedveilError as exc:
            return exc

    def _one_gradient(self, weights: torch.Tensor, x: torch.Tensor, d: torch.Tensor) -> np.ndarray:
        """Step 7 for one device: d/dθ of sum_j <dL/de_j, e_j(θ)>, by autograd."""
        p = weights.detach().clone().requires_grad_(True)
        self.flat(p, x).backward(d)
        return p.grad.cpu().numpy()

    def _batched_gradients(
        self, ready: Mapping[ClientId, _Pending], derivs: Mapping[ClientId, torch.Tensor]
    ) -> dict[ClientId, np.ndarray | tuple[np.ndarray, ...]]:
        """Step 7 for many devices at once.

        Devices whose step-4 forward pass was traced (a model with ``trace``/``group_gradient_pieces``,
        such as ``TouchAuthNet``) get their gradients from that trace in one written-out backward pass,
        each as its consecutive per-parameter pieces; any other model is run under ``vmap(grad(...))``
        over devices.
        """
        groups: dict[tuple[int, int], list[ClientId]] = {}
        for cid, p in ready.items():
            groups.setdefault(
                (id(p.trace) if p.trace is not None else id(p.weights), len(p.inputs)), []
            ).append(cid)
        out: dict[ClientId, np.ndarray | tuple[np.ndarray, ...]] = {}
        for group in groups.values():
            first = ready[group[0]]
            ds = torch.cat([derivs[c] for c in group])
            if first.trace is not None:
                rows = torch.cat([ready[c].rows for c in group])
                blocks = self.flat.module.group_gradient_pieces(first.trace, rows, ds, len(group))
                arrays = [b.cpu().numpy() for b in blocks]
                # each device's gradient stays in its rows of the per-parameter blocks: sealing reads them
                # in order, so the (devices, P) matrix is never assembled
                out.update({c: tuple(a[i] for a in arrays) for i, c in enumerate(group)})
            else:
                xs = torch.stack([ready[c].inputs for c in group])
                ds = ds.reshape(len(group), -1, ds.shape[-1])
                g = vmap(grad(self._contribution), in_dims=(None, 0, 0))(first.weights, xs, ds).cpu().numpy()
                out.update({c: g[i] for i, c in enumerate(group)})
        return out

    def _contribution(self, p: torch.Tensor, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """``sum_j <d_j, f_p(x_j)>``: its gradient in ``p`` is a device's local gradient."""
        return (self.flat(p, x) * d).sum()


@dataclass(frozen=True)
class _Pending:
    """What a device keeps between step 4 and step 7 of a round."""

    round: int
    attempt: int
    inputs: torch.Tensor
    weights: torch.Tensor
    shape: tuple[int, ...]
    trace: Any = None
    rows: torch.Tensor | None = None
