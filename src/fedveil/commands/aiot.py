"""``fedveil aiot``: the AIoT private-projector framework.

- ``fedveil aiot run CONFIG [--out DIR] [--set KEY=VALUE ...] [--seed S] [--trials N] [--methods M,...]
  [--json] [--no-progress] [--resume | --overwrite]``:
  Tables 1 and 2 (the pre-trained model, SOLO, centralized, the protocol and its ablations, TAR at FAR
  1e-3 / 1e-4 over trials; :func:`fedveil.experiments.aiot.runner.run_aiot`); ``--resume`` continues (or
  extends, with more trials or methods) the run in its output folder.
- ``fedveil aiot faces [--out DIR] [--epochs E] [--json]``: how hard the synthetic face population is:
  pre-trained on its public domain, evaluated on the private one, fine-tuned there and evaluated again
  (:func:`fedveil.experiments.aiot.faces_domain.measure_domain_gap`), with a grid of sample photos.
- ``fedveil aiot efficiency [--image-size S] [--width W] [--classes N] [--json]`` prints the parameters,
  FLOPs and multiply-accumulates of one example's forward pass, the safetensors size of the network and
  the peak memory of one training step with an ArcFace head over ``N`` identities
  (:func:`fedveil.models.measure.efficiency`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedveil.experiments.checkpoint import add_run_arguments, check_run_dir, run_sets
from fedveil.experiments.config import run_overrides
from fedveil.experiments.report import announce_stand_in


def register(subparsers: Any) -> None:
    """Add the ``aiot`` command with its ``faces`` and ``efficiency`` actions."""
    p = subparsers.add_parser("aiot", help="AIoT face verification with a private projector")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = actions.add_parser("run", help="Tables 1-2: fine-tune with private projectors, TAR@FAR over trials")
    r.add_argument(
        "config", type=Path, help="YAML settings, e.g. configs/aiot/quick.yaml (about a minute) or small.yaml"
    )
    add_run_arguments(r)
    r.add_argument("--trials", type=int, help="trials per method (default: the config's)")
    r.add_argument("--methods", help="comma-separated methods (default: the config's)")
    r.add_argument("--json", action="store_true", help="print results.json (no progress output)")
    f = actions.add_parser("faces", help="the synthetic face population: domain gap, TAR@FAR, samples")
    f.add_argument(
        "--out", type=Path, default=Path("runs/aiot_faces"), help="folder for faces.json, faces.png"
    )
    f.add_argument("--size", type=int, default=64, help="photo side (default 64; the paper: 112)")
    f.add_argument("--width", type=float, default=0.5, help="MobileFaceNet width (default 0.5; the paper: 1)")
    f.add_argument("--epochs", type=int, default=8, help="pre-training epochs (default 8)")
    f.add_argument("--finetune-epochs", type=int, default=8, help="fine-tuning epochs (default 8)")
    f.add_argument("--seed", type=int, default=0, help="seed of the population and the training")
    f.add_argument(
        "--device", default="auto", help="where it trains and embeds: auto (default), cpu, cuda or cuda:N"
    )
    f.add_argument("--json", action="store_true", help="print faces.json (no progress output)")
    e = actions.add_parser("efficiency", help="Table 3: parameters, FLOPs, disk and training memory")
    e.add_argument("--image-size", type=int, default=112, help="input side, a multiple of 16 (default 112)")
    e.add_argument(
        "--width", type=float, default=1.0, help="channel width multiplier (default 1: the paper's)"
    )
    e.add_argument("--classes", type=int, default=1000, help="identities of the ArcFace head (default 1000)")
    e.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _faces(args: argparse.Namespace) -> int:
    from fedveil.core.atomic import atomic_write
    from fedveil.data.faces import sample_grid
    from fedveil.experiments.aiot.faces_domain import FaceDomainRun, measure_domain_gap

    cfg = FaceDomainRun(
        size=args.size,
        width=args.width,
        epochs=args.epochs,
        finetune_epochs=args.finetune_epochs,
        seed=args.seed,
        device=args.device,
    )
    result = measure_domain_gap(cfg, progress=not args.json)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "faces.json", (json.dumps(result, indent=2, sort_keys=True) + "\n").encode())
    sample_grid(args.out / "faces.png", size=args.size, seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    pre, post = result["pretrained_on_public"], result["finetuned_on_private"]
    for label, row in (
        ("pre-trained, public test", pre["public_test"]),
        ("pre-trained, private test", pre["private_test"]),
        ("fine-tuned, private test", post["private_test"]),
    ):
        print(f"{label}: TAR@FAR1e-3 {row['tar_at_far_1e-3']:.3f}, TAR@FAR1e-4 {row['tar_at_far_1e-4']:.3f}")
    print(f"written to {args.out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from fedveil.experiments.aiot.runner import load_aiot_run, run_aiot

    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    overrides = run_overrides(run_sets(args), {"trials": args.trials, "methods": methods})
    cfg = load_aiot_run(args.config, overrides)
    out = args.out or Path("runs") / cfg.name
    check_run_dir(out, resume=args.resume, overwrite=args.overwrite)
    announce_stand_in(
        f"{cfg.public_identities} public and {cfg.private_identities + cfg.test_identities} private "
        "identities of the synthetic face population (fedveil.data.faces), for MS-Celeb-1M and the "
        "paper's private faces",
        quiet=args.json,
    )
    record = run_aiot(
        cfg,
        out,
        progress=not (args.json or args.no_progress),
        resume=args.resume,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
        return 0
    print(f"{record['model']}; {record['data']}")
    print(f"{'method':<14} {'trials':>6}  {'TAR@FAR1e-3':>16}  {'TAR@FAR1e-4':>16}  {'Eq. 5 accuracy':>16}")
    for method, row in record["summary"].items():
        cells = [
            f"{100 * row[k]['mean']:6.2f} +- {100 * row[k]['std']:5.2f}"
            for k in ("tar_at_far_1e-3", "tar_at_far_1e-4", "identification_accuracy")
        ]
        print(f"{method:<14} {row['trials']:>6}  {cells[0]:>16}  {cells[1]:>16}  {cells[2]:>16}")
    print(f"(percent, mean +- std over trials; {record['impostor_pairs']} impostor pairs) written to {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action."""
    if args.action == "faces":
        return _faces(args)
    if args.action == "run":
        return _run(args)
    from fedveil.models.faces import ArcFace, MobileFaceNet
    from fedveil.models.measure import efficiency

    model = MobileFaceNet(image_size=args.image_size, width=args.width)
    row: dict[str, Any] = {
        "model": "mobilefacenet",
        "image_size": args.image_size,
        "width": args.width,
        "embedding_dim": model.embedding_dim,
        "arcface_classes": args.classes,
        **efficiency(model, ArcFace(model.embedding_dim, args.classes), model.input_shape),
    }
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(
        f"MobileFaceNet {args.image_size}x{args.image_size}, width {args.width}: "
        f"{row['parameters']:,} parameters, {row['flops'] / 1e6:.1f} MFLOPs "
        f"({row['macs'] / 1e6:.1f} M multiply-accumulates) per image, "
        f"{row['disk_bytes'] / 2**20:.2f} MiB on disk, "
        f"{row['train_memory_bytes'] / 2**20:.1f} MiB per training step"
    )
    return 0
