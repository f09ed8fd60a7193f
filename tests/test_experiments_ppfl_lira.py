"""LiRA against E2E FedAvg and PPFL's releases (fedveil.experiments.ppfl.lira) on a tiny synthetic run: each
system's shadows are trained the way its target was, on halves of the candidates; a rerun resumes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.attacks.runs import membership_run
from fedveil.experiments.fedavg_images import FedAvgRun
from fedveil.experiments.ppfl import lira as ppfl_lira
from fedveil.experiments.ppfl.lira import SYSTEMS, ppfl_lira_table


def _images() -> FedAvgRun:
    return membership_run(
        data="synthetic-fashion-mnist:1500", clients=3, samples_per_client=16, rounds=2, local_epochs=1
    )


def test_each_system_is_attacked_with_shadows_trained_its_own_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[tuple[str, int, int]] = []
    real_fedavg, real_ppfl = ppfl_lira.train_fedavg, ppfl_lira.train_ppfl

    def fedavg(run: FedAvgRun, *, split, progress: bool) -> object:
        trained.append(("e2e", len(split.members), len(split.data.user_ids)))
        return real_fedavg(run, split=split, progress=progress)

    def ppfl(run, split) -> object:
        trained.append(("ppfl", len(split.members), len(split.data.user_ids)))
        return real_ppfl(run, split)

    monkeypatch.setattr(ppfl_lira, "train_fedavg", fedavg)
    monkeypatch.setattr(ppfl_lira, "train_ppfl", ppfl)
    summary = ppfl_lira_table(images=_images(), shadows=4, aux_examples=40, head_epochs=1, out=tmp_path)
    attacks = summary["attacks"]
    for system in SYSTEMS:
        for variant in ("online", "offline"):
            row = attacks[f"lira-{variant}/{system}"]
            assert 0.0 <= row["auc"] <= 1.0 and row["num_positives"] == row["num_negatives"] == 48
            assert set(row["tpr_at_fpr"]) >= {"0.001", "0.01"}
        assert 0.0 <= attacks[f"accuracy/{system}"] <= 1.0
    # per system: the target on its 48 members, then 4 shadows among the target's 3 clients, each of the
    # 96 candidates in exactly 2 of them (LiRA's halves)
    e2e = [t for t in trained if t[0] == "e2e"]
    assert len(e2e) == 5 and e2e[0] == ("e2e", 48, 3)
    assert sum(size for _, size, _ in e2e[1:]) == 96 * 2 and {c for *_, c in e2e} == {3}
    # one PPFL training per split serves both PPFL rows
    assert len([t for t in trained if t[0] == "ppfl"]) == 5
    assert summary["run"]["members"] == summary["run"]["non_members"] == 48
    assert json.loads((tmp_path / "ppfl_lira.json").read_text())["attacks"] == attacks
    assert sorted(p.name for p in (tmp_path / "shadows" / "e2e").iterdir()) == [
        f"shadow{s}.npz" for s in range(4)
    ]
    # a rerun with the same settings reads every finished system instead of training again
    trained.clear()
    again = ppfl_lira_table(images=_images(), shadows=4, aux_examples=40, head_epochs=1, out=tmp_path)
    assert trained == [] and again["attacks"] == attacks
    # a system cut off after its shadows were cached trains only its target again
    (tmp_path / "parts" / "lira-e2e.json").unlink()
    ppfl_lira_table(
        images=_images(), systems=("e2e",), shadows=4, aux_examples=40, head_epochs=1, out=tmp_path
    )
    assert trained == [("e2e", 48, 3)]
    with pytest.raises(ConfigError, match="other settings"):
        ppfl_lira_table(images=_images(), shadows=5, aux_examples=40, head_epochs=1, out=tmp_path)


def test_the_kept_row_from_a_shared_training_equals_training_with_the_layer_kept() -> None:
    kept = ("ppfl-kept",)
    alone = ppfl_lira_table(images=_images(), systems=kept, shadows=4, aux_examples=40, head_epochs=1)
    both = ppfl_lira_table(
        images=_images(), systems=("ppfl-released", *kept), shadows=4, aux_examples=40, head_epochs=1
    )
    for name in ("lira-online/ppfl-kept", "lira-offline/ppfl-kept", "accuracy/ppfl-kept"):
        assert both["attacks"][name] == alone["attacks"][name]
    released = both["attacks"]["lira-online/ppfl-released"]
    assert released != both["attacks"]["lira-online/ppfl-kept"]


def test_shadow_split_gives_the_target_s_clients_and_test_set() -> None:
    split = ppfl_lira.split_images(_images())
    x, y = split.members.x[:10], split.members.y[:10]
    shadow = ppfl_lira._shadow_split(split, _images(), x, y, seed=3)
    assert len(shadow.members) == 10 and len(shadow.non_members) == 0
    assert len(shadow.data.user_ids) == 3 and shadow.test is split.test
    pooled = np.concatenate([shadow.data.array(c, "y") for c in shadow.data.user_ids])
    assert sorted(pooled.tolist()) == sorted(y.tolist())


def test_bad_settings_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="among e2e, ppfl-released, ppfl-kept"):
        ppfl_lira_table(images=_images(), systems=("fedsgd",))
    with pytest.raises(ConfigError, match="at least 4"):
        ppfl_lira_table(images=_images(), shadows=3)
    assert main(["ppfl", "lira", "--clients", "0"]) == 2
    assert "--clients 0 must be >= 1" in capsys.readouterr().err


def test_device_cpu_and_the_default_give_the_same_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device`` reaches the table (default ``auto``, the CPU here), which records the resolved device;
    ``cpu`` and ``auto`` give the same bits."""
    from fedveil.experiments.attacks import runs as attack_runs

    seen: list[str] = []
    table = ppfl_lira.ppfl_lira_table

    def tiny_table(*, images: FedAvgRun, **kw: object) -> dict[str, object]:
        seen.append(images.device)
        return table(images=images, **{**kw, "aux_examples": 40, "head_epochs": 1})

    monkeypatch.setattr(attack_runs, "membership_run", lambda **kw: _images())
    monkeypatch.setattr(ppfl_lira, "ppfl_lira_table", tiny_table)
    argv = ["ppfl", "lira", "--systems", "ppfl-kept", "--shadows", "4", "--json"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert seen == ["auto", "cpu"] and default == cpu and cpu["run"]["device"] == "cpu"
    assert json.loads((tmp_path / "device.json").read_text()) == {"device": "cpu"}


def test_every_target_shadow_and_view_trains_and_is_scored_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E2E's and PPFL's trainings get the run's device, the ``ppfl-kept`` observer's head trains there,
    and every model LiRA scores (targets, shadows, views) is there. (A CUDA device is compared with the
    CPU in tests/test_gpu_ppfl_attacks.py.)"""
    from fedveil.attacks import lira as lira_attack
    from fedveil.attacks.scores import model_logits
    from fedveil.models.device import module_device

    trained: list[tuple[str, str]] = []
    scored: list[str] = []
    heads: list[str] = []
    real_fedavg, real_ppfl, real_head = ppfl_lira.train_fedavg, ppfl_lira.train_ppfl, ppfl_lira._attacker_head

    def fedavg(run: FedAvgRun, **kw: object) -> object:
        trained.append(("e2e", run.device))
        return real_fedavg(run, **kw)

    def ppfl(run, split) -> object:
        trained.append(("ppfl", run.device))
        return real_ppfl(run, split)

    def head(*a: object, device: object, **kw: object) -> object:
        heads.append(str(device))
        return real_head(*a, device=device, **kw)

    def logits(model: object, x: object, **kw: object) -> object:
        scored.append(str(module_device(model)))
        return model_logits(model, x, **kw)

    monkeypatch.setattr(ppfl_lira, "train_fedavg", fedavg)
    monkeypatch.setattr(ppfl_lira, "train_ppfl", ppfl)
    monkeypatch.setattr(ppfl_lira, "_attacker_head", head)
    monkeypatch.setattr(lira_attack, "model_logits", logits)
    images = replace(_images(), device="cpu")
    summary = ppfl_lira_table(
        images=images, systems=("e2e", "ppfl-kept"), shadows=4, aux_examples=40, head_epochs=1
    )
    assert summary["run"]["device"] == "cpu"
    assert trained == [("e2e", "cpu")] * 5 + [("ppfl", "cpu")] * 5
    assert heads == ["cpu"] * 5 and scored == ["cpu"] * 10


def test_a_folder_of_shadows_from_another_device_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cached shadows are never mixed across devices: a folder holding some (written before folders
    recorded their device: the CPU's) is refused to a run on another device, before anything trains."""
    shadows = tmp_path / "shadows" / "e2e"
    shadows.mkdir(parents=True)
    (shadows / "shadow0.npz").write_bytes(b"")
    monkeypatch.setattr(ppfl_lira, "train_fedavg", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setattr(ppfl_lira, "resolve_device", lambda spec: torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="holds parts computed on cpu, and this run is on cuda:0"):
        ppfl_lira_table(images=_images(), systems=("e2e",), shadows=4, out=tmp_path)
    assert not (tmp_path / "device.json").exists()
