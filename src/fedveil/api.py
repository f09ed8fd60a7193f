"""The one-call entry points of fedveil's public API (re-exported by :mod:`fedveil`).

- :func:`load_config` and :func:`run`: a ``fedveil run`` experiment (FDML or FL-traditional) from Python,
  with the command's checks and run directory.
- :func:`train_fedavg`: FedAvg of a user's own ``torch.nn.Module`` on a
  :class:`~fedveil.data.federated.FederatedDataset`, optionally with client-level differential privacy,
  on the one FedAvg engine (:class:`~fedveil.protocols.fedavg.ModelServer` and
  :class:`~fedveil.protocols.fedavg.ModelClients` over the in-process
  :class:`~fedveil.runtime.simulation.SimulationRuntime`), returning the trained weights, the per-round
  history, the privacy spent and, on request, what the server saw of every upload.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedveil.errors import ConfigError, ValidationError

if TYPE_CHECKING:
    import torch

    from fedveil.attacks.views import UpdateView
    from fedveil.data.federated import FederatedDataset
    from fedveil.experiments.config import ExperimentConfig
    from fedveil.protocols.fedavg import Aggregate, FitResult

__all__ = [
    "DP_MECHANISM",
    "FedAvgPrivacy",
    "FedAvgResult",
    "ServerUploads",
    "load_config",
    "run",
    "train_fedavg",
]

DP_MECHANISM = (
    "client-level DP-FedAvg (McMahan et al. 2018): each client's update clipped to L2 norm clip_norm, "
    "Gaussian noise of standard deviation noise_multiplier * clip_norm on the sum of the cohort's updates "
    "(add/remove one client's whole data), clients_per_round of the N clients drawn uniformly without "
    "replacement each round and accounted as Poisson sampling at rate clients_per_round / N"
)
"""The mechanism :func:`train_fedavg` applies and accounts for when it adds noise."""


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The experiment config at ``path`` with ``overrides`` applied, checked as ``fedveil run`` checks it.

    ``overrides`` are the command's ``--set`` strings, ``"key=value"`` with a dotted key
    (``"fdml.lr=0.001"``, ``"rounds=3"``); a key that does not exist, a value of the wrong type, or a key
    the chosen setting would ignore is a :class:`~fedveil.errors.ConfigError` naming it.
    """
    from fedveil.experiments import config

    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, not the string {overrides!r}")
    return config.load_config(path, list(overrides), refuse_ignored=True)


def run(
    config_or_path: ExperimentConfig | str | Path,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Train and evaluate one ``fedveil run`` experiment into the run directory ``out``; its results.

    ``config_or_path`` is an :class:`~fedveil.experiments.config.ExperimentConfig` (e.g. from
    :func:`load_config`) or the path of a YAML config. ``out`` must be missing or empty unless ``resume``
    (continue the run in it from its checkpoint) or ``overwrite`` (clear the run it holds first) is given,
    as with the command's ``--resume`` and ``--overwrite``. Returns the object the run directory's
    ``results.json`` holds (:func:`fedveil.experiments.fdml.runner.run_experiment`); ``progress`` shows a
    progress bar.
    """
    from fedveil.experiments.config import ExperimentConfig
    from fedveil.experiments.fdml.runner import run_experiment

    if isinstance(config_or_path, (str, Path)):
        cfg = load_config(config_or_path)
    elif isinstance(config_or_path, ExperimentConfig):
        cfg = config_or_path
    else:
        raise ConfigError(
            f"run takes an ExperimentConfig or the path of a YAML config, not {type(config_or_path).__name__}"
        )
    if not isinstance(out, (str, Path)):
        raise ConfigError(f"out must be the path of a run directory, not {type(out).__name__}")
    return run_experiment(cfg, out, progress=progress, resume=resume, overwrite=overwrite)


@dataclass(frozen=True)
class FedAvgPrivacy:
    """What a noised :func:`train_fedavg` spent: :data:`DP_MECHANISM` with these settings.

    ``epsilon`` is the whole training's (``rounds`` rounds) at ``delta``, ``epsilon_round`` one round's,
    both from :class:`~fedveil.privacy.groups.GroupLedger` over :mod:`fedveil.privacy.accounting` with the
    ``accountant`` named (PLD, or RDP below :data:`~fedveil.privacy.groups.PLD_MIN_Z`). ``noise_on``:
    ``"local"`` (each client adds a share of standard deviation ``noise_multiplier * clip_norm /
    sqrt(clients_per_round)`` to its clipped update; the shares sum to the stated noise, and one upload
    seen alone carries only that share) or ``"central"`` (the server adds it to the sum; the uploads it
    sees are clipped, not noised). The mean local loss each client reports with its upload is not covered.
    """

    mechanism: str
    clip_norm: float
    noise_multiplier: float
    noise_on: str
    clients_per_round: int
    num_clients: int
    sampling_rate: float
    rounds: int
    delta: float
    epsilon: float
    epsilon_round: float
    accountant: str

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class ServerUploads:
    """Every upload the server of a :func:`train_fedavg` run received, by round and client: what an
    honest-but-curious server saw, as :class:`~fedveil.attacks.views.UpdateView` deltas for the attacks.

    Recorded at the engine's aggregation hook, so each upload is as the engine received it through the
    codec (decoded and validated), beside the broadcast it answered and the sender's id (which a wire
    tap, :class:`~fedveil.attacks.observe.WireObserver`, does not learn).
    """

    def __init__(self, model: torch.nn.Module, *, lr: float, local_epochs: int, batch_size: int) -> None:
        self._template = copy.deepcopy(model)
        self._lr, self._epochs, self._batch = lr, local_epochs, batch_size
        self._seen: dict[int, tuple[np.ndarray, dict[str, FitResult]]] = {}

    def wrap(self, aggregate: Aggregate) -> Aggregate:
        """``aggregate`` (the engine's hook), recording each round's broadcast and uploads first."""

        def recorded(rnd: int, results: Any, current: Any) -> Any:
            self._seen[rnd] = (np.array(current, dtype=np.float32), dict(results))
            return aggregate(rnd, results, current)

        return recorded

    @property
    def rounds(self) -> list[int]:
        """The rounds whose uploads were recorded (a round without valid uploads has none)."""
        return sorted(self._seen)

    def views(self, rnd: int, observer: str = "server: per-client update") -> dict[str, UpdateView]:
        """Round ``rnd``'s uploads by client id: each client's delta (its upload minus the broadcast) on a
        copy of the model holding the broadcast weights (one copy per round, shared by the views), with
        the local learning rate and the number of local steps (``local_epochs * ceil(n / batch_size)``)."""
        from fedveil.attacks.views import update_view_from_upload
        from fedveil.models.flat import FlatModel

        if rnd not in self._seen:
            raise ValidationError(f"no uploads of round {rnd} were recorded; recorded rounds: {self.rounds}")
        broadcast, uploads = self._seen[rnd]
        flat = FlatModel(copy.deepcopy(self._template))
        snapshot = flat.load_into_module(broadcast)
        return {
            cid: update_view_from_upload(
                observer=observer,
                model=snapshot,
                names=flat.names,
                shapes=flat.shapes,
                sent=broadcast,
                received=np.asarray(upload.weights),
                lr=self._lr,
                local_steps=self._epochs * -(-upload.num_samples // self._batch),
                num_samples=upload.num_samples,
            )
            for cid, upload in uploads.items()
        }


@dataclass(frozen=True, eq=False)
class FedAvgResult:
    """What :func:`train_fedavg` returns.

    ``state_dict`` holds the trained global model (load it with ``model.load_state_dict``; buffers such as
    BatchNorm's running statistics are the model's own, not federated); ``history`` one dict per round
    (``round``, ``applied``, ``loss``: the sample-weighted mean local training loss of the cohort,
    ``participants``, ``dropouts``, ``bytes_up``, ``bytes_down``, ``lr``, and ``test_accuracy`` /
    ``test_loss`` when a test split was given); ``privacy`` what noise cost (``None`` without noise);
    ``server_uploads`` what the server received, when trained with ``observe=True``.
    """

    state_dict: dict[str, torch.Tensor]
    history: list[dict[str, Any]]
    privacy: FedAvgPrivacy | None
    server_uploads: ServerUploads | None

    @property
    def epsilon(self) -> float | None:
        """The whole training's epsilon at the ``delta`` given, or ``None`` when no noise was added."""
        return None if self.privacy is None else self.privacy.epsilon

    def uploads(self, rnd: int) -> dict[str, UpdateView]:
        """Round ``rnd``'s uploads as the server saw them, by client id (:meth:`ServerUploads.views`)."""
        if self.server_uploads is None:
            raise ConfigError("no uploads were recorded: train with observe=True to keep what the server saw")
        return self.server_uploads.views(rnd)


def _int_at_least(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name} {value!r} must be an integer >= {low}")
    return int(value)


def _positive(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(f"{name} {value!r} must be a finite number > 0")
    return float(value)


def _check_data(model: torch.nn.Module, dataset: FederatedDataset) -> None:
    """Every client holds ``x`` and integer labels ``y`` of equal, non-zero length, and ``model`` maps the
    first client's inputs to logits over enough classes: checked before training, where a failure would
    otherwise be a silent dropout."""
    import torch

    top = (-1, "")
    for uid in dataset.user_ids:
        x, y = dataset.array(uid, "x"), dataset.array(uid, "y")
        if len(x) == 0 or len(x) != len(y) or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise ValidationError(
                f"client {uid!r} holds {len(x)} inputs x and labels y of shape {y.shape}, dtype {y.dtype}: "
                "each client needs >= 1 input and one integer class label per input"
            )
        if int(y.min()) < 0:
            raise ValidationError(f"client {uid!r} has label {int(y.min())}: class labels are 0, 1, 2, ...")
        top = max(top, (int(y.max()), uid))
    first = dataset.user_ids[0]
    x = dataset.array(first, "x")
    probe = torch.from_numpy(np.array(x[:1], dtype=np.float32))
    try:
        with torch.no_grad():
            logits = copy.deepcopy(model).eval()(probe)
    except RuntimeError as exc:
        raise ConfigError(
            f"the model does not accept client {first!r}'s inputs of shape {tuple(x.shape[1:])}: {exc}"
        ) from exc
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ConfigError(f"the model must map a batch to logits (batch, classes); it returned {got}")
    if top[0] >= logits.shape[1]:
        raise ConfigError(
            f"client {top[1]!r} has label {top[0]}, but the model has {logits.shape[1]} outputs"
        )


def train_fedavg(
    model: torch.nn.Module,
    dataset: FederatedDataset,
    *,
    rounds: int,
    clients_per_round: int,
    local_epochs: int = 1,
    lr: float,
    batch_size: int,
    clip_norm: float | None = None,
    noise_multiplier: float | None = None,
    delta: float | None = None,
    noise_on: str = "local",
    test: tuple[np.ndarray, np.ndarray] | None = None,
    observe: bool = False,
    seed: int = 0,
    progress: bool = False,
    device: str = "cpu",
) -> FedAvgResult:
    """Train ``model`` (a classifier: logits over classes) by FedAvg on ``dataset`` and return the result.

    Every client of ``dataset`` holds arrays ``x`` (inputs) and ``y`` (integer class labels). Each of the
    ``rounds`` rounds, the server draws ``clients_per_round`` of them uniformly without replacement and
    sends the global model; each runs ``local_epochs`` epochs of SGD at ``lr`` on cross-entropy in batches
    of ``batch_size`` and uploads its model; the server averages (McMahan et al. 2017). The rounds run on
    the FedAvg engine (:class:`~fedveil.protocols.fedavg.ModelServer`,
    :class:`~fedveil.protocols.fedavg.ModelClients`) over the in-process simulation, so every message goes
    through the codec. ``model`` itself is not changed: the result holds the trained ``state_dict``.

    ``clip_norm`` clips each client's update (trained minus received) to that L2 norm
    (:class:`~fedveil.protocols.fedavg.ClipAndNoise` on the device); the server then takes the unweighted
    mean of the clipped updates (:class:`~fedveil.protocols.polifl.DPAggregate`). ``noise_multiplier``
    (needs ``clip_norm`` and ``delta``) adds Gaussian noise of standard deviation ``noise_multiplier *
    clip_norm`` to each round's sum, on the devices as shares (``noise_on="local"``) or on the server
    (``"central"``), and the result's :class:`FedAvgPrivacy` states :data:`DP_MECHANISM`'s epsilon at
    ``delta``. ``test`` ``(x, y)`` is evaluated after every round. ``observe=True`` keeps every upload the
    server received (:class:`ServerUploads`; memory: all uploads of all rounds), for
    :meth:`FedAvgResult.uploads`. ``seed`` fixes
    the selection, the shuffling, the noise and torch's random draws (torch's global generator is left as
    it was): the same seed gives the same result. ``device`` is where the clients train (``cpu``, ``cuda``,
    ``cuda:N`` or ``auto``: CUDA when available); on a GPU the numbers agree with the CPU's to float32
    rounding, not bit for bit (other kernels).
    """
    import torch

    from fedveil.data.federated import FederatedDataset
    from fedveil.experiments.fedavg_images import run_fedavg
    from fedveil.models.flat import FlatModel
    from fedveil.privacy.accounting import check_delta
    from fedveil.privacy.groups import GroupLedger
    from fedveil.protocols.fedavg import ClipAndNoise, ImageFedAvgConfig, fedavg_aggregate
    from fedveil.protocols.local import LocalOptimizer
    from fedveil.protocols.polifl import DP_MODES, DPAggregate

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(dataset, FederatedDataset):
        raise ConfigError(
            f"dataset must be a FederatedDataset (fedveil.FederatedDataset), not {type(dataset).__name__}"
        )
    if len(dataset) == 0:
        raise ConfigError("the dataset has no clients; give each client a UserData with arrays x and y")
    rounds = _int_at_least("rounds", rounds, 1)
    clients_per_round = _int_at_least("clients_per_round", clients_per_round, 1)
    if clients_per_round > len(dataset):
        raise ConfigError(
            f"clients_per_round {clients_per_round} exceeds the {len(dataset)} clients of the dataset: "
            f"use at most {len(dataset)}"
        )
    local_epochs = _int_at_least("local_epochs", local_epochs, 1)
    batch_size = _int_at_least("batch_size", batch_size, 1)
    seed = _int_at_least("seed", seed, 0)
    lr = _positive("lr", lr)
    if clip_norm is not None:
        clip_norm = _positive("clip_norm", clip_norm)
    if noise_multiplier is not None:
        noise_multiplier = _positive("noise_multiplier", noise_multiplier)
        if clip_norm is None:
            raise ConfigError(
                f"noise_multiplier {noise_multiplier!r} needs clip_norm: the noise is scaled to the clip norm"
            )
        if delta is None:
            raise ConfigError(f"noise_multiplier {noise_multiplier!r} needs delta, the delta of the epsilon")
        delta = check_delta(delta)
    elif delta is not None:
        raise ConfigError(f"delta {delta!r} is only used with noise_multiplier; give both or neither")
    if noise_on not in DP_MODES:
        raise ConfigError(f"noise_on {noise_on!r} is not one of {', '.join(DP_MODES)}")
    if test is not None and (
        not isinstance(test, tuple) or len(test) != 2 or len(test[0]) != len(test[1]) or len(test[0]) == 0
    ):
        raise ConfigError("test must be a pair (x, y) of equally long, non-empty arrays of inputs and labels")
    _check_data(model, dataset)

    flat = FlatModel(copy.deepcopy(model))
    m, n = clients_per_round, len(dataset)
    sigma = 0.0 if noise_multiplier is None else noise_multiplier * float(clip_norm or 0.0)
    transform = None
    aggregate = fedavg_aggregate
    streams = np.random.SeedSequence(seed).spawn(3)
    if clip_norm is not None:
        share = sigma / math.sqrt(m) if noise_on == "local" else 0.0
        transform = ClipAndNoise(clip_norm, share, 1)
        aggregate = DPAggregate(
            clip_norm=clip_norm,
            noise_std=sigma if noise_on == "central" else 0.0,
            rng=np.random.default_rng(streams[2]),
        )
    cfg = ImageFedAvgConfig(
        clients_per_round=m,
        local_epochs=local_epochs,
        batch_size=batch_size,
        optimizer=LocalOptimizer(lr=lr),
        eval_every=1,
    )
    recorded = None
    if observe:
        recorded = ServerUploads(model, lr=lr, local_epochs=local_epochs, batch_size=batch_size)
        aggregate = recorded.wrap(aggregate)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        trained_run = run_fedavg(
            flat,
            dataset,
            cfg,
            rounds=rounds,
            seed=seed,
            runtime_rng=np.random.default_rng(streams[0]),
            server_rng=np.random.default_rng(streams[1]),
            transform=transform,
            aggregate=aggregate,
            device=device,
            test=test,
            progress=progress,
        )
        weights = trained_run.server.full_weights()

    trained = copy.deepcopy(model)
    FlatModel(trained).load_into_module(weights)
    state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    privacy = None
    if noise_multiplier is not None:
        assert clip_norm is not None and delta is not None
        whole = GroupLedger(["clients"], delta=delta)
        whole.record(["clients"], z=noise_multiplier, q=m / n, rounds=rounds)
        one = GroupLedger(["clients"], delta=delta)
        one.record(["clients"], z=noise_multiplier, q=m / n)
        privacy = FedAvgPrivacy(
            mechanism=DP_MECHANISM,
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            noise_on=noise_on,
            clients_per_round=m,
            num_clients=n,
            sampling_rate=m / n,
            rounds=rounds,
            delta=delta,
            epsilon=whole.epsilon("clients"),
            epsilon_round=one.epsilon("clients"),
            accountant=whole.method_for(whole.segments("clients")),
        )
    return FedAvgResult(state, trained_run.history, privacy, recorded)
