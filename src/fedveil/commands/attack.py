"""``fedveil attack ATTACK ...``: run an attack of the suite and report its metrics.

Every attack that trains, attacks or scores a torch model takes ``--device D`` (``auto``, the default:
CUDA when torch sees a GPU, else the CPU; ``cpu``; ``cuda``; ``cuda:N``); its JSON report records the
device it ran on. ``fdml-derivatives`` has none: it plays FDML's enclave code, which is numpy on the host.

- ``fedveil attack dlg|idlg|ig [--model lenet-sigmoid] [--data fashion-mnist] [--batch 1] [--targets 10]
  [--iterations N] [--view gradient|fedavg] [--device D] [--seed 0] [--out DIR] [--json]``: gradient
  inversion of client batches (:func:`fedveil.experiments.attacks.runs.run_inversion`); prints ``mse``,
  ``psnr``, ``ssim`` (medians over targets), ``label_accuracy``; writes a PNG grid and the JSON under
  ``--out``.
- ``fedveil attack mia|lira [--model lenet] [--clients 10] [--samples-per-client 40] [--rounds 40]
  [--local-epochs 5] [--shadows 8] [--device D] [--seed 0] [--out DIR] [--json]``: membership inference
  against an undefended FedAvg model and its control (``mia``: Yeom and the Nasr-style white-box attack;
  ``lira``: LiRA) (:func:`~fedveil.experiments.attacks.runs.run_membership`).
- ``fedveil attack pia [--model lenet] [--clients 20] [--samples-per-client 16] [--rounds 6] [--device D]
  ...``: Melis et al.'s property inference on per-client updates, and its control
  (:func:`~fedveil.experiments.attacks.runs.run_property`).
- ``fedveil attack feduv-codeword [--methods feduv,softmax,fedaws] [--writers 10] [--rounds 20]
  [--fraction 0.3] [--code-length 127] [--device D] [--seed 0] [--out DIR] [--json]``: the server reads
  each user's FedUV codeword (softmax, FedAwS: class) off its updates, beside controls
  (:func:`~fedveil.experiments.attacks.feduv_codeword.feduv_codeword_table`).
- ``fedveil attack fdml-derivatives [--trials 2000] [--participants 4] [--samples 4] [--dim 8]
  [--epsilons 0.5,2,8] [--drop-rate 0] [--seed 0] [--out DIR] [--json]``: a participant infers from its
  step-6 derivatives whether a target embedding was in the round, without DP and with FDML Alg. 2 in
  both clipping modes, beside the epsilon that bounds it
  (:func:`~fedveil.experiments.attacks.fdml_views.fdml_derivative_table`).
- ``fedveil attack fdml-membership [--users 64] [--rounds 120] [--num-required 64] [--device D] [--seed 0]
  [--out DIR] [--json]``: user-level membership inference against the FDML embedding network every
  selected device receives, beside the control
  (:func:`~fedveil.experiments.attacks.fdml_views.fdml_membership_table`).
- ``fedveil attack fdml-lira [--users 200] [--shadows 16] [--rounds 100] [--devices 16] [--threads 1]
  [--device D] [--seed 0] [--out DIR] [--json]``: user-level LiRA (Carlini et al. 2022) against the FDML
  embedding network, online and offline, beside a control trained on other users
  (:func:`~fedveil.experiments.attacks.fdml_lira.fdml_lira_table`).
- ``fedveil attack fdml-inversion [--cohorts 1,2,4] [--windows 2] [--iterations 400] [--device D]
  [--seed 0] [--out DIR] [--json]``: gradient inversion of the touch windows of a round from the
  difference of two consecutive global models (SGD and Adam steps), beside controls
  (:func:`~fedveil.experiments.attacks.fdml_inversion.fdml_inversion_table`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedveil.commands import add_device_argument


def register(subparsers: Any) -> None:
    """Add the ``attack`` command; each attack is a sub-command."""
    parser = subparsers.add_parser("attack", help="attack what an observer of a federated run sees")
    attacks = parser.add_subparsers(dest="attack", metavar="ATTACK", required=True)
    for name, text in (
        ("dlg", "Deep Leakage from Gradients (Zhu et al. 2019)"),
        ("idlg", "improved DLG: label from the last layer (Zhao et al. 2020)"),
        ("ig", "Inverting Gradients (Geiping et al. 2020)"),
    ):
        p = attacks.add_parser(name, help=text, description=text)
        p.add_argument("--model", default="lenet-sigmoid", help="zoo model (default lenet-sigmoid)")
        p.add_argument("--data", default="fashion-mnist", help="data set (default fashion-mnist)")
        p.add_argument("--batch", type=int, default=1, help="images per client batch (default 1)")
        p.add_argument("--targets", type=int, default=10, help="client batches attacked (default 10)")
        p.add_argument("--iterations", type=int, default=None, help="optimiser iterations (attack default)")
        p.add_argument(
            "--view",
            choices=("gradient", "fedavg"),
            default="gradient",
            help="gradient: the batch gradient (FedSGD); fedavg: one FedAvg round's upload off the wire",
        )
        if name != "idlg":
            p.add_argument(
                "--defence",
                choices=("none", "projector", "projector-upper-bound"),
                default="none",
                help="AIoT's private projector: the last layer stays on the device; the attacker starts "
                "it at random (projector) or at the true values (projector-upper-bound)",
            )
        _common(p, where="where the client model, its batch and the matching run")
    for name, text in (
        ("mia", "membership inference: Yeom loss threshold and Nasr-style white-box classifier"),
        ("lira", "membership inference: LiRA (Carlini et al. 2022), offline and online"),
        ("pia", "property inference from client updates (Melis et al. 2019)"),
    ):
        p = attacks.add_parser(name, help=text, description=text)
        p.add_argument("--model", default="lenet", help="zoo model (default lenet)")
        p.add_argument("--data", default="fashion-mnist", help="data set (default fashion-mnist)")
        p.add_argument("--clients", type=int, default=None, help="clients (default 10; pia 20)")
        p.add_argument(
            "--samples-per-client", type=int, default=None, help="examples per client (40; pia 16)"
        )
        p.add_argument("--rounds", type=int, default=None, help="FedAvg rounds (default 40; pia 6)")
        if name != "pia":
            p.add_argument("--local-epochs", type=int, default=5, help="local epochs per round (default 5)")
            p.add_argument("--shadows", type=int, default=8, help="LiRA shadow models (default 8)")
            p.add_argument("--shadow-epochs", type=int, default=None, help="LiRA shadow epochs (<= 100)")
        _common(p, where="where FedAvg, the shadow models and the attacks train and score")
    p = attacks.add_parser(
        "feduv-codeword",
        help="FedUV: the server reads each user's secret codeword off its updates",
        description="FedUV: the server reads each user's secret codeword (softmax, FedAwS: class) off "
        "its FedAvg updates, on SYNTHETIC MNIST-UV",
    )
    p.add_argument("--methods", default="feduv,softmax,fedaws", help="comma-separated (default all three)")
    p.add_argument("--writers", type=int, default=10, help="users (default 10)")
    p.add_argument("--rounds", type=int, default=20, help="training rounds (default 20)")
    p.add_argument("--fraction", type=float, default=0.3, help="users per round, a fraction (default 0.3)")
    p.add_argument("--code-length", type=int, default=127, help="FedUV BCH code length (default 127)")
    _common(p, where="where the users train")
    p = attacks.add_parser(
        "fdml-derivatives",
        help="FDML: membership of a target embedding from a participant's step-6 derivatives",
        description="FDML: a participant infers from the derivatives it receives whether a target "
        "embedding of another participant was in the round (SYNTHETIC embeddings), without DP and with "
        "Alg. 2 in both clipping modes",
    )
    p.add_argument("--trials", type=int, default=2000, help="independent rounds (default 2000)")
    p.add_argument("--participants", type=int, default=4, help="participants per round (default 4)")
    p.add_argument("--samples", type=int, default=4, help="embeddings per participant (default 4)")
    p.add_argument("--dim", type=int, default=8, help="embedding dimension (default 8)")
    p.add_argument("--epsilons", default="0.5,2,8", help="per-round epsilons of Alg. 2 (default 0.5,2,8)")
    p.add_argument("--drop-rate", type=float, default=0.0, help="Alg. 2 embedding drop rate r (default 0)")
    _common(p, where=None)
    p = attacks.add_parser(
        "fdml-membership",
        help="FDML: user-level membership inference against the global embedding network",
        description="FDML: train on SYNTHETIC TouchAuth without DP and infer which users trained from the "
        "global embedding network every selected device receives, beside a control",
    )
    p.add_argument("--users", type=int, default=64, help="training users, and as many unseen (default 64)")
    p.add_argument("--rounds", type=int, default=120, help="FDML rounds (default 120)")
    p.add_argument("--num-required", type=int, default=64, help="devices per round (default 64)")
    _common(p, where="where FDML trains and the attacks embed")
    p = attacks.add_parser(
        "fdml-lira",
        help="FDML: user-level LiRA against the global embedding network",
        description="FDML: train on SYNTHETIC TouchAuth without DP and run user-level LiRA (Carlini et al. "
        "2022, online and offline; shadows trained centrally) against the global embedding network every "
        "selected device receives, beside a control trained on users disjoint from every candidate",
    )
    p.add_argument(
        "--users", type=int, default=200, help="candidate users, half of them members (default 200)"
    )
    p.add_argument("--shadows", type=int, default=16, help="shadow networks (default 16)")
    p.add_argument("--rounds", type=int, default=100, help="FDML rounds, and shadow steps (default 100)")
    p.add_argument("--devices", type=int, default=16, help="devices per round (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    _common(p, where="where FDML and the shadow networks train and the attacks embed")
    p = attacks.add_parser(
        "fdml-inversion",
        help="FDML: gradient inversion of a round's touch windows from a global-model difference",
        description="FDML: reconstruct the SYNTHETIC TouchAuth windows of a round from w_{t+1} - w_t "
        "(after an SGD and an Adam step), beside a round the targets were not in and the mean window",
    )
    p.add_argument("--cohorts", default="1,2,4", help="devices per round, one attack each (default 1,2,4)")
    p.add_argument("--windows", type=int, default=2, help="touch windows per device (default 2)")
    p.add_argument("--iterations", type=int, default=400, help="attack iterations (default 400)")
    _common(p, where="where the attack's matching runs")
    parser.set_defaults(func=run)


def _common(p: argparse.ArgumentParser, *, where: str | None) -> None:
    """The options every attack shares: ``--seed``, ``--out``, ``--json``, and ``--device`` (``where``
    says what runs there) unless ``where`` is ``None`` (an attack with nothing to put on a device)."""
    if where is not None:
        add_device_argument(p, where=where)
    p.add_argument("--seed", type=int, default=0, help="seed of everything random (default 0)")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON report and PNGs")
    p.add_argument("--json", action="store_true", help="print the JSON report")


def run(args: argparse.Namespace) -> int:
    """Run the chosen attack and print its report."""
    from fedveil.experiments.attacks import runs as attack_runs

    if args.attack == "feduv-codeword":
        return _feduv_codeword(args)
    if args.attack == "fdml-derivatives":
        return _fdml_derivatives(args)
    if args.attack == "fdml-membership":
        return _fdml_membership(args)
    if args.attack == "fdml-lira":
        return _fdml_lira(args)
    if args.attack == "fdml-inversion":
        return _fdml_inversion(args)
    if args.attack in attack_runs.INVERSIONS:
        summary = attack_runs.run_inversion(
            args.attack,
            model=args.model,
            data=args.data,
            batch=args.batch,
            targets=args.targets,
            iterations=args.iterations,
            view=args.view,
            seed=args.seed,
            out=args.out,
            defence=getattr(args, "defence", "none"),
            device=args.device,
        )
        if args.json:
            print(json.dumps(summary, indent=2, default=float))
        else:
            print(summary["data_source"])
            print(
                f"{args.attack} batch {args.batch}, {args.targets} targets, view {args.view}: "
                f"MSE {summary['mse']:.3g}  PSNR {summary['psnr']:.1f} dB  SSIM {summary['ssim']:.3f}  "
                f"labels {summary['label_accuracy']:.2f}  recovered {summary['recovered']}/{args.targets}"
            )
        return 0
    if args.attack == "pia":
        summary = attack_runs.run_property(
            data=args.data,
            model=args.model,
            clients=args.clients or 20,
            samples_per_client=args.samples_per_client or 16,
            rounds=args.rounds or 6,
            seed=args.seed,
            out=args.out,
            device=args.device,
        )
    else:
        summary = attack_runs.run_membership(
            attacks=("yeom", "nasr") if args.attack == "mia" else ("lira",),
            run=attack_runs.membership_run(
                data=args.data,
                model=args.model,
                clients=args.clients or 10,
                samples_per_client=args.samples_per_client or 40,
                rounds=args.rounds or 40,
                local_epochs=args.local_epochs,
                seed=args.seed,
                device=args.device,
            ),
            shadows=args.shadows,
            shadow_epochs=args.shadow_epochs,
            seed=args.seed,
            out=args.out,
            progress=not args.json,
        )
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
    else:
        print(summary["run"]["data"])
        for name, rep in summary["attacks"].items():
            low = rep.get("tpr_at_fpr", {})
            print(
                f"{name:16s} AUC {rep['auc']:.3f} (null s.e. {rep['auc_null_std_error']:.3f})  "
                f"precision {rep['precision']:.3f}  balanced acc {rep['balanced_accuracy']:.3f}  "
                f"TPR@FPR {low}"
            )
    return 0


def _feduv_codeword(args: argparse.Namespace) -> int:
    """``fedveil attack feduv-codeword``: run the table and print one line per method."""
    from fedveil.experiments.attacks.feduv_codeword import feduv_codeword_table
    from fedveil.experiments.feduv.runner import parse_methods

    summary = feduv_codeword_table(
        methods=parse_methods(args.methods),
        writers=args.writers,
        rounds=args.rounds,
        fraction=args.fraction,
        code_length=args.code_length,
        seed=args.seed,
        out=args.out,
        device=args.device,
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return 0
    print(summary["run"]["data"])
    for method, rep in summary["attacks"].items():
        if "target" in rep:
            print(
                f"{method:8s} bit accuracy {rep['target']['bit_accuracy_mean']:.3f} (chance 0.5, null s.e. "
                f"{rep['null_std_error']:.3f}), within t={rep['code']['t']}: "
                f"{rep['target']['within_radius']}/{rep['users_attacked']} users; control "
                f"{rep['control_random_codeword']['bit_accuracy_mean']:.3f}"
            )
        else:
            print(
                f"{method:8s} class top-1 {rep['target_top1']:.3f} (chance {rep['chance']:.3f}); control "
                f"{rep['control_random_class_top1']:.3f}"
            )
    return 0


def _fdml_derivatives(args: argparse.Namespace) -> int:
    """``fedveil attack fdml-derivatives``: run the table and print one line per setting."""
    from fedveil.errors import ConfigError
    from fedveil.experiments.attacks.fdml_views import fdml_derivative_table

    try:
        epsilons = tuple(float(e) for e in args.epsilons.split(",") if e.strip())
    except ValueError as exc:
        raise ConfigError(f"--epsilons {args.epsilons!r}: comma-separated numbers, e.g. 0.5,2,8") from exc
    summary = fdml_derivative_table(
        trials=args.trials,
        participants=args.participants,
        samples=args.samples,
        dim=args.dim,
        epsilons=epsilons,
        drop_rate=args.drop_rate,
        seed=args.seed,
        out=args.out,
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return 0
    print(summary["run"]["data"])
    for name, entry in summary["settings"].items():
        line = f"{name:16s}"
        for key in ("informed", "direction", "control"):
            row = entry[key]
            line += f"  {key} AUC {row['auc']:.3f} (null s.e. {row['auc_null_std_error']:.3f})"
        check = entry["informed"].get("vs_claimed")
        if check is not None:
            line += (
                f"  eps {check['epsilon']:g}: AUC bound {check['auc_bound']:.3f}, "
                f"empirical eps >= {check['epsilon_lower']:.2f}"
            )
        print(line)
    return 0


def _fdml_membership(args: argparse.Namespace) -> int:
    """``fedveil attack fdml-membership``: train, attack and print one line per attack."""
    from fedveil.experiments.attacks.fdml_views import fdml_membership_table

    summary = fdml_membership_table(
        users=args.users,
        rounds=args.rounds,
        num_required=args.num_required,
        seed=args.seed,
        out=args.out,
        device=args.device,
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return 0
    run = summary["run"]
    print(f"{run['data']}: {run['members']} members, {run['non_members']} non-members")
    _print_auc_rows(summary["attacks"], width=26)
    return 0


def _print_auc_rows(attacks: dict[str, dict], *, width: int) -> None:
    """One line per membership attack: its AUC, the AUC's standard error under the null, TPR at each FPR."""
    for name, rep in attacks.items():
        print(
            f"{name:{width}s} AUC {rep['auc']:.3f} (null s.e. {rep['auc_null_std_error']:.3f})  "
            f"TPR@FPR {rep['tpr_at_fpr']}"
        )


def _fdml_lira(args: argparse.Namespace) -> int:
    """``fedveil attack fdml-lira``: train, attack and print one line per attack."""
    from fedveil.experiments.attacks.fdml_lira import fdml_lira_table

    summary = fdml_lira_table(
        users=args.users,
        shadows=args.shadows,
        rounds=args.rounds,
        devices=args.devices,
        seed=args.seed,
        num_threads=args.threads,
        out=args.out,
        progress=not args.json,
        device=args.device,
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return 0
    run = summary["run"]
    print(f"{run['data']}: {run['members']} members, {run['non_members']} non-members; {run['fpr_note']}")
    print(f"epsilon: {run['dp']}")
    _print_auc_rows(summary["attacks"], width=30)
    return 0


def _fdml_inversion(args: argparse.Namespace) -> int:
    """``fedveil attack fdml-inversion``: attack each round and print one line per round and optimizer."""
    from fedveil.experiments.attacks.fdml_inversion import fdml_inversion_table

    summary = fdml_inversion_table(
        cohorts=[int(k) for k in args.cohorts.split(",")],
        windows=args.windows,
        iterations=args.iterations,
        seed=args.seed,
        out=args.out,
        device=args.device,
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return 0
    for name, entry in summary["rounds"].items():
        if entry["attack"] is None:
            print(f"{name:10s} {entry['note']}")
            continue
        keys = ("attack", "control/other-round", "baseline/prior-mean-window")
        cells = [
            f"{key} MSE {entry[key]['mse_mean']:.4f} cos {entry[key]['cosine_mean']:.3f}" for key in keys
        ]
        print(f"{name:10s} " + "  ".join(cells))
    return 0
