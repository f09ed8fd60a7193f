"""``fedveil ppfl run CONFIG``: PPFL's greedy layer-wise training in emulated TEEs.

- ``fedveil ppfl run CONFIG [--out DIR] [--set KEY=VALUE ...] [--rounds N] [--seed S] [--threads T]
  [--no-e2e] [--json] [--no-progress] [--resume | --overwrite]``
  trains PPFL (and end-to-end FedAvg over the same total rounds), writes the run directory
  (:func:`fedveil.experiments.ppfl.runner.run_ppfl`) and prints the per-layer summary.
- ``fedveil ppfl attacks [--model M] [--model-init I] [--classifier-pool P] [--data D] [--dra-targets N]
  [--seed S] [--device D] [--out DIR] [--json]``: Table 2, each attack on what each observer sees
  (:func:`fedveil.experiments.ppfl.attacks.ppfl_attack_table`), the trainings and attacks on ``D``.
- ``fedveil ppfl lira [--model M] [--model-init I] [--classifier-pool P] [--data D] [--clients C]
  [--shadows S] [--systems LIST] [--seed S] [--device D] [--out DIR] [--json]``: Table 2's membership row
  by LiRA, with shadows trained the way E2E FedAvg and PPFL train, on ``D``
  (:func:`fedveil.experiments.ppfl.lira.ppfl_lira_table`).
- ``fedveil ppfl transfer CONFIG [--fractions F ...] [--last K ...] [--out DIR] [--json]``: Appendix A.1 /
  Fig. 8, transfer from public data, on the config's ``device``
  (:func:`fedveil.experiments.ppfl.transfer.run_transfer_sweep`).
- ``fedveil ppfl cost [--model M] [--data D] [--steps N] [--repeats R] [--plot PNG] [--json]``: Fig. 3,
  a client's CPU time and memory with and without the TEE emulation
  (:func:`fedveil.experiments.ppfl.cost.measure_client_costs`).
- ``fedveil ppfl memory [--model M] [--batch-size B] [--data D] [--json]`` prints ``S_l`` per stage
  (parameters, gradients, optimizer, activations) and the measured peak of the same training steps.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedveil.commands import add_device_argument
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import add_run_arguments, run_sets
from fedveil.experiments.config import run_overrides


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--model-init`` and ``--classifier-pool`` of the attack commands (VGG9 needs
    ``--model-init darknet --classifier-pool avg`` to learn and to fit the enclave, as in Table 3)."""
    parser.add_argument("--model", default="lenet", help="zoo model (default lenet)")
    parser.add_argument(
        "--model-init",
        default="torch",
        choices=("torch", "darknet"),
        help="how E2E's model and each PPFL stage are initialised (default torch; vgg9: darknet)",
    )
    parser.add_argument(
        "--classifier-pool",
        default="none",
        choices=("none", "avg", "max"),
        help="pool a PPFL conv stage's output before its classifier (default none; vgg9: avg)",
    )


def register(subparsers: Any) -> None:
    """Add the ``ppfl`` command with its ``run`` and ``memory`` actions."""
    p = subparsers.add_parser("ppfl", help="PPFL: layer-wise federated training in client and server TEEs")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = actions.add_parser("run", help="train PPFL (and the E2E FedAvg baseline); write a run directory")
    r.add_argument(
        "config", type=Path, help="YAML settings, e.g. configs/ppfl/quick.yaml (about a minute) or small.yaml"
    )
    r.add_argument("--rounds", type=int, default=None, help="rounds per layer (overrides the config)")
    r.add_argument("--no-e2e", action="store_true", help="skip the end-to-end FedAvg baseline")
    r.add_argument("--threads", type=int, default=None, help="torch threads (overrides the config)")
    r.add_argument("--json", action="store_true", help="print results.json (no progress output)")
    add_run_arguments(r)
    a = actions.add_parser("attacks", help="Table 2: DLG, property and membership inference, E2E vs PPFL")
    _add_model_options(a)
    a.add_argument("--data", default="fashion-mnist", help="data set (default fashion-mnist)")
    a.add_argument("--dra-targets", type=int, default=5, help="batch-1 uploads DLG attacks (default 5)")
    a.add_argument("--seed", type=int, default=0, help="seed of everything random (default 0)")
    add_device_argument(a, where="where the trainings and the attacks run")
    a.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for ppfl_attacks.json and each finished part (parts/); a rerun resumes from them",
    )
    a.add_argument("--json", action="store_true", help="print the JSON report")
    li = actions.add_parser(
        "lira",
        help="Table 2's MIA by LiRA: TPR at FPR 1e-3, shadows trained the way E2E and PPFL train",
    )
    _add_model_options(li)
    li.add_argument("--data", default="fashion-mnist", help="data set (default fashion-mnist)")
    li.add_argument(
        "--clients",
        type=int,
        default=25,
        help="clients x 40 images: members, as many non-members (default 25)",
    )
    li.add_argument(
        "--shadows", type=int, default=16, help="shadow models per system (default 16, at least 4)"
    )
    li.add_argument(
        "--systems",
        default="e2e,ppfl-released,ppfl-kept",
        help="comma-separated, among e2e, ppfl-released, ppfl-kept (default all three)",
    )
    li.add_argument("--seed", type=int, default=0, help="seed of everything random (default 0)")
    add_device_argument(li, where="where the targets and shadows train and are scored")
    li.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for ppfl_lira.json, each shadow's phis and each finished system; a rerun resumes",
    )
    li.add_argument("--json", action="store_true", help="print the JSON report")
    t = actions.add_parser(
        "transfer", help="Appendix A.1: public-data fraction vs client-trained last layers"
    )
    t.add_argument(
        "config", type=Path, help="YAML settings without transfer keys, e.g. configs/ppfl/transfer_lenet.yaml"
    )
    t.add_argument(
        "--fractions", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="public data (default 0.1 0.5 1)"
    )
    t.add_argument(
        "--last", type=int, nargs="+", default=[1, 2, 3, 4], help="last units trained (default 1 2 3 4)"
    )
    t.add_argument("--out", type=Path, default=None, help="sweep directory (default: runs/<name>); resumes")
    add_device_argument(t, where="where the sweep trains (default: the config's device)", default=None)
    t.add_argument("--json", action="store_true", help="print transfer.json (no progress output)")
    c = actions.add_parser(
        "cost", help="Fig. 3: a client's CPU time and memory per step, with and without TEE"
    )
    c.add_argument("--model", default="lenet", help="zoo model (default lenet)")
    c.add_argument(
        "--data", default="fashion-mnist", choices=("fashion-mnist", "cifar10"), help="input shape"
    )
    c.add_argument("--batch-size", type=int, default=16, help="batch size (default 16, PPFL Sec. 6.2)")
    c.add_argument("--block-size", type=int, default=1, help="layers per stage (default 1; Fig. 5: 2)")
    c.add_argument(
        "--steps", type=int, default=1, help="training steps per measured block (default 1, Fig. 3)"
    )
    c.add_argument("--repeats", type=int, default=9, help="measured blocks, median taken (default 9)")
    c.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    c.add_argument("--plot", type=Path, default=None, help="write Fig. 3's bars to this PNG")
    c.add_argument("--json", action="store_true", help="print JSON")
    m = actions.add_parser("memory", help="S_l per layer stage: the TEE memory model and the measured peak")
    m.add_argument("--model", default="lenet", help="zoo model (default lenet)")
    m.add_argument(
        "--data", default="fashion-mnist", choices=("fashion-mnist", "cifar10"), help="input shape"
    )
    m.add_argument("--batch-size", type=int, default=16, help="batch size (default 16, PPFL Sec. 6.2)")
    m.add_argument("--block-size", type=int, default=1, help="layers per stage (default 1)")
    m.add_argument(
        "--classifier-pool",
        default="none",
        choices=("none", "avg", "max"),
        help="pool a stage's output to the last conv layer's input size first (default none)",
    )
    m.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _memory(args: argparse.Namespace) -> int:
    from fedveil.models.zoo import build_model
    from fedveil.protocols.ppfl import (
        PpflConfig,
        measure_tee_memory,
        plan_stages,
        stage_input_shape,
        stage_net,
        tee_memory,
    )

    channels, side = (1, 28) if args.data == "fashion-mnist" else (3, 32)
    model = build_model(args.model, num_classes=10, in_channels=channels, image_size=side)
    opt = PpflConfig().optimizer()
    rows = []
    for stage in plan_stages(model, args.block_size, classifier_pool=args.classifier_pool):
        net, shape = stage_net(model, stage), stage_input_shape(model, stage)
        row = tee_memory(net, shape, args.batch_size, opt, stage=stage.index).as_dict()
        row["units"] = list(stage.units)
        row["measured"] = measure_tee_memory(net, shape, args.batch_size, opt)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.model} on {channels}x{side}x{side}, batch {args.batch_size} (MiB):")
    print("stage  units     params  grads  optim  activ  S_l     measured")
    for row in rows:
        mib = {
            k: row[k] / 2**20
            for k in ("parameters", "gradients", "optimizer", "activations", "total", "measured")
        }
        print(
            f"{row['stage']:>5}  {row['units']!s:<8}  {mib['parameters']:6.1f}  {mib['gradients']:5.1f}  "
            f"{mib['optimizer']:5.1f}  {mib['activations']:5.1f}  {mib['total']:6.1f}  {mib['measured']:6.1f}"
        )
    return 0


def _attacks(args: argparse.Namespace) -> int:
    """Table 2 on ``--device``: every training and attack there (:func:`ppfl_attack_table`)."""
    from fedveil.experiments.attacks.runs import membership_run
    from fedveil.experiments.ppfl.attacks import ppfl_attack_table, ppfl_like

    images = replace(
        membership_run(data=args.data, model=args.model, seed=args.seed, model_init=args.model_init),
        device=args.device,
    )
    summary = ppfl_attack_table(
        images=images,
        ppfl=ppfl_like(images, classifier_pool=args.classifier_pool),
        dra_targets=args.dra_targets,
        out=args.out,
        progress=not args.json,
    )
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    for key, value in summary["attacks"].items():
        if isinstance(value, dict) and "auc" in value:
            print(f"{key:<28} AUC {value['auc']:.3f}  precision {value.get('precision')}")
        elif isinstance(value, dict) and "result" in value:
            print(f"{key:<28} {value['result']} ({value['sealed_views']} sealed views)")
        elif isinstance(value, dict):
            print(f"{key:<28} MSE {value.get('mse')}")
        else:
            print(f"{key:<28} {value}")
    return 0


def _lira(args: argparse.Namespace) -> int:
    """LiRA's Table 2 row on ``--device``: every target and shadow trains and is scored there."""
    from fedveil.experiments.attacks.runs import membership_run
    from fedveil.experiments.ppfl.lira import ppfl_lira_table

    if args.clients < 1:
        raise ConfigError(f"--clients {args.clients} must be >= 1")
    from fedveil.experiments.ppfl.attacks import ppfl_like

    images = replace(
        membership_run(
            data=args.data, model=args.model, clients=args.clients, seed=args.seed, model_init=args.model_init
        ),
        device=args.device,
    )
    summary = ppfl_lira_table(
        images=images,
        ppfl=ppfl_like(images, classifier_pool=args.classifier_pool),
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        shadows=args.shadows,
        out=args.out,
    )
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    for key, value in summary["attacks"].items():
        if isinstance(value, dict):
            tpr = value.get("tpr_at_fpr", {})
            print(
                f"{key:<26} AUC {value['auc']:.3f}  TPR@1e-3 {tpr.get('0.001')}  TPR@1e-2 {tpr.get('0.01')}"
            )
        else:
            print(f"{key:<26} {value:.3f}")
    return 0


def _cost(args: argparse.Namespace) -> int:
    from fedveil.experiments.ppfl.cost import measure_client_costs, plot_client_costs

    channels, side = (1, 28) if args.data == "fashion-mnist" else (3, 32)
    costs = measure_client_costs(
        args.model,
        channels=channels,
        side=side,
        batch_size=args.batch_size,
        block_size=args.block_size,
        steps=args.steps,
        repeats=args.repeats,
        threads=args.threads,
        progress=not args.json,
    )
    if args.plot is not None:
        title = f"PPFL client cost: {args.model}, {args.steps} step(s) of batch {args.batch_size}"
        plot_client_costs(costs, args.plot, title=title)
    if args.json:
        print(json.dumps([c.as_dict() for c in costs], indent=2))
    return 0


def _transfer(args: argparse.Namespace) -> int:
    from fedveil.experiments.ppfl.runner import load_ppfl_run
    from fedveil.experiments.ppfl.transfer import run_transfer_sweep

    cfg = load_ppfl_run(args.config, None if args.device is None else {"device": args.device})
    out = args.out or Path("runs") / cfg.name
    summary = run_transfer_sweep(
        cfg, out, args.fractions, args.last, progress=None if args.json else print, show_bar=not args.json
    )
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    print(f"E2E FedAvg: {summary['e2e_accuracy']:.4f}")
    for row in summary["runs"]:
        print(
            f"public fraction {row['fraction']:g} ({row['public_samples']} images, alone "
            f"{row['public_accuracy']:.4f}), last {row['train_last']} units: {row['final_accuracy']:.4f}"
        )
    print(f"sweep directory: {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action; the work is in :mod:`fedveil.experiments.ppfl.runner`."""
    if args.action == "memory":
        return _memory(args)
    if args.action == "attacks":
        return _attacks(args)
    if args.action == "lira":
        return _lira(args)
    if args.action == "transfer":
        return _transfer(args)
    if args.action == "cost":
        return _cost(args)
    from fedveil.experiments.ppfl.runner import load_ppfl_run, run_ppfl

    own = {
        "ppfl.rounds_per_stage": args.rounds,
        "threads": args.threads,
        "e2e": False if args.no_e2e else None,
    }
    cfg = load_ppfl_run(args.config, run_overrides(run_sets(args), own))
    out = args.out or Path("runs") / cfg.name
    quiet = args.json
    results = run_ppfl(
        cfg,
        out,
        progress=None if quiet else print,
        show_bar=not (quiet or args.no_progress),
        resume=args.resume,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
        return 0
    for stage in results["stages"]:
        print(
            f"layer stage {stage['stage']} (units {stage['units']}): {stage['rounds']} rounds, accuracy "
            f"{stage['accuracy']}, S_l {stage['tee_bytes_needed'] / 2**20:.1f} MiB, "
            f"{stage['eligible_devices']} devices eligible"
        )
    print(f"run directory: {out}")
    return 0
