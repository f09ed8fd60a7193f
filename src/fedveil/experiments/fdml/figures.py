"""The plots of an FDML (or FL-traditional) run directory, drawn from its ``metrics.jsonl``.

What shows learning in FDML is not the metric line's ``loss``: that is the mean hinge over the *active*
triplets only (Alg. 1), which stays near the margin while fewer and fewer triplets remain active. The
plots therefore show the share of valid triplets still active (``active_fraction``) and the loss over
all valid triplets (``valid_loss``), beside the active-triplet loss, and the Sec. VII-C accuracy of every
evaluation on a full 0-100% axis against the untrained network's accuracy. Evaluations come every
``eval.every`` rounds and after the last round: with the default ``eval.every: 0`` there is one point,
and fewer than three points are drawn as markers with no line between them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fedveil.eval.plots import roc_figure, save_png
from fedveil.eval.verification import Roc
from fedveil.experiments.plots import Reference, series_figure

__all__ = ["run_figures", "write_run_plots"]

VALID_LOSS = "loss over all valid triplets"
ACTIVE_LOSS = "loss over active triplets"


def _metric_lines(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The round lines and the evaluations of a ``metrics.jsonl``, in file order."""
    rounds: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for text in path.read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        if "eval" in line:
            evals.append(line["eval"])
        elif "round" in line:
            rounds.append(line)
    return rounds, evals


def _points(lines: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(round, line[key])`` of the lines that hold a value for ``key``."""
    return [(line["round"], float(line[key])) for line in lines if line.get(key) is not None]


def run_figures(
    out: str | Path, name: str, *, roc: Roc | None = None, untrained_percent: float | None = None
) -> dict[str, Figure]:
    """The figures of run directory ``out`` by file name, from its ``metrics.jsonl`` (resumed rounds
    included): ``loss.png`` (for FDML: the loss over all valid triplets and over the active ones, per
    round), ``active_fraction.png`` (FDML: active / valid triplets per round, on [0, 1]),
    ``accuracy.png`` (Sec. VII-C accuracy of each evaluation on [0, 100] %, with the ``untrained_percent``
    baseline drawn when given) and ``roc.png`` (``roc``, the last evaluation's, when given). A figure
    whose series is empty is left out."""
    rounds, evals = _metric_lines(Path(out) / "metrics.jsonl")
    figures: dict[str, Figure] = {}
    valid = _points(rounds, "valid_loss")
    if valid:
        losses = {VALID_LOSS: valid, ACTIVE_LOSS: _points(rounds, "loss")}
        figures["loss.png"] = series_figure(
            losses, title=f"{name}: triplet loss (Alg. 1)", ylabel="mean hinge (distance units)"
        )
        figures["active_fraction.png"] = series_figure(
            {"active / valid triplets": _points(rounds, "active_fraction")},
            title=f"{name}: share of valid triplets still active",
            ylabel="fraction of valid triplets",
            ylim=(0.0, 1.02),
        )
    elif _points(rounds, "loss"):
        figures["loss.png"] = series_figure(
            {"loss": _points(rounds, "loss")}, title=f"{name}: training loss", ylabel="loss"
        )
    accuracy = _points(evals, "accuracy_percent")
    if accuracy:
        references = (
            [Reference(f"untrained network (round 0): {untrained_percent:.1f}%", untrained_percent)]
            if untrained_percent is not None
            else []
        )
        figures["accuracy.png"] = series_figure(
            {"Sec. VII-C accuracy": accuracy},
            title=f"{name}: Sec. VII-C accuracy on test users",
            ylabel="accuracy (%)",
            references=references,
            ylim=(0.0, 102.0),
        )
    if roc is not None:
        figures["roc.png"] = roc_figure({name: roc}, title=f"{name}: ROC on test users")
    return figures


def write_run_plots(
    out: str | Path, name: str, *, roc: Roc | None = None, untrained_percent: float | None = None
) -> list[Path]:
    """Write :func:`run_figures` into ``out`` as PNGs; return their paths."""
    figures = run_figures(out, name, roc=roc, untrained_percent=untrained_percent)
    return [
        save_png(fig, Path(out) / file, dpi=120 if file == "roc.png" else None)
        for file, fig in figures.items()
    ]
