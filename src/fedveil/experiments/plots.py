"""Line plots of per-round series (loss, accuracy) for run directories and reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def plot_series(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    xlabel: str = "round",
    smooth: int = 0,
) -> Path:
    """Plot each named series of ``(x, y)`` points as a line (``smooth`` > 1 adds a running mean)
    and write a PNG to ``path``."""
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, points in series.items():
        if not points:
            continue
        x, y = np.asarray(points, dtype=float).T
        window = smooth or max(1, len(y) // 50)
        if window > 1 and len(y) > window:
            ax.plot(x, y, alpha=0.25, linewidth=0.8)
            kernel = np.ones(window) / window
            ax.plot(x[window - 1 :], np.convolve(y, kernel, mode="valid"), label=f"{name} (mean of {window})")
        else:
            ax.plot(x, y, marker="o" if len(y) < 20 else None, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


def plot_seed_curves(
    curves: Mapping[str, Sequence[Mapping[str, Sequence[tuple[float, float]]]]],
    path: str | Path,
    *,
    title: str,
    panels: Sequence[tuple[str, str]],
) -> Path:
    """One panel per ``(key, ylabel)`` of ``panels``; in each, one line per named cell of ``curves``: the
    mean over that cell's runs (seeds) of the series ``key``, with a band from the runs' minimum to their
    maximum. A run's series is ``(x, y)`` points; the runs of a cell are averaged at the x values they
    share. Series with more than 50 points are drawn as running means (window ``len / 50``)."""
    fig = Figure(figsize=(6.0 * len(panels), 4.2), dpi=100)
    FigureCanvasAgg(fig)
    for index, (key, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), index + 1)
        for name, runs in curves.items():
            series = [dict(run.get(key, ())) for run in runs]
            shared = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if not shared:
                continue
            x = np.asarray(shared, dtype=float)
            ys = np.array([[s[v] for v in shared] for s in series], dtype=float)
            window = max(1, len(x) // 50)
            if window > 1:
                kernel = np.ones(window) / window
                ys = np.array([np.convolve(y, kernel, mode="valid") for y in ys])
                x = x[window - 1 :]
            label = f"{name} ({len(series)} run{'s' * (len(series) > 1)})"
            (line,) = ax.plot(x, ys.mean(axis=0), marker="o" if len(x) < 20 else None, label=label)
            if len(series) > 1:
                ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=line.get_color(), alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


TIMING_PARTS = ("ttd", "tte", "ttr", "ttp")


def summarise_timings(timings: Sequence[object]) -> dict[str, float]:
    """Median, 95th percentile and maximum of TTD / TTE / TTR / TTP (PoliFL Sec. 5, seconds) over one
    round's per-device records (:class:`fedveil.core.communicator.DeviceTiming`), as flat
    ``metrics.jsonl`` fields such as ``ttd_p50``."""
    out: dict[str, float] = {}
    for part in TIMING_PARTS:
        values = np.array([getattr(t, part) for t in timings if getattr(t, part) is not None], dtype=float)
        if values.size:
            out[f"{part}_p50"] = float(np.percentile(values, 50))
            out[f"{part}_p95"] = float(np.percentile(values, 95))
            out[f"{part}_max"] = float(values.max())
    return out


def plot_round_timing(devices: Sequence[Mapping[str, object]], path: str | Path, *, title: str) -> Path:
    """PoliFL Fig. 5 for one round: one stacked bar per device reply (TTD, TTE, TTR, TTP in seconds),
    in arrival order (the order of ``devices``), written as a PNG to ``path``."""
    fig = Figure(figsize=(7.2, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(devices))
    bottom = np.zeros(len(devices))
    for part in TIMING_PARTS:
        h = np.array([float(d.get(part) or 0.0) for d in devices])
        ax.bar(x, h, bottom=bottom, label=part.upper(), width=0.85)
        bottom += h
    ax.set_title(title)
    ax.set_xlabel("device reply (arrival order)")
    ax.set_ylabel("seconds")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out
