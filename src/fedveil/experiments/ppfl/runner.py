"""``fedveil ppfl run CONFIG``: a PPFL run (PPFL: Privacy-preserving Federated Learning with Trusted
Execution Environments) beside end-to-end FedAvg, in a run directory.

A YAML config names the data and model (as :class:`~fedveil.experiments.fedavg_images.FedAvgRun` does:
the same clients, partition and test subset), the devices' TEE sizes, PPFL's settings
(:class:`~fedveil.protocols.ppfl.PpflConfig`, the ``ppfl:`` block) and whether to train the end-to-end
FedAvg baseline over the same total number of rounds (``e2e: true``, as Fig. 2 draws it), or first, as
the target PPFL must reach (``reach_e2e_rounds: N``, Table 3). With ``ppfl.train_last: k`` the run
transfers public knowledge (PPFL Sec. 4.3, Appendix A.1): the server first trains the whole model on
public data (``public_fraction`` times the clients' total number of examples, drawn from training
images no client holds, for ``public_epochs`` epochs), or loads it from ``pretrained`` (a safetensors
file); the clients keep its first units frozen and train its last ``k`` in their TEEs. The run
directory holds:

- ``config.json``: the settings, as parsed;
- ``memory.json``: ``S_l`` per stage (:class:`~fedveil.protocols.ppfl.TeeMemory`) and how many devices'
  TEEs can hold it;
- ``metrics.jsonl``: one line per PPFL round (stage, accuracy of layer + classifier on the test split,
  training loss, bytes up and down, phase seconds), written as each round ends;
- ``e2e.jsonl``: the baseline's rounds, when trained;
- ``results.json``: the summary (final accuracy per stage, rounds, bytes, wall-clock seconds, and the
  baseline's accuracy, bytes and seconds: PPFL's Eq. 2 against Eq. 1 as a ratio of seconds per round;
  with ``reach_e2e_rounds``, Table 3's rounds and bytes PPFL took to reach E2E's accuracy);
- ``accuracy.png``: test accuracy per round, one line per trained layer, and the baseline (Fig. 2).

**Resume.** After each round the run directory's ``checkpoint.npz`` (no pickle) holds what the run needs
to go on after it: the released values of the finished stages (public: every REE held them in the clear)
and their reports; the state of every generator a round draws from (the server's cohorts, the simulated
network's, each device's batches, torch's global one for dropout masks); and, inside a stage, that
stage's rounds so far with its layer in training *sealed* by the server's enclave (op ``layer_seal``,
:mod:`fedveil.enclave.layerwise`: AES-256-GCM under a key bound to the enclave's measurement; the host
stores only the blob, never the values). An SGX enclave's sealing key comes from the CPU; the emulated
one is derived from the run directory's ``sealing.key`` (32 random bytes, mode 0600, made by the first
run) and the measurement, so it is only as safe as that file. The enclave averages and keeps no
optimiser state, and a device's TEE holds the layer only within a round (it is sealed to it again at the
start of the next), so the sealed layer is all the TEEs' state there is. ``fedveil ppfl run CONFIG --out
DIR --resume`` releases the finished stages to the devices again, rewinds the generators, has a fresh
enclave unseal the stage's layer and goes on after the last round in the checkpoint: the resumed run
equals the uninterrupted one round for round (``tests/test_ppfl_resume.py``). A sealed layer that was
changed, sealed under another ``sealing.key``, or by an enclave of another measurement (changed enclave
code or launch config) is refused by name. The final stage's last round is checkpointed the same way,
its layer sealed (when the TEEs keep its classifier, ``keep_classifier_in_tee``, the enclave's sealed
copy is the only one outside the TEEs): a run resumed there releases it and ends as the uninterrupted
one did. The E2E FedAvg baseline is checkpointed after
each of its rounds too, in the same file (the FedAvg engine's ``state_dict``, the generators, its rounds
so far, and PPFL's finished results when it follows PPFL), and goes on from there. The checkpoint is
removed once ``results.json`` is written. A directory that
holds anything is refused unless ``--resume`` or ``--overwrite`` (clear it first) is given.

**Ctrl-C** stops the run at the end of its round, after the round's checkpoint
(:class:`~fedveil.experiments.checkpoint.StopAtRoundEnd`), and the message says which round
``--resume`` goes on from.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from fedveil.core.atomic import atomic_write
from fedveil.core.provenance import code_identity
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import ImageData
from fedveil.enclave.layerwise import SEAL_SECRET_BYTES
from fedveil.errors import ConfigError, RunInterrupted
from fedveil.experiments.checkpoint import (
    CHECKPOINT,
    Checkpoint,
    StopAtRoundEnd,
    claim_device,
    crash_point,
    differing_settings,
    identity_settings,
    load_checkpoint,
    prepare_run_dir,
    save_checkpoint,
    saved_settings,
)
from fedveil.experiments.config import load_run_config
from fedveil.experiments.fdml.runner import device_sessions
from fedveil.experiments.fedavg_images import FedAvgRun, ImageSplit, split_images, train_fedavg
from fedveil.experiments.plots import plot_series
from fedveil.experiments.report import announce_stand_in
from fedveil.models.device import check_device_spec, resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.vision import LayerwiseNet
from fedveil.models.weights import load_weights
from fedveil.models.zoo import build_model
from fedveil.protocols.common import pool_rng_states, restore_pool_rngs
from fedveil.protocols.fedavg import ImageFedAvgConfig, evaluate_model
from fedveil.protocols.local import local_train
from fedveil.protocols.ppfl import (
    HIKEY_TEE_BYTES,
    PpflClients,
    PpflConfig,
    PpflServer,
    StageProgress,
    StageReport,
)
from fedveil.runtime.enclave_host import BOUNDARIES, EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.runtime.simulation import SimulationRuntime

__all__ = [
    "PpflRun",
    "TrainedPpfl",
    "load_ppfl_run",
    "run_ppfl",
    "train_central",
    "train_e2e",
    "train_ppfl",
]

EVALUATOR = "evaluator"
SEALING_KEY = "sealing.key"
"""The run directory's sealing secret (mode 0600): the emulated enclave's sealing key is derived from it
and the enclave's measurement (:mod:`fedveil.enclave.layerwise`)."""


@dataclass(frozen=True)
class PpflRun:
    """One PPFL experiment (module docstring). ``tee_mib`` lists the TEE sizes devices draw from
    uniformly (one value: every device has it; default the HiKey 960's 16 MiB). ``reach_e2e_rounds``
    is Table 3's measure: E2E FedAvg trains first for that many rounds, and PPFL stops as soon as an
    evaluation reaches E2E's final accuracy; the results give the rounds and bytes it took.
    ``model_init`` (:data:`fedveil.models.zoo.INITS`) is how both E2E's model and each PPFL stage (drawn
    inside the enclave) start: ``darknet`` is how PPFL's own implementation starts them. ``device``
    (:func:`~fedveil.models.device.resolve_device`) is where the REEs run their frozen layers, the
    emulated client TEEs train their stage (:class:`~fedveil.protocols.ppfl.PpflClients`) and E2E's
    clients train; the server's enclave stays on the CPU."""

    name: str = "ppfl"
    data: str = "fashion-mnist"
    model: str = "lenet"
    model_init: str = "torch"
    clients: int = 10
    samples_per_client: int = 100
    scheme: str = "iid"
    test_samples: int = 1000
    seed: int = 0
    tee_mib: tuple[float, ...] = (HIKEY_TEE_BYTES / 2**20,)
    boundary: str = "inprocess"
    e2e: bool = True
    reach_e2e_rounds: int | None = None
    public_fraction: float | None = None
    public_epochs: int = 10
    pretrained: str | None = None
    threads: int = 2
    ppfl: PpflConfig = field(default_factory=PpflConfig)
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        if not self.tee_mib or any(not (isinstance(v, (int, float)) and v > 0) for v in self.tee_mib):
            raise ConfigError(f"tee_mib {self.tee_mib!r} must list one or more sizes > 0 (MiB)")
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"boundary {self.boundary!r} is not one of {', '.join(BOUNDARIES)}")
        if self.reach_e2e_rounds is not None and (
            isinstance(self.reach_e2e_rounds, bool)
            or not isinstance(self.reach_e2e_rounds, int)
            or self.reach_e2e_rounds < 1
        ):
            raise ConfigError(f"reach_e2e_rounds {self.reach_e2e_rounds!r} must be an integer >= 1 (or null)")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"threads {self.threads!r} must be an integer >= 1")
        if self.public_fraction is not None and not (
            isinstance(self.public_fraction, (int, float)) and 0 < self.public_fraction <= 10
        ):
            raise ConfigError(
                f"public_fraction {self.public_fraction!r} must be > 0 (times the clients' examples; "
                "PPFL Appendix A.1 uses 0.1, 0.5 and 1.0)"
            )
        if (
            isinstance(self.public_epochs, bool)
            or not isinstance(self.public_epochs, int)
            or self.public_epochs < 1
        ):
            raise ConfigError(f"public_epochs {self.public_epochs!r} must be an integer >= 1")
        transfer = self.public_fraction is not None or self.pretrained is not None
        if self.public_fraction is not None and self.pretrained is not None:
            raise ConfigError(
                "give public_fraction (train on public data) or pretrained (a weights file), not both"
            )
        if transfer != (self.ppfl.train_last is not None):
            raise ConfigError(
                "transfer needs both ppfl.train_last (how many last layer units the clients train) and a "
                "public model (public_fraction or pretrained)"
            )
        self.images()

    def images(self) -> FedAvgRun:
        """The data and model settings as the image FedAvg experiments take them (same split)."""
        return FedAvgRun(
            data=self.data,
            model=self.model,
            clients=self.clients,
            samples_per_client=self.samples_per_client,
            scheme=self.scheme,
            test_samples=self.test_samples,
            rounds=1,
            seed=self.seed,
            model_init=self.model_init,
            device=self.device,
        )


def _model(run: PpflRun, num_classes: int, channels: int, side: int) -> LayerwiseNet:
    model = build_model(
        run.model,
        num_classes=num_classes,
        in_channels=channels,
        image_size=side,
        seed=run.seed,
        init=run.model_init,
    )
    if not isinstance(model, LayerwiseNet):
        raise ConfigError(f"model {run.model!r} is not a layer-wise network")
    return model


def load_ppfl_run(path: str | Path, overrides: Mapping[str, Any] | None = None) -> PpflRun:
    """A :class:`PpflRun` from a YAML file with ``overrides`` (nested, e.g. ``--set``'s) on top: unknown
    keys and wrong values are refused, named, and so is ``e2e`` where ``reach_e2e_rounds`` trains E2E
    anyway (:func:`~fedveil.experiments.config.load_run_config`)."""
    return load_run_config(PpflRun, path, overrides, unused=_unused_settings)


def _unused_settings(run: PpflRun) -> list[tuple[str, bool, str]]:
    """The settings ``run`` ignores (:func:`~fedveil.experiments.config.keys_without_effect`)."""
    why = "reach_e2e_rounds trains E2E FedAvg first, as PPFL's target"
    return [("e2e", run.reach_e2e_rounds is not None, why)]


def _write_json(path: Path, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def run_ppfl(
    run: PpflRun,
    out_dir: str | Path,
    *,
    progress: Callable[[str], None] | None = None,
    show_bar: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train PPFL (and the end-to-end baseline), write the run directory, return ``results.json``.

    With ``resume``, a run directory holding a checkpoint of the same config continues after the last
    stage it finished (module docstring); one holding finished results returns them. Without it the
    directory must be missing or empty, or ``overwrite`` clears it first."""
    say = progress or (lambda _line: None)
    torch.set_num_threads(run.threads)
    # a device this machine lacks fails before the run directory is touched
    device = resolve_device(run.device)
    stages = run.ppfl.stages(_model(run, 10, 3, 32))  # a bad block size or train_last fails before loading
    out = prepare_run_dir(out_dir, resume=resume, overwrite=overwrite)
    config = asdict(run)
    split = split_images(run.images())
    config["data_source"] = split.train.describe()
    config = json.loads(json.dumps(config, sort_keys=True))
    mine = identity_settings(config)  # the device is compared as resolved, by claim_device
    ckpt = load_checkpoint(out) if resume else None
    if ckpt is not None and "sealed" in ckpt.arrays and not (out / SEALING_KEY).is_file():
        raise ConfigError(
            f"{out / CHECKPOINT} holds a layer sealed under {out / SEALING_KEY}, which is missing: the "
            "enclave cannot unseal it; put the file back, or start afresh with --overwrite"
        )
    if resume and ckpt is None and (out / "results.json").is_file():
        saved = out / "config.json"
        theirs = identity_settings(saved_settings(saved) if saved.is_file() else {})
        if theirs != mine:
            differ = differing_settings(mine, theirs)
            raise ConfigError(
                f"{out} holds a finished run of another config ({', '.join(differ)}): resume with the config "
                "it was run with, start afresh with --overwrite, or give another --out"
            )
        claim_device(out, device, artefacts=("results.json",))
        say(f"{out} holds a finished run: its results.json stands")
        return dict(json.loads((out / "results.json").read_text(encoding="utf-8")))
    differ = [] if ckpt is None else differing_settings(mine, identity_settings(ckpt.meta.get("config", {})))
    if differ:
        raise ConfigError(
            f"{out} holds a checkpoint of another config ({', '.join(differ)}): resume with the config it "
            "was started with, or give another --out"
        )
    claim_device(out, device, artefacts=(CHECKPOINT, "metrics.jsonl", "e2e.jsonl", "results.json"))
    _write_json(out / "config.json", config)
    secret = _sealing_secret(out)
    if split.train.synthetic:
        announce_stand_in(f"{split.train.name}, {split.train.source}", quiet=progress is None)
    else:
        say(split.train.describe())
    state: dict[str, Any] = {"stages": [], "seconds": 0.0, **(ckpt.meta if ckpt else {}), "config": config}
    e2e: list[dict[str, Any]] | None = None
    stop = StopAtRoundEnd(f"PPFL run {run.name!r}")

    def interrupted() -> RunInterrupted:
        saved = load_checkpoint(out)
        if saved is not None and "e2e_progress" in saved.meta:
            return RunInterrupted(
                f"PPFL run {run.name!r} interrupted in its E2E FedAvg baseline after round {saved.round}, "
                f"whose checkpoint is in {out}: it goes on again from round {saved.round + 1}"
            )
        if run.reach_e2e_rounds is not None and (saved is None or "e2e" not in saved.meta):
            return RunInterrupted(
                f"PPFL run {run.name!r} interrupted in its E2E FedAvg target run before its first "
                "checkpoint: it starts again from round 1"
            )
        if saved is None or not (saved.meta.get("stages") or "partial" in saved.meta):
            return RunInterrupted(
                f"PPFL run {run.name!r} interrupted before its first checkpoint: it starts again from round 1"
            )
        if saved.meta.get("partial", {}).get("stopped"):
            return RunInterrupted(
                f"PPFL run {run.name!r} interrupted after its last round {saved.round}, whose checkpoint is "
                f"in {out}: it goes on with the release and evaluation of its final stage"
            )
        where = (
            f"stage {saved.meta['partial']['stage']} goes on with its layer as the enclave sealed it"
            if "partial" in saved.meta
            else f"stage {len(saved.meta['stages'])} begins"
        )
        return RunInterrupted(
            f"PPFL run {run.name!r} interrupted after round {saved.round}, whose checkpoint is in {out}: "
            f"it goes on again from round {saved.round + 1}, where {where}"
        )

    def baseline(rounds: int) -> tuple[list[dict[str, Any]], float]:
        """E2E FedAvg over ``rounds`` rounds and its seconds, checkpointed after each round with ``state``
        (what the run finished before it), going on from the checkpoint's E2E round when there is one."""
        before = state.pop("e2e_progress", None)
        resumed = None
        if ckpt is not None and before is not None:
            arrays = {k.removeprefix("e2e_"): v for k, v in ckpt.arrays.items() if k.startswith("e2e_")}
            resumed = Checkpoint(ckpt.round, arrays, before)
        spent = float(before["seconds"]) if before is not None else 0.0
        started = time.perf_counter()

        def on_round(c: Checkpoint) -> None:
            progress = {**c.meta, "seconds": spent + time.perf_counter() - started}
            arrays = {f"e2e_{k}": v for k, v in c.arrays.items()}
            save_checkpoint(out, Checkpoint(c.round, arrays, {**state, "e2e_progress": progress}))
            crash_point("e2e_checkpoint", c.round)
            stop.check()

        try:
            with stop:
                history = train_e2e(run, split, rounds, show_bar, on_round=on_round, resume=resumed)
        except KeyboardInterrupt:
            raise interrupted() from None
        return history, spent + time.perf_counter() - started

    if run.reach_e2e_rounds is not None:
        if "e2e" in state:
            e2e, e2e_seconds = state["e2e"], float(state["e2e_seconds"])
            say(f"E2E FedAvg: {len(e2e)} rounds, from the checkpoint")
        else:
            e2e, e2e_seconds = baseline(run.reach_e2e_rounds)
            state.update(e2e=e2e, e2e_seconds=e2e_seconds)
            save_checkpoint(out, Checkpoint(0, {}, state))
            ckpt = load_checkpoint(out) if ckpt is not None else None
        target = e2e[-1]["test_accuracy"]
        say(f"E2E FedAvg: {len(e2e)} rounds, accuracy {target:.4f}: PPFL's target")
        run = replace(run, ppfl=replace(run.ppfl, target_accuracy=target))
    finished = "ppfl_results" in state  # PPFL had finished; its E2E baseline was interrupted
    restored = [
        (StageReport.from_json(report), ckpt.arrays[f"released_{i}"])
        for i, report in enumerate(state["stages"])
        if ckpt is not None and not finished
    ]
    partial = (
        StageProgress.from_json(state["partial"], ckpt.arrays["sealed"].tobytes())
        if ckpt is not None and "partial" in state and not finished
        else None
    )
    if ckpt is not None and (restored or partial):
        say(f"resuming after round {ckpt.round}")
    metrics_path = out / "metrics.jsonl"
    partial_lines = partial.rounds if partial is not None else []
    if not finished:  # the round lines of the checkpoint, no more
        metrics_path.write_text(
            "".join(
                json.dumps(line, sort_keys=True) + "\n"
                for line in [*(x for r, _ in restored for x in r.rounds), *partial_lines]
            )
        )
    released_so_far = {f"released_{i}": w for i, (_, w) in enumerate(restored)}
    started_at = time.perf_counter()

    def save(rnd: int, generators: dict[str, Any], progress: StageProgress | None) -> None:
        """The checkpoint after round ``rnd``: the finished stages' released values, the generators, and
        the stage in training's progress with its sealed layer (never its values in the clear)."""
        meta = {k: v for k, v in state.items() if k != "partial"}
        meta.update(seconds=float(state["seconds"]) + time.perf_counter() - started_at, generators=generators)
        arrays = dict(released_so_far)
        if progress is not None:
            meta["partial"] = progress.to_json()
            arrays["sealed"] = np.frombuffer(progress.sealed, dtype=np.uint8)
        save_checkpoint(out, Checkpoint(rnd, arrays, meta))
        crash_point("ppfl_checkpoint", rnd)
        stop.check()

    def checkpoint(report: StageReport, released: np.ndarray, generators: dict[str, Any]) -> None:
        """After each stage but the final one (checkpointed after its last round, sealed: ``mid_stage``)."""
        if report.stage >= len(stages) - 1:
            return
        released_so_far[f"released_{report.stage}"] = released
        state["stages"] = [*state["stages"], report.to_json()]
        save(report.rounds[-1]["round"] if report.rounds else 0, generators, None)

    def mid_stage(progress: StageProgress, generators: dict[str, Any]) -> None:
        """After each round that its stage follows with another, and after the final stage's last."""
        save(progress.round, generators, progress)

    bar = tqdm(total=None, unit="round", desc=run.name, disable=not show_bar)

    def record(line: dict[str, Any]) -> None:
        with metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
        bar.update(1)
        if "accuracy" in line:
            bar.set_postfix(layer=line["stage"], acc=f"{line['accuracy']:.3f}")
        crash_point("ppfl_metrics", line["round"])

    def memory(server: PpflServer) -> None:
        bar.total = len(server.stages) * run.ppfl.rounds_per_stage
        _write_json(
            out / "memory.json",
            [
                {**m.as_dict(), "eligible": len(server.eligible(m)), "devices": len(server.members)}
                for m in server.memory
            ],
        )

    if finished:
        results = dict(state["ppfl_results"])
        series = {k: [(r, a) for r, a in v] for k, v in state["ppfl_series"].items()}
        bar.close()
        say(f"PPFL: {results['rounds']} rounds, final accuracy {results['final_accuracy']} (checkpoint)")
    else:
        try:
            with stop:
                trained = train_ppfl(
                    run,
                    split,
                    progress=record,
                    on_setup=memory,
                    resume=restored,
                    start_round=ckpt.round if ckpt is not None else 0,
                    on_stage=checkpoint,
                    partial=partial,
                    generators=state.get("generators") if ckpt is not None else None,
                    sealing_secret=secret,
                    on_round=mid_stage,
                )
        except KeyboardInterrupt:
            raise interrupted() from None
        finally:
            bar.close()
        server, final = trained.server, trained.final
        seconds = float(state["seconds"]) + trained.seconds
        lines = [line for r in server.reports for line in r.rounds]
        results: dict[str, Any] = {
            "name": run.name,
            "code": code_identity(),
            "data": split.train.describe(),
            "synthetic_data": split.train.synthetic,
            "model": run.model,
            "stages": [
                {
                    "stage": r.stage,
                    "units": list(r.units),
                    "tee_bytes_needed": r.memory.total,
                    "eligible_devices": r.eligible,
                    "rounds": len(r.rounds),
                    "accuracy": r.rounds[-1].get("accuracy") if r.rounds else None,
                    "stopped": r.stopped or "rounds",
                }
                for r in server.reports
            ],
            "rounds": len(lines),
            "bytes_up": sum(line["bytes_up"] for line in lines),
            "bytes_down": sum(line["bytes_down"] for line in lines),
            "final_accuracy": final.get("accuracy", lines[-1].get("accuracy") if lines else None),
            "seconds": seconds,
            "phase_seconds": _phase_seconds(server),
        }
        if trained.public:
            results["public"] = trained.public
            results["train_last"] = run.ppfl.train_last
        say(f"PPFL: {len(lines)} rounds in {seconds:.0f} s, final accuracy {results['final_accuracy']}")
        series = {
            (f"PPFL last {run.ppfl.train_last} units" if trained.public else f"PPFL layer {r.stage + 1}"): [
                (line["round"], line["accuracy"]) for line in r.rounds if "accuracy" in line
            ]
            for r in server.reports
        }
    if run.reach_e2e_rounds is not None:
        reached = bool(results["stages"]) and results["stages"][-1]["stopped"] == "target"
        results["target_accuracy"] = run.ppfl.target_accuracy
        results["reached"] = reached
        results["rounds_to_reach"] = results["rounds"] if reached else None
        results["bytes_to_reach"] = results["bytes_up"] + results["bytes_down"] if reached else None
    elif run.e2e:
        if "ppfl_results" not in state:
            for key in ("partial", "generators"):
                state.pop(key, None)
            state.update(ppfl_results=dict(results), ppfl_series=series)
        e2e, e2e_seconds = baseline(results["rounds"])
    if e2e is not None:
        results["e2e_rounds"] = len(e2e)
        results["e2e_seconds"] = e2e_seconds
        per_round = results["seconds"] / max(1, results["rounds"])
        results["ppfl_over_e2e_seconds_per_round"] = per_round / (e2e_seconds / len(e2e))
        with (out / "e2e.jsonl").open("w", encoding="utf-8") as f:
            for line in e2e:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        series["E2E FedAvg"] = [
            (line["round"], line["test_accuracy"]) for line in e2e if "test_accuracy" in line
        ]
        results["e2e_accuracy"] = e2e[-1].get("test_accuracy")
        results["e2e_bytes_up"] = sum(line["bytes_up"] for line in e2e)
        results["e2e_bytes_down"] = sum(line["bytes_down"] for line in e2e)
        say(f"E2E FedAvg: {len(e2e)} rounds, final accuracy {results['e2e_accuracy']}")
    plot_series(series, out / "accuracy.png", title=f"PPFL {run.model}: test accuracy", ylabel="accuracy")
    _write_json(out / "results.json", results)
    (out / CHECKPOINT).unlink(missing_ok=True)
    return results


def _phase_seconds(server: PpflServer) -> list[dict[str, Any]]:
    """Table 4: per stage, the median seconds of each phase of a round (broadcast: sealing theta_l to the
    cohort in the enclave; train: the clients' REE forward, TEE training and sealing, with the simulated
    network's transfers; aggregate: opening and averaging in the enclave)."""
    out = []
    for r in server.reports:
        if not r.rounds:
            continue
        row: dict[str, Any] = {"stage": r.stage, "units": list(r.units), "rounds": len(r.rounds)}
        for phase in ("broadcast", "train", "aggregate"):
            row[phase] = float(np.median([line[f"seconds_{phase}"] for line in r.rounds]))
        out.append(row)
    return out


@dataclass
class TrainedPpfl:
    """A finished PPFL run: the ``server`` (per-stage reports), the devices (``pool``: what each REE
    holds), the ``model`` architecture, the final evaluation with the classifier kept in the TEEs
    (``final``, empty otherwise) and the wall-clock ``seconds``."""

    server: PpflServer
    pool: PpflClients
    model: LayerwiseNet
    final: dict[str, float]
    seconds: float
    public: dict[str, Any] = field(default_factory=dict)


def train_ppfl(
    run: PpflRun,
    split: ImageSplit,
    *,
    tap: Callable[[str, bytes], None] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    on_setup: Callable[[PpflServer], None] | None = None,
    resume: Sequence[tuple[StageReport, np.ndarray]] = (),
    start_round: int = 0,
    on_stage: Callable[[StageReport, np.ndarray, dict[str, Any]], None] | None = None,
    partial: StageProgress | None = None,
    generators: Mapping[str, Any] | None = None,
    sealing_secret: bytes | None = None,
    on_round: Callable[[StageProgress, dict[str, Any]], None] | None = None,
) -> TrainedPpfl:
    """Train PPFL on ``split``'s clients, with an evaluation device holding its test subset; ``tap`` sees
    every byte on the wire (an observer), ``progress`` every round's line, ``on_setup`` the server after
    registration and attestation, ``on_stage`` each stage's report and released values and ``on_round``
    the progress of a stage that goes on after a round (its layer sealed under ``sealing_secret``), both
    with the generators' states then (:func:`_generator_states`); ``resume``, ``partial``,
    ``start_round`` and ``generators`` continue an interrupted run from those (:meth:`PpflServer.train`):
    the generators are rewound once the finished stages are released again, so that the rest of the run
    draws what the uninterrupted run drew.

    Dropout's masks (VGG9's dropout layers, which its stages train) come from torch's global generator,
    which is seeded here with ``run.seed``, as :func:`~fedveil.experiments.fedavg_images.train_fedavg`
    seeds it: the training is then the same whatever ran before it in the process."""
    torch.manual_seed(run.seed)
    shape = split.members.image_shape
    model = _model(run, split.members.num_classes, shape[0], shape[1])
    data = FederatedDataset([*split.data, UserData(EVALUATOR, {}, {"x": split.test.x, "y": split.test.y})])
    draw = np.random.default_rng([run.seed, 7])
    tee = {c: int(float(draw.choice(run.tee_mib)) * 2**20) for c in data.user_ids}
    platform = SimulatedPlatform.generate()
    cfg = run.ppfl
    final: dict[str, float] = {}
    public_model, public_info = _public_model(run, split, model)
    with EnclaveHost.start(platform=platform, boundary=run.boundary) as host:
        sessions = device_sessions(data.user_ids, platform.public_key, host.measurement)
        pool = PpflClients(
            model,
            data,
            optimizer=cfg.optimizer(),
            seed=run.seed,
            block_size=cfg.block_size,
            train_last=cfg.train_last,
            classifier_stage=cfg.classifier_stage,
            classifier_pool=cfg.classifier_pool,
            sessions=sessions,
            tee_bytes=tee,
            evaluators=[EVALUATOR],
            device=run.device,
        )
        runtime = SimulationRuntime(pool, rng=np.random.default_rng(run.seed + 1), tap=tap)
        server = PpflServer(
            model, cfg, host, np.random.default_rng(run.seed + 2), public=public_model, init=run.model_init
        )
        server.sealing_secret = sealing_secret
        start = time.perf_counter()

        def states() -> dict[str, Any]:
            return _generator_states(server, runtime, pool)

        async def go() -> None:
            await server.setup(runtime)
            if on_setup is not None:
                on_setup(server)
            server.round = start_round
            await server.train(
                runtime,
                progress=progress,
                resume=resume,
                on_stage=None if on_stage is None else lambda r, w: on_stage(r, w, states()),
                partial=partial,
                on_round=None if on_round is None else lambda p: on_round(p, states()),
                resumed=None
                if generators is None
                else lambda: _restore_generators(generators, server, runtime, pool),
            )
            if cfg.keep_classifier_in_tee:
                final.update(await server.evaluate_kept(runtime))

        asyncio.run(go())
        seconds = time.perf_counter() - start
    return TrainedPpfl(server, pool, model, final, seconds, public_info)


def _generator_states(server: PpflServer, runtime: SimulationRuntime, pool: PpflClients) -> dict[str, Any]:
    """Every generator a PPFL round draws from, JSON-ready: the server's (cohorts), the simulated
    network's, each device's (batches) and torch's global one (dropout masks)."""
    return {
        "server": server.rng.bit_generator.state,
        "runtime": runtime.rng.bit_generator.state,
        "pool": pool_rng_states(pool),
        "torch": torch.get_rng_state().tolist(),
    }


def _restore_generators(
    states: Mapping[str, Any], server: PpflServer, runtime: SimulationRuntime, pool: PpflClients
) -> None:
    """Rewind the generators to what :func:`_generator_states` saved."""
    try:
        server.rng.bit_generator.state = dict(states["server"])
        runtime.rng.bit_generator.state = dict(states["runtime"])
        restore_pool_rngs(pool, states["pool"])
        torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"the checkpoint's generator states do not fit this run: {exc!r}") from exc


def _sealing_secret(out: Path) -> bytes:
    """The run directory's sealing secret (:data:`SEALING_KEY`), made (32 random bytes, mode 0600) if
    missing."""
    path = out / SEALING_KEY
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) != SEAL_SECRET_BYTES:
            raise ConfigError(
                f"{path} holds {len(secret)} bytes, not a {SEAL_SECRET_BYTES}-byte sealing secret: start "
                "afresh with --overwrite"
            ) from None
        return secret
    secret = os.urandom(SEAL_SECRET_BYTES)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    return secret


def _public_model(
    run: PpflRun, split: ImageSplit, model: LayerwiseNet
) -> tuple[nn.Module | None, dict[str, Any]]:
    """The public model a transfer run starts from (module docstring), and what to report about it."""
    if run.pretrained is not None:
        loaded = load_weights(model, run.pretrained)
        return loaded, {
            "pretrained": run.pretrained,
            "accuracy": evaluate_model(loaded, split.test.x, split.test.y)["accuracy"],
        }
    if run.public_fraction is None:
        return None, {}
    used = np.concatenate([split.member_index, split.non_member_index])
    pool = np.setdiff1d(np.arange(len(split.train)), used)
    count = max(1, round(run.public_fraction * len(split.members)))
    if count > len(pool):
        raise ConfigError(
            f"public_fraction {run.public_fraction} asks for {count} public examples; {split.train.name} has "
            f"{len(pool)} that no client holds"
        )
    index = np.sort(np.random.default_rng([run.seed, 11]).choice(pool, count, replace=False))
    public = split.train.subset(index)
    trained = train_central(model, public, run.ppfl, run.public_epochs, seed=run.seed, device=run.device)
    return trained, {
        "fraction": run.public_fraction,
        "samples": count,
        "epochs": run.public_epochs,
        "accuracy": evaluate_model(trained, split.test.x, split.test.y)["accuracy"],
    }


def train_central(
    model: nn.Module,
    data: ImageData,
    cfg: PpflConfig,
    epochs: int,
    *,
    seed: int,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The server's training on public data (PPFL Appendix A.1): a copy of ``model`` trained centrally for
    ``epochs`` epochs with the clients' optimiser settings (SGD, momentum, rate decayed per epoch).

    It trains on ``device`` (:func:`~fedveil.models.device.resolve_device`), where the public examples
    move once; the trained copy comes back to host memory, where the server's enclave reads it."""
    where = resolve_device(device)
    trained = copy.deepcopy(model).train().to(where)
    flat = FlatModel(trained)
    rng = np.random.default_rng([seed, 12])
    x, y = torch.from_numpy(data.x).to(where), torch.from_numpy(data.y).to(where)
    batches, rates = [], []
    for epoch in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y))).to(where)
        for s in range(0, len(y), cfg.batch_size):
            idx = order[s : s + cfg.batch_size]
            batches.append((x[idx], y[idx]))
            rates.append(cfg.lr * cfg.epoch_decay**epoch)
    p, _ = local_train(
        lambda q, t, labels: nn.functional.cross_entropy(flat(q, t), labels),
        torch.from_numpy(flat.initial()).to(where),
        batches,
        cfg.optimizer(),
        rates,
        inplace=True,
    )
    flat.load_into_module(p.detach().cpu().numpy())
    return trained.eval().cpu()


def train_e2e(
    run: PpflRun,
    split: ImageSplit,
    rounds: int,
    show_bar: bool,
    *,
    on_round: Callable[[Checkpoint], None] | None = None,
    resume: Checkpoint | None = None,
) -> list[dict[str, Any]]:
    """End-to-end FedAvg with PPFL's client settings, over ``rounds`` rounds (the one FedAvg engine); its
    rate is not decayed per epoch (the engine's schedule is per round). ``on_round`` and ``resume``: a
    checkpoint after each round, and going on from one (:func:`fedavg_images.train_fedavg`)."""
    cfg = run.ppfl
    fedavg = ImageFedAvgConfig(
        clients_per_round=cfg.clients_per_round or run.clients,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        optimizer=cfg.optimizer(),
    )
    base = replace(run.images(), rounds=max(1, rounds), fedavg=fedavg)
    return train_fedavg(base, progress=show_bar, split=split, on_round=on_round, resume=resume).history
