"""PPFL Table 2 harness on a tiny synthetic run: every PPFL update view is sealed and refused, and PPFL's
release is attacked as its observer would (with and without the last layer kept in the TEEs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedveil.errors import ConfigError
from fedveil.experiments import ppfl_attacks
from fedveil.experiments.attack_runs import membership_run
from fedveil.experiments.fedavg_images import FedAvgRun
from fedveil.experiments.ppfl_attacks import ppfl_attack_table

TINY = {
    "aux_examples": 40,
    "head_epochs": 1,
    "dra_targets": 1,
    "dra_iterations": 3,
    "pia_clients": 4,
    "pia_rounds": 1,
    "e2e": False,
    "progress": False,
}


def _images(**kw: object) -> FedAvgRun:
    return membership_run(
        data="synthetic-fashion-mnist:1500", clients=3, samples_per_client=16, rounds=2, local_epochs=1, **kw
    )


def test_table_2_harness_runs_each_attack_on_what_each_observer_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = _images()
    summary = ppfl_attack_table(images=images, out=tmp_path, **TINY)
    attacks = summary["attacks"]
    assert summary["run"]["synthetic_data"] is True
    assert attacks["dra/ppfl"]["result"] == "no plaintext view" and attacks["dra/ppfl"]["sealed_views"] > 0
    assert attacks["pia/ppfl"]["result"] == "no plaintext view"
    assert not any(key.endswith("/e2e") for key in attacks)  # the E2E rows: tests/test_attacks_*.py
    for key in ("mia-yeom/ppfl", "mia-nasr/ppfl", "mia-yeom/ppfl-released", "mia-nasr/ppfl-released"):
        assert 0 <= attacks[key]["auc"] <= 1 and "precision" in attacks[key]
    assert "head trained on auxiliary data" in attacks["mia-yeom/ppfl"]["observer"]
    assert attacks["mia-yeom/ppfl-released"]["observer"] == "observer: released whole model"
    assert (tmp_path / "ppfl_attacks.json").exists()
    # each part is kept as it finishes: a rerun reads them instead of training again
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["ppfl-kept.json", "ppfl-released.json"]
    monkeypatch.setattr(ppfl_attacks, "train_ppfl", lambda *a, **k: pytest.fail("a finished part ran again"))
    again = ppfl_attack_table(images=images, out=tmp_path, **TINY)
    assert again["attacks"] == json.loads((tmp_path / "ppfl_attacks.json").read_text())["attacks"]
    assert again["attacks"] == summary["attacks"]
    with pytest.raises(ConfigError, match="written by a run with other settings"):
        ppfl_attack_table(images=_images(seed=1), out=tmp_path, **TINY)


def test_model_init_and_classifier_pool_reach_every_part(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """VGG9's Table 2 needs Darknet's initialisation (to learn) and pooled stage classifiers (to fit the
    enclave): the CLI options reach E2E's DLG and property runs, PPFL's run and its stages."""
    from fedveil.cli import main

    images = _images(model_init="darknet")
    cfg = ppfl_attacks.ppfl_like(images, classifier_pool="avg")
    assert cfg.classifier_pool == "avg" and cfg.keep_classifier_in_tee
    assert ppfl_attacks._ppfl_run(images, cfg, 64.0).model_init == "darknet"
    seen: dict[str, object] = {}

    def table(**kw: object) -> dict[str, object]:
        seen.update(kw)
        return {"attacks": {}}

    monkeypatch.setattr(ppfl_attacks, "ppfl_attack_table", table)
    argv = ["ppfl", "attacks", "--model", "vgg9", "--model-init", "darknet", "--classifier-pool", "avg"]
    assert main([*argv, "--json"]) == 0
    assert seen["images"].model == "vgg9" and seen["images"].model_init == "darknet"
    assert seen["ppfl"].classifier_pool == "avg"
    with pytest.raises(SystemExit):
        main(["ppfl", "attacks", "--model-init", "xavier"])
    assert "invalid choice: 'xavier'" in capsys.readouterr().err
    calls: list[str] = []

    def fake_build(*a: object, init: str = "torch", **k: object) -> None:
        calls.append(init)
        raise RuntimeError("stop after building")

    from fedveil.experiments import attack_runs

    monkeypatch.setattr(attack_runs, "build_model", fake_build)
    for run in (
        lambda: attack_runs.run_inversion(
            "dlg", data="synthetic-fashion-mnist:1500", targets=1, init="darknet"
        ),
        lambda: attack_runs.run_property(data="synthetic-fashion-mnist:1500", clients=2, init="darknet"),
    ):
        with pytest.raises(RuntimeError, match="stop after building"):
            run()
    assert calls == ["darknet", "darknet"]
