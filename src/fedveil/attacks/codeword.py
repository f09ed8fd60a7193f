"""Reading a FedUV user's secret codeword (or a baseline user's class) off its model updates.

[FedUV] Sec. 4.2 claims the server never learns a user's codeword ``v_u``. Undefended FedAvg still shows
the server every selected user's locally trained model. For FedUV's loss
``l_pos = max(0, 1 - (1/c) v_u^T sigma(z))``, ``z = W g(x) + b`` and ``sigma(z) = sqrt(c) z / ||z||``,
the gradient with respect to the head's bias is

    dl/db = -(1 / (sqrt(c) ||z||)) (v_u - (v_u^T z^) z^),     z^ = z / ||z||,

so one SGD step moves ``b`` along the part of ``v_u`` orthogonal to the current output: while the
model has not learned the user's codeword, mostly along ``v_u`` itself. The attack sums the bias deltas
``b_local - b_global`` over every round the user took part in and reads the bits by sign
(``v = (-1)^bits``: a positive coordinate is bit 0). A bounded-distance BCH decoder returns ``v_u`` itself
whenever at most ``t = floor((d - 1) / 2)`` bits are wrong, so "within the radius" means recovered.

Softmax and FedAwS have no codeword: the user's secret-looking target is its class row ``w_u``, which
the server assigned and holds in the model it broadcasts (FedAwS even sends each user only its own row).
The analogous attack identifies the user's class from its update: the bias entry that grew most
(softmax: ``-dl/db = e_u - p``, positive only at ``u``), or with no bias the row of ``W`` that moved most
(FedAwS: the only row the user trains).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedveil.attacks.views import ObserverView, require_update_view
from fedveil.errors import ValidationError

__all__ = [
    "CodewordGuess",
    "class_scores",
    "codeword_attack",
    "codeword_estimate",
    "compare_codeword",
]


def _deltas(views: Sequence[ObserverView], name: str, attack: str) -> list[np.ndarray]:
    """The deltas of parameter ``name`` in every view (model deltas, not single-step gradients)."""
    if not views:
        raise ValidationError(f"{attack}: no update of this user was observed")
    out = []
    for view in views:
        update = require_update_view(view, attack)
        if update.kind != "delta":
            raise ValidationError(f"{attack}: expected model deltas (FedAvg uploads), got {update.kind!r}")
        if name not in update.update:
            raise ValidationError(
                f"{attack}: the observer did not see {name!r} (it saw {sorted(update.update)})"
            )
        out.append(update.update[name].detach().cpu().numpy().astype(np.float64))
    return out


def codeword_estimate(views: Sequence[ObserverView], *, bias: str = "fc.bias") -> np.ndarray:
    """The soft estimate of ``v_u`` ``(c,)``: the sum over the user's rounds of its head-bias deltas
    (module docstring). Needs model-delta views naming ``bias``."""
    return np.sum(_deltas(views, bias, "codeword"), axis=0)


@dataclass(frozen=True)
class CodewordGuess:
    """The attack's hard decision: ``bits`` ``(c,)`` uint8 (``v = (-1)^bits``) and the soft estimate."""

    bits: np.ndarray
    estimate: np.ndarray


def codeword_attack(views: Sequence[ObserverView], *, bias: str = "fc.bias") -> CodewordGuess:
    """Bit-wise decision on :func:`codeword_estimate`: bit 1 where the estimate is negative."""
    estimate = codeword_estimate(views, bias=bias)
    return CodewordGuess((estimate < 0).astype(np.uint8), estimate)


def compare_codeword(guess: np.ndarray, truth: np.ndarray, radius: int) -> dict[str, float | int | bool]:
    """Bit accuracy of ``guess`` against ``truth`` (both ``(c,)`` 0/1), the Hamming distance, and whether it
    lies within the code's error-correcting ``radius`` ``t`` (then a bounded-distance decoder recovers
    ``truth``)."""
    guess, truth = np.asarray(guess), np.asarray(truth)
    if guess.shape != truth.shape or guess.ndim != 1:
        raise ValidationError(f"codewords of shapes {guess.shape} and {truth.shape}: expected equal (c,)")
    wrong = int(np.count_nonzero(guess != truth))
    return {"bit_accuracy": 1.0 - wrong / truth.size, "hamming": wrong, "within_radius": wrong <= radius}


def class_scores(
    views: Sequence[ObserverView], *, weight: str = "fc.weight", bias: str | None = "fc.bias"
) -> np.ndarray:
    """Per-class scores ``(K,)`` of a softmax or FedAwS user's updates, summed over its rounds: the bias
    deltas when the head has a ``bias`` (softmax), else the norms of the rows of the weight deltas
    (FedAwS). The user's class is the argmax."""
    if bias is not None:
        return np.sum(_deltas(views, bias, "class"), axis=0)
    return np.sum([np.linalg.norm(d, axis=1) for d in _deltas(views, weight, "class")], axis=0)
