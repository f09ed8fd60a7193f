"""The enclave's measurement: an emulated MRENCLAVE over the trusted files and the launch configuration.

Under Gramine (``packaging/gramine/enclave.manifest.template``), every trusted file is listed in the
manifest with its SHA-256, the manifest itself feeds MRENCLAVE, and Gramine refuses to open a trusted
file whose content no longer matches. fedveil emulates that identity as one SHA-256 (all integers
big-endian)::

    SHA-256( b"fedveil-enclave-measurement/v1"
             | u32 number of files
             | for each trusted file, sorted by its relative path:
                   u32 len(path) | path (UTF-8, "/"-separated) | SHA-256(content)
             | u32 len(config) | config )

where ``config`` is :meth:`EnclaveConfig.canonical_json`. The trusted files are every file of the
``fedveil/enclave/`` package (recursively; ``__pycache__`` excluded, see ``docs/tee.md``) plus the three
files of ``fedveil`` that the enclave process executes: ``fedveil/__init__.py``, ``fedveil/_version.py``
and ``fedveil/errors.py``. Paths are relative to the directory that holds the ``fedveil`` package, so
the same code measures the same anywhere on disk, and changing any byte of any trusted file, or any
configuration value, changes the measurement.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from fedveil.errors import ConfigError

DEFAULT_MEMORY_LIMIT_BYTES = 96 * 2**20
"""SGX1's EPC is 128 MiB of which about 93 MiB is usable by enclaves; fedveil's default heap budget."""

MIN_MEMORY_LIMIT_BYTES = 2**20
TRIPLET_STRATEGIES = ("batch-all", "semi-hard")
MEASUREMENT_DOMAIN = b"fedveil-enclave-measurement/v1"
ENCLAVE_PACKAGE = "fedveil/enclave"
SHARED_TRUSTED_FILES = ("fedveil/__init__.py", "fedveil/_version.py", "fedveil/errors.py")
"""Files outside the enclave package that the enclave process runs (the parent package and the errors)."""

_U32 = struct.Struct(">I")
_CONFIG_KEYS = (
    "dp_bound_T",
    "dp_drop_rate",
    "dp_mode",
    "dp_noise_b",
    "dp_seed",
    "margin",
    "memory_limit_bytes",
    "strategy",
)
DP_MODES = ("paper", "strict")


def package_root() -> Path:
    """The directory that holds the installed ``fedveil`` package (``src/`` in a checkout)."""
    return Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class EnclaveConfig:
    """The enclave's launch configuration; part of the measurement, so clients attest to it.

    ``memory_limit_bytes`` bounds the enclave heap per call (default 96 MiB, SGX1's usable EPC);
    ``margin`` and ``strategy`` fix the triplet loss of FDML Alg. 1 that the enclave computes, so the
    untrusted host cannot change the loss without changing the measurement. ``dp_mode`` (``None``:
    no DP; ``paper`` or ``strict``), ``dp_bound_T``, ``dp_noise_b`` and ``dp_drop_rate`` switch step 5
    to FDML Alg. 2 (:mod:`fedveil.enclave.dp`), measured likewise. ``dp_seed`` seeds its noise for
    reproducible simulations only: a seed anyone knows lets a participant subtract the noise, so a
    deployment leaves it ``None`` and the enclave draws exact discrete Laplace noise on a grid from the
    operating system's CSPRNG (:class:`~fedveil.enclave.secure_noise.SecureNoise`), which also resists
    the attack on the low-order bits of floating-point noise.
    """

    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES
    margin: float = 1.0
    strategy: str = "batch-all"
    dp_mode: str | None = None
    dp_bound_T: float = 0.0
    dp_noise_b: float = 0.0
    dp_drop_rate: float = 0.0
    dp_seed: int | None = None

    def __post_init__(self) -> None:
        limit = self.memory_limit_bytes
        if type(limit) is not int or limit < MIN_MEMORY_LIMIT_BYTES:
            raise ConfigError(
                f"memory_limit_bytes {limit!r} must be an int >= {MIN_MEMORY_LIMIT_BYTES} (1 MiB); "
                f"the default is {DEFAULT_MEMORY_LIMIT_BYTES} (96 MiB)"
            )
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise ConfigError(f"margin {margin!r} must be a finite number > 0")
        if not margin > 0:
            raise ConfigError(f"margin {margin!r} must be > 0")
        object.__setattr__(self, "margin", float(margin))
        if self.strategy not in TRIPLET_STRATEGIES:
            raise ConfigError(f"strategy {self.strategy!r} is not one of {', '.join(TRIPLET_STRATEGIES)}")
        self._check_dp()

    def _check_dp(self) -> None:
        if self.dp_seed is not None and (type(self.dp_seed) is not int or self.dp_seed < 0):
            raise ConfigError(f"dp_seed {self.dp_seed!r} must be None or an int >= 0")
        if self.dp_mode is None:
            if (self.dp_bound_T, self.dp_noise_b, self.dp_drop_rate) != (0.0, 0.0, 0.0):
                raise ConfigError("dp_bound_T, dp_noise_b and dp_drop_rate need dp_mode 'paper' or 'strict'")
            return
        if self.dp_mode not in DP_MODES:
            raise ConfigError(f"dp_mode {self.dp_mode!r} is not one of None, {', '.join(DP_MODES)}")
        for name in ("dp_bound_T", "dp_noise_b", "dp_drop_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} {value!r} must be a finite number")
            object.__setattr__(self, name, float(value))
        if not (self.dp_bound_T > 0 and self.dp_noise_b > 0):
            raise ConfigError(
                f"dp_bound_T {self.dp_bound_T!r} and dp_noise_b {self.dp_noise_b!r} must be > 0"
            )
        if not 0 <= self.dp_drop_rate < 1:
            raise ConfigError(f"dp_drop_rate {self.dp_drop_rate!r} must be in [0, 1)")

    def canonical_json(self) -> bytes:
        """The configuration as canonical JSON (sorted keys, no spaces, ASCII): the measured bytes."""
        fields = {name: getattr(self, name) for name in _CONFIG_KEYS}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("ascii")

    @classmethod
    def from_json(cls, data: bytes | str) -> EnclaveConfig:
        """Parse :meth:`canonical_json` output (any key order); unknown or missing keys are refused."""
        try:
            fields = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"enclave config is not valid JSON: {exc}") from exc
        if not isinstance(fields, dict) or sorted(fields) != list(_CONFIG_KEYS):
            keys = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ConfigError(f"enclave config has keys {keys}, expected exactly {list(_CONFIG_KEYS)}")
        return cls(**fields)


@dataclass(frozen=True)
class Measurement:
    """A computed measurement: ``digest`` (32 bytes), the ``(path, sha256 hex)`` of every trusted file
    in measured order, and the canonical ``config`` bytes."""

    digest: bytes
    files: tuple[tuple[str, str], ...]
    config: bytes

    @property
    def hex(self) -> str:
        """The digest as 64 lowercase hex characters (what ``fedveil enclave measure`` prints)."""
        return self.digest.hex()


def trusted_files(root: Path | None = None) -> list[str]:
    """Relative paths (sorted, ``/``-separated) of the trusted files under ``root`` (default:
    :func:`package_root`): every file of ``fedveil/enclave/`` except ``__pycache__``, plus
    ``fedveil/__init__.py``, ``fedveil/_version.py`` and ``fedveil/errors.py``."""
    base = package_root() if root is None else Path(root)
    enclave_dir = base / ENCLAVE_PACKAGE
    if not enclave_dir.is_dir():
        raise ConfigError(f"no enclave package at {enclave_dir}: pass the directory that holds fedveil/")
    paths = [
        p.relative_to(base).as_posix()
        for p in enclave_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.relative_to(enclave_dir).parts
    ]
    for shared in SHARED_TRUSTED_FILES:
        if not (base / shared).is_file():
            raise ConfigError(f"trusted file {shared} is missing under {base}")
        paths.append(shared)
    return sorted(paths)


def measure_enclave(config: EnclaveConfig, *, root: Path | None = None) -> Measurement:
    """The measurement of the enclave code under ``root`` (default: the installed package) launched
    with ``config``: the formula in this module's docstring."""
    base = package_root() if root is None else Path(root)
    files = tuple((rel, hashlib.sha256((base / rel).read_bytes()).hexdigest()) for rel in trusted_files(base))
    cfg = config.canonical_json()
    h = hashlib.sha256(MEASUREMENT_DOMAIN)
    h.update(_U32.pack(len(files)))
    for rel, digest in files:
        name = rel.encode("utf-8")
        h.update(_U32.pack(len(name)) + name + bytes.fromhex(digest))
    h.update(_U32.pack(len(cfg)) + cfg)
    return Measurement(h.digest(), files, cfg)
