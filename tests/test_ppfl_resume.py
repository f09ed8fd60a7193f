"""A PPFL run stopped inside a stage (Ctrl-C, or SIGKILL at either side of a round's checkpoint) goes on
after its last finished round and ends as the uninterrupted run does: the stage's layer is checkpointed
sealed by the server's enclave to its measurement (never in the clear), and the generators are rewound.
A sealed layer that was changed, sealed under another secret or by another enclave is refused by name."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedveil.cli import main
from fedveil.enclave.layerwise import ParamSpec
from fedveil.enclave.measure import EnclaveConfig
from fedveil.errors import RunInterrupted, ValidationError
from fedveil.experiments.checkpoint import (
    CHECKPOINT,
    CRASH_ENV,
    Checkpoint,
    StopRequested,
    load_checkpoint,
    save_checkpoint,
)
from fedveil.experiments.ppfl import runner as ppfl_runner
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from test_experiments_rundir import interrupt

# LeNet in three stages of three rounds, two of three devices per round: about 3 s of training
TINY = """
name: tiny
data: synthetic-fashion-mnist:600
model: lenet
clients: 3
samples_per_client: 24
test_samples: 60
tee_mib: [64]
threads: 1
e2e: false
ppfl: {rounds_per_stage: 3, local_epochs: 1, batch_size: 8, lr: 0.05, clients_per_round: 2}
"""


def _config(directory: Path) -> Path:
    path = directory / "tiny.yaml"
    path.write_text(TINY)
    return path


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedveil.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _outcome(out: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """Every round's line but its timings, and each stage's final accuracy."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [{k: v for k, v in line.items() if not k.startswith("seconds")} for line in lines]
    results = json.loads((out / "results.json").read_text())
    return rounds, [s["accuracy"] for s in results["stages"]] + [results["final_accuracy"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[Any]]:
    base = tmp_path_factory.mktemp("ppfl-uninterrupted")
    done = _cli("ppfl", "run", str(_config(base)), "--out", str(base / "run"), "--no-progress")
    assert done.returncode == 0, done.stderr
    return _outcome(base / "run")


@pytest.mark.parametrize(
    "point",
    [
        "ppfl_metrics:2",  # stage 0's round 2 written to metrics.jsonl, its checkpoint not yet
        "ppfl_checkpoint:5",  # just after stage 1's round 5 (its second) was checkpointed
    ],
)
def test_a_run_killed_inside_a_stage_resumes_to_the_uninterrupted_run(
    tmp_path: Path, uninterrupted: tuple[list[dict[str, Any]], list[Any]], point: str
) -> None:
    out = tmp_path / "run"
    args = ["ppfl", "run", str(_config(tmp_path)), "--out", str(out), "--no-progress"]
    crashed = _cli(*args, env={CRASH_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    ckpt = load_checkpoint(out)
    assert ckpt is not None and "sealed" in ckpt.arrays and "partial" in ckpt.meta, "a mid-stage checkpoint"
    resumed = _cli(*args, "--resume", "--device", "cpu")  # the device ``auto`` resolved to here
    assert resumed.returncode == 0, resumed.stderr
    assert _outcome(out) == uninterrupted, "every round's loss and accuracy, bit for bit"
    assert load_checkpoint(out) is None


def _interrupt(cmd: list[str], metrics: Path) -> tuple[int, str]:
    """Start ``fedveil cmd`` as a terminal does, press Ctrl-C once a round line is written."""
    err_path = Path(tempfile.mkstemp(prefix="fedveil-stderr-")[1])
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedveil.cli", *cmd],
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text()):
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_path.read_text()
    err_path.unlink()
    return proc.returncode, err


def test_ctrl_c_inside_a_stage_checkpoints_it_and_the_resumed_run_ends_as_the_uninterrupted_one(
    tmp_path: Path, uninterrupted: tuple[list[dict[str, Any]], list[Any]]
) -> None:
    out = tmp_path / "run"
    cmd = ["ppfl", "run", str(_config(tmp_path)), "--out", str(out), "--no-progress"]
    code, err = _interrupt(cmd, out / "metrics.jsonl")
    assert code == 2 and "Traceback" not in err, err
    ckpt = load_checkpoint(out)
    assert ckpt is not None and ckpt.round < 9, "stopped at the end of a round, with its checkpoint"
    last = err.strip().splitlines()[-1]
    assert f"interrupted after round {ckpt.round}, whose checkpoint is in {out}" in last, last
    assert f"again from round {ckpt.round + 1}" in last, last
    assert last.endswith("continue with: " + shlex.join(["fedveil", *cmd, "--resume"])), last
    rounds = [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(1, ckpt.round + 1))
    assert main([*cmd, "--resume"]) == 0
    assert _outcome(out) == uninterrupted


def _windows(values: np.ndarray, count: int = 64) -> list[bytes]:
    """``count`` runs of four consecutive float32 values of ``values``, spread evenly over it, as bytes."""
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    starts = np.linspace(0, values.size - 4, count).astype(int)
    return [raw[4 * i : 4 * i + 16] for i in starts]


def test_the_checkpoint_never_holds_the_layer_in_training_in_the_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy reads the layer in training out of the (in-process) enclave's memory whenever it is sealed,
    and searches each checkpoint file written then, byte by byte, for runs of four consecutive values of
    it spread over the whole layer; the same search finds the released stages, which are public and
    stored in the clear."""
    seen: list[tuple[np.ndarray, bytes, np.ndarray]] = []
    inside: list[np.ndarray] = []
    real_seal, real_save = EnclaveHost.layer_seal, ppfl_runner.save_checkpoint

    def spy_seal(self: EnclaveHost, stage: int, rnd: int, secret: bytes) -> bytes:
        inside.append(self._transport._service._layers.current(stage).copy())  # type: ignore[attr-defined]
        return real_seal(self, stage, rnd, secret)

    def spy_save(directory: Path, ckpt: Checkpoint) -> Path:
        path = real_save(directory, ckpt)
        if "sealed" in ckpt.arrays:
            released = ckpt.arrays.get("released_0", np.zeros(0, dtype=np.float32))
            seen.append((inside[-1], path.read_bytes(), released))
        return path

    monkeypatch.setattr(EnclaveHost, "layer_seal", spy_seal)
    monkeypatch.setattr(ppfl_runner, "save_checkpoint", spy_save)
    assert main(["ppfl", "run", str(_config(tmp_path)), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert len(seen) == 7, "two mid-stage checkpoints in each of the three stages, and the final one's last"
    for theta, stored, released in seen:
        assert theta.size > 100
        assert not [w for w in _windows(theta) if w in stored], "the layer in training, in the clear"
        assert all(w in stored for w in _windows(released)), "the spy finds what is stored in the clear"
    assert any(released.size for _, _, released in seen)


def _host(config: EnclaveConfig | None = None, boundary: str = "inprocess") -> EnclaveHost:
    return EnclaveHost.start(config, platform=SimulatedPlatform.generate(), boundary=boundary)


def test_a_sealed_layer_opens_only_in_an_enclave_of_the_same_measurement_under_the_same_secret() -> None:
    specs = [ParamSpec((6, 5), "uniform", 0.3), ParamSpec((6,), "zeros")]
    secret, other = os.urandom(32), os.urandom(32)
    with _host(boundary="process") as host:  # the enclave in its own process: the same measurement
        host.layer_begin(1, specs, seed=4)
        sealed = host.layer_seal(1, 7, secret)
        theta = host.layer_release(1)
    with _host() as host:
        assert host.layer_unseal(1, 7, secret, sealed) == 36
        np.testing.assert_array_equal(host.layer_release(1), theta)
    tampered = bytearray(sealed)
    tampered[-20] ^= 1
    for why, (rnd, key, blob) in {
        "a changed byte": (7, secret, bytes(tampered)),
        "another run directory's secret": (7, other, sealed),
        "another round's blob": (6, secret, sealed),
    }.items():
        with _host() as host, pytest.raises(ValidationError, match="fails authentication"):
            host.layer_unseal(1, rnd, key, blob)
            pytest.fail(why)
    changed = EnclaveConfig(memory_limit_bytes=EnclaveConfig().memory_limit_bytes // 2)
    with _host(changed) as host, pytest.raises(ValidationError, match="a changed enclave cannot unseal"):
        host.layer_unseal(1, 7, secret, sealed)


def test_resume_refuses_a_tampered_sealed_layer_or_a_missing_sealing_key_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["ppfl", "run", str(_config(tmp_path)), "--out", str(out), "--no-progress"]
    crashed = _cli(*args, env={CRASH_ENV: "ppfl_checkpoint:2"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    ckpt = load_checkpoint(out)
    assert ckpt is not None
    sealed = ckpt.arrays["sealed"].copy()
    sealed[-1] ^= 1
    save_checkpoint(out, Checkpoint(ckpt.round, {**ckpt.arrays, "sealed": sealed}, ckpt.meta))
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fails authentication" in err, err
    (out / "sealing.key").unlink()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sealing.key, which is missing" in err and "--overwrite" in err, err


def test_the_e2e_baseline_killed_mid_run_resumes_from_its_checkpoint_to_the_uninterrupted_baseline(
    tmp_path: Path,
) -> None:
    """PPFL's rounds are kept (not trained again) and FedAvg goes on after its last checkpointed round."""
    config = tmp_path / "e2e.yaml"
    config.write_text(
        TINY.replace("e2e: false", "e2e: true").replace("rounds_per_stage: 3", "rounds_per_stage: 2")
    )
    runs = {}
    for name, env in (("whole", {}), ("killed", {CRASH_ENV: "e2e_checkpoint:3"})):
        out = tmp_path / name
        args = ["ppfl", "run", str(config), "--out", str(out), "--no-progress"]
        done = _cli(*args, env=env)
        if name == "killed":
            assert done.returncode == -signal.SIGKILL, done.stderr
            ckpt = load_checkpoint(out)
            assert ckpt is not None and ckpt.round == 3 and "e2e_weights" in ckpt.arrays
            done = _cli(*args, "--resume")
            assert "PPFL: 6 rounds" in done.stdout and "(checkpoint)" in done.stdout, done.stdout
        assert done.returncode == 0, done.stderr
        e2e = [json.loads(x) for x in (out / "e2e.jsonl").read_text().splitlines()]
        results = json.loads((out / "results.json").read_text())
        runs[name] = (_outcome(out), e2e, results["e2e_accuracy"])
    assert runs["killed"] == runs["whole"]
    assert [line["round"] for line in runs["whole"][1]] == [1, 2, 3, 4, 5, 6]


def test_a_run_stopped_after_the_final_round_with_the_classifier_kept_in_the_tees_resumes_to_the_same_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final stage's last round is checkpointed sealed too: with the TEEs keeping the classifier its
    sealed layer is the only copy outside them. A run stopped right after that checkpoint (Ctrl-C, here
    raised where the crash-test hook sits) says so, and the resumed run releases it and evaluates as the
    uninterrupted run does, training no round again."""
    config = tmp_path / "kept.yaml"
    config.write_text(
        TINY.replace("rounds_per_stage: 3", "rounds_per_stage: 2").replace(
            "clients_per_round: 2}", "clients_per_round: 2, keep_classifier_in_tee: true}"
        )
    )
    run = ppfl_runner.load_ppfl_run(config)
    whole = ppfl_runner.run_ppfl(run, tmp_path / "whole", show_bar=False)
    passed: list[str] = []

    def hook(name: str, rnd: int) -> None:
        passed.append(f"{name}:{rnd}")
        if passed[-1] == "ppfl_checkpoint:6":
            raise StopRequested

    monkeypatch.setattr(ppfl_runner, "crash_point", hook)
    out = tmp_path / "cut"
    with pytest.raises(RunInterrupted, match=r"after its last round 6, .* release and evaluation of its"):
        ppfl_runner.run_ppfl(run, out, show_bar=False)
    ckpt = load_checkpoint(out)
    assert ckpt is not None and ckpt.round == 6 and "sealed" in ckpt.arrays
    assert ckpt.meta["partial"]["stage"] == 2 and ckpt.meta["partial"]["stopped"] == "rounds"
    passed.clear()
    resumed = ppfl_runner.run_ppfl(run, out, show_bar=False, resume=True)
    assert passed == [], "no round is trained again"
    assert _outcome(out) == _outcome(tmp_path / "whole"), "every round's line and the final accuracy"
    assert resumed["final_accuracy"] == whole["final_accuracy"] is not None
    assert load_checkpoint(out) is None


def test_ctrl_c_in_the_e2e_baseline_stops_at_the_end_of_its_round_with_the_command_that_continues(
    tmp_path: Path,
) -> None:
    """Ctrl-C in the E2E FedAvg baseline (here Table 3's, trained first) stops it at the end of a round,
    after that round's checkpoint, and the last line names the round and the exact command that
    continues."""
    config = tmp_path / "reach.yaml"
    config.write_text(TINY.replace("e2e: false", "reach_e2e_rounds: 100000"))
    out = tmp_path / "run"
    cmd = ["ppfl", "run", str(config), "--out", str(out), "--no-progress"]
    code, err = interrupt(cmd, out / CHECKPOINT)
    assert code == 2 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "stops at the end of this round" in err, "the first Ctrl-C says what it does"
    ckpt = load_checkpoint(out)
    assert ckpt is not None and "e2e_progress" in ckpt.meta and "e2e_weights" in ckpt.arrays
    assert [line["round"] for line in ckpt.meta["e2e_progress"]["history"]] == list(range(1, ckpt.round + 1))
    last = err.strip().splitlines()[-1]
    assert f"E2E FedAvg baseline after round {ckpt.round}, whose checkpoint is in {out}" in last, last
    assert f"again from round {ckpt.round + 1}" in last, last
    assert last.endswith("continue with: " + shlex.join(["fedveil", *cmd, "--resume"])), last
