"""fedveil: privacy-preserving federated learning (FDML, FedUV, projector-head FL, PoliFL, PPFL).

The public API is the names in ``__all__`` (docs/api.md maps them): run an experiment (:func:`run`),
train FedAvg on your own model and data (:func:`train_fedavg`) or drive the FedAvg engine and its hooks
yourself, federated datasets and partitioners, the model zoo, privacy accounting and ledgers, PoliFL's
policies, the attacks on what an observer saw, and each system's entry point. Everything else is internal.

Names are loaded on first use (``import fedveil`` imports neither torch nor numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedveil._version import __version__ as __version__

if TYPE_CHECKING:
    from fedveil.api import FedAvgPrivacy, FedAvgResult, ServerUploads, load_config, run, train_fedavg
    from fedveil.attacks.dlg import dlg_attack
    from fedveil.attacks.dp_audit import audit_mechanism
    from fedveil.attacks.idlg import idlg_attack
    from fedveil.attacks.inversion import evaluate_inversion
    from fedveil.attacks.inverting_gradients import inverting_gradients_attack
    from fedveil.attacks.lira import lira_attack
    from fedveil.attacks.mia_nasr import nasr_attack, snapshot_model
    from fedveil.attacks.mia_yeom import yeom_attack
    from fedveil.attacks.observe import WireObserver
    from fedveil.attacks.pia_melis import melis_attack
    from fedveil.attacks.scores import AttackScores
    from fedveil.attacks.views import ModelView, NoPlaintextView, SealedView, UpdateView
    from fedveil.data.federated import FederatedDataset, UserData
    from fedveil.data.images import ImageData, load_image_dataset
    from fedveil.data.partition import classes_per_client, dirichlet, iid, partition, to_federated
    from fedveil.errors import ConfigError, FedveilError, ValidationError
    from fedveil.experiments.aiot.runner import load_aiot_run, run_aiot
    from fedveil.experiments.config import ExperimentConfig
    from fedveil.experiments.feduv.runner import load_feduv_config, run_feduv
    from fedveil.experiments.polifl.runner import load_polifl_run, run_polifl
    from fedveil.experiments.ppfl.runner import load_ppfl_run, run_ppfl
    from fedveil.models.flat import FlatModel
    from fedveil.models.zoo import MODELS, build_model, count_parameters
    from fedveil.privacy.accounting import (
        Accountant,
        GaussianRelease,
        LaplaceRelease,
        PureEpsilonRelease,
        calibrate_noise,
        epsilon_of,
    )
    from fedveil.privacy.groups import GroupLedger
    from fedveil.privacy.ledger import PrivacyLedger, fdml_privacy_summary
    from fedveil.privacy.policy import Call, Policy, advance, allows, derivative
    from fedveil.privacy.policy import parse as parse_policy
    from fedveil.protocols.fedavg import (
        ClipAndNoise,
        FedAvgEngine,
        FitResult,
        ImageFedAvgConfig,
        ModelClients,
        ModelServer,
        ParameterPlan,
        evaluate_model,
        fedavg_aggregate,
        select_uniform,
    )
    from fedveil.protocols.local import LocalOptimizer
    from fedveil.protocols.polifl import DPAggregate
    from fedveil.runtime.simulation import SimulationRuntime

_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fedveil.api", ("FedAvgPrivacy", "FedAvgResult", "ServerUploads", "load_config", "run", "train_fedavg")),
    ("fedveil.experiments.config", ("ExperimentConfig",)),
    (
        "fedveil.protocols.fedavg",
        (
            "ClipAndNoise",
            "FedAvgEngine",
            "FitResult",
            "ImageFedAvgConfig",
            "ModelClients",
            "ModelServer",
            "ParameterPlan",
            "evaluate_model",
            "fedavg_aggregate",
            "select_uniform",
        ),
    ),
    ("fedveil.protocols.local", ("LocalOptimizer",)),
    ("fedveil.protocols.polifl", ("DPAggregate",)),
    ("fedveil.models.flat", ("FlatModel",)),
    ("fedveil.runtime.simulation", ("SimulationRuntime",)),
    ("fedveil.data.federated", ("FederatedDataset", "UserData")),
    (
        "fedveil.data.partition",
        ("classes_per_client", "dirichlet", "iid", "partition", "to_federated"),
    ),
    ("fedveil.data.images", ("ImageData", "load_image_dataset")),
    ("fedveil.models.zoo", ("MODELS", "build_model", "count_parameters")),
    (
        "fedveil.privacy.accounting",
        (
            "Accountant",
            "GaussianRelease",
            "LaplaceRelease",
            "PureEpsilonRelease",
            "calibrate_noise",
            "epsilon_of",
        ),
    ),
    ("fedveil.privacy.groups", ("GroupLedger",)),
    ("fedveil.privacy.ledger", ("PrivacyLedger", "fdml_privacy_summary")),
    ("fedveil.privacy.policy", ("Call", "Policy", "advance", "allows", "derivative")),
    ("fedveil.attacks.views", ("ModelView", "NoPlaintextView", "SealedView", "UpdateView")),
    ("fedveil.attacks.observe", ("WireObserver",)),
    ("fedveil.attacks.scores", ("AttackScores",)),
    ("fedveil.attacks.dlg", ("dlg_attack",)),
    ("fedveil.attacks.dp_audit", ("audit_mechanism",)),
    ("fedveil.attacks.idlg", ("idlg_attack",)),
    ("fedveil.attacks.inversion", ("evaluate_inversion",)),
    ("fedveil.attacks.inverting_gradients", ("inverting_gradients_attack",)),
    ("fedveil.attacks.mia_yeom", ("yeom_attack",)),
    ("fedveil.attacks.mia_nasr", ("nasr_attack", "snapshot_model")),
    ("fedveil.attacks.pia_melis", ("melis_attack",)),
    ("fedveil.attacks.lira", ("lira_attack",)),
    ("fedveil.experiments.feduv.runner", ("load_feduv_config", "run_feduv")),
    ("fedveil.experiments.aiot.runner", ("load_aiot_run", "run_aiot")),
    ("fedveil.experiments.polifl.runner", ("load_polifl_run", "run_polifl")),
    ("fedveil.experiments.ppfl.runner", ("load_ppfl_run", "run_ppfl")),
    ("fedveil.errors", ("ConfigError", "FedveilError", "ValidationError")),
)

_RENAMED = {"parse_policy": ("fedveil.privacy.policy", "parse")}
"""Public names that differ from the name in their module (``parse`` alone would not say what it reads)."""

_WHERE: dict[str, tuple[str, str]] = {
    name: (module, name) for module, names in _SOURCES for name in names
} | _RENAMED

__all__ = [
    "MODELS",
    "Accountant",
    "AttackScores",
    "Call",
    "ClipAndNoise",
    "ConfigError",
    "DPAggregate",
    "ExperimentConfig",
    "FedAvgEngine",
    "FedAvgPrivacy",
    "FedAvgResult",
    "FederatedDataset",
    "FedveilError",
    "FitResult",
    "FlatModel",
    "GaussianRelease",
    "GroupLedger",
    "ImageData",
    "ImageFedAvgConfig",
    "LaplaceRelease",
    "LocalOptimizer",
    "ModelClients",
    "ModelServer",
    "ModelView",
    "NoPlaintextView",
    "ParameterPlan",
    "Policy",
    "PrivacyLedger",
    "PureEpsilonRelease",
    "SealedView",
    "ServerUploads",
    "SimulationRuntime",
    "UpdateView",
    "UserData",
    "ValidationError",
    "WireObserver",
    "advance",
    "allows",
    "audit_mechanism",
    "build_model",
    "calibrate_noise",
    "classes_per_client",
    "count_parameters",
    "derivative",
    "dirichlet",
    "dlg_attack",
    "epsilon_of",
    "evaluate_inversion",
    "evaluate_model",
    "fdml_privacy_summary",
    "fedavg_aggregate",
    "idlg_attack",
    "iid",
    "inverting_gradients_attack",
    "lira_attack",
    "load_aiot_run",
    "load_config",
    "load_feduv_config",
    "load_image_dataset",
    "load_polifl_run",
    "load_ppfl_run",
    "melis_attack",
    "nasr_attack",
    "parse_policy",
    "partition",
    "run",
    "run_aiot",
    "run_feduv",
    "run_polifl",
    "run_ppfl",
    "select_uniform",
    "snapshot_model",
    "to_federated",
    "train_fedavg",
    "yeom_attack",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562) and keep it on the package."""
    if name not in _WHERE:
        raise AttributeError(
            f"module 'fedveil' has no attribute {name!r}; its public names are fedveil.__all__"
        )
    module, attr = _WHERE[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own names and the public API."""
    return sorted({*globals(), *__all__})
