"""``fedveil bench BENCH ...``: speed and memory benchmarks, printed as a table or ``--json``.

``fedveil bench enclave --participants 64,128,256,512 --samples 8 --dim 64 --strategy batch-all
[--repeats 5] [--seed 0] [--margin 1.0] [--embeddings both] [--json]`` times FDML Alg. 1 in the enclave
beside the paper's Table V, on synthetic embeddings and on those of a short FDML run's trained network
(:mod:`fedveil.experiments.bench.enclave`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedveil.commands import device_spec
from fedveil.enclave.triplet import DEFAULT_MEMORY_LIMIT_BYTES, STRATEGIES
from fedveil.errors import ConfigError
from fedveil.experiments.bench.enclave import TRAINED_LR, TRAINED_ROUNDS
from fedveil.experiments.fdml.triplet_reference import REFERENCE_MEMORY_BYTES
from fedveil.models.device import resolve_device


def register(subparsers: Any) -> None:
    """Add the ``bench`` command; each benchmark is a sub-command of it."""
    parser = subparsers.add_parser(
        "bench",
        help="measure speed and memory: enclave Alg. 1 (FDML Table V), FDML rounds, the codec, the network",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _add_enclave(benches)
    _add_rounds(benches)
    _add_codec(benches)
    _add_network(benches)
    _add_fedavg(benches)
    _add_ppfl(benches)
    _add_mobilefacenet(benches)
    _add_policy(benches)
    _add_polifl(benches)
    _add_dlg(benches)
    _add_scale(benches)
    _add_peers(benches)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    return int(args.bench_func(args))


def _add_device(p: Any) -> None:
    """Add ``--device`` (:func:`~fedveil.models.device.resolve_device`) to the benchmark parser ``p``."""
    p.add_argument(
        "--device",
        type=device_spec,
        default="cpu",
        help="where the benchmark trains: cpu (default), cuda, cuda:N or auto (CUDA when available)",
    )


def _participants(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every participant count must be >= 2")
    return counts


def _add_enclave(sub: Any) -> None:
    p = sub.add_parser(
        "enclave",
        help="time FDML Alg. 1 (triplet loss and derivatives) beside the paper's Table V",
        description="Time fedveil.enclave.triplet.loss_and_derivatives on clustered float32 embeddings, "
        "with peak memory, the error against a brute-force float64 reference, and FDML Table V.",
    )
    p.add_argument(
        "--participants", type=_participants, default=[64, 128, 256, 512], help="comma-separated counts"
    )
    p.add_argument("--samples", type=int, default=8, help="embeddings per participant (default 8)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default="batch-all", help="triplet strategy")
    p.add_argument("--margin", type=float, default=1.0, help="triplet margin (default 1.0)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per size; the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the embeddings")
    p.add_argument(
        "--memory-limit-mib",
        type=float,
        default=DEFAULT_MEMORY_LIMIT_BYTES / 2**20,
        help="working memory allowed to Alg. 1 (default 96)",
    )
    p.add_argument(
        "--reference-limit-mib",
        type=float,
        default=REFERENCE_MEMORY_BYTES / 2**20,
        help="memory the brute-force reference may use; larger sizes skip it (default 2048)",
    )
    p.add_argument(
        "--boundary",
        choices=("none", "process", "inprocess"),
        default="none",
        help="none: Alg. 1 called directly; process/inprocess: through the emulated TEE (sealing, "
        "framing, IPC, the enclave's memory metering) beside the direct call",
    )
    p.add_argument(
        "--embeddings",
        choices=("both", "synthetic", "trained"),
        default="both",
        help="synthetic: clustered unit vectors, --dim wide; trained: the network of a short FDML run "
        "(--train-rounds at --train-lr) embedding --samples training samples of each of --participants "
        "users (64 wide: --dim must be 64); both (default): a row of each, side by side",
    )
    p.add_argument(
        "--train-rounds",
        type=int,
        default=TRAINED_ROUNDS,
        help=f"rounds of the FDML run behind trained embeddings (default {TRAINED_ROUNDS})",
    )
    p.add_argument(
        "--train-lr",
        type=float,
        default=TRAINED_LR,
        help=f"its learning rate (default {TRAINED_LR:g}, configs/table1_fdml.yaml's)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of that FDML run (e.g. data.train_users_per_model=[6, 6])",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.set_defaults(bench_func=_run_enclave)


def _embedding_sources(args: argparse.Namespace) -> list[Any]:
    """The sources ``--embeddings`` names; a trained source builds its population (and checks the sizes)
    here, and trains at its first draw."""
    from fedveil.experiments.bench.enclave import SYNTHETIC, TrainedEmbeddings

    sources: list[Any] = [SYNTHETIC] if args.embeddings in ("both", "synthetic") else []
    if args.embeddings in ("both", "trained"):
        trained = TrainedEmbeddings(args.overrides, rounds=args.train_rounds, lr=args.train_lr)
        trained.check(args.participants, args.samples, args.dim)
        sources.append(trained)
    return sources


def _run_enclave(args: argparse.Namespace) -> int:
    if args.memory_limit_mib <= 0 or args.reference_limit_mib <= 0:
        raise ConfigError(
            f"--memory-limit-mib {args.memory_limit_mib} and --reference-limit-mib "
            f"{args.reference_limit_mib} must be > 0"
        )
    if args.boundary != "none":
        return _run_boundary(args)
    from fedveil.experiments.bench.enclave import bench_enclave

    rows = bench_enclave(
        args.participants,
        args.samples,
        args.dim,
        args.strategy,
        repeats=args.repeats,
        seed=args.seed,
        reference_limit=int(args.reference_limit_mib * 2**20),
        margin=args.margin,
        memory_limit_bytes=int(args.memory_limit_mib * 2**20),
        sources=_embedding_sources(args),
    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"FDML Alg. 1, {args.strategy}, margin {args.margin}, "
        f"{args.samples} samples per participant, {args.dim} dims, float32"
    )
    header = (
        "participants",
        "source",
        "embeddings",
        "ours (s)",
        "paper (s)",
        "peak (MiB)",
        "active",
        "max rel err",
    )
    print("  ".join(f"{h:>12}" for h in header))
    for r in rows:
        paper = "-" if r["paper_seconds"] is None else f"{r['paper_seconds']:.2f}"
        err = "skipped" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}"
        cells = (
            str(r["participants"]),
            r["source"],
            str(r["embeddings"]),
            f"{r['seconds']:.4f}",
            paper,
            f"{r['peak_bytes'] / 2**20:.1f}",
            f"{r['num_active'] / max(r['num_valid'], 1):.1%}",
            err,
        )
        print("  ".join(f"{c:>12}" for c in cells))
    return 0


def _run_boundary(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.boundary import bench_enclave_boundary

    rows = bench_enclave_boundary(
        args.participants,
        args.samples,
        args.dim,
        args.strategy,
        args.repeats,
        args.seed,
        boundary=args.boundary,
        margin=args.margin,
        memory_limit_bytes=int(args.memory_limit_mib * 2**20),
        sources=_embedding_sources(args),
    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"FDML Alg. 1 through the emulated TEE ({args.boundary}), {args.strategy}, float32")
    header = (
        "participants",
        "source",
        "direct (s)",
        "boundary (s)",
        "overhead",
        "paper (s)",
        "peak (MiB)",
        "max abs diff",
    )
    print("  ".join(f"{h:>12}" for h in header))
    for r in rows:
        paper = "-" if r["paper_table_v_s"] is None else f"{r['paper_table_v_s']:.2f}"
        cells = (
            str(r["participants"]),
            r["source"],
            f"{r['direct_s']:.4f}",
            f"{r['boundary_s']:.4f}",
            f"{100 * r['overhead']:+.0f}%",
            paper,
            f"{r['peak_bytes'] / 2**20:.1f}",
            f"{r['max_abs_diff']:.1e}",
        )
        print("  ".join(f"{c:>12}" for c in cells))
    return 0


def _add_rounds(sub: Any) -> None:
    p = sub.add_parser(
        "rounds",
        help="FDML (or FL-traditional) training rounds per second at the paper's TouchAuth setting",
        description="Whole FDML rounds (64 participants x 8 samples on the synthetic TouchAuth population): "
        "selection, codec, device forward and backward passes, enclave, Eq. 2 and Adam; with --protocol "
        "fedavg, Table I's FL-traditional rounds (one local SGD step per device, FedAvg).",
    )
    p.add_argument("--rounds", type=int, default=20, help="rounds per timed block (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks; the median is reported (default 3)")
    p.add_argument(
        "--warmup",
        type=int,
        default=60,
        help="untimed training rounds first, so that Alg. 1 runs at its long-run cost (default 60)",
    )
    p.add_argument(
        "--trained-lr",
        type=float,
        default=None,
        help="FDML: the learning rate of a second case beside the config's (FDML's 1e-4, at which the "
        "warm-up leaves the network untrained): warm-up and timed rounds at this rate see trained "
        f"embeddings (default {TRAINED_LR:g}, configs/table1_fdml.yaml's)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument(
        "--protocol",
        default="fdml",
        choices=("fdml", "fedavg"),
        help="fdml, or fedavg: Table I's FL-traditional baseline (64 devices x 8 samples, one SGD step)",
    )
    p.add_argument("--one-by-one", action="store_true", help="compute devices one by one instead of batched")
    p.add_argument("--profile", action="store_true", help="one more block under cProfile: seconds per phase")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_rounds)


def _run_rounds(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.rounds import bench_rounds

    if args.rounds < 1 or args.repeats < 1 or args.threads < 1:
        raise ConfigError(
            f"--rounds {args.rounds}, --repeats {args.repeats}, --threads {args.threads} must be >= 1"
        )
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup} must be >= 0 (untimed rounds before the timed blocks)")
    row = bench_rounds(
        rounds=args.rounds,
        repeats=args.repeats,
        batched=not args.one_by_one,
        threads=args.threads,
        overrides=(*args.overrides, f"device={args.device}"),
        profile=args.profile,
        warmup=args.warmup,
        protocol=args.protocol,
        trained_lr=TRAINED_LR if args.trained_lr is None and args.protocol == "fdml" else args.trained_lr,
    )
    row["device"] = str(resolve_device(args.device))
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    name = "FDML" if args.protocol == "fdml" else "FL-traditional"
    for label, case in (("the config's", row), ("trained", row.get("trained"))):
        if case is not None:
            print(
                f"{name}, {label} lr {case['lr']:g}: {case['rounds_per_second']:.2f} rounds/s (median of "
                f"{case['rounds_per_second_runs']}); 15,000 rounds take "
                f"{case['seconds_for_15000_rounds'] / 60:.0f} min; {case['bytes_up_per_round'] / 2**20:.1f} "
                f"MiB up, {case['bytes_down_per_round'] / 2**20:.1f} MiB down per round; device "
                f"{case['device_flops_per_round'] / 1e9:.1f} GFLOP per round at "
                f"{case['device_gflops_achieved']:.0f} GFLOP/s (peak GEMM {case['peak_gemm_gflops']:.0f}); "
                f"Alg. 1 {case['alg1_seconds']:.4f} s; floor {case['floor_seconds']:.3f} s, fraction of "
                f"floor {case['fraction_of_floor']:.2f}"
            )
    return 0


def _require_positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse a count option below 1, naming it as the user typed it."""
    for name in names:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")


def _add_codec(sub: Any) -> None:
    p = sub.add_parser("codec", help="wire codec throughput on a TouchAuth-sized gradient message")
    p.add_argument("--elements", type=int, default=337_280, help="float32 values in the message")
    p.add_argument("--repeats", type=int, default=200, help="timed round trips; medians are reported")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_codec)


def _run_codec(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.codec import bench_codec

    _require_positive(args, "elements", "repeats")
    row = bench_codec(elements=args.elements, repeats=args.repeats)
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(
            f"codec round trip of {row['wire_bytes']} bytes: {1e6 * row['round_trip_seconds']:.0f} us "
            f"({row['round_trip_gb_per_s']:.1f} GB/s; encode {1e6 * row['encode_seconds']:.0f} us, "
            f"decode {1e6 * row['decode_seconds']:.0f} us)"
        )
    return 0


def _add_fedavg(sub: Any) -> None:
    p = sub.add_parser(
        "fedavg",
        help="FedAvg engine client updates per second, batched cohort vs one by one",
        description="Time ModelClients answering one FitRequest for --clients clients (each --epochs over "
        "--samples examples in batches of --batch-size), batched (vmap) and one by one, side by side.",
    )
    p.add_argument("--model", default="lenet", help="zoo model (default lenet)")
    p.add_argument("--clients", type=int, default=8, help="clients per request (default 8)")
    p.add_argument("--samples", type=int, default=500, help="examples per client (default 500)")
    p.add_argument("--batch-size", type=int, default=16, help="local batch size (default 16)")
    p.add_argument("--epochs", type=int, default=1, help="local epochs (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls; the median is reported (default 3)")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_fedavg)


def _run_fedavg(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.fedavg import bench_fedavg_updates

    _require_positive(args, "clients", "samples", "batch_size", "epochs", "repeats")
    row = bench_fedavg_updates(
        model=args.model,
        clients=args.clients,
        samples=args.samples,
        batch_size=args.batch_size,
        local_epochs=args.epochs,
        repeats=args.repeats,
        device=args.device,
    )
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(
            f"{row['model']} ({row['num_params']} parameters), {row['samples']} samples, "
            f"batch {row['batch_size']}: "
            f"batched {row['batched_updates_per_second']:.2f} updates/s, one by one "
            f"{row['one_by_one_updates_per_second']:.2f} updates/s (x{row['speedup']:.2f})"
        )
    return 0


def _add_ppfl(sub: Any) -> None:
    p = sub.add_parser(
        "ppfl",
        help="PPFL client updates per second per stage (batched vs one by one) and the sealing's share",
        description="Rounds of each PPFL stage through the in-process enclave: sealing down, the devices' "
        "training (batched cohort and device by device, side by side) and aggregation, timed apart.",
    )
    p.add_argument("--model", default="lenet", help="zoo model (default lenet)")
    p.add_argument(
        "--data", default="fashion-mnist", choices=("fashion-mnist", "cifar10"), help="input shape"
    )
    p.add_argument("--clients", type=int, default=10, help="devices per round (default 10, Table 3)")
    p.add_argument("--samples", type=int, default=100, help="examples per device (default 100)")
    p.add_argument("--batch-size", type=int, default=16, help="local batch size (default 16)")
    p.add_argument("--epochs", type=int, default=10, help="local epochs (default 10, Table 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per mode; medians (default 3)")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_ppfl)


def _run_ppfl(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.ppfl import bench_ppfl

    _require_positive(args, "clients", "samples", "batch_size", "epochs", "repeats")
    row = bench_ppfl(
        model=args.model,
        data=args.data,
        clients=args.clients,
        samples=args.samples,
        batch_size=args.batch_size,
        local_epochs=args.epochs,
        repeats=args.repeats,
        device=args.device,
    )
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    for s in row["stages"]:
        print(
            f"stage {s['stage']} ({s['num_params']} parameters): batched "
            f"{s['batched_updates_per_second']:.2f} updates/s, one by one "
            f"{s['one_by_one_updates_per_second']:.2f} (x{s['speedup']:.2f}); sealing "
            f"{100 * s['sealing_share']:.1f}% of a round"
        )
    return 0


def _add_mobilefacenet(sub: Any) -> None:
    p = sub.add_parser(
        "mobilefacenet",
        help="MobileFaceNet forward + backward images/s (ArcFace loss) and AIoT client updates/s",
    )
    p.add_argument("--image-size", type=int, default=112, help="input side (default 112)")
    p.add_argument("--width", type=float, default=1.0, help="channel width multiplier (default 1)")
    p.add_argument("--batch-size", type=int, default=32, help="batch (default 32)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads (default 1 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps; the median is reported (default 5)")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_mobilefacenet)


def _run_mobilefacenet(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.faces import bench_mobilefacenet

    _require_positive(args, "batch_size", "repeats")
    row = bench_mobilefacenet(
        image_size=args.image_size,
        width=args.width,
        batch_size=args.batch_size,
        threads=args.threads,
        repeats=args.repeats,
        device=args.device,
    )
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    for r in row["rows"]:
        print(
            f"MobileFaceNet {row['image_size']}x{row['image_size']}, batch {row['batch_size']}, "
            f"{r['threads']} thread(s), BatchNorm {r['batchnorm']}: {r['images_per_second']:.1f} images/s"
        )
    for r in row["client_updates"]:
        print(
            f"AIoT client updates (20 photos, batch 8, projector, frozen BatchNorm), {r['threads']} "
            f"thread(s): {r['client_updates_per_second']:.2f} updates/s"
        )
    return 0


def _add_policy(sub: Any) -> None:
    p = sub.add_parser("policy", help="PoliFL policy advance (us) and sandbox compile / run cost")
    p.add_argument("--repeats", type=int, default=2000, help="timed policy advances (default 2000)")
    p.add_argument("--sandbox-runs", type=int, default=20, help="timed sandboxed runs (default 20)")
    p.add_argument(
        "--union", type=int, default=20_000, help="alternatives of the large policy parsed (default 20000)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_policy)


def _run_policy(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.policy import bench_policy

    _require_positive(args, "repeats", "sandbox_runs", "union")
    row = bench_policy(repeats=args.repeats, sandbox_runs=args.sandbox_runs, union=args.union)
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(
        f"policy advance {row['advance_microseconds_median']:.1f} us; sandbox compile "
        f"{row['sandbox_compile_milliseconds']:.1f} ms, run {row['sandbox_run_milliseconds_median']:.1f} ms "
        f"against {row['direct_call_microseconds_median']:.1f} us called directly; trusted filter "
        f"{row['library_filter_microseconds_median']:.1f} us against "
        f"{row['direct_filter_microseconds_median']:.1f} us for the zeroing alone; a union of "
        f"{row['union_alternatives']} alternatives parses in {row['union_parse_seconds']:.3f} s, "
        f"a verdict on it takes {row['union_verdict_seconds'] * 1e3:.1f} ms"
    )
    return 0


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be >= 0")
    return counts


def _add_scale(sub: Any) -> None:
    p = sub.add_parser(
        "scale",
        help="FedAvg rounds/s and memory as registered clients grow, in-process and over Ray actors",
        description="FedAvg with LeNet (2 conv + 2 FC) on 28x28 images, --per-round clients per round; "
        "each setting in a fresh process (docs/benchmarks.md, 'Scale').",
    )
    p.add_argument("--clients", type=_counts, default=[1_000, 10_000, 100_000], help="in-process settings")
    p.add_argument("--actors", type=_counts, default=[1, 2, 4], help="Ray settings (empty: no Ray)")
    p.add_argument("--ray-clients", type=int, default=1_000, help="registered clients on Ray (default 1000)")
    p.add_argument("--per-round", type=int, default=100, help="clients per round (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up (default 5)")
    p.add_argument("--samples", type=int, default=50, help="images per client (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    _add_device(p)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(bench_func=_run_scale)


def _run_scale(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.scale import bench_scale, measure_setting

    _require_positive(args, "ray_clients", "per_round", "rounds", "samples", "threads")
    if args.one:  # one setting, in this fresh process (bench_scale starts one per setting)
        row = measure_setting(
            clients=args.clients[0],
            per_round=args.per_round,
            rounds=args.rounds,
            samples=args.samples,
            actors=args.actors[0],
            seed=args.seed,
            threads=args.threads,
            device=args.device,
        )
        print(json.dumps(row))
        return 0
    result = bench_scale(
        clients=args.clients,
        actors=args.actors,
        ray_clients=args.ray_clients,
        per_round=args.per_round,
        rounds=args.rounds,
        samples=args.samples,
        seed=args.seed,
        threads=args.threads,
        device=args.device,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"FedAvg {result['model']} on {result['data']}, {result['samples_per_client']} images per client")
    for r in result["rows"]:
        where = f"Ray, {r['actors']} actors" if r["actors"] else f"in-process, {r['device']}"
        rss = r["peak_rss_bytes"] / 2**20
        print(
            f"  {r['clients']:>7} clients ({where}): {r['rounds_per_second']:.2f} rounds/s, start-up "
            f"{r['startup_seconds']:.1f} s, peak RSS {rss:.0f} MiB ({r['rss_covers']})"
        )
    return 0


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_peers(sub: Any) -> None:
    p = sub.add_parser(
        "peers",
        help="the same FedAvg task in fedveil, fedveil on Ray, Flower's simulation engine and pfl-research",
        description="FedAvg with LeNet on 28x28 images, the same task folder for every framework, each "
        "setting in a fresh process; the peers in their own virtual environments (docs/benchmarks.md, "
        "'Peers').",
    )
    p.add_argument(
        "--frameworks", type=_names, default=["fedveil", "ray", "flower", "pfl"], help="default: all four"
    )
    p.add_argument("--cohorts", type=_counts, default=[10, 100], help="clients per round (default 10,100)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds after one warm-up (default 30)")
    p.add_argument("--clients", type=int, default=1_000, help="registered clients (default 1000)")
    p.add_argument("--samples", type=int, default=50, help="images per client (default 50)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, or Ray actors (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument(
        "--out", default="runs/bench-peers", help="task folder and results (default runs/bench-peers)"
    )
    p.add_argument("--setup", action="store_true", help="create the peers' virtual environments and exit")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the task and the rows as JSON")
    p.set_defaults(bench_func=_run_peers)


def _run_peers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedveil.experiments.bench.peers import PEERS, bench_peers, format_table, repo_root, setup_peers

    if args.setup:
        peers = [name for name in args.frameworks if name in PEERS]
        versions = setup_peers(peers, repo_root() / ".venv-peers")
        print(json.dumps(versions) if args.json else ", ".join(f"{k} {v}" for k, v in versions.items()))
        return 0
    result = bench_peers(
        frameworks=args.frameworks,
        cohorts=args.cohorts,
        rounds=args.rounds,
        clients=args.clients,
        samples=args.samples,
        threads=args.threads,
        seed=args.seed,
        out=Path(args.out),
        device=args.device,
    )
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _add_polifl(sub: Any) -> None:
    p = sub.add_parser("polifl", help="PoliFL use cases: client updates/s, policy-enforcing vs plain devices")
    p.add_argument("--repeats", type=int, default=3, help="timed cohorts per path; the median (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(bench_func=_run_polifl)


def _run_polifl(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.polifl import bench_polifl

    _require_positive(args, "repeats", "threads")
    rows = bench_polifl(repeats=args.repeats, threads=args.threads, device=args.device)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(
            f"{r['use_case']:<7} {r['model_parameters']:>9,} parameters, "
            f"{r['examples_per_client']:.0f} examples: "
            f"{r['client_updates_per_second']:.2f} updates/s enforcing policies, "
            f"{r['plain_client_updates_per_second']:.2f} plain ({100 * r['enforcement_overhead']:+.1f}%)"
        )
    return 0


def _add_dlg(sub: Any) -> None:
    p = sub.add_parser("dlg", help="DLG iterations per second at batch 1 (sigmoid LeNet, 28x28)")
    p.add_argument("--iterations", type=int, default=50, help="L-BFGS iterations per run (default 50)")
    p.add_argument("--repeats", type=int, default=3, help="runs; the median is reported (default 3)")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_dlg)


def _run_dlg(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.fedavg import bench_dlg

    _require_positive(args, "iterations", "repeats")
    row = bench_dlg(iterations=args.iterations, repeats=args.repeats, device=args.device)
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(
            f"DLG on lenet-sigmoid, batch 1: {row['iterations_per_second_median']:.1f} iterations/s "
            f"({row['evaluations_per_second_median']:.0f} gradient-matching evaluations/s)"
        )
    return 0


def _add_network(sub: Any) -> None:
    p = sub.add_parser(
        "network",
        help="many device agents on loopback over mutual TLS: FedAvg rounds of a ~1 MB model",
        description="Start a gRPC server and --agents device agents (one TLS connection and certificate "
        "each) in at most --processes processes; run --rounds FedAvg rounds with every agent selected; "
        "report lost updates, TTD/TTE/TTR/TTP percentiles, server overhead and peak RSS, and the same "
        "rounds in the in-process simulation.",
    )
    p.add_argument("--agents", type=int, default=1000, help="device agents (default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--processes", type=int, default=8, help="agent processes (default 8)")
    p.add_argument("--model-mib", type=float, default=1.0, help="model size in MiB (default 1)")
    p.add_argument("--tte-mean", type=float, default=0.0, help="simulated mean on-device seconds (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(bench_func=_run_network)


def _run_network(args: argparse.Namespace) -> int:
    from fedveil.experiments.bench.network import bench_network

    row = bench_network(
        agents=args.agents,
        rounds=args.rounds,
        processes=args.processes,
        model_bytes=int(args.model_mib * 2**20),
        tte_mean=args.tte_mean,
    )
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(
            f"{row['agents']} agents in {row['processes']} processes, {row['rounds']} rounds of a "
            f"{row['model_bytes'] / 2**20:.1f} MiB model: {row['lost_updates']} lost updates, round "
            f"{row['round_seconds_median']:.2f} s "
            f"(server overhead {row['server_overhead_seconds_median']:.2f} s; "
            f"simulation {row['simulation_round_seconds_median']:.2f} s), TTD p50 {row['ttd']['p50']:.3f} s, "
            f"TTR p50 {row['ttr']['p50']:.3f} s, TTP p50 {1e3 * row['ttp']['p50']:.2f} ms, "
            f"server {row['server_cpu_seconds_per_round']:.2f} CPU-s per round, "
            f"server peak RSS {row['server_peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    return 0
