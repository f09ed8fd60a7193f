"""Nothing lost on a crash: a run killed after any round resumes from its checkpoint to the same model,
and a DP spend is on disk before the release it pays for (never lost, never paid twice)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import (
    DEVICE_RECORD,
    Checkpoint,
    SpendLog,
    config_digest,
    differing_settings,
    identity_settings,
    load_checkpoint,
    save_checkpoint,
    saved_settings,
)
from fedveil.experiments.config import config_to_dict, load_config
from fedveil.experiments.fdml.runner import run_experiment
from fedveil.protocols import fdml as fdml_module
from fedveil.protocols.fdml import FDMLServer
from fedveil.protocols.fedavg import FedAvgServer
from test_experiments_runner import SMALL as RUNNER_SMALL

TABLE1 = Path(__file__).resolve().parents[1] / "configs" / "table1_fdml.yaml"
SMALL = [
    *RUNNER_SMALL,
    "enclave.boundary=inprocess",
    "rounds=5",
    "name=r",
]


class Crash(RuntimeError):
    pass


def _rounds(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "round" in x and "eval" not in x]


def _weights(out: Path) -> np.ndarray:
    ckpt = load_checkpoint(out)
    assert ckpt is not None
    return ckpt.arrays["weights"]


@pytest.mark.parametrize(("protocol", "server_cls"), [("fdml", FDMLServer), ("fedavg", FedAvgServer)])
def test_a_crashed_simulation_resumes_to_the_same_model(
    tmp_path: Path, toy_population: Any, monkeypatch: pytest.MonkeyPatch, protocol: str, server_cls: type
) -> None:
    cfg = load_config(None, [f"protocol={protocol}", *SMALL])
    whole = tmp_path / "whole"
    run_experiment(cfg, whole, progress=False, population=toy_population)

    crashed = tmp_path / "crashed"
    original = server_cls.run_round

    async def crash_in_round_4(self: Any, rnd: int, comm: Any) -> Any:
        if rnd == 4:
            raise Crash("power cut")
        return await original(self, rnd, comm)

    monkeypatch.setattr(server_cls, "run_round", crash_in_round_4)
    with pytest.raises(Crash):
        run_experiment(cfg, crashed, progress=False, population=toy_population)
    assert load_checkpoint(crashed).round == 3
    monkeypatch.setattr(server_cls, "run_round", original)
    # ``auto`` (the default) ran on the CPU here: ``cpu`` names the same device, and the run resumes
    on_cpu = load_config(None, [f"protocol={protocol}", *SMALL, "device=cpu"])
    results = run_experiment(on_cpu, crashed, progress=False, population=toy_population, resume=True)
    assert [r["round"] for r in _rounds(crashed)] == [1, 2, 3, 4, 5]
    assert results["rounds"] == 5 and results["resumed_after_round"] == 3
    np.testing.assert_array_equal(_weights(crashed), _weights(whole))


def test_a_dp_spend_is_durable_before_the_release_and_never_repeated(
    tmp_path: Path, toy_population: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(
        None, ["dp.enabled=true", "dp.mode=strict", "dp.round_epsilon=8", "dp.bound_T=1e-3", *SMALL]
    )
    seen: list[tuple[int, list[int]]] = []
    release = fdml_module.AttestedEnclave.step_five

    def spy(self: Any, rnd: int, attempt: int, replies: Any) -> Any:
        seen.append((rnd, SpendLog(tmp_path).rounds()))
        if rnd == 3 and len(seen) == 3:
            release(self, rnd, attempt, replies)
            raise Crash("killed right after the enclave released round 3")
        return release(self, rnd, attempt, replies)

    monkeypatch.setattr(fdml_module.AttestedEnclave, "step_five", spy)
    with pytest.raises(Crash):
        run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    # every release found its own round already on disk
    assert all(rnd in paid for rnd, paid in seen)
    assert SpendLog(tmp_path).rounds() == [1, 2, 3] and load_checkpoint(tmp_path).round == 2
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population, resume=True)
    rounds = _rounds(tmp_path)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    assert rounds[2].get("interrupted") is True and rounds[2]["applied"] is False
    assert SpendLog(tmp_path).rounds() == [1, 2, 3, 4, 5], "round 3 was paid once and not run again"
    assert results["privacy"]["round"] == 5 == results["privacy"]["rounds_paid"]
    assert [r["privacy_round"] for r in rounds if "privacy_round" in r] == [1, 2, 4, 5]


def test_resume_refuses_another_config(tmp_path: Path, toy_population: Any) -> None:
    run_experiment(
        load_config(None, [*SMALL, "rounds=1"]), tmp_path, progress=False, population=toy_population
    )
    with pytest.raises(
        ConfigError, match=r"config\.yaml holds another config than this one \(rounds, seed\)"
    ):
        run_experiment(
            load_config(None, [*SMALL, "rounds=2", "seed=9"]),
            tmp_path,
            progress=False,
            population=toy_population,
            resume=True,
        )


def test_a_run_resumes_on_its_device_however_spelled_and_on_no_other(
    tmp_path: Path, toy_population: Any
) -> None:
    """The device a run trained on is recorded as resolved (``device.json``); a resumed run is compared on
    it, not on the spelling of the option. A checkpoint whose digest still hashes the device as spelled
    (written before digests left it out) resumes under the same spelling."""
    cfg = load_config(None, [*SMALL, "rounds=2"])
    assert cfg.device == "auto"
    run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    assert json.loads((tmp_path / DEVICE_RECORD).read_text()) == {"device": "cpu"}
    on_cpu = load_config(None, [*SMALL, "rounds=2", "device=cpu"])
    assert run_experiment(on_cpu, tmp_path, progress=False, population=toy_population, resume=True)
    ckpt = load_checkpoint(tmp_path)
    spelled = config_digest(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    assert ckpt.meta["config_sha256"] != spelled
    save_checkpoint(tmp_path, Checkpoint(ckpt.round, ckpt.arrays, {**ckpt.meta, "config_sha256": spelled}))
    (tmp_path / DEVICE_RECORD).unlink()
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population, resume=True)
    assert results["resumed_after_round"] == 2
    assert json.loads((tmp_path / DEVICE_RECORD).read_text()) == {"device": "cpu"}, "it counts as the CPU's"

    (tmp_path / DEVICE_RECORD).write_text(json.dumps({"device": "cuda:0"}))
    message = r"computed on cuda:0, and this run is on cpu: resume it with --device cuda:0"
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg, tmp_path, progress=False, population=toy_population, resume=True)


@pytest.mark.parametrize(
    ("name", "data", "why"),
    [
        ("config.json", b'{"rounds": 3', "Expecting"),
        ("config.json", b"[1, 2]", "a list, not a mapping of settings"),
        ("config.json", b"\xff\xfe", "'utf-8' codec can't decode"),
        ("config.yaml", b"rounds: [1", "while parsing"),
        ("config.yaml", b"", "empty"),
    ],
)
def test_a_damaged_run_config_is_one_clear_error_naming_it(
    tmp_path: Path, name: str, data: bytes, why: str
) -> None:
    """A run's recorded settings that are truncated, edited or not UTF-8 are refused naming the file, the
    reason and what to do, never a traceback."""
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError, match=rf"{name} is not a readable run config \({why}.*--overwrite"):
        saved_settings(tmp_path / name)


def test_a_resumed_fdml_run_with_a_damaged_config_yaml_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text("- not\n- a mapping\n")
    assert main(["run", str(TABLE1), "--out", str(tmp_path), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.yaml is not a readable run config (a list" in err, err


def test_identity_settings_leave_out_the_device_and_the_free_settings() -> None:
    settings = {"rounds": 3, "device": "cuda:0", "threads": 4, "lr": 1e-3, "shape": (2, 3)}
    assert identity_settings(settings, free=("threads",)) == {"rounds": 3, "lr": 1e-3, "shape": [2, 3]}
    assert differing_settings({"a": 1, "b": 2}, {"b": 3, "c": 4}) == ["a", "b", "c"]


def test_checkpoint_round_trip_and_refusals(tmp_path: Path) -> None:
    arrays = {"weights": np.arange(5, dtype=np.float32)}
    save_checkpoint(tmp_path, Checkpoint(7, arrays, {"rng": {"state": 2**80}}))
    got = load_checkpoint(tmp_path)
    assert got.round == 7 and got.meta == {"rng": {"state": 2**80}}
    np.testing.assert_array_equal(got.arrays["weights"], arrays["weights"])
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"
    with pytest.raises(ConfigError, match="may not be named"):
        save_checkpoint(tmp_path, Checkpoint(1, {"meta": np.zeros(1)}, {}))
    (tmp_path / "checkpoint.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a fedveil checkpoint"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path / "nowhere") is None


def test_a_torn_spend_line_is_ignored(tmp_path: Path) -> None:
    log = SpendLog(tmp_path)
    log.record(1)
    log.record(2)
    with open(log.path, "a") as fh:
        fh.write('{"rou')
    assert log.rounds() == [1, 2]
    log.record(3)
    assert log.rounds() == [1, 2, 3]


def test_a_reproducible_dp_seed_is_refused_outside_the_simulation(toy_population: Any) -> None:
    from fedveil.experiments.fdml.runner import build_trainer
    from fedveil.protocols.fdml import DPRelease

    cfg = load_config(None, SMALL)
    release = DPRelease("paper", 1e-3, 1.0, 0.2)
    with pytest.raises(ConfigError, match="simulation only: a deployed enclave must draw its noise from OS"):
        build_trainer(cfg, toy_population, release, runtime=object(), dp_seed=5)
