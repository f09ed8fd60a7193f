"""The one ``device`` setting (:mod:`fedveil.models.device`): its resolver, its place in every config and
run command, and the promise that on the CPU (``device: cpu``, and ``auto`` on a machine without CUDA)
every number is exactly what fedveil computed before the setting existed."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedveil
from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import add_run_arguments, run_sets
from fedveil.experiments.config import load_config
from fedveil.models.device import check_device_spec, resolve_device

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()


def test_auto_is_cuda_where_torch_sees_a_gpu_and_the_cpu_elsewhere() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_machine_without_it_is_a_clear_error(spec: str) -> None:
    with pytest.raises(ConfigError, match=rf"device: '{spec}' asks for CUDA.*sees no CUDA device.*cpu"):
        resolve_device(spec)


def test_a_gpu_index_past_the_machines_gpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        ConfigError, match=r"'cuda:2' names GPU 2, but this machine has 2 \(cuda:0 to cuda:1\)"
    ):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("spec", ["gpu", "CPU", "cuda:", "cuda:-1", "cuda:01", "cuda:x", " cpu", "", "mps"])
def test_misspelt_devices_are_refused_naming_the_value(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"device: .* is not one of auto, cpu, cuda or cuda:N"):
        check_device_spec(spec)
    with pytest.raises(ConfigError, match="is not one of auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_a_config_refuses_a_misspelt_device_before_training() -> None:
    with pytest.raises(ConfigError, match="device: 'gpu' is not one of"):
        load_config(REPO / "configs/table1_fdml.yaml", ["device=gpu"])
    assert load_config(REPO / "configs/table1_fdml.yaml").device == "auto"
    assert load_config(REPO / "configs/table1_fdml.yaml", ["device=cuda:1"]).device == "cuda:1"


def test_every_run_command_has_device_and_it_wins_over_set() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--set", "device=cuda", "--device", "cpu", "--seed", "3"])
    assert run_sets(args) == ["device=cuda", "seed=3", "device=cpu"]
    assert run_sets(parser.parse_args([])) == []


# A tiny Table I setting: the FDML configuration of the paper's table, shrunk to a few seconds.
TINY = [
    "rounds=3",
    "eval.every=0",
    "data.train_users_per_model=[24,24,24,24]",
    "data.test_users_per_model=[6,6,6,6]",
]
COHORT = {
    "configs/table1_fdml.yaml": "fdml.num_required=16",
    "configs/table1_fl_lr0.1.yaml": "fedavg.clients_per_round=16",
}


def _fdml_run(tmp: Path, name: str, config: str, *extra: str) -> tuple[dict, dict[str, np.ndarray], list]:
    out = tmp / name
    sets = [a for item in [*TINY, COHORT[config]] for a in ("--set", item)]
    assert main(["run", str(REPO / config), *sets, "--out", str(out), "--no-progress", *extra]) == 0
    results = json.loads((out / "results.json").read_text())
    for key in ("code", "real_seconds", "rounds_per_second"):
        results.pop(key)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for line in metrics:
        line.pop("real_seconds", None)
    with np.load(out / "checkpoint.npz") as ckpt:
        arrays = {k: ckpt[k] for k in ckpt.files if k != "meta"}
    return results, arrays, metrics


@pytest.mark.skipif(not NO_CUDA, reason="auto is the CPU only on a machine without CUDA")
@pytest.mark.parametrize("config", sorted(COHORT))
def test_fdml_and_fl_traditional_give_the_same_bits_with_and_without_device_cpu(
    tmp_path: Path, config: str
) -> None:
    plain = _fdml_run(tmp_path, "plain", config)
    on_cpu = _fdml_run(tmp_path, "cpu", config, "--device", "cpu")
    assert plain[0] == on_cpu[0]
    assert plain[1].keys() == on_cpu[1].keys() and "weights" in plain[1]
    for key, value in plain[1].items():
        assert np.array_equal(value, on_cpu[1][key]), key
    assert plain[2] == on_cpu[2]


def _separable(clients: int = 6, per_client: int = 12) -> fedveil.FederatedDataset:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=clients * per_client)
    x = (rng.normal(size=(len(y), 8)) + 2.0 * y[:, None]).astype(np.float32)
    return fedveil.FederatedDataset(
        fedveil.UserData(f"client{i}", {}, {"x": x[i::clients], "y": y[i::clients]}) for i in range(clients)
    )


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.skipif(not NO_CUDA, reason="auto is the CPU only on a machine without CUDA")
@pytest.mark.parametrize("dp", [{}, {"clip_norm": 1.0, "noise_multiplier": 0.5, "delta": 1e-5}])
def test_fedavg_gives_the_same_bits_with_and_without_device_cpu(dp: dict) -> None:
    data = _separable()
    kwargs = dict(rounds=3, clients_per_round=3, lr=0.1, batch_size=4, local_epochs=2, seed=5, **dp)
    results = [
        fedveil.train_fedavg(_mlp(), data, **kwargs),  # type: ignore[arg-type]
        fedveil.train_fedavg(_mlp(), data, device="cpu", **kwargs),  # type: ignore[arg-type]
        fedveil.train_fedavg(_mlp(), data, device="auto", **kwargs),  # type: ignore[arg-type]
    ]
    first = results[0]
    for other in results[1:]:
        assert other.history == first.history
        for key, value in first.state_dict.items():
            assert torch.equal(value, other.state_dict[key]), key


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
def test_asking_a_cpu_machine_for_cuda_fails_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        fedveil.train_fedavg(
            _mlp(), _separable(), rounds=1, clients_per_round=2, lr=0.1, batch_size=4, device="cuda"
        )


def test_gpu_check_dry_run_says_the_cuda_half_and_runs_the_cpu_half(tmp_path: Path) -> None:
    """``scripts/gpu-check --dry-run``: what the GPU machine runs, checked here so that it cannot rot."""
    out = tmp_path / "out"
    done = subprocess.run(
        [str(REPO / "scripts/gpu-check"), "--dry-run"],
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for step in ("bench-fedavg", "bench-mobilefacenet", "bench-rounds"):
        assert (
            f"would run {step} on cuda:" in done.stderr
            and f"--device cuda > {out}/{step}-cuda.json" in done.stderr
        )
        assert json.loads((out / f"{step}-cpu.json").read_text())["device"] == "cpu"
        assert not (out / f"{step}-cuda.json").exists()
    aiot = json.loads((out / "aiot-step-cpu.json").read_text())
    assert aiot["run"]["device"] == "cpu" and "ours/0" in aiot["results"]
    assert "skipped" in (out / "pytest-gpu.txt").read_text() and (out / "pytest-gpu.xml").is_file()
    assert "finished in" in done.stderr and "0 failed step(s)" in done.stderr


@pytest.mark.parametrize(
    ("loader", "config"),
    [
        ("fedveil.experiments.aiot.runner:load_aiot_run", "configs/aiot/quick.yaml"),
        ("fedveil.experiments.ppfl.runner:load_ppfl_run", "configs/ppfl/quick.yaml"),
        ("fedveil.experiments.polifl.runner:load_polifl_run", "configs/polifl/small.yaml"),
    ],
)
def test_every_systems_config_has_the_device_setting(loader: str, config: str) -> None:
    module, name = loader.split(":")
    load = getattr(importlib.import_module(module), name)
    assert load(REPO / config).device == "auto"
    assert load(REPO / config, {"device": "cuda:0"}).device == "cuda:0"
    with pytest.raises(ConfigError, match="device: 'gpu' is not one of"):
        load(REPO / config, {"device": "gpu"})


def test_feduv_config_has_the_device_setting() -> None:
    from fedveil.experiments.feduv.runner import load_feduv_config

    quick = REPO / "configs/feduv/quick.yaml"
    assert load_feduv_config(quick).device == "auto"
    assert load_feduv_config(quick, overrides={"device": "cpu"}).device == "cpu"
    with pytest.raises(ConfigError, match="device: 'cuda:x' is not one of"):
        load_feduv_config(quick, overrides={"device": "cuda:x"})


class _Started(Exception):
    """Raised by a runner stand-in: the command got as far as training, with ``cfg``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__("training started")
        self.cfg = cfg


#: Each system's run command (its words) and the runner it calls (module under experiments, function).
RUNS = {
    "run": (["run", str(REPO / "configs/table1_fdml.yaml")], "fdml.runner", "run_experiment"),
    "demo": (["demo"], "fdml.runner", "run_experiment"),
    "feduv": (["feduv", "run"], "feduv.runner", "run_feduv"),
    "aiot": (["aiot", "run", str(REPO / "configs/aiot/quick.yaml")], "aiot.runner", "run_aiot"),
    "ppfl": (["ppfl", "run", str(REPO / "configs/ppfl/quick.yaml")], "ppfl.runner", "run_ppfl"),
    "polifl": (["polifl", "run", str(REPO / "configs/polifl/small.yaml")], "polifl.runner", "run_polifl"),
}


@pytest.mark.parametrize("system", sorted(RUNS))
def test_device_reaches_every_systems_config(
    system: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    words, module, function = RUNS[system]

    def started(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Started(cfg)

    monkeypatch.setattr(importlib.import_module(f"fedveil.experiments.{module}"), function, started)
    with pytest.raises(_Started) as run:
        main([*words, "--set", "device=cuda", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert run.value.cfg.device == "cpu", "--device wins over --set device=..."
    assert main([*words, "--device", "gpu", "--out", str(tmp_path / "bad")]) == 2
    assert "device: 'gpu' is not one of auto, cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("system", sorted(RUNS))
def test_cuda_on_a_cpu_machine_fails_before_the_run_directory_is_touched(
    system: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words, _, _ = RUNS[system]
    out = tmp_path / "run"
    assert main([*words, "--device", "cuda", "--out", str(out), "--no-progress"]) == 2
    assert "device: 'cuda' asks for CUDA, but torch" in capsys.readouterr().err
    assert not out.exists()
