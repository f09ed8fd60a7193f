"""``fedveil bench peers``: the same FedAvg task in fedveil, fedveil on Ray, Flower and pfl-research.

The task is :mod:`fedveil.experiments.bench.scale`'s: LeNet (2 conv + 2 FC) on 28 x 28 grayscale images
(real Fashion-MNIST when installed, else its labelled stand-in), ``clients`` clients of ``samples``
images each, ``cohort`` clients a round drawn uniformly without replacement, 1 local epoch of plain SGD
(lr 0.05, batch 10, reshuffled every epoch), FedAvg weighted by sample count; ``rounds`` timed rounds
after one warm-up round, then the test accuracy of the global model.

**One task, written once.** :func:`write_task` writes the task folder every peer reads: the clients'
training data exactly as :func:`~fedveil.experiments.bench.scale.scale_users` partitions it (client ``i``
owns rows ``i * samples`` to ``(i + 1) * samples`` of ``train.npz``), the test set (``test.npz``), the
initial LeNet weights (``initial.safetensors``, fedveil's parameter names) and ``manifest.json``. No
pickle anywhere. fedveil's own rows build the same partition and weights with the same code and seed.

**Who runs where.** fedveil's rows run :func:`~fedveil.experiments.bench.scale.measure_setting` in a fresh
process each: in-process (``fedveil``) and with the clients on ``threads`` Ray actors of one torch thread
(``ray``). The peers run ``benchmarks/peers/<framework>_fedavg.py`` with the python of their own virtual
environment, ``.venv-peers/<framework>`` (:func:`setup_peers`, ``fedveil bench peers --setup``), so they
cannot change the project's pinned torch: Flower 1.42's simulation engine (Ray backend, ``threads``
actors) and pfl-research 0.6's simulated backend (in one process, ``threads`` torch threads).
``device`` (``--device``) is forwarded to fedveil's in-process rows (``fedveil``), whose clients train
there; the peers' environments hold the CPU torch and fedveil's Ray actors are given CPUs only, so those
rows train on the CPU, and asking for another device with ``ray`` among the frameworks is refused before
anything runs (:func:`~fedveil.experiments.bench.scale.check_scale_device`). Every row names its device.

Each row: ``framework``, ``version``, ``engine``, ``clients_per_round``, ``rounds``, ``seconds_per_round``
(median of the timed rounds), ``first_round_seconds`` (the warm-up), ``startup_seconds`` (building the
clients and engine before round 1), ``peak_rss_bytes`` (``ru_maxrss`` of the measured process;
``rss_covers`` says what that leaves out, e.g. Ray actors) and ``accuracy``.

**Cost that does not move with the load.** Wall time per round depends on what else the machine runs, so
each row also has:

- ``cpu_seconds_per_round``: the median over the timed rounds of the CPU seconds (user + system) used by
  the process doing the work and its descendants (Ray's raylet, GCS and actors for fedveil-ray and
  Flower), measured in that process by :func:`~fedveil.experiments.bench.floor.tree_cpu_seconds`, which
  the peer scripts load from this checkout: one measurement for all;
- ``flops_per_round``: FLOPs of the round's training, forward and backward of LeNet over ``cohort x
  samples x local epochs`` examples, counted from the model's layers
  (:func:`~fedveil.experiments.bench.floor.training_flops`; biases, activations, pooling and the optimiser
  step are not counted);
- ``peak_gemm_flops_per_second``: FLOPs per CPU second of a 2048 x 2048 float32 ``torch.matmul`` on
  ``threads`` threads, measured once per run in a fresh process (the same torch as every peer);
- ``fraction_of_floor``: ``flops_per_round / peak_gemm_flops_per_second / cpu_seconds_per_round``, the
  share of the CPU time that the arithmetic at the peak rate would take (1.0: a round all GEMM at peak).
  A fedveil row whose clients train on a GPU is held to the GPU's floor instead: its
  ``peak_gemm_flops_per_second`` is the GPU's (FLOPs per second of wall time, the operands on the GPU)
  and its ``fraction_of_floor`` is ``flops_per_round / peak_gemm_flops_per_second / seconds_per_round``
  (the CPU time of a GPU round measures the host's share of it, not the arithmetic). Every row's
  ``floor_basis`` says which.

Every process of the run (the frameworks' and the peak GEMM's) gets ``OMP_WAIT_POLICY=PASSIVE`` unless
the caller's environment sets it: by default OpenMP's idle threads spin, and on a loaded machine a thread
spins for as long as the one it waits for is descheduled, so CPU time then grows with the load (fedveil
at 10 clients per round, 2 threads, load average 5: 7.9 CPU seconds per round spinning, 0.78 passive,
0.60 on one thread).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.core.atomic import atomic_file, atomic_write
from fedveil.errors import ConfigError
from fedveil.experiments.bench.floor import training_flops
from fedveil.experiments.bench.scale import (
    SCALE_BATCH,
    SCALE_EPOCHS,
    SCALE_LR,
    SCALE_MODEL,
    check_scale_device,
    measure_in_subprocess,
    scale_users,
)
from fedveil.models.device import resolve_device

__all__ = [
    "FRAMEWORKS",
    "PEERS",
    "bench_peers",
    "check_settings",
    "floor_fields",
    "format_table",
    "measure_peak_gemm",
    "peer_python",
    "run_environment",
    "run_peer",
    "setup_peers",
    "write_task",
]

FRAMEWORKS = ("fedveil", "ray", "flower", "pfl")
"""``--frameworks`` names: fedveil in-process, fedveil on Ray, Flower's simulation engine, pfl-research."""

TORCH_PIN = "2.13.0"
"""The project's torch; every peer environment must resolve to exactly this (a CPU build)."""


@dataclass(frozen=True)
class Peer:
    """A peer framework: its script in ``benchmarks/peers`` and the pinned requirements of its venv."""

    script: str
    requirements: tuple[str, ...]


PEERS = {
    "flower": Peer(
        "flower_fedavg.py",
        ("flwr[simulation]==1.42.0", f"torch=={TORCH_PIN}", "numpy==2.4.6", "safetensors==0.8.0"),
    ),
    "pfl": Peer(
        "pfl_fedavg.py",
        ("pfl[pytorch]==0.6.0", f"torch=={TORCH_PIN}", "numpy==2.4.6", "safetensors==0.8.0"),
    ),
}

Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def repo_root() -> Path:
    """The source checkout holding ``benchmarks/peers`` (the peers' scripts are not installed)."""
    root = Path(__file__).resolve().parents[4]
    if not (root / "benchmarks" / "peers").is_dir():
        raise ConfigError(
            f"{root / 'benchmarks' / 'peers'} does not exist: fedveil bench peers runs from a source "
            "checkout of fedveil (pip install -e .)"
        )
    return root


def peer_python(name: str, venvs: Path) -> Path:
    """The python of peer ``name``'s virtual environment, or a :class:`ConfigError` naming the fix."""
    python = venvs / name / "bin" / "python"
    if not python.is_file():
        raise ConfigError(
            f"{name}'s virtual environment {venvs / name} does not exist: create it with "
            f"`fedveil bench peers --setup --frameworks {name}`"
        )
    return python


def check_settings(
    *,
    frameworks: Sequence[str],
    cohorts: Sequence[int],
    rounds: int,
    clients: int,
    samples: int,
    threads: int,
) -> None:
    """Refuse unknown frameworks, cohorts outside ``1..clients`` and counts below 1, naming the value."""
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or not frameworks:
        raise ConfigError(f"frameworks {list(frameworks)}: each must be one of {', '.join(FRAMEWORKS)}")
    for name, value in (("rounds", rounds), ("clients", clients), ("samples", samples), ("threads", threads)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1")
    if not cohorts:
        raise ConfigError("give at least one cohort size (clients per round)")
    for cohort in cohorts:
        if not 1 <= cohort <= clients:
            raise ConfigError(f"cohort {cohort} must lie between 1 and the {clients} clients")


def write_task(
    folder: Path, *, clients: int, samples: int, rounds: int, cohorts: Sequence[int], seed: int
) -> dict[str, Any]:
    """Write the task folder (module docstring) and return its manifest."""
    import torch

    from fedveil.data.images import load_image_dataset
    from fedveil.models.weights import save_weights
    from fedveil.models.zoo import build_model

    users = scale_users(clients, samples, seed)
    test = load_image_dataset("fashion-mnist", "test", seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    _save_npz(
        folder / "train.npz",
        x=np.concatenate([u.arrays["x"] for u in users]),
        y=np.concatenate([u.arrays["y"] for u in users]).astype(np.int64),
    )
    _save_npz(
        folder / "test.npz",
        x=np.ascontiguousarray(test.x, dtype=np.float32),
        y=np.asarray(test.y, dtype=np.int64),
    )
    torch.manual_seed(seed)
    model = build_model(SCALE_MODEL, num_classes=10, in_channels=1, image_size=28, seed=seed)
    save_weights(model, folder / "initial.safetensors")
    manifest = {
        "model": SCALE_MODEL,
        "num_params": sum(p.numel() for p in model.parameters()),
        "training_flops_per_example": training_flops(model, torch.zeros(1, 1, 28, 28)),
        "data": test.name,  # real Fashion-MNIST, or a name that says it is the synthetic stand-in
        "test_size": len(test.y),
        "clients": clients,
        "samples_per_client": samples,
        "rounds": rounds,
        "warmup_rounds": 1,
        "cohorts": list(cohorts),
        "local_epochs": SCALE_EPOCHS,
        "batch_size": SCALE_BATCH,
        "lr": SCALE_LR,
        "optimizer": "sgd (no momentum, no weight decay)",
        "seed": seed,
    }
    atomic_write(folder / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    with atomic_file(path) as fh:
        np.savez(fh, **arrays)


def setup_peers(names: Sequence[str], venvs: Path, progress: Progress = _stderr) -> dict[str, str]:
    """Create ``venvs/<name>`` for each peer in ``names`` with its pinned requirements; returns each
    peer's installed version. A dry run first: torch must resolve to exactly ``TORCH_PIN`` (the CPU
    build on this machine's package index) and no ``nvidia-*`` or ``triton`` wheel may come with it."""
    versions = {}
    for name in names:
        if name not in PEERS:
            raise ConfigError(f"{name!r} has no virtual environment; peers are {', '.join(PEERS)}")
        peer, target = PEERS[name], venvs / name
        python = target / "bin" / "python"
        if not python.is_file():
            progress(f"bench peers --setup: creating {target}")
            _check_call([sys.executable, "-m", "venv", str(target)])
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            progress(f"bench peers --setup: resolving {', '.join(peer.requirements)} (dry run)")
            pip = [str(python), "-m", "pip", "install", "--quiet"]
            _check_call([*pip, "--dry-run", "--report", str(report), *peer.requirements])
            planned = {
                i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]
            }
        heavy = sorted(n for n in planned if n.startswith("nvidia-") or n == "triton")
        torch_version = planned.get("torch") or _installed(python, "torch")
        if heavy or torch_version.split("+")[0] != TORCH_PIN:
            raise ConfigError(
                f"{name}'s requirements resolve to torch {torch_version} with {heavy or 'no'} CUDA wheels; "
                f"only torch {TORCH_PIN} (CPU) is allowed: check the package index before installing"
            )
        progress(f"bench peers --setup: installing into {target}")
        _check_call([*pip, *peer.requirements])
        versions[name] = _installed(python, "flwr" if name == "flower" else name)
    return versions


def _check_call(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"{' '.join(command)} failed: {done.stderr.strip()[-1500:]}")


def _installed(python: Path, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "not installed"


def run_environment() -> dict[str, str]:
    """The environment of every process of a run: this one's, with OpenMP's idle threads asleep
    (``OMP_WAIT_POLICY=PASSIVE``) unless it says otherwise (module docstring)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


def measure_peak_gemm(threads: int, device: str = "cpu") -> float:
    """:func:`~fedveil.experiments.bench.floor.peak_gemm_flops_per_second` per CPU second on ``threads``
    threads, in a fresh process of :func:`run_environment` (OpenMP reads it when torch loads); with a GPU
    ``device`` (``cuda``, ``cuda:N``), per second of wall time on that GPU."""
    clock = "time.process_time" if device == "cpu" else "time.perf_counter"
    code = (
        "import time; from fedveil.experiments.bench.floor import peak_gemm_flops_per_second as peak; "
        f"print(peak({threads}, clock={clock}, device={device!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=run_environment()
    )
    if done.returncode != 0:
        raise ConfigError(f"measuring the peak GEMM rate failed: {done.stderr.strip()[-1500:]}")
    return float(done.stdout)


def run_peer(name: str, task: Path, cohort: int, threads: int, *, venvs: Path) -> dict[str, Any]:
    """Peer ``name``'s script on ``task`` at ``cohort`` clients per round, in a fresh process of its
    venv's python and :func:`run_environment`; returns its JSON row (the last line of its output that
    is a JSON object)."""
    script = repo_root() / "benchmarks" / "peers" / PEERS[name].script
    command = [str(peer_python(name, venvs)), str(script), "--task", str(task), "--cohort", str(cohort)]
    command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=7200, env=run_environment())
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise ConfigError(
            f"{name} at {cohort} clients per round failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-1500:]}"
        )
    return dict(json.loads(lines[-1]))


def _fedveil_row(
    name: str,
    *,
    clients: int,
    samples: int,
    cohort: int,
    rounds: int,
    seed: int,
    threads: int,
    device: str = "cpu",
) -> dict[str, Any]:
    actors = threads if name == "ray" else 0
    row = measure_in_subprocess(
        clients=clients,
        per_round=cohort,
        rounds=rounds,
        samples=samples,
        actors=actors,
        seed=seed,
        threads=threads,
        device=device,
        env=run_environment(),
    )
    from fedveil._version import __version__

    engine = "fedveil simulation, clients in-process"
    if actors:
        engine = f"fedveil simulation, clients on {actors} Ray actors of 1 thread (ray {_version('ray')})"
    row.update(
        framework="fedveil" if name == "fedveil" else "fedveil-ray",
        version=__version__,
        engine=engine,
        threads=threads,
        torch=_version("torch"),
    )
    return row


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def bench_peers(
    *,
    frameworks: Sequence[str] = FRAMEWORKS,
    cohorts: Sequence[int] = (10, 100),
    rounds: int = 30,
    clients: int = 1_000,
    samples: int = 50,
    threads: int = 2,
    seed: int = 0,
    out: Path = Path("runs/bench-peers"),
    venvs: Path | None = None,
    progress: Progress = _stderr,
    device: str = "cpu",
) -> dict[str, Any]:
    """Write the task to ``out/task``, measure the peak GEMM rate, run every framework at every cohort
    size, each in its own process, and write ``out/results.json``; returns ``{"task": manifest, "rows":
    [...], "speedup"}`` where ``speedup[cohort][framework]`` is that framework's seconds per round over
    fedveil's. Every row carries the floor's fields and its device; ``device`` is where fedveil's
    in-process rows train (module docstring)."""
    check_settings(
        frameworks=frameworks,
        cohorts=cohorts,
        rounds=rounds,
        clients=clients,
        samples=samples,
        threads=threads,
    )
    check_scale_device(device, [threads] if "ray" in frameworks else [])
    venvs = venvs or repo_root() / ".venv-peers"
    for name in frameworks:
        if name in PEERS:
            peer_python(name, venvs)
    task = out / "task"
    progress(f"bench peers: writing the task to {task}")
    manifest = write_task(task, clients=clients, samples=samples, rounds=rounds, cohorts=cohorts, seed=seed)
    peak = measure_peak_gemm(threads)
    progress(f"bench peers: peak GEMM {peak / 1e9:.1f} GFLOP per CPU second on {threads} threads")
    gpu = resolve_device(device) if device != "cpu" else None
    gpu_peak = measure_peak_gemm(threads, str(gpu)) if gpu is not None and gpu.type == "cuda" else None
    if gpu_peak is not None:
        progress(f"bench peers: peak GEMM {gpu_peak / 1e9:.1f} GFLOP per second on {gpu}")
    rows = []
    for name in frameworks:
        for cohort in cohorts:
            progress(f"bench peers: {name}, {cohort} of {clients} clients per round, {rounds} + 1 rounds ...")
            started = time.perf_counter()
            if name in PEERS:
                row = {**run_peer(name, task, cohort, threads, venvs=venvs), "device": "cpu"}
            else:
                row = _fedveil_row(
                    name,
                    clients=clients,
                    samples=samples,
                    cohort=cohort,
                    rounds=rounds,
                    seed=seed,
                    threads=threads,
                    device=device,
                )
            if gpu_peak is not None and name not in PEERS:
                row.update(floor_fields(manifest, cohort, row["seconds_per_round"], gpu_peak))
                row["floor_basis"] = f"seconds per round at {gpu}'s peak GEMM per second"
            else:
                row.update(floor_fields(manifest, cohort, row["cpu_seconds_per_round"], peak))
                row["floor_basis"] = "CPU seconds per round at the CPU's peak GEMM per CPU second"
            rows.append(row)
            progress(
                f"bench peers: {name}, {cohort} per round: {row['seconds_per_round']:.3f} s/round, "
                f"{row['cpu_seconds_per_round']:.3f} CPU s/round, {row['fraction_of_floor']:.3f} of the "
                f"floor, accuracy {row['accuracy']:.4f} ({time.perf_counter() - started:.0f} s)"
            )
    result = {"task": manifest, "rows": rows, "speedup": _speedup(rows)}
    atomic_write(out / "results.json", (json.dumps(result, indent=2) + "\n").encode())
    return result


def floor_fields(manifest: dict[str, Any], cohort: int, seconds: float, peak: float) -> dict[str, float]:
    """``flops_per_round``, ``peak_gemm_flops_per_second`` and ``fraction_of_floor`` of a round of
    ``cohort`` clients of the task ``manifest`` that took ``seconds`` (CPU seconds, at ``peak`` FLOPs per
    CPU second; or, for a GPU row, wall seconds at the GPU's ``peak`` FLOPs per second: module
    docstring)."""
    examples = cohort * manifest["samples_per_client"] * manifest["local_epochs"]
    flops = examples * manifest["training_flops_per_example"]
    return {
        "flops_per_round": flops,
        "peak_gemm_flops_per_second": peak,
        "fraction_of_floor": flops / peak / seconds,
    }


def _speedup(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = {r["clients_per_round"]: r["seconds_per_round"] for r in rows if r["framework"] == "fedveil"}
    speedup: dict[str, dict[str, float]] = {}
    for r in rows:
        cohort = r["clients_per_round"]
        if cohort in base and r["framework"] != "fedveil":
            speedup.setdefault(str(cohort), {})[r["framework"]] = r["seconds_per_round"] / base[cohort]
    return speedup


def format_table(result: dict[str, Any]) -> str:
    """The rows as a text table, with the task and fedveil's speed-up over each framework."""
    task = result["task"]
    lines = [
        f"FedAvg {task['model']} on {task['data']}: {task['clients']} clients x {task['samples_per_client']} "
        f"images, {task['rounds']} timed rounds after 1 warm-up, lr {task['lr']}, batch {task['batch_size']}",
        f"{'framework':<12} {'version':<8} {'per round':>9} {'s/round':>8} {'CPU s/round':>11} "
        f"{'of floor':>8} {'first s':>8} {'start-up s':>10} {'peak RSS MiB':>12} {'accuracy':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['framework']:<12} {r['version']:<8} {r['clients_per_round']:>9} "
            f"{r['seconds_per_round']:>8.3f} {r['cpu_seconds_per_round']:>11.3f} "
            f"{r['fraction_of_floor']:>8.3f} {r['first_round_seconds']:>8.2f} {r['startup_seconds']:>10.2f} "
            f"{r['peak_rss_bytes'] / 2**20:>12,.0f} {r['accuracy']:>8.4f}"
        )
    bases = {r.get("floor_basis", "CPU seconds"): r["peak_gemm_flops_per_second"] for r in result["rows"]}
    for basis, peak in bases.items():
        lines.append(
            f"floor: {task['training_flops_per_example'] / 1e6:.1f} MFLOP per example (forward + backward), "
            f"peak GEMM {peak / 1e9:.1f} GFLOP; of floor = {basis}"
        )
    for cohort, others in result["speedup"].items():
        ratios = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in others.items())
        lines.append(f"seconds per round over fedveil's at {cohort} clients per round: {ratios}")
    return "\n".join(lines)
