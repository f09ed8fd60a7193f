"""``fedveil privacy``: privacy accounting from the command line.

- ``fedveil privacy epsilon``: epsilon of ``--steps`` releases of the (Poisson-subsampled) Gaussian or
  Laplace mechanism at ``--delta``, in the spirit of TF-Privacy's ``compute_dp_sgd_privacy``.
- ``fedveil privacy fdml``: FDML Alg. 2 over a whole training: the Laplace scale ``b``, Thm V.1's
  per-round epsilon and what it composes to, next to the strict analysis (docs/privacy.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedveil.enclave.dp import MODES as ACCOUNTINGS
from fedveil.errors import ConfigError
from fedveil.privacy.names import ACCOUNTANTS, DEFAULT_DELTA, MECHANISMS

RDP_ORDER_SETS = ("dp-accounting", "tf-privacy")


def register(subparsers: Any) -> None:
    """Add the ``privacy`` command with its ``epsilon`` and ``fdml`` sub-commands."""
    p = subparsers.add_parser("privacy", help="privacy accounting: epsilon of DP releases, FDML budgets")
    sub = p.add_subparsers(dest="privacy_command", metavar="SUBCOMMAND", required=True)

    e = sub.add_parser("epsilon", help="epsilon of repeated (subsampled) Gaussian or Laplace releases")
    e.add_argument("--mechanism", choices=MECHANISMS, required=True)
    e.add_argument(
        "--noise-multiplier",
        type=float,
        required=True,
        help="noise standard deviation / L2 sensitivity (gaussian) or scale b / L1 sensitivity (laplace)",
    )
    e.add_argument("--sampling-rate", type=float, default=1.0, help="Poisson sampling rate q (default 1)")
    e.add_argument("--steps", type=int, required=True, help="number of releases composed")
    e.add_argument("--delta", type=float, required=True)
    e.add_argument("--accountant", choices=ACCOUNTANTS, default="pld", help="default: pld")
    e.add_argument(
        "--rdp-orders",
        choices=RDP_ORDER_SETS,
        default="dp-accounting",
        help="RDP orders (tf-privacy: those of compute_dp_sgd_privacy)",
    )
    e.add_argument(
        "--pld-interval", type=float, default=None, help="PLD discretisation interval (default 1e-4)"
    )
    e.add_argument("--json", action="store_true", help="print one JSON object")

    f = sub.add_parser("fdml", help="FDML Alg. 2: noise scale b and the epsilon of a whole training")
    f.add_argument("--T", dest="bound_T", type=float, required=True, help="clipping bound T of Alg. 2")
    f.add_argument("--drop-rate", type=float, required=True, help="embedding drop rate r of Alg. 2")
    given = f.add_mutually_exclusive_group(required=True)
    given.add_argument("--round-epsilon", type=float, help="the paper's per-round epsilon (Thm V.1)")
    given.add_argument("--noise-b", type=float, help="the Laplace scale b")
    given.add_argument("--target-epsilon", type=float, help="whole-training epsilon at --delta")
    f.add_argument(
        "--target-accounting",
        choices=ACCOUNTINGS,
        default="strict",
        help="accounting that --target-epsilon applies to (default: strict)",
    )
    f.add_argument("--rounds", type=int, required=True, help="training rounds that release derivatives")
    f.add_argument(
        "--participants", type=int, required=True, help="users addressed per round (num_required * k)"
    )
    users = f.add_mutually_exclusive_group(required=True)
    users.add_argument("--users", type=int, help="training users (groups of equal size)")
    users.add_argument(
        "--group-sizes", help="users per group (phone model), comma-separated, e.g. 507,333,287,270"
    )
    f.add_argument("--delta", type=float, default=DEFAULT_DELTA, help=f"default {DEFAULT_DELTA}")
    f.add_argument(
        "--samples", type=int, default=8, help="derivative vectors one participant receives per round"
    )
    f.add_argument("--dim", type=int, default=64, help="embedding dimension d (default 64, TouchAuth)")
    f.add_argument(
        "--protected-samples",
        type=int,
        default=1,
        help="samples of one user the neighbouring relation changes per round (1: sample-level)",
    )
    f.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the sub-command."""
    if args.privacy_command == "epsilon":
        return run_epsilon(args)
    return run_fdml(args)


def run_epsilon(args: argparse.Namespace) -> int:
    """Print the epsilon of ``--steps`` releases."""
    from fedveil.privacy.accounting import TF_PRIVACY_RDP_ORDERS, Accountant, GaussianRelease, LaplaceRelease

    if args.mechanism == "gaussian":
        event: GaussianRelease | LaplaceRelease = GaussianRelease(
            args.noise_multiplier, args.sampling_rate, args.steps
        )
    else:
        event = LaplaceRelease(1.0, args.noise_multiplier, args.sampling_rate, args.steps)
    orders = TF_PRIVACY_RDP_ORDERS if args.rdp_orders == "tf-privacy" else None
    acc = Accountant(args.accountant, value_discretization_interval=args.pld_interval, rdp_orders=orders)
    acc.compose(event)
    eps = acc.epsilon(args.delta)
    result = {
        "epsilon": eps,
        "delta": args.delta,
        "accountant": args.accountant,
        "mechanism": args.mechanism,
        "noise_multiplier": args.noise_multiplier,
        "sampling_rate": args.sampling_rate,
        "steps": args.steps,
    }
    if args.json:
        print(json.dumps(result))
    else:
        sampled = "Poisson-subsampled " if args.sampling_rate < 1 else ""
        print(
            f"epsilon = {eps:.6g} at delta = {args.delta:g} ({args.accountant} accountant): {args.steps} "
            f"releases of the {sampled}{args.mechanism} mechanism, noise multiplier "
            f"{args.noise_multiplier:g}, sampling rate {args.sampling_rate:g}"
        )
    return 0


def _group_sizes(args: argparse.Namespace) -> list[int]:
    if args.group_sizes is None:
        return [args.users]
    try:
        return [int(part) for part in args.group_sizes.split(",")]
    except ValueError:
        raise ConfigError(
            f"--group-sizes {args.group_sizes!r} must be comma-separated integers, e.g. 507,333,287,270"
        ) from None


def run_fdml(args: argparse.Namespace) -> int:
    """Print the FDML privacy summary."""
    from fedveil.privacy.ledger import fdml_participation_rate, fdml_privacy_summary

    q = fdml_participation_rate(num_addressed=args.participants, group_sizes=_group_sizes(args))
    summary = fdml_privacy_summary(
        bound_T=args.bound_T,
        drop_rate=args.drop_rate,
        rounds=args.rounds,
        participation_rate=q,
        delta=args.delta,
        vectors_received=args.samples,
        dim=args.dim,
        protected_samples=args.protected_samples,
        round_epsilon=args.round_epsilon,
        noise_b=args.noise_b,
        target_epsilon=args.target_epsilon,
        target_accounting=args.target_accounting,
    )
    if args.json:
        print(json.dumps(summary))
        return 0
    s = summary
    print(
        f"FDML Alg. 2: T = {s['bound_T']:g}, r = {s['drop_rate']:g}, b = {s['noise_b']:.6g} "
        f"({s['calibrated']}); {s['rounds']} rounds, participation rate q = {s['participation_rate']:.6g}, "
        f"delta = {s['delta']:g}"
    )
    print(
        f"  paper (Thm V.1): {s['epsilon_round_paper']:.6g} per round; over the training "
        f"{s['epsilon_total_paper_composed']:.6g} (PLD), {s['epsilon_total_paper_basic']:.6g} (basic sum)"
    )
    print(
        f"  strict (L1 clipping, sensitivity 2 T n): {s['epsilon_round_strict']:.6g} per round; "
        f"{s['epsilon_total_strict']:.6g} over the training (PLD)"
    )
    print(
        f"  strict analysis of per-coordinate clipping (sensitivity 2 T d n): "
        f"{s['epsilon_round_strict_paper_clipping']:.6g} per round; "
        f"{s['epsilon_total_strict_paper_clipping']:.6g} over the training (PLD)"
    )
    return 0
