"""Table 3 runner (MNIST-UV): a tiny end-to-end run, its files, the shape checks, the CLI and the bench."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedveil import cli
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import load_checkpoint
from fedveil.experiments.feduv import runner as feduv_runner
from fedveil.experiments.feduv.runner import (
    PAPER_TABLE3_MNIST_UV,
    SCALES,
    FeduvRunConfig,
    bench_client_updates,
    load_feduv_config,
    mnist_uv_net,
    parse_int_list,
    parse_methods,
    run_feduv,
    shape_checks,
    with_overrides,
)
from fedveil.protocols.feduv import UvModel, UvServer, UvTrainConfig

TINY = FeduvRunConfig(
    name="tiny",
    writers=5,
    unseen_writers=3,
    train_examples=4,
    val_examples=3,
    test_examples=2,
    width_divisor=32,
    rounds=2,
    train=UvTrainConfig(fraction=0.4),
    code_lengths=(127,),
    bins=200,
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple:
    lines: list[str] = []
    out = tmp_path_factory.mktemp("tiny") / "run"
    return run_feduv(TINY, out, progress=lines.append), out, lines


def test_a_tiny_run_writes_results_beside_the_paper_numbers(tiny_run, tmp_path) -> None:
    results, run_dir, lines = tiny_run
    (tmp_path / "run").symlink_to(run_dir)
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert files == {
        "config.json",
        "device.json",
        "loss.png",
        "metrics.jsonl",
        "methods",
        "results.json",
        "roc.png",
    }
    assert json.loads((tmp_path / "run" / "device.json").read_text()) == {"device": "cpu"}
    saved = {p.name for p in (tmp_path / "run" / "methods").iterdir()}
    assert saved == {f"{m}{ext}" for m in ("softmax", "fedaws", "feduv-127") for ext in (".json", ".roc.npz")}
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == json.loads(json.dumps(results))
    assert set(results["methods"]) == {"softmax", "fedaws", "feduv-127"}
    for kind in ("train", "test_known", "test_unknown"):
        for label, row in results["methods"].items():
            ev = row["eval"][kind]
            assert 0.0 <= ev["auc"] <= 1.0 and ev["users"] == 5
            assert {"tpr@fpr=0.1", "tpr@fpr=0.01", "tpr@fpr=0.001", "warmup_tpr"} <= set(ev)
            assert results["paper_auc"][kind][label] == PAPER_TABLE3_MNIST_UV[kind][label]
    assert results["methods"]["feduv-127"]["eval"]["test_unknown"]["impostor"] == 5 * 3
    assert results["methods"]["softmax"]["eval"]["test_known"]["impostor"] == 5 * 4 * 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("round" in r for r in records) == 3 * 2 and sum("eval" in r for r in records) == 3 * 3
    assert len(lines) == 4 and lines[-1].startswith("feduv-127:")
    assert set(results["shape"]) == {"train", "test_known", "test_unknown", "tolerance"}
    assert all(
        row["loss_last_tenth"] > 0 and row["loss_first_round"] > 0 for row in results["methods"].values()
    )


def test_worker_processes_give_the_same_numbers(tiny_run, tmp_path) -> None:
    ticks: list[str] = []
    parallel = run_feduv(
        with_overrides(TINY, workers=2, methods=("feduv", "softmax")), tmp_path / "par", progress=ticks.append
    )
    for kind, row in parallel["auc"].items():
        assert row == {label: tiny_run[0]["auc"][kind][label] for label in ("feduv-127", "softmax")}
    assert sorted(line.split(":")[0] for line in ticks[1:]) == ["feduv-127", "softmax"]


def test_a_run_directory_resumes_and_refuses_other_settings(tiny_run, tmp_path) -> None:
    results = tiny_run[0]
    out = tmp_path / "resume"
    cfg = with_overrides(TINY, methods=("softmax", "feduv"))
    first = run_feduv(cfg, out)
    (out / "methods" / "feduv-127.json").unlink()
    with pytest.raises(ConfigError, match=r"--resume.*--overwrite"):
        run_feduv(cfg, out)  # a used directory is continued or cleared, never silently mixed
    lines: list[str] = []
    again = run_feduv(with_overrides(cfg, workers=2), out, progress=lines.append, resume=True)
    assert lines[1] == f"softmax: already in {out / 'methods'}, reused" and lines[2].startswith("feduv-127:")
    assert again["auc"] == first["auc"]
    assert again["methods"]["softmax"] == first["methods"]["softmax"]
    assert first["methods"]["softmax"]["eval"] == results["methods"]["softmax"]["eval"]
    records = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["method"] for r in records][:2] == ["softmax", "softmax"]
    with pytest.raises(ConfigError, match=r"other settings \(rounds\)"):
        run_feduv(with_overrides(cfg, rounds=3), out, resume=True)
    (out / "methods" / "softmax.roc.npz").write_bytes(b"not an npz")
    with pytest.raises(ConfigError, match=r"saved outcome of 'softmax'.*delete softmax\.json"):
        run_feduv(cfg, out, resume=True)


def test_shape_checks_follow_section_6_3() -> None:
    paper = shape_checks(PAPER_TABLE3_MNIST_UV)
    assert paper["train"] == {
        "auc_grows_with_code_length": True,
        "feduv_within_tolerance_of_fedaws": True,
        "softmax_best": False,
    }
    flipped = shape_checks({"train": {"softmax": 0.9, "feduv-127": 0.95, "feduv-255": 0.93}})
    assert flipped["train"] == {
        "auc_grows_with_code_length": False,
        "feduv_within_tolerance_of_fedaws": None,
        "softmax_best": False,
    }


def test_the_paper_scale_net_is_table_2_and_the_small_one_keeps_its_shape() -> None:
    exact = UvModel(mnist_uv_net(127))
    assert exact.num_params == 6_275_136 + 1025 * 127
    small = mnist_uv_net(127, width_divisor=8, bias=False)
    assert small(torch.zeros(2, 4, 28, 28)).shape == (2, 127)
    assert UvModel(small).embedding_dim == 1024 and not UvModel(small).has_bias
    assert [m.out_channels for m in small.features if isinstance(m, torch.nn.Conv2d)] == [8, 16, 32, 64, 1024]
    narrow = UvModel(mnist_uv_net(127, width_divisor=8, narrow_head=True))
    assert narrow.embedding_dim == 128
    with pytest.raises(ConfigError, match="width_divisor 3"):
        mnist_uv_net(10, width_divisor=3)


def test_scales_and_overrides() -> None:
    assert SCALES["paper"].writers == 1000 and SCALES["paper"].rounds == 20_000
    assert SCALES["paper"].train.fraction == 0.01 and SCALES["paper"].width_divisor == 1
    cfg = with_overrides(SCALES["small"], rounds=7, fraction=0.5, methods=None)
    assert cfg.rounds == 7 and cfg.train.fraction == 0.5 and cfg.methods == SCALES["small"].methods
    assert [r[0] for r in cfg.runs()] == ["softmax", "fedaws", "feduv-127", "feduv-255", "feduv-511"]
    assert parse_int_list("127, 255", "code lengths") == (127, 255)
    assert parse_methods("feduv,softmax") == ("feduv", "softmax")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"methods": ("feduv", "arcface")}, "arcface"),
        ({"code_lengths": ()}, "code length"),
        ({"rounds": 0}, "rounds 0"),
        ({"q": 1.0}, "q=1.0"),
    ],
)
def test_bad_run_settings_fail_naming_the_value(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        with_overrides(TINY, **change)


def test_bad_cli_lists_fail_naming_the_value() -> None:
    with pytest.raises(ConfigError, match="'12x'"):
        parse_int_list("12x", "code lengths")
    with pytest.raises(ConfigError, match="'fedprox'"):
        parse_methods("fedprox")


def test_cli_run_prints_results_json(tmp_path, capsys) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "writers: 4\nunseen_writers: 2\nrounds: 3\nwidth_divisor: 32\ntrain:\n  fraction: 0.5\n"
    )
    args = ["feduv", "run", "--config", str(config), "--methods", "feduv", "--code-lengths", "127"]
    args += ["--train-examples", "3", "--rounds", "1", "--out", str(tmp_path / "cli"), "--json"]
    assert cli.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["methods"]) == {"feduv-127"} and (tmp_path / "cli" / "roc.png").exists()
    written = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (written["writers"], written["rounds"], written["train_examples"]) == (4, 1, 3)
    assert written["train"]["fraction"] == 0.5 and written["train"]["lr"] == 0.1


def test_shipped_configs_are_the_presets(tmp_path) -> None:
    configs = Path(__file__).resolve().parents[1] / "configs"
    assert load_feduv_config(configs / "feduv" / "table3_small.yaml") == SCALES["small"]
    assert load_feduv_config(configs / "feduv" / "table3_paper.yaml") == SCALES["paper"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("writers: 4\ntrain:\n  lr_schedule: cosine\n")
    with pytest.raises(
        ConfigError, match=r"train\.lr_schedule: unknown key; allowed keys here are: fraction"
    ):
        load_feduv_config(bad)
    bad.write_text("rounds: many\n")
    with pytest.raises(ConfigError, match=r"rounds: expected an integer, got 'many'"):
        load_feduv_config(bad)
    bad.write_text("code_lengths: [127, 200]\n")
    with pytest.raises(ConfigError, match="200"):
        run_feduv(with_overrides(TINY, code_lengths=load_feduv_config(bad).code_lengths), tmp_path / "r")
    with pytest.raises(ConfigError, match="does not exist"):
        load_feduv_config(tmp_path / "missing.yaml")


def test_cli_reports_bad_input_without_a_traceback(capsys) -> None:
    assert cli.main(["feduv", "run", "--methods", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_bench_counts_client_updates() -> None:
    doc = bench_client_updates(clients=2, width_divisor=32, examples=10, repeats=1, threads=1)
    assert doc["client_updates_per_second"] > 0 and doc["clients"] == 2 and doc["num_params"] > 0


class _PowerCut(Exception):
    """A crash in the middle of a run, raised where the crash-test hook would kill the process."""


def _cut_at(monkeypatch: pytest.MonkeyPatch, point: str, seen: list[str], nth: int = 1) -> None:
    """Make the crash-test hook raise :class:`_PowerCut` the ``nth`` time it passes ``point``
    (``NAME:ROUND``: of the ``nth`` method); record every point passed in ``seen``."""

    def hook(name: str, rnd: int) -> None:
        seen.append(f"{name}:{rnd}")
        if seen.count(point) == nth and seen[-1] == point:
            raise _PowerCut(point)

    monkeypatch.setattr(feduv_runner, "crash_point", hook)


def _without_seconds(results: dict) -> dict:
    return {label: {k: v for k, v in row.items() if k != "real_seconds"} for label, row in results.items()}


def test_a_method_cut_off_mid_way_resumes_from_its_last_round_to_the_uninterrupted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = with_overrides(TINY, methods=("fedaws", "feduv"), rounds=4)
    deployed: list[tuple[str, np.ndarray]] = []
    real_deploy = UvServer.deploy

    async def deploy(self: UvServer, comm: object, q: float) -> object:
        deployed.append((self.method, self.weights))
        return await real_deploy(self, comm, q)  # type: ignore[arg-type]

    monkeypatch.setattr(UvServer, "deploy", deploy)
    whole = run_feduv(cfg, tmp_path / "whole")
    final = dict(deployed)
    deployed.clear()
    seen: list[str] = []
    _cut_at(monkeypatch, "metrics:3", seen, nth=2)  # the second method's round 3, not checkpointed
    out = tmp_path / "cut"
    with pytest.raises(_PowerCut):
        run_feduv(cfg, out)
    assert sorted(p.name for p in (out / "methods").iterdir()) == [
        "fedaws.json",
        "fedaws.roc.npz",
        "feduv-127.checkpoint.npz",
    ], "the finished method's checkpoint is gone; the one in training has its own"
    seen.clear()
    deployed.clear()
    # ``auto`` (the default) ran on the CPU here: ``cpu`` names the same device, and the run resumes
    resumed = run_feduv(with_overrides(cfg, device="cpu"), out, resume=True)
    assert seen == ["round:3", "metrics:3", "round:4", "metrics:4"], "only the rounds after the checkpoint"
    assert [m for m, _ in deployed] == ["feduv"]
    np.testing.assert_array_equal(deployed[0][1], final["feduv"])
    assert _without_seconds(resumed["methods"]) == _without_seconds(whole["methods"])
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "whole" / "metrics.jsonl").read_text()
    assert sorted(p.name for p in (out / "methods").iterdir()) == [
        f"{m}{ext}" for m in ("fedaws", "feduv-127") for ext in (".json", ".roc.npz")
    ]


def test_worker_processes_resume_their_method_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = with_overrides(TINY, methods=("softmax", "feduv"), rounds=3)
    whole = run_feduv(cfg, tmp_path / "whole")
    out = tmp_path / "cut"
    _cut_at(monkeypatch, "round:2", [])  # the first method after its round 1
    with pytest.raises(_PowerCut):
        run_feduv(cfg, out)
    assert load_checkpoint(out / "methods", name="softmax.checkpoint.npz").round == 1
    resumed = run_feduv(with_overrides(cfg, workers=2), out, resume=True)
    assert _without_seconds(resumed["methods"]) == _without_seconds(whole["methods"])
    assert not list((out / "methods").glob("*.checkpoint.npz"))


def test_a_method_checkpoint_of_other_settings_is_not_resumed(tmp_path: Path, monkeypatch) -> None:
    cfg = with_overrides(TINY, methods=("softmax",), rounds=3)
    _cut_at(monkeypatch, "round:3", [])
    with pytest.raises(_PowerCut):
        run_feduv(cfg, tmp_path / "a")
    _cut_at(monkeypatch, "round:3", [])
    with pytest.raises(_PowerCut):
        run_feduv(with_overrides(cfg, seed=1), tmp_path / "b")
    (tmp_path / "b" / "methods" / "softmax.checkpoint.npz").replace(
        tmp_path / "a" / "methods" / "softmax.checkpoint.npz"
    )
    with pytest.raises(ConfigError, match=r"softmax\.checkpoint\.npz \(round 2\) was trained under another"):
        run_feduv(cfg, tmp_path / "a", resume=True)
