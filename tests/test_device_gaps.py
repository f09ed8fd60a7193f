"""Where the ``device`` setting reaches beyond training, tested on the CPU (the CUDA side is in
tests/test_gpu_device_gaps.py): FDML's evaluation runs on the run's device in batches and its numbers on
the CPU are the same bits as before; a device's name is spelled one way (``cuda:N``) wherever it is
recorded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedveil.experiments.config import load_config
from fedveil.experiments.fdml import central, runner
from fedveil.models.device import module_device
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "enclave.boundary=none",
]


def _touch_samples(users: int, samples: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(users, samples, 30, 10)).astype(np.float32)


def _embed_before_the_device(
    flat: FlatModel, weights: np.ndarray, samples: np.ndarray, batch: int
) -> np.ndarray:
    """FDML's evaluation as it was before it took a device: the reference for the CPU's bits."""
    u, s = samples.shape[:2]
    x = torch.from_numpy(np.array(samples, dtype=np.float32)).reshape(u * s, 1, *samples.shape[2:])
    p = torch.from_numpy(np.array(weights, dtype=np.float32))
    with torch.no_grad():
        out = torch.cat([flat(p, x[i : i + batch]) for i in range(0, len(x), batch)])
    return out.numpy().reshape(u, s, -1)


@pytest.mark.parametrize("device", [None, "cpu", "auto"])
def test_fdml_evaluation_on_the_cpu_is_the_same_bits_as_before(device: str | None) -> None:
    torch.manual_seed(0)
    flat = FlatModel(TouchAuthNet())
    weights = flat.initial() + np.float32(0.01)
    samples = _touch_samples(5, 7)
    expected = _embed_before_the_device(flat, weights, samples, batch=8)
    got = runner.embed_samples(flat, weights, samples, batch=8, device=device)
    assert got.dtype == expected.dtype and got.shape == (5, 7, 64)
    assert np.array_equal(got, expected)


class _SpyNet(nn.Module):
    """Records the device of every batch it is given and of its weight; answers zeros in host memory."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(300, 4)
        self.seen: list[tuple[str, str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.device.type, self.lin.weight.device.type, x.shape[0]))
        return torch.zeros(x.shape[0], 4)


def test_fdml_evaluation_runs_each_batch_on_the_requested_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda`` asked for (here resolved to torch's ``meta`` device, which this machine has): the weights
    and every batch of samples reach the network there, ``batch`` samples at a time."""
    asked: list[Any] = []

    def resolve(spec: Any) -> torch.device:
        asked.append(spec)
        return torch.device("meta")

    monkeypatch.setattr(runner, "resolve_device", resolve)
    spy = _SpyNet()
    flat = FlatModel(spy)
    out = runner.embed_samples(flat, flat.initial(), _touch_samples(3, 4), batch=5, device="cuda")
    assert asked == ["cuda"]
    assert spy.seen == [("meta", "meta", 5), ("meta", "meta", 5), ("meta", "meta", 2)]
    assert module_device(spy).type == "meta"  # the network moved there (its buffers must be there too)
    assert isinstance(out, np.ndarray) and out.shape == (3, 4, 4)


def _embedding_devices(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``device`` of every call of the FDML runner's ``embed_samples`` from now on, in order."""
    seen: list[Any] = []
    original = runner.embed_samples

    def spy(*args: Any, **kwargs: Any) -> np.ndarray:
        seen.append(kwargs.get("device"))
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "embed_samples", spy)
    return seen


def test_fdml_trainer_evaluates_on_the_device_its_clients_train_on(
    monkeypatch: pytest.MonkeyPatch, toy_population: Any
) -> None:
    cfg = load_config(None, ["protocol=fdml", "rounds=1", "device=cpu", *SMALL])
    trainer = runner.build_trainer(cfg, toy_population)
    try:
        assert trainer.device == torch.device("cpu") == module_device(trainer.embed_flat.module)
    finally:
        trainer.close()
    calls = _embedding_devices(monkeypatch)
    runner.evaluate(trainer, toy_population, seed=0)
    runner.untrained_accuracy(cfg, toy_population, device=trainer.device)
    assert calls == [trainer.device, trainer.device]


def test_fdml_run_evaluates_on_its_device_and_over_a_network_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, toy_population: Any, tmp_path: Path
) -> None:
    """A simulated run resolves ``cfg.device`` for its evaluation (every scheduled one and the untrained
    baseline); a run whose clients train elsewhere evaluates on this machine's CPU."""
    resolved: list[Any] = []
    original = runner.resolve_device

    def resolve(spec: Any) -> torch.device:
        resolved.append(spec)
        return original(spec)

    monkeypatch.setattr(runner, "resolve_device", resolve)
    seen = _embedding_devices(monkeypatch)
    cfg = load_config(None, ["protocol=fdml", "rounds=2", "eval.every=1", "device=auto", "name=t", *SMALL])
    runner.run_experiment(cfg, tmp_path / "run", progress=False, population=toy_population)
    assert "auto" in resolved
    assert seen == [torch.device("cpu")] * 3  # rounds 1 and 2, then the untrained network
    trainer = runner.build_trainer(cfg, toy_population, runtime=object())
    assert trainer.device == torch.device("cpu")


def test_central_evaluation_feeds_the_net_where_it_is() -> None:
    spy = _SpyNet().to("meta")
    out = central.embed_samples(spy, _touch_samples(2, 3), batch=4)
    assert spy.seen == [("meta", "meta", 4), ("meta", "meta", 2)]
    assert out.shape == (2, 3, 4)
    torch.manual_seed(0)
    net = TouchAuthNet().eval()
    samples = _touch_samples(3, 5, seed=1)
    with torch.no_grad():
        whole = net(torch.from_numpy(samples).reshape(15, 1, 30, 10)).numpy().reshape(3, 5, -1)
    assert np.array_equal(central.embed_samples(net, samples, batch=15), whole)


def test_an_fdml_round_then_evaluation_on_the_cpu_matches_the_old_evaluation(toy_population: Any) -> None:
    cfg = load_config(None, ["protocol=fdml", "rounds=1", "device=cpu", *SMALL])
    trainer = runner.build_trainer(cfg, toy_population)

    async def one_round() -> None:
        await trainer.server.register(trainer.runtime)
        await trainer.server.run_round(1, trainer.runtime)

    try:
        asyncio.run(one_round())
    finally:
        trainer.close()
    weights = trainer.embedding_weights()
    _, samples = toy_population.test_samples()
    assert np.array_equal(
        runner.embed_samples(trainer.embed_flat, weights, samples, device=trainer.device),
        _embed_before_the_device(trainer.embed_flat, weights, samples, batch=1024),
    )


NO_CUDA = not torch.cuda.is_available()
POLICY = 'get_data(data_type="MPU").runFL.enforce_dp_budget(eps=5).return'


class _Dialled(Exception):
    """Raised by the stand-in for the agent's connection: the agent got as far as dialling, with ``pool``."""

    def __init__(self, pool: Any) -> None:
        super().__init__("dialled the server")
        self.pool = pool


def _no_dialling(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedveil.experiments.fdml.agent as fdml_agent
    import fedveil.experiments.network_run as network_run

    def dial(server: str, pool: Any, **kwargs: Any) -> Any:
        raise _Dialled(pool)

    for module in (network_run, fdml_agent):
        monkeypatch.setattr(module, "agent_host", dial)


def _polifl_agent(tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "alice.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.normal(size=(8, 6)).astype(np.float32), y=rng.integers(0, 2, 8))
    hosted = ["--device", "alice-phone", "--data", str(data), "--policy", POLICY]
    return ["polifl", "agent", "--server", "127.0.0.1:9", "--insecure", *hosted, *extra]


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
def test_polifl_agent_refuses_a_training_device_it_lacks_before_dialling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedveil.cli import main

    _no_dialling(monkeypatch)
    assert main(_polifl_agent(tmp_path, "--train-device", "cuda")) == 2
    assert "device: 'cuda' asks for CUDA" in capsys.readouterr().err


def test_polifl_agent_trains_on_the_cpu_unless_told_and_refuses_a_misspelt_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedveil.cli import build_parser, main

    _no_dialling(monkeypatch)
    args = build_parser().parse_args(_polifl_agent(tmp_path))
    assert args.train_device == "cpu" and args.device == ["alice-phone"]  # --device names who is hosted
    with pytest.raises(_Dialled) as dialled:
        args.func(args)
    assert dialled.value.pool.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = build_parser().parse_args(_polifl_agent(tmp_path, "--train-device", "cuda:1"))
    with pytest.raises(_Dialled) as dialled:
        args.func(args)
    assert dialled.value.pool.device == torch.device("cuda", 1)
    with pytest.raises(SystemExit):
        main(_polifl_agent(tmp_path, "--train-device", "gpu"))
    assert "device: 'gpu' is not one of auto, cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
def test_the_other_agents_train_on_their_configs_device_and_refuse_one_they_lack_before_dialling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedveil agent`` takes the experiment config's ``device`` (``--set device=...`` too) and ``fedveil
    feduv agent`` the run's ``config.json``'s; a device this machine lacks fails before any dialling."""
    from fedveil.cli import main

    _no_dialling(monkeypatch)
    fdml = ["agent", "--config", str(REPO / "configs/table1_fdml.yaml"), "--server", "127.0.0.1:9"]
    fdml += ["--insecure", "--shard", "0/50", *[a for s in SMALL for a in ("--set", s)]]
    with pytest.raises(_Dialled) as dialled:
        main([*fdml, "--set", "device=cpu", "--set", "enclave.boundary=none"])
    assert dialled.value.pool.pool.device == torch.device("cpu")
    assert main([*fdml, "--set", "device=cuda"]) == 2
    assert "device: 'cuda' asks for CUDA" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text('{"device": "cuda"}\n', encoding="utf-8")
    feduv = ["feduv", "agent", "--config", str(config), "--method", "softmax", "--server", "127.0.0.1:9"]
    assert main([*feduv, "--insecure"]) == 2
    assert "device: 'cuda' asks for CUDA" in capsys.readouterr().err


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> None:
    """Make torch see ``count`` GPUs, ``current`` the current one (no GPU is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


@pytest.mark.parametrize(("current", "expected"), [(0, "cuda:0"), (1, "cuda:1")])
def test_a_gpu_is_named_by_its_index_however_it_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, current: int, expected: str
) -> None:
    from fedveil.models.device import resolve_device

    _gpus(monkeypatch, 2, current)
    for spec in ("cuda", "auto", expected, torch.device("cuda"), torch.device(expected)):
        assert str(resolve_device(spec)) == expected, spec
    assert str(resolve_device("cuda:0")) == "cuda:0" and str(resolve_device("cuda:1")) == "cuda:1"
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_folder_of_parts_resumes_on_the_same_gpu_whatever_its_spelling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A PPFL output folder whose parts ``--device cuda`` computed resumes under ``cuda:0`` and ``auto`` (the
    same GPU) and is refused to another GPU, naming both by index."""
    from fedveil.errors import ConfigError
    from fedveil.experiments.checkpoint import DEVICE_RECORD, claim_device
    from fedveil.experiments.ppfl.attacks import PARTS
    from fedveil.models.device import resolve_device

    _gpus(monkeypatch, 2, 0)
    claim_device(tmp_path, resolve_device("cuda"), artefacts=PARTS)
    assert json.loads((tmp_path / DEVICE_RECORD).read_text(encoding="utf-8")) == {"device": "cuda:0"}
    for spec in ("cuda:0", "auto", "cuda"):
        claim_device(tmp_path, resolve_device(spec), artefacts=PARTS)
    with pytest.raises(ConfigError, match="computed on cuda:0, and this run is on cuda:1"):
        claim_device(tmp_path, resolve_device("cuda:1"), artefacts=PARTS)


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
def test_feduv_agent_trains_where_told_else_on_the_runs_device_and_refuses_a_device_it_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedveil feduv agent --train-device D`` overrides the run's ``device`` for the users it hosts (a
    CPU-only agent can join a run recorded on ``cuda``); without it the run's device holds. A device this
    machine lacks, or a misspelt one, fails before the users' data is made or the server dialled."""
    from fedveil.cli import main

    _no_dialling(monkeypatch)
    config = tmp_path / "config.json"
    small = {"writers": 2, "unseen_writers": 1, "train_examples": 2, "val_examples": 1, "test_examples": 1}
    config.write_text(json.dumps({**small, "device": "cuda:1"}), encoding="utf-8")
    feduv = ["feduv", "agent", "--config", str(config), "--method", "softmax", "--server", "127.0.0.1:9"]
    with pytest.raises(_Dialled) as dialled:
        main([*feduv, "--insecure", "--train-device", "cpu"])
    assert dialled.value.pool.device == torch.device("cpu")
    assert main([*feduv, "--insecure"]) == 2, "without --train-device the run's cuda:1 is asked for"
    assert "device: 'cuda:1' asks for CUDA" in capsys.readouterr().err
    config.write_text(json.dumps({**small, "device": "cpu"}), encoding="utf-8")
    assert main([*feduv, "--insecure", "--train-device", "cuda"]) == 2
    assert "device: 'cuda' asks for CUDA" in capsys.readouterr().err
    assert main([*feduv, "--insecure", "--train-device", "gpu"]) == 2
    assert "device: 'gpu' is not one of auto, cpu, cuda or cuda:N" in capsys.readouterr().err
