"""The table of a ``scripts/gpu-check`` run: each measure on the GPU beside the CPU's of the same call.

``python benchmarks/gpu_table.py OUT`` reads the JSON results ``scripts/gpu-check`` appended to
``OUT/results.jsonl`` (a line per step and device) and the GPU and torch it named in
``OUT/gpu-check.log``, and prints a Markdown table for docs/benchmarks.md: per measure, the figure on
``cuda``, the figure on the ``cpu``, and the GPU's speed-up (rates: cuda over cpu; seconds: cpu over
cuda). A measure a step did not produce on a device (skipped, failed or cut off) is ``not run``; nothing
is estimated. Standard library only: it runs wherever the check's files are, with or without fedveil
installed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEVICES = ("cuda", "cpu")

Pick = Callable[[dict[str, Any]], float | None]


def _rows(result: dict[str, Any], **match: Any) -> Iterator[dict[str, Any]]:
    for row in result.get("rows", []):
        if all(row.get(k) == v for k, v in match.items()):
            yield row


def _first(result: dict[str, Any], field: str, **match: Any) -> float | None:
    return next((float(r[field]) for r in _rows(result, **match) if field in r), None)


def _get(*path: str) -> Pick:
    def pick(result: dict[str, Any]) -> float | None:
        value: Any = result
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return float(value) if isinstance(value, int | float) else None

    return pick


#: (step, measure, "rate" or "seconds", how the figure is read off the step's JSON)
MEASURES: list[tuple[str, str, str, Pick]] = [
    ("bench-fedavg", "FedAvg client updates/s, batched (vmap)", "rate", _get("batched_updates_per_second")),
    ("bench-fedavg", "FedAvg client updates/s, one by one", "rate", _get("one_by_one_updates_per_second")),
    (
        "bench-mobilefacenet",
        "MobileFaceNet images/s, BatchNorm training",
        "rate",
        lambda r: _first(r, "images_per_second", batchnorm="training"),
    ),
    (
        "bench-mobilefacenet",
        "MobileFaceNet images/s, BatchNorm frozen",
        "rate",
        lambda r: _first(r, "images_per_second", batchnorm="frozen"),
    ),
    ("bench-rounds", "FDML rounds/s (lr 1e-4)", "rate", _get("rounds_per_second")),
    ("bench-rounds", "FDML floor, s/round (lr 1e-4)", "seconds", _get("floor_seconds")),
    ("bench-rounds", "FDML fraction of the floor (lr 1e-4)", "fraction", _get("fraction_of_floor")),
    ("bench-rounds", "FDML rounds/s (trained)", "rate", _get("trained", "rounds_per_second")),
    ("bench-rounds", "FDML floor, s/round (trained)", "seconds", _get("trained", "floor_seconds")),
    (
        "bench-rounds",
        "FDML fraction of the floor (trained)",
        "fraction",
        _get("trained", "fraction_of_floor"),
    ),
    (
        "aiot-step",
        "AIoT run (pre-training, fine-tuning, evaluation), s",
        "seconds",
        _get("seconds_this_session"),
    ),
    ("ppfl-step", "PPFL run (REEs and emulated client TEEs), s", "seconds", _get("seconds")),
    (
        "bench-scale",
        "FedAvg at scale, s/round (in-process)",
        "seconds",
        lambda r: _first(r, "seconds_per_round"),
    ),
    (
        "bench-peers",
        "fedveil's peers row, s/round",
        "seconds",
        lambda r: _first(r, "seconds_per_round", framework="fedveil"),
    ),
    (
        "bench-peers",
        "fedveil's peers row, fraction of the floor",
        "fraction",
        lambda r: _first(r, "fraction_of_floor", framework="fedveil"),
    ),
]


def load_results(out: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The JSON result of each step and device that finished, from ``out/results.jsonl`` (the last line
    of a step and device wins; a line cut off mid-write, or of a failed step, is skipped)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        lines = (out / "results.jsonl").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("ok") and isinstance(entry.get("result"), dict):
            found[(str(entry.get("step")), str(entry.get("device")))] = entry["result"]
    return found


def _cell(value: float | None, kind: str) -> str:
    if value is None:
        return "not run"
    if kind == "fraction":
        return f"{value:.3f}"
    return f"{value:.4g}"


def machine_line(out: Path) -> str:
    """The GPU and torch ``scripts/gpu-check`` named in its log (``unknown`` without one)."""
    try:
        log = (out / "gpu-check.log").read_text()
    except OSError:
        return "GPU: unknown (no gpu-check.log)"
    found = re.search(r"^gpu-check: torch (\S+) on (.+)$", log, re.MULTILINE)
    return f"GPU: {found.group(2)}, torch {found.group(1)}" if found else "GPU: unknown (dry run or no CUDA)"


def step_commands(out: Path) -> list[tuple[str, str]]:
    """``(step on device, command)`` of every step ``scripts/gpu-check`` started, as its log says."""
    try:
        log = (out / "gpu-check.log").read_text()
    except OSError:
        return []
    return re.findall(r"^gpu-check: (.+? on (?:cuda|cpu)) \(limit \d+ s\): (.*)$", log, re.MULTILINE)


def gpu_table(out: Path) -> str:
    """The Markdown table of the results in ``out`` (module docstring), then each step's command."""
    lines = [
        machine_line(out),
        "",
        "| measure | cuda | cpu | GPU speed-up |",
        "|---|---:|---:|---:|",
    ]
    results = load_results(out)
    for step, measure, kind, pick in MEASURES:
        values = {}
        for device in DEVICES:
            result = results.get((step, device))
            values[device] = pick(result) if result is not None else None
        cuda, cpu = values["cuda"], values["cpu"]
        ratio = "n/a"
        if cuda and cpu and kind != "fraction":
            ratio = f"{cuda / cpu:.2f}x" if kind == "rate" else f"{cpu / cuda:.2f}x"
        lines.append(f"| {measure} | {_cell(cuda, kind)} | {_cell(cpu, kind)} | {ratio} |")
    commands = step_commands(out)
    if commands:
        lines += ["", "Commands (from gpu-check.log):", ""]
        lines += [f"- {step}: `{command}`" for step, command in commands]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: python benchmarks/gpu_table.py OUT (the folder scripts/gpu-check wrote)", file=sys.stderr
        )
        return 2
    sys.stdout.write(gpu_table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
