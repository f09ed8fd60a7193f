"""One-command reproduction of the FDML paper's tables (Tables I-IV).

``table1``-``table3`` are TouchAuth's cells; ``camera1``, ``camera2`` and ``camera4`` the CameraAuth cells of
Tables I, II and IV (configs in ``configs/fdml/``); ``partial`` is not a paper table but the experiment that
asks why partial participation costs accuracy (Sec. VIII-B2/B3; ``docs/results.md``).

Each table is a list of cells; each cell is one experiment config in ``configs/`` beside the number the
paper reports for it. :func:`reproduce` runs the cells (as ``fedveil run`` subprocesses, several at a
time), each with ``seeds`` training seeds, skips runs whose ``results.json`` already exists and continues a
run that was cut off from its checkpoint (so an interrupted reproduction resumes where it stopped), and
writes ``summary.md`` / ``summary.json`` and ``summary.png`` (each cell's training loss and test
accuracy against the round, mean and range over the seeds): our number (the mean +- sample standard
deviation over the seeds) beside the paper's, the scale used, and for DP cells the paper's per-round
epsilon and the whole-training epsilon under both accountings.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedveil.core.provenance import code_identity
from fedveil.errors import ConfigError, RunInterrupted


@dataclass(frozen=True)
class Cell:
    """One table cell: its row and column labels, config file name and the paper's accuracy (%), None
    where the paper has no such cell."""

    row: str
    column: str
    config: str
    paper: float | None


TABLES: dict[str, tuple[str, list[Cell]]] = {
    "table1": (
        "Table I: user authentication accuracy (%) of FDML and FL-traditional, TouchAuth",
        [
            Cell("TouchAuth", "FDML", "table1_fdml.yaml", 80.88),
            Cell("TouchAuth", "FL (lr=0.1)", "table1_fl_lr0.1.yaml", 71.4),
            Cell("TouchAuth", "FL (lr=0.01)", "table1_fl_lr0.01.yaml", 63.24),
        ],
    ),
    "table2": (
        "Table II: accuracy (%) under gradient-upload exceptions (Case B), TouchAuth",
        [
            Cell(f"Strategy-{s.upper()}", f"p={p}", f"table2_{s}_p{p}.yaml", paper)
            for s, values in (("as", (57.86, 58.61, 58.61)), ("uc", (81.11, 80.94, 80.94)))
            for p, paper in zip(("0.2", "0.4", "0.6"), values, strict=True)
        ],
    ),
    "table3": (
        "Table III: accuracy (%) with privacy (Alg. 2, T=2e-5, r=0.2) and robustness (rate_p), TouchAuth",
        [
            Cell(label, f"rate_p={rp}", f"table3_rp{rp}_{tag}.yaml", paper)
            for label, tag, values in (
                ("w/o DP", "nodp", (80.88, 80.75, 80.16)),
                ("epsilon=8 (per round)", "eps8", (80.55, 80.57, 71.40)),
                ("epsilon=4 (per round)", "eps4", (74.56, 73.93, 73.97)),
            )
            for rp, paper in zip(("1.0", "0.8", "0.6"), values, strict=True)
        ],
    ),
    "camera1": (
        "Table I: user authentication accuracy (%) of FDML and FL-traditional, CameraAuth",
        [
            Cell("CameraAuth", "FDML", "fdml/cameraauth_table1_fdml.yaml", 79.98),
            Cell("CameraAuth", "FL (lr=0.1)", "fdml/cameraauth_table1_fl_lr0.1.yaml", 76.55),
            Cell("CameraAuth", "FL (lr=0.01)", "fdml/cameraauth_table1_fl_lr0.01.yaml", 72.27),
        ],
    ),
    "camera2": (
        "Table II: accuracy (%) under gradient-upload exceptions (Case B), CameraAuth",
        [
            Cell(f"Strategy-{s.upper()}", f"p={p}", f"fdml/cameraauth_table2_{s}_p{p}.yaml", paper)
            for s, values in (("as", (55.92, 55.38, 54.45)), ("uc", (77.46, 80.54, 79.53)))
            for p, paper in zip(("0.2", "0.4", "0.6"), values, strict=True)
        ],
    ),
    "camera4": (
        "Table IV: accuracy (%) with privacy (Alg. 2, T=2e-5, r=0) and robustness (rate_p), CameraAuth",
        [
            Cell(label, f"rate_p={rp}", f"fdml/cameraauth_table4_rp{rp}_{tag}.yaml", paper)
            for label, tag, values in (
                ("w/o DP", "nodp", (79.98, 79.86, 79.1)),
                ("epsilon=1 (per round)", "eps1", (79.94, 78.88, 78.87)),
                ("epsilon=0.5 (per round)", "eps0.5", (78.3, 77.7, 75.51)),
                ("epsilon=0.25 (per round)", "eps0.25", (73.52, 73.93, 71.39)),
            )
            for rp, paper in zip(("1.0", "0.8", "0.6"), values, strict=True)
        ],
    ),
    "partial": (
        "Partial participation: what costs accuracy when only part of the gradients is applied, TouchAuth",
        [
            Cell("64 gradients of 64", "all applied (rate_p=1)", "table1_fdml.yaml", 80.88),
            Cell("51 of 64, first to arrive", "rate_p=0.8", "table3_rp0.8_nodp.yaml", 80.75),
            Cell("~51 of 64, random", "each lost w.p. 0.2 (Strategy-UC)", "table2_uc_p0.2.yaml", 81.11),
            Cell("51 gradients of 51", "51 participants, rate_p=1", "fdml/partial_cohort51.yaml", None),
        ],
    ),
}


class _Children:
    """The ``fedveil run`` processes in flight. Each runs in its own session, so that a terminal's
    Ctrl-C reaches only :func:`reproduce`, which passes it on to each run exactly once
    (:meth:`interrupt`); a run stops at the end of its round, checkpointed. Once interrupted, no
    further run starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._stopping = False

    def run(self, cmd: list[str], log: Any) -> int | None:
        """Run ``cmd`` to its end and return its exit status; ``None`` if interrupted before it started."""
        with self._lock:
            if self._stopping:
                return None
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self._procs.add(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)

    def interrupt(self) -> None:
        """Start no more runs and send each running one SIGINT (what Ctrl-C would have sent it)."""
        with self._lock:
            self._stopping = True
            for proc in self._procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)


def _run_cell(
    config: Path, out: Path, overrides: Sequence[str], threads: int, children: _Children
) -> tuple[Path, float, str]:
    """One ``fedveil run`` of ``config`` into ``out``: kept when it finished before, continued from its
    checkpoint when it was cut off, else started (unless ``children`` was interrupted)."""
    if (out / "results.json").is_file():
        return out, 0.0, "kept"
    cmd = [sys.executable, "-m", "fedveil.cli", "run", str(config), "--out", str(out), "--no-progress"]
    for item in [f"runtime.threads={threads}", *overrides]:
        cmd += ["--set", item]
    resumed = (out / "checkpoint.npz").is_file() and (out / "config.yaml").is_file()
    cmd.append("--resume")  # a cut-off cell continues; a cell never started starts (its dir holds a log)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "log.txt", "a" if resumed else "w", encoding="utf-8") as log:
        code = children.run(cmd, log)
    if code is None:
        return out, 0.0, "not started (interrupted)"
    status = "done" if code == 0 else f"failed (exit {code}, see {out / 'log.txt'})"
    return out, time.perf_counter() - start, f"{status} (resumed)" if resumed and code == 0 else status


def _overrides_per_cell(
    cfg_dir: Path, cells: Sequence[Cell], overrides: Sequence[str]
) -> dict[str, list[str]]:
    """Each cell's share of the table-wide ``overrides``: those its config reads. One ``--set`` list
    serves tables that mix protocols (``fdml.*`` is not passed to an FL-traditional cell, whose
    ``fedveil run`` would refuse it as a key without effect); a key a cell does not know is still
    refused, by that cell's run."""
    from fedveil.experiments.config import effective_overrides

    return {cell.config: effective_overrides(cfg_dir / cell.config, overrides) for cell in cells}


def seed_dirs(base: Path, cell: Cell, seeds: int) -> list[Path]:
    """Run directories of ``cell``'s seeds: ``base/<config name>`` for one seed (seed of the config),
    ``base/<config name>/seed<i>`` for ``i`` in ``0 .. seeds-1`` otherwise."""
    cell_dir = base / Path(cell.config).stem
    return [cell_dir] if seeds == 1 else [cell_dir / f"seed{i}" for i in range(seeds)]


def reproduce(
    table: str,
    *,
    configs: str | Path = "configs",
    out: str | Path = "runs",
    overrides: Sequence[str] = (),
    jobs: int = 1,
    threads: int | None = None,
    seeds: int = 1,
    only: Sequence[int] | None = None,
    rounds_scale: int = 1,
    echo: Any = print,
) -> dict[str, Any]:
    """Run every cell of ``table`` with ``overrides`` and write ``<out>/<table>/summary.{md,json}``.

    ``seeds`` > 1 runs each cell with training seeds ``0 .. seeds-1`` (``--set seed=i``: the model's
    initialisation, the selection and the devices' sampling; the synthetic population and the evaluation
    split stay those of ``data.seed`` and ``eval.seed``) and reports mean and standard deviation.
    ``only`` runs (and summarises) just the cells of those 1-based positions in the table.
    ``rounds_scale`` runs each cell for that many times its config's ``rounds`` (FL-traditional cells keep
    their 3:1 ratio to FDML's, as in the paper).
    """
    if table not in TABLES:
        raise ConfigError(f"table {table!r} is not one of {', '.join(TABLES)}")
    if jobs < 1:
        raise ConfigError(f"jobs {jobs} must be >= 1")
    if seeds < 1:
        raise ConfigError(f"seeds {seeds} must be >= 1")
    if seeds > 1 and any(item.split("=", 1)[0].strip() == "seed" for item in overrides):
        raise ConfigError(
            f"--set seed=... and --seeds {seeds} both choose the seed: --seeds runs seeds 0..{seeds - 1}"
        )
    if isinstance(rounds_scale, bool) or not isinstance(rounds_scale, int) or rounds_scale < 1:
        raise ConfigError(f"rounds scale {rounds_scale!r} must be an integer >= 1")
    if rounds_scale > 1 and any(item.split("=", 1)[0].strip() == "rounds" for item in overrides):
        raise ConfigError(
            f"--set rounds=... and --rounds-scale {rounds_scale} both choose the rounds: use one of them"
        )
    title, cells = TABLES[table]
    if only is not None:
        bad = [i for i in only if not 1 <= i <= len(cells)]
        if bad or not only:
            raise ConfigError(f"cells {list(only)}: {table} has cells 1 to {len(cells)}")
        cells = [cells[i - 1] for i in sorted(set(only))]
    cfg_dir = Path(configs)
    missing = [c.config for c in cells if not (cfg_dir / c.config).is_file()]
    if missing:
        raise ConfigError(
            f"configs {missing} not found in {str(cfg_dir)!r}; pass --configs DIR (the repo's configs/)"
        )
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    base = Path(out) / table
    echo(
        f"{title}: {len(cells)} cells x {seeds} seed(s), {jobs} run(s) at a time, "
        f"overrides {list(overrides) or 'none'}"
    )
    from fedveil.experiments.config import load_config  # its imports are heavy; --help must stay quick

    scaled = {
        c.config: [f"rounds={rounds_scale * load_config(cfg_dir / c.config).rounds}"]
        if rounds_scale > 1
        else []
        for c in cells
    }
    used = _overrides_per_cell(cfg_dir, cells, overrides)
    runs = [
        (cell, path, [*used[cell.config], *scaled[cell.config], *([f"seed={i}"] if seeds > 1 else [])])
        for cell in cells
        for i, path in enumerate(seed_dirs(base, cell, seeds))
    ]
    children = _Children()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [
            pool.submit(_run_cell, cfg_dir / c.config, d, extra, threads, children) for c, d, extra in runs
        ]
        try:
            for (cell, _, _), fut in zip(runs, futures, strict=True):
                path, secs, status = fut.result()
                echo(f"  {cell.row} / {cell.column}: {status} ({secs:.0f} s) -> {path}")
        except KeyboardInterrupt:
            children.interrupt()
            pool.shutdown(wait=True, cancel_futures=True)
            raise RunInterrupted(
                f"{table}: interrupted; finished runs are kept and each cut-off run continues from its "
                f"last round's checkpoint: run the same command again (out {base})"
            ) from None
    rows = []
    for c in cells:
        results = []
        for path in seed_dirs(base, c, seeds):
            res_path = path / "results.json"
            results.append(json.loads(res_path.read_text()) if res_path.is_file() else None)
        row: dict[str, Any] = {"row": c.row, "column": c.column, "config": c.config, "paper": c.paper}
        row["results"] = results[0] if seeds == 1 else None
        if seeds > 1:
            row["seeds"] = results
            row["stats"] = seed_stats(results)
        rows.append(row)
    ran = [r for row in rows for r in (row["seeds"] if seeds > 1 else [row["results"]]) if r is not None]
    summary = {
        "table": table,
        "title": title,
        "overrides": list(overrides),
        "rounds_scale": rounds_scale,
        "seeds": seeds,
        "cells": rows,
        "code": code_identity(),
        # the commits the cells' runs recorded (a cell kept from an earlier invocation may differ)
        "cell_commits": sorted({(r.get("code") or {}).get("git_commit") or "unrecorded" for r in ran}),
    }
    (base / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (base / "summary.md").write_text(format_summary(summary), encoding="utf-8")
    from fedveil.experiments.plots import plot_seed_curves  # matplotlib: only once there is a plot

    curves = {
        f"{c.row} / {c.column}": [run_curves(path) for path in seed_dirs(base, c, seeds)] for c in cells
    }
    plot_seed_curves(
        {name: [r for r in runs if r] for name, runs in curves.items()},
        base / "summary.png",
        title=f"{title}; band: min-max over seeds",
        panels=(("loss", "training loss (step 5 / FedAvg)"), ("accuracy", "test accuracy (%)")),
    )
    return summary


def run_curves(run_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """A run's training loss per round and test accuracy (%) per evaluation, from its ``metrics.jsonl``
    (empty when the run has none)."""
    path = run_dir / "metrics.jsonl"
    curves: dict[str, list[tuple[float, float]]] = {"loss": [], "accuracy": []}
    if not path.is_file():
        return {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "eval" in row:
            curves["accuracy"].append((float(row["eval"]["round"]), float(row["eval"]["accuracy_percent"])))
        elif row.get("loss") is not None:
            curves["loss"].append((float(row["round"]), float(row["loss"])))
    return curves


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0.0 for a single value)."""
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def seed_stats(results: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Mean and standard deviation of accuracy (%), EER and AUC over the seeds that finished, with each
    seed's accuracy; None when none finished."""
    done = [r for r in results if r is not None]
    if not done:
        return None
    stats: dict[str, Any] = {
        "n": len(done),
        "of": len(results),
        "accuracy_percent_each": [r["accuracy_percent"] for r in done],
    }
    for key in ("accuracy_percent", "eer", "auc"):
        stats[key], stats[f"{key}_std"] = mean_std([float(r[key]) for r in done])
    stats["rounds_applied"] = [r["rounds_applied"] for r in done]
    stats["rounds"] = done[0]["rounds"]
    stats["privacy"] = done[0].get("privacy")
    return stats


def _privacy(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    return (
        f"per round: paper {p['epsilon_round_paper']:.3g}, strict {p['epsilon_round_strict']:.3g}; "
        f"whole training (delta={p['delta']:g}): paper {p['epsilon_total_paper_composed']:.4g}, "
        f"strict {p['epsilon_total_strict']:.4g}"
    )


def _paper(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _one_seed_line(cell: dict[str, Any]) -> str:
    res = cell["results"]
    if res is None:
        return f"| {cell['row']} | {cell['column']} | failed | {_paper(cell['paper'])} | - | - | - | - |"
    return (
        f"| {cell['row']} | {cell['column']} | {res['accuracy_percent']:.2f} | {_paper(cell['paper'])} | "
        f"{100 * res['eer']:.1f}% | {res['auc']:.3f} | {res['rounds_applied']}/{res['rounds']} | "
        f"{_privacy(res.get('privacy'))} |"
    )


def _seeds_line(cell: dict[str, Any]) -> str:
    st = cell["stats"]
    if st is None:
        return f"| {cell['row']} | {cell['column']} | failed | - | {_paper(cell['paper'])} | - | - | - | - |"
    n = f" (n={st['n']} of {st['of']})" if st["n"] < st["of"] else ""
    each = ", ".join(f"{a:.2f}" for a in st["accuracy_percent_each"])
    applied = ", ".join(f"{a}" for a in st["rounds_applied"])
    ours = f"{st['accuracy_percent']:.2f} +- {st['accuracy_percent_std']:.2f}{n}"
    return (
        f"| {cell['row']} | {cell['column']} | {ours} | {each} | {_paper(cell['paper'])} | "
        f"{100 * st['eer']:.1f}% +- {100 * st['eer_std']:.1f} | "
        f"{st['auc']:.3f} +- {st['auc_std']:.3f} | {applied} of {st['rounds']} | {_privacy(st['privacy'])} |"
    )


def format_summary(summary: dict[str, Any]) -> str:
    """A markdown table: ours beside the paper's for every cell, with EER, AUC and privacy where run; with
    several seeds, mean +- sample standard deviation and each seed's accuracy."""
    lines = [f"### {summary['title']}", ""]
    if summary.get("cell_commits"):
        commits = ", ".join(c if c == "unrecorded" else c[:12] for c in summary["cell_commits"])
        lines += [f"Code the cells ran on (git commit): {commits}.", ""]
    if summary.get("rounds_scale", 1) > 1:
        lines += [f"Each cell at {summary['rounds_scale']}x its config's rounds.", ""]
    seeds = summary.get("seeds", 1)
    if seeds > 1:
        lines.append(f"Seeds 0-{seeds - 1}; overrides: {', '.join(summary['overrides']) or 'none'}.")
        lines.append("")
        lines.append(
            "| row | column | ours (%), mean +- std | each seed (%) | paper (%) | EER | AUC | rounds applied "
            "| privacy |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        lines += [_seeds_line(cell) for cell in summary["cells"]]
    else:
        lines.append("| row | column | ours (%) | paper (%) | EER | AUC | rounds applied | privacy |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        lines += [_one_seed_line(cell) for cell in summary["cells"]]
    return "\n".join(lines) + "\n"
