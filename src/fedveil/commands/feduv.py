"""``fedveil feduv {run,bench}``: FedUV, FedAwS and softmax on MNIST-UV (Table 3), and client speed.

- ``fedveil feduv run [--scale small|paper] [--config YAML] [--set KEY=VALUE ...] [--methods
  feduv,fedaws,softmax] [--code-lengths 127,255,511] [--out DIR] [--rounds N] [--writers N]
  [--unseen-writers N] [--train-examples N] [--fraction F] [--width-divisor W] [--narrow-head] [--seed S]
  [--threads T] [--workers N] [--json] [--no-progress] [--resume | --overwrite]``
  trains every method (with ``--resume``, only those a run directory does not hold yet), writes the run
  directory (:func:`fedveil.experiments.feduv.runner.run_feduv`) and prints the AUC table.
- ``fedveil feduv bench [--clients N] [--width-divisor W] [--threads T] [--one-by-one] [--json]``
  measures FedAvg client updates per second on the MNIST-UV net.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fedveil.commands import add_device_argument
from fedveil.experiments.agent_options import add_feduv_agent_arguments
from fedveil.experiments.checkpoint import add_run_arguments, check_run_dir, run_sets
from fedveil.experiments.config import run_overrides
from fedveil.experiments.network_options import add_network_arguments, with_runtime
from fedveil.experiments.report import announce_stand_in


def register(subparsers: Any) -> None:
    """Add the ``feduv`` command with its ``run`` and ``bench`` actions."""
    p = subparsers.add_parser(
        "feduv", help="FedUV / FedAwS / softmax user verification on MNIST-UV (Table 3)"
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = actions.add_parser("run", help="train and evaluate the methods; write a run directory")
    r.add_argument("--scale", choices=("small", "paper"), default="small", help="preset (default: small)")
    r.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML of run settings laid over the preset, e.g. configs/feduv/quick.yaml (about a minute)",
    )
    r.add_argument("--methods", default=None, help="comma-separated subset of feduv,fedaws,softmax")
    r.add_argument("--code-lengths", default=None, help="FedUV code lengths (default: 127,255,511)")
    r.add_argument("--rounds", type=int, default=None, help="training rounds")
    r.add_argument("--writers", type=int, default=None, help="seen writers (users)")
    r.add_argument("--unseen-writers", type=int, default=None, help="writers never seen in training")
    r.add_argument("--train-examples", type=int, default=None, help="training examples per writer")
    r.add_argument("--fraction", type=float, default=None, help="fraction of users per round (epsilon)")
    r.add_argument("--width-divisor", type=int, default=None, help="divide Table 2's channels (1 = exact)")
    r.add_argument(
        "--narrow-head", action="store_true", default=None, help="divide the last block's 1024 channels too"
    )
    r.add_argument("--threads", type=int, default=None, help="torch threads per process (default: 1)")
    r.add_argument("--workers", type=int, default=None, help="processes training methods side by side")
    r.add_argument("--json", action="store_true", help="print results.json (no progress output)")
    add_run_arguments(r)
    add_network_arguments(r, default_agents=4, clients="users", ray=False)
    a = actions.add_parser("agent", help="run users of a FedUV run as a device agent (docs/deployment.md)")
    add_feduv_agent_arguments(a)
    b = actions.add_parser("bench", help="FedAvg client updates per second on the MNIST-UV net")
    b.add_argument("--clients", type=int, default=4, help="users updated together (default: 4)")
    b.add_argument("--width-divisor", type=int, default=1, help="1 = Table 2's net (default)")
    b.add_argument("--code-length", type=int, default=127, help="FedUV code length c (default: 127)")
    b.add_argument("--repeats", type=int, default=2, help="timed calls (default: 2)")
    b.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    b.add_argument("--one-by-one", action="store_true", help="one user at a time instead of vmap")
    add_device_argument(b, where="where the users train", default="cpu")
    b.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _table(results: dict[str, Any]) -> str:
    lines = [f"{'dataset type':<14}{'method':<11}{'AUC':>8}{'paper':>8}{'TPR@1e-2':>10}{'TPR@1e-3':>10}"]
    for kind, row in results["auc"].items():
        for label, auc in row.items():
            paper = results["paper_auc"].get(kind, {}).get(label)
            ev = results["methods"][label]["eval"][kind]
            lines.append(
                f"{kind:<14}{label:<11}{auc:>8.4f}{'' if paper is None else f'{paper:.3f}':>8}"
                f"{ev['tpr@fpr=0.01']:>10.3f}{ev['tpr@fpr=0.001']:>10.3f}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action; the work is in :mod:`fedveil.experiments.feduv.runner`."""
    from fedveil.experiments.feduv import runner as fr

    if args.action == "agent":
        return _agent(args)
    if args.action == "bench":
        doc = fr.bench_client_updates(
            clients=args.clients,
            width_divisor=args.width_divisor,
            code_length=args.code_length,
            repeats=args.repeats,
            batched=not args.one_by_one,
            threads=args.threads,
            device=args.device,
        )
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            print(
                f"{doc['client_updates_per_second']:.3f} client updates/s ({doc['clients']} clients x "
                f"{doc['repeats']}, {doc['num_params']:,} parameters, {doc['threads']} threads, on "
                f"{doc['device']})"
            )
        return 0
    base = fr.load_feduv_config(args.config, fr.SCALES[args.scale], run_overrides(run_sets(args)))
    cfg = fr.with_overrides(
        base,
        methods=None if args.methods is None else fr.parse_methods(args.methods),
        code_lengths=None
        if args.code_lengths is None
        else fr.parse_int_list(args.code_lengths, "code lengths"),
        rounds=args.rounds,
        writers=args.writers,
        unseen_writers=args.unseen_writers,
        train_examples=args.train_examples,
        fraction=args.fraction,
        width_divisor=args.width_divisor,
        narrow_head=args.narrow_head,
        threads=args.threads,
        workers=args.workers,
    )
    out = args.out or Path("runs") / cfg.name
    check_run_dir(out, resume=args.resume, overwrite=args.overwrite)
    announce_stand_in(
        "MNIST-UV drawn from synthetic handwriting (fedveil.data.mnist_uv), for FedUV's EMNIST",
        quiet=args.json,
    )
    results = with_runtime(
        args,
        lambda network: fr.run_feduv(
            cfg,
            out,
            progress=None if args.json else lambda line: print(line, file=sys.stderr),
            show_bar=not args.json and not args.no_progress,
            network=network,
            resume=args.resume,
            overwrite=args.overwrite,
        ),
    )
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        print(_table(results))
        print(f"run directory: {out}")
    return 0


def _agent(args: argparse.Namespace) -> int:
    """Serve users of one method of a FedUV run until the server says training is over."""

    import torch

    from fedveil.experiments.feduv.runner import agent_clients
    from fedveil.experiments.network_run import agent_host, parse_shard, serve_devices

    torch.set_num_threads(max(1, args.threads))
    pool = agent_clients(args.config, args.method, args.code_length, device=args.train_device)
    host = agent_host(
        args.server,
        pool,
        devices=args.device or None,
        shard=parse_shard(args.shard) if args.shard else None,
        credentials=args.credentials,
        insecure=args.insecure,
        give_up_after=args.give_up_after,
    )
    return serve_devices(host, "fedveil feduv agent")
