"""Line plots of per-round series (loss, accuracy) for run directories and reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedveil.eval.plots import method_colours, save_png

if TYPE_CHECKING:
    from fedveil.core.communicator import DeviceTiming

FEW_POINTS = 3
"""A series with fewer points is drawn as markers alone: a line through two evaluations suggests a
trajectory nobody measured."""


@dataclass(frozen=True)
class Reference:
    """A horizontal reference line at ``value`` (in the plot's y units), drawn dashed and grey with its
    ``label`` in the legend: chance, or the untrained model's score."""

    label: str
    value: float


@dataclass(frozen=True)
class Note:
    """A text annotation at the data point ``(x, y)`` (e.g. the epsilon a group had spent by then), in
    ``colour`` (default: black), e.g. that of the series it annotates."""

    x: float
    y: float
    text: str
    colour: str | None = None


def plot_series(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    xlabel: str = "round",
    smooth: int = 0,
    colours: Mapping[str, str] | None = None,
    references: Sequence[Reference] = (),
    notes: Sequence[Note] = (),
    ylim: tuple[float, float] | None = None,
) -> Path:
    """Draw :func:`series_figure` and write it as a PNG to ``path``."""
    fig = series_figure(
        series,
        title=title,
        ylabel=ylabel,
        xlabel=xlabel,
        smooth=smooth,
        colours=colours,
        references=references,
        notes=notes,
        ylim=ylim,
    )
    return save_png(fig, path)


def series_figure(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    ylabel: str,
    xlabel: str = "round",
    smooth: int = 0,
    colours: Mapping[str, str] | None = None,
    references: Sequence[Reference] = (),
    notes: Sequence[Note] = (),
    ylim: tuple[float, float] | None = None,
) -> Figure:
    """Each named series of ``(x, y)`` points as a line in its ``colours`` entry (default:
    :func:`~fedveil.eval.plots.method_colours` of the names in order). A series of more than 50 points
    (or any, with ``smooth`` > 1) adds a running mean of window ``smooth`` (default ``len / 50``) over
    its faint raw line, both in the series' colour; one of fewer than :data:`FEW_POINTS` points is
    drawn as markers only, and one of fewer than 20 with markers on the line. ``references`` are
    horizontal lines, ``notes`` text at data points, ``ylim`` the y axis' range (default: fitted)."""
    colours = colours if colours is not None else method_colours(series)
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, points in series.items():
        if not points:
            continue
        colour = colours.get(name)
        x, y = np.asarray(points, dtype=float).T
        window = smooth or max(1, len(y) // 50)
        if window > 1 and len(y) > window:
            ax.plot(x, y, color=colour, alpha=0.25, linewidth=0.8)
            kernel = np.ones(window) / window
            mean = np.convolve(y, kernel, mode="valid")
            ax.plot(x[window - 1 :], mean, color=colour, label=f"{name} (mean of {window})")
        else:
            style = "none" if len(y) < FEW_POINTS else "-"
            ax.plot(x, y, color=colour, linestyle=style, marker="o" if len(y) < 20 else None, label=name)
    for ref in references:
        ax.axhline(ref.value, color="grey", linestyle="--", linewidth=1.0, label=ref.label)
    for note in notes:
        ax.annotate(
            note.text,
            (note.x, note.y),
            xytext=(4, 6),
            textcoords="offset points",
            fontsize=7,
            color=note.colour,
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.7, "linewidth": 0.3},
        )
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bars_figure(
    values: Mapping[str, Mapping[str, tuple[float, float]]],
    *,
    title: str,
    ylabel: str,
    colours: Mapping[str, str] | None = None,
    chance: Mapping[str, float] | None = None,
    ylim: tuple[float, float] | None = None,
) -> Figure:
    """Grouped bars: one group per key of ``values`` (e.g. a metric), in it one bar per method at
    ``values[group][method] = (mean, spread)`` with an error bar of +- ``spread`` (e.g. the standard
    deviation over trials), each method in its ``colours`` entry (default:
    :func:`~fedveil.eval.plots.method_colours` in order of appearance). ``chance[group]`` draws a dashed
    grey segment across that group's bars: what a model that learned nothing scores there."""
    methods = list(dict.fromkeys(m for row in values.values() for m in row))
    colours = colours if colours is not None else method_colours(methods)
    fig = Figure(figsize=(max(6.4, 1.6 * len(values) * max(1, len(methods)) / 3), 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(methods))
    for g, row in enumerate(values.values()):
        for m, method in enumerate(methods):
            if method in row:
                mean, spread = row[method]
                x = g - 0.4 + width * (m + 0.5)
                ax.bar(x, mean, width, yerr=spread, capsize=3, color=colours.get(method), label=method)
    labelled = False
    for g, group in enumerate(values):
        if chance is not None and group in chance:
            label = "chance" if not labelled else "_chance"
            ax.plot([g - 0.45, g + 0.45], [chance[group]] * 2, color="grey", linestyle="--", label=label)
            labelled = True
    ax.set_xticks(range(len(values)), list(values))
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=8)
    fig.tight_layout()
    return fig


def plot_seed_curves(
    curves: Mapping[str, Sequence[Mapping[str, Sequence[tuple[float, float]]]]],
    path: str | Path,
    *,
    title: str,
    panels: Sequence[tuple[str, str]],
) -> Path:
    """Draw :func:`seed_curves_figure` and write it as a PNG to ``path``."""
    return save_png(seed_curves_figure(curves, title=title, panels=panels), path)


def seed_curves_figure(
    curves: Mapping[str, Sequence[Mapping[str, Sequence[tuple[float, float]]]]],
    *,
    title: str,
    panels: Sequence[tuple[str, str]],
) -> Figure:
    """One panel per ``(key, ylabel)`` of ``panels``; in each, one line per named cell of ``curves``: the
    mean over that cell's runs (seeds) of the series ``key``, with a band from the runs' minimum to their
    maximum. A run's series is ``(x, y)`` points; the runs of a cell are averaged at the x values they
    share. Series with more than 50 points are drawn as running means (window ``len / 50``). A cell has
    one colour in every panel (:func:`~fedveil.eval.plots.method_colours`)."""
    colours = method_colours(curves)
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
            ax.plot(x, ys.mean(axis=0), color=colours[name], marker="o" if len(x) < 20 else None, label=label)
            if len(series) > 1:
                ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=colours[name], alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


TIMING_PARTS = ("ttd", "tte", "ttr", "ttp")

TIMING_UNITS: dict[str, float] = {"s": 1.0, "ms": 1000.0}
"""The units :func:`summarise_timings` reports in, by name: how many of them make one second."""


def summarise_timings(
    timings: Sequence[DeviceTiming], *, points: Sequence[int] = (50, 95), unit: str = "s"
) -> dict[str, float]:
    """The ``points`` percentiles and the maximum of TTD / TTE / TTR / TTP (PoliFL Sec. 5) over
    per-device records (:class:`~fedveil.core.communicator.DeviceTiming`, whose times are seconds), as
    flat fields: ``ttd_p50``, ``ttd_p95``, ``ttd_max`` in seconds by default (a round's
    ``metrics.jsonl`` line), ``ttd_p50_ms`` ... with ``unit="ms"``. A measure no record carries is left
    out."""
    if unit not in TIMING_UNITS:
        raise ValueError(f"unit {unit!r} is not one of {', '.join(TIMING_UNITS)}")
    scale = TIMING_UNITS[unit]
    suffix = "" if unit == "s" else f"_{unit}"
    out: dict[str, float] = {}
    for part in TIMING_PARTS:
        values = np.array([getattr(t, part) for t in timings if getattr(t, part) is not None], dtype=float)
        if values.size:
            values = values * scale
            out.update({f"{part}_p{q}{suffix}": float(np.percentile(values, q)) for q in points})
            out[f"{part}_max{suffix}"] = float(values.max())
    return out


def summarise_timings_by_phase(
    timings: Sequence[DeviceTiming], *, points: Sequence[int] = (50, 90), unit: str = "ms"
) -> dict[str, dict[str, float]]:
    """Per phase (each record's ``phase``, sorted), the number of ``replies`` and
    :func:`summarise_timings` of that phase's records, by default the 50th and 90th percentiles and the
    maximum in milliseconds (``ttd_p50_ms``, ``ttd_p90_ms``, ``ttd_max_ms``, ...)."""
    out: dict[str, dict[str, float]] = {}
    for phase in sorted({t.phase for t in timings}):
        rows = [t for t in timings if t.phase == phase]
        out[phase] = {"replies": float(len(rows)), **summarise_timings(rows, points=points, unit=unit)}
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
    return save_png(fig, path)
