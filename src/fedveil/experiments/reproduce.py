"""One-command reproduction of the FDML paper's tables (000_5f3e2740eb021610.txt, Tables I-IV).

``table1``-``table3`` are TouchAuth's cells; ``camera1``, ``camera2`` and ``camera4`` the CameraAuth cells of
Tables I, II and IV (configs in ``configs/fdml/``).

Each table is a list of cells; each cell is one experiment config in ``configs/`` beside the number the
paper reports for it. :func:`reproduce` runs the cells (as ``fedveil run`` subprocesses, several at a
time), skips cells whose ``results.json`` already exists (so an interrupted reproduction resumes where
it stopped), and writes ``summary.md`` / ``summary.json``: our number beside the paper's, the scale
used, and for DP cells the paper's per-round epsilon and the whole-training epsilon under both
accountings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedveil.errors import ConfigError


@dataclass(frozen=True)
class Cell:
    """One table cell: its row and column labels, config file name and the paper's accuracy (%)."""

    row: str
    column: str
    config: str
    paper: float


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
}


def _run_cell(config: Path, out: Path, overrides: Sequence[str], threads: int) -> tuple[Path, float, str]:
    if (out / "results.json").is_file():
        return out, 0.0, "kept"
    cmd = [sys.executable, "-m", "fedveil.cli", "run", str(config), "--out", str(out), "--no-progress"]
    for item in [f"runtime.threads={threads}", *overrides]:
        cmd += ["--set", item]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "log.txt", "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    status = "done" if code == 0 else f"failed (exit {code}, see {out / 'log.txt'})"
    return out, time.perf_counter() - start, status


def reproduce(
    table: str,
    *,
    configs: str | Path = "configs",
    out: str | Path = "runs",
    overrides: Sequence[str] = (),
    jobs: int = 1,
    threads: int | None = None,
    echo: Any = print,
) -> dict[str, Any]:
    """Run every cell of ``table`` with ``overrides`` and write ``<out>/<table>/summary.{md,json}``."""
    if table not in TABLES:
        raise ConfigError(f"table {table!r} is not one of {', '.join(TABLES)}")
    if jobs < 1:
        raise ConfigError(f"jobs {jobs} must be >= 1")
    title, cells = TABLES[table]
    cfg_dir = Path(configs)
    missing = [c.config for c in cells if not (cfg_dir / c.config).is_file()]
    if missing:
        raise ConfigError(
            f"configs {missing} not found in {str(cfg_dir)!r}; pass --configs DIR (the repo's configs/)"
        )
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    base = Path(out) / table
    echo(f"{title}: {len(cells)} runs, {jobs} at a time, overrides {list(overrides) or 'none'}")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [
            pool.submit(_run_cell, cfg_dir / c.config, base / Path(c.config).stem, overrides, threads)
            for c in cells
        ]
        for cell, fut in zip(cells, futures, strict=True):
            path, seconds, status = fut.result()
            echo(f"  {cell.row} / {cell.column}: {status} ({seconds:.0f} s) -> {path}")
    rows = []
    for c in cells:
        res_path = base / Path(c.config).stem / "results.json"
        res = json.loads(res_path.read_text()) if res_path.is_file() else None
        rows.append({"row": c.row, "column": c.column, "config": c.config, "paper": c.paper, "results": res})
    summary = {"table": table, "title": title, "overrides": list(overrides), "cells": rows}
    (base / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (base / "summary.md").write_text(format_summary(summary), encoding="utf-8")
    return summary


def _ours(res: dict[str, Any] | None) -> str:
    return "failed" if res is None else f"{res['accuracy_percent']:.2f}"


def format_summary(summary: dict[str, Any]) -> str:
    """A markdown table: ours beside the paper's for every cell, with EER, AUC and privacy where run."""
    lines = [f"### {summary['title']}", ""]
    lines.append("| row | column | ours (%) | paper (%) | EER | AUC | rounds applied | privacy |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in summary["cells"]:
        res = cell["results"]
        privacy = "-"
        if res and res.get("privacy"):
            p = res["privacy"]
            privacy = (
                f"per round: paper {p['epsilon_round_paper']:.3g}, strict {p['epsilon_round_strict']:.3g}; "
                f"whole training (delta={p['delta']:g}): paper {p['epsilon_total_paper_composed']:.4g}, "
                f"strict {p['epsilon_total_strict']:.4g}"
            )
        eer = "-" if res is None else f"{100 * res['eer']:.1f}%"
        auc = "-" if res is None else f"{res['auc']:.3f}"
        applied = "-" if res is None else f"{res['rounds_applied']}/{res['rounds']}"
        lines.append(
            f"| {cell['row']} | {cell['column']} | {_ours(res)} | {cell['paper']:.2f} | {eer} | {auc} | "
            f"{applied} | {privacy} |"
        )
    return "\n".join(lines) + "\n"
