"""FDML Alg. 1 of this checkout against another version of ``fedveil/enclave/triplet.py``, side by side.

``git show REV:src/fedveil/enclave/triplet.py > /tmp/triplet_base.py``, then ``python
benchmarks/triplet_against.py --base-file /tmp/triplet_base.py [--participants 512] [--samples 8]
[--dim 64] [--reps 7]`` times :func:`loss_and_derivatives` of both modules in this one process on float32
embeddings of three kinds: ``synthetic`` (``fedveil bench enclave``'s clustered unit vectors, spread
0.5), ``tight`` (spread 0.1, like a trained network's outputs: every positive pair is close, so its
terms take the exact path) and ``copies`` (spread 0.3, and two of each participant's samples equal, as
a network whose outputs saturate gives: each copy's pairs all take the exact path). Calls alternate
base, now, base, now, ... on one BLAS thread; it prints, per kind, the median wall and CPU seconds
(``time.process_time``) of each, the ratio of the medians and the median of the per-pair CPU ratios,
and the largest difference between the two modules' derivatives relative to the largest derivative.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from fedveil.enclave import triplet


def load(path: Path) -> ModuleType:
    """The module in ``path``, loaded under its own name beside the installed one."""
    spec = importlib.util.spec_from_file_location("triplet_base", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def embeddings(kind: str, participants: int, samples: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded float32 unit vectors around per-participant centres, and their labels."""
    spread = {"synthetic": 0.5, "tight": 0.1, "copies": 0.3}[kind]
    rng = np.random.default_rng(0)
    centres = rng.normal(0.0, 1.0, (participants, 1, dim))
    x = centres + spread * rng.normal(0.0, 1.0, (participants, samples, dim))
    if kind == "copies":
        x[:, 1] = x[:, 0]
    x = x.reshape(-1, dim) / np.linalg.norm(x.reshape(-1, dim), axis=1, keepdims=True)
    return x.astype(np.float32), np.repeat(np.arange(participants), samples)


def timed(module: ModuleType, x: np.ndarray, y: np.ndarray) -> tuple[float, float, Any]:
    start, start_cpu = time.perf_counter(), time.process_time()
    result = module.loss_and_derivatives(x, y, margin=1.0, strategy="batch-all")
    return time.perf_counter() - start, time.process_time() - start_cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-file", type=Path, required=True, help="the other version of triplet.py")
    parser.add_argument("--participants", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    base = load(args.base_file)
    rows = []
    with threadpool_limits(limits=1, user_api="blas"):
        for kind in ("synthetic", "tight", "copies"):
            x, y = embeddings(kind, args.participants, args.samples, args.dim)
            got: dict[str, list[tuple[float, float, Any]]] = {"base": [], "now": []}
            for module in (base, triplet):  # warm-up
                timed(module, x, y)
            for _ in range(args.reps):
                for name, module in (("base", base), ("now", triplet)):
                    got[name].append(timed(module, x, y))
            med = {n: [statistics.median(r[k] for r in got[n]) for k in (0, 1)] for n in got}
            old, new = got["base"][0][2], got["now"][0][2]
            scale = float(np.max(np.abs(old.derivatives)))
            rows.append(
                {
                    "kind": kind,
                    "embeddings": int(x.shape[0]),
                    "dim": args.dim,
                    "active_fraction": new.num_active / new.num_valid,
                    "base_seconds": med["base"][0],
                    "now_seconds": med["now"][0],
                    "base_cpu_seconds": med["base"][1],
                    "now_cpu_seconds": med["now"][1],
                    "cpu_ratio_of_medians": med["base"][1] / med["now"][1],
                    "cpu_ratio_per_pair_median": statistics.median(
                        b[1] / n[1] for b, n in zip(got["base"], got["now"], strict=True)
                    ),
                    "max_rel_diff": float(np.max(np.abs(new.derivatives - old.derivatives))) / scale,
                    "same_loss_and_counts": (old.loss, old.num_active) == (new.loss, new.num_active),
                }
            )
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
