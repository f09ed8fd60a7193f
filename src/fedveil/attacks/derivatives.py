"""Membership inference from the derivatives an FDML participant receives (step 6 of [FDML] Fig. 2).

A participant uploads the embeddings of its samples (step 4) and receives ``dloss/demb`` for each of
them (step 6). Through the triplets its embeddings share with everyone else's (Alg. 1), those
derivatives depend on the other participants' embeddings: a curious participant can ask whether a
*target* embedding (of a sample of another participant) was in the round. [FDML] Sec. V-B's defence is
Alg. 2 (drop, clip, Laplace noise), whose per-round epsilon bounds any such test.

Two scores of a :class:`DerivativeView` (higher = "the target was in the round"):

- :func:`informed_score`, the adversary of the DP definition: it knows every other embedding of the round
  except the one slot that holds the target or a replacement, and the mechanism's settings, so it can
  compute the release it would get with the target in (:func:`expected_release`: Alg. 1 and Alg. 2's
  clipping, no noise). The score is the Laplace log-likelihood of the received block under that
  hypothesis, up to the factor ``1/b``: ``-||received - expected||_1``.
- :func:`direction_score`, a participant that knows only its own embeddings and the target: the target
  enters the derivative of each own embedding ``a`` (of another label) along ``(target - a) / ||target -
  a||`` (as negative of ``a``'s triplets, and ``a`` as negative of the target's), so it sums the received
  derivatives' projections on those directions.

:func:`dp_consistency` puts an attack's result beside an epsilon: under pure ``epsilon``-DP no test beats
``TPR <= e^eps FPR``, which caps the AUC at ``e^eps / (1 + e^eps)``; the one-run bound of Steinke, Nasr
and Jagielski (NeurIPS 2023; :mod:`fedveil.privacy.audit`) turns the attack's most confident guesses into
an empirical epsilon lower bound, which must not exceed a correct epsilon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedveil.attacks.scores import AttackScores
from fedveil.enclave.dp import clip_derivatives
from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.errors import ValidationError
from fedveil.privacy.audit import guess_outcome, max_auditable_epsilon, one_run_epsilon_lower_bound

__all__ = [
    "DerivativeView",
    "direction_score",
    "dp_consistency",
    "expected_release",
    "informed_score",
]


@dataclass(frozen=True)
class DerivativeView:
    """What one FDML participant saw of a round: the ``embeddings`` ``(m, d)`` it uploaded (step 4) and
    the ``derivatives`` ``(m, d)`` it received for them (step 6)."""

    observer: str
    embeddings: np.ndarray
    derivatives: np.ndarray

    def __post_init__(self) -> None:
        emb, der = np.asarray(self.embeddings), np.asarray(self.derivatives)
        if emb.ndim != 2 or emb.shape != der.shape:
            raise ValidationError(
                f"{self.observer}: embeddings {emb.shape} and derivatives {der.shape} must be equal (m, d)"
            )


def expected_release(
    embeddings: np.ndarray,
    labels: np.ndarray,
    rows: np.ndarray,
    *,
    margin: float,
    strategy: str,
    mode: str | None = None,
    bound_T: float | None = None,
) -> np.ndarray:
    """The derivatives of rows ``rows`` of a round's ``embeddings`` ``(N, d)`` with ``labels`` ``(N,)``
    (Alg. 1 with ``margin`` and ``strategy``), clipped as Alg. 2 line 3 does in ``mode`` with ``bound_T``
    when a mode is given; without noise (its mean) and without drops."""
    derivatives = loss_and_derivatives(embeddings, labels, margin=margin, strategy=strategy).derivatives
    if mode is not None:
        if bound_T is None:
            raise ValidationError("a clipping mode needs its bound T")
        derivatives = clip_derivatives(np.asarray(derivatives, np.float64), mode=mode, bound_T=bound_T)
    return np.asarray(derivatives, np.float64)[np.asarray(rows)]


def informed_score(view: DerivativeView, expected: np.ndarray) -> float:
    """``-||received - expected||_1``: the Laplace log-likelihood (times ``b``) of the received block if
    the target was in the round and the release with it would have been ``expected`` ``(m, d)``."""
    received = np.asarray(view.derivatives, np.float64)
    if received.shape != np.shape(expected):
        raise ValidationError(
            f"expected release {np.shape(expected)} differs from the view's {received.shape}"
        )
    return -float(np.abs(received - expected).sum())


def direction_score(view: DerivativeView, target: np.ndarray) -> float:
    """``sum_i <g_i, (target - a_i) / ||target - a_i||>`` over the participant's embeddings ``a_i`` and the
    derivatives ``g_i`` it received (module docstring); the target must carry another label."""
    own = np.asarray(view.embeddings, np.float64)
    towards = np.asarray(target, np.float64)[None, :] - own
    norms = np.linalg.norm(towards, axis=1, keepdims=True)
    unit = np.divide(towards, norms, out=np.zeros_like(towards), where=norms > 0)
    return float((np.asarray(view.derivatives, np.float64) * unit).sum())


def dp_consistency(
    scores: AttackScores,
    epsilon: float,
    *,
    guess_fraction: float = 0.1,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """An attack's result beside the ``epsilon`` that should bound it (pure DP when ``delta = 0``):

    - ``auc_bound = e^eps / (1 + e^eps)``, the largest AUC (and balanced accuracy) any test can reach when
      ``TPR <= e^eps FPR + delta`` and ``1 - FPR <= e^eps (1 - TPR) + delta`` hold at every threshold
      (``delta = 0``); ``auc_within_bound`` allows two standard errors of the AUC;
    - ``epsilon_lower``: the one-run empirical lower bound from guessing the ``guess_fraction`` highest
      scores IN and as many lowest OUT (a number fixed before the scores are seen); ``consistent`` when
      it does not exceed ``epsilon``. ``max_auditable`` is the most these guesses could show."""
    n = scores.labels.size
    k = max(1, int(guess_fraction * n))
    outcome = guess_outcome(np.asarray(scores.scores), np.asarray(scores.labels), k_plus=k, k_minus=k)
    lower = one_run_epsilon_lower_bound(
        canaries=n, guesses=outcome.guesses, correct=outcome.correct, delta=delta, confidence=confidence
    )
    bound = 1.0 / (1.0 + math.exp(-epsilon)) if math.isfinite(epsilon) else 1.0
    slack = 2.0 * (scores.auc_std_error or scores.auc_null_std_error)
    return {
        "epsilon": epsilon,
        "auc_bound": bound,
        "auc_within_bound": bool(scores.auc <= bound + slack),
        "guesses": outcome.guesses,
        "correct_guesses": outcome.correct,
        "epsilon_lower": lower,
        "max_auditable": max_auditable_epsilon(
            canaries=n, guesses=outcome.guesses, delta=delta, confidence=confidence
        ),
        "consistent": bool(lower <= epsilon),
    }
