"""``fedveil bench peers``: the task folder holds fedveil's partition and weights, fedveil's row has every
field, the peer scripts run on a tiny task, and bad settings are refused naming the value; the floor's
parts (:mod:`fedveil.experiments.bench.floor`): the FLOPs counted from the layers against torch's own
counter, and the CPU seconds of a child process."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.bench.floor import training_flops, tree_cpu_seconds
from fedveil.experiments.bench.peers import bench_peers, run_environment, write_task
from fedveil.experiments.bench.scale import scale_users
from fedveil.models.weights import load_weights
from fedveil.models.zoo import build_model

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
ROW_FIELDS = {
    "framework",
    "version",
    "engine",
    "clients_per_round",
    "rounds",
    "seconds_per_round",
    "cpu_seconds_per_round",
    "first_round_seconds",
    "startup_seconds",
    "peak_rss_bytes",
    "rss_covers",
    "accuracy",
}


pytestmark = pytest.mark.usefixtures("small_fashion_mnist")  # the task's images: 1,200 + 200, not 70,000


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory, small_fashion_mnist_root: Path) -> Path:
    """10 clients of 20 images, 2 timed rounds (the peers' tiny task), from the small Fashion-MNIST."""
    folder = tmp_path_factory.mktemp("peers") / "task"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDVEIL_DATA_DIR", str(small_fashion_mnist_root))
        write_task(folder, clients=10, samples=20, rounds=2, cohorts=[3], seed=0)
    return folder


def _check_row(row: dict, framework: str, cohort: int, rounds: int) -> None:
    assert not ROW_FIELDS - set(row), f"missing {ROW_FIELDS - set(row)}"
    assert (row["framework"], row["clients_per_round"], row["rounds"]) == (framework, cohort, rounds)
    assert row["seconds_per_round"] > 0 and row["startup_seconds"] >= 0 and row["first_round_seconds"] > 0
    assert row["cpu_seconds_per_round"] > 0
    assert row["peak_rss_bytes"] > 10 * 2**20
    assert math.isfinite(row["accuracy"]) and 0 <= row["accuracy"] <= 1


def test_task_folder_holds_scale_partition_test_set_and_initial_weights(task: Path) -> None:
    manifest = json.loads((task / "manifest.json").read_text())
    assert (manifest["clients"], manifest["samples_per_client"], manifest["rounds"]) == (10, 20, 2)
    assert (manifest["lr"], manifest["batch_size"], manifest["local_epochs"]) == (0.05, 10, 1)
    assert manifest["cohorts"] == [3] and manifest["seed"] == 0 and "fashion-mnist" in manifest["data"]
    assert manifest["training_flops_per_example"] == 76_696_000 // 2  # LeNet at batch 2, counted below
    users = scale_users(10, 20, seed=0)
    with np.load(task / "train.npz", allow_pickle=False) as train:
        for i, user in enumerate(users):
            np.testing.assert_array_equal(train["x"][i * 20 : (i + 1) * 20], user.arrays["x"])
            np.testing.assert_array_equal(train["y"][i * 20 : (i + 1) * 20], user.arrays["y"])
    with np.load(task / "test.npz", allow_pickle=False) as test:
        assert test["x"].shape == (manifest["test_size"], 1, 28, 28) and test["y"].dtype == np.int64
    model = build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=0)
    loaded = load_weights(model, task / "initial.safetensors")
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got), name


def test_peer_lenet_is_fedveils_lenet(task: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PEERS))
    from peer_task import Task

    peer = Task(task).initial_model()
    model = build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=0)
    assert sorted(peer.state_dict()) == sorted(load_file(str(task / "initial.safetensors")))
    assert list(peer.state_dict()) == list(model.state_dict())
    x = torch.rand(4, 1, 28, 28)
    torch.testing.assert_close(peer(x), model(x))


def test_fedveil_row_has_every_field(tmp_path: Path) -> None:
    result = bench_peers(
        frameworks=["fedveil"], cohorts=[5], rounds=2, clients=20, samples=5, threads=1, out=tmp_path
    )
    assert result["task"]["clients"] == 20 and (tmp_path / "results.json").is_file()
    (row,) = result["rows"]
    _check_row(row, "fedveil", 5, 2)
    assert row["rss_covers"] == "the whole run"
    assert row["flops_per_round"] == 5 * 5 * result["task"]["training_flops_per_example"]
    assert 1e9 < row["peak_gemm_flops_per_second"] < 1e13
    assert 0 < row["fraction_of_floor"] <= 1.5
    assert row["fraction_of_floor"] == pytest.approx(
        row["flops_per_round"] / row["peak_gemm_flops_per_second"] / row["cpu_seconds_per_round"]
    )


def test_every_process_of_a_run_gets_passive_openmp_threads_unless_the_caller_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert run_environment()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert run_environment()["OMP_WAIT_POLICY"] == "ACTIVE"


def _flop_counter(model: nn.Module, x: torch.Tensor) -> int:
    """torch's own count of one training step: forward, cross-entropy, backward."""
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(x), torch.zeros(len(x), dtype=torch.int64)).backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize(
    "model",
    [
        build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=0),
        nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 64),
            nn.ReLU(),
            nn.Linear(64, 32, bias=False),
            nn.Tanh(),
            nn.Linear(32, 10),
        ),
    ],
    ids=["lenet", "mlp"],
)
def test_training_flops_match_torchs_flop_counter(model: nn.Module) -> None:
    x = torch.rand(2, 1, 28, 28)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert training_flops(model, x) == _flop_counter(model, x) > 0
    assert training_flops(model, x[:1]) * 2 == training_flops(model, x)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_training_flops_refuse_a_layer_they_cannot_count() -> None:
    with pytest.raises(ValueError, match=r"\['rnn'\] are neither"):
        training_flops(nn.ModuleDict({"rnn": nn.LSTM(4, 4)}), torch.zeros(1, 2, 4))


def test_tree_cpu_seconds_count_a_child_while_it_runs_and_once_it_is_reaped() -> None:
    burn = (
        "import sys, time\n"
        "start = time.process_time()\n"
        "while time.process_time() - start < 0.5: pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    before = tree_cpu_seconds()
    child = subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    used = float(child.stdout.readline())  # the child's own CPU seconds; it now waits, alive
    live = tree_cpu_seconds() - before
    child.communicate("")
    reaped = tree_cpu_seconds() - before
    assert used >= 0.5
    assert used - 0.02 <= live < used + 0.3  # read from /proc in 10 ms ticks
    assert used <= reaped < used + 0.3  # counted once: by the kernel's rusage of reaped children


@pytest.mark.skipif(
    importlib.util.find_spec("flwr") is None,
    reason="Flower is the fedveil[flower] extra (installed by scripts/bootstrap)",
)
def test_flower_script_runs_on_a_tiny_task(task: Path) -> None:
    command = [sys.executable, str(PEERS / "flower_fedavg.py"), "--task", str(task), "--cohort", "3"]
    done = subprocess.run([*command, "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.splitlines()[-1])
    _check_row(row, "flower", 3, 2)
    assert row["version"] == "1.42.0" and row["rss_covers"].startswith("this process only")


@pytest.mark.skipif(
    importlib.util.find_spec("pfl") is None,
    reason="pfl is not installed in this interpreter: pfl 0.6.0 needs dp-accounting<0.6 (and so "
    "absl-py 1.x), older than the project's; it runs in .venv-peers/pfl",
)
def test_pfl_script_runs_on_a_tiny_task(task: Path) -> None:
    command = [sys.executable, str(PEERS / "pfl_fedavg.py"), "--task", str(task), "--cohort", "3"]
    done = subprocess.run([*command, "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_row(json.loads(done.stdout.splitlines()[-1]), "pfl", 3, 2)


def test_peer_script_refuses_a_cohort_larger_than_the_task(task: Path) -> None:
    command = [sys.executable, str(PEERS / "flower_fedavg.py"), "--task", str(task), "--cohort", "11"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--cohort 11 must lie between 1 and the task's 10 clients" in done.stderr


def test_unknown_framework_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "peers", "--frameworks", "fedveil,tff"]) == 2
    assert (
        "frameworks ['fedveil', 'tff']: each must be one of fedveil, ray, flower, pfl"
        in capsys.readouterr().err
    )


def test_cohort_larger_than_the_clients_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "peers", "--clients", "50", "--cohorts", "10,100"]) == 2
    assert "cohort 100 must lie between 1 and the 50 clients" in capsys.readouterr().err


def test_missing_venv_names_the_setup_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"create it with `fedveil bench peers --setup --frameworks pfl`"):
        bench_peers(frameworks=["fedveil", "pfl"], venvs=tmp_path / "venvs", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
