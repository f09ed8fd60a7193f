"""PPFL Table 2 (Sec. 6.1): each attack on exactly what each observer sees, E2E
FedAvg against PPFL.

One member split (the membership target's recipe, :func:`fedveil.experiments.attacks.runs.membership_run`:
clients that train long enough on few examples to leak) is trained twice: by undefended end-to-end FedAvg
and by PPFL with the last layer kept in the TEEs. An observer taps every byte of each run
(:class:`~fedveil.attacks.observe.WireObserver`):

- **DRA and PIA** need the clients' updates. E2E FedAvg shows them in the clear, so DLG runs on a batch-1
  upload of the E2E model (:func:`~fedveil.experiments.attacks.runs.run_inversion` with ``view="fedavg"``)
  and Melis et al.'s attack on every round's uploads (:func:`~fedveil.experiments.attacks.runs.run_property`).
  In PPFL every upload and broadcast of a layer in training is an AES-GCM record: the observer's views are
  :class:`~fedveil.attacks.views.SealedView`, and the same attack functions refuse them
  (:class:`~fedveil.attacks.views.NoPlaintextView`). The table says "no plaintext view" and counts the
  sealed messages, rather than inventing an MSE or AUC for an attack that cannot start.
- **MIA** needs the released model. E2E releases it whole (Yeom, Nasr-style, with the control of
  :func:`~fedveil.experiments.attacks.runs.run_membership`). PPFL with ``keep_classifier_in_tee`` releases
  only the convolutional layers: the observer's strongest move is to train its own classifier atop them
  on auxiliary data from the same distribution (examples that are neither members nor candidates) and to
  attack that model (the "adaptive" row). PPFL without the option releases the whole model (the
  "released" row), which shows what the TEE-kept last layer buys.

With an output folder, each part (DLG on each E2E target, E2E's property and membership attacks, PPFL with
the last layer kept, PPFL released) is written to ``parts/`` as it finishes, and a rerun with the same
settings reads it instead of running it again (an earlier run's single ``e2e`` part too).

**Where it runs.** ``images.device`` (:func:`~fedveil.models.device.resolve_device`) is where everything
trains and attacks: E2E FedAvg's clients and PPFL's REEs and emulated client TEEs (their examples move
there once per training), DLG's matching, the property attack's simulated updates and features, the
observer's head and the membership attacks' scoring (PPFL's candidates move there once). The PPFL server's
enclave stays on the CPU, and what the report holds comes back to host memory; the report records the
resolved device (``run.device``). An output folder's parts are all computed on one device: a rerun on
another is refused, naming both (:func:`~fedveil.experiments.checkpoint.claim_device`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedveil.attacks.dlg import dlg_attack
from fedveil.attacks.mia_nasr import nasr_attack
from fedveil.attacks.mia_yeom import per_example_loss, yeom_attack
from fedveil.attacks.observe import WireObserver
from fedveil.attacks.pia_melis import melis_attack
from fedveil.attacks.views import ModelView, NoPlaintextView
from fedveil.core.atomic import atomic_write
from fedveil.errors import ConfigError
from fedveil.experiments.attacks.runs import (
    membership_run,
    run_inversion,
    run_membership,
    run_property,
    summarize_targets,
)
from fedveil.experiments.checkpoint import claim_device
from fedveil.experiments.fedavg_images import FedAvgRun, split_images
from fedveil.experiments.ppfl.runner import PpflRun, train_ppfl
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.zoo import build_model
from fedveil.protocols.fedavg import ParameterPlan
from fedveil.protocols.ppfl import PpflConfig, conv_units, plan_stages
from fedveil.protocols.ppfl_messages import LayerEvalRequest, LayerFitReply, LayerFitRequest

__all__ = ["auxiliary_examples", "ppfl_attack_table", "ppfl_like"]

PARTS = ("parts/*.json",)
"""What an earlier run of :func:`ppfl_attack_table` leaves in its output folder (parts, resumed from)."""


def _ppfl_run(images: FedAvgRun, cfg: PpflConfig, tee_mib: float) -> PpflRun:
    """PPFL on ``images``' clients and data with ``cfg``, devices' TEEs of ``tee_mib`` MiB, on
    ``images.device`` (its REEs and emulated client TEEs)."""
    return PpflRun(
        name="ppfl_attacks",
        data=images.data,
        model=images.model,
        clients=images.clients,
        samples_per_client=images.samples_per_client,
        scheme=images.scheme,
        test_samples=images.test_samples,
        seed=images.seed,
        model_init=images.model_init,
        tee_mib=(tee_mib,),
        e2e=False,
        ppfl=cfg,
        device=images.device,
    )


def _settings_images(images: FedAvgRun) -> str:
    """``images`` as the parts' settings record it: without its device, which the output folder records
    apart (:func:`~fedveil.experiments.checkpoint.claim_device`: one resolved device for all its parts,
    whatever its spelling), so that parts written before that record still match."""
    return repr(replace(images, device="auto"))


def ppfl_like(images: FedAvgRun, *, classifier_pool: str = "none") -> PpflConfig:
    """PPFL with E2E FedAvg's local recipe (epochs, batch, SGD), each stage for E2E's rounds divided by the
    number of stages (LeNet's two layers and its classifier: 13 rounds each of E2E's 40), the last layer
    kept in the TEEs; ``classifier_pool`` for the conv stages' classifiers (VGG9's first stages need
    ``avg`` to fit the server's enclave)."""
    model = build_model(images.model, num_classes=10, in_channels=3, image_size=32)
    stages = plan_stages(model, classifier_pool=classifier_pool)
    rounds = max(1, images.rounds // len(stages))
    return PpflConfig(
        rounds_per_stage=rounds,
        local_epochs=images.fedavg.local_epochs,
        batch_size=images.fedavg.batch_size,
        lr=images.fedavg.optimizer.lr,
        momentum=images.fedavg.optimizer.momentum,
        epoch_decay=1.0,
        keep_classifier_in_tee=True,
        eval_every=rounds,
        seed=images.seed,
        classifier_pool=classifier_pool,
    )


def auxiliary_examples(split: Any, seed: int, count: int) -> Any:
    """The observer's auxiliary examples: ``count`` training examples that are neither members nor
    candidates (drawn with ``seed``)."""
    used = np.r_[split.member_index, split.non_member_index]
    spare = np.setdiff1d(np.arange(len(split.train)), used)
    return split.train.subset(np.sort(np.random.default_rng(seed + 3).permutation(spare)[:count]))


def _attacker_head(
    frozen: nn.Module,
    head: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    seed: int,
    device: torch.device,
) -> nn.Module:
    """The observer's classifier atop the released layers, trained on its auxiliary examples (Adam), on
    ``device``: the head is drawn on the host (the seeded generator's draws), then ``frozen``, the head
    and the examples move there once; the model returned is there."""
    torch.manual_seed(seed)
    for module in head.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    frozen, head = frozen.to(device), head.to(device)
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        features = frozen.eval()(x)
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(features), generator=gen).to(device)
        for s in range(0, len(order), 32):
            idx = order[s : s + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(head(features[idx]), y[idx]).backward()
            opt.step()
    return nn.Sequential(frozen, head.eval().requires_grad_(False))


def _saved_part(out: Path | None, name: str, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The rows an earlier run with the same ``settings`` wrote to ``out/parts/<name>.json``, if any."""
    path = None if out is None else out / "parts" / f"{name}.json"
    if path is None or not path.is_file():
        return None
    saved = json.loads(path.read_text(encoding="utf-8"))
    if saved.get("settings") != settings:
        raise ConfigError(
            f"{path} was written by a run with other settings; use another --out or delete {path.parent}"
        )
    return dict(saved["rows"])


def _part(out: Path | None, name: str, settings: dict[str, Any], compute: Any) -> dict[str, Any]:
    """The table rows of one part of the run: read from ``out/parts/<name>.json`` when an earlier run with
    the same ``settings`` finished it, else computed and written there (so an interrupted run resumes
    from the last finished part). Rows are stored as plain JSON (scores as their ``as_dict``)."""
    saved = _saved_part(out, name, settings)
    if saved is not None:
        return saved
    path = None if out is None else out / "parts" / f"{name}.json"
    rows = {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in compute().items()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"settings": settings, "rows": rows}, indent=2, sort_keys=True) + "\n"
        atomic_write(path, text.encode())
    return rows


def _no_view(attack: str, views: list[Any], call: Any) -> dict[str, Any]:
    """Run ``call`` on the first view; a sealed view must be refused."""
    try:
        call(views[0])
    except NoPlaintextView as exc:
        return {
            "attack": attack,
            "result": "no plaintext view",
            "sealed_views": len(views),
            "reason": str(exc),
        }
    raise AssertionError(f"{attack} ran on a PPFL view: the observer saw plaintext")


def ppfl_attack_table(
    *,
    images: FedAvgRun | None = None,
    ppfl: PpflConfig | None = None,
    tee_mib: float = 64.0,
    aux_examples: int = 2000,
    head_epochs: int = 20,
    dra_targets: int = 5,
    dra_iterations: int | None = None,
    pia_clients: int = 20,
    pia_rounds: int = 6,
    e2e: bool = True,
    out: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Table 2 at the scale that runs here (module docstring); returns (and writes to
    ``out/ppfl_attacks.json``) one entry per attack and learning method.

    ``images`` is the member split and E2E recipe (default :func:`membership_run`); PPFL trains the same
    clients with the same local settings, each stage for E2E's rounds divided by the number of stages
    (LeNet's two layers and its classifier: 13 rounds each of E2E's 40), the devices' TEEs ``tee_mib``
    MiB. The observer's head trains ``head_epochs`` on ``aux_examples`` spare training examples. DLG
    attacks ``dra_targets`` batch-1 uploads; the property attack runs on its own recipe with
    ``pia_clients`` clients for ``pia_rounds`` rounds. ``e2e=False`` leaves out the E2E rows (each is
    :mod:`fedveil.experiments.attacks.runs`' own experiment).

    Everything trains and attacks on ``images.device`` (module docstring), resolved before anything
    runs: a device this machine lacks, or an ``out`` whose parts were computed on another, fails first."""
    images = images or membership_run()
    cfg = ppfl or ppfl_like(images)
    where = resolve_device(images.device)
    if out is not None:
        claim_device(out, where, artefacts=PARTS)
    table: dict[str, Any] = {}
    settings = {
        "images": _settings_images(images),
        "ppfl": repr(cfg),
        "tee_mib": tee_mib,
        "aux_examples": aux_examples,
        "head_epochs": head_epochs,
        "dra": [dra_targets, dra_iterations],
        "pia": [pia_clients, pia_rounds],
    }

    def dra_target(i: int) -> dict[str, Any]:
        """DLG on target ``i`` of E2E FedAvg's batch-1 uploads (one part per target: each takes long at
        VGG9)."""
        dra = run_inversion(
            "dlg",
            model=images.model,
            data=images.data,
            batch=1,
            targets=dra_targets,
            iterations=dra_iterations,
            view="fedavg",
            seed=images.seed,
            init=images.model_init,
            only=(i,),
            device=str(where),
        )
        return {"row": dra["per_target"][0]}

    def pia_rows() -> dict[str, Any]:
        """Melis et al.'s property inference on E2E FedAvg's plaintext updates, and its control."""
        pia = run_property(
            data=images.data,
            model=images.model,
            clients=pia_clients,
            rounds=pia_rounds,
            seed=images.seed,
            init=images.model_init,
            device=str(where),
        )
        return {"pia/e2e": pia["attacks"]["melis/target"], "pia/e2e-control": pia["attacks"]["melis/control"]}

    def mia_rows() -> dict[str, Any]:
        """Yeom and Nasr-style membership inference on E2E FedAvg's released model, and their control (on
        ``images.device``: the membership run's own device)."""
        rows: dict[str, Any] = {}
        mia = run_membership(attacks=("yeom", "nasr"), run=images, seed=images.seed, progress=progress)
        for key, value in mia["attacks"].items():
            name, which = key.split("/")
            rows[f"mia-{name}/e2e" + ("" if which == "target" else "-control")] = value
        return rows

    if e2e:
        earlier = _saved_part(out, "e2e", settings)  # the E2E rows as one part, as earlier runs kept them
        if earlier is not None:
            table.update(earlier)
        else:
            per_target = [
                _part(out, f"e2e-dra-{i}", settings, lambda i=i: dra_target(i))["row"]
                for i in range(dra_targets)
            ]
            summary = summarize_targets(per_target)
            table["dra/e2e"] = {
                "attack": "dlg",
                "view": "fedavg",
                "targets": dra_targets,
                **{k: summary[k] for k in ("mse", "psnr", "ssim", "recovered")},
            }
            table.update(_part(out, "e2e-pia", settings, pia_rows))
            table.update(_part(out, "e2e-mia", settings, mia_rows))
    # --- PPFL: what its observer sees ---
    split = split_images(images)
    shape = split.members.image_shape
    aux_x, aux_y = split.non_members.x[:8], split.non_members.y[:8]

    def ppfl_rows(keep: bool) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        run = _ppfl_run(images, replace(cfg, keep_classifier_in_tee=keep), tee_mib)
        # PPFL sends no plaintext FitRequest/FitReply, so the observer's model and plan are never used
        stand_in = FlatModel(nn.Linear(1, 1))
        observer = WireObserver(
            stand_in,
            ParameterPlan(stand_in),
            lambda: nn.Linear(1, 1),
            sealed_types=(LayerFitRequest, LayerFitReply, LayerEvalRequest),
        )
        trained = train_ppfl(run, split, tap=observer.tap)
        views = [v for rnd in sorted(observer.rounds) for v in observer.client_views(rnd)]
        suffix = "" if keep else "-released"
        if keep:
            rows["dra/ppfl"] = _no_view(
                "dlg", views, lambda v: dlg_attack(v, image_shape=shape, iterations=1, device=str(where))
            )
            rows["pia/ppfl"] = _no_view(
                "melis",
                views,
                lambda v: melis_attack(
                    [v],
                    np.zeros(1, bool),
                    aux_x,
                    aux_y,
                    np.zeros(8, bool),
                    rng=np.random.default_rng(0),
                    device=str(where),
                ),
            )
        rows.update(_ppfl_membership(trained, split, images, aux_examples, head_epochs, keep, suffix, where))
        rows[f"ppfl{suffix}/accuracy"] = trained.final.get(
            "accuracy", trained.server.reports[-1].rounds[-1].get("accuracy")
        )
        return rows

    for keep in (True, False):
        table.update(
            _part(out, "ppfl-kept" if keep else "ppfl-released", settings, lambda k=keep: ppfl_rows(k))
        )
    summary = {
        "run": {
            "data": split.train.describe(),
            "synthetic_data": split.train.synthetic,
            "model": images.model,
            "clients": images.clients,
            "samples_per_client": images.samples_per_client,
            "e2e_rounds": images.rounds,
            "ppfl_rounds_per_stage": cfg.rounds_per_stage,
            "local_epochs": cfg.local_epochs,
            "aux_examples": aux_examples,
            "device": str(where),
        },
        "attacks": {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in table.items()},
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(
            out / "ppfl_attacks.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode()
        )
    return summary


def _ppfl_membership(
    trained: Any,
    split: Any,
    images: FedAvgRun,
    aux_examples: int,
    head_epochs: int,
    keep: bool,
    suffix: str,
    where: torch.device,
) -> dict[str, Any]:
    """MIA on PPFL's release: the observer's own head atop the released layers (kept), or the released
    whole model (not kept). The attacked model and the candidates' inputs move to ``where`` once, where
    Yeom's losses and Nasr's features are computed (their labels stay on the host, beside the logits the
    scoring brings back)."""
    n = len(split.members)
    x = torch.from_numpy(np.concatenate([split.members.x, split.non_members.x[:n]])).to(where)
    y = torch.from_numpy(np.concatenate([split.members.y, split.non_members.y[:n]]))
    is_member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    client = next(c for c in trained.pool.client_ids() if c not in trained.pool.evaluators)
    frozen = nn.Sequential(*trained.pool.frozen[client])
    if keep:
        aux = auxiliary_examples(split, images.seed, aux_examples)
        head = copy.deepcopy(nn.Sequential(*trained.model.layer_units()[conv_units(trained.model) :]))
        model = _attacker_head(
            frozen,
            head,
            torch.from_numpy(np.array(aux.x)),
            torch.from_numpy(np.array(aux.y)),
            epochs=head_epochs,
            seed=images.seed,
            device=where,
        )
        observer = "observer: released layers + its own head trained on auxiliary data"
    else:
        model = trained.pool.trained_model(client).to(where)
        observer = "observer: released whole model"
    view = ModelView(observer, model)
    train_loss = float(per_example_loss(model, x[:n], y[:n]).mean())
    rng = np.random.default_rng(images.seed)
    yeom = yeom_attack(view, x, y, is_member, mean_train_loss=train_loss)
    nasr = nasr_attack(view, x, y, is_member, rng=rng, device=str(where))
    return {
        f"mia-yeom/ppfl{suffix}": {**yeom.as_dict(), "observer": observer},
        f"mia-nasr/ppfl{suffix}": {**nasr.as_dict(), "observer": observer},
    }
