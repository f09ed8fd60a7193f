"""``fedveil ppfl transfer CONFIG``: PPFL Appendix A.1 / Fig. 8, transfer from public data.

For each public-data fraction ``f`` and each number ``k`` of last layer units the clients train, one
PPFL transfer run (:func:`~fedveil.experiments.ppfl.runner.run_ppfl` with ``public_fraction: f`` and
``ppfl.train_last: k``) over the config's ``ppfl.rounds_per_stage`` rounds (the paper fixes 20), in
``OUT/f<f>_last<k>/``; and once, end-to-end FedAvg over the same rounds on the clients' data only (the
paper's reference line), in ``OUT/e2e.jsonl``. A finished sub-run (its ``results.json`` exists) is not
run again, so an interrupted sweep resumes where it stopped. ``OUT/transfer.json`` collects the final
accuracies, the public model's own accuracy before federated training, and E2E's; ``OUT/transfer.png``
draws accuracy against ``k``, one line per fraction, as Fig. 8 does.

Everything trains on the config's ``device`` (:func:`~fedveil.models.device.resolve_device`): the
server's public model (:func:`~fedveil.experiments.ppfl.runner.train_central`), each PPFL run's REEs and
emulated client TEEs, and E2E FedAvg's clients; ``transfer.json`` records the resolved device. A sweep
folder's runs are all computed on one device: resuming it on another is refused, naming both
(:func:`~fedveil.experiments.checkpoint.claim_device`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedveil.core.atomic import atomic_write
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import claim_device
from fedveil.experiments.fedavg_images import split_images
from fedveil.experiments.plots import plot_series
from fedveil.experiments.ppfl.runner import PpflRun, run_ppfl, train_e2e
from fedveil.models.device import resolve_device

__all__ = ["run_transfer_sweep"]

SWEEP = ("e2e.jsonl", "f*_last*")
"""What an earlier sweep leaves in its folder (resumed from)."""


def run_transfer_sweep(
    run: PpflRun,
    out_dir: str | Path,
    fractions: Sequence[float],
    lasts: Sequence[int],
    *,
    progress: Callable[[str], None] | None = None,
    show_bar: bool = True,
) -> dict[str, Any]:
    """Run the sweep (module docstring) on ``run.device`` and return ``transfer.json``'s content. A device
    this machine lacks, or a sweep folder computed on another, fails before anything trains."""
    say = progress or (lambda _line: None)
    if not fractions or not lasts:
        raise ConfigError("a transfer sweep needs at least one public fraction and one train_last")
    base = replace(run, e2e=False, reach_e2e_rounds=None, pretrained=None)
    candidates = [
        replace(base, public_fraction=float(f), ppfl=replace(base.ppfl, train_last=int(k)))
        for f in fractions
        for k in lasts
    ]  # every setting is checked before anything trains
    where = resolve_device(run.device)
    out = Path(out_dir)
    claim_device(out, where, artefacts=SWEEP)
    rows = []
    for sub in candidates:
        folder = out / f"f{sub.public_fraction:g}_last{sub.ppfl.train_last}"
        done = folder / "results.json"
        if done.is_file():
            result = json.loads(done.read_text(encoding="utf-8"))
            say(f"{folder.name}: done before, accuracy {result['final_accuracy']}")
        else:
            result = run_ppfl(
                replace(sub, name=f"{run.name}/{folder.name}"), folder, show_bar=show_bar, resume=True
            )  # a setting cut off before continues after its last finished stage
            say(f"{folder.name}: accuracy {result['final_accuracy']}")
        rows.append(
            {
                "fraction": sub.public_fraction,
                "train_last": sub.ppfl.train_last,
                "public_samples": result["public"]["samples"],
                "public_accuracy": result["public"]["accuracy"],
                "final_accuracy": result["final_accuracy"],
                "rounds": result["rounds"],
                "bytes_up": result["bytes_up"],
                "bytes_down": result["bytes_down"],
                "tee_bytes_needed": result["stages"][0]["tee_bytes_needed"],
            }
        )
    e2e_path = out / "e2e.jsonl"
    if e2e_path.is_file():
        e2e = [json.loads(line) for line in e2e_path.read_text(encoding="utf-8").splitlines() if line]
    else:
        e2e = train_e2e(run, split_images(run.images()), run.ppfl.rounds_per_stage, show_bar)
        atomic_write(e2e_path, "".join(json.dumps(line, sort_keys=True) + "\n" for line in e2e).encode())
    e2e_accuracy = e2e[-1]["test_accuracy"]
    say(f"E2E FedAvg over {len(e2e)} rounds: accuracy {e2e_accuracy}")
    summary = {
        "name": run.name,
        "model": run.model,
        "data": run.data,
        "rounds": run.ppfl.rounds_per_stage,
        "device": str(where),
        "e2e_accuracy": e2e_accuracy,
        "runs": rows,
    }
    lasts_sorted = sorted({int(k) for k in lasts})
    series = {
        f"public fraction {f:g}": [
            (r["train_last"], r["final_accuracy"]) for r in rows if r["fraction"] == float(f)
        ]
        for f in fractions
    }
    series["E2E FedAvg (no public data)"] = [
        (lasts_sorted[0], e2e_accuracy),
        (lasts_sorted[-1], e2e_accuracy),
    ]
    plot_series(
        series,
        out / "transfer.png",
        title=f"PPFL transfer from public data: {run.model}, {run.ppfl.rounds_per_stage} rounds",
        ylabel="test accuracy",
        xlabel="last layer units trained in the clients' TEEs",
    )
    atomic_write(out / "transfer.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
    return summary
