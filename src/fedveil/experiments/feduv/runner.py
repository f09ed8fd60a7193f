"""Table 3's MNIST-UV rows ([FedUV], Sec. 6 and Appendix D): softmax, FedAwS and FedUV.

:func:`run_feduv` trains every requested method on the same synthetic MNIST-UV data
(:func:`fedveil.data.mnist_uv.generate_mnist_uv`) through the simulation runtime, deploys it with the
warm-up threshold of Alg. 2, evaluates the three dataset types of Table 3 (:data:`UV_EVALUATIONS`) and
writes a run directory: ``config.json`` (the resolved settings), ``metrics.jsonl`` (one line per round
and method, then one per evaluation), ``results.json`` (AUC and TPR at FPR 1e-1, 1e-2, 1e-3 per method
and dataset type, beside the paper's AUCs, and the shape checks of Sec. 6.3), ``roc.png`` (Fig. 2:
one panel per dataset type, all methods), ``loss.png`` (each method's mean local training loss per round)
and ``methods/`` (each method's outcome as it finishes, and the checkpoint of each method in training,
so an interrupted run resumes).

Two scales (:data:`SCALES`):

- ``paper``: Sec. 6: 1,000 writers (50 / 15 / 15 examples) and 1,000 unseen writers, the Table 2 net,
  20,000 rounds with 1% of the users each, one local epoch. Far beyond a 2-core machine (the Table 2 net
  does a few client updates per second there, :func:`bench_client_updates`).
- ``small``: what fits a 2-core machine, 13 to 17 minutes per method on one core (``workers = 2`` trains
  two methods at a time): 50 writers and 50 unseen writers (the paper's 50 / 15 / 15 examples each) and
  a narrower net: the first four Table 2 blocks with their channels divided by ``width_divisor = 8``
  (8, 16, 32, 64), the last block and ``FC(1024, c)`` exactly as Table 2.
  Keeping ``g(x)`` 1024-wide matters for FedUV: a step on ``l_pos`` turns ``W g(x)`` towards ``v_u`` by
  an angle of order ``eta ||g(x)||^2 / c``, and ``||g(x)||^2`` is about ``D`` after the last GroupNorm;
  with ``D = 128`` (all channels divided by 8: ``narrow_head``) FedUV-511 learned several times slower
  than FedUV-127.
  1,000 rounds with 20% of the users each keep the paper's cohort of 10 users per round and its 200
  rounds per user (20,000 x 1%), with its learning rate, per-round decay, batch and epochs; the learning
  rate falls to ``0.1 / 11`` instead of ``0.1 / 201``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import multiprocessing
import queue
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

from fedveil.core.communicator import Dropout
from fedveil.core.provenance import code_identity
from fedveil.data.mnist_uv import MnistUvConfig, generate_mnist_uv, writer_difficulty_probe
from fedveil.errors import ConfigError, RunInterrupted
from fedveil.eval.plots import method_colours, save_png
from fedveil.eval.uv import DEFAULT_BINS, UV_EVALUATIONS, UvEvaluation, uv_roc_figure
from fedveil.eval.verification import Roc
from fedveil.experiments.checkpoint import (
    Checkpoint,
    StopAtRoundEnd,
    check_checkpoint_identity,
    claim_device,
    config_digest,
    crash_point,
    differing_settings,
    identity_settings,
    load_checkpoint,
    prepare_run_dir,
    save_checkpoint,
    saved_settings,
)
from fedveil.experiments.config import load_run_config, refuse_keys_without_effect
from fedveil.experiments.plots import series_figure
from fedveil.models.device import check_device_spec, resolve_device
from fedveil.models.feduv import build_uv_net
from fedveil.protocols.common import pool_rng_states, restore_pool_rngs
from fedveil.protocols.feduv import (
    DEFAULT_TARGET_TPR,
    FEDAWS_SPREADOUT_MARGIN,
    FedAwSMethod,
    FedAwSServer,
    FedUVMethod,
    FedUVServer,
    SoftmaxMethod,
    SoftmaxServer,
    UvClients,
    UvModel,
    UvServer,
    UvTrainConfig,
    check_target_tpr,
)
from fedveil.protocols.feduv_messages import UvTrainRequest
from fedveil.runtime.simulation import SimulationRuntime

__all__ = [
    "METHOD_NAMES",
    "PAPER_TABLE3_MNIST_UV",
    "SCALES",
    "FeduvRunConfig",
    "bench_client_updates",
    "load_feduv_config",
    "mnist_uv_net",
    "parse_int_list",
    "parse_methods",
    "run_feduv",
    "shape_checks",
    "with_overrides",
]

METHOD_NAMES = ("softmax", "fedaws", "feduv")

PAPER_TABLE3_MNIST_UV: dict[str, dict[str, float]] = {
    "train": {"softmax": 0.997, "fedaws": 0.998, "feduv-127": 0.993, "feduv-255": 0.995, "feduv-511": 0.996},
    "test_known": {
        "softmax": 0.996,
        "fedaws": 0.997,
        "feduv-127": 0.993,
        "feduv-255": 0.994,
        "feduv-511": 0.995,
    },
    "test_unknown": {
        "softmax": 0.996,
        "fedaws": 0.996,
        "feduv-127": 0.992,
        "feduv-255": 0.993,
        "feduv-511": 0.995,
    },
}
"""Table 3, MNIST-UV rows: AUC per dataset type and method (``feduv-<code length>``)."""

_CHANNELS = (64, 128, 256, 512, 1024)


class _MnistUvNet(nn.Module):
    """Table 2's MNIST-UV topology with the channels of the first four blocks divided by ``divisor``;
    the last block (1024 channels) and ``FC(1024, c)`` as in Table 2, or divided too (``narrow_head``)."""

    def __init__(self, num_outputs: int, divisor: int, *, bias: bool, narrow_head: bool) -> None:
        super().__init__()
        last = _CHANNELS[-1] // divisor if narrow_head else _CHANNELS[-1]
        widths = [4] + [c // divisor for c in _CHANNELS[:-1]] + [last]
        layers: list[nn.Module] = []
        for i in range(len(_CHANNELS)):
            layers += [
                nn.Conv2d(widths[i], widths[i + 1], 3, padding=3 if i == 0 else 1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.GroupNorm(2, widths[i + 1]),
            ]
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.fc = nn.Linear(widths[-1], num_outputs, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, 4, 28, 28)`` -> ``W g(x) + b`` ``(B, c)``."""
        return self.fc(self.features(x))


def mnist_uv_net(
    num_outputs: int, *, bias: bool = True, width_divisor: int = 1, narrow_head: bool = False
) -> nn.Module:
    """The MNIST-UV net: Table 2 exactly for ``width_divisor = 1`` (:func:`build_uv_net`), else the same
    five blocks (conv 3 x 3, ReLU, max-pool 2, GN(2)) with ``64 / w, 128 / w, 256 / w, 512 / w, 1024``
    channels and ``FC(1024, c)``; ``narrow_head`` divides the last block too (``1024 / w`` channels,
    ``FC(1024 / w, c)``). FedUV's scaling is applied by the method, not the net."""
    if width_divisor not in (1, 2, 4, 8, 16, 32):
        raise ConfigError(f"width_divisor {width_divisor!r} must be one of 1, 2, 4, 8, 16, 32")
    if width_divisor == 1:
        return build_uv_net("mnist_uv", num_outputs, scaling=False, bias=bias)
    return _MnistUvNet(num_outputs, width_divisor, bias=bias, narrow_head=narrow_head)


@dataclass(frozen=True)
class FeduvRunConfig:
    """Everything one run of :func:`run_feduv` depends on.

    Data: ``writers`` seen writers with ``train_examples`` / ``val_examples`` / ``test_examples``
    examples and ``unseen_writers`` (:class:`MnistUvConfig`). Model: ``width_divisor`` (1 = Table 2) and
    ``narrow_head`` (:func:`mnist_uv_net`).
    Training: ``rounds`` of Alg. 1 with ``train``. Methods: ``methods`` from :data:`METHOD_NAMES`, FedUV once
    per code length of ``code_lengths``. FedAwS: ``spreadout_steps`` and ``spreadout_margin`` (``nu``).
    Warm-up target TPR ``q``; evaluation histogram ``bins``. ``threads`` for torch (per process);
    ``batched`` client work; ``workers`` processes training methods side by side; ``device`` where the
    users train and score (:func:`~fedveil.models.device.resolve_device`).
    """

    name: str = "feduv_mnist_uv_small"
    seed: int = 0
    writers: int = 50
    unseen_writers: int = 50
    train_examples: int = 50
    val_examples: int = 15
    test_examples: int = 15
    width_divisor: int = 8
    narrow_head: bool = False
    rounds: int = 1000
    train: UvTrainConfig = field(default_factory=lambda: UvTrainConfig(fraction=0.2))
    methods: tuple[str, ...] = METHOD_NAMES
    code_lengths: tuple[int, ...] = (127, 255, 511)
    spreadout_steps: int = 5
    spreadout_margin: float = FEDAWS_SPREADOUT_MARGIN
    q: float = DEFAULT_TARGET_TPR
    bins: int = DEFAULT_BINS
    threads: int = 1
    batched: bool = True
    workers: int = 1
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown or not self.methods:
            raise ConfigError(f"methods {list(self.methods)!r}: choose from {', '.join(METHOD_NAMES)}")
        if "feduv" in self.methods and not self.code_lengths:
            raise ConfigError("FedUV needs at least one code length, e.g. 127, 255, 511")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ConfigError(f"rounds {self.rounds!r} must be an integer >= 1")
        for name in ("threads", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} must be an integer >= 1")
        check_target_tpr(self.q)

    def data_config(self) -> MnistUvConfig:
        """The MNIST-UV generator's settings (paper sub-image pools 6 / 2 / 2 when they suffice)."""
        pools = tuple(
            max(need, math.ceil(count**0.25 - 1e-9))
            for need, count in zip(
                (6, 2, 2), (self.train_examples, self.val_examples, self.test_examples), strict=True
            )
        )
        return MnistUvConfig(
            seed=self.seed,
            writers=self.writers,
            train=self.train_examples,
            val=self.val_examples,
            test=self.test_examples,
            unseen_writers=self.unseen_writers,
            sub_images_per_digit=(pools[0], pools[1], pools[2]),
        )

    def runs(self) -> list[tuple[str, str, int | None]]:
        """``(label, method, code length)`` of every training run, in order."""
        out: list[tuple[str, str, int | None]] = []
        for m in self.methods:
            if m == "feduv":
                out.extend((f"feduv-{n}", m, n) for n in self.code_lengths)
            else:
                out.append((m, m, None))
        return out


SCALES: dict[str, FeduvRunConfig] = {
    "small": FeduvRunConfig(),
    "paper": FeduvRunConfig(
        name="feduv_mnist_uv_paper",
        writers=1000,
        unseen_writers=1000,
        width_divisor=1,
        rounds=20_000,
        train=UvTrainConfig(fraction=0.01),
        batched=False,
    ),
}
"""``small`` fits a 2-core machine; ``paper`` is Sec. 6's setting (one user at a time: for the full Table 2
net the one-by-one path is faster on CPU than ``vmap``, ``docs/benchmarks.md``)."""


def load_feduv_config(
    path: str | Path | None,
    base: FeduvRunConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> FeduvRunConfig:
    """A :class:`FeduvRunConfig` from the YAML file ``path`` (``None``: none) laid over ``base`` (default:
    the ``small`` scale), with ``overrides`` (nested, e.g. ``--set``'s) on top: top-level keys are
    :class:`FeduvRunConfig`'s fields, ``train`` holds :class:`~fedveil.protocols.feduv.UvTrainConfig`'s.
    Unknown keys and wrong types fail naming them, and so do keys the settings ignore (``code_lengths``
    without FedUV among the ``methods``; :func:`~fedveil.experiments.config.load_run_config`)."""
    return load_run_config(
        FeduvRunConfig,
        path,
        overrides,
        base=_config_dict(base or SCALES["small"]),
        unused=_unused_settings,
    )


def _unused_settings(cfg: FeduvRunConfig) -> list[tuple[str, bool, str]]:
    """The settings ``cfg``'s choices ignore (:func:`~fedveil.experiments.config.keys_without_effect`)."""
    why = f"only FedUV has a code length; methods are {', '.join(cfg.methods)}"
    return [("code_lengths", "feduv" not in cfg.methods, why)]


def _config_dict(cfg: FeduvRunConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["methods"] = list(cfg.methods)
    out["code_lengths"] = list(cfg.code_lengths)
    return out


def _model(cfg: FeduvRunConfig, method: str, code_length: int | None) -> UvModel:
    """The Table 2 net of ``method`` initialised from ``cfg.seed`` (the same on server and devices)."""
    torch.manual_seed(cfg.seed)
    outputs = code_length if code_length is not None else cfg.writers
    net = mnist_uv_net(
        outputs, bias=method != "fedaws", width_divisor=cfg.width_divisor, narrow_head=cfg.narrow_head
    )
    return UvModel(net)


def _uv_method(method: str) -> Any:
    return {"feduv": FedUVMethod, "softmax": SoftmaxMethod, "fedaws": FedAwSMethod}[method]()


def agent_clients(
    config: str | Path, method: str, code_length: int | None, *, device: str | None = None
) -> UvClients:
    """The users a FedUV device agent hosts for one method of the run whose ``config.json`` is ``config``
    (``fedveil feduv agent``, and a Flower ClientApp), training on ``device`` (None: the run's). The
    device is resolved before the users' data is made: one this machine lacks is a
    :class:`~fedveil.errors.ConfigError` naming it before the agent dials its server."""
    from fedveil.data.mnist_uv import generate_mnist_uv

    cfg = load_feduv_config(config)
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    resolve_device(cfg.device)
    return feduv_clients(cfg, method, code_length, generate_mnist_uv(cfg.data_config()))


def feduv_clients(
    cfg: FeduvRunConfig,
    method: str,
    code_length: int | None,
    data: Any,
    code_cache_dir: str | None = None,
    model: UvModel | None = None,
) -> UvClients:
    """The users of one method: the client pool the simulation runs in-process and a device agent
    hosts (``fedveil feduv agent``)."""
    return UvClients(
        _uv_method(method),
        model or _model(cfg, method, code_length),
        data,
        seed=cfg.seed,
        batched=cfg.batched,
        code_cache_dir=code_cache_dir,
        device=cfg.device,
    )


def _build(
    cfg: FeduvRunConfig, method: str, code_length: int | None, data: Any, code_cache_dir: str | None
) -> tuple[UvServer, UvClients]:
    """Server and users of one method, seeded from ``cfg.seed``."""
    model = _model(cfg, method, code_length)
    server_rng = np.random.default_rng([cfg.seed, 1])
    server: UvServer
    if method == "feduv":
        assert code_length is not None
        server = FedUVServer(
            cfg.train, model, server_rng, code_length=code_length, code_cache_dir=code_cache_dir
        )
    elif method == "softmax":
        server = SoftmaxServer(cfg.train, model, server_rng)
    else:
        server = FedAwSServer(
            cfg.train,
            model,
            server_rng,
            spreadout_steps=cfg.spreadout_steps,
            spreadout_margin=cfg.spreadout_margin,
        )
    return server, feduv_clients(cfg, method, code_length, data, code_cache_dir, model)


def _json_line(fh: Any, obj: dict[str, Any]) -> None:
    fh.write(json.dumps(obj, sort_keys=True) + "\n")
    fh.flush()


def shape_checks(aucs: dict[str, dict[str, float]], tolerance: float = 0.03) -> dict[str, Any]:
    """Sec. 6.3's claims on ``aucs[dataset type][method label]``, each ``True``/``False`` (or ``None``
    when a method it compares was not run): FedUV's AUC does not decrease with the code length; the
    best FedUV is within ``tolerance`` of FedAwS; softmax has the highest AUC."""
    out: dict[str, Any] = {}
    for kind, row in aucs.items():
        lengths = sorted(int(k.split("-")[1]) for k in row if k.startswith("feduv-"))
        feduv = [row[f"feduv-{n}"] for n in lengths]
        out[kind] = {
            "auc_grows_with_code_length": (
                all(a <= b for a, b in itertools.pairwise(feduv)) if len(feduv) > 1 else None
            ),
            "feduv_within_tolerance_of_fedaws": (
                abs(max(feduv) - row["fedaws"]) <= tolerance if feduv and "fedaws" in row else None
            ),
            "softmax_best": (
                row["softmax"] >= max(row.values()) if "softmax" in row and len(row) > 1 else None
            ),
        }
    out["tolerance"] = tolerance
    return out


def run_feduv(
    cfg: FeduvRunConfig,
    out_dir: str | Path,
    *,
    progress: Callable[[str], None] | None = None,
    show_bar: bool = False,
    code_cache_dir: str | None = None,
    network: Any = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train, deploy and evaluate every run of ``cfg``; write the run directory; return ``results.json``.

    ``progress`` receives one line per finished phase (e.g. ``print``); ``show_bar`` draws a progress bar
    over all rounds of all runs on stderr. With ``cfg.workers > 1`` the methods train in that many worker
    processes; each run depends only on ``cfg`` (its own seeds, the same generated data), so the numbers
    equal those of one process. ``network`` (a :class:`fedveil.experiments.network_run.NetworkPlan`) trains
    each method in turn with its users as device agents over gRPC + mutual TLS.

    Nothing finished is lost: each method's outcome is written to ``methods/<label>.json`` and
    ``methods/<label>.roc.npz`` as soon as it ends, and a later call with ``resume`` on the same
    ``out_dir`` with the same ``cfg`` reuses them and trains only the missing methods. A method in
    training in the simulation is checkpointed after every round in ``methods/<label>.checkpoint.npz``
    (its own file, so methods trained side by side never share one; written atomically by
    :func:`~fedveil.experiments.checkpoint.save_checkpoint`): the FedAvg engine's weights and generator,
    the runtime's and every user's generator, the round lines and the traffic so far, and the digest of
    the settings. Users' codewords and classes are not in it: set-up draws them again from the same
    seeded generators. A resumed run continues each method from its last checkpointed round, only under
    the same settings, and reaches the uninterrupted run's model; a method's checkpoint is removed once
    its outcome is written. Over the ``network`` the checkpoint holds the same but the users' generators,
    which live in the agents: a resumed method continues from its last checkpointed round with that
    round's model and selection generator, and its users draw on from their agents' streams (a fresh
    agent's from their start), so its model is not bit-identical to an uninterrupted run's; users keep
    their codewords when set-up runs again. A different ``cfg`` in an existing ``out_dir``
    is refused (:class:`ConfigError` naming the settings that differ); without ``resume`` a directory
    that holds anything is refused, unless ``overwrite`` clears it first. Ctrl-C stops every method in
    training at the end of its round, after its checkpoint
    (:class:`~fedveil.experiments.checkpoint.StopAtRoundEnd`).
    """
    torch.set_num_threads(cfg.threads)
    # simulated users train here: a device this machine lacks fails before the run directory is touched
    device = resolve_device(cfg.device) if network is None else None
    out = prepare_run_dir(out_dir, resume=resume, overwrite=overwrite)
    _claim_run_dir(out, cfg, device)
    digest = _digest(cfg)
    say = progress or (lambda _line: None)
    started = time.perf_counter()
    data = generate_mnist_uv(cfg.data_config())
    probe = writer_difficulty_probe(data.train, data.test)
    took = time.perf_counter() - started
    say(f"data: {cfg.writers} writers, raw-pixel centroid AUC {probe.auc:.3f} ({took:.1f} s)")
    results: dict[str, Any] = {
        "name": cfg.name,
        "code": code_identity(),
        "data": {
            "raw_pixel_probe_auc": probe.auc,
            "raw_pixel_probe_top1": probe.top1,
            "writers": cfg.writers,
        },
        "methods": {},
    }
    outcomes: dict[str, _Outcome] = {}
    todo = []
    for run in cfg.runs():
        saved = _load_outcome(out, run[0])
        if saved is None:
            todo.append(run)
        else:
            outcomes[run[0]] = saved
            say(f"{run[0]}: already in {out / 'methods'}, reused")
    bar = tqdm(total=len(todo) * cfg.rounds, unit="round", disable=not show_bar, desc=cfg.name)

    def finished(outcome: _Outcome) -> None:
        _save_outcome(out, outcome)
        (out / "methods" / _checkpoint_name(outcome.label)).unlink(missing_ok=True)
        outcomes[outcome.label] = outcome
        aucs = ", ".join(f"{kind} {ev['auc']:.4f}" for kind, ev in outcome.row["eval"].items())
        with tqdm.external_write_mode():
            say(f"{outcome.label}: {aucs} ({outcome.row['real_seconds']:.0f} s)")

    try:
        with bar, StopAtRoundEnd(f"FedUV run {cfg.name!r}") as stop:
            if cfg.workers == 1 or len(todo) <= 1 or network is not None:
                for label, method, code_length in todo:
                    finished(
                        _train_one(
                            cfg,
                            label,
                            method,
                            code_length,
                            data,
                            code_cache_dir,
                            bar.update,
                            network=network,
                            out=out,
                            stop=stop,
                            checkpoints=(out, digest),
                        )
                    )
                    stop.check()
            else:
                _train_in_pool(cfg, todo, code_cache_dir, bar.update, finished, stop, (out, digest))
    except KeyboardInterrupt:
        left = []
        for label, _, _ in cfg.runs():
            ckpt = (
                None if label in outcomes else load_checkpoint(out / "methods", name=_checkpoint_name(label))
            )
            if ckpt is not None:
                left.append(f"{label} continues after round {ckpt.round}")
            elif label not in outcomes:
                left.append(f"{label} starts again from its first round")
        raise RunInterrupted(
            f"FedUV run {cfg.name!r} interrupted; its finished methods "
            f"({', '.join(outcomes) or 'none'}) and the checkpoints of the others are kept in "
            f"{out / 'methods'}: {', '.join(left)}"
        ) from None
    curves: dict[str, dict[str, Roc]] = {kind: {} for kind in UV_EVALUATIONS}
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for label, _, _ in cfg.runs():
            outcome = outcomes[label]
            for line in outcome.lines:
                _json_line(fh, line)
            for kind, roc in outcome.rocs.items():
                curves[kind][label] = roc
            results["methods"][label] = outcome.row
    aucs = {
        kind: {label: results["methods"][label]["eval"][kind]["auc"] for label in results["methods"]}
        for kind in UV_EVALUATIONS
    }
    results["auc"] = aucs
    results["paper_auc"] = {
        kind: {k: v for k, v in row.items() if k in results["methods"]}
        for kind, row in PAPER_TABLE3_MNIST_UV.items()
    }
    results["shape"] = shape_checks(aucs)
    results["real_seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    losses = {
        label: [
            (line["round"], line["loss"]) for line in outcomes[label].lines if line.get("loss") is not None
        ]
        for label, _, _ in cfg.runs()
    }
    title = f"{cfg.name}: MNIST-UV ({cfg.writers} writers, {cfg.rounds} rounds)"
    for file, fig in run_figures(cfg.name, title, curves, losses).items():
        save_png(fig, out / file)
    return results


def run_figures(
    name: str, title: str, curves: dict[str, dict[str, Roc]], losses: dict[str, list[tuple[int, float]]]
) -> dict[str, Figure]:
    """A run's figures by file name: ``roc.png`` (Fig. 2: ``curves[evaluation][method]``, a panel per
    evaluation, titled ``title``) and ``loss.png`` (each method's mean local training loss per round,
    ``losses[method]``), every method in its colour of one :func:`~fedveil.eval.plots.method_colours`
    map, so a method looks the same in both."""
    colours = method_colours(losses)
    return {
        "roc.png": uv_roc_figure(curves, title=title, colours=colours),
        "loss.png": series_figure(
            losses, title=f"{name}: mean local training loss", ylabel="loss", colours=colours
        ),
    }


#: The settings that do not change a run's numbers (nor its identity, :func:`_digest`).
FREE_SETTINGS = ("workers", "threads")


def _claim_run_dir(out: Path, cfg: FeduvRunConfig, device: torch.device | None) -> None:
    """Create ``out`` with ``config.json``, or check that the one there is ``cfg``'s (except ``workers``
    and ``threads``, which do not change the numbers, and the spelling of ``device``: ``device``, where
    the users train, None when they are agents elsewhere, is checked on the device it resolved to,
    :func:`~fedveil.experiments.checkpoint.claim_device`)."""
    mine = _config_dict(cfg)
    path = out / "config.json"
    if path.is_file():
        theirs = saved_settings(path)
        differ = differing_settings(
            identity_settings(mine, free=FREE_SETTINGS), identity_settings(theirs, free=FREE_SETTINGS)
        )
        if differ:
            raise ConfigError(
                f"run directory {str(out)!r} holds a run with other settings ({', '.join(differ)}); "
                "use another --out, or delete it to start over"
            )
    if device is not None:
        claim_device(out, device, artefacts=("methods/*",))
    out.mkdir(parents=True, exist_ok=True)
    (out / "methods").mkdir(exist_ok=True)
    path.write_text(json.dumps(mine, indent=2) + "\n", encoding="utf-8")


def _digest(cfg: FeduvRunConfig, *, legacy: bool = False) -> str:
    """The identity of ``cfg``'s numbers (:func:`~fedveil.experiments.checkpoint.config_digest`): every
    setting but :data:`FREE_SETTINGS` and the device (:func:`_claim_run_dir`). ``legacy``: the digest
    that checkpoints written before it left out the device name."""
    if legacy:
        kept = {k: v for k, v in _config_dict(cfg).items() if k not in FREE_SETTINGS}
    else:
        kept = identity_settings(_config_dict(cfg), free=FREE_SETTINGS)
    return config_digest(json.dumps(kept, sort_keys=True))


def _checkpoint_name(label: str) -> str:
    """The file in ``methods/`` that checkpoints the rounds of method ``label``."""
    return f"{label}.checkpoint.npz"


_STAT_FIELDS = ("bytes_down", "bytes_up", "messages_down", "messages_up", "sim_seconds", "bytes_down_coded")


def _stats_state(runtime: Any) -> dict[str, Any]:
    """The simulation runtime's traffic counters, JSON-ready (a checkpoint's)."""
    stats = runtime.stats()
    out: dict[str, Any] = {name: getattr(stats, name) for name in _STAT_FIELDS}
    out["dropouts"] = [[d.client, d.phase, d.reason] for d in stats.dropouts]
    return out


def _restore_stats(runtime: Any, state: dict[str, Any]) -> None:
    """Set the runtime's traffic counters to ``state`` (:func:`_stats_state`)."""
    stats = runtime.stats()
    for name in _STAT_FIELDS:
        setattr(stats, name, state[name])
    stats.dropouts[:] = [Dropout(*d) for d in state["dropouts"]]


@dataclass(frozen=True)
class _Outcome:
    """One method's run: its label, ``results.json`` row, ``metrics.jsonl`` lines and ROC curves."""

    label: str
    row: dict[str, Any]
    lines: list[dict[str, Any]]
    rocs: dict[str, Roc]


_ROC_ARRAYS = ("fpr", "tpr", "thresholds")


def _save_outcome(out: Path, outcome: _Outcome) -> None:
    """Write ``methods/<label>.roc.npz`` then ``methods/<label>.json`` (the JSON last: it marks the
    method done), each through a temporary file and an atomic rename."""
    base = out / "methods"
    arrays = {
        f"{kind}.{name}": getattr(roc, name) for kind, roc in outcome.rocs.items() for name in _ROC_ARRAYS
    }
    tmp = base / f".{outcome.label}.roc.tmp.npz"
    np.savez(tmp, **arrays)
    tmp.replace(base / f"{outcome.label}.roc.npz")
    doc = {"label": outcome.label, "row": outcome.row, "lines": outcome.lines}
    tmp_json = base / f".{outcome.label}.json.tmp"
    tmp_json.write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
    tmp_json.replace(base / f"{outcome.label}.json")


def _load_outcome(out: Path, label: str) -> _Outcome | None:
    """The outcome :func:`_save_outcome` wrote for ``label``, or ``None`` when there is none."""
    doc_path = out / "methods" / f"{label}.json"
    roc_path = out / "methods" / f"{label}.roc.npz"
    if not (doc_path.is_file() and roc_path.is_file()):
        return None
    try:
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
        with np.load(roc_path, allow_pickle=False) as z:
            rocs = {kind: Roc(*(z[f"{kind}.{name}"] for name in _ROC_ARRAYS)) for kind in UV_EVALUATIONS}
        if doc["label"] != label:
            raise ValueError(f"label {doc['label']!r}")
        return _Outcome(label, doc["row"], doc["lines"], rocs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"saved outcome of {label!r} in {str(out / 'methods')!r} is unreadable ({exc}); delete "
            f"{doc_path.name} to train {label} again"
        ) from None


def _train_in_pool(
    cfg: FeduvRunConfig,
    runs: list[tuple[str, str, int | None]],
    code_cache_dir: str | None,
    advance: Callable[[int], object],
    finished: Callable[[_Outcome], None],
    stop: StopAtRoundEnd,
    checkpoints: tuple[Path, str],
) -> None:
    """Train ``runs`` in ``cfg.workers`` spawned processes; ``advance(n)`` as rounds complete there,
        ``finished`` as each run ends (in completion order). After a Ctrl-C here (``stop``) or in a worker,
        every worker stops at the end of its round and no further run starts. Each run checkpoints its rounds
    in its own file (``checkpoints``: the run directory and the settings' digest, :func:`_train_one`)."""
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager:
        ticks = manager.Queue()
        halt = manager.Event()
        with ProcessPoolExecutor(max_workers=min(cfg.workers, len(runs)), mp_context=spawn) as pool:
            pending = {
                pool.submit(_train_in_worker, cfg, *run, code_cache_dir, ticks, halt, checkpoints)
                for run in runs
            }
            try:
                while pending:
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    _drain(ticks, advance)
                    for future in done:
                        finished(future.result())
                    if stop.requested:
                        halt.set()
                        stop.check()
            except BaseException:
                halt.set()  # the running workers stop at the end of their round; the queued never start
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            _drain(ticks, advance)


def _drain(ticks: Any, advance: Callable[[int], object]) -> None:
    while True:
        try:
            advance(ticks.get_nowait())
        except queue.Empty:
            return


def _train_in_worker(
    cfg: FeduvRunConfig,
    label: str,
    method: str,
    code_length: int | None,
    code_cache_dir: str | None,
    ticks: Any,
    halt: Any,
    checkpoints: tuple[Path, str],
) -> _Outcome:
    """:func:`_train_one` in a worker process, on data generated there from ``cfg``; rounds are reported
    on ``ticks`` in blocks of ten; it stops at the end of a round once ``halt`` (an event) is set or this
    process receives Ctrl-C."""
    torch.set_num_threads(cfg.threads)
    data = generate_mnist_uv(cfg.data_config())
    with StopAtRoundEnd(f"FedUV {label}", also=halt.is_set) as stop:
        return _train_one(
            cfg,
            label,
            method,
            code_length,
            data,
            code_cache_dir,
            ticks.put,
            tick_every=10,
            stop=stop,
            checkpoints=checkpoints,
        )


def _train_one(
    cfg: FeduvRunConfig,
    label: str,
    method: str,
    code_length: int | None,
    data: Any,
    code_cache_dir: str | None,
    advance: Callable[[int], object] | None = None,
    *,
    tick_every: int = 1,
    network: Any = None,
    out: Path | None = None,
    stop: StopAtRoundEnd | None = None,
    checkpoints: tuple[Path, str] | None = None,
) -> _Outcome:
    """Train, deploy and evaluate one method; ``advance(n)`` after every ``tick_every`` rounds.
    ``network`` (a :class:`fedveil.experiments.network_run.NetworkPlan`) runs the users as device agents
    over gRPC + mutual TLS instead of in this process; ``stop`` ends it at the end of a round after a
    Ctrl-C. ``checkpoints`` (the run directory and the settings' digest) checkpoints every round in
    ``methods/<label>.checkpoint.npz`` and continues from the one there (:func:`run_feduv`; over the
    ``network`` without the users' generators, which live in the agents)."""
    server, pool = _build(cfg, method, code_length, data, code_cache_dir)
    runtime: Any
    if network is None:
        runtime = SimulationRuntime(pool, rng=np.random.default_rng([cfg.seed, 2]))
    else:
        assert out is not None
        runtime, _ = network.make_runtime(out, max_message_bytes=64 * 2**20, attested=False)
    step = advance or (lambda _n: None)
    lines: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def go() -> dict[str, UvEvaluation]:
        if network is None:
            return await train()
        command = ["feduv", "agent", "--config", str(Path(out) / "config.json"), "--method", method]
        if code_length is not None:
            command += ["--code-length", str(code_length)]
        await network.start(runtime, pool.client_ids(), Path(out), command)
        try:
            return await train()
        finally:
            await network.stop(runtime)

    name = _checkpoint_name(label)

    def save(rnd: int) -> None:
        assert checkpoints is not None
        arrays, meta = server.engine.state_dict()
        extra = {
            "server": meta,
            "pool": None if network is not None else pool_rng_states(pool),
            "runtime_rng": None if network is not None else runtime.rng.bit_generator.state,
            "stats": _stats_state(runtime),
            "lines": lines,
            "method": label,
            "config_sha256": checkpoints[1],
        }
        save_checkpoint(checkpoints[0] / "methods", Checkpoint(rnd, arrays, extra), name=name)

    def resume() -> int:
        """Continue from the method's checkpoint (after set-up, which draws codewords and classes again
        as the first run did); the first round to train."""
        previous = None if checkpoints is None else load_checkpoint(checkpoints[0] / "methods", name=name)
        if previous is None:
            return 1
        assert checkpoints is not None
        check_checkpoint_identity(
            checkpoints[0] / "methods", previous, checkpoints[1], name=name, legacy=_digest(cfg, legacy=True)
        )
        server.engine.load_state_dict(previous.arrays, previous.meta["server"])
        if network is None:
            if previous.meta["pool"] is None:
                raise ConfigError(
                    f"{name} in {str(checkpoints[0] / 'methods')!r} (round {previous.round}) was trained "
                    "over the network and holds no user generators: resume it with --runtime network, or "
                    f"delete {name} to train {label} again from its first round"
                )
            restore_pool_rngs(pool, previous.meta["pool"])
            runtime.rng.bit_generator.state = previous.meta["runtime_rng"]
        _restore_stats(runtime, previous.meta["stats"])
        lines.extend(previous.meta["lines"])
        step(previous.round)
        return previous.round + 1

    async def train() -> dict[str, UvEvaluation]:
        await server.setup(runtime)
        for rnd in range(resume(), cfg.rounds + 1):
            crash_point("round", rnd)
            report = await server.run_round(rnd, runtime)
            lines.append({"method": label, **report.as_dict()})
            crash_point("metrics", rnd)
            if checkpoints is not None:
                save(rnd)
            if rnd % tick_every == 0 or rnd == cfg.rounds:
                step(rnd % tick_every or tick_every)
            if stop is not None and rnd < cfg.rounds:
                stop.check()
        await server.deploy(runtime, cfg.q)
        return {
            kind: await server.evaluate(runtime, genuine, impostor, bins=cfg.bins)
            for kind, (genuine, impostor) in UV_EVALUATIONS.items()
        }

    evaluations = asyncio.run(go())
    stats = runtime.stats()
    losses = [line["loss"] for line in lines if line["loss"] is not None]
    tail = losses[-max(1, len(losses) // 10) :]
    row: dict[str, Any] = {
        "eval": {kind: ev.summary() for kind, ev in evaluations.items()},
        "loss_first_round": losses[0] if losses else None,
        "loss_last_tenth": float(np.mean(tail)) if tail else None,
        "real_seconds": time.perf_counter() - t0,
        "bytes_up": stats.bytes_up,
        "bytes_down": stats.bytes_down,
        "dropouts": len(stats.dropouts),
        "num_params": server.model.num_params,
        "code_length": code_length,
    }
    lines.extend({"method": label, "eval": kind, **ev.summary()} for kind, ev in evaluations.items())
    return _Outcome(label, row, lines, {kind: ev.roc for kind, ev in evaluations.items()})


def bench_client_updates(
    *,
    clients: int = 4,
    width_divisor: int = 1,
    code_length: int = 127,
    examples: int = 50,
    batch_size: int = 10,
    repeats: int = 2,
    batched: bool = True,
    threads: int = 2,
    seed: int = 0,
    code_cache_dir: str | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """FedAvg client updates per second of FedUV on the MNIST-UV net (Alg. 1 UserUpdate, one epoch).

    ``clients`` users with ``examples`` training examples each run one local epoch (batches of
    ``batch_size``) from the same global model, ``repeats`` times after one untimed warm-up call,
    through the user pool directly (no codec or runtime), the users training on ``device``
    (:func:`~fedveil.models.device.resolve_device`; each call ends with the updates in host memory, so
    the timer sees the device's work finished). Returns the settings, the device, seconds and updates/s.
    """
    torch.set_num_threads(threads)
    data = generate_mnist_uv(
        MnistUvConfig(seed=seed, writers=clients, train=examples, val=1, test=1, unseen_writers=0)
    )
    torch.manual_seed(seed)
    model = UvModel(mnist_uv_net(code_length, width_divisor=width_divisor))
    server = FedUVServer(
        UvTrainConfig(fraction=1.0),
        model,
        np.random.default_rng(seed),
        code_length=code_length,
        code_cache_dir=code_cache_dir,
    )
    pool = UvClients(
        FedUVMethod(), model, data, seed=seed, batched=batched, code_cache_dir=code_cache_dir, device=device
    )
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(seed))
    asyncio.run(server.setup(runtime))
    request = UvTrainRequest(1, 0.1, 1, batch_size, server.weights)
    ids = pool.client_ids()
    pool.handle_batch(dict.fromkeys(ids, request))
    t0 = time.perf_counter()
    for _ in range(repeats):
        pool.handle_batch(dict.fromkeys(ids, request))
    seconds = time.perf_counter() - t0
    return {
        "clients": clients,
        "width_divisor": width_divisor,
        "num_params": model.num_params,
        "code_length": code_length,
        "examples": examples,
        "batch_size": batch_size,
        "repeats": repeats,
        "batched": batched,
        "threads": threads,
        "device": str(pool.device),
        "seconds": seconds,
        "client_updates_per_second": clients * repeats / seconds,
    }


def parse_int_list(text: str, name: str) -> tuple[int, ...]:
    """``"127,255,511"`` -> ``(127, 255, 511)``; :class:`ConfigError` naming ``name`` otherwise."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name} {text!r} must be comma-separated integers, e.g. 127,255,511") from None
    if not values:
        raise ConfigError(f"{name} {text!r} is empty")
    return values


def parse_methods(text: str) -> tuple[str, ...]:
    """``"feduv,fedaws"`` -> ``("feduv", "fedaws")``, checked against :data:`METHOD_NAMES`."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in values if v not in METHOD_NAMES]
    if unknown or not values:
        raise ConfigError(f"methods {text!r}: choose from {', '.join(METHOD_NAMES)}, comma-separated")
    return values


def with_overrides(cfg: FeduvRunConfig, **changes: Any) -> FeduvRunConfig:
    """``cfg`` with the non-``None`` ``changes`` applied (``fraction`` goes into ``cfg.train``); a change
    the result ignores (``code_lengths`` without FedUV) is refused."""
    fraction = changes.pop("fraction", None)
    given = {k: v for k, v in changes.items() if v is not None}
    if fraction is not None:
        given["train"] = dataclasses.replace(cfg.train, fraction=fraction)
    out = dataclasses.replace(cfg, **given)
    refuse_keys_without_effect(given, _unused_settings(out))
    return out
