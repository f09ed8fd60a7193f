"""Seconds per FDML round and the host's wait on the enclave's steps 5 and 9, block by block as training goes.

``python benchmarks/fdml_steps.py [--blocks 8] [--rounds 10] [--threads 2] [--set KEY=VALUE ...]`` trains
the paper's TouchAuth setting (64 participants x 8 samples, enclave in its own process, two torch threads
by default) and prints, for each block of ``--rounds`` rounds: seconds per round, the median time of the
host's call into the enclave for step 5 (``EnclaveHost.loss_and_derivatives``: the records' opening,
Alg. 1, the derivatives' sealing, and the pipe) and for step 9 (``EnclaveHost.aggregate``: the gradients
through the shared region, their opening and Eq. 2; where the round streams its gradients into the enclave
as they arrive, ``AggregateStream.finish``: the wait for the requests still running and the final one),
and the median number of active triplets.

Alg. 1's cost depends on the embeddings: from the initial model every valid triplet is active; after
some 30-50 rounds part of them fall inactive and step 5 settles at its long-run cost, which is why
``fedveil bench rounds`` times its blocks after ``--warmup`` rounds. To compare two commits side by side,
check the other one out with ``git worktree add /tmp/base <commit>`` and run this script with
``PYTHONPATH=/tmp/base/src`` (the enclave process inherits it), alternating the two.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import torch

import fedveil.runtime.enclave_host as enclave_host
from fedveil.core.heap import retain_freed_memory
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import build_population, build_trainer


def _timed(calls: dict[str, list[float]], cls: type, name: str, key: str) -> None:
    """Wrap ``cls.<name>`` so that each call's seconds are appended to ``calls[key]``."""
    inner = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            calls.setdefault(key, []).append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks of rounds (default 8)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per block (default 10)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the host (default 2)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    calls: dict[str, list[float]] = {}
    _timed(calls, enclave_host.EnclaveHost, "loss_and_derivatives", "step 5")
    # step 9 is streamed where the host has a stream: the wait is then only for the final request
    _timed(calls, enclave_host.EnclaveHost, "aggregate", "step 9")
    if hasattr(enclave_host, "AggregateStream"):
        _timed(calls, enclave_host.AggregateStream, "finish", "step 9")
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    cfg = load_config(None, ["protocol=fdml", "enclave.boundary=process", *args.overrides])
    trainer = build_trainer(cfg, build_population(cfg))

    async def go() -> None:
        await trainer.server.register(trainer.runtime)
        print("rounds   s/round  step 5 (s)  step 9 (s)  active triplets")
        for block in range(args.blocks):
            calls.clear()
            active = []
            start = time.perf_counter()
            first = block * args.rounds
            for rnd in range(first, first + args.rounds):
                report = await trainer.server.run_round(rnd, trainer.runtime)
                active.append(report.as_dict()["active_triplets"])
            per_round = (time.perf_counter() - start) / args.rounds
            five = statistics.median(calls["step 5"])
            nine = statistics.median(calls["step 9"])
            print(
                f"{first:>3}-{first + args.rounds - 1:<3} {per_round:8.4f} {five:11.4f} {nine:11.4f} "
                f"{int(statistics.median(active)):>16,}"
            )

    try:
        asyncio.run(go())
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
