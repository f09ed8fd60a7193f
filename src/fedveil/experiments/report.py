"""Human-readable summaries of run results."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

STAND_IN = "SYNTHETIC STAND-IN"
"""What every run on synthetic data says first (:func:`announce_stand_in`)."""


def announce_stand_in(what: str, *, quiet: bool = False) -> None:
    """Print the banner of a run on synthetic stand-in data (``what``: which data, from where) before it
    trains: its numbers measure the code on made-up data, not the paper's claim. It leads the run's
    output on stdout, or goes to stderr for a ``quiet`` run, whose stdout carries only its result
    (``--json``)."""
    print(
        f"{STAND_IN}: {what} -- not real data; the numbers are no reproduction of the paper's",
        file=sys.stderr if quiet else sys.stdout,
        flush=True,
    )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def format_results(results: dict[str, Any], out_dir: str | Path) -> str:
    """A two-column table of a run's final metrics, and where its files are."""
    rows = [
        ("protocol", results["protocol"]),
        ("rounds (applied)", f"{results['rounds']} ({results['rounds_applied']})"),
        ("accuracy (Sec. VII-C)", f"{results['accuracy_percent']:.2f} %"),
        ("EER", f"{100 * results['eer']:.2f} %"),
        ("ROC AUC", f"{results['auc']:.4f}"),
    ]
    rows += [(f"TPR @ FPR={k}", f"{v:.3f}") for k, v in results.get("tpr_at_fpr", {}).items()]
    rows += [
        ("final loss", "-" if results.get("final_loss") is None else f"{results['final_loss']:.4f}"),
        ("dropouts", str(results["dropouts"])),
        ("bytes up / down", f"{_bytes(results['bytes_up'])} / {_bytes(results['bytes_down'])}"),
        ("simulated time", f"{results['sim_seconds']:.1f} s"),
        ("real time", f"{results['real_seconds']:.1f} s ({results['rounds_per_second']:.2f} rounds/s)"),
    ]
    privacy = results.get("privacy")
    if privacy:
        rows += [
            (
                "DP (Alg. 2)",
                f"{privacy['dp_mode']} mode, T={privacy['bound_T']:g}, r={privacy['drop_rate']:g}, "
                f"b={privacy['noise_b']:.4g}",
            ),
            (
                "epsilon per round",
                f"paper (Thm V.1) {privacy['epsilon_round_paper']:.4g}, "
                f"strict {privacy['epsilon_round_strict']:.4g}",
            ),
            (
                f"epsilon whole training (delta={privacy['delta']:g})",
                f"paper composed {privacy['epsilon_total_paper_composed']:.4g}, "
                f"strict {privacy['epsilon_total_strict']:.4g} "
                f"(selection prob. {privacy['participation_rate']:.4g})",
            ),
        ]
    if results.get("stopped"):
        rows.append(("stopped", results["stopped"]))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append(f"{'run directory'.ljust(width)}  {out_dir}")
    return "\n".join(lines)
