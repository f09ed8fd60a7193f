"""The runner writes a complete run directory; the CLI fails on bad configs before training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedveil.cli import main
from fedveil.core.provenance import code_identity
from fedveil.errors import ConfigError
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import run_experiment

SMALL = [
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "fedavg.clients_per_round=4",
    "fedavg.samples_per_client=4",
]


@pytest.mark.parametrize("protocol", ["fdml", "fedavg"])
def test_run_directory_is_complete(tmp_path: Path, toy_population, protocol: str) -> None:
    cfg = load_config(None, [f"protocol={protocol}", "rounds=4", "eval.every=2", "name=t", *SMALL])
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    for name in ("config.yaml", "metrics.jsonl", "results.json", "checkpoint.npz", "roc.png", "accuracy.png"):
        assert (tmp_path / name).is_file(), name
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if "round" in x and "eval" not in x]
    evals = [x["eval"] for x in lines if "eval" in x]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    assert {"loss", "dropouts", "bytes_up", "bytes_down", "sim_seconds", "real_seconds"} <= set(rounds[0])
    assert [e["round"] for e in evals] == [2, 4]
    assert 0 <= results["accuracy_percent"] <= 100 and 0 <= results["eer"] <= 1
    assert results["bytes_up"] == sum(r["bytes_up"] for r in rounds)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert results["code"] == code_identity()  # which code ran (tests/test_core_provenance.py)
    with np.load(tmp_path / "checkpoint.npz", allow_pickle=False) as ck:
        assert int(ck["round"]) == 4
    assert (tmp_path / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_run_rejects_a_bad_config_before_training(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("protocol: fdml\nfdml:\n  rate_p: 0\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rate_p 0.0 must be in (0, 1]" in err
    assert not (tmp_path / "out").exists()


def test_cli_run_rejects_a_bad_override(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--set", "fdml.strategy=hardest", "--out", str(tmp_path / "o")]) == 2
    assert "strategy 'hardest' is not one of batch-all, semi-hard" in capsys.readouterr().err


def test_dp_run_reports_both_epsilons_every_round(tmp_path: Path, toy_population) -> None:
    cfg = load_config(
        None,
        [
            "rounds=3",
            "name=dp",
            "dp.enabled=true",
            "dp.mode=strict",
            "dp.round_epsilon=8",
            "dp.bound_T=1e-3",
            *SMALL,
        ],
    )
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if "round" in x and "eval" not in x]
    assert [r["privacy_round"] for r in rounds] == [1, 2, 3]
    eps = [r["privacy_epsilon_total_strict"] for r in rounds]
    assert eps[0] < eps[1] < eps[2]
    assert results["privacy"]["epsilon_round_strict"] == pytest.approx(8, rel=1e-6)
    assert results["privacy"]["dp_mode"] == "strict"


def test_dp_target_is_never_exceeded(tmp_path: Path, toy_population) -> None:
    plan = ["dp.enabled=true", "dp.mode=paper", "dp.round_epsilon=1", "dp.target_epsilon=2.5", *SMALL]
    with pytest.raises(ConfigError, match="covers only 2 of the 50 rounds"):
        run_experiment(
            load_config(None, ["rounds=50", *plan]), tmp_path, progress=False, population=toy_population
        )
    assert not (tmp_path / "metrics.jsonl").exists()
    cfg = load_config(None, ["rounds=50", "dp.when_exhausted=stop", *plan])
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    assert results["rounds"] == 2
    assert "stopped before round 3" in results["stopped"]
    assert results["privacy"]["epsilon_total_paper_composed"] <= 2.5


def test_dp_calibrates_to_a_whole_training_target(tmp_path: Path, toy_population) -> None:
    cfg = load_config(None, ["rounds=4", "dp.enabled=true", "dp.mode=strict", "dp.target_epsilon=20", *SMALL])
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    assert results["rounds"] == 4 and "stopped" not in results
    assert results["privacy"]["epsilon_total_strict"] <= 20


def test_fdml_trains_on_real_touch_logs_in_the_csv_schema(tmp_path: Path) -> None:
    """The runner builds a population from a touch-log CSV and trains FDML rounds on it."""
    import asyncio

    from fedveil.data.touch_csv import FIXTURE_PATH
    from fedveil.experiments.fdml.runner import build_population, build_trainer

    cfg = load_config(
        None,
        [
            "data.kind=touchauth-csv",
            f"data.path={FIXTURE_PATH}",
            "data.test_users_per_model=[0]",
            "fdml.num_required=2",
            "fdml.samples_per_client=2",
            "fdml.min_gradients=2",
            "enclave.boundary=none",
        ],
    )
    population = build_population(cfg)
    trainer = build_trainer(cfg, population)

    async def go():
        await trainer.server.register(trainer.runtime)
        return [await trainer.server.run_round(r, trainer.runtime) for r in (1, 2)]

    reports = asyncio.run(go())
    assert all(r.applied and r.loss is not None for r in reports)
