"""``fedveil aiot efficiency``: AIoT Table 3 (002_a446963dedd95f77.txt) for MobileFaceNet.

- ``fedveil aiot faces [--out DIR] [--epochs E] [--json]``: how hard the synthetic face population is:
  pre-trained on its public domain, evaluated on the private one, fine-tuned there and evaluated again
  (:func:`fedveil.experiments.faces_domain.measure_domain_gap`), with a grid of sample photos.
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


def register(subparsers: Any) -> None:
    """Add the ``aiot`` command with its ``faces`` and ``efficiency`` actions."""
    p = subparsers.add_parser(
        "aiot", help="AIoT face verification with a private projector (efficiency so far)"
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    f = actions.add_parser("faces", help="the synthetic face population: domain gap, TAR@FAR, samples")
    f.add_argument(
        "--out", type=Path, default=Path("runs/aiot_faces"), help="folder for faces.json, faces.png"
    )
    f.add_argument("--size", type=int, default=64, help="photo side (default 64; the paper: 112)")
    f.add_argument("--width", type=float, default=0.5, help="MobileFaceNet width (default 0.5; the paper: 1)")
    f.add_argument("--epochs", type=int, default=8, help="pre-training epochs (default 8)")
    f.add_argument("--finetune-epochs", type=int, default=8, help="fine-tuning epochs (default 8)")
    f.add_argument("--seed", type=int, default=0, help="seed of the population and the training")
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
    from fedveil.experiments.faces_domain import FaceDomainRun, measure_domain_gap

    cfg = FaceDomainRun(
        size=args.size,
        width=args.width,
        epochs=args.epochs,
        finetune_epochs=args.finetune_epochs,
        seed=args.seed,
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


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action."""
    if args.action == "faces":
        return _faces(args)
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
