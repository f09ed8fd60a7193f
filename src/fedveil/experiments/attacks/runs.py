"""The attack experiments behind ``fedveil attack ...`` and the baseline tables of docs/results.md.

- :func:`run_inversion`: DLG / iDLG / Inverting Gradients against what an observer of undefended FedAvg
  sees of one client's batch, on real Fashion-MNIST (or its labelled synthetic stand-in): per-image MSE,
  PSNR, SSIM after the best matching, label accuracy, and a PNG grid of the reconstructions over
  iterations (AIoT Fig. 4). ``view="gradient"``: the client's batch gradient (DLG's setting, FedSGD);
  ``view="fedavg"``: one real FedAvg round through the engine and the codec, one local SGD step, the
  upload read off the wire by :class:`~fedveil.attacks.observe.WireObserver` (its delta over ``-lr``).
  ``defence="projector"``: AIoT's private projector (Sec. 5.5): the model's last
  layer (here LeNet's classifier standing in for the paper's ArcFace projector) stays on the device, so the
  observer sees the gradient of every other layer; the attacker initialises a projector at random and
  optimises it jointly with the dummy input. ``"projector-upper-bound"``: the paper's displayed attacker,
  whose projector starts at the true values (still optimised jointly).
- :func:`run_membership`: an undefended FedAvg model trained on Fashion-MNIST until it overfits, attacked by
  Yeom's loss threshold, the Nasr-style white-box classifier and LiRA (offline and online); beside it a
  control model trained by the same recipe on disjoint data, on which every attack must sit at chance.
- :func:`run_property`: Melis et al.'s property inference on the per-client updates a FedAvg server sees,
  where half the clients' photos carry a property unrelated to the task (a small bright watermark in one
  corner, stamped on real images: a synthetic subgroup marker, labelled as such); the control run stamps
  nothing and labels clients at random.

Each takes a ``device`` (:func:`~fedveil.models.device.resolve_device`: ``auto``, ``cpu``, ``cuda``,
``cuda:N``), resolved once before anything loads or trains; what trains, attacks or scores a torch model
runs there (the client models, FedAvg's clients, LiRA's shadow models, the attacks' matching and
features), each client's data moved there once; what the reports and plots hold comes back to host
memory, and each JSON report records the device (``"cpu"``, ``"cuda"``, ``"cuda:N"``). On the CPU they
compute exactly what they computed before the setting existed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedveil.attacks.dlg import dlg_attack
from fedveil.attacks.idlg import idlg_attack
from fedveil.attacks.inversion import client_gradient_view, evaluate_inversion, save_inversion_grid
from fedveil.attacks.inverting_gradients import inverting_gradients_attack
from fedveil.attacks.lira import lira_variants
from fedveil.attacks.mia_nasr import nasr_attack
from fedveil.attacks.mia_yeom import per_example_loss, yeom_attack
from fedveil.attacks.observe import WireObserver
from fedveil.attacks.pia_melis import melis_attack
from fedveil.attacks.scores import plot_attack_roc
from fedveil.attacks.views import ModelView
from fedveil.core.atomic import atomic_write
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import load_image_dataset
from fedveil.errors import ConfigError
from fedveil.experiments.fedavg_images import FedAvgRun, train_fedavg
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.zoo import build_model
from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelClients, ModelServer, ParameterPlan
from fedveil.protocols.local import LocalOptimizer, local_train
from fedveil.runtime.simulation import SimulationRuntime

__all__ = [
    "DEFENCES",
    "INVERSIONS",
    "last_layer",
    "membership_run",
    "run_inversion",
    "run_membership",
    "run_property",
    "stamp_property",
]

INVERSIONS = {"dlg": dlg_attack, "idlg": idlg_attack, "ig": inverting_gradients_attack}
DEFENCES = ("none", "projector", "projector-upper-bound")


def last_layer(model: nn.Module) -> list[str]:
    """The parameter names of ``model``'s last layer (the module holding its last parameter)."""
    names = [n for n, _ in model.named_parameters()]
    owner = names[-1].rsplit(".", 1)[0] if "." in names[-1] else ""
    return [n for n in names if (n.rsplit(".", 1)[0] if "." in n else "") == owner]


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, default=float) + "\n").encode())


def _fedavg_one_step_view(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, device: torch.device
) -> Any:
    """One FedAvg round (one client, one local SGD step on its whole batch ``x``, ``y`` in host memory)
    through the engine and the codec, the client training on ``device`` (its batch moved there once);
    the view the server's wire observer builds of the upload (its model on ``device``)."""
    flat = FlatModel(model)
    data = FederatedDataset([UserData("target", {}, {"x": x.numpy(), "y": y.numpy()})])
    plan = ParameterPlan(flat)
    initial = flat.initial()
    observer = WireObserver(flat, plan, lambda: copy.deepcopy(model))
    cfg = ImageFedAvgConfig(
        clients_per_round=1, local_epochs=1, batch_size=len(x), optimizer=LocalOptimizer(lr=lr)
    )
    pool = ModelClients(
        flat, data, optimizer=cfg.optimizer, seed=0, plan=plan, initial=initial, device=device
    )
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(0), tap=observer.tap)
    server = ModelServer(cfg, flat, np.random.default_rng(0), plan=plan, initial=initial)
    server.setup(runtime)
    asyncio.run(server.run_round(1, runtime))
    flat.load_into_module(initial)
    (view,) = observer.client_views(1)
    return view


GRID_TARGETS = 8
"""Batch-1 grids show this many targets side by side (AIoT Fig. 4 style); larger batches show one."""
GRID_ITERATIONS = (0, 1, 2, 3, 5, 8, 13, 21)


def _grid_result(
    shown: list[tuple[torch.Tensor, torch.Tensor, Any]],
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Originals, labels and one result whose columns are the shown targets, with snapshots at the early
    iterations where the reconstructions form (:data:`GRID_ITERATIONS`) and the final one."""
    histories = [dict(r.history) for _, _, r in shown]
    last = min(max(h) for h in histories)
    picks = [it for it in GRID_ITERATIONS if it < last and all(it in h for h in histories)] + [last]
    combined = replace(
        shown[0][2],
        images=torch.cat([r.images for _, _, r in shown]),
        labels=torch.cat([r.labels for _, _, r in shown]),
        history=[(it, torch.cat([h[it] for h in histories])) for it in picks],
    )
    return torch.cat([x for x, _, _ in shown]), torch.cat([y for _, y, _ in shown]), combined


def run_inversion(
    attack: str,
    *,
    model: str = "lenet-sigmoid",
    data: str = "fashion-mnist",
    batch: int = 1,
    targets: int = 10,
    iterations: int | None = None,
    view: str = "gradient",
    lr: float = 0.1,
    seed: int = 0,
    out: Path | None = None,
    defence: str = "none",
    init: str = "torch",
    only: Sequence[int] | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Invert ``targets`` client batches of ``batch`` test images with ``attack`` (``dlg``, ``idlg``, ``ig``).

    Target ``i`` uses a fresh model initialised with seed ``seed + i`` (the DLG paper's setting: an
    untrained network) and the images ``i * batch ... (i + 1) * batch - 1`` of a seeded shuffle of the
    test split; ``init`` is how its parameters are drawn (:data:`fedveil.models.zoo.INITS`). ``only``
    computes just those of the ``targets`` (each exactly as in the full run: a long attack can be run and
    kept one target at a time, and its rows summarised by :func:`summarize_targets`). Returns (and
    writes to ``out/attack_<name>.json``) the per-target and median metrics.

    Each target's model (and the projector defence's attacker guess) is drawn on the host, as on the CPU,
    then moved to ``device`` (:func:`~fedveil.models.device.resolve_device`) with its batch, once; the
    observed gradient (or the FedAvg client's step) and the attack's matching run there, and the
    reconstructions come back to host memory to be scored. The report records the device.
    """
    if attack not in INVERSIONS:
        raise ConfigError(f"inversion attack {attack!r} is not one of {', '.join(INVERSIONS)}")
    if view not in ("gradient", "fedavg"):
        raise ConfigError(f"view {view!r} is not one of gradient, fedavg")
    if defence not in DEFENCES:
        raise ConfigError(f"defence {defence!r} is not one of {', '.join(DEFENCES)}")
    if defence != "none" and (view != "gradient" or attack == "idlg"):
        raise ConfigError(
            f"defence {defence!r} is studied on the gradient view with dlg or ig (iDLG reads the label off "
            "the last layer, which the projector hides)"
        )
    if batch < 1 or targets < 1:
        raise ConfigError(f"batch {batch!r} and targets {targets!r} must be >= 1")
    chosen = list(range(targets)) if only is None else sorted(set(only))
    if not chosen or any(not 0 <= i < targets for i in chosen):
        raise ConfigError(f"only={only!r} must name targets among 0 ... {targets - 1}")
    where = resolve_device(device)
    images = load_image_dataset(data, "test", seed=seed)
    order = np.random.default_rng(seed).permutation(len(images))[: batch * targets]
    if len(order) < batch * targets:
        raise ConfigError(f"{images.name} has {len(images)} test images, fewer than {batch} x {targets}")
    run = INVERSIONS[attack]
    kwargs: dict[str, Any] = {} if iterations is None else {"iterations": iterations}
    if defence != "none":
        kwargs["optimize_hidden"] = True
    rows: list[dict[str, Any]] = []
    shown: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    t0 = time.perf_counter()
    for i in chosen:
        idx = np.sort(order[i * batch : (i + 1) * batch])
        x = torch.from_numpy(np.array(images.x[idx]))
        y = torch.from_numpy(np.array(images.y[idx]))
        net = build_model(
            model,
            num_classes=images.num_classes,
            in_channels=images.image_shape[0],
            image_size=images.image_shape[1],
            seed=seed + i,
            init=init,
        )
        if view == "fedavg":
            seen = _fedavg_one_step_view(net, x, y, lr, where)
        elif defence == "none":
            seen = client_gradient_view(net.to(where), x.to(where), y.to(where))
        else:
            guess = None
            if defence == "projector":
                guess = build_model(
                    model,
                    num_classes=images.num_classes,
                    in_channels=images.image_shape[0],
                    image_size=images.image_shape[1],
                    seed=seed + 10_000 + i,
                    init=init,
                ).to(where)
            seen = client_gradient_view(
                net.to(where), x.to(where), y.to(where), hidden=last_layer(net), attacker_model=guess
            )
        result = run(
            seen,
            image_shape=images.image_shape,
            batch_size=batch,
            seed=seed + i,
            snapshot_every=1 if i < GRID_TARGETS else None,
            device=where,
            **kwargs,
        )
        metrics = evaluate_inversion(result, x, y)
        rows.append(
            {
                "target": i,
                "mse": float(np.mean(metrics["mse"])),
                "psnr": float(np.mean(metrics["psnr"])),
                "ssim": float(np.mean(metrics["ssim"])),
                "label_accuracy": float(metrics["label_accuracy"]),
                "iterations": result.iterations,
                "iterations_per_second": result.iterations_per_second,
            }
        )
        if i < GRID_TARGETS:
            shown.append((x, y, result))
    summary = {
        "attack": attack,
        "model": model,
        "data": images.name,
        "data_source": images.describe(),
        "synthetic_data": images.synthetic,
        "view": view,
        "defence": defence,
        "batch": batch,
        "device": str(where),
        "targets": len(rows),
        **summarize_targets(rows),
        "seconds": time.perf_counter() - t0,
        "per_target": rows,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"attack_{attack}_batch{batch}" + ("" if defence == "none" else f"_{defence}")
        if shown:
            x, y, grid = _grid_result(shown if batch == 1 else shown[:1])
            save_inversion_grid(out / f"{stem}.png", x, grid, original_labels=y)
        _write_json(out / f"{stem}.json", summary)
    return summary


def summarize_targets(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary of per-target inversion rows (``run_inversion``'s ``per_target``): medians of MSE, PSNR
    and SSIM, mean label accuracy, and how many targets were recovered (MSE <= 0.01)."""
    return {
        "mse": float(np.median([r["mse"] for r in rows])),
        "psnr": float(np.median([r["psnr"] for r in rows])),
        "ssim": float(np.median([r["ssim"] for r in rows])),
        "label_accuracy": float(np.mean([r["label_accuracy"] for r in rows])),
        "recovered": int(sum(r["mse"] <= 0.01 for r in rows)),
        "iterations_per_second": float(np.median([r["iterations_per_second"] for r in rows])),
        "metric_note": "mse, psnr, ssim: medians over targets of each target's mean over its batch, after "
        "the best matching of reconstructions to originals; recovered: targets with mse <= 0.01",
    }


# --- membership inference ------------------------------------------------------------------------------

MIA_ATTACKS = ("yeom", "nasr", "lira")


def _central_train_fn(run: FedAvgRun, epochs: int, num_classes: int, device: torch.device) -> Any:
    """LiRA's shadow training: the target's architecture and client optimizer, trained centrally for
    ``epochs`` passes in batches of the target's batch size (the attacker imitates the recipe), on
    ``device``: each shadow is initialised on the host (seeded as on the CPU), then it and its training
    half move there once; the shadow returned stays there, where LiRA scores it."""

    def train(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
        module = build_model(
            run.model, num_classes=num_classes, in_channels=x.shape[1], image_size=x.shape[2], seed=seed
        ).to(device)
        flat = FlatModel(module)
        rng = np.random.default_rng(seed)
        bsz = run.fedavg.batch_size
        x, y = x.to(device), y.to(device)
        batches = []
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(len(x))).to(device)
            batches.extend((x[order[s : s + bsz]], y[order[s : s + bsz]]) for s in range(0, len(x), bsz))

        def loss(p: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(flat(p, xb), yb)

        opt = run.fedavg.optimizer
        p, _ = local_train(loss, torch.from_numpy(flat.initial()).to(device), batches, opt, opt.lr)
        return flat.load_into_module(p.detach().cpu().numpy()).eval()

    return train


def membership_run(
    *,
    data: str = "fashion-mnist",
    model: str = "lenet",
    clients: int = 10,
    samples_per_client: int = 40,
    rounds: int = 40,
    local_epochs: int = 5,
    seed: int = 0,
    model_init: str = "torch",
    device: str = "auto",
) -> FedAvgRun:
    """The default target of :func:`run_membership`: full participation, SGD with momentum 0.9 and
    learning rate 0.05, batches of 16, no defence; ``test_samples`` equal to the members (non-members);
    ``model_init`` and ``device`` (where :func:`run_membership` trains and attacks it) as
    :class:`~fedveil.experiments.fedavg_images.FedAvgRun` takes them."""
    return FedAvgRun(
        data=data,
        model=model,
        clients=clients,
        samples_per_client=samples_per_client,
        rounds=rounds,
        test_samples=clients * samples_per_client,
        fedavg=ImageFedAvgConfig(
            clients_per_round=clients,
            local_epochs=local_epochs,
            batch_size=16,
            optimizer=LocalOptimizer(lr=0.05, momentum=0.9),
            eval_every=5,
        ),
        seed=seed,
        model_init=model_init,
        device=device,
    )


def run_membership(
    *,
    attacks: tuple[str, ...] = MIA_ATTACKS,
    run: FedAvgRun | None = None,
    shadows: int = 8,
    shadow_epochs: int | None = None,
    seed: int = 0,
    out: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Membership inference against an undefended FedAvg model, beside a control (module docstring).

    Candidates are the target's ``n`` training examples (members) and ``n`` unused training examples
    (non-members). The control model is trained by the same recipe on examples disjoint from both, so its
    AUC must be 0.5 up to sampling error (``auc_null_std_error`` in each report). LiRA's ``shadows`` are
    trained centrally on random halves of the candidates for ``shadow_epochs`` passes (default: the
    target's epochs over a client's data, ``rounds * local_epochs``, at most 100).

    Everything runs on ``run.device`` (:func:`~fedveil.models.device.resolve_device`), resolved before
    anything trains: the FedAvg clients of the target and the control (each client's data moved once),
    LiRA's shadow models, Yeom's losses, the Nasr-style features and LiRA's statistics (the released
    models stay where they trained; the candidates move to them in batches of up to 1,024 per model);
    scores, reports and the ROC plot are in host memory. The report records the device.
    """
    bad = [a for a in attacks if a not in MIA_ATTACKS]
    if bad:
        raise ConfigError(f"membership attacks {bad} are not among {', '.join(MIA_ATTACKS)}")
    run = run or membership_run(seed=seed)
    where = resolve_device(run.device)
    run = replace(run, device=str(where))
    target = train_fedavg(run, progress=progress)
    control = train_fedavg(replace(run, seed=run.seed + 1), progress=progress, avoid=target.candidate_index)
    n = len(target.members)
    if len(target.non_members) < n:
        raise ConfigError(f"{len(target.non_members)} non-members for {n} members: raise test_samples")
    x = torch.from_numpy(np.concatenate([target.members.x, target.non_members.x[:n]]))
    y = torch.from_numpy(np.concatenate([target.members.y, target.non_members.y[:n]]))
    is_member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    epochs = shadow_epochs or min(100, run.rounds * run.fedavg.local_epochs)
    train_fn = _central_train_fn(run, epochs, target.members.num_classes, where)
    reports: dict[str, Any] = {}
    for name, trained in (("target", target), ("control", control)):
        model = trained.model().to(where)
        released = ModelView(f"{name}: released global model", model)
        for attack in attacks:
            rng = np.random.default_rng(seed)
            if attack == "yeom":
                train_loss = float(per_example_loss(model, x[:n], y[:n]).mean())
                scores = yeom_attack(released, x, y, is_member, mean_train_loss=train_loss)
            elif attack == "nasr":
                scores = nasr_attack(
                    ModelView(f"{name}: released global model", model), x, y, is_member, rng=rng, device=where
                )
            else:
                both = lira_variants(released, x, y, is_member, train_fn, rng=rng, num_shadow=shadows)
                for variant, scores in both.items():
                    reports[f"lira-{variant}/{name}"] = scores
                continue
            reports[f"{attack}/{name}"] = scores
    summary = {
        "run": {
            "data": target.members.describe(),
            "synthetic_data": target.members.synthetic,
            "model": run.model,
            "clients": run.clients,
            "samples_per_client": run.samples_per_client,
            "rounds": run.rounds,
            "local_epochs": run.fedavg.local_epochs,
            "shadows": shadows,
            "shadow_epochs": epochs,
            "device": str(where),
            "target_train_accuracy": target.train_accuracy(),
            "target_test": target.history[-1].get("test_accuracy"),
            "control_test": control.history[-1].get("test_accuracy"),
        },
        "attacks": {k: v.as_dict() for k, v in reports.items()},
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "attack_membership.json", summary)
        plot_attack_roc(
            reports, out / "attack_membership_roc.png", title="Membership inference: target vs control"
        )
    return summary


# --- property inference --------------------------------------------------------------------------------


def stamp_property(x: np.ndarray, size: int = 3) -> np.ndarray:
    """The property of :func:`run_property`: a bright ``size`` x ``size`` watermark in the top-left corner."""
    out = np.array(x, dtype=np.float32, copy=True)
    out[:, :, :size, :size] = 1.0
    return out


async def _rounds(server: ModelServer, runtime: SimulationRuntime, rounds: int) -> None:
    for rnd in range(1, rounds + 1):
        await server.run_round(rnd, runtime)


def run_property(
    *,
    data: str = "fashion-mnist",
    model: str = "lenet",
    clients: int = 20,
    samples_per_client: int = 16,
    rounds: int = 6,
    seed: int = 0,
    out: Path | None = None,
    init: str = "torch",
    device: str = "auto",
) -> dict[str, Any]:
    """Melis et al.'s property inference on per-client FedAvg updates, and its control (module docstring);
    ``init`` is how the model's parameters are drawn (:data:`fedveil.models.zoo.INITS`).

    Half the clients (seeded choice) have the property: every one of their images is stamped
    (:func:`stamp_property`). The attacker holds auxiliary examples (unused training images), stamps half
    of them, and attacks the last-layer update of every upload the server saw, over all rounds. The control
    run stamps nothing, so its "property" (the same client labels) is unrelated to the updates.

    The FedAvg clients train on ``device`` (:func:`~fedveil.models.device.resolve_device`, resolved before
    anything loads; each client's photos moved there once), and so does the attack's simulation of
    updates on the auxiliary data (moved there once); the observed updates are decoded off the wire in
    host memory and the classifier's features come back there. The report records the device.
    """
    where = resolve_device(device)
    images = load_image_dataset(data, "train", seed=seed)
    rng = np.random.default_rng(seed)
    need = clients * samples_per_client
    order = rng.permutation(len(images))
    if len(order) < need + 1000:
        raise ConfigError(f"{images.name} has {len(images)} images, fewer than {need + 1000} needed")
    own = images.subset(np.sort(order[:need]))
    aux = images.subset(np.sort(order[need : need + 1000]))
    has = np.zeros(clients, bool)
    has[rng.choice(clients, clients // 2, replace=False)] = True
    aux_prop = np.zeros(len(aux), bool)
    aux_prop[rng.choice(len(aux), len(aux) // 2, replace=False)] = True
    aux_x = np.where(aux_prop[:, None, None, None], stamp_property(aux.x), aux.x)
    results = {}
    for name, stamped in (("target", True), ("control", False)):
        users = []
        for i in range(clients):
            xs = own.x[i * samples_per_client : (i + 1) * samples_per_client]
            if stamped and has[i]:
                xs = stamp_property(xs)
            users.append(
                UserData(
                    f"client{i:04d}",
                    {},
                    {"x": np.array(xs), "y": own.y[i * samples_per_client : (i + 1) * samples_per_client]},
                )
            )
        fed = FederatedDataset(users)
        module = build_model(
            model,
            num_classes=own.num_classes,
            in_channels=own.image_shape[0],
            image_size=own.image_shape[1],
            seed=seed,
            init=init,
        )
        flat = FlatModel(module)
        plan = ParameterPlan(flat)
        cfg = ImageFedAvgConfig(
            clients_per_round=clients,
            local_epochs=1,
            batch_size=samples_per_client,
            optimizer=LocalOptimizer(lr=0.05),
        )
        observer = WireObserver(flat, plan, lambda m=module: copy.deepcopy(m))
        initial = flat.initial()
        pool = ModelClients(
            flat, fed, optimizer=cfg.optimizer, seed=seed, plan=plan, initial=initial, device=where
        )
        runtime = SimulationRuntime(pool, rng=np.random.default_rng(seed), tap=observer.tap)
        server = ModelServer(cfg, flat, np.random.default_rng(seed), plan=plan, initial=initial)
        server.setup(runtime)

        asyncio.run(_rounds(server, runtime, rounds))
        views, labels = [], []
        for rnd in range(1, rounds + 1):
            for v, cid in zip(observer.client_views(rnd), server.members, strict=True):
                views.append(v)
                labels.append(has[int(cid[len("client") :])])
        last = [n for n, _ in module.named_parameters()][-2:]
        results[name] = melis_attack(
            views,
            np.array(labels),
            aux_x,
            aux.y,
            aux_prop,
            rng=np.random.default_rng(seed),
            batch_size=samples_per_client,
            params=last,
            device=where,
        )
    summary = {
        "run": {
            "data": own.describe(),
            "synthetic_data": own.synthetic,
            "property": "3x3 bright top-left watermark (a synthetic subgroup marker stamped on real images)",
            "model": model,
            "clients": clients,
            "samples_per_client": samples_per_client,
            "rounds": rounds,
            "views": len(views),
            "attacked_parameters": last,
            "device": str(where),
        },
        "attacks": {f"melis/{k}": v.as_dict() for k, v in results.items()},
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "attack_property.json", summary)
    return summary
