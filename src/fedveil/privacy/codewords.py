"""FedUV's codeword selection (Sec. 4.2 and Alg. 2, "Codeword Selection").

1. Server: :func:`assign_base_vectors` gives every user ``u`` a unique binary base vector ``b_u`` of
   ``l_b >= log2 K`` bits (the paper uses ``l_b = 32``).
2. User ``u``: :func:`make_codeword` draws a random ``r_u`` of ``l_r >= 32`` bits locally, builds the
   message ``m_u = b_u || r_u`` (``k = l_b + l_r`` bits) and the codeword ``v_u = C(m_u)`` of the BCH
   code ``C`` (:mod:`fedveil.privacy.codes`), mapped to ``{-1, +1}^n`` by ``v = (-1)^bit`` (bit 0 ->
   +1, bit 1 -> -1, so XOR of codewords is the elementwise product of their vectors).

Because the ``b_u`` are unique, so are the ``m_u`` and, ``C`` being injective, the codewords; any two
differ in at least ``d`` positions, so ``(1/n) v_u^T v_u' <= 1 - 2 d / n`` (Theorem 1). ``r_u``, ``m_u`` and
``v_u`` never leave the user: :class:`Codeword` keeps them out of its ``repr``/``str`` and compares in
constant time. The random bits come from the ``numpy.random.Generator`` the caller passes; a
deployment seeds it from the operating system (``numpy.random.default_rng()`` with no seed), a
simulation from its seed.
"""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass, field

import numpy as np

from fedveil.errors import ConfigError, ValidationError
from fedveil.privacy.codes import BchCode

DEFAULT_BASE_BITS = 32
"""Sec. 4.2: "In experiments, we set l_b = 32"."""

MIN_RANDOM_BITS = 32
"""Sec. 4.2: "we set l_r >= 32"; the user's codeword is one of 2^l_r for its base vector."""

MAX_BASE_BITS = 64


def min_base_bits(num_users: int) -> int:
    """The smallest ``l_b`` with ``2^l_b >= num_users`` (at least 1): Sec. 4.2's ``l_b >= log2 K``."""
    return max(1, math.ceil(math.log2(num_users))) if num_users > 1 else 1


def _int_to_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned integers ``(K,)`` -> bits ``(K, width)`` uint8, most significant bit first."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
    return ((values.astype(np.uint64)[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)


def assign_base_vectors(
    num_users: int, l_b: int = DEFAULT_BASE_BITS, *, rng: np.random.Generator
) -> np.ndarray:
    """Alg. 2, server: unique random base vectors ``b_u``, ``(num_users, l_b)`` uint8 of 0/1.

    Drawn uniformly without replacement from the ``2^l_b`` binary vectors, so duplicates cannot
    occur. Fails when ``l_b`` is below :func:`min_base_bits` (``2^l_b < num_users``) or above
    :data:`MAX_BASE_BITS`, naming the value and the allowed range.
    """
    if isinstance(num_users, bool) or not isinstance(num_users, (int, np.integer)) or num_users < 1:
        raise ConfigError(f"num_users must be a positive integer, not {num_users!r}")
    num_users, need = int(num_users), min_base_bits(int(num_users))
    if isinstance(l_b, bool) or not isinstance(l_b, (int, np.integer)) or not need <= l_b <= MAX_BASE_BITS:
        raise ConfigError(
            f"l_b={l_b!r} base-vector bits cannot give {num_users} users unique base vectors; "
            f"use {need} <= l_b <= {MAX_BASE_BITS} (l_b >= log2 K; the paper uses {DEFAULT_BASE_BITS})"
        )
    population = 2 ** int(l_b)
    if population <= 4 * num_users:
        ids = rng.choice(population, size=num_users, replace=False).astype(np.uint64)
    else:
        ids = rng.integers(0, population, size=num_users, dtype=np.uint64, endpoint=False)
        while True:
            _, first = np.unique(ids, return_index=True)
            dup = np.setdiff1d(np.arange(num_users), first)
            if dup.size == 0:
                break
            ids[dup] = rng.integers(0, population, size=dup.size, dtype=np.uint64, endpoint=False)
    return _int_to_bits(ids, int(l_b))


def _check_bits(name: str, bits: np.ndarray, ndim: int) -> np.ndarray:
    arr = np.asarray(bits)
    if arr.ndim != ndim or arr.shape[-1] == 0:
        raise ValidationError(f"{name} must be a non-empty {ndim}-d array of bits, not shape {arr.shape}")
    if not (arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer)):
        raise ValidationError(f"{name} must be bool or integer 0/1, not dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > 1:
        raise ValidationError(f"{name} must hold only 0 and 1; found values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8)


def validate_base_vectors(base_vectors: np.ndarray) -> None:
    """Check a server's assignment ``(K, l_b)``: 0/1 entries and no two users with the same ``b_u``.

    A duplicate would give two users the same message space (and possibly the same codeword), so it
    fails naming the rows that collide.
    """
    arr = _check_bits("base vectors", base_vectors, ndim=2)
    _, first, inverse = np.unique(arr, axis=0, return_index=True, return_inverse=True)
    clash = np.flatnonzero(first[inverse.reshape(-1)] != np.arange(len(arr)))
    if clash.size:
        row = int(clash[0])
        other = int(first[inverse.reshape(-1)[row]])
        raise ValidationError(
            f"duplicate base vector: users {other} and {row} both have "
            f"{''.join(map(str, arr[row]))}; every user needs a unique b_u"
        )


@dataclass(frozen=True, eq=False, repr=False)
class Codeword:
    """User ``u``'s codeword material (Alg. 2). Secret except ``base_bits``; kept out of repr/str.

    - ``base_bits``: ``b_u``, ``(l_b,)`` uint8, assigned by the server (known to it).
    - ``random_bits``: ``r_u``, ``(l_r,)`` uint8, secret.
    - ``bits``: ``C(b_u || r_u)``, ``(n,)`` uint8, secret.
    - ``vector``: ``v_u = (-1)^bits``, ``(n,)`` float32 in ``{-1, +1}``, secret: the target of the
      positive loss and of the verification score.
    """

    base_bits: np.ndarray
    random_bits: np.ndarray
    bits: np.ndarray
    vector: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("base_bits", "random_bits", "bits"):
            arr = _check_bits(name, getattr(self, name), ndim=1).copy()
            arr.setflags(write=False)
            arrays[name] = arr
        if arrays["bits"].size < arrays["base_bits"].size + arrays["random_bits"].size:
            raise ValidationError("a codeword cannot be shorter than its message b_u || r_u")
        vector = (1.0 - 2.0 * arrays["bits"]).astype(np.float32)
        vector.setflags(write=False)
        for name, arr in arrays.items():
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "vector", vector)

    @property
    def n(self) -> int:
        """Code length ``c`` (the FC output size of the FedUV nets)."""
        return int(self.bits.size)

    @property
    def message(self) -> np.ndarray:
        """``m_u = b_u || r_u``, ``(k,)`` uint8 (secret)."""
        return np.concatenate([self.base_bits, self.random_bits])

    def __repr__(self) -> str:
        return (
            f"Codeword(n={self.n}, l_b={self.base_bits.size}, l_r={self.random_bits.size}, secret=<hidden>)"
        )

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        """Constant-time comparison of the secret bits (``hmac.compare_digest``)."""
        if not isinstance(other, Codeword):
            return NotImplemented
        same_base = np.array_equal(self.base_bits, other.base_bits)
        mine = self.random_bits.tobytes() + self.bits.tobytes()
        theirs = other.random_bits.tobytes() + other.bits.tobytes()
        return hmac.compare_digest(mine, theirs) and same_base


def make_codeword(base_bits: np.ndarray, code: BchCode, l_r: int, rng: np.random.Generator) -> Codeword:
    """Alg. 2, user: draw ``r_u`` (``l_r`` bits) and return ``v_u = C(b_u || r_u)``.

    ``base_bits`` is the user's ``b_u`` ``(l_b,)`` from :func:`assign_base_vectors`. Requires
    ``l_r >= 32`` and ``l_b + l_r == code.k``; fails naming the value and the ``l_r`` that fits.
    """
    base = _check_bits("base_bits", base_bits, ndim=1)
    l_b = base.size
    fits = code.k - l_b
    hint = (
        f"use l_r = k - l_b = {fits}"
        if fits >= MIN_RANDOM_BITS
        else f"BCH({code.n}, {code.k}) leaves only {fits} random bits after l_b = {l_b}: "
        f"pick a code with k >= {l_b + MIN_RANDOM_BITS}"
    )
    if isinstance(l_r, bool) or not isinstance(l_r, (int, np.integer)) or l_r < MIN_RANDOM_BITS:
        raise ConfigError(
            f"l_r={l_r!r} random bits is too few: l_r must be >= {MIN_RANDOM_BITS} (Sec. 4.2); {hint}"
        )
    if l_b + l_r != code.k:
        raise ConfigError(
            f"l_b + l_r = {l_b} + {l_r} = {l_b + l_r} does not equal the message length k = {code.k} "
            f"of BCH({code.n}, {code.k}); {hint}"
        )
    random_bits = rng.integers(0, 2, size=l_r, dtype=np.uint8)
    bits = code.encode(np.concatenate([base, random_bits]))
    return Codeword(base, random_bits, bits)


@dataclass(frozen=True)
class CodewordTiming:
    """Per-user codeword generation time (:func:`time_codeword_generation`), milliseconds.

    The upper quantiles and the maximum include any time the process was descheduled.
    """

    n: int
    k: int
    users: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def time_codeword_generation(
    code: BchCode, num_users: int, rng: np.random.Generator, l_b: int = DEFAULT_BASE_BITS
) -> CodewordTiming:
    """Time :func:`make_codeword` for each of ``num_users`` users (the code already built or cached).

    The server's :func:`assign_base_vectors` runs once, untimed; each user's call is timed with
    ``time.perf_counter_ns``.
    """
    base = assign_base_vectors(num_users, l_b, rng=rng)
    l_r = code.k - l_b
    times = np.empty(num_users)
    for u in range(num_users):
        start = time.perf_counter_ns()
        make_codeword(base[u], code, l_r, rng)
        times[u] = (time.perf_counter_ns() - start) / 1e6
    return CodewordTiming(
        n=code.n,
        k=code.k,
        users=num_users,
        median_ms=float(np.median(times)),
        p90_ms=float(np.quantile(times, 0.9)),
        p99_ms=float(np.quantile(times, 0.99)),
        max_ms=float(times.max()),
    )
