"""The one ``device`` setting (:mod:`fedveil.models.device`): its resolver, its place in every config and
run command, and the promise that on the CPU (``device: cpu``, and ``auto`` on a machine without CUDA)
every number is exactly what fedveil computed before the setting existed."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedveil
from fedveil.cli import build_parser, main
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import add_run_arguments, run_sets
from fedveil.experiments.config import load_config
from fedveil.models.device import check_device_spec, module_device, resolve_device

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
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)  # the current GPU, by its index


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
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(
        [str(REPO / "scripts/gpu-check"), "--dry-run"],
        env={**os.environ, "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # a machine may send back only a few files: $OUT holds five, each step's files stay in WORK
    files = {"gpu-check.log", "pytest-gpu.txt", "pytest-gpu.xml", "results.jsonl", "gpu-table.md"}
    assert {f.name for f in out.iterdir()} == files
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    results = {(line["step"], line["device"]): line for line in lines}
    ran = ("bench-fedavg", "bench-mobilefacenet", "bench-rounds", "aiot-step")
    assert sorted(results) == sorted((step, "cpu") for step in ran), "the cuda half is said, not run"
    for step in ran:
        assert f"would run {step} on cuda:" in done.stderr
        line = results[(step, "cpu")]
        assert line["ok"] and line["seconds"] >= 0
        assert line["result"] == json.loads((work / f"{step}-cpu.json").read_text())
        device = line["result"]["run"]["device"] if step == "aiot-step" else line["result"]["device"]
        assert device == "cpu"
    assert "ours/0" in results[("aiot-step", "cpu")]["result"]["results"]
    assert "skipped" in (out / "pytest-gpu.txt").read_text() and (out / "pytest-gpu.xml").is_file()
    assert "finished in" in done.stderr and "0 failed step(s)" in done.stderr
    # the table for docs/benchmarks.md: the cpu figures read off the files, the cuda half not run
    table = (out / "gpu-table.md").read_text()
    updates = results[("bench-fedavg", "cpu")]["result"]["batched_updates_per_second"]
    assert f"| FedAvg client updates/s, batched (vmap) | not run | {updates:.4g} | n/a |" in table
    assert "- bench-rounds on cpu: `" in table and "GPU: unknown" in table
    # the steps said, not run (each builds the 60,000-image stand-in): their commands parse, on each device
    said = re.findall(r"would run (\S+) on (cuda|cpu): (.*?)(?: > \S+)?$", done.stderr, re.MULTILINE)
    steps = {(step, device) for step, device, _ in said}
    for step in ("ppfl-step", "bench-scale", "bench-peers"):
        assert {(step, "cuda"), (step, "cpu")} <= steps and not (work / f"{step}-cpu.json").exists()
    for step, device, command in said:
        words = shlex.split(command)
        assert words[1:3] == ["-m", "fedveil"], command
        args = build_parser().parse_args(words[3:])
        assert args.device == device, step
        if step == "bench-scale":
            assert args.actors == [], "Ray's actors get CPUs only: bench scale's GPU half is in-process"


def test_gpu_check_dry_run_with_a_python_lacking_fedveil_says_so_once_and_stops(tmp_path: Path) -> None:
    """A dry run installs nothing: with a Python that cannot import fedveil (here a bare one, without pip
    either) it says what it cannot check and stops with one message saying what to do, instead of
    failing every step."""
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")
    out = tmp_path / "out"
    done = subprocess.run(
        [str(REPO / "scripts/gpu-check"), "--dry-run"],
        env={
            **os.environ,
            "OUT": str(out),
            "WORK": str(tmp_path / "work"),
            "PYTHON": str(tmp_path / "bare/bin/python3"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("cannot import fedveil") == 1 and "set PYTHON" in done.stderr, done.stderr
    assert "cannot tell what" in done.stderr and "lacks: none" not in done.stderr, "no pip: nothing is known"
    assert "would run bench" not in done.stderr and not (out / "results.jsonl").read_text()


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


# --- the device reaches AIoT's pre-training and evaluation, PPFL's client TEEs, bench scale and peers ---

ASKED = "cuda:1"
"""What the runs below ask for; only the spied resolver (:func:`_spy_device`) answers it."""
SENTINEL = torch.device("cpu", 0)
"""The spied resolver's answer to :data:`ASKED`: the CPU, so the run computes here, but told apart from
``torch.device("cpu")`` by its index, so a ``.to`` call that receives it moves to the device asked for."""


def _spy_device(monkeypatch: pytest.MonkeyPatch, *modules: str) -> list[tuple[Any, str]]:
    """Make ``resolve_device`` in each of ``modules`` answer :data:`ASKED` (and :data:`SENTINEL`) with
    :data:`SENTINEL`, resolving anything else as before, and return the list of what is moved there and
    by which function: ``(shape, caller)`` per tensor and ``(class name, caller)`` per module. Their
    ``module_device`` says :data:`SENTINEL` of a module last moved there (a tensor moved there reports
    the plain CPU)."""

    def spied(spec: str | torch.device = "auto") -> torch.device:
        if spec == ASKED or (isinstance(spec, torch.device) and spec == SENTINEL):
            return SENTINEL
        return resolve_device(spec)

    there: set[int] = set()

    def where(module: torch.nn.Module) -> torch.device:
        return SENTINEL if id(module) in there else module_device(module)

    for name in modules:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "resolve_device", spied)
        if hasattr(module, "module_device"):
            monkeypatch.setattr(module, "module_device", where)
    moved: list[tuple[Any, str]] = []

    def to_sentinel(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return any(isinstance(a, torch.device) and a == SENTINEL for a in (*args, *kwargs.values()))

    tensor_to, module_to = torch.Tensor.to, torch.nn.Module.to

    def tensor_spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if to_sentinel(args, kwargs):
            moved.append((tuple(self.shape), sys._getframe(1).f_code.co_name))
        return tensor_to(self, *args, **kwargs)

    def module_spy(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if to_sentinel(args, kwargs):
            moved.append((type(self).__name__, sys._getframe(1).f_code.co_name))
            there.add(id(self))
        else:
            there.discard(id(self))
        return module_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", tensor_spy)
    monkeypatch.setattr(torch.nn.Module, "to", module_spy)
    return moved


AIOT_MODULES = (
    "fedveil.experiments.aiot.runner",
    "fedveil.experiments.aiot.faces_domain",
    "fedveil.protocols.projector",
)


def _tiny_aiot(device: str) -> Any:
    from fedveil.experiments.aiot.runner import AiotRun

    return AiotRun(
        size=32,
        width=0.25,
        public_identities=20,
        pretrain_epochs=1,
        private_identities=12,
        test_identities=6,
        wild=2,
        identities_per_device=3,
        rounds=1,
        clients_per_round=2,
        batch_size=4,
        trials=1,
        methods=("pretrained", "ours"),
        threads=1,
        device=device,
    )


def test_aiot_pre_trains_fine_tunes_and_evaluates_on_the_resolved_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.experiments.aiot.runner import run_aiot

    moved = _spy_device(monkeypatch, *AIOT_MODULES)
    record = run_aiot(_tiny_aiot(ASKED), tmp_path / "run", progress=False)
    assert record["run"]["device"] == ASKED and set(record["results"]) == {"pretrained/0", "ours/0"}
    public, test = (20 * 3, 3, 32, 32), (6 * 3, 3, 32, 32)  # identities x (reference + 2 wild photos)
    assert {(public, "train_faces"), ("MobileFaceNet", "train_faces"), ("ArcFace", "train_faces")} <= set(
        moved
    ), "the pre-training: the public photos, the network and its ArcFace head"
    # each method's evaluation embeds the test photos on the device twice (TAR@FAR, then Eq. 5)
    assert moved.count((test, "embed_faces")) == 4
    assert ((9, 3, 32, 32), "_tensors") in moved, "a device's photos (3 identities) for its fine-tuning"


def test_aiot_faces_measures_on_the_resolved_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedveil.experiments.aiot.faces_domain import FaceDomainRun, measure_domain_gap

    moved = _spy_device(monkeypatch, *AIOT_MODULES)
    run = FaceDomainRun(
        size=32,
        width=0.25,
        public_identities=8,
        private_train_identities=6,
        test_identities=4,
        wild=2,
        epochs=1,
        finetune_epochs=1,
        batch_size=8,
        threads=1,
        device=ASKED,
    )
    result = measure_domain_gap(run, progress=False)
    assert result["run"]["device"] == ASKED
    assert ((8 * 3, 3, 32, 32), "train_faces") in moved, "the public photos, for the pre-training"
    assert ((6 * 3, 3, 32, 32), "train_faces") in moved, "the private ones, for the fine-tuning"
    assert moved.count(((4 * 3, 3, 32, 32), "embed_faces")) == 3, "public test, private test twice"
    with pytest.raises(ConfigError, match="device: 'gpu' is not one of"):
        FaceDomainRun(device="gpu")


@pytest.mark.skipif(not NO_CUDA, reason="auto is the CPU only on a machine without CUDA")
def test_aiot_gives_the_same_bits_with_and_without_device_cpu(tmp_path: Path) -> None:
    from fedveil.experiments.aiot.runner import run_aiot

    runs = {d: run_aiot(_tiny_aiot(d), tmp_path / d, progress=False) for d in ("auto", "cpu")}
    assert runs["auto"]["results"] == runs["cpu"]["results"]
    pretrained = [(tmp_path / d / "pretrained.safetensors").read_bytes() for d in ("auto", "cpu")]
    assert pretrained[0] == pretrained[1]


def _tiny_ppfl(device: str, *, batched: bool) -> Any:
    """PPFL over 4 devices of 12 examples (8 x 8 images, 4 classes) and an evaluation device, LeNet's
    three stages of 2 rounds each, the REEs and TEEs on ``device``: the server and the devices."""
    from fedveil.experiments.fdml.runner import device_sessions
    from fedveil.models.zoo import build_model
    from fedveil.protocols.ppfl import PpflClients, PpflConfig, PpflServer
    from fedveil.runtime.enclave_host import EnclaveHost
    from fedveil.runtime.quoting import SimulatedPlatform
    from fedveil.runtime.simulation import SimulationRuntime

    rng = np.random.default_rng(0)
    prototypes = rng.normal(0, 1, (4, 1, 8, 8)).astype(np.float32)
    users = []
    for name, n in (("c0", 12), ("c1", 12), ("c2", 12), ("c3", 12), ("eval", 16)):
        y = rng.integers(0, 4, n)
        x = (prototypes[y] + 0.5 * rng.normal(0, 1, (n, 1, 8, 8))).astype(np.float32)
        users.append(fedveil.UserData(name, {}, {"x": x, "y": y}))
    data = fedveil.FederatedDataset(users)
    cfg = PpflConfig(rounds_per_stage=2, clients_per_round=2, local_epochs=2, batch_size=4, lr=0.05)
    model = build_model("lenet", num_classes=4, in_channels=1, image_size=8, seed=0)
    platform = SimulatedPlatform.generate()
    with EnclaveHost.start(platform=platform) as host:
        pool = PpflClients(
            model,
            data,
            optimizer=cfg.optimizer(),
            seed=0,
            sessions=device_sessions(data.user_ids, platform.public_key, host.measurement),
            tee_bytes=dict.fromkeys(data.user_ids, 64 * 2**20),
            evaluators=["eval"],
            batched=batched,
            device=device,
        )
        runtime = SimulationRuntime(pool, rng=np.random.default_rng(1))
        server = PpflServer(model, cfg, host, np.random.default_rng(2))

        async def go() -> None:
            await server.setup(runtime)
            await server.train(runtime)

        asyncio.run(go())
    return server, pool


@pytest.mark.parametrize("batched", [True, False])
def test_ppfl_client_tees_train_and_evaluate_on_the_resolved_device(
    batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.models.flat import FlatModel

    moved = _spy_device(monkeypatch, "fedveil.protocols.ppfl")
    _, pool = _tiny_ppfl(ASKED, batched=batched)
    assert all(tee.device == SENTINEL for tee in pool.tees.values())
    for stage in range(len(pool.stages)):
        size = FlatModel(pool.net(stage)).num_params
        # theta_l as each TEE opened it, or as the cohort's two TEEs opened it together
        trained = ((2, size), "_fit_cohort") if batched else ((size,), "train")
        assert trained in moved, f"stage {stage}'s theta_l trains on the device"
        assert ((size,), "evaluate") in moved, f"stage {stage}'s theta_l is evaluated on the device"
    assert ("StageNet", "net") in moved and ((12,), "_client_tensor") in moved, "the nets and the labels"
    assert all(
        p.device == torch.device("cpu")
        for units in pool.frozen.values()
        for u in units
        for p in u.parameters()
    ), "the released layers the REEs keep stay on the CPU"


@pytest.mark.skipif(not NO_CUDA, reason="auto is the CPU only on a machine without CUDA")
@pytest.mark.parametrize("batched", [True, False])
def test_ppfl_client_tees_give_the_same_bits_with_and_without_device_cpu(batched: bool) -> None:
    timed = ("seconds_broadcast", "seconds_aggregate", "seconds_train")
    runs = {d: _tiny_ppfl(d, batched=batched) for d in ("auto", "cpu")}
    reports = {
        d: [[{k: v for k, v in line.items() if k not in timed} for line in r.rounds] for r in server.reports]
        for d, (server, _) in runs.items()
    }
    assert reports["auto"] == reports["cpu"] and len(reports["cpu"]) == 3
    models = [pool.trained_model("c0") for _, pool in runs.values()]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("small_fashion_mnist")  # bench scale's data set: 1,200 + 200 images, not 70,000
def test_bench_scale_trains_its_clients_on_the_resolved_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedveil.experiments.bench.scale import measure_setting

    setting = dict(clients=20, per_round=4, rounds=1, samples=5, actors=0, seed=0, threads=1)
    on_cpu = measure_setting(**setting, device="cpu")  # type: ignore[arg-type]
    moved = _spy_device(monkeypatch, "fedveil.experiments.bench.scale", "fedveil.protocols.fedavg")
    row = measure_setting(**setting, device=ASKED)  # type: ignore[arg-type]
    assert row["device"] == str(SENTINEL) and on_cpu["device"] == "cpu"
    assert ("LeNet", "__init__") in moved, "the clients' network moves to the device"
    assert any(shape == (5, 1, 28, 28) for shape, _ in moved), "a client's images move to the device"
    if NO_CUDA:  # the same bits on the CPU, asked for or by default
        assert on_cpu["accuracy"] == row["accuracy"]
        assert measure_setting(**setting)["accuracy"] == row["accuracy"]  # type: ignore[arg-type]


def test_bench_scale_refuses_a_gpu_for_its_ray_actors_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.experiments.bench.peers import bench_peers
    from fedveil.experiments.bench.scale import bench_scale, check_scale_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert check_scale_device("cuda", [0]) == "cuda:0" and check_scale_device("cpu", [1, 2]) == "cpu"
    refused = r"device 'cuda' \(cuda:0\) with Ray actors \[2\]: the actors are given CPUs only.*--device cpu"
    with pytest.raises(ConfigError, match=refused):
        bench_scale(clients=[10], actors=[2], device="cuda")
    with pytest.raises(ConfigError, match=refused):
        bench_peers(frameworks=["fedveil", "ray"], threads=2, device="cuda", out=tmp_path / "peers")
    assert not (tmp_path / "peers").exists(), "refused before the task is written"


@pytest.mark.usefixtures("small_fashion_mnist")
def test_bench_peers_holds_a_gpu_row_to_the_gpus_floor_and_the_peers_to_the_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fedveil row trained on a GPU: FLOPs at the GPU's peak per second of wall time, over its seconds
    per round (its CPU seconds are the host's share, not the arithmetic); the floor's basis is named."""
    from fedveil.experiments.bench import peers, scale

    def setting_process(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        args = build_parser().parse_args(command[3:])
        row = {"clients_per_round": args.per_round, "device": args.device, "accuracy": 0.5}
        row.update(seconds_per_round=0.5, cpu_seconds_per_round=2.0)
        return subprocess.CompletedProcess(command, 0, json.dumps(row), "")

    peaks: list[str] = []

    def peak(threads: int, device: str = "cpu") -> float:
        peaks.append(device)
        return 1e10 if device == "cpu" else 1e12

    monkeypatch.setattr(scale.subprocess, "run", setting_process)
    monkeypatch.setattr(peers, "measure_peak_gemm", peak)
    monkeypatch.setattr(peers, "resolve_device", lambda spec: torch.device("cuda", 0))
    monkeypatch.setattr(scale, "resolve_device", lambda spec: torch.device("cuda", 0))
    settings = dict(frameworks=["fedveil"], cohorts=[2], rounds=1, clients=4, samples=2, threads=1)
    (row,) = peers.bench_peers(**settings, out=tmp_path / "gpu", device="cuda")["rows"]
    assert peaks == ["cpu", "cuda:0"]
    assert row["peak_gemm_flops_per_second"] == 1e12 and "cuda:0" in row["floor_basis"]
    assert row["fraction_of_floor"] == pytest.approx(row["flops_per_round"] / 1e12 / 0.5, rel=1e-12)
    (row,) = peers.bench_peers(**settings, out=tmp_path / "cpu", device="cpu")["rows"]
    assert row["peak_gemm_flops_per_second"] == 1e10 and "CPU seconds" in row["floor_basis"]
    assert row["fraction_of_floor"] == pytest.approx(row["flops_per_round"] / 1e10 / 2.0, rel=1e-12)


def test_bench_scale_and_peers_forward_the_device_to_fedveils_setting_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.experiments.bench import peers, scale

    commands: list[list[str]] = []

    def setting_process(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        args = build_parser().parse_args(command[3:])
        row = {"clients_per_round": args.per_round, "device": args.device, "accuracy": 0.5}
        row.update(seconds_per_round=1.0, cpu_seconds_per_round=1.0)
        return subprocess.CompletedProcess(command, 0, json.dumps(row), "")

    monkeypatch.setattr(scale.subprocess, "run", setting_process)
    monkeypatch.setattr(peers, "measure_peak_gemm", lambda threads, device="cpu": 1e10)
    _spy_device(monkeypatch, "fedveil.experiments.bench.scale", "fedveil.experiments.bench.peers")
    result = peers.bench_peers(
        frameworks=["fedveil"],
        cohorts=[2],
        rounds=1,
        clients=4,
        samples=2,
        threads=1,
        out=tmp_path,
        device=ASKED,
    )
    (command,) = commands
    assert command[1:5] == ["-m", "fedveil", "bench", "scale"] and command[-2:] == ["--device", ASKED]
    assert [r["device"] for r in result["rows"]] == [ASKED]
    rows = scale.bench_scale(clients=[3], actors=[], per_round=2, rounds=1, samples=2, device=ASKED)["rows"]
    assert [r["device"] for r in rows] == [ASKED] and commands[-1][-2:] == ["--device", ASKED]


def test_reproduce_sends_device_to_every_cell_and_refuses_a_missing_gpu_before_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedveil reproduce TABLE --device D`` is ``--set device=D`` for every cell (after the other sets,
    so it wins), and a device this machine lacks, or a misspelt one, fails before a cell starts."""
    from fedveil.commands import reproduce as command

    asked: list[list[str]] = []

    def fake(table: str, **kwargs: Any) -> dict[str, Any]:
        asked.append(list(kwargs["overrides"]))
        (kwargs["out"] / table).mkdir(parents=True)
        (kwargs["out"] / table / "summary.md").write_text("summary\n")
        return {"cells": []}

    monkeypatch.setattr(command, "reproduce", fake)
    out = tmp_path / "runs"
    assert main(["reproduce", "table1", "--set", "device=cuda", "--device", "cpu", "--out", str(out)]) == 0
    assert asked == [["device=cuda", "device=cpu"]]
    for spec, says in (("cuda", "sees no CUDA device"), ("gpu", "'gpu'")):
        if spec == "cuda" and not NO_CUDA:
            continue
        assert main(["reproduce", "table1", "--device", spec, "--out", str(tmp_path / spec)]) == 2
        assert says in capsys.readouterr().err and not (tmp_path / spec).exists()
    assert len(asked) == 1


def test_feduv_bench_trains_its_users_on_the_device_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedveil feduv bench --device D``: the users' pool resolves D and trains there (default cpu)."""
    there = _spy_device(monkeypatch, "fedveil.protocols.feduv")
    settings = ["--clients", "2", "--width-divisor", "32", "--repeats", "1", "--threads", "1", "--json"]
    assert main(["feduv", "bench", *settings, "--device", ASKED]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == str(SENTINEL)
    assert any(caller for _, caller in there), "the users' network and data moved to the device asked"
    assert main(["feduv", "bench", *settings]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"
