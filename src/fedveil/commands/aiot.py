"""``fedveil aiot efficiency``: AIoT Table 3 (002_a446963dedd95f77.txt) for MobileFaceNet.

- ``fedveil aiot efficiency [--image-size S] [--width W] [--classes N] [--json]`` prints the parameters,
  FLOPs and multiply-accumulates of one example's forward pass, the safetensors size of the network and
  the peak memory of one training step with an ArcFace head over ``N`` identities
  (:func:`fedveil.models.measure.efficiency`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``aiot`` command with its ``efficiency`` action."""
    p = subparsers.add_parser(
        "aiot", help="AIoT face verification with a private projector (efficiency so far)"
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    e = actions.add_parser("efficiency", help="Table 3: parameters, FLOPs, disk and training memory")
    e.add_argument("--image-size", type=int, default=112, help="input side, a multiple of 16 (default 112)")
    e.add_argument(
        "--width", type=float, default=1.0, help="channel width multiplier (default 1: the paper's)"
    )
    e.add_argument("--classes", type=int, default=1000, help="identities of the ArcFace head (default 1000)")
    e.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure and print."""
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
