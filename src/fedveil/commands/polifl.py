"""``fedveil polifl``: PoliFL's policy-compliant federated learning.

- ``fedveil polifl run CONFIG [--out DIR] [--set KEY=VALUE ...] [--seed S] [--strategies S,...]
  [--rounds R] [--json] [--no-progress] [--resume | --overwrite]``: the compliance strategies of Sec. 6
  (cascaded, combined, single group) with per-group DP and policy enforcement on devices and server
  (:func:`fedveil.experiments.polifl.runner.run_polifl`);
  prints each strategy's final metric, each group's epsilon and whether its model was released;
  ``--resume`` continues the run in its output folder.
- ``fedveil polifl table4 [--json]``: Table 4 recomputed under two readings of its columns beside the
  paper's figures (:func:`fedveil.experiments.polifl.table4.table4`).
- ``fedveil polifl scale [--devices N] [--rounds R] [--tasks text,images,mpu] [--tte-scale F]
  [--processes P] [--out DIR] [--json] [--seed S]``: Sec. 5.3 / 5.4's TTD, TTE, TTR and TTP (Fig. 4: one
  device, R rounds per task; Fig. 5: one round of N simultaneous devices with TTE replayed from the
  paper's distribution times F) over the networked runtime on loopback
  (:func:`fedveil.experiments.polifl.scale.measure_scale`); writes ``results.json``, ``fig4.png`` and
  ``fig5.png`` under DIR.
- ``fedveil polifl agent --server HOST:PORT --device NAME ... (--population KIND:SIZE | --data FILE.npz)
  (--policy TEXT | --policy-file FILE.json) --credentials DIR [--train-device D]``: policy-enforcing
  devices for a service started with ``fedveil serve --devices-listen``
  (:func:`fedveil.service.network.serve_agent`), training on ``D`` (default ``cpu``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedveil.commands import device_spec
from fedveil.experiments.checkpoint import add_run_arguments, run_sets
from fedveil.experiments.config import run_overrides


def register(subparsers: Any) -> None:
    """Add the ``polifl`` command with its ``run``, ``table4``, ``scale`` and ``agent`` actions."""
    p = subparsers.add_parser("polifl", help="PoliFL: per-group DP, compliance strategies, Table 4")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = actions.add_parser("run", help="cascaded / combined / single-group training with per-group epsilon")
    r.add_argument("config", type=Path, help="YAML settings, e.g. configs/polifl/small.yaml")
    add_run_arguments(r)
    r.add_argument("--strategies", help="comma-separated strategies (default: the config's)")
    r.add_argument("--rounds", type=int, help="rounds per group stage (default: the config's)")
    r.add_argument("--json", action="store_true", help="print results.json (no progress output)")
    t = actions.add_parser("table4", help="Table 4: privacy spent per group, two readings vs the paper")
    t.add_argument("--json", action="store_true", help="print JSON")
    s = actions.add_parser(
        "scale",
        help="Sec. 5.3/5.4 (Fig. 4, Fig. 5): TTD/TTE/TTR/TTP over mutual TLS on loopback",
        description="Fig. 4: one device trains --rounds rounds of each task's model; Fig. 5: one round "
        "with --devices simultaneous devices per task that return a pre-computed update after a TTE "
        "replayed from the paper's Raspberry Pi distribution times --tte-scale. A gRPC server with mutual "
        "TLS (throw-away PKI) and device agents in --processes processes on 127.0.0.1.",
    )
    s.add_argument("--devices", type=int, default=100, help="Fig. 5's simultaneous devices (default 100)")
    s.add_argument("--rounds", type=int, default=100, help="Fig. 4's rounds per task (default 100)")
    s.add_argument("--tasks", default="text,images,mpu", help="comma-separated tasks (default all three)")
    s.add_argument(
        "--tte-scale",
        type=float,
        default=0.01,
        help="factor on the paper's TTE mean and std in Fig. 5's replay (default 0.01: seconds, not minutes)",
    )
    s.add_argument("--processes", type=int, default=4, help="agent processes (default 4)")
    s.add_argument("--out", type=Path, default=Path("runs/polifl_scale"), help="output folder")
    s.add_argument("--seed", type=int, default=0, help="seed of the replayed TTEs and the tasks (default 0)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON (no progress output)")
    a = actions.add_parser(
        "agent",
        help="policy-enforcing devices for a `fedveil serve --devices-listen` service (docs/service.md)",
        description="Host devices that dial the service's device port over mutual TLS, each holding its "
        "own data and its own policy and enforcing it on the device (the job's local program runs in the "
        "sandbox here; only job acceptances and clipped model updates leave).",
    )
    a.add_argument("--server", required=True, help="the service's device port, HOST:PORT")
    a.add_argument("--device", action="append", default=[], help="a device to host (repeatable)")
    a.add_argument("--kind", default="mpu", help="the kind of data the devices hold: mpu, images, text")
    a.add_argument("--population", default=None, help="simulated users' data: KIND:SIZE (e.g. mpu:40)")
    a.add_argument("--data", type=Path, default=None, help="one device's own data: .npz with x, y (...)")
    a.add_argument("--policy", default=None, help="the devices' own policy (paper syntax)")
    a.add_argument("--policy-file", type=Path, default=None, help="JSON: device name -> its policy")
    a.add_argument(
        "--credentials", type=Path, default=None, help="DIR/<device>/{device.crt,device.key,ca.crt}"
    )
    a.add_argument("--server-name", default=None, help="TLS name to expect in the server certificate")
    a.add_argument("--insecure", action="store_true", help="plaintext, unauthenticated (not for real use)")
    a.add_argument("--give-up-after", type=float, default=None, help="exit after this long without a server")
    a.add_argument(
        "--program-seconds", type=float, default=10.0, help="local program time limit (default 10)"
    )
    a.add_argument("--program-memory-mb", type=int, default=1024, help="local program memory (default 1024)")
    a.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    a.add_argument(
        "--train-device",
        type=device_spec,
        default="cpu",
        help="where the hosted devices train: auto (CUDA when available), cpu, cuda or cuda:N (default cpu: "
        "an agent stands in for phones, which train on their own processor; a device this machine lacks "
        "is refused before the agent dials the server)",
    )
    p.set_defaults(func=run)


def _fmt(eps: float) -> str:
    return f"{eps:.3g}" if eps < 1e6 else ("inf" if eps == float("inf") else f"{eps:.2e}")


def _run(args: argparse.Namespace) -> int:
    from fedveil.experiments.polifl.runner import load_polifl_run, run_polifl

    cfg = load_polifl_run(args.config, run_overrides(run_sets(args), {"rounds": args.rounds}))
    strategies = (
        tuple(s.strip() for s in args.strategies.split(",") if s.strip()) if args.strategies else None
    )
    out = args.out or Path("runs") / cfg.name
    results = run_polifl(
        cfg,
        out,
        strategies=strategies,
        progress=not (args.json or args.no_progress),
        resume=args.resume,
        overwrite=args.overwrite,
    )
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
    from fedveil.experiments.polifl.table4 import table4

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


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _scale(args: argparse.Namespace) -> int:
    from fedveil.experiments.polifl.scale import measure_scale, summary

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    results = measure_scale(
        devices=args.devices,
        rounds=args.rounds,
        tasks=tasks,
        tte_scale=args.tte_scale,
        processes=args.processes,
        seed=args.seed,
        out=args.out,
        progress=not args.json,
    )
    if args.json:
        print(json.dumps(summary(results), indent=2))
        return 0
    cfg = results["settings"]
    print(
        f"Fig. 4: one device, {cfg['rounds']} rounds per task ({cfg['fig4_devices']}); milliseconds p50 / max"
    )
    for t, r in results["fig4"].items():
        parts = "  ".join(
            f"{k.upper()} {_ms(r[k]['p50'])} / {_ms(r[k]['max'])}" for k in ("ttd", "tte", "ttr", "ttp")
        )
        print(f"  {t:<7} {r['bytes_down'] / 1e6:6.2f} MB  {parts}  FedAvg {_ms(r['aggregate']['p50'])}")
    print(
        f"Fig. 5: one round, {cfg['devices']} simultaneous devices ({cfg['fig5_devices']}), "
        f"TTE = paper x {cfg['tte_scale']:g}; seconds p50 / max"
    )
    for t, r in results["fig5"].items():
        parts = "  ".join(f"{k.upper()} {r[k]['p50']:.3f} / {r[k]['max']:.3f}" for k in ("ttd", "tte", "ttr"))
        print(
            f"  {t:<7} {parts}  round {r['round_seconds']:.2f} s vs slowest device "
            f"{r['slowest_device_seconds']:.2f} s ({r['replies']}/{r['devices']} replies)"
        )
    cpus, wall = results["machine"]["cpus"], results["wall_seconds"]
    print(f"(loopback, {cpus} CPUs, {wall:.0f} s) written to {args.out}")
    return 0


def _agent(args: argparse.Namespace) -> int:
    import logging

    import torch

    from fedveil.service.network import read_policies, serve_agent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    return serve_agent(
        args.server,
        kind=args.kind,
        devices=args.device,
        policies=read_policies(args.device, args.policy, args.policy_file),
        population=args.population,
        data_file=args.data,
        credentials=args.credentials,
        insecure=args.insecure,
        server_name=args.server_name,
        give_up_after=args.give_up_after,
        program_seconds=args.program_seconds,
        program_memory=args.program_memory_mb << 20,
        device=args.train_device,
    )


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action."""
    if args.action == "scale":
        return _scale(args)
    if args.action == "agent":
        return _agent(args)
    return _run(args) if args.action == "run" else _table4(args)
