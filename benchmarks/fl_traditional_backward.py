"""FL-traditional's local step with the written-out backward against ``vmap`` autograd, side by side.

``python benchmarks/fl_traditional_backward.py [--reps 7] [--run-rounds 0] [--run-reps 3]`` builds the
devices of ``configs/table1_fl_lr0.1.yaml`` (one torch thread, the heap setting of ``fedveil run``) twice:
:class:`~fedveil.protocols.fedavg.FedAvgClients` as ``fedveil run`` builds it (one-step cohorts through
``FedAvgClients._traced_sgd_step``, FDML Sec. VIII-B1's baseline) and with ``written_backward=False``
(``vmap`` over per-device autograd, what ran before). It times one round's local training, the
``handle_batch`` call for 64 devices of one phone model x 8 samples from the same weights, for each in
turn, ``--reps`` times, and prints the medians, their ratio and the largest difference between the two
variants' new weights (both draw the same samples: their device generators advance alike).

With ``--run-rounds N`` it also runs the whole experiment (``fedveil run`` with ``rounds=N``,
``runtime.threads=1``, evaluation only after the last round) ``--run-reps`` times per variant, each in a
fresh process and the variants interleaved, and reports the median rounds/s as ``fedveil run`` prints it
(training and the final evaluation) and the median time of one round (``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedveil.core.heap import retain_freed_memory
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import build_clients, build_population
from fedveil.protocols.fedavg import FedAvgClients
from fedveil.protocols.messages import TrainRequest

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "table1_fl_lr0.1.yaml"

RUN = """
import functools, json, sys
import fedveil.experiments.fdml.runner as runner
from fedveil.experiments.config import load_config
if sys.argv[1] == "vmap":
    runner.FedAvgClients = functools.partial(runner.FedAvgClients, written_backward=False)
rounds = int(sys.argv[3])
cfg = load_config(sys.argv[2], [f"rounds={rounds}", "runtime.threads=1", f"eval.every={rounds}"])
results = runner.run_experiment(cfg, sys.argv[4], progress=False)
lines = [json.loads(s) for s in open(sys.argv[4] + "/metrics.jsonl")]
per_round = sorted(x["real_seconds"] for x in lines if "round" in x and "real_seconds" in x)
print(json.dumps({"rounds_per_second": results["rounds_per_second"],
                  "round_seconds_median": per_round[len(per_round) // 2]}))
"""


def client_call(reps: int) -> dict[str, object]:
    """Median seconds of one 64 x 8 cohort's local training by each path, interleaved."""
    torch.set_num_threads(1)
    retain_freed_memory()
    cfg = load_config(CONFIG, ["runtime.threads=1"])
    population = build_population(cfg)
    fast = build_clients(cfg, population)
    slow = FedAvgClients(
        population, fast.flat, attributes=fast.attributes, seed=cfg.seed, written_backward=False
    )
    assert fast.written_backward and not slow.written_backward
    phone = {}
    for cid in fast.ids:
        phone.setdefault(fast.attributes[cid]["phone_model"], []).append(cid)
    devices = max(phone.values(), key=len)[: cfg.fedavg.clients_per_round]
    weights = fast.flat.initial()
    request = TrainRequest(1, cfg.fedavg.lr, cfg.fedavg.samples_per_client, 1, weights)
    msgs = {cid: request for cid in devices}
    times: dict[str, list[float]] = {"written_backward": [], "vmap": []}
    diff = 0.0
    for rep in range(reps + 1):  # the first pass is a warm-up (the devices' data are generated lazily)
        new = {}
        for name, pool in (("written_backward", fast), ("vmap", slow)):
            t0 = time.perf_counter()
            new[name] = pool.handle_batch(msgs)
            if rep:
                times[name].append(time.perf_counter() - t0)
        for cid in msgs:
            gap = np.abs(new["written_backward"][cid].weights - new["vmap"][cid].weights)
            diff = max(diff, float(gap.max()))
    fast_s, slow_s = statistics.median(times["written_backward"]), statistics.median(times["vmap"])
    return {
        "devices": len(devices),
        "samples_per_device": cfg.fedavg.samples_per_client,
        "params": fast.flat.num_params,
        "written_backward_seconds": fast_s,
        "vmap_seconds": slow_s,
        "speedup": slow_s / fast_s,
        "max_abs_weight_difference": diff,
        "runs": times,
    }


def whole_runs(rounds: int, reps: int) -> dict[str, object]:
    """``fedveil run`` of the config, ``rounds`` rounds, fresh processes, the variants interleaved."""
    found: dict[str, list[dict[str, float]]] = {"written_backward": [], "vmap": []}
    for _ in range(reps):
        for name in found:
            with tempfile.TemporaryDirectory() as out:
                done = subprocess.run(
                    [sys.executable, "-c", RUN, name, str(CONFIG), str(rounds), out],
                    capture_output=True,
                    text=True,
                    check=True,
                )
            found[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{name}: {found[name][-1]}", file=sys.stderr)
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in found.items()
    }
    return {
        "rounds": rounds,
        **medians,
        "speedup_rounds_per_second": medians["written_backward"]["rounds_per_second"]
        / medians["vmap"]["rounds_per_second"],
        "speedup_round_seconds": medians["vmap"]["round_seconds_median"]
        / medians["written_backward"]["round_seconds_median"],
        "runs": found,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed client calls per variant (default 7)")
    parser.add_argument(
        "--run-rounds", type=int, default=0, help="rounds of each whole run (default 0: none)"
    )
    parser.add_argument("--run-reps", type=int, default=3, help="whole runs per variant (default 3)")
    args = parser.parse_args()
    report: dict[str, object] = {"client_call": client_call(args.reps)}
    if args.run_rounds:
        report["whole_run"] = whole_runs(args.run_rounds, args.run_reps)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
