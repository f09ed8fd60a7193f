"""Differentially private derivative release inside the enclave: FDML Alg. 2 (Sec. V-B) and the per-round
epsilon of Thm V.1 next to a strict per-round analysis (docs/privacy.md).

Alg. 2 adjusts step 5 of the protocol: (1) drop each uploaded embedding independently with
probability ``r`` (:func:`drop_embeddings`); (2) compute the loss and the derivative of the loss with
respect to every kept embedding; (3) clip; (4) add ``Lap(b)`` noise to every coordinate
(:func:`dp_release`). :func:`private_derivatives` runs all four steps around a derivative function.

Two modes, named in every report:

- ``paper``: step 3 clips every *coordinate* to ``[-T, T]``, as Alg. 2 line 3 says. Thm V.1 states
  the per-round epsilon ``ln[(1 - r) e^(2T/b) + r]`` (:func:`paper_round_epsilon`). Its proof uses
  sensitivity ``2T``, which bounds one coordinate of one derivative only.
- ``strict``: step 3 clips every derivative *vector* to L1 norm ``T``. The strict analysis
  (:func:`strict_round_epsilon`) bounds the L1 sensitivity of everything one participant receives in
  a round: when one training sample of another participant changes, every released vector can
  change (each derivative is a mean over all active triplets), so the block of ``n`` vectors moves
  by at most ``2T n`` in L1 (``2T d n`` under coordinate clipping, for ``d``-dimensional vectors).

Neighbouring relation: replace one training sample of a participant other than the adversary
(``protected_samples`` > 1 replaces that many samples of one user in the round, e.g. all of them
for user-level privacy). The adversary is one participant, who receives ``vectors_received``
derivative vectors per round.

What the owner of a dropped embedding receives: the zero derivative plus the same ``Lap(b)`` noise,
in the same shape as a kept one. A dropped row does not depend on anyone's data, so it costs no
privacy; the owner cannot tell which of its own embeddings were used (the stated aim of the drop in
Sec. V-B); every message keeps the same shape, so nothing on the wire or in a byte meter reveals
the drop either; and, because drops are independent across embeddings, an owner who did learn its
own drops would learn nothing about anyone else's, which is what the drop amplification in the
proof of Thm V.1 needs.

Noise source: a seeded ``numpy.random.Generator`` (simulation: reproducible) draws floating-point
Laplace noise (inverse CDF), which does not resist the attack on the low-order bits of floating-point
noise (Mironov, CCS 2012); epsilon is then that of the idealised real-valued mechanism. A
:class:`~fedveil.enclave.secure_noise.SecureNoise` (what a deployed enclave, launched without
``dp_seed``, uses) snaps the clipped derivatives to a power-of-two grid and adds exact discrete Laplace
noise of the same scale ``b`` from the OS's CSPRNG (Canonne, Kamath and Steinke 2020); the snapping adds
at most ``n d grid`` to the L1 sensitivity (``grid <= b 2^-29``, :mod:`fedveil.enclave.secure_noise`).
The enclave uses numpy and the standard library only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TypeAlias

import numpy as np

from fedveil.enclave.secure_noise import SecureNoise
from fedveil.errors import ConfigError, ValidationError

MODES = ("paper", "strict")

NoiseSource: TypeAlias = "np.random.Generator | SecureNoise"
"""Where Alg. 2's randomness comes from: seeded numpy (simulation) or the secure sampler (deployment); a
string, so that importing the enclave does not load ``numpy.random``."""


def check_mode(mode: str) -> str:
    """``mode`` if it is ``"paper"`` or ``"strict"``, else :class:`ConfigError`."""
    if mode not in MODES:
        raise ConfigError(
            f"DP mode {mode!r} is not one of {', '.join(MODES)} (paper = per-coordinate clipping and "
            "Thm V.1's epsilon; strict = L1 clipping per derivative vector and the strict analysis)"
        )
    return mode


def check_drop_rate(drop_rate: float) -> float:
    """The embedding drop rate ``r`` of Alg. 2 if it lies in [0, 1), else :class:`ConfigError`."""
    if isinstance(drop_rate, bool) or not isinstance(drop_rate, numbers.Real) or not 0 <= drop_rate < 1:
        raise ConfigError(f"drop rate r {drop_rate!r} must be in [0, 1) (0 disables the drop)")
    return float(drop_rate)


def _check_positive(value: float, name: str) -> float:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} {value!r} must be a finite number > 0")
    return float(value)


def check_bound(bound_T: float) -> float:
    """The clipping bound ``T`` of Alg. 2 if it is finite and > 0, else :class:`ConfigError`."""
    return _check_positive(bound_T, "clipping bound T")


def check_noise_scale(noise_b: float) -> float:
    """The Laplace scale ``b`` of Alg. 2 if it is finite and > 0, else :class:`ConfigError`."""
    return _check_positive(noise_b, "Laplace noise scale b")


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name} {value!r} must be an integer >= 1")
    return int(value)


def drop_embeddings(n: int, drop_rate_r: float, rng: NoiseSource) -> np.ndarray:
    """Alg. 2 line 1: the keep mask ``(n,)`` bool; each embedding is dropped independently with
    probability ``drop_rate_r`` (Bernoulli, not a fixed number), so the drops of different
    embeddings, and of different participants, are independent."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ConfigError(f"number of embeddings {n!r} must be an integer >= 0")
    r = check_drop_rate(drop_rate_r)
    return rng.random(int(n)) >= r


def _check_derivatives(derivatives: np.ndarray) -> np.ndarray:
    arr = np.asarray(derivatives)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.floating):
        raise ValidationError(f"derivatives must be a float array (N, d); got {arr.dtype} {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValidationError("derivatives contain NaN or inf; the loss computation diverged")
    return arr


def clip_derivatives(derivatives: np.ndarray, *, mode: str, bound_T: float) -> np.ndarray:
    """Alg. 2 line 3 on ``(N, d)`` derivatives: ``paper`` clips every coordinate to ``[-T, T]``;
    ``strict`` scales every row ``g`` by ``min(1, T / ||g||_1)`` so that ``||g||_1 <= T``."""
    check_mode(mode)
    T = check_bound(bound_T)
    arr = _check_derivatives(derivatives)
    if mode == "paper":
        return np.clip(arr, -T, T)
    norms = np.abs(arr).sum(axis=1, keepdims=True, dtype=np.float64)
    over = norms > T
    scale = np.ones_like(norms)
    np.divide(T, norms, out=scale, where=over)
    return (arr * scale).astype(arr.dtype, copy=False)


def dp_release(
    derivatives: np.ndarray,
    *,
    mode: str,
    bound_T: float,
    noise_b: float,
    rng: NoiseSource,
    keep: np.ndarray | None = None,
) -> np.ndarray:
    """Alg. 2 lines 3-4: clip ``(N, d)`` derivatives (see :func:`clip_derivatives`), set the rows of
    dropped embeddings (``keep[i]`` False) to zero, and add i.i.d. ``Lap(noise_b)`` noise (density
    ``exp(-|x| / b) / 2b``) to every coordinate of every row, dropped or kept. Clipping and noise are
    computed in float64; the result ``(N, d)`` is cast to the input's float dtype afterwards.

    Neighbouring relation: one training sample of another participant replaced. L1 sensitivity of
    the ``n`` rows one participant receives: ``2 T n`` (strict) or ``2 T d n`` (paper), see
    :func:`release_sensitivity`; pure epsilon per round: :func:`strict_round_epsilon` (Thm V.1's
    :func:`paper_round_epsilon` assumes ``2T``)."""
    check_mode(mode)
    b = check_noise_scale(noise_b)
    out_dtype = _check_derivatives(derivatives).dtype
    clipped = clip_derivatives(np.array(derivatives, dtype=np.float64), mode=mode, bound_T=bound_T)
    if keep is not None:
        mask = np.asarray(keep)
        if mask.dtype != np.bool_ or mask.shape != (clipped.shape[0],):
            raise ValidationError(
                f"keep mask must be bool ({clipped.shape[0]},); got {mask.dtype} {mask.shape}"
            )
        clipped[~mask] = 0.0
    if isinstance(rng, SecureNoise):
        noisy = rng.add_laplace(clipped, b)
    else:
        noisy = clipped + rng.laplace(0.0, b, size=clipped.shape)
    return noisy.astype(out_dtype, copy=False)


def private_derivatives(
    embeddings: np.ndarray,
    labels: np.ndarray,
    derivative_fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    drop_rate: float,
    mode: str,
    bound_T: float,
    noise_b: float,
    rng: NoiseSource,
) -> tuple[np.ndarray, np.ndarray]:
    """FDML Alg. 2 end to end: drop (line 1), ``derivative_fn(kept_embeddings, kept_labels) -> (k, d)``
    on the kept ``k`` embeddings only (line 2, e.g. Alg. 1's triplet derivatives), clip and add noise
    (lines 3-4). Returns the released derivatives ``(N, d)``, one row per uploaded embedding (dropped
    rows are zero plus noise), and the keep mask ``(N,)``."""
    emb = np.asarray(embeddings)
    if emb.ndim != 2:
        raise ValidationError(f"embeddings must be (N, d); got shape {emb.shape}")
    lab = np.asarray(labels)
    if lab.shape != (emb.shape[0],):
        raise ValidationError(f"labels must be ({emb.shape[0]},); got shape {lab.shape}")
    keep = drop_embeddings(emb.shape[0], drop_rate, rng)
    dtype = emb.dtype if np.issubdtype(emb.dtype, np.floating) else np.float64
    derivs = np.zeros(emb.shape, dtype=dtype)
    if keep.any():
        kept = np.asarray(derivative_fn(emb[keep], lab[keep]))
        if kept.shape != (int(keep.sum()), emb.shape[1]):
            raise ValidationError(
                f"derivative_fn returned shape {kept.shape}; expected {(int(keep.sum()), emb.shape[1])}"
            )
        derivs[keep] = kept
    released = dp_release(derivs, mode=mode, bound_T=bound_T, noise_b=noise_b, rng=rng, keep=keep)
    return released, keep


def log_mixture(drop_rate: float, log_ratio: float) -> float:
    """``ln[r + (1 - r) e^x]`` for ``r = drop_rate``, ``x = log_ratio >= 0``, without overflow: the
    pure epsilon of a mechanism that is ``x``-DP when the protected record is used and that leaves
    the record out with probability ``r`` (the proof of FDML Thm V.1, part (b))."""
    r = check_drop_rate(drop_rate)
    if not (math.isfinite(log_ratio) and log_ratio >= 0):
        raise ConfigError(f"log ratio {log_ratio!r} must be a finite number >= 0")
    if r == 0:
        return float(log_ratio)
    return float(log_ratio + math.log1p(-r) + math.log1p(r / (1 - r) * math.exp(-log_ratio)))


def inverse_log_mixture(drop_rate: float, round_epsilon: float) -> float:
    """The ``x >= 0`` with ``log_mixture(r, x) = round_epsilon``: ``ln[(e^eps - r) / (1 - r)]``."""
    r = check_drop_rate(drop_rate)
    eps = _check_positive(round_epsilon, "per-round epsilon")
    return float(eps + math.log1p(-r * math.exp(-eps)) - math.log1p(-r))


def paper_round_epsilon(bound_T: float, noise_b: float, drop_rate: float) -> float:
    """FDML Thm V.1 exactly: ``epsilon = ln[(1 - r) e^(2T/b) + r]`` per training round."""
    T = check_bound(bound_T)
    b = check_noise_scale(noise_b)
    return log_mixture(drop_rate, 2 * T / b)


def paper_noise_scale(round_epsilon: float, bound_T: float, drop_rate: float) -> float:
    """The Laplace scale ``b`` at which Thm V.1 gives ``round_epsilon``:
    ``b = 2T / ln[(e^eps - r) / (1 - r)]``."""
    T = check_bound(bound_T)
    return 2 * T / inverse_log_mixture(drop_rate, round_epsilon)


def release_sensitivity(*, mode: str, bound_T: float, vectors_received: int, dim: int | None = None) -> float:
    """L1 sensitivity of the ``(vectors_received, dim)`` block one participant receives in a round
    when one training sample of another participant changes: every vector may change, by at most
    ``2T`` in L1 after ``strict`` (L1) clipping or ``2T d`` after ``paper`` (per-coordinate) clipping.
    ``dim`` is needed in ``paper`` mode only."""
    check_mode(mode)
    T = check_bound(bound_T)
    n = _check_count(vectors_received, "vectors_received")
    if mode == "strict":
        return 2 * T * n
    if dim is None:
        raise ConfigError("dim (the embedding dimension) is needed for the paper-mode sensitivity 2 T d n")
    return 2 * T * _check_count(dim, "dim") * n


def strict_round_epsilon(
    *,
    mode: str,
    bound_T: float,
    noise_b: float,
    drop_rate: float,
    vectors_received: int,
    dim: int | None = None,
    protected_samples: int = 1,
) -> float:
    """Per-round pure epsilon of Alg. 2 under the strict analysis (docs/privacy.md):
    ``ln[r^s + (1 - r^s) e^(Delta / b)]`` with ``Delta`` from :func:`release_sensitivity` and ``s`` =
    ``protected_samples`` (the changed samples must all be dropped for the round to ignore them)."""
    sens = release_sensitivity(mode=mode, bound_T=bound_T, vectors_received=vectors_received, dim=dim)
    b = check_noise_scale(noise_b)
    r = check_drop_rate(drop_rate) ** _check_count(protected_samples, "protected_samples")
    return log_mixture(r, sens / b)


def strict_noise_scale(
    round_epsilon: float,
    *,
    mode: str,
    bound_T: float,
    drop_rate: float,
    vectors_received: int,
    dim: int | None = None,
    protected_samples: int = 1,
) -> float:
    """The Laplace scale ``b`` at which :func:`strict_round_epsilon` equals ``round_epsilon``."""
    sens = release_sensitivity(mode=mode, bound_T=bound_T, vectors_received=vectors_received, dim=dim)
    r = check_drop_rate(drop_rate) ** _check_count(protected_samples, "protected_samples")
    return sens / inverse_log_mixture(r, round_epsilon)
