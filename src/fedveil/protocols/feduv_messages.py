"""Typed messages of FedUV and its baselines (Alg. 1 and 2; Yu et al. 2020).

Every wire name starts with ``feduv.``; FedUV, softmax and FedAwS share the training, deployment and
evaluation messages and differ only in the set-up message (a base vector for FedUV, a class index for
the baselines). What travels *up* to the server is deliberately small: acknowledgements, the locally
trained model, the number of warm-up inputs, and score histograms. A user's codeword ``v_u`` and its
random bits ``r_u`` never appear in any of them (``tests/test_protocols_feduv.py`` searches every byte
string the server receives).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedveil.core.messages import array_field, message

MAX_BINS = 1 << 16
"""Largest score histogram a user sends (bins over the score range [-1, 1])."""


@message("feduv.base_vector")
@dataclass(frozen=True)
class BaseVector:
    """Alg. 2, server -> user: the unique base vector ``b_u`` (``l_b`` bits, 0/1) and the public BCH
    code ``(code_n, code_k)`` the user encodes ``m_u = b_u || r_u`` with."""

    code_n: int
    code_k: int
    base_bits: np.ndarray = array_field(dtype="uint8", ndim=1, max_elements=64)


@message("feduv.codeword_ready")
@dataclass(frozen=True)
class CodewordReady:
    """Alg. 2, user -> server: the user built its codeword of length ``code_n``; nothing secret."""

    code_n: int


@message("feduv.class_assignment")
@dataclass(frozen=True)
class ClassAssignment:
    """Softmax / FedAwS, server -> user: the row ``class_index`` of the ``num_classes`` class
    embeddings that is the user's own (shared with the server by these baselines' design)."""

    class_index: int
    num_classes: int


@message("feduv.class_ready")
@dataclass(frozen=True)
class ClassReady:
    """Softmax / FedAwS, user -> server: the user took class ``class_index``."""

    class_index: int


@message("feduv.train_request")
@dataclass(frozen=True)
class UvTrainRequest:
    """Alg. 1, server -> user: the global model ``theta_{t-1}`` (flat float32), the round's learning
    rate ``eta_t``, the number of local epochs ``E`` and the batch size ``B`` of UserUpdate."""

    round: int
    lr: float
    local_epochs: int
    batch_size: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("feduv.train_reply")
@dataclass(frozen=True)
class UvTrainReply:
    """Alg. 1, user -> server: the locally updated model ``theta_t^u``, ``n_u = |D_u|`` and the mean
    training loss over the local update's batches."""

    round: int
    num_samples: int
    loss: float
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("feduv.deploy")
@dataclass(frozen=True)
class Deploy:
    """Alg. 2, server -> user: the trained model to deploy; the user runs its warm-up phase for the
    target true-positive rate ``q`` and keeps its threshold ``tau`` to itself."""

    q: float
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("feduv.deployed")
@dataclass(frozen=True)
class Deployed:
    """User -> server: the model is deployed; ``num_inputs`` inputs were collected in the warm-up."""

    num_inputs: int


@message("feduv.eval_request")
@dataclass(frozen=True)
class EvalRequest:
    """Evaluation, server -> user: score the user's own examples of split ``genuine`` and the impostor
    probe set ``impostor`` (every other user's examples of that set) with the deployed model, and
    return histograms over ``bins`` equal bins of [-1, 1]."""

    genuine: str
    impostor: str
    bins: int


@message("feduv.eval_reply")
@dataclass(frozen=True)
class EvalReply:
    """Evaluation, user -> server: histograms of genuine and impostor scores (counts per bin of
    [-1, 1]) and how many of each the user's warm-up threshold accepts (score >= tau).

    Histograms, not scores: a score list aligned with known probe inputs would let the server solve
    for the codeword; counts per bin do not say which input scored what.
    """

    genuine_accepted: int
    impostor_accepted: int
    genuine_counts: np.ndarray = array_field(dtype="int64", ndim=1, max_elements=MAX_BINS)
    impostor_counts: np.ndarray = array_field(dtype="int64", ndim=1, max_elements=MAX_BINS)
