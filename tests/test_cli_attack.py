"""``fedveil attack ...`` end to end on small settings: DLG prints mse/psnr/ssim and writes its PNG;
membership and property inference print reports for a target and its control; ``--device`` is checked as
it is parsed, reaches every runner resolved, and on the CPU changes no number (CUDA beside the CPU:
tests/test_gpu_attacks.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from fedveil.cli import build_parser, main
from fedveil.experiments.attacks import fdml_inversion, fdml_lira, fdml_views, feduv_codeword
from fedveil.experiments.attacks import runs as attack_runs
from fedveil.experiments.attacks.runs import last_layer
from fedveil.models.device import module_device
from fedveil.models.zoo import build_model


def test_dlg_json_on_fashion_mnist(tmp_path: Path, capsys) -> None:
    code = main(
        [
            "attack",
            "dlg",
            "--model",
            "lenet-sigmoid",
            "--data",
            "fashion-mnist",
            "--batch",
            "1",
            "--targets",
            "1",
            "--seed",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("mse", "psnr", "ssim", "label_accuracy"):
        assert key in report
    assert report["mse"] < 0.01 and report["label_accuracy"] == 1.0
    png = tmp_path / "attack_dlg_batch1.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "attack_dlg_batch1.json").read_text())["targets"] == 1


def test_idlg_through_a_fedavg_round_on_the_wire(capsys) -> None:
    assert main(["attack", "idlg", "--targets", "1", "--view", "fedavg", "--iterations", "50"]) == 0
    out = capsys.readouterr().out
    assert "idlg batch 1, 1 targets, view fedavg" in out and "labels 1.00" in out


@pytest.mark.usefixtures("small_fashion_mnist")  # 1,200 + 200 images of fashion-mnist, not 70,000
def test_membership_and_property_reports(tmp_path: Path, capsys) -> None:
    small = ["--model", "lenet-sigmoid", "--clients", "3", "--samples-per-client", "10", "--rounds", "2"]
    assert main(["attack", "mia", *small, "--local-epochs", "1", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["attacks"]) == {"yeom/target", "yeom/control", "nasr/target", "nasr/control"}
    assert 0.0 <= report["attacks"]["yeom/target"]["auc"] <= 1.0
    assert (tmp_path / "attack_membership_roc.png").is_file()
    assert main(["attack", "pia", *small, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["attacks"]) == {"melis/target", "melis/control"}
    assert report["run"]["views"] == 6


def test_bad_attack_input(capsys) -> None:
    assert main(["attack", "dlg", "--data", "imagenet", "--targets", "1"]) == 2
    assert "not one of fashion-mnist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["attack", "dlg", "--view", "sealed"])


def test_bench_fedavg_and_dlg_report_rates(capsys) -> None:
    small = ["--model", "lenet-sigmoid", "--clients", "2", "--samples", "20", "--repeats", "1", "--json"]
    assert main(["bench", "fedavg", *small]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["batched_updates_per_second"] > 0 and row["one_by_one_updates_per_second"] > 0
    assert row["speedup"] == pytest.approx(
        row["batched_updates_per_second"] / row["one_by_one_updates_per_second"]
    )
    assert main(["bench", "dlg", "--iterations", "2", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iterations_per_second_median"] > 0
    assert main(["bench", "fedavg", "--clients", "0"]) == 2


def test_dlg_against_the_private_projector(tmp_path: Path, capsys) -> None:
    """AIoT Sec. 5.5: the observer sees every layer's gradient but the last (the private projector); the
    attacker optimises a projector jointly with the dummy, from a random guess or (upper bound) the truth.
    How often it still recovers the image is measured in docs/results.md, not asserted here."""
    net = build_model("lenet-sigmoid", num_classes=10, in_channels=1, image_size=28, seed=0)
    assert last_layer(net) == ["units.3.1.weight", "units.3.1.bias"]
    common = ["--targets", "1", "--iterations", "20", "--out", str(tmp_path), "--json"]
    for defence in ("projector", "projector-upper-bound"):
        assert main(["attack", "dlg", *common, "--defence", defence]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["defence"] == defence and report["per_target"][0]["iterations"] == 20
        assert report["mse"] >= 0 and 0 <= report["label_accuracy"] <= 1
        assert (tmp_path / f"attack_dlg_batch1_{defence}.png").is_file()
    assert main(["attack", "dlg", "--view", "fedavg", "--defence", "projector", "--targets", "1"]) == 2
    assert "gradient view" in capsys.readouterr().err


DEVICE_ATTACKS = (
    "dlg",
    "idlg",
    "ig",
    "mia",
    "lira",
    "pia",
    "feduv-codeword",
    "fdml-membership",
    "fdml-lira",
    "fdml-inversion",
)
"""Every ``fedveil attack`` that trains, attacks or scores a torch model: each takes ``--device``."""

SMALL_FEDAVG = ["--model", "lenet-sigmoid", "--clients", "3", "--samples-per-client", "10", "--rounds", "2"]


@pytest.mark.parametrize("attack", DEVICE_ATTACKS)
def test_a_misspelt_device_fails_as_the_options_are_parsed(attack: str, capsys) -> None:
    assert build_parser().parse_args(["attack", attack]).device == "auto"
    with pytest.raises(SystemExit) as exit_:
        main(["attack", attack, "--device", "gpu:0"])
    assert exit_.value.code == 2
    assert "device: 'gpu:0' is not one of auto, cpu, cuda or cuda:N" in capsys.readouterr().err


def test_fdml_derivatives_has_no_device(capsys) -> None:
    """It plays the enclave's numpy code on synthetic embeddings: nothing of it runs on a device."""
    with pytest.raises(SystemExit) as exit_:
        main(["attack", "fdml-derivatives", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --device cpu" in capsys.readouterr().err


def _numbers(report: Any) -> Any:
    """``report`` without its wall-clock timings (the only entries two identical runs may differ in)."""
    if isinstance(report, dict):
        timed = ("seconds", "iterations_per_second")
        return {k: _numbers(v) for k, v in report.items() if k not in timed}
    if isinstance(report, list):
        return [_numbers(v) for v in report]
    return report


@pytest.mark.usefixtures("small_fashion_mnist")
@pytest.mark.parametrize(
    "argv",
    [
        ["dlg", "--targets", "1", "--iterations", "5"],
        ["lira", *SMALL_FEDAVG, "--local-epochs", "1", "--shadows", "4", "--shadow-epochs", "1"],
        ["pia", *SMALL_FEDAVG],
        ["fdml-membership", "--users", "8", "--rounds", "2", "--num-required", "16"],
        ["fdml-inversion", "--cohorts", "2", "--iterations", "5"],
    ],
    ids=lambda argv: argv[0],
)
def test_device_cpu_and_the_default_report_the_same_numbers(argv: list[str], capsys) -> None:
    """``auto`` (the default) is the CPU here: both spellings compute the same bits, and the report says
    where it ran."""
    reports = []
    for device in ([], ["--device", "cpu"]):
        assert main(["attack", *argv, *device, "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    default, cpu = reports
    assert (cpu.get("run") or cpu)["device"] == (default.get("run") or default)["device"] == "cpu"
    assert _numbers(default) == _numbers(cpu)


def _resolve_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every attack runner's resolver answering the CPU (this machine has no GPU), whatever it is asked:
    the spellings it was asked for."""
    asked: list[str] = []

    def resolve(spec: str = "auto") -> torch.device:
        asked.append(str(spec))
        return torch.device("cpu")

    for module in (attack_runs, fdml_views, fdml_lira, fdml_inversion, feduv_codeword):
        monkeypatch.setattr(module, "resolve_device", resolve)
    return asked


def _spy(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType | dict, name: str, pick: Callable[..., Any]
) -> list[Any]:
    """Wrap ``module.name`` (or ``module[name]``): record ``pick(*args, **kwargs)`` of each call."""
    seen: list[Any] = []
    real = module[name] if isinstance(module, dict) else getattr(module, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        seen.append(pick(*a, **k))
        return real(*a, **k)

    if isinstance(module, dict):
        monkeypatch.setitem(module, name, wrapped)
    else:
        monkeypatch.setattr(module, name, wrapped)
    return seen


def _device(k: dict[str, Any]) -> str:
    return str(k.get("device", "not given"))


@pytest.mark.usefixtures("small_fashion_mnist")
def test_the_device_reaches_the_inversion_attacks(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The resolved device reaches the attack's matching, the client model it observes (and the FedAvg
    client of the wire view)."""
    asked = _resolve_on_the_cpu(monkeypatch)
    attacks = {
        name: _spy(
            monkeypatch,
            attack_runs.INVERSIONS,
            name,
            lambda view, **k: (_device(k), str(module_device(view.model))),
        )
        for name in ("dlg", "idlg")
    }
    clients = _spy(monkeypatch, attack_runs, "ModelClients", lambda *a, **k: _device(k))
    assert main(["attack", "dlg", "--targets", "1", "--iterations", "2", "--device", "cuda:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"
    argv = ["attack", "idlg", "--targets", "1", "--iterations", "2", "--view", "fedavg", "--device", "cuda"]
    assert main(argv) == 0
    assert asked == ["cuda:1", "cuda"]
    assert attacks == {"dlg": [("cpu", "cpu")], "idlg": [("cpu", "cpu")]}
    assert clients == ["cpu"]


@pytest.mark.usefixtures("small_fashion_mnist")
def test_the_device_reaches_fedavg_the_shadows_and_the_membership_attacks(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """FedAvg's clients (the run's device, resolved), LiRA's shadow training, Nasr's features; Yeom's
    losses and LiRA's statistics are taken where the released models are."""
    asked = _resolve_on_the_cpu(monkeypatch)
    trained = _spy(monkeypatch, attack_runs, "train_fedavg", lambda run, **k: run.device)
    shadows = _spy(monkeypatch, attack_runs, "_central_train_fn", lambda run, e, c, device: str(device))
    nasr = _spy(monkeypatch, attack_runs, "nasr_attack", lambda *a, **k: _device(k))
    released = _spy(monkeypatch, attack_runs, "ModelView", lambda what, model: str(module_device(model)))
    common = [*SMALL_FEDAVG, "--local-epochs", "1", "--json"]
    lira = ["--shadows", "4", "--shadow-epochs", "1"]
    assert main(["attack", "lira", *common, *lira, "--device", "cuda:1"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    assert main(["attack", "mia", *common, "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    assert asked == ["cuda:1", "cuda"]
    assert trained == ["cpu"] * 4 and shadows == ["cpu"] * 2 and nasr == ["cpu"] * 2
    assert released and set(released) == {"cpu"}


@pytest.mark.usefixtures("small_fashion_mnist")
def test_the_device_reaches_the_property_attack(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    asked = _resolve_on_the_cpu(monkeypatch)
    clients = _spy(monkeypatch, attack_runs, "ModelClients", lambda *a, **k: _device(k))
    melis = _spy(monkeypatch, attack_runs, "melis_attack", lambda *a, **k: _device(k))
    assert main(["attack", "pia", *SMALL_FEDAVG, "--device", "cuda:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    assert asked == ["cuda:1"] and clients == ["cpu"] * 2 and melis == ["cpu"] * 2


def test_the_device_reaches_fdml_its_shadows_and_the_matching(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """FDML trains through the run's device setting (the resolved device, not ``auto``), fdml-lira's
    shadow networks and every network the attacks embed with are there, and fdml-inversion matches there."""
    asked = _resolve_on_the_cpu(monkeypatch)
    membership = _spy(monkeypatch, fdml_views, "train_fdml", lambda cfg, *a, **k: cfg.device)
    lira = _spy(monkeypatch, fdml_lira, "train_fdml", lambda cfg, *a, **k: cfg.device)
    shadows = _spy(
        monkeypatch, fdml_lira, "train_triplet_steps", lambda net, *a, **k: str(module_device(net))
    )
    matching = _spy(monkeypatch, fdml_inversion, "invert_model_difference", lambda *a, **k: _device(k))
    argv = ["fdml-membership", "--users", "8", "--rounds", "2", "--num-required", "16", "--device", "cuda:1"]
    assert main(["attack", *argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    argv = ["fdml-lira", "--users", "8", "--shadows", "4", "--rounds", "2", "--devices", "4"]
    assert main(["attack", *argv, "--device", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    argv = ["fdml-inversion", "--cohorts", "2", "--iterations", "2", "--device", "cuda:2", "--json"]
    assert main(["attack", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    assert asked == ["cuda:1", "cuda", "cuda:2", *["cpu"] * 4]  # the matching resolves what it is handed
    assert membership == ["cpu"] and lira == ["cpu", "cpu"] and shadows == ["cpu"] * 4
    assert matching == ["cpu"] * 4  # SGD and Adam: the attack and its control each


def test_the_device_reaches_feduv_s_users(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    asked = _resolve_on_the_cpu(monkeypatch)
    users = _spy(monkeypatch, feduv_codeword, "UvClients", lambda *a, **k: _device(k))
    argv = ["feduv-codeword", "--methods", "feduv", "--writers", "5", "--rounds", "2", "--fraction", "0.6"]
    assert main(["attack", *argv, "--device", "cuda:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["device"] == "cpu"
    assert asked == ["cuda:1"] and users == ["cpu"]
