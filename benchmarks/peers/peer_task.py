"""What every peer script of ``fedveil bench peers`` shares: the task folder, the model, the row.

The task folder (written by :func:`fedveil.experiments.bench.peers.write_task`) holds

- ``manifest.json``: clients, samples per client, timed rounds, lr, batch size, local epochs, seed, data;
- ``train.npz``: ``x`` (clients * samples, 1, 28, 28) float32 and ``y`` int64; client ``i`` owns rows
  ``i * samples`` to ``(i + 1) * samples`` (fedveil's partition, copied out);
- ``test.npz``: the test images and labels;
- ``initial.safetensors``: the initial LeNet weights (fedveil's parameter names).

This module needs only numpy, torch and safetensors, so it runs in any peer's virtual environment. Every
script trains ``rounds`` timed rounds after one warm-up round and prints one JSON row (:func:`row`). CPU
time is fedveil's own measurement (:func:`tree_cpu_seconds`, from ``fedveil.experiments.bench.floor``,
loaded by path from this checkout: it needs only the standard library), so every framework's CPU seconds
per round are counted alike. ``fedveil bench peers`` runs the scripts with ``OMP_WAIT_POLICY=PASSIVE``
(spinning OpenMP threads would count the machine's load as CPU time); set it too when running one by hand.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

__all__ = [
    "LeNet",
    "Task",
    "evaluate",
    "open_task",
    "parse_args",
    "peak_rss_bytes",
    "row",
    "train_local",
    "tree_cpu_seconds",
]


def _floor_module() -> Any:
    path = Path(__file__).resolve().parents[2] / "src" / "fedveil" / "experiments" / "bench" / "floor.py"
    spec = importlib.util.spec_from_file_location("fedveil_bench_floor", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path} does not exist: run the peer scripts from a fedveil source checkout")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tree_cpu_seconds = _floor_module().tree_cpu_seconds
"""CPU seconds of this process, its live descendants (Ray's actors) and its reaped ones, so far."""


class LeNet(nn.Module):
    """fedveil's zoo ``lenet`` in plain torch, with the same parameter names and order:
    conv 5x5 (20) + ReLU + max-pool, conv 5x5 (50) + ReLU + max-pool, FC 500 + ReLU, FC ``num_classes``."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.units = nn.ModuleList(
            [
                nn.Sequential(nn.Conv2d(1, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
                nn.Sequential(nn.Conv2d(20, 50, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
                nn.Sequential(nn.Flatten(), nn.Linear(50 * 7 * 7, 500), nn.ReLU()),
                nn.Sequential(nn.Linear(500, num_classes)),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` of images ``(B, 1, 28, 28)``."""
        for unit in self.units:
            x = unit(x)
        return x


class Task:
    """The task folder ``folder`` (module docstring); its arrays are read once per process."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        manifest = self.folder / "manifest.json"
        if not manifest.is_file():
            raise SystemExit(f"{manifest} does not exist: write the task with `fedveil bench peers` first")
        self.manifest: dict[str, Any] = json.loads(manifest.read_text())
        self.clients = int(self.manifest["clients"])
        self.samples = int(self.manifest["samples_per_client"])
        self.rounds = int(self.manifest["rounds"])
        self.lr = float(self.manifest["lr"])
        self.batch_size = int(self.manifest["batch_size"])
        self.local_epochs = int(self.manifest["local_epochs"])
        self.seed = int(self.manifest["seed"])
        self._scratch: LeNet | None = None

    def initial_model(self) -> LeNet:
        """A LeNet holding the task's initial weights."""
        model = LeNet()
        model.load_state_dict(load_file(str(self.folder / "initial.safetensors")))
        return model

    def scratch_model(self) -> LeNet:
        """One LeNet per process to load received weights into (a client need not build its own)."""
        if self._scratch is None:
            self._scratch = LeNet()
        return self._scratch

    def preload(self) -> None:
        """Read the training arrays now (part of start-up) rather than at the first client."""
        _arrays(str(self.folder / "train.npz"))

    def client(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``index``'s images and labels (views into the training arrays, loaded once)."""
        x, y = _arrays(str(self.folder / "train.npz"))
        rows = slice(index * self.samples, (index + 1) * self.samples)
        return x[rows], y[rows]

    def test(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The test images and labels."""
        return _arrays(str(self.folder / "test.npz"))


@functools.lru_cache(maxsize=4)
def open_task(folder: str) -> Task:
    """The :class:`Task` of ``folder``, read once per process (for code that runs once per client)."""
    return Task(folder)


@functools.lru_cache(maxsize=2)
def _arrays(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path, allow_pickle=False) as npz:
        return torch.from_numpy(npz["x"]), torch.from_numpy(npz["y"])


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    rng: np.random.Generator,
    *,
    lr: float,
    batch_size: int,
    epochs: int,
) -> float:
    """fedveil's local training in plain torch: ``epochs`` passes over ``(x, y)``, reshuffled by ``rng``
    every epoch, in batches of ``batch_size`` (the last may be smaller), a plain SGD step on the mean
    cross-entropy of each batch. Returns the mean training loss over the steps."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(x)))
        for start in range(0, len(x), batch_size):
            idx = order[start : start + batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return sum(losses) / len(losses)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
    """Test accuracy as fedveil's ``evaluate_model`` computes it (eval mode, no gradients)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start : start + batch_size])
            correct += int((logits.argmax(dim=1) == y[start : start + batch_size]).sum())
    return correct / len(x)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parse_args(description: str) -> tuple[argparse.Namespace, Task]:
    """``--task DIR --cohort N --threads T`` and the task, the cohort checked against its clients."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", required=True, help="the task folder written by `fedveil bench peers`")
    parser.add_argument("--cohort", type=int, required=True, help="clients per round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (default 2)")
    args = parser.parse_args()
    task = Task(args.task)
    if not 1 <= args.cohort <= task.clients:
        parser.error(f"--cohort {args.cohort} must lie between 1 and the task's {task.clients} clients")
    if args.threads < 1:
        parser.error(f"--threads {args.threads} must be >= 1")
    return args, task


def row(
    *,
    framework: str,
    version: str,
    engine: str,
    task: Task,
    cohort: int,
    threads: int,
    startup: float,
    round_seconds: list[float],
    round_cpu_seconds: list[float],
    accuracy: float,
    rss_covers: str,
) -> dict[str, Any]:
    """The JSON row of one run: ``round_seconds`` (wall) and ``round_cpu_seconds`` (:func:`tree_cpu_seconds`
    differences) hold every round, the warm-up round first."""
    for timed in (round_seconds, round_cpu_seconds):
        if len(timed) != task.rounds + 1:
            raise RuntimeError(f"timed {len(timed)} rounds, expected {task.rounds + 1} (with warm-up)")
    per = statistics.median(round_seconds[1:])
    return {
        "framework": framework,
        "version": version,
        "engine": engine,
        "clients": task.clients,
        "clients_per_round": cohort,
        "rounds": task.rounds,
        "threads": threads,
        "seconds_per_round": per,
        "rounds_per_second": 1.0 / per,
        "cpu_seconds_per_round": statistics.median(round_cpu_seconds[1:]),
        "first_round_seconds": round_seconds[0],
        "startup_seconds": startup,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_covers": rss_covers,
        "accuracy": accuracy,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
