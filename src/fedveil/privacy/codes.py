"""Binary BCH codes for FedUV's secret codewords (Sec. 2.3, 4.2 and Table 1).

FedUV (Alg. 2) turns each user's message ``m_u = b_u || r_u`` of ``k`` bits into a codeword
``v_u = C(m_u)`` of ``n = 2^i - 1`` bits with a binary BCH code ``C``. The codes here are the
*primitive, narrow-sense* binary BCH codes that ``galois.BCH(n, d=...)`` builds by default: the
generator polynomial ``g(x)`` is the least common multiple of the minimal polynomials of
``alpha^1 .. alpha^(d-1)``, with ``alpha`` a root of MATLAB's primitive polynomial of degree ``i``
(``galois.matlab_primitive_poly``), and the encoding is systematic: a codeword is the message
followed by ``n - k`` parity bits (``G = [I_k | P]``).

Which ``(k, d)`` exist for a given ``n`` follows from the cyclotomic cosets of 2 modulo ``n``, computed
here without ``galois`` (:func:`valid_dimensions`): the code of designed distance ``delta`` has
``k = n - |union of the cosets of 1 .. delta-1|``, and ``d`` is the largest designed distance with that
``k`` (the Bose distance, ``galois``' ``d``). The true minimum distance is at least ``d``; FedUV's
Table 1 reports this ``d`` as ``d_min``: (127, 64, 21), (255, 71, 59), (511, 67, 175). By
Theorem 1 of the paper, two distinct codewords mapped to ``{-1, +1}^n`` have correlation
``(1/n) v^T v' <= 1 - 2 d / n`` (:attr:`BchCode.max_correlation`).

Building a generator matrix with ``galois`` takes seconds (minimal polynomials over GF(2^i)), so
:func:`bch_code` builds each ``(n, k)`` once and caches ``G`` on disk: ``<key>.npy`` (read with
``allow_pickle=False``) beside ``<key>.json`` (n, k, d, generator polynomial, SHA-256 of ``G``). The key
holds ``n``, ``k``, the installed ``galois`` version and :data:`CACHE_FORMAT_VERSION`, so a cache written
by another ``galois`` or another fedveil layout is never read. Files are written atomically
(temporary file + ``os.replace``) and validated on load (metadata, shape, dtype, binary entries,
systematic identity block, checksum); an invalid entry is rebuilt. The checksum detects corruption,
not tampering: the cache directory must be as trusted as the Python environment itself. After
loading, encoding is one ``(..., k) @ (k, n)`` matrix product modulo 2 in numpy; ``galois`` is not
imported.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.errors import ConfigError, ValidationError

log = logging.getLogger(__name__)

MIN_FIELD_DEGREE = 3
MAX_FIELD_DEGREE = 12
"""Supported code lengths are ``n = 2^i - 1`` for ``3 <= i <= 12`` (7 .. 4095)."""

DEFAULT_MIN_MESSAGE_LENGTH = 64
"""Sec. 6.2: "for each code length, we find the message length of greater than or equal to 64"."""

CACHE_FORMAT_VERSION = 1
CACHE_DIR_ENV = "FEDVEIL_CACHE_DIR"

_SUPPORTED_LENGTHS = tuple(2**i - 1 for i in range(MIN_FIELD_DEGREE, MAX_FIELD_DEGREE + 1))


def _field_degree(n: Any) -> int:
    """Return ``i`` with ``n = 2^i - 1``; fail naming ``n`` and the nearest supported lengths."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ConfigError(f"BCH code length n must be an integer 2^i - 1, not {n!r}")
    n = int(n)
    if n not in _SUPPORTED_LENGTHS:
        pos = bisect.bisect_left(_SUPPORTED_LENGTHS, n)
        near = _SUPPORTED_LENGTHS[max(pos - 1, 0) : pos + 1]
        raise ConfigError(
            f"n={n} is not a supported binary BCH code length; n must be 2^i - 1 with "
            f"{MIN_FIELD_DEGREE} <= i <= {MAX_FIELD_DEGREE}; nearest valid: "
            + ", ".join(f"n={v}" for v in near)
        )
    return n.bit_length()


def valid_dimensions(n: int) -> list[tuple[int, int]]:
    """All nontrivial binary primitive narrow-sense BCH codes of length ``n``, as ``(k, d)`` pairs.

    Sorted by decreasing message length ``k`` (increasing designed distance ``d``), from
    ``(n - i, 3)`` down to the repetition code ``(1, n)``. Computed from the cyclotomic cosets of 2
    modulo ``n``: ``d`` is the smallest positive exponent not among the roots of ``g(x)``.
    """
    _field_degree(n)
    covered = bytearray(n)
    size = 0
    dims: list[tuple[int, int]] = []
    for j in range(1, n):
        if covered[j]:
            continue
        if size:
            dims.append((n - size, j))
        x = j
        while not covered[x]:
            covered[x] = 1
            size += 1
            x = 2 * x % n
    dims.append((n - size, n))
    return dims


def _describe(dims: list[tuple[int, int]]) -> str:
    return ", ".join(f"k={k} (d={d})" for k, d in dims)


def default_message_length(n: int, minimum: int = DEFAULT_MIN_MESSAGE_LENGTH) -> int:
    """The smallest valid ``k >= minimum`` for length ``n`` (Sec. 6.2's rule; 64 -> Table 1's k)."""
    dims = valid_dimensions(n)
    fitting = [k for k, _ in dims if k >= minimum]
    if not fitting:
        largest_k, largest_d = dims[0]
        longer = [v for v in _SUPPORTED_LENGTHS if v - v.bit_length() >= minimum]
        hint = f" or use a longer code, n={longer[0]} or more" if longer else ""
        raise ConfigError(
            f"no binary BCH code of length n={n} has message length k >= {minimum}; the largest is "
            f"k={largest_k} (d={largest_d}): pass k explicitly{hint}"
        )
    return min(fitting)


def designed_distance(n: int, k: int) -> int:
    """The designed distance ``d`` of the BCH code ``(n, k)``; fails naming ``k`` and the nearest valid."""
    dims = valid_dimensions(n)
    lookup = dict(dims)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) not in lookup:
        ks = sorted(lookup)
        near: list[tuple[int, int]] = []
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            pos = bisect.bisect_left(ks, int(k))
            near = [(v, lookup[v]) for v in ks[max(pos - 1, 0) : pos + 1]]
        raise ConfigError(
            f"k={k!r} is not the message length of a binary BCH code of length n={n}; "
            + (f"nearest valid: {_describe(near)}; " if near else "")
            + f"all valid: {_describe(dims)}"
        )
    return lookup[int(k)]


@dataclass(frozen=True, eq=False)
class BchCode:
    """A binary BCH code ``(n, k, d)`` with its systematic generator matrix.

    ``generator_matrix`` is ``(k, n)`` uint8, ``[I_k | P]``; ``generator_poly`` holds the ``n - k + 1``
    binary coefficients of ``g(x)``, highest degree first. Build one with :func:`bch_code`.
    """

    n: int
    k: int
    d: int
    generator_matrix: np.ndarray = field(repr=False)
    generator_poly: np.ndarray = field(repr=False)
    _matrix_f32: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if designed_distance(self.n, self.k) != self.d:
            raise ConfigError(
                f"d={self.d} is not the designed distance of BCH({self.n}, {self.k}); "
                f"it is d={designed_distance(self.n, self.k)}"
            )
        g = np.array(self.generator_matrix, copy=True)
        poly = np.array(self.generator_poly, copy=True)
        problem = _matrix_problem(g, poly, self.n, self.k)
        if problem:
            raise ValidationError(f"generator of BCH({self.n}, {self.k}): {problem}")
        g.setflags(write=False)
        poly.setflags(write=False)
        f32 = g.astype(np.float32)
        f32.setflags(write=False)
        object.__setattr__(self, "generator_matrix", g)
        object.__setattr__(self, "generator_poly", poly)
        object.__setattr__(self, "_matrix_f32", f32)

    @property
    def t(self) -> int:
        """Errors the code corrects, ``(d - 1) // 2`` (Sec. 2.3)."""
        return (self.d - 1) // 2

    @property
    def rate(self) -> float:
        """Code rate ``k / n``."""
        return self.k / self.n

    @property
    def max_correlation(self) -> float:
        """Bound on ``(1/n) v^T v'`` over distinct ``{-1, +1}`` codewords, ``1 - 2 d / n`` (Theorem 1)."""
        return 1.0 - 2.0 * self.d / self.n

    @property
    def generator_poly_hex(self) -> str:
        """``g(x)`` as a hexadecimal integer (bit ``j`` is the coefficient of ``x^j``)."""
        return hex(int("".join(str(int(b)) for b in self.generator_poly), 2))

    def encode(self, bits: np.ndarray) -> np.ndarray:
        """Encode messages ``(..., k)`` of 0/1 (bool or integer dtype) to codewords ``(..., n)`` uint8.

        ``C(m) = m G mod 2``: systematic, so ``C(m)[..., :k] == m``. Fails on a wrong last axis,
        a non-integer dtype or entries other than 0 and 1.
        """
        arr = np.asarray(bits)
        if arr.ndim == 0 or arr.shape[-1] != self.k:
            raise ValidationError(
                f"messages for BCH({self.n}, {self.k}) must have shape (..., {self.k}), not {arr.shape}"
            )
        if not (arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer)):
            raise ValidationError(f"message bits must be bool or integer 0/1, not dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > 1):
            raise ValidationError(f"message bits must be 0 or 1; found values in [{arr.min()}, {arr.max()}]")
        flat = arr.reshape(-1, self.k).astype(np.float32)
        words = (flat @ self._matrix_f32).astype(np.int64) & 1
        return words.astype(np.uint8).reshape(*arr.shape[:-1], self.n)


def _matrix_problem(g: np.ndarray, poly: np.ndarray, n: int, k: int) -> str | None:
    """What is wrong with a generator matrix and polynomial, or ``None`` if they look right."""
    if g.dtype != np.uint8 or g.shape != (k, n):
        return f"matrix must be uint8 of shape ({k}, {n}), not {g.dtype} {g.shape}"
    if poly.dtype != np.uint8 or poly.shape != (n - k + 1,):
        return f"polynomial must be uint8 of shape ({n - k + 1},), not {poly.dtype} {poly.shape}"
    if g.max(initial=0) > 1 or poly.max(initial=0) > 1:
        return "entries must be 0 or 1"
    if poly[0] != 1 or poly[-1] != 1:
        return "g(x) must have degree n - k and a nonzero constant term"
    if not np.array_equal(g[:, :k], np.eye(k, dtype=np.uint8)):
        return "matrix is not systematic [I_k | P]"
    return None


def default_cache_dir() -> Path:
    """``$FEDVEIL_CACHE_DIR/bch`` if set, else ``~/.cache/fedveil/bch``."""
    root = os.environ.get(CACHE_DIR_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "fedveil"
    return base / "bch"


def _galois_version() -> str:
    return metadata.version("galois")


def cache_key(n: int, k: int) -> str:
    """Cache file name (no extension) of ``(n, k)``: length, dimension, galois version, cache format."""
    version = re.sub(r"[^A-Za-z0-9]", "_", _galois_version())
    return f"bch-n{n}-k{k}-galois{version}-fmt{CACHE_FORMAT_VERSION}"


def _metadata(n: int, k: int, d: int, g: np.ndarray, poly: np.ndarray) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT_VERSION,
        "galois": _galois_version(),
        "n": n,
        "k": k,
        "d": d,
        "generator_poly": "".join(str(int(b)) for b in poly),
        "sha256": hashlib.sha256(np.ascontiguousarray(g).tobytes()).hexdigest(),
    }


def _load_cached(npy: Path, meta_path: Path, n: int, k: int, d: int) -> BchCode | None:
    """The cached code, or ``None`` (with a logged reason) when absent or invalid."""
    if not (npy.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        g = np.load(npy, allow_pickle=False)
        bits = meta["generator_poly"]
        if not (isinstance(bits, str) and set(bits) <= {"0", "1"}):
            raise ValueError("generator polynomial is not a bit string")
        poly = np.frombuffer(bits.encode("ascii"), dtype=np.uint8) - ord("0")
        expected = {"format": CACHE_FORMAT_VERSION, "galois": _galois_version(), "n": n, "k": k, "d": d}
        wrong = {key: meta.get(key) for key, value in expected.items() if meta.get(key) != value}
        if wrong:
            raise ValueError(f"metadata mismatch {wrong}")
        problem = _matrix_problem(g, poly, n, k)
        if problem:
            raise ValueError(problem)
        if hashlib.sha256(np.ascontiguousarray(g).tobytes()).hexdigest() != meta["sha256"]:
            raise ValueError("checksum mismatch")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring invalid BCH cache entry %s: %s; rebuilding", npy.name, exc)
        return None
    return BchCode(n, k, d, g, poly)


def _write_atomic(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store(npy: Path, meta_path: Path, code: BchCode) -> None:
    npy.parent.mkdir(parents=True, exist_ok=True)
    meta = _metadata(code.n, code.k, code.d, code.generator_matrix, code.generator_poly)
    _write_atomic(npy, lambda fh: np.save(fh, code.generator_matrix, allow_pickle=False))
    _write_atomic(meta_path, lambda fh: fh.write(json.dumps(meta, indent=1).encode("utf-8")))


def build_with_galois(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Construct ``galois.BCH(n, d=d)``: its generator matrix ``(k, n)`` and ``g(x)`` coefficients (uint8).

    The extension field GF(2^i) is ``galois``' default for BCH codes (MATLAB's primitive polynomial)
    in ``"python-calculate"`` mode, which avoids seconds of JIT compilation for the few hundred field
    operations this needs; the field class is reset to ``galois``' ``"auto"`` mode afterwards.
    """
    import galois

    i = _field_degree(n)
    ext = galois.GF(2**i, irreducible_poly=galois.matlab_primitive_poly(2, i), compile="python-calculate")
    try:
        code = galois.BCH(int(n), d=int(d), extension_field=ext)
        g = np.asarray(code.G.view(np.ndarray), dtype=np.uint8)
        poly = np.asarray(code.generator_poly.coeffs.view(np.ndarray), dtype=np.uint8)
    finally:
        ext.compile("auto")
    return g, poly


def bch_code(n: int, k: int | None = None, *, cache_dir: str | os.PathLike[str] | None = None) -> BchCode:
    """The binary BCH code ``(n, k)``, from the disk cache or built once with ``galois`` and cached.

    ``k`` defaults to :func:`default_message_length` (the smallest valid ``k >= 64``), so
    ``bch_code(127)``, ``bch_code(255)`` and ``bch_code(511)`` are Table 1's codes. ``cache_dir``
    defaults to :func:`default_cache_dir`. Fails with :class:`ConfigError` naming ``n`` or ``k`` and
    the nearest valid choices.
    """
    _field_degree(n)
    n = int(n)
    k = default_message_length(n) if k is None else k
    d = designed_distance(n, k)
    k = int(k)
    npy, meta_path = _paths(n, k, cache_dir)
    cached = _load_cached(npy, meta_path, n, k, d)
    if cached is not None:
        return cached
    g, poly = build_with_galois(n, d)
    code = BchCode(n, k, d, g, poly)
    _store(npy, meta_path, code)
    return code


def cache_paths(code: BchCode, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """Where :func:`bch_code` keeps ``code``: the ``.npy`` matrix and the ``.json`` metadata."""
    return _paths(code.n, code.k, cache_dir)


def _paths(n: int, k: int, cache_dir: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(n, k)
    return directory / f"{key}.npy", directory / f"{key}.json"
