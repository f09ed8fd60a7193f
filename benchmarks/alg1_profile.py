"""Where FDML Alg. 1's time goes on ``fedveil bench enclave``'s synthetic and trained embeddings.

``python benchmarks/alg1_profile.py [--participants 512] [--samples 8] [--repeats 5] [--seed 0]`` draws
the embeddings of both sources of :mod:`fedveil.experiments.bench.enclave` as ``fedveil bench enclave``
does for its first participant count (the trained ones after the same short FDML run: 60 rounds of
64 x 8 at lr 3e-3), and prints as JSON, per source, on one BLAS thread: the median CPU seconds
(``time.process_time``) of ``repeats`` calls of :func:`loss_and_derivatives` (batch-all, margin 1)
after one warm-up, the share of valid triplets that are active, how many pairs take the exact path
(``_Computation._scatter_pairs``: pairs close against their squared norms, or duplicated), the
embeddings' mean norm and its coefficient of variation, and the cumulative seconds per call of the
ten most expensive functions of ``fedveil/enclave/triplet.py`` under cProfile (``repeats`` more calls).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from fedveil.enclave import triplet
from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.experiments.bench.enclave import SYNTHETIC, TrainedEmbeddings


def profile(x: np.ndarray, labels: np.ndarray, repeats: int) -> dict[str, Any]:
    """The figures of one set of embeddings (module docstring)."""
    exact = [0]
    scatter = triplet._Computation._scatter_pairs

    def counted(self: Any, i: np.ndarray, *args: Any, **kwargs: Any) -> None:
        exact[0] += i.size
        scatter(self, i, *args, **kwargs)

    triplet._Computation._scatter_pairs = counted  # type: ignore[method-assign]
    try:
        result = loss_and_derivatives(x, labels, margin=1.0)
    finally:
        triplet._Computation._scatter_pairs = scatter  # type: ignore[method-assign]
    cpu = []
    for _ in range(repeats):
        start = time.process_time()
        loss_and_derivatives(x, labels, margin=1.0)
        cpu.append(time.process_time() - start)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        loss_and_derivatives(x, labels, margin=1.0)
    prof.disable()
    table = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    parts = {
        name: ct / repeats
        for (path, _, name), (_, _, _, ct, _) in table.items()
        if path.replace("\\", "/").endswith("enclave/triplet.py")
    }
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    return {
        "cpu_seconds": statistics.median(cpu),
        "active_fraction": result.active_fraction,
        "exact_path_pairs": exact[0],
        "pairs": x.shape[0] ** 2,
        "norm_mean": float(norms.mean()),
        "norm_cv": float(norms.std() / norms.mean()),
        "cumulative_seconds": {k: parts[k] for k in sorted(parts, key=lambda k: -parts[k])[:10]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--participants", type=int, default=512, help="participants (default 512)")
    parser.add_argument("--samples", type=int, default=8, help="embeddings per participant (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed and profiled calls (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    args = parser.parse_args()
    out = {}
    with threadpool_limits(limits=1, user_api="blas"):
        for source in (SYNTHETIC, TrainedEmbeddings()):
            x, labels = source(args.participants, args.samples, 64, np.random.default_rng(args.seed))
            out[source.name] = profile(x, labels, args.repeats)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
