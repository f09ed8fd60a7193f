"""``fedveil ppfl run CONFIG`` end to end through the CLI on a tiny config, and ``fedveil ppfl memory``;
config errors name the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.ppfl.runner import load_ppfl_run

TINY = """
name: tiny
data: synthetic-fashion-mnist:600
model: lenet
clients: 3
samples_per_client: 24
test_samples: 60
tee_mib: [64]
threads: 1
ppfl:
  rounds_per_stage: 2
  local_epochs: 1
  batch_size: 8
  lr: 0.05
"""


def test_ppfl_run_writes_a_run_directory(tmp_path: Path, capsys) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "run"
    assert main(["ppfl", "run", str(config), "--out", str(out), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["synthetic_data"] is True
    assert [s["rounds"] for s in results["stages"]] == [2, 2, 2]
    assert results["rounds"] == 6 and results["bytes_up"] > 0
    assert 0 <= results["final_accuracy"] <= 1 and 0 <= results["e2e_accuracy"] <= 1
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["stage"] for line in lines] == [0, 0, 1, 1, 2, 2]
    assert all("accuracy" in line for line in lines)
    assert len((out / "e2e.jsonl").read_text().splitlines()) == 6
    memory = json.loads((out / "memory.json").read_text())
    assert [m["eligible"] for m in memory] == [3, 3, 3]
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SYNTHETIC" in json.loads((out / "config.json").read_text())["data_source"]


def test_ppfl_memory_table(capsys) -> None:
    assert main(["ppfl", "memory", "--model", "alexnet", "--data", "cifar10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["units"] for r in rows] == [[0], [1], [2], [3]]
    assert all(0.7 <= r["measured"] / r["total"] <= 1.25 for r in rows[:3])  # the conv stages
    assert abs(rows[3]["measured"] - rows[3]["total"]) <= 64 * 2**10  # one FC layer: fixed temporaries
    # VGG9's first stage: a classifier on the unpooled map, or pooled to the last conv layer's input size
    first = {}
    for pool in ("none", "avg"):
        argv = ["ppfl", "memory", "--model", "vgg9", "--classifier-pool", pool, "--json"]
        assert main(argv) == 0
        first[pool] = json.loads(capsys.readouterr().out)[0]
    assert first["avg"]["parameters"] * 5 < first["none"]["parameters"]
    assert 0.7 <= first["avg"]["measured"] / first["avg"]["total"] <= 1.25


def test_a_run_with_darknet_initialisation_starts_each_stage_in_the_enclave_that_way(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.protocols import ppfl

    drawn: list[str] = []
    real = ppfl.param_specs
    monkeypatch.setattr(ppfl, "param_specs", lambda net, init="torch": drawn.append(init) or real(net, init))
    config = tmp_path / "darknet.yaml"
    config.write_text(TINY + "model_init: darknet\n")
    assert main(["ppfl", "run", str(config), "--out", str(tmp_path / "run"), "--json", "--no-e2e"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 6
    assert drawn == ["darknet"] * 3


def test_config_errors_name_the_setting(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY + "colour: red\n")
    with pytest.raises(ConfigError, match=r"colour: unknown key; allowed keys here are: name, data"):
        load_ppfl_run(bad)
    bad.write_text(TINY.replace("lr: 0.05", "lr: 0.05\n  block: 2"))
    with pytest.raises(ConfigError, match=r"ppfl\.block: unknown key; allowed keys here are: rounds_per"):
        load_ppfl_run(bad)
    bad.write_text(TINY.replace("lr: 0.05", "lr: 0.05\n  classifier_pool: median"))
    with pytest.raises(ConfigError, match="classifier_pool 'median' is not one of none, avg, max"):
        load_ppfl_run(bad)
    bad.write_text(TINY.replace("tee_mib: [64]", "tee_mib: [0]"))
    with pytest.raises(ConfigError, match="tee_mib"):
        load_ppfl_run(bad)
    bad.write_text(TINY + "model_init: he\n")
    with pytest.raises(ConfigError, match="model_init 'he' is not one of torch, darknet"):
        load_ppfl_run(bad)
    bad.write_text(TINY.replace("lr: 0.05", "lr: 0.05\n  block_size: 3"))
    assert main(["ppfl", "run", str(bad), "--out", str(tmp_path / "x"), "--json", "--no-e2e"]) != 0
    assert "block size 3 must be an integer from 1 to the 2" in capsys.readouterr().err


def test_table_3_measure_rounds_to_reach_e2e(tmp_path: Path, capsys) -> None:
    """reach_e2e_rounds: E2E trains first; PPFL stops at the first evaluation reaching its accuracy."""
    config = tmp_path / "reach.yaml"
    config.write_text(TINY.replace("rounds_per_stage: 2", "rounds_per_stage: 6") + "reach_e2e_rounds: 2\n")
    assert main(["ppfl", "run", str(config), "--out", str(tmp_path / "run"), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["e2e_rounds"] == 2 and results["target_accuracy"] == results["e2e_accuracy"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    hits = [i for i, line in enumerate(lines) if line["accuracy"] >= results["target_accuracy"]]
    if results["reached"]:
        assert results["rounds_to_reach"] == len(lines) == hits[0] + 1
        assert results["bytes_to_reach"] == results["bytes_up"] + results["bytes_down"]
    else:
        assert not hits and results["rounds_to_reach"] is None and len(lines) == 12


def test_ppfl_transfer_sweep_resumes_and_draws_fig_8(tmp_path: Path, capsys) -> None:
    """Appendix A.1: one run per (public fraction, last units), E2E once; a second call trains nothing."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.replace("name: tiny", "name: tiny_transfer\npublic_epochs: 1"))
    out = tmp_path / "sweep"
    argv = ["ppfl", "transfer", str(config), "--fractions", "0.5", "1", "--last", "1", "4", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [(r["fraction"], r["train_last"]) for r in summary["runs"]] == [
        (0.5, 1),
        (0.5, 4),
        (1.0, 1),
        (1.0, 4),
    ]
    assert [r["public_samples"] for r in summary["runs"]] == [36, 36, 72, 72]
    assert all(0 <= r["final_accuracy"] <= 1 and r["rounds"] == 2 for r in summary["runs"])
    # training all four units needs more TEE than training the last one
    assert summary["runs"][1]["tee_bytes_needed"] > summary["runs"][0]["tee_bytes_needed"]
    assert (out / "transfer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["device"] == "cpu" and json.loads((out / "device.json").read_text()) == {"device": "cpu"}
    stamp = (out / "f0.5_last1" / "results.json").stat().st_mtime_ns
    assert main(argv) == 0
    assert "done before" in capsys.readouterr().out
    assert (out / "f0.5_last1" / "results.json").stat().st_mtime_ns == stamp


def test_ppfl_transfer_trains_its_public_model_on_the_config_s_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's public model trains where the config's ``device`` says (the clients' PPFL and E2E
    trainings already do); a sweep folder computed on another device is refused before anything trains."""
    from fedveil.experiments.fedavg_images import split_images
    from fedveil.experiments.ppfl import runner
    from fedveil.experiments.ppfl.transfer import run_transfer_sweep

    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.replace("name: tiny", "name: tiny_transfer\npublic_epochs: 1"))
    run = load_ppfl_run(config, {"public_fraction": 0.5, "ppfl": {"train_last": 1}, "device": "cpu"})
    asked: list[object] = []
    real = runner.train_central

    def central(*a: object, device: object, **k: object) -> object:
        asked.append(device)
        return real(*a, device=device, **k)

    monkeypatch.setattr(runner, "train_central", central)
    split = split_images(run.images())
    public, info = runner._public_model(run, split, runner._model(run, 10, 1, 28))
    assert asked == ["cpu"] and info["samples"] == 36
    assert all(p.device.type == "cpu" for p in public.parameters())  # back on the host, for the enclave
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "device.json").write_text(json.dumps({"device": "cuda:0"}))
    monkeypatch.setattr("fedveil.experiments.ppfl.transfer.run_ppfl", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(ConfigError, match="holds parts computed on cuda:0, and this run is on cpu"):
        run_transfer_sweep(run, out, [0.5], [1])


def test_ppfl_transfer_from_a_safetensors_file(tmp_path: Path) -> None:
    """Sec. 4.3 with a model pre-trained elsewhere: its weights come from safetensors (never pickle); a
    file of another architecture is refused before training, naming the tensor."""
    from fedveil.experiments.ppfl.runner import run_ppfl
    from fedveil.models.weights import save_weights
    from fedveil.models.zoo import build_model

    config = tmp_path / "tiny.yaml"
    config.write_text(TINY + "  train_last: 2\n")
    weights = tmp_path / "lenet.safetensors"
    save_weights(build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=5), weights)
    run = load_ppfl_run(config, {"pretrained": str(weights), "e2e": False})
    results = run_ppfl(run, tmp_path / "run", show_bar=False)
    assert results["train_last"] == 2 and results["public"]["pretrained"] == str(weights)
    assert [s["units"] for s in results["stages"]] == [[2, 3]]
    wrong = tmp_path / "cifar.safetensors"
    save_weights(build_model("lenet", num_classes=10, in_channels=3, image_size=32), wrong)
    with pytest.raises(ConfigError, match=r"tensor units.0.0.weight has shape \(20, 3, 5, 5\)"):
        run_ppfl(load_ppfl_run(config, {"pretrained": str(wrong)}), tmp_path / "bad", show_bar=False)
    plain = tmp_path / "plain.yaml"
    plain.write_text(TINY)
    with pytest.raises(ConfigError, match=r"needs both ppfl\.train_last"):
        load_ppfl_run(plain, {"public_fraction": 0.5})


def test_ppfl_cost_measures_each_stage_with_and_without_the_tee(tmp_path: Path, capsys) -> None:
    """Fig. 3: per stage a plain and a TEE measurement (fresh processes), and E2E; all positive."""
    plot = tmp_path / "cost.png"
    argv = ["ppfl", "cost", "--model", "lenet", "--repeats", "1", "--plot", str(plot), "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["stage"]) for r in rows] == [
        ("plain", 0),
        ("tee", 0),
        ("plain", 1),
        ("tee", 1),
        ("plain", 2),
        ("tee", 2),
        ("e2e", None),
    ]
    assert all(r["cpu_seconds"] > 0 and r["max_rss_bytes"] > 0 and r["rss_increase_bytes"] >= 0 for r in rows)
    assert rows[-1]["units"] == [0, 1, 2, 3]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_ppfl_times_each_stage(capsys) -> None:
    small = ["--clients", "2", "--samples", "8", "--epochs", "1", "--repeats", "1", "--json"]
    assert main(["bench", "ppfl", *small]) == 0
    row = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in row["stages"]] == [0, 1, 2]
    for s in row["stages"]:
        assert s["batched_updates_per_second"] > 0 and s["one_by_one_updates_per_second"] > 0
        assert 0 < s["sealing_share"] < 1 and s["devices_open_and_seal_seconds"] > 0
        assert s["sealed_bytes_per_round"] == 2 * 2 * 4 * s["num_params"]
    assert main(["bench", "ppfl", "--clients", "0"]) == 2


class MachineDown(RuntimeError):
    """A crash the test stages."""


def test_an_interrupted_run_resumes_after_its_last_finished_stage(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A crash in stage 1 leaves a checkpoint of stage 0; --resume releases stage 0's checkpointed values
    to the devices again and trains stages 1 and 2 only; the finished run's checkpoint is removed."""
    import numpy as np

    from fedveil.experiments.checkpoint import load_checkpoint
    from fedveil.experiments.ppfl import runner as ppfl_runner
    from fedveil.protocols.ppfl import PpflServer

    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "run"
    original = PpflServer._train_stage

    async def crash_in_stage_1(self, comm, stage, *args, **kwargs):  # type: ignore[no-untyped-def]
        if stage.index == 1:
            raise MachineDown("the machine went down")
        return await original(self, comm, stage, *args, **kwargs)

    monkeypatch.setattr(PpflServer, "_train_stage", crash_in_stage_1)
    with pytest.raises(MachineDown):
        main(["ppfl", "run", str(config), "--out", str(out), "--json", "--no-e2e"])
    ckpt = load_checkpoint(out)
    assert ckpt is not None and ckpt.round == 2 and list(ckpt.arrays) == ["released_0"]
    released = ckpt.arrays["released_0"]
    monkeypatch.setattr(PpflServer, "_train_stage", original)
    trained_stages: list[int] = []
    real_train = ppfl_runner.train_ppfl

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real_train(*args, **kwargs)
        trained_stages.extend(line["stage"] for r in result.server.reports[1:] for line in r.rounds)
        frozen = result.pool.frozen[result.pool.client_ids()[0]][0]
        np.testing.assert_array_equal(
            np.concatenate([p.detach().numpy().ravel() for p in frozen.parameters()]), released
        )
        return result

    monkeypatch.setattr(ppfl_runner, "train_ppfl", spy)
    capsys.readouterr()
    assert main(["ppfl", "run", str(config), "--out", str(out), "--json", "--no-e2e", "--resume"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [s["rounds"] for s in results["stages"]] == [2, 2, 2] and results["rounds"] == 6
    assert trained_stages == [1, 1, 2, 2]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert load_checkpoint(out) is None
    # resuming a finished run returns its results; another config is refused
    assert main(["ppfl", "run", str(config), "--out", str(out), "--json", "--no-e2e", "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 6
    assert main(["ppfl", "run", str(config), "--out", str(out), "--json", "--no-e2e"]) == 2, "used: refused"
    with pytest.raises(MachineDown):
        monkeypatch.setattr(PpflServer, "_train_stage", crash_in_stage_1)
        main(["ppfl", "run", str(config), "--out", str(out), "--json", "--no-e2e", "--overwrite"])
    assert main(["ppfl", "run", str(config), "--out", str(out), "--seed", "3", "--resume", "--no-e2e"]) == 2


def test_ppfl_transfer_device_flag_wins_over_the_configs_and_a_misspelt_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedveil ppfl transfer CONFIG --device D`` is the config's ``device: D``; without it the config
    decides; a misspelt device fails as the options are parsed, before the sweep."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.replace("name: tiny", "name: tiny_transfer\ndevice: cpu"))
    asked: list[str] = []

    def sweep(cfg: object, out: Path, *a: object, **k: object) -> dict[str, object]:
        asked.append(cfg.device)  # type: ignore[attr-defined]
        return {"e2e_accuracy": 0.5, "runs": []}

    monkeypatch.setattr("fedveil.experiments.ppfl.transfer.run_transfer_sweep", sweep)
    out = ["--out", str(tmp_path / "sweep"), "--json"]
    assert main(["ppfl", "transfer", str(config), *out]) == 0
    assert main(["ppfl", "transfer", str(config), "--device", "auto", *out]) == 0
    assert asked == ["cpu", "auto"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["ppfl", "transfer", str(config), "--device", "gpu0", *out])
    assert exc.value.code == 2 and "'gpu0'" in capsys.readouterr().err and asked == ["cpu", "auto"]
