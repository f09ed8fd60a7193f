"""FedAvg of the ``fedveil bench peers`` task in Flower's simulation engine (Flower 1.42, Message API).

Run with the Flower virtual environment's python (``fedveil bench peers --setup`` makes it)::

    .venv-peers/flower/bin/python benchmarks/peers/flower_fedavg.py --task runs/bench-peers/task --cohort 100

A ``ServerApp`` runs Flower's :class:`flwr.serverapp.strategy.FedAvg` (``fraction_train`` and
``min_train_nodes`` give exactly ``--cohort`` nodes a round, drawn uniformly without replacement; no
federated evaluation); a ``ClientApp`` trains with ``@app.train()``: it loads the received arrays into the
task's LeNet, trains its partition (node ``partition-id``) for the task's epochs with plain SGD, reshuffled
every epoch by a generator seeded from (seed, partition, round), and replies with its arrays and
``num-examples``, by which FedAvg weights the average. ``flwr.simulation.run_simulation`` runs one
SuperNode per client on the Ray backend: ``--threads`` actors of one CPU and one torch thread each, while
the ServerApp runs in this process.

Start-up is from calling ``run_simulation`` to the strategy's first step; Flower starts Ray and its actors
concurrently with the ServerApp, so most of their start-up lands in the warm-up round
(``first_round_seconds``). Round times are the intervals between the strategy's per-round
``evaluate_fn`` calls; the final model is scored on the test set there, after the last stamp. CPU seconds
cover this process and its descendants (Ray's raylet, GCS and the actors that train the clients); peak
RSS is this process's only: the Ray actors are not included.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import time
from typing import Any

import numpy as np
import torch
from peer_task import evaluate, open_task, parse_args, row, train_local, tree_cpu_seconds


def train_client(msg: Any, context: Any) -> Any:
    """The ClientApp's ``train``: local training of this node's partition on the received arrays."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    config = msg.content["config"]
    torch.set_num_threads(1)
    task = open_task(str(config["task"]))
    index = int(context.node_config["partition-id"])
    model = task.scratch_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = task.client(index)
    rng = np.random.default_rng([task.seed, index, int(config["server-round"])])
    loss = train_local(model, x, y, rng, lr=task.lr, batch_size=task.batch_size, epochs=task.local_epochs)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(x), "train-loss": loss}),
        }
    )
    return Message(content=content, reply_to=msg)


def main() -> None:
    """Train the task with Flower's simulation engine and print the row."""
    args, task = parse_args("FedAvg of the fedveil bench peers task in Flower's simulation engine")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    torch.set_num_threads(args.threads)
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    accuracy: list[float] = []
    model = task.initial_model()

    def clock(server_round: int, arrays: ArrayRecord) -> None:
        """Stamp the end of a round (round 0: the start); score the final model after the last one."""
        stamps.append(time.perf_counter())
        cpu_stamps.append(tree_cpu_seconds())
        if server_round == task.rounds + 1:
            model.load_state_dict(arrays.to_torch_state_dict())
            accuracy.append(evaluate(model, *task.test()))

    server = ServerApp()

    @server.main()
    def run_server(grid: Grid, context: Context) -> None:
        random.seed(task.seed + 1)  # FedAvg samples nodes with random.sample
        strategy = FedAvg(
            fraction_train=args.cohort / task.clients,
            fraction_evaluate=0.0,
            min_train_nodes=args.cohort,
            min_available_nodes=task.clients,
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=task.rounds + 1,
            train_config=ConfigRecord({"task": str(task.folder.resolve())}),
            evaluate_fn=clock,
        )

    client = ClientApp()
    client.train()(train_client)
    started = time.perf_counter()
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=task.clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": args.threads},
        },
    )
    if len(accuracy) != 1:
        raise SystemExit(f"Flower's simulation ended after {len(stamps) - 1} of {task.rounds + 1} rounds")
    result = row(
        framework="flower",
        version=importlib.metadata.version("flwr"),
        engine=f"Flower simulation engine, Ray backend with {args.threads} actors of 1 CPU",
        task=task,
        cohort=args.cohort,
        threads=args.threads,
        startup=stamps[0] - started,
        round_seconds=[float(s) for s in np.diff(stamps)],
        round_cpu_seconds=[float(s) for s in np.diff(cpu_stamps)],
        accuracy=accuracy[0],
        rss_covers="this process only (the ServerApp and the engine; Ray actors not included)",
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
