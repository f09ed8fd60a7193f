"""``fedveil privacy``: privacy accounting from the command line.

- ``fedveil privacy epsilon``: epsilon of ``--steps`` releases of the (Poisson-subsampled) Gaussian or
  Laplace mechanism at ``--delta``, in the spirit of TF-Privacy's ``compute_dp_sgd_privacy``.
- ``fedveil privacy fdml``: FDML Alg. 2 over a whole training: the Laplace scale ``b``, Thm V.1's
  per-round epsilon and what it composes to, next to the strict analysis (docs/privacy.md).
- ``fedveil privacy audit``: a canary audit of a DP mechanism as implemented (``gaussian``: FedAvg's
  ``ClipAndNoise``; ``fdml``: FDML Alg. 2; ``polifl``: PoliFL's central noise): the one-run epsilon lower
  bound of Steinke, Nasr and Jagielski (NeurIPS 2023) beside the accountant's epsilon
  (:mod:`fedveil.attacks.dp_audit`); ``--broken`` audits a deliberately miscalibrated run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedveil.enclave.dp import MODES as ACCOUNTINGS
from fedveil.errors import ConfigError
from fedveil.privacy.names import ACCOUNTANTS, AUDITED, BROKEN, DEFAULT_DELTA, MECHANISMS

RDP_ORDER_SETS = ("dp-accounting", "tf-privacy")


def register(subparsers: Any) -> None:
    """Add the ``privacy`` command with its ``epsilon``, ``fdml`` and ``audit`` sub-commands."""
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
    _register_audit(sub)
    p.set_defaults(func=run)


def _register_audit(sub: Any) -> None:
    a = sub.add_parser(
        "audit", help="canary audit: an empirical epsilon lower bound beside the accountant's epsilon"
    )
    a.add_argument("--mechanism", choices=AUDITED, required=True)
    a.add_argument("--canaries", type=int, default=1000, help="canaries, each IN with probability 1/2")
    a.add_argument("--k-plus", type=int, default=50, help="highest-scoring canaries guessed IN (default 50)")
    a.add_argument("--k-minus", type=int, default=50, help="lowest-scoring canaries guessed OUT (default 50)")
    a.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound")
    a.add_argument("--delta", type=float, default=DEFAULT_DELTA, help=f"default {DEFAULT_DELTA}")
    a.add_argument("--rounds", type=int, default=1, help="releases audited together (default 1)")
    a.add_argument("--noise-multiplier", type=float, default=2.0, help="z = sigma / S (gaussian, polifl)")
    a.add_argument("--clip-norm", type=float, default=1.0, help="clip norm S (gaussian, polifl)")
    a.add_argument("--fdml-mode", choices=ACCOUNTINGS, default="strict", help="fdml: clipping mode")
    a.add_argument("--T", dest="bound_T", type=float, default=1.0, help="fdml: clipping bound T")
    a.add_argument("--noise-b", type=float, default=1.0, help="fdml: Laplace scale b")
    a.add_argument("--drop-rate", type=float, default=0.0, help="fdml: embedding drop rate r")
    a.add_argument("--dim", type=int, default=8, help="fdml: derivative dimension d")
    a.add_argument("--canary-scale", type=float, default=10.0, help="canary update / clip bound (> 1)")
    a.add_argument(
        "--broken",
        choices=BROKEN,
        default=None,
        help="audit a deliberately broken run: noise 10x too small, or clipping that never binds",
    )
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Dispatch to the sub-command."""
    if args.privacy_command == "epsilon":
        return run_epsilon(args)
    if args.privacy_command == "audit":
        return run_audit(args)
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


def run_audit(args: argparse.Namespace) -> int:
    """Print the audit of one mechanism: the accountant's epsilon and the empirical lower bound."""
    from fedveil.attacks.dp_audit import audit_mechanism

    report = audit_mechanism(
        args.mechanism,
        canaries=args.canaries,
        k_plus=args.k_plus,
        k_minus=args.k_minus,
        confidence=args.confidence,
        delta=args.delta,
        rounds=args.rounds,
        noise_multiplier=args.noise_multiplier,
        clip_norm=args.clip_norm,
        fdml_mode=args.fdml_mode,
        bound_T=args.bound_T,
        noise_b=args.noise_b,
        drop_rate=args.drop_rate,
        dim=args.dim,
        canary_scale=args.canary_scale,
        broken=args.broken,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    r = report
    run = f"deliberately broken ({r.broken})" if r.broken else "as implemented"
    print(f"audit of {r.mechanism}, {run}: {r.rounds} release(s), seed {r.seed}")
    print(f"  accountant (upper bound): epsilon = {r.accountant_epsilon:.4g} at delta = {r.delta:g}")
    print(
        f"  empirical lower bound:    epsilon >= {r.empirical_epsilon_lower:.4g} with confidence "
        f"{r.confidence:g} ({r.correct_guesses} of {r.guesses} guesses correct on {r.canaries} canaries; "
        f"at most {r.max_auditable_epsilon:.4g} with these settings)"
    )
    if "paper_epsilon" in r.settings:
        paper = r.settings["paper_epsilon"]
        beyond = "below" if r.empirical_epsilon_lower <= paper else "ABOVE"
        print(f"  FDML Thm V.1's epsilon (the paper's analysis): {paper:.4g}; the lower bound is {beyond} it")
    verdict = "EXCEEDS the claim: not as private as accounted" if r.exceeds_claim else "within the claim"
    print(f"  method: {r.method}; lower bound {verdict}")
    return 0
