"""``fedveil polifl``: PoliFL's policy-compliant federated learning (003_d27972a5478cff69.txt).

- ``fedveil polifl run CONFIG [--out DIR] [--strategies S,...] [--rounds R] [--json]``: the compliance
  strategies of Sec. 6 (cascaded, combined, single group) with per-group DP and policy enforcement on
  devices and server (:func:`fedveil.experiments.polifl.run_polifl`); prints each strategy's final
  metric, each group's epsilon and whether its model was released; resumable in its output folder.
- ``fedveil polifl table4 [--json]``: Table 4 recomputed under two readings of its columns beside the
  paper's figures (:func:`fedveil.experiments.polifl_table4.table4`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``polifl`` command with its ``run`` and ``table4`` actions."""
    p = subparsers.add_parser("polifl", help="PoliFL: per-group DP, compliance strategies, Table 4")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = actions.add_parser("run", help="cascaded / combined / single-group training with per-group epsilon")
    r.add_argument("config", type=Path, help="YAML settings, e.g. configs/polifl/small.yaml")
    r.add_argument("--out", type=Path, help="output folder (default runs/<name>); a rerun resumes there")
    r.add_argument("--strategies", help="comma-separated strategies (default: the config's)")
    r.add_argument("--rounds", type=int, help="rounds per group stage (default: the config's)")
    r.add_argument("--json", action="store_true", help="print results.json (no progress output)")
    t = actions.add_parser("table4", help="Table 4: privacy spent per group, two readings vs the paper")
    t.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _fmt(eps: float) -> str:
    return f"{eps:.3g}" if eps < 1e6 else ("inf" if eps == float("inf") else f"{eps:.2e}")


def _run(args: argparse.Namespace) -> int:
    from fedveil.experiments.polifl import load_polifl_run, run_polifl

    cfg = load_polifl_run(args.config, {"rounds": args.rounds} if args.rounds is not None else None)
    strategies = (
        tuple(s.strip() for s in args.strategies.split(",") if s.strip()) if args.strategies else None
    )
    out = args.out or Path("runs") / cfg.name
    results = run_polifl(cfg, out, strategies=strategies, progress=not args.json)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return 0
    metric = results["metric"]
    print(results["description"])
    for name, r in results["strategies"].items():
        eps = ", ".join(f"{g} {_fmt(v['epsilon'])}" for g, v in r["privacy"].items() if v["rounds"])
        final = "n/a" if r["final"] is None else f"{r['final']:.4f}"
        status = "released" if r["released"] else f"NOT released: {r['stopped']}"
        print(f"{name:<14} {r['rounds']:>5} rounds  {metric} {final}  epsilon: {eps}  ({status})")
    print(f"(epsilon at delta {cfg.delta:g}, {cfg.accounting}) written to {out}")
    return 0


def _table4(args: argparse.Namespace) -> int:
    from fedveil.experiments.polifl_table4 import table4

    result = table4()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for reading, block in result["readings"].items():
        zs = ", ".join(f"noise {k}: z={v:.4g}" for k, v in block["z"].items())
        print(f"reading {reading} ({block['method']}; {zs})")
        for row in block["rows"]:
            e, p = row["epsilon"], row["paper"]
            print(
                f"  {row['row']}. {row['dataset']:<22} Gr1 {e['Gr1']:.3g} (paper {p['Gr1']}), "
                f"Gr2 {e['Gr2']:.3g} (paper {p['Gr2']})  satisfies: {'yes' if row['satisfies'] else 'no'}"
            )
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action."""
    return _run(args) if args.action == "run" else _table4(args)
