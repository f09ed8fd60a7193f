"""Partial participation in FDML at the level of one update: how far is the gradient of the devices that
answered from the gradient of the whole cohort, against how far one cohort's gradient is from another's?

FDML's update (Eq. 2) averages the devices' local gradients ``g_i = dL/dtheta`` through device ``i``'s
embeddings, where ``L`` is Alg. 1's triplet loss over the whole cohort's embeddings (Fig. 2 steps 5-9).
With every device's gradient, ``G = (1/K) sum_i g_i = (1/K) dL/dtheta``. With rate_p < 1 (Alg. 3 line 9)
or upload exceptions (Strategy-UC), only a subset ``S`` arrives and ``G_S = (1/|S|) sum_{i in S} g_i``:
for a uniformly random ``S`` its mean over ``S`` is ``G`` itself, so the partial update is unbiased and
adds only variance. This module measures that variance beside the one that every round has anyway (a
different cohort and different samples), on the synthetic TouchAuth population, at a given model.

For ``draws`` independent draws (each: a phone model and a cohort of ``cohort`` of its devices, 8 samples
each as in training) it computes, with the devices' written-out backward
(:meth:`~fedveil.models.touchauth.TouchAuthNet.group_gradients`) and Alg. 1
(:func:`~fedveil.enclave.triplet.loss_and_derivatives`):

- ``subset``: ``G_S`` for a random ``applied`` of the cohort's devices, against ``G``;
- ``subset_mean``: the mean of ``G_S`` over ``subsets`` random subsets, against ``G`` (the unbiasedness
  check: it tends to 1 as ``subsets`` grows);
- ``other_cohort``: ``G`` of another cohort of the same phone model, against ``G`` (the round-to-round
  noise FDML trains with anyway);
- ``small_cohort``: ``G`` of a cohort of ``applied`` devices of the same phone model, against ``G``.

Each as the mean cosine similarity and the mean relative distance ``|X - G| / |G|``, and, per parameter
tensor, its share of the squared deviation ``|X - G|^2`` (``deviation_share``: where the extra noise
lives) and of ``|G|^2`` (``signal_share``). Run it with
``python -m fedveil.experiments.fdml.partial --config configs/table1_fdml.yaml [--checkpoint RUN_DIR]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import load_checkpoint
from fedveil.experiments.config import ExperimentConfig, load_config
from fedveil.experiments.fdml.runner import EMBEDDING_DIM, build_population
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet

__all__ = ["device_gradients", "gradient_agreement"]


def device_gradients(
    flat: FlatModel, weights: np.ndarray, samples: Sequence[np.ndarray], margin: float, strategy: str
) -> np.ndarray:
    """Each device's FDML local gradient ``(K, P)`` for one cohort: ``samples[i]`` ``(n, 30, 10)`` are
    device ``i``'s; Alg. 1 runs over all ``K * n`` embeddings labelled by device (Fig. 2 steps 3-7)."""
    module = flat.load_into_module(weights)
    n = samples[0].shape[0]
    x = torch.from_numpy(np.concatenate(samples).astype(np.float32)).reshape(-1, 1, 30, 10)
    trace = module.trace(x)
    labels = np.repeat(np.arange(len(samples)), n)
    result = loss_and_derivatives(trace.out.numpy(), labels, margin=margin, strategy=strategy)
    derivatives = torch.from_numpy(np.asarray(result.derivatives, dtype=np.float32))
    rows = torch.arange(x.shape[0])
    return module.group_gradients(trace, rows, derivatives, len(samples)).numpy().astype(np.float64)


def _compare(x: np.ndarray, g: np.ndarray) -> tuple[float, float]:
    norm = float(np.linalg.norm(g))
    return float(x @ g / (np.linalg.norm(x) * norm)), float(np.linalg.norm(x - g) / norm)


def _shares(v: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Each consecutive block's share of ``|v|^2``."""
    squares = np.array([float(b @ b) for b in np.split(v, np.cumsum(sizes)[:-1])])
    return squares / squares.sum()


def gradient_agreement(
    cfg: ExperimentConfig,
    weights: np.ndarray | None = None,
    *,
    cohort: int = 64,
    applied: int = 51,
    draws: int = 20,
    subsets: int = 50,
    seed: int = 0,
) -> dict[str, Any]:
    """The measurements of the module docstring at ``weights`` (default: the config's initial model)."""
    if not 2 <= applied <= cohort:
        raise ConfigError(f"applied {applied} must be between 2 and the cohort size {cohort}")
    if draws < 1 or subsets < 1:
        raise ConfigError(f"draws {draws} and subsets {subsets} must be >= 1")
    population = build_population(cfg)
    torch.manual_seed(cfg.seed)
    flat = FlatModel(TouchAuthNet(EMBEDDING_DIM))
    w = flat.initial() if weights is None else np.asarray(weights, dtype=np.float32)
    if w.shape != (flat.num_params,):
        raise ConfigError(f"weights of shape {w.shape}; the TouchAuth network has {flat.num_params} values")
    n, margin, strategy = cfg.fdml.samples_per_client, cfg.fdml.margin, cfg.fdml.strategy
    models = [m for m in population.phone_models if len(population.train_user_ids(m)) >= 2 * cohort]
    if not models:
        raise ConfigError(f"no phone model has the {2 * cohort} training users two disjoint cohorts need")
    rng = np.random.default_rng(seed)
    found: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("subset", "subset_mean", "other_cohort", "small_cohort")
    }
    shares: dict[str, list[np.ndarray]] = {"signal": [], "subset": [], "other_cohort": [], "small_cohort": []}
    for _ in range(draws):
        members = population.train_user_ids(models[int(rng.integers(len(models)))])
        order = rng.permutation(len(members))
        first = [members[i] for i in order[:cohort]]
        second = [members[i] for i in order[cohort : 2 * cohort]]
        small = [members[i] for i in rng.choice(len(members), size=applied, replace=False)]

        def gradients(ids: list[str]) -> np.ndarray:
            return device_gradients(
                flat, w, [population.sample_training(c, n, rng) for c in ids], margin, strategy
            )

        per_device = gradients(first)
        full = per_device.mean(axis=0)
        picks = [rng.choice(cohort, size=applied, replace=False) for _ in range(subsets)]
        partial = [per_device[p].mean(axis=0) for p in picks]
        other, smaller = gradients(second).mean(axis=0), gradients(small).mean(axis=0)
        found["subset"].append(_compare(partial[0], full))
        found["subset_mean"].append(_compare(np.mean(partial, axis=0), full))
        found["other_cohort"].append(_compare(other, full))
        found["small_cohort"].append(_compare(smaller, full))
        shares["signal"].append(_shares(full, flat.sizes))
        for key, x in (("subset", partial[0]), ("other_cohort", other), ("small_cohort", smaller)):
            shares[key].append(_shares(x - full, flat.sizes))
    report: dict[str, Any] = {
        "cohort": cohort,
        "applied": applied,
        "draws": draws,
        "subsets": subsets,
        "seed": seed,
    }
    for key, pairs in found.items():
        cos, dist = np.array(pairs).T
        report[key] = {
            "cosine": float(cos.mean()),
            "cosine_std": float(cos.std(ddof=1)) if draws > 1 else 0.0,
            "relative_distance": float(dist.mean()),
            "relative_distance_std": float(dist.std(ddof=1)) if draws > 1 else 0.0,
        }

    def by_name(rows: list[np.ndarray]) -> dict[str, float]:
        return dict(zip(flat.names, np.mean(rows, axis=0).tolist(), strict=True))

    report["signal_share"] = by_name(shares.pop("signal"))
    for key, rows in shares.items():
        report[key]["deviation_share"] = by_name(rows)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedveil.experiments.fdml.partial``: print the JSON report."""
    p = argparse.ArgumentParser(prog="python -m fedveil.experiments.fdml.partial", description=__doc__)
    p.add_argument("--config", type=Path, default=Path("configs/table1_fdml.yaml"), help="FDML config")
    p.add_argument("--checkpoint", type=Path, default=None, help="a run directory: its checkpoint's model")
    p.add_argument("--cohort", type=int, default=64, help="participants per round (default 64)")
    p.add_argument("--applied", type=int, default=51, help="gradients applied (default 51 = 0.8 x 64)")
    p.add_argument("--draws", type=int, default=20, help="independent cohorts (default 20)")
    p.add_argument("--subsets", type=int, default=50, help="random subsets per cohort (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    weights = None
    if args.checkpoint is not None:
        ckpt = load_checkpoint(args.checkpoint)
        if ckpt is None:
            raise SystemExit(f"no checkpoint.npz in {args.checkpoint}")
        weights = ckpt.arrays["weights"]
    report = gradient_agreement(
        cfg,
        weights,
        cohort=args.cohort,
        applied=args.applied,
        draws=args.draws,
        subsets=args.subsets,
        seed=args.seed,
    )
    if args.checkpoint is not None:
        report["checkpoint"] = {"run": str(args.checkpoint), "round": ckpt.round}
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
