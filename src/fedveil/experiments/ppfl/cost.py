"""``fedveil ppfl cost``: PPFL Fig. 3, a client's cost of training steps with and without the TEE.

For every stage of a model (and for end-to-end training of the whole model, Fig. 3's dashed line) a
fresh process measures ``steps`` local training steps of one client, ``repeats`` times:

- ``without TEE``: the REE runs the frozen layers on the batch (model partitioned execution) and trains
  the stage's layers and classifier with :func:`~fedveil.protocols.local.local_train`, in the clear;
- ``with TEE``: the same, through :class:`~fedveil.protocols.ppfl.ClientTee`: ``theta_l`` opened from
  the record the server's enclave sealed to this client, trained, and sealed back with the loss.
- ``E2E``: the whole model, one step per batch, in the clear.

CPU time is ``getrusage(RUSAGE_SELF)`` user + system seconds over the measured block, as the paper
measures it (median over the repeats, after one warm-up block); memory is the process's maximum
resident set size (``ru_maxrss``) at the end, and its increase over the same process just before the
warm-up (the training's own allocations, without the interpreter, torch and the data). The paper adds
the TEE's allocation (``mdbg_check``) to the REE's RSS; our emulated client TEE lives in the REE's
process, so RSS holds both. The server's enclave, which seals ``theta_l`` for the TEE path, runs in
its own process, so that the client's figures do not include it.

**What the overhead measures here:** the emulation's AES-GCM opening and sealing of ``theta_l`` and its
copies, once per round however many steps the round has, not TrustZone's world switches or
secure-memory allocation (the paper's 15% CPU / 18% memory). ``steps=1`` is the paper's "one step";
a Table 3 round is 70 steps (100 examples, batch 16, 10 epochs).
"""

from __future__ import annotations

import multiprocessing
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.errors import ConfigError

__all__ = ["ClientCost", "measure_client_costs", "plot_client_costs"]

MODES = ("plain", "tee", "e2e")


@dataclass(frozen=True)
class ClientCost:
    """One measurement: ``mode`` (plain / tee / e2e), the stage (``None`` for e2e), median CPU seconds
    and wall seconds of the block, the process's max RSS after it and its increase over the baseline."""

    mode: str
    stage: int | None
    units: tuple[int, ...]
    cpu_seconds: float
    wall_seconds: float
    max_rss_bytes: int
    rss_increase_bytes: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "mode": self.mode,
            "stage": self.stage,
            "units": list(self.units),
            "cpu_seconds": self.cpu_seconds,
            "wall_seconds": self.wall_seconds,
            "max_rss_bytes": self.max_rss_bytes,
            "rss_increase_bytes": self.rss_increase_bytes,
        }


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: set up, then time ``repeats`` blocks of ``steps`` steps (module docstring)."""
    import torch
    from torch import nn

    from fedveil.experiments.fdml.runner import device_sessions
    from fedveil.models.flat import FlatModel
    from fedveil.models.zoo import build_model
    from fedveil.protocols.local import local_train
    from fedveil.protocols.ppfl import ClientTee, PpflConfig, param_specs, stage_net
    from fedveil.runtime.enclave_host import EnclaveHost
    from fedveil.runtime.quoting import SimulatedPlatform

    torch.set_num_threads(spec["threads"])
    cfg = PpflConfig(batch_size=spec["batch_size"], block_size=spec["block_size"])
    model = build_model(
        spec["model"], num_classes=10, in_channels=spec["channels"], image_size=spec["side"], seed=0
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(spec["steps"], cfg.batch_size, *model.input_shape, generator=gen)
    y = torch.randint(0, 10, (spec["steps"], cfg.batch_size), generator=gen)
    mode, repeats = spec["mode"], spec["repeats"]
    host = None
    if mode == "e2e":
        flat = FlatModel(model)
        frozen: list[nn.Module] = []
        units: tuple[int, ...] = tuple(range(len(model.layer_units())))
        net: nn.Module = model
    else:
        stage = cfg.stages(model)[spec["stage"]]
        units = stage.units
        frozen = [u.eval().requires_grad_(False) for u in model.layer_units()[: stage.units[0]]]
        net = stage_net(model, stage)
        flat = FlatModel(net)
        if mode == "tee":
            platform = SimulatedPlatform.generate()
            host = EnclaveHost.start(platform=platform, boundary="process")  # the server is elsewhere
            session = device_sessions(["c0"], platform.public_key, host.measurement)["c0"]
            session.establish(host.open_session(session.hello()))
            host.layer_begin(0, param_specs(net), 0)
            tee = ClientTee(session, 2**40)
    theta = torch.from_numpy(flat.initial())
    opt = cfg.optimizer()

    def record(r: int) -> bytes:
        """Round ``r + 1``'s sealed theta_l, as it arrives from the network (outside the measurement)."""
        return host.layer_broadcast(r + 1, 0, ["c0"])["c0"] if host is not None else b""

    def block(r: int, sealed: bytes) -> None:
        with torch.no_grad():
            t = x
            for unit in frozen:
                t = torch.stack([unit(b) for b in t])
        batches = list(zip(t, y, strict=True))
        if mode == "tee":
            tee.train(r + 1, sealed, net, batches, opt, [cfg.lr] * len(batches))
        else:
            local_train(
                lambda q, a, b: nn.functional.cross_entropy(flat(q, a), b),
                theta.clone(),
                batches,
                opt,
                cfg.lr,
                inplace=True,
            )

    net.train()
    baseline = _max_rss_bytes()
    block(0, record(0))  # warm-up (round 1); the measured blocks are rounds 2 ..
    cpu, wall = [], []
    for r in range(1, repeats + 1):
        sealed = record(r)
        c0, w0 = _cpu(), time.perf_counter()
        block(r, sealed)
        cpu.append(_cpu() - c0)
        wall.append(time.perf_counter() - w0)
    peak = _max_rss_bytes()
    if host is not None:
        host.close()
    return {
        "mode": mode,
        "stage": spec.get("stage"),
        "units": list(units),
        "cpu_seconds": float(np.median(cpu)),
        "wall_seconds": float(np.median(wall)),
        "max_rss_bytes": peak,
        "rss_increase_bytes": peak - baseline,
    }


def measure_client_costs(
    model: str,
    *,
    channels: int,
    side: int,
    batch_size: int = 16,
    block_size: int = 1,
    steps: int = 1,
    repeats: int = 5,
    threads: int = 1,
    progress: bool = False,
) -> list[ClientCost]:
    """Fig. 3 for ``model`` on ``channels x side x side`` images: for each stage, plain then TEE, then
    E2E (each in its own fresh process, one after another)."""
    from fedveil.models.zoo import build_model
    from fedveil.protocols.ppfl import PpflConfig

    for name, value in (
        ("batch_size", batch_size),
        ("steps", steps),
        ("repeats", repeats),
        ("threads", threads),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} {value!r} must be an integer >= 1")
    net = build_model(model, num_classes=10, in_channels=channels, image_size=side)
    stages = PpflConfig(batch_size=batch_size, block_size=block_size).stages(net)
    base = {
        "model": model,
        "channels": channels,
        "side": side,
        "batch_size": batch_size,
        "block_size": block_size,
        "steps": steps,
        "repeats": repeats,
        "threads": threads,
    }
    specs = [{**base, "mode": m, "stage": s.index} for s in stages for m in ("plain", "tee")]
    specs.append({**base, "mode": "e2e", "stage": None})
    context = multiprocessing.get_context("spawn")
    out = []
    for spec in specs:
        with context.Pool(1) as pool:
            row = pool.apply(_worker, (spec,))
        cost = ClientCost(
            row["mode"],
            row["stage"],
            tuple(row["units"]),
            row["cpu_seconds"],
            row["wall_seconds"],
            row["max_rss_bytes"],
            row["rss_increase_bytes"],
        )
        if progress:
            print(
                f"{cost.mode:>5} stage {cost.stage}: CPU {cost.cpu_seconds * 1e3:.2f} ms, max RSS "
                f"{cost.max_rss_bytes / 2**20:.1f} MiB (+{cost.rss_increase_bytes / 2**20:.1f})",
                flush=True,
            )
        out.append(cost)
    return out


def plot_client_costs(costs: list[ClientCost], path: Path | str, *, title: str) -> Path:
    """Fig. 3's bars: per stage, CPU time and memory increase without (grey) and with (black) the TEE
    emulation, the overhead in percent above each pair, and E2E as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stages = sorted({c.stage for c in costs if c.stage is not None})
    by = {(c.mode, c.stage): c for c in costs}
    e2e = by.get(("e2e", None))
    fig = Figure(figsize=(9.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    for i, (attr, scale, label) in enumerate(
        (("cpu_seconds", 1e3, "CPU time (ms)"), ("rss_increase_bytes", 2**-20, "memory increase (MiB)"))
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        xs = np.arange(len(stages))
        plain = [getattr(by["plain", s], attr) * scale for s in stages]
        tee = [getattr(by["tee", s], attr) * scale for s in stages]
        ax.bar(xs - 0.2, plain, 0.4, color="0.75", label="without TEE")
        ax.bar(xs + 0.2, tee, 0.4, color="0.1", label="with emulated TEE")
        for x, a, b in zip(xs, plain, tee, strict=True):
            if a > 0:
                ax.annotate(
                    f"{100 * (b - a) / a:+.0f}%", (x, max(a, b)), ha="center", va="bottom", fontsize=8
                )
        if e2e is not None:
            ax.axhline(getattr(e2e, attr) * scale, linestyle="--", color="tab:red", label="E2E")
        ax.set_xticks(xs, [f"stage {s + 1}" for s in stages])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    return target
