"""``fedveil aiot run CONFIG`` end to end through the CLI on a tiny config: every method of Tables 1-2 over
two trials, the printed table, resuming without repeating finished work, and config errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.aiot import runner as aiot
from fedveil.experiments.aiot.runner import METHODS, load_aiot_run
from fedveil.experiments.checkpoint import Checkpoint, load_checkpoint, save_checkpoint

TINY_SETTINGS: dict[str, Any] = {
    "name": "tiny",
    "size": 32,
    "width": 0.25,
    "public_identities": 20,
    "pretrain_epochs": 1,
    "private_identities": 12,
    "test_identities": 6,
    "wild": 2,
    "identities_per_device": 3,
    "rounds": 2,
    "clients_per_round": 2,
    "batch_size": 4,
    "trials": 2,
    "threads": 1,
}


def tiny_aiot(**changes: Any) -> str:
    """A few seconds of AIoT (32 px, a quarter of MobileFaceNet's width) as YAML, with ``changes``."""
    return yaml.safe_dump({**TINY_SETTINGS, **changes}, sort_keys=False)


TINY = tiny_aiot(solo_devices=2)


def test_aiot_run_prints_tar_at_far_and_resumes(tmp_path: Path, capsys, monkeypatch) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "run"
    assert main(["aiot", "run", str(config), "--out", str(out), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["synthetic_data"] is True and "SYNTHETIC" in record["data"]
    assert record["model"] == "mobilefacenet (image_size 32, width 0.25)"
    assert set(record["summary"]) == set(METHODS)
    assert record["summary"]["pretrained"]["trials"] == 1
    assert all(record["summary"][m]["trials"] == 2 for m in METHODS[1:])
    for row in record["results"].values():
        assert 0 <= row["tar_at_far_1e-3"] <= 1 and 0 <= row["identification_accuracy"] <= 1
    assert record["results"]["centralized/0"]["epochs"] == 1
    assert len(record["results"]["solo/1"]["per_device"]) == 2
    assert (out / "pretrained.safetensors").is_file()

    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a finished (method, trial) ran again")

    monkeypatch.setattr(aiot, "_method", fail)
    monkeypatch.setattr(aiot, "train_faces", fail)
    assert main(["aiot", "run", str(config), "--out", str(out)]) == 2, "a used folder needs --resume"
    assert "--resume" in capsys.readouterr().err
    assert main(["aiot", "run", str(config), "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "TAR@FAR1e-3" in printed and "no_frozen_bn" in printed and "impostor pairs" in printed


def test_aiot_config_errors_name_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("size: 32\nroundz: 3\n")
    with pytest.raises(ConfigError, match="roundz"):
        load_aiot_run(config)
    config.write_text("methods: [ours, magic]\n")
    with pytest.raises(ConfigError, match="magic"):
        load_aiot_run(config)
    config.write_text("batch_size: 1\n")
    with pytest.raises(ConfigError, match="batch_size 1"):
        load_aiot_run(config)
    good = tmp_path / "tiny.yaml"
    good.write_text(TINY)
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"run": {"rounds": 99}, "results": {}}))
    with pytest.raises(ConfigError, match="other settings"):
        aiot.run_aiot(load_aiot_run(good), out, progress=False, resume=True)


def test_shipped_aiot_config_loads() -> None:
    cfg = load_aiot_run(Path(__file__).parents[1] / "configs" / "aiot" / "small.yaml")
    assert (cfg.rounds, cfg.local_epochs, cfg.lr, cfg.trials) == (20, 1, 0.001, 5)
    assert set(cfg.methods) == set(METHODS)


class _PowerCut(Exception):
    """A crash in the middle of a run, raised where the crash-test hook would kill the process."""


def test_a_trial_cut_off_mid_way_resumes_from_its_last_round_to_the_uninterrupted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    run = load_aiot_run(config, {"rounds": 3, "trials": 1, "methods": ["ours", "solo"]})
    models: list[dict[str, torch.Tensor]] = []
    real_evaluate = aiot.evaluate_faces

    def evaluate(model: torch.nn.Module, *args: Any) -> dict[str, Any]:
        models.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real_evaluate(model, *args)

    monkeypatch.setattr(aiot, "evaluate_faces", evaluate)
    whole = aiot.run_aiot(run, tmp_path / "whole", progress=False)
    final = models[-1]
    seen: list[str] = []

    def hook(name: str, rnd: int) -> None:
        seen.append(f"{name}:{rnd}")
        if seen.count("metrics:2") == 3 and seen[-1] == "metrics:2":  # ours, solo device 1, solo device 2
            raise _PowerCut

    monkeypatch.setattr(aiot, "crash_point", hook)
    out = tmp_path / "cut"
    with pytest.raises(_PowerCut):
        aiot.run_aiot(run, out, progress=False)
    ckpt = load_checkpoint(out)
    assert (ckpt.round, ckpt.meta["key"], ckpt.meta["part"], len(ckpt.meta["rows"])) == (1, "solo/0", 1, 1)
    assert any(k.startswith("projector.") for k in ckpt.arrays), "the simulated devices' projectors"
    seen.clear()
    models.clear()
    # ``auto`` (the default) ran on the CPU here: ``cpu`` names the same device, and the run resumes
    resumed = aiot.run_aiot(replace(run, device="cpu"), out, progress=False, resume=True)
    assert seen == ["round:2", "metrics:2", "round:3", "metrics:3"], "only the second device's last rounds"
    assert len(models) == 1 and models[0].keys() == final.keys()
    for name, value in final.items():
        torch.testing.assert_close(models[0][name], value, rtol=0, atol=0)
    assert resumed["results"] == whole["results"] and not (out / "checkpoint.npz").exists()


def test_a_trial_checkpoint_of_other_settings_is_not_resumed(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run", Checkpoint(1, {}, {"config_sha256": "another", "key": "ours/0"}))
    with pytest.raises(ConfigError, match=r"checkpoint\.npz \(round 1\) was trained under another config"):
        aiot.run_aiot(load_aiot_run(config), tmp_path / "run", progress=False, resume=True)
