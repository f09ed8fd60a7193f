"""Typed messages of the round protocols (FDML Fig. 2 steps 1-8; FedAvg).

Weights and gradients travel as one flat float32 vector (:mod:`fedveil.models.flat`); embeddings and
their derivatives as ``(num_samples, dim)`` float32 matrices. All arrays must be finite.

A record sealed to or by the enclave travels as a uint8 array (:func:`sealed_record`): on the wire the same
bytes as a ``bytes`` field, but decoded as a read-only view of the message rather than a copy (a round's
sealed gradients are 86 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedveil.core.messages import array_field, message


@message("reg.call")
@dataclass(frozen=True)
class RegistrationCall:
    """The server asks reachable devices to register (FDML Fig. 2, step 1)."""

    protocol: str


@message("reg.register")
@dataclass(frozen=True)
class Register:
    """A device registers: the attributes the server selects by (FDML: the phone model), and, when
    the server runs an attested enclave, the device's client hello for it (a fresh nonce and key)."""

    protocol: str
    attributes: dict[str, str]
    hello: bytes | None = None


@message("tee.session_offer")
@dataclass(frozen=True)
class SessionOffer:
    """The enclave's answer to a device's hello, relayed by the host: its key and its quote."""

    server_hello: bytes


@message("tee.session_ready")
@dataclass(frozen=True)
class SessionReady:
    """The device verified the quote (signature, measurement, its nonce) and opened its channel."""

    protocol: str


def sealed_record(data: bytes | bytearray | memoryview) -> np.ndarray:
    """The bytes of a sealed record as the uint8 array the sealed messages carry (a view, not a copy)."""
    return np.frombuffer(data, dtype=np.uint8)


@message("fdml.sealed_embed_reply")
@dataclass(frozen=True)
class SealedEmbedReply:
    """Step 4 through the enclave channel: the embeddings, encrypted to the enclave."""

    round: int
    attempt: int
    record: np.ndarray = array_field(dtype="uint8", ndim=1)


@message("fdml.sealed_backprop_request")
@dataclass(frozen=True)
class SealedBackpropRequest:
    """Step 6 through the enclave channel: the derivatives, encrypted by the enclave to this device."""

    round: int
    attempt: int
    record: np.ndarray = array_field(dtype="uint8", ndim=1)


@message("fdml.sealed_grad_reply")
@dataclass(frozen=True)
class SealedGradReply:
    """Step 8 through the enclave channel: the local gradient, encrypted to the enclave."""

    round: int
    attempt: int
    num_samples: int
    record: np.ndarray = array_field(dtype="uint8", ndim=1)


@message("fdml.embed_request")
@dataclass(frozen=True)
class EmbedRequest:
    """Step 2: the global embedding network and how many training samples to embed."""

    round: int
    attempt: int
    num_samples: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("fdml.embed_reply")
@dataclass(frozen=True)
class EmbedReply:
    """Step 4: the embeddings of the device's training samples of this round."""

    round: int
    attempt: int
    embeddings: np.ndarray = array_field(dtype="float32", ndim=2)


@message("fdml.backprop_request")
@dataclass(frozen=True)
class BackpropRequest:
    """Step 6: d loss / d embedding for each of the embeddings the device uploaded."""

    round: int
    attempt: int
    derivatives: np.ndarray = array_field(dtype="float32", ndim=2)


@message("fdml.grad_reply")
@dataclass(frozen=True)
class GradReply:
    """Step 8: the device's local gradient and its number of training samples (Eq. 2's |d_i|)."""

    round: int
    attempt: int
    num_samples: int
    gradient: np.ndarray = array_field(dtype="float32", ndim=1)


@message("fedavg.train_request")
@dataclass(frozen=True)
class TrainRequest:
    """FedAvg: the global model, the local learning rate, batch size and number of SGD steps."""

    round: int
    lr: float
    num_samples: int
    local_steps: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("fedavg.train_reply")
@dataclass(frozen=True)
class TrainReply:
    """FedAvg: the locally updated model and the number of samples it was trained on."""

    round: int
    num_samples: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("fedavg.fit_request")
@dataclass(frozen=True)
class FitRequest:
    """The FedAvg engine's broadcast: the shared parameters, this round's learning rate, local epochs and
    batch size (the optimizer itself is part of the experiment's configuration on both sides)."""

    round: int
    lr: float
    local_epochs: int
    batch_size: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("fedavg.fit_reply")
@dataclass(frozen=True)
class FitReply:
    """The FedAvg engine's upload: the client's trained values of the uploaded parameters (shared and
    trainable, after its update transform), its number of training samples and mean training loss."""

    round: int
    num_samples: int
    loss: float
    weights: np.ndarray = array_field(dtype="float32", ndim=1)
