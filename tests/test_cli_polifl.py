"""``fedveil polifl run`` and ``fedveil polifl table4`` end to end: strategies on a tiny MPU config with
per-group epsilon, a release the budget refuses, resuming after a crash with the same model as an
uninterrupted run, config errors, and Table 4's readings against the paper."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.polifl import runner as polifl
from fedveil.experiments.polifl.runner import load_polifl_run

TINY = """
name: tiny
task: mpu
clients: 12
hidden: 4
clients_per_round: 3
batch_size: 16
lr: 0.5
clip_norm: 1.0
delta: 1.0e-5
groups:
  - name: strict
    policy: "get_data . filter(sensors=['mic','loc']) . runFL . check_privacy_budget(max_eps=20) . return"
    commands: ["get_data", "filter(sensors=['mic','loc'])"]
    noise: 2.0
  - name: loose
    policy: "get_data . runFL . check_privacy_budget(max_eps=40) . return"
    noise: 1.0
strategies: [cascaded, combined, "single:loose"]
rounds: 3
eval_every: 1
threads: 1
"""


def _config(tmp_path: Path, text: str = TINY) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    return path


def test_strategies_report_per_group_epsilon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["polifl", "run", str(_config(tmp_path)), "--out", str(out), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    cascaded = results["strategies"]["cascaded"]
    assert [s["stage"] for s in cascaded["stages"]] == ["strict", "loose"]
    assert cascaded["released"] and cascaded["rounds"] == 6
    strict, loose = cascaded["privacy"]["strict"], cascaded["privacy"]["loose"]
    assert strict["rounds"] == 3 and loose["rounds"] == 3 and 0 < strict["epsilon"] < loose["epsilon"]
    assert cascaded["stages"][0]["release_commands"] == ["check_privacy_budget(max_eps=20)", "return"]
    combined = results["strategies"]["combined"]
    assert combined["privacy"]["strict"]["epsilon"] == combined["privacy"]["loose"]["epsilon"]
    assert combined["stages"][0]["noise_std"] == 2.0 and combined["rounds"] == 6
    starts = {s: r["history"][0] for s, r in results["strategies"].items()}
    assert len({json.dumps(h, sort_keys=True) for h in starts.values()}) == 1, "every strategy starts afresh"
    single = results["strategies"]["single:loose"]
    assert single["privacy"]["strict"]["rounds"] == 0 and single["rounds"] == 3
    assert (out / "curves.png").stat().st_size > 0
    assert main(["polifl", "run", str(_config(tmp_path)), "--out", str(out)]) == 2, "a used folder"
    assert "--resume" in capsys.readouterr().err
    assert main(["polifl", "run", str(_config(tmp_path)), "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "cascaded" in printed and "epsilon: strict" in printed and "released" in printed


def test_a_release_over_budget_is_refused_and_stops_the_cascade(tmp_path: Path) -> None:
    cfg = load_polifl_run(_config(tmp_path, TINY.replace("max_eps=20", "max_eps=0.5")))
    results = polifl.run_polifl(cfg, tmp_path / "run", strategies=("cascaded",), progress=False)
    cascaded = results["strategies"]["cascaded"]
    assert not cascaded["released"] and len(cascaded["stages"]) == 1
    assert "group strict has spent epsilon" in cascaded["stopped"]
    assert cascaded["privacy"]["loose"]["rounds"] == 0


def test_stop_at_budget_shortens_the_stage(tmp_path: Path) -> None:
    text = TINY.replace("max_eps=20", "max_eps=1.5") + "stop_at_budget: true\n"
    cfg = load_polifl_run(_config(tmp_path, text), {"rounds": 50})
    results = polifl.run_polifl(cfg, tmp_path / "run", strategies=("single:strict",), progress=False)
    run = results["strategies"]["single:strict"]
    assert run["stages"][0]["stopped_by_budget"] and 0 < run["rounds"] < 50
    assert run["released"] and run["privacy"]["strict"]["epsilon"] <= 1.5


def test_a_crashed_run_resumes_to_the_same_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_polifl_run(_config(tmp_path))
    whole = polifl.run_polifl(cfg, tmp_path / "whole", strategies=("cascaded",), progress=False)
    real = polifl.run_stage
    calls = {"n": 0}

    async def crash_in_stage_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("power cut")
        return await real(*args, **kwargs)

    monkeypatch.setattr(polifl, "run_stage", crash_in_stage_two)
    with pytest.raises(RuntimeError, match="power cut"):
        polifl.run_polifl(cfg, tmp_path / "crashed", strategies=("cascaded",), progress=False)
    monkeypatch.setattr(polifl, "run_stage", real)
    other = load_polifl_run(_config(tmp_path), {"rounds": 4})
    with pytest.raises(ConfigError, match=r"other settings \(rounds\)"):
        polifl.run_polifl(other, tmp_path / "crashed", strategies=("cascaded",), progress=False, resume=True)
    # ``auto`` (the default) ran on the CPU here: ``cpu`` names the same device, and the run resumes
    resumed = polifl.run_polifl(
        replace(cfg, device="cpu"),
        tmp_path / "crashed",
        strategies=("cascaded",),
        progress=False,
        resume=True,
    )
    a, b = whole["strategies"]["cascaded"], resumed["strategies"]["cascaded"]
    assert a["history"] == b["history"] and a["privacy"] == b["privacy"]
    with (
        np.load(tmp_path / "whole" / "cascaded" / "weights.npz") as x,
        np.load(tmp_path / "crashed" / "cascaded" / "weights.npz") as y,
    ):
        np.testing.assert_array_equal(x["weights"], y["weights"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strategies": ["mixed"]}, "use cascaded, combined, single:GROUP or program"),
        ({"strategies": ["single:nobody"]}, "names no group"),
        ({"task": "speech"}, "task 'speech' is not one of"),
        ({"groups": []}, "at least one group"),
        ({"rounds": 0}, "rounds 0 must be >= 1"),
    ],
)
def test_config_errors_are_named(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_polifl_run(_config(tmp_path), change)


def test_table4_readings_against_the_paper(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["polifl", "table4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    fitted = {r["row"]: r for r in result["readings"]["fitted"]["rows"]}
    for row in (1, 2, 5, 6):
        for g in ("Gr1", "Gr2"):
            assert fitted[row]["epsilon"][g] == pytest.approx(fitted[row]["paper"][g], abs=0.01)
    assert fitted[3]["epsilon"]["Gr1"] > 1.08 and not fitted[3]["satisfies"]
    assert fitted[5]["satisfies"] and fitted[6]["satisfies"]
    written = result["readings"]["as_written"]["rows"]
    assert all(r["epsilon"]["Gr1"] < 0.01 and r["epsilon"]["Gr2"] < 0.01 for r in written)


def test_bench_polifl_measures_both_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedveil.experiments.bench import polifl as bench_polifl

    _config(tmp_path)
    monkeypatch.setattr(bench_polifl, "USE_CASES", {"mpu": "tiny.yaml"})
    (row,) = bench_polifl.bench_polifl(repeats=1, root=tmp_path, threads=1)
    assert row["use_case"] == "mpu" and row["clients"] == 3
    assert row["client_updates_per_second"] > 0 and row["plain_client_updates_per_second"] > 0


GLOBAL = """
program: |
  def main(model, groups, rounds):
      names = [g["name"] for g in groups]
      trained = run_fl(model, names, rounds)
      try:
          peek = trained.value
      except Exception as e:
          pass
      checked = check_privacy_budget(trained, max_eps=20)
      try:
          check_privacy_budget(trained, max_eps=0.001)
      except Exception as e:
          refused = str(e)
      return release(checked) if "has spent epsilon" in refused else model
"""


def test_a_third_party_global_program_runs_in_the_sandbox(tmp_path: Path) -> None:
    text = TINY.replace('strategies: [cascaded, combined, "single:loose"]', "strategies: [program]") + GLOBAL
    cfg = load_polifl_run(_config(tmp_path, text))
    results = polifl.run_polifl(cfg, tmp_path / "run", progress=False)
    run = results["strategies"]["program"]
    assert run["released"] and run["rounds"] == 3
    assert run["privacy"]["strict"]["epsilon"] == run["privacy"]["loose"]["epsilon"] > 0
    escape = text.replace('names = [g["name"] for g in groups]', "names = model.ref")
    cfg = load_polifl_run(_config(tmp_path, escape))
    results = polifl.run_polifl(cfg, tmp_path / "run2", progress=False)
    assert not results["strategies"]["program"]["released"]
    assert "no attribute 'ref'" in results["strategies"]["program"]["stopped"]
    with pytest.raises(ConfigError, match="needs the job's global program"):
        load_polifl_run(_config(tmp_path), {"strategies": ["program"]})
