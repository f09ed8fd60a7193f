"""``fedveil aiot run CONFIG``: AIoT Tables 1 and 2 (Sec. 5.3-5.4) in simulation.

The server pre-trains MobileFaceNet with an ArcFace head on the synthetic face population's **public**
domain (:func:`~fedveil.experiments.aiot.faces_domain.train_faces`, Adam on a cosine schedule; the paper: 150
epochs on MS-Celeb-1M). The **private** domain's training identities are spread over devices
(:func:`~fedveil.data.faces.face_devices`); its held-out identities are the test set. Methods, each
evaluated by TAR at FAR 1e-3 and 1e-4 on reference-vs-wild pairs of the held-out identities
(:func:`~fedveil.experiments.aiot.faces_domain.verification`) and by the identification accuracy of Eq. 5
(each wild photo's nearest reference embedding, :func:`~fedveil.protocols.projector.identify`).
The run's ``device`` (:func:`~fedveil.models.device.resolve_device`) is where all of it computes: the
pre-training, the devices' fine-tuning and the embeddings of the evaluation. Methods:

- ``pretrained``: the pre-trained model as it is (no trials: it does not depend on them);
- ``ours``: the private-projector protocol (:mod:`fedveil.protocols.projector`) on the FedAvg engine, with
  frozen BatchNorm statistics and warm-up;
- ``centralized``: the same fine-tuning with every device's photos pooled on one "device" (one ArcFace
  projector over all training identities) for as many example-gradients as the federated run
  (``rounds x clients_per_round / devices`` epochs, at least one);
- ``solo``: each of ``solo_devices`` devices fine-tunes alone for ``rounds x local_epochs`` epochs; the
  trial's value is the mean over those devices' models;
- ablations (Table 2): ``no_pretrain`` (the protocol from a randomly initialised network),
  ``no_frozen_bn`` (BatchNorm statistics updated on the devices and averaged), ``no_warmup``.

Each method runs ``trials`` times (the population and the pre-trained model are fixed; device
selection, projector initialisation and batch order change with the trial's seed) and is reported as
mean +- standard deviation, as the paper's tables are, and drawn in ``scores.png`` beside chance
(:func:`run_figures`). The run resumes (``resume``): the pre-trained
weights (safetensors) and every finished (method, trial) are saved in the output folder as they
complete; a folder that holds anything is refused otherwise, unless ``overwrite`` clears it first.
The (method, trial) in training is checkpointed after every round (``checkpoint.npz``,
:func:`~fedveil.experiments.checkpoint.save_checkpoint`): the server's weights and generator, the
runtime's and every device's generator, and each simulated device's private projector and warm-up
counter (:meth:`~fedveil.protocols.projector.ProjectorClients.state_dict`; a real device keeps its
projector on its own disk and it never travels: this checkpoint is the simulation's, written on the
machine that simulates the devices), with the digest of the settings; ``solo`` also keeps the scores of
its devices already done. A resumed run continues it from its last round, only under the same settings,
and reaches the uninterrupted run's model; the checkpoint is removed once the (method, trial)'s scores
are in ``results.json``. Ctrl-C (:class:`~fedveil.experiments.checkpoint.StopAtRoundEnd`) stops at the
end of the round in progress, after its checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from fedveil.core.atomic import atomic_write
from fedveil.core.provenance import code_identity
from fedveil.data.faces import FaceImages, face_devices, synthetic_faces
from fedveil.errors import ConfigError, RunInterrupted
from fedveil.eval.plots import method_colours, save_png
from fedveil.experiments.aiot.faces_domain import embed_faces, train_faces, verification
from fedveil.experiments.checkpoint import (
    CHECKPOINT,
    Checkpoint,
    StopAtRoundEnd,
    check_checkpoint_identity,
    claim_device,
    config_digest,
    crash_point,
    differing_settings,
    identity_settings,
    load_checkpoint,
    prepare_run_dir,
    save_checkpoint,
)
from fedveil.experiments.config import load_run_config
from fedveil.experiments.plots import bars_figure
from fedveil.models.device import check_device_spec, resolve_device
from fedveil.models.faces import MobileFaceNet
from fedveil.models.weights import load_weights, save_weights
from fedveil.protocols.common import pool_rng_states, restore_pool_rngs
from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.projector import (
    ProjectorClients,
    ProjectorSettings,
    backbone_flat,
    backbone_plan,
    identify,
)
from fedveil.runtime.simulation import SimulationRuntime

__all__ = ["METHODS", "AiotRun", "evaluate_faces", "load_aiot_run", "run_aiot", "summarise"]

METHODS = ("pretrained", "centralized", "solo", "ours", "no_pretrain", "no_frozen_bn", "no_warmup")


@dataclass(frozen=True)
class AiotRun:
    """A run's settings (module docstring); ``size`` and ``width`` reduce MobileFaceNet for this machine
    (the paper: 112 and 1) and are named in every result. ``device``
    (:func:`~fedveil.models.device.resolve_device`): where the server pre-trains, the devices fine-tune
    and the evaluation embeds the photos."""

    name: str = "aiot"
    size: int = 64
    width: float = 0.5
    public_identities: int = 800
    pretrain_epochs: int = 8
    pretrain_lr: float = 3e-3
    pretrain_batch_size: int = 64
    private_identities: int = 400
    test_identities: int = 100
    wild: int = 4
    identities_per_device: int = 4
    rounds: int = 20
    local_epochs: int = 1
    clients_per_round: int = 20
    batch_size: int = 8
    optimizer: str = "sgd"
    lr: float = 0.001
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_batches: int = 5
    trials: int = 5
    solo_devices: int = 5
    methods: tuple[str, ...] = METHODS
    seed: int = 0
    threads: int = 2
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        for name in ("public_identities", "private_identities", "test_identities", "wild"):
            if getattr(self, name) < 2:
                raise ConfigError(f"{name} {getattr(self, name)} must be >= 2")
        for name in (
            "pretrain_epochs",
            "rounds",
            "local_epochs",
            "clients_per_round",
            "trials",
            "solo_devices",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)} must be >= 1")
        if self.batch_size < 2:
            raise ConfigError(
                f"batch_size {self.batch_size} must be >= 2 (an ArcFace projector compares photos)"
            )
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ConfigError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
        LocalOptimizer(self.optimizer, self.lr, self.momentum, self.weight_decay)  # type: ignore[arg-type]
        ProjectorSettings(warmup_batches=self.warmup_batches)

    @property
    def model_name(self) -> str:
        """How results name the network."""
        return f"mobilefacenet (image_size {self.size}, width {self.width})"


def load_aiot_run(path: str | Path, overrides: Mapping[str, Any] | None = None) -> AiotRun:
    """An :class:`AiotRun` from a YAML file with ``overrides`` (e.g. ``--set``'s) on top: unknown keys and
    wrong values are refused, named, and so are keys its methods ignore (``solo_devices`` without ``solo``;
    :func:`~fedveil.experiments.config.load_run_config`)."""
    return load_run_config(AiotRun, path, overrides, unused=_unused_settings)


def _unused_settings(run: AiotRun) -> list[tuple[str, bool, str]]:
    """The settings ``run``'s methods ignore (:func:`~fedveil.experiments.config.keys_without_effect`)."""
    why = f"only the solo method uses it; methods are {', '.join(run.methods)}"
    return [("solo_devices", "solo" not in run.methods, why)]


def evaluate_faces(model: torch.nn.Module, faces: FaceImages, reference: np.ndarray) -> dict[str, Any]:
    """TAR at FAR 1e-3 / 1e-4 of reference-vs-wild pairs and Eq. 5's identification accuracy; the
    embeddings are computed where ``model``'s parameters are
    (:func:`~fedveil.experiments.aiot.faces_domain.embed_faces`)."""
    row = verification(model, faces, reference)
    e = embed_faces(model, faces.x, normalise=False)
    predicted = identify(e[reference], faces.identity[reference], e[~reference])
    row["identification_accuracy"] = float(np.mean(predicted == faces.identity[~reference]))
    return row


@dataclass
class _RoundCheckpoints:
    """Where the (method, trial) ``key`` in training checkpoints its rounds (module docstring):
    ``out/checkpoint.npz`` under the settings' ``digest``. ``previous`` is the checkpoint a resumed run
    found; it continues ``key`` only when it names it. ``part`` numbers the federations of one
    (method, trial) (``solo``: one per device) and ``rows`` holds the scores of the parts done."""

    out: Path
    digest: str
    previous: Checkpoint | None
    key: str = ""
    part: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    saved: bool = False

    def begin(self, key: str) -> None:
        """Start (method, trial) ``key``: the parts a checkpoint of it holds count as done."""
        self.key, self.part, self.saved = key, 0, False
        ours = self.previous is not None and self.previous.meta.get("key") == key
        self.rows = list(self.previous.meta["rows"]) if ours and self.previous is not None else []

    def resumed(self) -> Checkpoint | None:
        """The checkpoint of the part in training, if a resumed run found one."""
        previous = self.previous
        if previous is None or previous.meta.get("key") != self.key or previous.meta.get("part") != self.part:
            return None
        return previous

    def save(self, rnd: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Checkpoint round ``rnd`` of the part in training."""
        extra = {**meta, "key": self.key, "part": self.part, "rows": self.rows, "config_sha256": self.digest}
        save_checkpoint(self.out, Checkpoint(rnd, arrays, extra))
        self.saved = True

    def finished(self) -> None:
        """The (method, trial) begun last is in ``results.json``: its checkpoint goes (one of another
        (method, trial) stays)."""
        if self.previous is not None and self.previous.meta.get("key") == self.key:
            self.previous = None
            self.saved = True
        if self.saved:
            (self.out / CHECKPOINT).unlink(missing_ok=True)
        self.saved = False


def _federate(
    run: AiotRun,
    state: dict[str, torch.Tensor] | None,
    devices: Any,
    *,
    seed: int,
    rounds: int,
    clients_per_round: int,
    settings: ProjectorSettings,
    desc: str,
    progress: bool,
    stop: StopAtRoundEnd | None = None,
    checkpoints: _RoundCheckpoints | None = None,
) -> MobileFaceNet:
    """The projector protocol over ``devices`` from the pre-trained ``state`` (``None``: random);
    ``stop`` ends it at the end of a round after a Ctrl-C, after the round's checkpoint
    (``checkpoints``, which also continues a resumed part from its last round). The fine-tuned backbone
    is returned on the run's device, where it is evaluated."""
    torch.manual_seed(seed)
    backbone = MobileFaceNet(image_size=run.size, width=run.width)
    if state is not None:
        backbone.load_state_dict(state)
    flat = backbone_flat(backbone)
    plan = backbone_plan(flat, freeze_bn=settings.freeze_bn)
    optimizer = LocalOptimizer(run.optimizer, run.lr, run.momentum, run.weight_decay)  # type: ignore[arg-type]
    pool = ProjectorClients(
        backbone,
        devices,
        embedding_dim=backbone.embedding_dim,
        optimizer=optimizer,
        seed=seed,
        settings=settings,
        device=run.device,
    )
    cfg = ImageFedAvgConfig(
        clients_per_round=clients_per_round,
        local_epochs=run.local_epochs,
        batch_size=run.batch_size,
        optimizer=optimizer,
        eval_every=0,
    )
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(seed + 1))
    server = ModelServer(cfg, flat, np.random.default_rng(seed + 2), plan=plan, initial=flat.initial())
    server.setup(runtime)
    previous = checkpoints.resumed() if checkpoints is not None else None
    if previous is not None:
        server.load_state_dict(previous.arrays, previous.meta["server"])
        pool.load_state_dict(previous.arrays, previous.meta["devices"])
        restore_pool_rngs(pool, previous.meta["pool"])
        runtime.rng.bit_generator.state = previous.meta["runtime_rng"]
    first = previous.round + 1 if previous is not None else 1

    def save(rnd: int) -> None:
        assert checkpoints is not None
        arrays, meta = server.state_dict()
        devices, device_meta = pool.state_dict()
        extra = {
            "server": meta,
            "devices": device_meta,
            "pool": pool_rng_states(pool),
            "runtime_rng": runtime.rng.bit_generator.state,
        }
        checkpoints.save(rnd, {**arrays, **devices}, extra)

    async def go() -> None:
        bar = tqdm(
            range(first, rounds + 1),
            desc=desc,
            unit="round",
            disable=not progress,
            leave=False,
            initial=first - 1,
            total=rounds,
        )
        for rnd in bar:
            crash_point("round", rnd)
            report = await server.run_round(rnd, runtime)
            if report.loss is not None:
                bar.set_postfix(loss=f"{report.loss:.2f}")
            crash_point("metrics", rnd)
            if checkpoints is not None:
                save(rnd)
            if stop is not None and rnd < rounds:
                stop.check()  # after the last round the (method, trial) is finished and saved first

    asyncio.run(go())
    flat.load_into_module(server.full_weights())
    return backbone


def _method(
    method: str,
    run: AiotRun,
    trial: int,
    state: dict[str, torch.Tensor],
    train: FaceImages,
    test: tuple[FaceImages, np.ndarray],
    progress: bool,
    stop: StopAtRoundEnd | None = None,
    checkpoints: _RoundCheckpoints | None = None,
) -> dict[str, Any]:
    """One (method, trial) of the module docstring: its scores on the held-out identities; its rounds are
    checkpointed in ``checkpoints`` (which :meth:`_RoundCheckpoints.begin` has started)."""
    seed = run.seed + 1000 * (trial + 1)
    devices = face_devices(train, run.identities_per_device)
    base = ProjectorSettings(warmup_batches=run.warmup_batches)
    common = {
        "seed": seed,
        "progress": progress,
        "desc": f"{method} trial {trial + 1}",
        "stop": stop,
        "checkpoints": checkpoints,
    }
    federated = {"rounds": run.rounds, "clients_per_round": run.clients_per_round}
    variants = {
        "ours": (state, base),
        "no_pretrain": (None, base),
        "no_frozen_bn": (state, replace(base, freeze_bn=False)),
        "no_warmup": (state, replace(base, warmup_batches=0)),
    }
    if method in variants:
        start, settings = variants[method]
        model = _federate(run, start, devices, settings=settings, **federated, **common)
        return evaluate_faces(model, *test)
    if method == "centralized":
        pooled = face_devices(train, len(train.names), prefix="central")
        taking = min(run.clients_per_round, len(devices))
        epochs = max(1, round(run.rounds * taking / len(devices)))
        model = _federate(run, state, pooled, settings=base, rounds=epochs, clients_per_round=1, **common)
        return {**evaluate_faces(model, *test), "epochs": epochs}
    if method == "solo":
        usable = [u for u in devices.user_ids if len(np.unique(devices.array(u, "y"))) >= 2]
        chosen = np.random.default_rng(seed).choice(
            len(usable), min(run.solo_devices, len(usable)), replace=False
        )
        rows = checkpoints.rows if checkpoints is not None else []
        for k in sorted(chosen)[len(rows) :]:
            if checkpoints is not None:
                checkpoints.part = len(rows)
            alone = devices.subset([usable[k]])
            model = _federate(
                run, state, alone, settings=base, rounds=run.rounds, clients_per_round=1, **common
            )
            rows.append(evaluate_faces(model, *test))
        keys = ("tar_at_far_1e-3", "tar_at_far_1e-4", "identification_accuracy")
        return {
            **{k: float(np.mean([r[k] for r in rows])) for k in keys},
            "devices": [usable[k] for k in sorted(chosen)],
            "per_device": rows,
        }
    raise ConfigError(f"method {method!r} has no trials")


def summarise(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Mean and standard deviation (over trials, ``ddof=0``) of each method's scores."""
    keys = ("tar_at_far_1e-3", "tar_at_far_1e-4", "identification_accuracy")
    out: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        rows = [v for k, v in results.items() if k.split("/")[0] == method]
        if rows:
            out[method] = {"trials": len(rows)}
            for key in keys:
                values = np.asarray([r[key] for r in rows], dtype=np.float64)
                out[method][key] = {"mean": float(values.mean()), "std": float(values.std())}
    return out


SCORE_LABELS = {
    "tar_at_far_1e-3": "TAR @ FAR 1e-3",
    "tar_at_far_1e-4": "TAR @ FAR 1e-4",
    "identification_accuracy": "identification accuracy (Eq. 5)",
}
"""The scores of Tables 1-2 as the plots name them."""


def run_figures(run: AiotRun, summary: dict[str, dict[str, Any]]) -> dict[str, Figure]:
    """``scores.png``: each method's mean TAR at FAR 1e-3 and 1e-4 and identification accuracy with
    +- their standard deviation over trials (:func:`summarise`'s ``summary``), each method in its
    colour, beside chance: a scorer that knows nothing accepts impostors and genuine pairs alike
    (TAR = FAR) and names one of the ``test_identities`` at random (``1 / test_identities``). The runner
    records scores only after each (method, trial), not per round, so there is no fine-tuning curve."""
    values = {
        label: {m: (row[key]["mean"], row[key]["std"]) for m, row in summary.items()}
        for key, label in SCORE_LABELS.items()
    }
    chance = dict(zip(SCORE_LABELS.values(), (1e-3, 1e-4, 1.0 / run.test_identities), strict=True))
    fig = bars_figure(
        values,
        title=f"{run.name}: AIoT Tables 1-2 on held-out identities (mean ± std over trials)",
        ylabel="score",
        colours=method_colours(summary),
        chance=chance,
        ylim=(0.0, 1.02),
    )
    return {"scores.png": fig}


def _write_json(path: Path, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def run_aiot(
    run: AiotRun,
    out_dir: str | Path,
    *,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Pre-train (or reuse the saved pre-training), then each method and trial not yet done; writes
    ``results.json`` after each and returns it (module docstring)."""
    device = resolve_device(run.device)  # a device this machine lacks fails before the run folder is touched
    out = prepare_run_dir(out_dir, resume=resume, overwrite=overwrite)
    torch.set_num_threads(run.threads)
    settings = asdict(run)
    free = ("trials", "methods", "threads")  # a (method, trial)'s numbers do not depend on them
    mine = identity_settings(settings, free=free)
    digest = config_digest(json.dumps(mine, sort_keys=True))
    legacy = config_digest(json.dumps({k: v for k, v in settings.items() if k not in free}, sort_keys=True))
    previous = load_checkpoint(out) if resume else None
    if previous is not None:
        check_checkpoint_identity(out, previous, digest, legacy=legacy)
    path = out / "results.json"
    record: dict[str, Any] = {"run": settings, "code": code_identity(), "results": {}}
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        fixed = identity_settings(saved.get("run", {}), free=free)
        if fixed != mine:
            changed = ", ".join(differing_settings(fixed, mine))
            raise ConfigError(
                f"{path} was written by a run with other settings ({changed}): use another --out"
            )
        record["results"] = saved.get("results", {})
    claim_device(out, device, artefacts=(CHECKPOINT, "results.json", "pretrained.safetensors"))
    checkpoints = _RoundCheckpoints(out, digest, previous)
    start = time.perf_counter()
    public, _ = synthetic_faces(
        run.public_identities, run.wild, domain="public", size=run.size, seed=run.seed
    )
    train, _ = synthetic_faces(
        run.private_identities, run.wild, domain="private", size=run.size, seed=run.seed
    )
    test = synthetic_faces(
        run.test_identities,
        run.wild,
        domain="private",
        size=run.size,
        seed=run.seed,
        first_identity=run.private_identities,
    )
    weights = out / "pretrained.safetensors"
    torch.manual_seed(run.seed)
    model = MobileFaceNet(image_size=run.size, width=run.width)
    if weights.is_file():
        model = load_weights(model, weights).to(device)
    else:
        try:
            train_faces(
                model,
                public,
                epochs=run.pretrain_epochs,
                lr=run.pretrain_lr,
                batch_size=run.pretrain_batch_size,
                seed=run.seed,
                desc="pre-train (public)",
                progress=progress,
                device=device,
            )
        except KeyboardInterrupt:  # the pre-training is saved only when it ends: Ctrl-C stops it at once
            raise RunInterrupted(
                f"AIoT run {run.name!r} interrupted in its pre-training, which starts again from its "
                "first epoch"
            ) from None
        save_weights(model, weights)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = record["results"]
    record.update(
        data=f"{train.source}; {public.source}",
        synthetic_data=True,
        model=run.model_name,
        impostor_pairs=len(test[0].names) * (len(test[0].names) - 1) * run.wild,
        genuine_pairs=len(test[0].names) * run.wild,
    )
    todo = [("pretrained", 0)] if "pretrained" in run.methods else []
    todo += [(m, t) for m in run.methods if m != "pretrained" for t in range(run.trials)]
    key = ""
    try:
        with StopAtRoundEnd(f"AIoT run {run.name!r}") as stop:
            for method, trial in todo:
                key = f"{method}/{trial}"
                if key in results:
                    continue
                if method == "pretrained":
                    results[key] = evaluate_faces(model, *test)
                else:
                    checkpoints.begin(key)
                    results[key] = _method(
                        method, run, trial, state, train, test, progress, stop, checkpoints
                    )
                record["summary"] = summarise(results)
                _write_json(path, record)
                if method != "pretrained":
                    checkpoints.finished()
                stop.check()
    except KeyboardInterrupt:
        ckpt = load_checkpoint(out) if key not in results else None
        again = (
            f"{key} continues after round {ckpt.round}, whose checkpoint is in {out}"
            if ckpt is not None and ckpt.meta.get("key") == key
            else f"{key} starts again from its first round"
            if key not in results
            else "the rest follows"
        )
        raise RunInterrupted(
            f"AIoT run {run.name!r} interrupted; its {len(results)} finished (method, trial)s are kept in "
            f"{path}, and {again}"
        ) from None
    record["seconds_this_session"] = time.perf_counter() - start
    record["summary"] = summarise(results)
    _write_json(path, record)
    for file, fig in run_figures(run, record["summary"]).items():
        save_png(fig, out / file)
    return record
