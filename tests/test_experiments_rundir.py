"""A run directory holds one run: a new run refuses a used directory unless told to continue it
(``--resume``) or clear it (``--overwrite``); a checkpoint continues only the run it came from; a crash
at any point of a round (real processes, SIGKILL) loses no round line and no scheduled evaluation, and the
resumed run ends at the uninterrupted run's model; Ctrl-C stops at the end of a round and says how to go
on; a full or read-only disk ends a run with one line."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedveil import cli
from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import (
    CHECKPOINT,
    CRASH_ENV,
    Checkpoint,
    load_checkpoint,
    prepare_run_dir,
    save_checkpoint,
)
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml import runner
from fedveil.experiments.fdml.runner import run_experiment
from test_cli_aiot_run import tiny_aiot

CONFIG = Path(__file__).parents[1] / "configs" / "table1_fdml.yaml"
# plain FDML (no emulated TEE), 6 + 6 synthetic users: a round takes about 0.1 s
TINY = [
    "rounds=4",
    "eval.every=2",
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "enclave.boundary=none",
    "runtime.threads=1",
]


def _sets(items: list[str]) -> list[str]:
    return [word for item in items for word in ("--set", item)]


def _lines(out: Path) -> tuple[list[int], list[int]]:
    """The round numbers of ``metrics.jsonl``'s round lines and of its evaluation lines, in order."""
    objs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [o["round"] for o in objs if "round" in o], [o["eval"]["round"] for o in objs if "eval" in o]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedveil.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


# --- one run per directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["run", str(CONFIG)], ["demo"]])
def test_a_second_run_into_a_used_directory_is_refused_naming_resume_and_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    out = tmp_path / "x"
    args = [*command, "--out", str(out), *_sets([*TINY, "rounds=1", "eval.every=0"])]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the refused run wrote nothing"
    assert main([*args, "--overwrite"]) == 0


def test_overwrite_clears_the_old_run_before_anything_is_written(tmp_path: Path, toy_population: Any) -> None:
    out = tmp_path / "x"
    out.mkdir()
    save_checkpoint(out, Checkpoint(30, {"weights": np.ones(3)}, {}))
    (out / "privacy_spent.jsonl").write_text("".join(f'{{"round": {r}}}\n' for r in range(1, 31)))
    (out / "old.png").write_bytes(b"old")
    cfg = load_config(None, [*TINY, "rounds=1", "eval.every=0", "dp.enabled=false"])
    with pytest.raises(ConfigError, match=r"--resume.*--overwrite"):
        run_experiment(cfg, out, progress=False, population=toy_population)
    run_experiment(cfg, out, progress=False, population=toy_population, overwrite=True)
    assert not (out / "old.png").exists() and not (out / "privacy_spent.jsonl").exists()
    assert load_checkpoint(out).round == 1


def test_overwrite_leaves_a_folder_that_holds_no_run_alone(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="does not hold a fedveil run"):
        prepare_run_dir(tmp_path, resume=False, overwrite=True)
    assert (tmp_path / "thesis.tex").read_text() == "years of work"
    with pytest.raises(ConfigError, match="give one"):
        prepare_run_dir(tmp_path, resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="is a file"):
        prepare_run_dir(tmp_path / "thesis.tex", resume=False, overwrite=False)


def test_a_checkpoint_from_another_run_is_never_resumed(tmp_path: Path, toy_population: Any) -> None:
    """The stale checkpoint of an earlier run beside this run's config (a crash before this run's first
    checkpoint, with the old code's overwrite) is refused, as is a checkpoint that names no config."""
    old, new = tmp_path / "old", tmp_path / "new"
    run_experiment(load_config(None, [*TINY, "rounds=3"]), old, progress=False, population=toy_population)
    cfg = load_config(None, [*TINY, "rounds=2", "eval.every=0"])
    run_experiment(cfg, new, progress=False, population=toy_population)
    (new / "checkpoint.npz").write_bytes((old / "checkpoint.npz").read_bytes())
    with pytest.raises(ConfigError, match="trained under another config"):
        run_experiment(cfg, new, progress=False, population=toy_population, resume=True)
    stale = load_checkpoint(old)
    del stale.meta["config_sha256"]
    save_checkpoint(new, stale)
    with pytest.raises(ConfigError, match="names no config"):
        run_experiment(cfg, new, progress=False, population=toy_population, resume=True)


# --- crashes at every point of a round -----------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The final weights of the uninterrupted run of ``TINY`` (in this process: the same numbers)."""
    out = tmp_path_factory.mktemp("whole")
    run_experiment(load_config(CONFIG, TINY), out, progress=False)
    return load_checkpoint(out).arrays["weights"]


@pytest.mark.parametrize(
    "point",
    [
        "round:3",  # before round 3's uploads
        "metrics:3",  # round 3's line is on disk, its checkpoint is not
        "eval:2",  # during round 2's evaluation, after its checkpoint
    ],
)
def test_a_run_killed_anywhere_in_a_round_resumes_to_the_uninterrupted_model(
    tmp_path: Path, uninterrupted: np.ndarray, point: str
) -> None:
    out = tmp_path / "run"
    args = ["run", str(CONFIG), "--out", str(out), "--no-progress", *_sets(TINY)]
    crashed = _cli(*args, env={CRASH_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = _cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    rounds, evals = _lines(out)
    assert rounds == [1, 2, 3, 4], "every round once, in order"
    assert evals == [2, 4], "every scheduled evaluation once, the one cut off included"
    np.testing.assert_array_equal(load_checkpoint(out).arrays["weights"], uninterrupted)
    results = json.loads((out / "results.json").read_text())
    assert results["rounds"] == 4 and results["rounds_per_second"] >= 0


def test_a_crash_in_the_last_evaluation_is_made_good_once_on_resume(
    tmp_path: Path, toy_population: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, TINY)
    real = runner.evaluate
    calls = {"n": 0}

    def crash_in_the_second(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "evaluate", crash_in_the_second)
    with pytest.raises(RuntimeError, match="power cut"):
        run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    assert load_checkpoint(tmp_path).round == 4 and _lines(tmp_path) == ([1, 2, 3, 4], [2])
    run_experiment(cfg, tmp_path, progress=False, population=toy_population, resume=True)
    assert _lines(tmp_path) == ([1, 2, 3, 4], [2, 4]), "the cut-off evaluation, once"
    run_experiment(cfg, tmp_path, progress=False, population=toy_population, resume=True)
    assert _lines(tmp_path) == ([1, 2, 3, 4], [2, 4]), "resuming a finished run adds no line"


# --- Ctrl-C -----------------------------------------------------------------------------------------


def interrupt(
    cmd: list[str], ready: Path | Callable[[str], bool], *, times: int = 1, settle: float = 0.0
) -> tuple[int, str]:
    """Start ``fedveil cmd`` as a terminal starts it (SIGINT at its default: this process may have it
    ignored), wait until ``ready`` exists (or ``ready(stderr so far)`` holds) and ``settle`` seconds
    more, press Ctrl-C ``times`` times; (exit status, stderr)."""
    err_path = Path(tempfile.mkstemp(prefix="fedveil-stderr-")[1])
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedveil.cli", *cmd],
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() if isinstance(ready, Path) else ready(err_path.read_text())):
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, f"not ready within 120 s: {err_path.read_text()}"
            time.sleep(0.05)
        time.sleep(settle)
        for _ in range(times):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_path.read_text()
    err_path.unlink()
    return proc.returncode, err


@pytest.mark.parametrize("command", [["run", str(CONFIG)], ["demo"]])
def test_ctrl_c_stops_at_the_end_of_a_round_and_prints_the_command_that_continues(
    tmp_path: Path, command: list[str]
) -> None:
    out = tmp_path / "x"
    cmd = [*command, "--out", str(out), "--no-progress", *_sets([*TINY, "rounds=100000"])]
    if command == ["demo"]:
        cmd.remove("--no-progress")
    code, err = interrupt(cmd, out / "checkpoint.npz")
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    ckpt = load_checkpoint(out)
    assert f"interrupted after round {ckpt.round}, whose checkpoint is in {out}" in last
    assert last.endswith("continue with: " + shlex.join(["fedveil", *cmd, "--resume"]))
    rounds, _ = _lines(out)
    assert rounds == list(range(1, ckpt.round + 1)), "the checkpoint holds the last round written"


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "x"
    cmd = ["run", str(CONFIG), "--out", str(out), "--no-progress", *_sets([*TINY, "rounds=100000"])]
    code, err = interrupt(cmd, out / "checkpoint.npz", times=2)
    assert code == 2 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "--resume" in err.strip().splitlines()[-1]


def test_a_ctrl_c_outside_the_runs_own_handling_still_says_how_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands where no runner turns it into a stop (before the rounds begin, or while a stop
    that the first Ctrl-C asked for is being reported, as a quick second Ctrl-C can) ends a command that
    resumes with the command that continues; any other command exits 130."""

    def ctrl_c(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", ctrl_c)
    cmd = ["run", str(CONFIG), "--out", str(tmp_path / "x"), "--no-progress"]
    assert main(cmd) == 2
    again = shlex.join(["fedveil", *cmd, "--resume"])
    assert capsys.readouterr().err == f"fedveil run: interrupted; continue with: {again}\n"
    epsilon = ["--mechanism", "gaussian", "--noise-multiplier", "1", "--steps", "1", "--delta", "1e-5"]
    assert main(["privacy", "epsilon", *epsilon]) == 130
    assert capsys.readouterr().err == "fedveil privacy: interrupted\n"


PPFL = """
name: tiny
data: synthetic-fashion-mnist:600
model: lenet
clients: 3
samples_per_client: 24
test_samples: 60
tee_mib: [64]
threads: 1
e2e: false
ppfl: {rounds_per_stage: 100000, local_epochs: 1, batch_size: 8, lr: 0.05, eval_every: 1000}
"""
AIOT_SETTINGS = {"rounds": 100000, "trials": 1, "methods": ["pretrained", "ours"]}
AIOT = tiny_aiot(**AIOT_SETTINGS)
POLIFL = """
name: tiny
task: mpu
clients: 12
hidden: 4
clients_per_round: 3
batch_size: 16
lr: 0.5
clip_norm: 1.0
groups:
  - {name: loose, policy: "get_data . runFL . check_privacy_budget(max_eps=1e9) . return", noise: 1.0}
strategies: ["single:loose"]
rounds: 100000
eval_every: 1000
threads: 1
"""
FEDUV = ["--methods", "feduv", "--code-lengths", "127", "--writers", "4", "--unseen-writers", "2"]
FEDUV += ["--train-examples", "3", "--width-divisor", "32", "--rounds", "100000", "--threads", "1"]


def _system(tmp_path: Path, system: str) -> tuple[list[str], Path | Callable[[str], bool], float]:
    """(``fedveil`` arguments, when the run is training, seconds to wait then) of a tiny run of
    ``system`` whose rounds never end by themselves."""
    out = str(tmp_path / "out")
    config = tmp_path / "c.yaml"
    if system == "ppfl":
        config.write_text(PPFL)
        metrics = tmp_path / "out" / "metrics.jsonl"
        after_a_round = lambda err: metrics.is_file() and bool(metrics.read_text())  # noqa: E731
        return ["ppfl", "run", str(config), "--out", out, "--no-progress"], after_a_round, 0.0
    if system == "aiot":
        config.write_text(AIOT)
        # ready once a round of the method in training is checkpointed (results.json appears earlier,
        # when the pre-trained model's scores are in: a Ctrl-C then can land before a round of "ours")
        return ["aiot", "run", str(config), "--out", out], tmp_path / "out" / "checkpoint.npz", 0.0
    if system == "polifl":
        config.write_text(POLIFL)
        return ["polifl", "run", str(config), "--out", out], tmp_path / "out" / "single_loose", 1.0
    return ["feduv", "run", *FEDUV, "--out", out, "--no-progress"], lambda err: "data:" in err, 2.0


@pytest.mark.parametrize("system", ["ppfl", "aiot", "feduv", "polifl"])
def test_each_system_refuses_a_used_run_directory_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], system: str
) -> None:
    cmd, _, _ = _system(tmp_path, system)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.json").write_text("{}")
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--resume" in err and "--overwrite" in err, err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["results.json"], "nothing was written"


@pytest.mark.parametrize("system", ["ppfl", "aiot", "feduv", "polifl"])
def test_ctrl_c_stops_each_system_at_the_end_of_a_round_with_the_command_that_continues(
    tmp_path: Path, system: str
) -> None:
    cmd, ready, settle = _system(tmp_path, system)
    code, err = interrupt(cmd, ready, settle=settle)
    assert code == 2 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last, last
    if system in ("aiot", "feduv"):  # the method in training goes on from its last round's checkpoint
        assert "continues after round" in last and "checkpoint" in last, last
    else:
        assert "again from" in last or "checkpoint" in last, "it says what is kept and where it goes on"
    assert last.endswith("continue with: " + shlex.join(["fedveil", *cmd, "--resume"])), last
    assert "stops at the end of this round" in err, "the first Ctrl-C says what it does"


@pytest.mark.parametrize("system, point", [("feduv", "round:3"), ("aiot", "metrics:2")])
def test_feduv_and_aiot_runs_killed_mid_method_resume_to_the_uninterrupted_results(
    tmp_path: Path, system: str, point: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(tiny_aiot(**{**AIOT_SETTINGS, "rounds": 3}))
    feduv = ["feduv", "run", *FEDUV, "--methods", "softmax,feduv", "--rounds", "4", "--no-progress"]
    cmd = ["aiot", "run", str(config)] if system == "aiot" else feduv
    assert main([*cmd, "--out", str(tmp_path / "whole")]) == 0
    args = [*cmd, "--out", str(tmp_path / "cut")]
    crashed = _cli(*args, env={CRASH_ENV: point})  # SIGKILLed in the first method in training
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = _cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole, cut = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "cut"))
    if system == "aiot":
        assert cut["results"] == whole["results"] and not (tmp_path / "cut" / CHECKPOINT).exists()
        return
    for row in [*whole["methods"].values(), *cut["methods"].values()]:
        del row["real_seconds"]
    assert cut["methods"] == whole["methods"]
    metrics = [(tmp_path / d / "metrics.jsonl").read_text() for d in ("whole", "cut")]
    assert metrics[1] == metrics[0], "every round line once, as the uninterrupted run wrote them"
    assert not list((tmp_path / "cut" / "methods").glob("*checkpoint*")), "finished methods keep none"


# --- a full or read-only disk ---------------------------------------------------------------------------


def test_a_full_disk_ends_a_run_with_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "x"
    assert main(["run", str(CONFIG), "--out", str(out), "--no-progress", *_sets(TINY)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedveil run: error: cannot write"), err
    assert str(out / "config.yaml") in err and "No space left on device" in err
    assert "free some space there" in err and "--resume" in err


def test_a_run_directory_below_a_file_ends_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    assert main(["run", str(CONFIG), "--out", str(out), "--no-progress", *_sets(TINY)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "is a file, not a directory" in err, err


# --- keys without effect in each system's config --------------------------------------------------------


@pytest.mark.parametrize(
    ("system", "extra", "named"),
    [
        (
            "ppfl",
            "reach_e2e_rounds: 3\n",
            "e2e=False has no effect: reach_e2e_rounds trains E2E FedAvg first",
        ),
        ("aiot", "solo_devices: 4\n", "solo_devices=4 has no effect: only the solo method uses it"),
        (
            "polifl",
            "program: 'def main(model, groups, rounds):\\n  return model'\n",
            "only the 'program' strategy",
        ),
    ],
)
def test_each_system_refuses_a_key_its_settings_ignore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], system: str, extra: str, named: str
) -> None:
    cmd, _, _ = _system(tmp_path, system)
    config = tmp_path / "c.yaml"
    config.write_text(config.read_text() + extra)
    assert main([*cmd, *(["--no-e2e"] if system == "ppfl" else [])]) == 2
    err = capsys.readouterr().err
    assert named in err and "remove it" in err, err
    assert not (tmp_path / "out").exists(), "refused before anything was written"


def test_feduv_refuses_code_lengths_without_feduv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["feduv", "run", "--methods", "softmax", "--code-lengths", "127", "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert "code_lengths=(127,) has no effect: only FedUV has a code length" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text("methods: [fedaws]\ncode_lengths: [255]\n")
    assert main(["feduv", "run", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    assert "code_lengths=[255] has no effect" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_ctrl_c_while_the_process_exits_prints_no_traceback() -> None:
    """The second Ctrl-C of a stopped run can land after the command returned, while the interpreter
    runs its exit handlers (torch's finalisers): the console script ignores it there, where it used to
    print a ``KeyboardInterrupt`` traceback under the line that says how to continue."""
    script = (
        "import atexit, sys, time\n"
        "from fedveil import cli\n"
        "atexit.register(time.sleep, 2)\n"  # an exit handler that takes a while, as torch's can
        "atexit.register(lambda: print('exiting', flush=True))\n"
        "cli.main = lambda: 2\n"
        "cli.entry()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "exiting\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2 and "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_run_directorys_config_yaml_runs_again_to_the_same_model(tmp_path: Path) -> None:
    """``config.yaml`` states every setting of the run, those its setting ignores at their defaults too:
    ``fedveil run DIR/config.yaml`` accepts it as it is and trains the same model."""
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["run", str(CONFIG), "--out", str(first), "--no-progress", *_sets(TINY)]) == 0
    assert main(["run", str(first / "config.yaml"), "--out", str(again), "--no-progress"]) == 0
    assert (again / "config.yaml").read_text() == (first / "config.yaml").read_text()
    np.testing.assert_array_equal(
        load_checkpoint(again).arrays["weights"], load_checkpoint(first).arrays["weights"]
    )
