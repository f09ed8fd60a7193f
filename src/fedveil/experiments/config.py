"""Experiment configuration: a YAML file, checked completely before any training starts.

The schema is a tree of frozen dataclasses. Loading rejects unknown keys (listing the allowed ones),
values of the wrong type, and values the protocol does not allow, each with the dotted key, the
value and what is allowed. ``--set a.b=value`` overrides are parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedveil.errors import ConfigError
from fedveil.models.device import check_device_spec
from fedveil.protocols.settings import FDMLConfig, FedAvgConfig
from fedveil.runtime.simulation import LATENCY_KINDS

__all__ = [
    "BOUNDARIES",
    "DATA_KINDS",
    "DP_MODES",
    "NETWORKS",
    "PROTOCOLS",
    "DPSection",
    "DataSection",
    "EnclaveSection",
    "EvalSection",
    "ExperimentConfig",
    "FaultsSection",
    "LatencySection",
    "ModelSection",
    "PhaseSection",
    "RuntimeSection",
    "build_dataclass",
    "config_to_dict",
    "effective_overrides",
    "ignored_keys",
    "keys_without_effect",
    "load_config",
    "load_run_config",
    "parse_overrides",
    "read_yaml_mapping",
    "refuse_keys_without_effect",
    "run_overrides",
    "unused_settings",
]

PROTOCOLS = ("fdml", "fedavg")
DATA_KINDS = ("touchauth-synthetic", "touchauth-csv", "cameraauth-synthetic", "cameraauth-folder")
NETWORKS = ("auto", "touchauth", "resnet34")
DP_MODES = ("paper", "strict")
BOUNDARIES = ("process", "inprocess", "none")


@dataclass(frozen=True)
class LatencySection:
    """Reply latency distribution of a phase, in simulated seconds (see ``LatencyModel``)."""

    kind: str = "lognormal"
    mean: float = 0.5
    spread: float = 0.5


@dataclass(frozen=True)
class PhaseSection:
    """Faults of one phase: failure probability and latency."""

    fail_prob: float = 0.0
    latency: LatencySection = field(default_factory=LatencySection)


@dataclass(frozen=True)
class FaultsSection:
    """Per-phase faults: ``embed`` is FDML's Case A, ``grad`` Case B, ``train`` FedAvg's one phase."""

    embed: PhaseSection = field(default_factory=PhaseSection)
    grad: PhaseSection = field(default_factory=PhaseSection)
    train: PhaseSection = field(default_factory=PhaseSection)


@dataclass(frozen=True)
class DataSection:
    """Where the users come from: the embedded synthetic TouchAuth population (default, scaled by
    the per-model user counts) or real touch logs in the CSV schema of ``fedveil.data.touch_csv``
    at ``path`` (then ``test_users_per_model[0]`` test users are drawn from every phone model, seeded by
    ``seed``, and ``train_users_per_model`` is unused).

    CameraAuth (FDML Sec. VII-B, :mod:`fedveil.data.cameraauth`): ``cameraauth-synthetic`` (the synthetic
    face population) or ``cameraauth-folder`` (a VGGFace2-layout folder at ``path``), with
    ``train_people`` x ``train_photos`` and ``test_people`` x ``test_photos`` photos of side ``image_size``
    (the paper: 300 x 70, 100 x 40; its photo size is not stated)."""

    kind: str = "touchauth-synthetic"
    path: str | None = None
    seed: int = 0
    train_users_per_model: tuple[int, ...] = (507, 333, 287, 270)
    test_users_per_model: tuple[int, ...] = (30, 30, 30, 30)
    train_people: int = 300
    test_people: int = 100
    train_photos: int = 70
    test_photos: int = 40
    image_size: int = 64

    @property
    def stand_in(self) -> str | None:
        """The synthetic population that stands in for real data here (``None``: real data at ``path``)."""
        return {
            "touchauth-synthetic": "the synthetic TouchAuth population (FDML Sec. VII-A's users)",
            "cameraauth-synthetic": "the synthetic face population (FDML Sec. VII-B's CameraAuth)",
        }.get(self.kind)


@dataclass(frozen=True)
class ModelSection:
    """The embedding network: ``auto`` (TouchAuth's network for touch data, ResNet-34 for CameraAuth),
    ``touchauth`` or ``resnet34`` (FDML Sec. VII-B, 64-d output) with its channel ``width`` (1: the
    paper's) and ``norm`` (``batch`` or ``group``: GroupNorm, no dependence on the batch, the default)."""

    network: str = "auto"
    width: float = 1.0
    norm: str = "group"


@dataclass(frozen=True)
class RuntimeSection:
    """Simulation runtime: batched client work, message size limit, torch threads."""

    batched: bool = True
    max_message_bytes: int = 64 * 2**20
    threads: int = 2


@dataclass(frozen=True)
class EnclaveSection:
    """Where FDML's step 5 and step 9 run. ``process``: the emulated TEE, a measured enclave in its own
    OS process behind attestation and per-device encrypted channels (the default); ``inprocess``: the
    same enclave service, attested and encrypted, called in the server's process; ``none``: the
    enclave maths on plaintext in the server (no emulated TEE at all)."""

    boundary: str = "process"
    memory_limit_mib: float = 96.0


@dataclass(frozen=True)
class EvalSection:
    """Evaluation every ``every`` rounds (0 = only at the end) with the Sec. VII-C protocol. Each
    evaluation is one point of ``accuracy.png``: the default gives one point, so set ``every`` to, say, a
    tenth of the rounds for a curve (fewer than three points are drawn as markers, not a line)."""

    every: int = 0
    seed: int = 1234


@dataclass(frozen=True)
class DPSection:
    """FDML Alg. 2 (differentially private derivative release) and whole-training accounting.

    ``mode``: ``paper`` (clip each coordinate to [-T, T]; Thm V.1's per-round epsilon) or ``strict``
    (clip each derivative vector to L1 norm T; the strict analysis of docs/privacy.md). Give exactly
    one of ``round_epsilon`` (per round, as the paper does) or ``noise_b`` (the Laplace scale), or
    neither and ``target_epsilon`` (whole training at ``delta``) to calibrate the noise to it. A
    ``target_epsilon`` is also a hard limit the run never exceeds: a plan whose rounds would pass it
    is refused before training (``when_exhausted: refuse``) or trained until the round that would
    pass it, where it stops (``when_exhausted: stop``).
    """

    enabled: bool = False
    mode: str = "paper"
    bound_T: float = 2e-5
    drop_rate: float = 0.2
    round_epsilon: float | None = None
    target_epsilon: float | None = None
    noise_b: float | None = None
    delta: float = 1e-5
    when_exhausted: str = "refuse"


@dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: a protocol trained for ``rounds`` rounds on a data set, evaluated; the devices'
    networks run on ``device`` (:func:`~fedveil.models.device.resolve_device`: ``auto``, ``cpu``,
    ``cuda``, ``cuda:N``; the enclave and the server stay on the CPU)."""

    name: str = "experiment"
    protocol: str = "fdml"
    seed: int = 0
    rounds: int = 100
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    fdml: FDMLConfig = field(default_factory=FDMLConfig)
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)
    dp: DPSection = field(default_factory=DPSection)
    enclave: EnclaveSection = field(default_factory=EnclaveSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    eval: EvalSection = field(default_factory=EvalSection)
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol: {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if self.rounds < 1:
            raise ConfigError(f"rounds: {self.rounds!r} must be >= 1")
        if self.data.kind not in DATA_KINDS:
            raise ConfigError(f"data.kind: {self.data.kind!r} is not one of {', '.join(DATA_KINDS)}")
        if self.data.kind == "touchauth-csv" and not self.data.path:
            raise ConfigError("data.path: touchauth-csv needs the path of a touch-log CSV file")
        if self.data.kind == "cameraauth-folder" and not self.data.path:
            raise ConfigError(
                "data.path: cameraauth-folder needs a VGGFace2-layout folder (root/n000001/0001_01.jpg)"
            )
        if self.data.image_size < 32:
            raise ConfigError(
                f"data.image_size: {self.data.image_size!r} must be >= 32 (ResNet-34's smallest input)"
            )
        if self.model.network not in NETWORKS:
            raise ConfigError(f"model.network: {self.model.network!r} is not one of {', '.join(NETWORKS)}")
        if self.model.norm not in ("batch", "group"):
            raise ConfigError(f"model.norm: {self.model.norm!r} is not one of batch, group")
        camera = self.data.kind.startswith("cameraauth")
        if (self.network == "touchauth") == camera:
            raise ConfigError(
                f"model.network: {self.network!r} does not read {self.data.kind!r} data "
                "(touchauth reads touch events, resnet34 reads photos)"
            )
        if self.eval.every < 0:
            raise ConfigError(f"eval.every: {self.eval.every!r} must be >= 0 (0 = evaluate only at the end)")
        if self.runtime.threads < 1:
            raise ConfigError(f"runtime.threads: {self.runtime.threads!r} must be >= 1")
        self._check_dp()
        if self.enclave.boundary not in BOUNDARIES:
            raise ConfigError(
                f"enclave.boundary: {self.enclave.boundary!r} is not one of {', '.join(BOUNDARIES)}"
            )
        if not self.enclave.memory_limit_mib >= 1:
            raise ConfigError(f"enclave.memory_limit_mib: {self.enclave.memory_limit_mib!r} must be >= 1")
        for phase in ("embed", "grad", "train"):
            lat = getattr(self.faults, phase).latency
            if lat.kind not in LATENCY_KINDS:
                raise ConfigError(
                    f"faults.{phase}.latency.kind: {lat.kind!r} is not one of {', '.join(LATENCY_KINDS)}"
                )
            if not 0 <= getattr(self.faults, phase).fail_prob <= 1:
                raise ConfigError(
                    f"faults.{phase}.fail_prob: {getattr(self.faults, phase).fail_prob!r} must be in [0, 1]"
                )

    @property
    def network(self) -> str:
        """The embedding network ``model.network`` resolves to for this data."""
        if self.model.network != "auto":
            return self.model.network
        return "resnet34" if self.data.kind.startswith("cameraauth") else "touchauth"

    def _check_dp(self) -> None:
        dp = self.dp
        if not dp.enabled:
            return
        if self.protocol != "fdml":
            raise ConfigError(
                f"dp.enabled: differential privacy is FDML's Alg. 2; protocol is {self.protocol!r}"
            )
        if dp.mode not in DP_MODES:
            raise ConfigError(f"dp.mode: {dp.mode!r} is not one of {', '.join(DP_MODES)}")
        given = [k for k in ("round_epsilon", "noise_b") if getattr(dp, k) is not None]
        if len(given) > 1 or not (given or dp.target_epsilon is not None):
            raise ConfigError(
                "dp: set the noise by exactly one of round_epsilon, noise_b, or target_epsilon alone; "
                f"got {given or 'none'}"
            )
        if dp.target_epsilon is not None:
            given.append("target_epsilon")
        if dp.when_exhausted not in ("refuse", "stop"):
            raise ConfigError(f"dp.when_exhausted: {dp.when_exhausted!r} is not one of refuse, stop")
        for key in ("bound_T", *given):
            if not getattr(dp, key) > 0:
                raise ConfigError(f"dp.{key}: {getattr(dp, key)!r} must be > 0")
        if not 0 <= dp.drop_rate < 1:
            raise ConfigError(f"dp.drop_rate: {dp.drop_rate!r} must be in [0, 1)")
        if not 0 < dp.delta < 1:
            raise ConfigError(f"dp.delta: {dp.delta!r} must be in (0, 1)")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against annotation ``tp`` (building nested dataclasses); ConfigError if wrong."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of {_keys(tp)}, got {value!r}")
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(path, value, inner[0])
    if origin is tuple:
        (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{path}: expected a list of {_type_name(item)}, got {value!r}")
        return tuple(_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            value = _yaml11_float(path, value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp!r}")


def _yaml11_float(path: str, text: str) -> float | str:
    """PyYAML reads ``1e-3`` (no dot) as a string (YAML 1.1); accept such exponent forms as numbers."""
    try:
        return float(text)
    except ValueError:
        return text


def _keys(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _build(cls: type, raw: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{path}: unknown key; allowed keys here are: {_keys(cls)}")
        kwargs[key] = _coerce(path, value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(f"{prefix}.{msg}" if prefix and not msg.startswith(prefix) else msg) from None


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Turn ``["fdml.lr=0.001", "rounds=5"]`` into a nested dict; values are YAML scalars."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set fdml.lr=0.001")
        key, text = item.split("=", 1)
        _put(tree, key.strip(), yaml.safe_load(text), f"--set {item!r}")
    return tree


def _put(tree: dict[str, Any], key: str, value: Any, what: str) -> None:
    """Set the dotted ``key`` of the nested ``tree`` to ``value`` (``what`` names the option in errors)."""
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{what}: {part} is already set to a value")
    node[parts[-1]] = value


def run_overrides(sets: Sequence[str], options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The nested overrides a system's run command lays over its config file: the ``--set KEY=VALUE``
    items (:func:`parse_overrides`), then the command's own options on top, each a dotted key with its
    value (``None``: the option was not given), e.g. ``{"ppfl.rounds_per_stage": 3, "trials": None}``."""
    tree = parse_overrides(sets)
    for key, value in (options or {}).items():
        if value is not None:
            _put(tree, key, value, key)
    return tree


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path`` (empty for an empty file); ConfigError naming the
    file when it is missing, not YAML, or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, Mapping):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return dict(loaded or {})


def build_dataclass(cls: type, raw: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> Any:
    """``cls`` (a tree of frozen dataclasses) from ``raw`` laid over ``base`` (nested mappings merge):
    unknown keys are refused listing the allowed ones, values are type-checked, and the dataclasses'
    own checks run."""
    return _build(cls, _merge(dict(base or {}), raw))


def load_run_config(
    cls: type,
    path: str | Path | None,
    overrides: Mapping[str, Any] | None = None,
    *,
    base: Mapping[str, Any] | None = None,
    unused: Callable[[Any], Sequence[tuple[str, bool, str]]] | None = None,
) -> Any:
    """A system's run settings ``cls`` (a tree of frozen dataclasses) from the YAML file ``path`` (``None``:
    none) laid over ``base``, with ``overrides`` (nested, e.g. :func:`run_overrides`) on top, checked as
    :func:`build_dataclass` checks, so that a wrong key or value fails before any training, named.

    ``unused(cfg)`` gives the rules (:func:`keys_without_effect`) of the keys ``cfg``'s setting ignores:
    a key of the file that the file's own setting ignores is refused naming the file, unless it holds its
    default value (a run's resolved config states every setting, so that it can be run again as it is),
    and so is an override that the final setting ignores (an override that makes a file key moot is its
    intent)."""
    file_raw = {} if path is None else read_yaml_mapping(path)
    given = dict(overrides or {})
    cfg = build_dataclass(cls, _merge(file_raw, given), base)
    if unused is not None:
        try:
            as_filed = build_dataclass(cls, file_raw, base)
        except ConfigError:  # the file needs its overrides to be a config at all
            as_filed = cfg
        try:
            defaults = _dotted(config_to_dict(build_dataclass(cls, {}, base)))
        except ConfigError:  # settings without a default: every key of the file is the file's choice
            defaults = {}
        stated = {k: v for k, v in _dotted(file_raw).items() if k not in defaults or defaults[k] != v}
        refuse_keys_without_effect(stated, unused(as_filed), f"{path}: ")
        refuse_keys_without_effect(given, unused(cfg))
    return cfg


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, refuse_ignored: bool = False
) -> ExperimentConfig:
    """Load, override and validate an experiment config (``path=None`` starts from the defaults).

    ``refuse_ignored`` (the commands that train) also refuses a key the chosen setting does not use
    (:func:`ignored_keys`: it would have no effect) and a ``data.path`` that does not exist: an override
    the final config ignores, or a key of the file that the file's own setting ignores (a file key made
    moot by an override that changes the setting, e.g. ``--set protocol=fedavg`` on an FDML config, is
    the override's intent)."""
    unused = unused_settings if refuse_ignored else None
    cfg = load_run_config(ExperimentConfig, path, parse_overrides(overrides), unused=unused)
    if refuse_ignored and cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path: {cfg.data.path!r} does not exist (data.kind {cfg.data.kind!r})")
    return cfg


def effective_overrides(path: str | Path | None, overrides: Sequence[str]) -> list[str]:
    """Those of ``overrides`` that the config at ``path`` with all of them reads (the others have no
    effect there): one list of overrides can then serve runs of different settings."""
    cfg = load_config(path, overrides)
    return [item for item in overrides if not ignored_keys(cfg, parse_overrides([item]))]


def _dotted(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_dotted(value, f"{path}."))
        else:
            out[path] = value
    return out


def ignored_keys(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> list[str]:
    """The keys given in ``raw`` (a config file with its overrides) that ``cfg``'s setting never reads
    (:func:`unused_settings`), each as ``"key=value has no effect: why"``."""
    return keys_without_effect(raw, unused_settings(cfg))


def unused_settings(cfg: ExperimentConfig) -> list[tuple[str, bool, str]]:
    """The rules (:func:`keys_without_effect`) of the settings ``cfg`` never reads: a path with synthetic
    data, photo sizes with touch data, one protocol's section in the other's run, the enclave without
    FDML's TEE, DP settings with ``dp.enabled: false``, ..."""
    d = cfg.data
    camera = d.kind.startswith("cameraauth")
    kind = f"data.kind is {d.kind!r}"
    return [
        (
            "data.path",
            d.kind not in ("touchauth-csv", "cameraauth-folder"),
            f"only data.kind touchauth-csv and cameraauth-folder read a path; {kind}",
        ),
        (
            "data.train_users_per_model",
            d.kind != "touchauth-synthetic",
            f"only data.kind touchauth-synthetic draws its users; {kind}",
        ),
        ("data.test_users_per_model", camera, f"it counts touch users; {kind}"),
        *(
            (f"data.{k}", not camera, f"it sizes CameraAuth photos; {kind}")
            for k in ("train_people", "test_people", "train_photos", "test_photos", "image_size")
        ),
        *(
            (
                f"model.{k}",
                cfg.network != "resnet34",
                f"only ResNet-34 has it; the network is {cfg.network!r}",
            )
            for k in ("width", "norm")
        ),
        ("fdml", cfg.protocol != "fdml", f"protocol is {cfg.protocol!r}"),
        ("fedavg", cfg.protocol != "fedavg", f"protocol is {cfg.protocol!r}"),
        ("enclave", cfg.protocol != "fdml", f"only FDML has an enclave; protocol is {cfg.protocol!r}"),
        (
            "enclave.memory_limit_mib",
            cfg.enclave.boundary == "none",
            "enclave.boundary is 'none': no enclave runs",
        ),
        ("faults.embed", cfg.protocol != "fdml", f"it is an FDML phase; protocol is {cfg.protocol!r}"),
        ("faults.grad", cfg.protocol != "fdml", f"it is an FDML phase; protocol is {cfg.protocol!r}"),
        ("faults.train", cfg.protocol != "fedavg", f"it is FedAvg's phase; protocol is {cfg.protocol!r}"),
        *(
            (f"dp.{k}", not cfg.dp.enabled, "dp.enabled is false")
            for k in (f.name for f in dataclasses.fields(DPSection))
            if k != "enabled"
        ),
    ]


def keys_without_effect(raw: Mapping[str, Any], rules: Sequence[tuple[str, bool, str]]) -> list[str]:
    """The keys given in ``raw`` that a rule ``(dotted key or section, unused, why)`` whose ``unused``
    holds covers, each as ``"key=value has no effect: why"`` (every system's config check)."""
    out = []
    for key, value in _dotted(raw).items():
        for prefix, unused, why in rules:
            if unused and (key == prefix or key.startswith(f"{prefix}.")):
                out.append(f"{key}={value!r} has no effect: {why}")
                break
    return out


def refuse_keys_without_effect(
    raw: Mapping[str, Any], rules: Sequence[tuple[str, bool, str]], where: str = ""
) -> None:
    """A ConfigError naming every key of ``raw`` that ``rules`` say has no effect
    (:func:`keys_without_effect`); ``where`` prefixes the message (e.g. the file)."""
    _refuse(keys_without_effect(raw, rules), where)


def _refuse(ignored: list[str], where: str = "") -> None:
    if ignored:
        raise ConfigError(
            f"{where}{'; '.join(ignored)}: remove {'it' if len(ignored) == 1 else 'them'}, or change the "
            "setting it depends on"
        )


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain YAML-ready data (tuples become lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))
