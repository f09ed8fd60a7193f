"""PPFL Table 2 harness on a tiny synthetic run: every PPFL update view is sealed and refused, and PPFL's
release is attacked as its observer would (with and without the last layer kept in the TEEs)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedveil.errors import ConfigError
from fedveil.experiments.attacks.runs import membership_run
from fedveil.experiments.fedavg_images import FedAvgRun, split_images
from fedveil.experiments.ppfl import attacks as ppfl_attacks
from fedveil.experiments.ppfl.attacks import ppfl_attack_table
from fedveil.experiments.ppfl.runner import train_ppfl
from fedveil.models.device import resolve_device

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

    from fedveil.experiments.attacks import runs as attack_runs

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


def test_e2e_rows_are_kept_attack_by_attack_and_dlg_target_by_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At VGG9 one DLG target takes half an hour: each target, the property attack and the membership
    attacks are parts of their own, and a rerun reads every finished one. DLG's summary over the kept
    targets is the one ``run_inversion`` gives over all of them; an earlier run's single ``e2e`` part is
    still read."""
    from fedveil.experiments.attacks import runs as attack_runs

    def score(auc: float) -> dict[str, float]:
        return {"auc": auc, "precision": 0.5}

    # the property and membership experiments have tests of their own; here they stand in, quickly
    monkeypatch.setattr(
        ppfl_attacks,
        "run_property",
        lambda **k: {"attacks": {"melis/target": score(0.9), "melis/control": score(0.5)}},
    )
    monkeypatch.setattr(
        ppfl_attacks,
        "run_membership",
        lambda **k: {
            "attacks": {f"{a}/{w}": score(0.6) for a in ("yeom", "nasr") for w in ("target", "control")}
        },
    )
    images = _images()
    small = {**TINY, "e2e": True, "dra_targets": 2}
    summary = ppfl_attack_table(images=images, out=tmp_path, **small)
    parts = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert parts == [
        "e2e-dra-0.json", "e2e-dra-1.json", "e2e-mia.json", "e2e-pia.json", "ppfl-kept.json",
        "ppfl-released.json",
    ]  # fmt: skip
    whole = attack_runs.run_inversion(
        "dlg", model=images.model, data=images.data, batch=1, targets=2, iterations=3, view="fedavg", seed=0
    )
    dra = summary["attacks"]["dra/e2e"]
    assert dra["targets"] == 2 and dra["mse"] == whole["mse"] and dra["recovered"] == whole["recovered"]
    for name in ("pia/e2e", "pia/e2e-control", "mia-yeom/e2e", "mia-nasr/e2e-control"):
        assert 0 <= summary["attacks"][name]["auc"] <= 1
    for name in ("run_inversion", "run_property", "run_membership", "train_ppfl"):
        monkeypatch.setattr(ppfl_attacks, name, lambda *a, **k: pytest.fail("a finished part ran again"))
    assert ppfl_attack_table(images=images, out=tmp_path, **small)["attacks"] == summary["attacks"]
    # the single E2E part of earlier runs
    for part in tmp_path.glob("parts/e2e-*.json"):
        part.unlink()
    saved = json.loads((tmp_path / "parts" / "ppfl-kept.json").read_text())
    e2e_rows = {k: v for k, v in summary["attacks"].items() if k.endswith(("/e2e", "/e2e-control"))}
    (tmp_path / "parts" / "e2e.json").write_text(
        json.dumps({"settings": saved["settings"], "rows": e2e_rows})
    )
    assert ppfl_attack_table(images=images, out=tmp_path, **small)["attacks"] == summary["attacks"]


def test_inversion_targets_one_at_a_time_are_the_whole_run_s() -> None:
    from fedveil.experiments.attacks.runs import run_inversion, summarize_targets

    kw = {"data": "synthetic-fashion-mnist:1500", "targets": 3, "iterations": 2, "seed": 4}
    whole = run_inversion("dlg", **kw)
    parts = [run_inversion("dlg", **kw, only=(i,))["per_target"][0] for i in (2, 0, 1)]
    by_target = sorted(parts, key=lambda r: r["target"])
    keys = ("target", "mse", "psnr", "ssim", "label_accuracy", "iterations")
    assert [{k: r[k] for k in keys} for r in by_target] == [
        {k: r[k] for k in keys} for r in whole["per_target"]
    ]
    assert summarize_targets(by_target)["mse"] == whole["mse"]
    with pytest.raises(ConfigError, match=r"only=\(3,\) must name targets among 0 \.\.\. 2"):
        run_inversion("dlg", **kw, only=(3,))


def test_a_ppfl_training_with_dropout_does_not_depend_on_what_ran_before_it() -> None:
    """VGG9 has dropout layers, which its PPFL stages train: their masks must come from the run's seed, not
    from whatever state torch's global generator was left in (Table 2's kept and released rows)."""
    images = _images(model="vgg9")
    cfg = ppfl_attacks.ppfl_like(images, classifier_pool="avg")
    split = split_images(images)
    released: list[list[np.ndarray]] = [[], []]
    for state, values in zip((1, 2), released, strict=True):
        torch.manual_seed(state)
        train_ppfl(
            ppfl_attacks._ppfl_run(images, cfg, 64),
            split,
            on_stage=lambda _r, v, _states, out=values: out.append(v.copy()),
        )
    assert len(released[0]) == len(released[1]) > 1
    for a, b in zip(*released, strict=True):
        np.testing.assert_array_equal(a, b)


def _tiny_command(monkeypatch: pytest.MonkeyPatch) -> list[FedAvgRun]:
    """``fedveil ppfl attacks`` at the tiny settings (the command's own defaults train for minutes): its
    member split and table, each run's ``images`` kept."""
    from fedveil.experiments.attacks import runs as attack_runs

    seen: list[FedAvgRun] = []
    table = ppfl_attacks.ppfl_attack_table

    def tiny_table(*, images: FedAvgRun, **kw: object) -> dict[str, object]:
        seen.append(images)
        return table(images=images, **{**kw, **TINY})

    monkeypatch.setattr(attack_runs, "membership_run", lambda **kw: _images(seed=kw["seed"]))
    monkeypatch.setattr(ppfl_attacks, "ppfl_attack_table", tiny_table)
    return seen


def test_device_cpu_and_the_default_give_the_same_numbers_and_share_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device`` reaches the table (default ``auto``, the CPU here); the report records the resolved
    device; ``cpu`` and ``auto`` resolve alike here, so their numbers are the same bits and a folder
    written by one resumes with the other."""
    from fedveil.cli import main

    seen = _tiny_command(monkeypatch)
    assert main(["ppfl", "attacks", "--json", "--out", str(tmp_path / "auto")]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(["ppfl", "attacks", "--device", "cpu", "--json", "--out", str(tmp_path / "cpu")]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert [images.device for images in seen] == ["auto", "cpu"]
    assert default == cpu and cpu["run"]["device"] == "cpu"
    assert json.loads((tmp_path / "cpu" / "device.json").read_text()) == {"device": "cpu"}
    monkeypatch.setattr(ppfl_attacks, "train_ppfl", lambda *a, **k: pytest.fail("a finished part ran again"))
    assert main(["ppfl", "attacks", "--device", "cpu", "--json", "--out", str(tmp_path / "auto")]) == 0
    assert json.loads(capsys.readouterr().out) == cpu


@pytest.mark.parametrize("action", ["attacks", "lira"])
def test_a_misspelt_device_fails_as_the_options_are_parsed(
    action: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedveil.cli import main
    from fedveil.experiments.attacks import runs as attack_runs

    monkeypatch.setattr(attack_runs, "membership_run", lambda **k: pytest.fail("the command started"))
    with pytest.raises(SystemExit) as exit_:
        main(["ppfl", action, "--device", "gpu:0"])
    assert exit_.value.code == 2
    assert "device: 'gpu:0' is not one of auto, cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["attacks", "lira"])
def test_a_gpu_this_machine_lacks_fails_before_the_output_folder_is_touched(
    action: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedveil.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["ppfl", action, "--device", "cuda:0", "--out", str(tmp_path / "out")]) == 2
    assert "device: 'cuda:0' asks for CUDA, but torch" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_device_reaches_every_training_and_attack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part is handed the run's resolved device: E2E's DLG, property and membership runs, PPFL's
    training (its REEs and client TEEs), the sealed views' DLG and property attacks, the observer's head,
    Nasr's features; Yeom's losses and the attacked models are on it. (A CUDA device is compared with the
    CPU in tests/test_gpu_ppfl_attacks.py.)"""
    from fedveil.attacks.scores import model_logits
    from fedveil.models.device import module_device

    calls: dict[str, list[object]] = {}

    def spy(name: str, real: object, pick: object) -> None:
        def wrapped(*a: object, **k: object) -> object:
            calls.setdefault(name, []).append(pick(*a, **k))
            return real(*a, **k)

        monkeypatch.setattr(ppfl_attacks, name, wrapped)

    # the E2E experiments have device tests of their own: here they stand in, quickly, saying what they got
    score = {"auc": 0.5, "precision": 0.5}
    row = {"mse": 0.5, "psnr": 3.0, "ssim": 0.1, "label_accuracy": 1.0, "iterations_per_second": 1.0}
    e2e = {
        "run_inversion": ({"per_target": [row]}, lambda *a, **k: k.get("device")),
        "run_property": (
            {"attacks": {"melis/target": score, "melis/control": score}},
            lambda **k: k.get("device"),
        ),
        "run_membership": (
            {"attacks": {f"{a}/{w}": score for a in ("yeom", "nasr") for w in ("target", "control")}},
            lambda **k: k["run"].device,
        ),
    }
    for name, (result, pick) in e2e.items():
        spy(name, lambda *a, result=result, **k: result, pick)
    spy("train_ppfl", ppfl_attacks.train_ppfl, lambda run, *a, **k: run.device)
    for name in ("dlg_attack", "melis_attack", "nasr_attack", "_attacker_head"):
        spy(name, getattr(ppfl_attacks, name), lambda *a, **k: str(k.get("device")))
    spy("per_example_loss", ppfl_attacks.per_example_loss, lambda model, x, y: str(module_device(model)))

    def yeom_logits(model: torch.nn.Module, x: torch.Tensor, **k: object) -> torch.Tensor:
        calls.setdefault("yeom", []).append(str(module_device(model)))
        return model_logits(model, x, **k)

    monkeypatch.setattr("fedveil.attacks.mia_yeom.model_logits", yeom_logits)
    summary = ppfl_attack_table(images=replace(_images(), device="cpu"), **{**TINY, "e2e": True})
    assert summary["run"]["device"] == "cpu"
    assert calls == {
        "run_inversion": ["cpu"],
        "run_property": ["cpu"],
        "run_membership": ["cpu"],
        "train_ppfl": ["cpu", "cpu"],
        "dlg_attack": ["cpu"],
        "melis_attack": ["cpu"],
        "_attacker_head": ["cpu"],
        "per_example_loss": ["cpu", "cpu"],
        "yeom": ["cpu"] * 4,
        "nasr_attack": ["cpu", "cpu"],
    }


def test_a_folder_of_parts_from_another_device_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts are never mixed across devices: ``device.json`` says where a folder's parts were computed,
    a folder of parts without it (written before the record) counts as the CPU's, and a run on another
    device is refused before anything trains."""
    from fedveil.experiments import checkpoint

    images = _images()
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "ppfl-kept.json").write_text("{}")
    monkeypatch.setattr(ppfl_attacks, "train_ppfl", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setattr(ppfl_attacks, "resolve_device", lambda spec: torch.device("cuda", 0))
    message = (
        rf"{tmp_path} holds parts computed on cpu, and this run is on cuda:0: "
        "resume it with --device cpu"
    )
    with pytest.raises(ConfigError, match=message):
        ppfl_attack_table(images=images, out=tmp_path, **TINY)
    assert not (tmp_path / checkpoint.DEVICE_RECORD).exists()
    (tmp_path / checkpoint.DEVICE_RECORD).write_text(json.dumps({"device": "cuda:1"}))
    with pytest.raises(ConfigError, match="computed on cuda:1, and this run is on cuda:0"):
        ppfl_attack_table(images=images, out=tmp_path, **TINY)
    fresh = tmp_path / "fresh"
    checkpoint.claim_device(fresh, torch.device("cuda", 0), artefacts=ppfl_attacks.PARTS)
    assert json.loads((fresh / checkpoint.DEVICE_RECORD).read_text()) == {"device": "cuda:0"}
    checkpoint.claim_device(fresh, torch.device("cuda", 0), artefacts=ppfl_attacks.PARTS)
    # ``cuda`` (and ``auto`` on a GPU machine) resolves to the GPU it is, so it resumes ``cuda:N``'s parts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for spec in ("cuda", "auto", "cuda:0"):
        checkpoint.claim_device(fresh, resolve_device(spec), artefacts=ppfl_attacks.PARTS)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"where": "cpu"}', "\udcff"])
def test_a_damaged_device_record_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    """A ``device.json`` that is not a device record (truncated, edited, not UTF-8) is a clear error that
    names it and says what to do, never a traceback."""
    from fedveil.experiments import checkpoint

    (tmp_path / checkpoint.DEVICE_RECORD).write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match=r"device\.json is not a device record"):
        checkpoint.claim_device(tmp_path, torch.device("cpu"), artefacts=ppfl_attacks.PARTS)
