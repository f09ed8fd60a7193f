"""Typed messages of PPFL (Alg. 1 and 2).

Every wire name starts with ``ppfl.``. While a layer trains, its parameters travel only inside
``record`` fields: AES-GCM records sealed between the server's enclave and one client's TEE
(:mod:`fedveil.enclave.layerwise`); the host and the network see ciphertext. In the clear travel the
round, the layer stage, the training schedule, sample counts, evaluation counts, and the layers the
server has *released* after training (:class:`LayerRelease`), which Alg. 1 hands to the REE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedveil.core.messages import array_field, message


@message("ppfl.fit_request")
@dataclass(frozen=True)
class LayerFitRequest:
    """Alg. 1 -> Alg. 2: train stage ``stage`` for ``local_epochs`` epochs in batches of ``batch_size``
    at rate ``lr`` times ``epoch_decay`` per epoch; ``record`` holds ``theta_l`` sealed to this client's
    TEE for ``round``."""

    round: int
    stage: int
    lr: float
    epoch_decay: float
    local_epochs: int
    batch_size: int
    record: bytes


@message("ppfl.fit_reply")
@dataclass(frozen=True)
class LayerFitReply:
    """Alg. 2 -> Alg. 1: the client TEE's trained ``theta_l^(j)`` and mean loss, sealed to the server's
    enclave, and the number of local examples."""

    round: int
    stage: int
    num_samples: int
    record: bytes


@message("ppfl.eval_request")
@dataclass(frozen=True)
class LayerEvalRequest:
    """Evaluate the sealed layer + classifier of ``stage`` atop the released layers on the device's
    evaluation split, inside its TEE."""

    round: int
    stage: int
    record: bytes


@message("ppfl.eval_reply")
@dataclass(frozen=True)
class LayerEvalReply:
    """The evaluation's counts: examples, correct predictions, and the summed cross-entropy."""

    round: int
    stage: int
    num_samples: int
    correct: int
    loss_sum: float


@message("ppfl.release")
@dataclass(frozen=True)
class LayerRelease:
    """Alg. 1's "Save theta_l from TEE as theta_l^0 in REE", broadcast to every client: the trained
    layer(s) of ``stage`` in the clear, frozen from now on (without any tail kept in the TEEs)."""

    stage: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("ppfl.released")
@dataclass(frozen=True)
class LayerReleased:
    """The client froze the released layer(s) of ``stage``."""

    stage: int


@message("ppfl.public_layers")
@dataclass(frozen=True)
class PublicLayers:
    """Transfer of public knowledge (PPFL Sec. 4.3, Appendix A.1): the first ``units`` layer units of a
    model pre-trained on public data, in the clear, which every client keeps frozen in its REE."""

    units: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1)


@message("ppfl.public_layers_set")
@dataclass(frozen=True)
class PublicLayersSet:
    """The client froze the ``units`` public layer units."""

    units: int
