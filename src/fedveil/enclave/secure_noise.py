"""Noise that survives the floating-point attack: exact discrete Laplace and discrete Gaussian samplers
(Canonne, Kamath and Steinke, "The Discrete Gaussian for Differential Privacy", NeurIPS 2020) from a
cryptographic source, on a grid.

**Why.** Mironov ("On Significance of the Least Significant Bits for Differential Privacy", CCS 2012)
showed that textbook floating-point Laplace sampling (``numpy``'s inverse CDF included) leaves some
outputs ``f(D) + noise`` reachable from one value ``f(D)`` and not from its neighbour, so the low-order
bits of a single release can reveal the input exactly. The remedy here: snap the value to a grid of step
``grid`` (a power of two, so that every grid point below ``2^53 grid`` is an exact double), add an
integer drawn *exactly* from the discrete distribution, and scale by ``grid``: every output is a grid
point, whatever the input's low-order bits were.

**Samplers** (exact: every draw is a ``Bernoulli(num / den)`` of integers decided against words from
:func:`secrets.token_bytes`, the operating system's CSPRNG; floats only screen the comparisons, with a
margin far above their rounding error, and the undecided ones, about one in ``2^47``, are finished
with rationals; numpy runs each step for all values at once):

- :func:`bernoulli_exp`: ``Bernoulli(exp(-gamma))`` for rational ``gamma >= 0`` (CKS20 Alg. 1);
- :func:`discrete_laplace`: ``P[Y = y] ∝ exp(-|y| / scale)`` on the integers, rational ``scale > 0``
  (CKS20 Alg. 2);
- :func:`discrete_gaussian`: ``P[Y = y] ∝ exp(-y^2 / (2 sigma^2))`` on the integers, rational
  ``sigma^2 > 0`` (CKS20 Alg. 3: discrete Laplace proposals, accepted with ``Bernoulli(exp(-(|Y| -
  sigma^2 / t)^2 / (2 sigma^2)))``).

A million values take about 1.5 s (Laplace) and 4 s (Gaussian) on the 2-core development machine
(docs/privacy.md has the command); :data:`MAX_VALUES` bounds one call.

**Privacy of the grid mechanisms** (:class:`SecureNoise`). Snapping ``d`` coordinates to the nearest grid
point moves each by at most ``grid / 2``, so two neighbouring values whose L1 (L2) distance is ``Delta``
snap to grid points at most ``Delta + d grid`` (``Delta + sqrt(d) grid``) apart: the sensitivity in grid
units is :func:`grid_sensitivity`, rounded up. The discrete Laplace of scale ``b / grid`` with L1
sensitivity ``k`` grid units is ``k grid / b``-DP (pure; the ratio of the pmfs at ``y`` and ``y + k`` is
at most ``e^(k grid / b)``). The discrete Gaussian of variance parameter ``(sigma / grid)^2`` with L2
sensitivity ``k`` grid units is ``rho``-zCDP with ``rho = (k grid)^2 / (2 sigma^2)`` (CKS20's
concentrated-DP theorem for the discrete Gaussian, coordinates independent): the Renyi curve ``alpha
rho`` of the continuous Gaussian with the same noise multiplier, so RDP accounting of ``sigma / (k
grid)`` (:func:`zcdp_epsilon`, or fedveil's ``rdp`` accountant, which converts alike) is valid for it;
the exact PLD of the continuous Gaussian is not claimed for the discrete one. With the default grid
(:data:`DEFAULT_GRID_BITS`) ``grid <= scale 2^-29``, so snapping adds at most ``d 2^-29`` (L1, Laplace
of scale ``b``) to ``Delta / b``.
The enclave module uses the standard library and numpy only.
"""

from __future__ import annotations

import math
import numbers
import secrets
from fractions import Fraction

import numpy as np

from fedveil.errors import ConfigError

__all__ = [
    "MAX_VALUES",
    "SECURE_NOISE_BYTES_PER_VALUE",
    "SecureNoise",
    "bernoulli_exp",
    "discrete_gaussian",
    "discrete_laplace",
    "grid_sensitivity",
    "zcdp_epsilon",
]

MAX_VALUES = 20_000_000
"""The most values one call draws (well under a minute; a larger release is drawn in parts)."""

SECURE_NOISE_BYTES_PER_VALUE = 160
"""Heap a :class:`SecureNoise` release allocates per value beyond numpy's float path, an upper bound
(tracemalloc measures about 125 bytes: the snapped steps, the integer noise and the sampler's index, word
and screen arrays; tests/test_secure_noise.py checks the bound)."""

DEFAULT_GRID_BITS = 30
""":class:`SecureNoise` puts its grid this many binary orders of magnitude below the noise scale."""


def _fraction(value: float | Fraction, name: str) -> Fraction:
    ok = isinstance(value, (numbers.Rational, float)) and not isinstance(value, bool)
    if not ok or (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
        raise ConfigError(f"{name} {value!r} must be a finite number > 0")
    return Fraction(value)


def _count(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or not 0 <= size <= MAX_VALUES:
        raise ConfigError(
            f"size {size!r} must be an integer in [0, {MAX_VALUES}]: draw a larger release in parts"
        )
    return int(size)


def _words(n: int) -> np.ndarray:
    """``n`` uniform 64-bit words from the operating system's CSPRNG."""
    return np.frombuffer(secrets.token_bytes(8 * n), dtype=np.uint64)


_INT64_BELOW = 2**53
"""Integers below this run in int64: Alg. 1's ``den * k`` stays far from overflow for any ``k`` its
series reaches; larger ones run as Python ints (exact, slower)."""

_SCREEN = 2.0**-48  # relative margin of the float screen; float64 errors here stay below 2^-50


def _bernoulli(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Exact ``Bernoulli(num / den)`` per element (integers, ``0 <= num <= den``; int64 or Python ints in
    object arrays). Each draw compares ``U = (R + U') / 2^64`` (``R`` a CSPRNG word, ``U'`` uniform) with
    ``p = num / den``: when a float screen of ``p``, with a margin far above its rounding error, decides
    ``U < p`` for every ``U'``, that decides; otherwise (probability about ``2^-47``) the residual
    ``Bernoulli(p 2^64 - R)`` is drawn exactly with rationals."""
    words = _words(len(num))
    p = np.asarray(num, dtype=np.float64) / np.asarray(den, dtype=np.float64)
    r = words.astype(np.float64)
    low = r * (1 - 2.0**-51) * 2.0**-64  # <= R / 2^64
    high = (r * (1 + 2.0**-51) + 1) * 2.0**-64  # >= (R + 1) / 2^64
    yes = high <= p * (1 - _SCREEN)
    no = low >= p * (1 + _SCREEN)
    for i in np.flatnonzero(~(yes | no)):
        c = Fraction(int(num[i]) << 64, int(den[i])) - int(words[i])
        yes[i] = c >= 1 or (c > 0 and secrets.randbelow(c.denominator) < c.numerator)
    return yes


def _bernoulli_exp_unit(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``Bernoulli(exp(-num / den))`` per element for ``0 <= num <= den``: CKS20 Alg. 1's alternating
    series (draw ``A_k ~ Bernoulli(gamma / k)`` for ``k = 1, 2, ...`` until one is 0; 1 iff that ``k`` is
    odd), all elements stepping ``k`` together."""
    out = np.zeros(len(num), dtype=bool)
    active = np.arange(len(num))
    k = 1
    while active.size:
        a = _bernoulli(num[active], den[active] * k)
        out[active[~a]] = k % 2 == 1
        active = active[a]
        k += 1
    return out


def bernoulli_exp(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """CKS20 Alg. 1: exact ``Bernoulli(exp(-gamma))`` per element, ``gamma = num / den >= 0`` (integer
    arrays, int64 or Python ints): one ``Bernoulli(exp(-1))`` per whole unit of ``gamma``, then the
    fractional part."""
    if np.any(num < 0) or np.any(den <= 0):
        raise ConfigError("bernoulli_exp needs num >= 0 and den > 0")
    whole = num // den
    out = _bernoulli_exp_unit(num - whole * den, den)
    unit = 1
    while True:
        left = np.flatnonzero(out & (whole >= unit))
        if not left.size:
            return out
        ones = np.ones(left.size, dtype=np.int64)
        out[left] = _bernoulli_exp_unit(ones, ones)
        unit += 1


def _uniform_below(t: int, n: int) -> np.ndarray:
    """``n`` exact uniform integers in ``[0, t)`` (rejection from CSPRNG words); int64 below
    :data:`_INT64_BELOW`, else Python ints in an object array."""
    if t >= _INT64_BELOW:
        return np.array([secrets.randbelow(t) for _ in range(n)], dtype=object)
    mask = np.uint64((1 << t.bit_length()) - 1)
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        draw = _words(todo.size) & mask
        ok = draw < np.uint64(t)
        out[todo[ok]] = draw[ok].astype(np.int64)
        todo = todo[~ok]
    return out


def _discrete_laplace(s: int, t: int, n: int) -> np.ndarray:
    """CKS20 Alg. 2, all ``n`` draws together: ``P[Y = y] ∝ exp(-|y| s / t)`` for integers ``s, t >= 1``
    (int64 below :data:`_INT64_BELOW`, else an object array of Python ints)."""
    out = np.zeros(n, dtype=np.int64 if t < _INT64_BELOW else object)
    todo = np.arange(n)
    while todo.size:
        u = _uniform_below(t, todo.size)
        keep = _bernoulli_exp_unit(u, np.full(todo.size, t, dtype=u.dtype))
        u, cand = u[keep], todo[keep]
        v = np.zeros(cand.size, dtype=np.int64)
        going = np.arange(cand.size)
        while going.size:  # V: Bernoulli(exp(-1)) successes before the first failure
            ones = np.ones(going.size, dtype=np.int64)
            more = _bernoulli_exp_unit(ones, ones)
            v[going[more]] += 1
            going = going[more]
        y = (u + t * v.astype(u.dtype)) // s
        negative = (_words(cand.size) & np.uint64(1)).astype(bool)
        ok = ~(negative & (y == 0))
        out[cand[ok]] = np.where(negative[ok], -y[ok], y[ok])
        todo = np.concatenate([todo[~keep], cand[~ok]])
    return out


def discrete_laplace(scale: float | Fraction, size: int) -> np.ndarray:
    """``size`` i.i.d. integers with ``P[Y = y] ∝ exp(-|y| / scale)`` (``scale`` rational > 0, a float is
    taken exactly), as int64 (CKS20 Alg. 2 with ``s / t = 1 / scale``)."""
    sc = _fraction(scale, "discrete Laplace scale")
    if sc >= 2**56:
        raise ConfigError(f"discrete Laplace scale {scale!r} must be below 2^56, so that draws fit int64")
    n = _count(size)
    return _discrete_laplace(sc.denominator, sc.numerator, n).astype(np.int64)


def discrete_gaussian(sigma_squared: float | Fraction, size: int) -> np.ndarray:
    """``size`` i.i.d. integers with ``P[Y = y] ∝ exp(-y^2 / (2 sigma^2))`` (``sigma_squared`` rational
    > 0, a float is taken exactly), as int64 (CKS20 Alg. 3: discrete Laplace proposals of scale ``t =
    floor(sigma) + 1``, each accepted with ``Bernoulli(exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)))``)."""
    s2 = _fraction(sigma_squared, "discrete Gaussian sigma^2")
    if s2 >= 2**100:
        raise ConfigError(f"discrete Gaussian sigma^2 {sigma_squared!r} must be below 2^100 (int64 draws)")
    n = _count(size)
    a, b = s2.numerator, s2.denominator
    t = math.isqrt(a // b) + 1  # floor(sigma) + 1
    out = np.zeros(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        y = _discrete_laplace(1, t, todo.size).astype(object)
        # gamma = (|y| - sigma^2 / t)^2 / (2 sigma^2) = (|y| b t - a)^2 / (2 a b t^2), in integers
        num = (np.abs(y) * (b * t) - a) ** 2
        den = np.full(todo.size, 2 * a * b * t * t, dtype=object)
        ok = bernoulli_exp(num, den)
        out[todo[ok]] = y[ok].astype(np.int64)
        todo = todo[~ok]
    return out


def grid_sensitivity(sensitivity: float, grid: float, coordinates: int, *, norm: str) -> int:
    """The sensitivity in grid units after snapping ``coordinates`` values to the grid (module
    docstring): ``ceil(Delta / grid + d)`` for ``norm="l1"``, ``ceil(Delta / grid + sqrt(d))`` for
    ``"l2"``."""
    delta = _fraction(sensitivity, "sensitivity")
    g = _fraction(grid, "grid")
    if isinstance(coordinates, bool) or not isinstance(coordinates, numbers.Integral) or coordinates < 1:
        raise ConfigError(f"coordinates {coordinates!r} must be an integer >= 1")
    if norm == "l1":
        return math.ceil(delta / g + coordinates)
    if norm == "l2":
        return math.ceil(delta / g + math.sqrt(coordinates))
    raise ConfigError(f"norm {norm!r} is not one of l1, l2")


def zcdp_epsilon(rho: float, delta: float) -> float:
    """Epsilon at ``delta`` of a ``rho``-zCDP mechanism (Renyi DP ``alpha rho`` at every order), by the
    conversion of CKS20 and Balle et al. (AISTATS 2020) that dp-accounting's RDP accountant also uses:
    ``min over alpha > 1`` of ``alpha rho + (ln(1/delta) + (alpha - 1) ln(1 - 1/alpha) - ln(alpha)) /
    (alpha - 1)``, minimised on a fine grid of orders (any order gives a valid bound)."""
    if not (math.isfinite(rho) and rho > 0):
        raise ConfigError(f"rho {rho!r} must be a finite number > 0")
    if not 0 < delta < 1:
        raise ConfigError(f"delta {delta!r} must lie strictly between 0 and 1")
    alphas = 1 + np.geomspace(1e-4, 1e4, 20_000)
    eps = alphas * rho + (math.log(1 / delta) + (alphas - 1) * np.log1p(-1 / alphas) - np.log(alphas)) / (
        alphas - 1
    )
    return float(max(eps.min(), 0.0))


class SecureNoise:
    """Noise for deployments: the values snapped to a power-of-two grid plus exact discrete noise from the
    OS's CSPRNG (module docstring), in place of a seeded ``numpy.random.Generator``.

    :meth:`add_laplace` and :meth:`add_normal` return ``values`` snapped to the grid plus ``grid`` times a
    discrete Laplace of scale ``b / grid`` (a discrete Gaussian of ``sigma^2 = (std / grid)^2``); the grid
    is ``2^(ceil(log2(scale)) - grid_bits)`` unless ``grid`` fixes it. :meth:`random` gives uniform floats
    for the draws that are not noise (e.g. FDML's drop mask), from the same CSPRNG. Nothing is seeded: a
    simulation keeps its seeded generator.
    """

    def __init__(self, *, grid: float | None = None, grid_bits: int = DEFAULT_GRID_BITS) -> None:
        if grid is not None:
            g = _fraction(grid, "grid")
            num, den = g.numerator, g.denominator
            if not ((num == 1 and den & (den - 1) == 0) or (den == 1 and num & (num - 1) == 0)):
                raise ConfigError(f"grid {grid!r} must be a power of two, e.g. 2**-20")
        if isinstance(grid_bits, bool) or not isinstance(grid_bits, int) or not 0 <= grid_bits <= 40:
            raise ConfigError(f"grid_bits {grid_bits!r} must be an integer in [0, 40]")
        self.grid = grid
        self.grid_bits = grid_bits

    def grid_for(self, scale: float) -> float:
        """The grid step used for noise of ``scale`` (a power of two)."""
        if self.grid is not None:
            return float(self.grid)
        return math.ldexp(1.0, math.ceil(math.log2(float(_fraction(scale, "noise scale")))) - self.grid_bits)

    def _snap(self, values: np.ndarray, grid: float) -> np.ndarray:
        arr = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(arr)):
            raise ConfigError("values to noise contain NaN or inf")
        steps = np.rint(arr / grid)
        if np.any(np.abs(steps) > 2**52):
            raise ConfigError(f"values reach {np.abs(arr).max():g}, beyond 2^52 grid steps of {grid:g}")
        return steps

    def add_laplace(self, values: np.ndarray, scale: float) -> np.ndarray:
        """``values`` on the grid plus ``grid * DLap(scale / grid)`` per coordinate, float64."""
        grid = self.grid_for(scale)
        steps = self._snap(values, grid)
        noise = discrete_laplace(Fraction(scale) / Fraction(grid), steps.size)
        return (steps + noise.reshape(steps.shape)) * grid

    def add_normal(self, values: np.ndarray, std: float) -> np.ndarray:
        """``values`` on the grid plus ``grid * N_Z(0, (std / grid)^2)`` per coordinate, float64."""
        grid = self.grid_for(std)
        steps = self._snap(values, grid)
        noise = discrete_gaussian((Fraction(std) / Fraction(grid)) ** 2, steps.size)
        return (steps + noise.reshape(steps.shape)) * grid

    def random(self, size: int) -> np.ndarray:
        """``size`` uniform floats in [0, 1) with 53 random bits each, from the CSPRNG."""
        return (_words(_count(size)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
