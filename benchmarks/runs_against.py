"""Whole ``fedveil run`` rounds of this code against another checkout's, side by side.

``python benchmarks/runs_against.py --base-src /tmp/before/src [--config configs/table1_fl_lr0.1.yaml]
[--rounds 100] [--threads 1] [--reps 3]`` runs the config for ``--rounds`` rounds (``runtime.threads``
set, evaluation only after the last round) ``--reps`` times with this checkout's ``src`` and with
``--base-src`` on ``PYTHONPATH`` (a ``git worktree`` of an older commit), each run in a fresh process and
the two alternating, and prints each run's median round time (``real_seconds`` of ``metrics.jsonl``),
the medians, their ratio and the ratio of each alternating pair. Used for issue 15's "FL-traditional
rounds at least 3x faster than today" (docs/benchmarks.md), against the code before the issue.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(src: Path, config: Path, rounds: int, threads: int) -> float:
    """Median seconds of a round of one ``fedveil run`` with ``src`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    sets = [f"rounds={rounds}", f"runtime.threads={threads}", f"eval.every={rounds * 10}"]
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "fedveil", "run", str(config), "--out", out, "--no-progress"]
        argv += [arg for s in sets for arg in ("--set", s)]
        subprocess.run(argv, env=env, capture_output=True, check=True, cwd=ROOT)
        lines = [json.loads(s) for s in Path(out, "metrics.jsonl").read_text().splitlines() if s]
    return statistics.median(x["real_seconds"] for x in lines if "round" in x and "real_seconds" in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", type=Path, required=True, help="the other checkout's src folder")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "table1_fl_lr0.1.yaml")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not (args.base_src / "fedveil").is_dir():
        parser.error(f"--base-src {args.base_src} has no fedveil package (pass a checkout's src folder)")
    found: dict[str, list[float]] = {"base": [], "now": []}
    for _ in range(args.reps):
        for name, src in (("base", args.base_src), ("now", ROOT / "src")):
            found[name].append(one_run(src, args.config, args.rounds, args.threads))
            print(f"{name} {found[name][-1]:.4f} s/round", flush=True)
    base, now = statistics.median(found["base"]), statistics.median(found["now"])
    pairs = [b / n for b, n in zip(found["base"], found["now"], strict=True)]
    print(
        json.dumps(
            {
                "config": str(args.config),
                "rounds": args.rounds,
                "threads": args.threads,
                "base_seconds": found["base"],
                "now_seconds": found["now"],
                "base_median": base,
                "now_median": now,
                "speedup": base / now,
                "pair_speedups": pairs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
