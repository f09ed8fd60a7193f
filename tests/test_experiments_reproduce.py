"""``fedveil reproduce``: every cell runs, the summary sits beside the paper's numbers, reruns resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import load_checkpoint
from fedveil.experiments.fdml.reproduce import TABLES, mean_std, reproduce, run_curves
from processes import wait_for_file

CONFIGS = Path(__file__).parents[1] / "configs"
TINY = [
    "rounds=2",
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "fedavg.clients_per_round=4",
    "fedavg.samples_per_client=4",
    "eval.every=0",
    "enclave.boundary=inprocess",
]


def test_every_table_cell_has_a_config() -> None:
    for _, cells in TABLES.values():
        for cell in cells:
            assert (CONFIGS / cell.config).is_file(), cell.config


def test_table1_runs_and_resumes(tmp_path: Path) -> None:
    lines: list[str] = []
    summary = reproduce(
        "table1", configs=CONFIGS, out=tmp_path, overrides=TINY, jobs=2, threads=1, echo=lines.append
    )
    assert [c["column"] for c in summary["cells"]] == ["FDML", "FL (lr=0.1)", "FL (lr=0.01)"]
    assert all(c["results"] is not None and c["results"]["rounds"] == 2 for c in summary["cells"])
    md = (tmp_path / "table1" / "summary.md").read_text()
    assert "| TouchAuth | FDML |" in md and "80.88" in md and "71.40" in md
    assert json.loads((tmp_path / "table1" / "summary.json").read_text())["overrides"] == TINY
    # each cell's run recorded the code it ran on, and the summary names it
    commit = summary["code"]["git_commit"]
    assert summary["cell_commits"] == [commit or "unrecorded"]
    assert f"Code the cells ran on (git commit): {commit[:12] if commit else 'unrecorded'}." in md
    again: list[str] = []
    reproduce("table1", configs=CONFIGS, out=tmp_path, overrides=TINY, jobs=1, threads=1, echo=again.append)
    assert sum("kept" in line for line in again) == 3


def test_bad_table_and_missing_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="table 'table9' is not one of"):
        reproduce("table9")
    with pytest.raises(ConfigError, match="not found"):
        reproduce("table2", configs=tmp_path)


def test_seeds_give_mean_and_std_and_a_cut_run_resumes(tmp_path: Path) -> None:
    lines: list[str] = []
    summary = reproduce(
        "partial",
        configs=CONFIGS,
        out=tmp_path,
        overrides=TINY,
        jobs=2,
        threads=1,
        seeds=2,
        echo=lines.append,
    )
    assert summary["seeds"] == 2 and len(summary["cells"]) == 4
    for cell in summary["cells"]:
        runs = cell["seeds"]
        assert [r["seed"] for r in runs] == [0, 1]
        accs = [r["accuracy_percent"] for r in runs]
        assert cell["stats"]["accuracy_percent_each"] == accs
        assert cell["stats"]["accuracy_percent"] == pytest.approx(sum(accs) / 2)
        assert cell["stats"]["accuracy_percent_std"] == pytest.approx(abs(accs[0] - accs[1]) / 2**0.5)
    # different seeds train different models
    first = summary["cells"][0]["seeds"]
    assert first[0]["accuracy_percent"] != first[1]["accuracy_percent"] or first[0]["eer"] != first[1]["eer"]
    md = (tmp_path / "partial" / "summary.md").read_text()
    assert "mean +- std" in md and "| 51 gradients of 51 | 51 participants, rate_p=1 |" in md
    assert "| - |" in md  # no paper number for the control cell
    assert (tmp_path / "partial" / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = run_curves(tmp_path / "partial" / "table1_fdml" / "seed0")
    assert [r for r, _ in curves["loss"]] == [1.0, 2.0] and [r for r, _ in curves["accuracy"]] == [2.0]
    assert run_curves(tmp_path / "nowhere") == {}
    # a run cut off after its checkpoint continues from it instead of starting again
    cut = tmp_path / "partial" / "table1_fdml" / "seed1"
    done = json.loads((cut / "results.json").read_text())
    (cut / "results.json").unlink()
    again: list[str] = []
    summary2 = reproduce(
        "partial",
        configs=CONFIGS,
        out=tmp_path,
        overrides=TINY,
        jobs=1,
        threads=1,
        seeds=2,
        echo=again.append,
    )
    assert sum("kept" in line for line in again) == 7
    assert sum("(resumed)" in line for line in again) == 1
    resumed = summary2["cells"][0]["seeds"][1]
    assert resumed["resumed_after_round"] == 2 and resumed["accuracy_percent"] == done["accuracy_percent"]


def test_rounds_scale_keeps_each_cell_s_ratio(tmp_path: Path) -> None:
    """``--rounds-scale K``: every cell runs K times its own config's rounds (Table I's FDML and
    FL-traditional keep their 1:3 ratio), and says so in the summary."""
    small = tmp_path / "configs"
    small.mkdir()
    for cell in TABLES["table1"][1]:  # the table's configs at 1/100 of their rounds
        text = (CONFIGS / cell.config).read_text()
        rounds = next(int(line.split(":")[1]) for line in text.splitlines() if line.startswith("rounds:"))
        (small / cell.config).write_text(text.replace(f"rounds: {rounds}\n", f"rounds: {rounds // 100}\n"))
    tiny = [item for item in TINY if not item.startswith("rounds=")]
    summary = reproduce(
        "table1", configs=small, out=tmp_path, overrides=tiny, rounds_scale=2, threads=1, echo=lambda _: None
    )
    assert [c["results"]["rounds"] for c in summary["cells"]] == [4, 12, 12]
    assert summary["rounds_scale"] == 2
    assert "Each cell at 2x its config's rounds." in (tmp_path / "table1" / "summary.md").read_text()
    with pytest.raises(ConfigError, match="both choose the rounds"):
        reproduce("table1", configs=CONFIGS, out=tmp_path, overrides=["rounds=5"], rounds_scale=2)
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        reproduce("table1", configs=CONFIGS, out=tmp_path, rounds_scale=0)


def test_mean_std_and_seed_conflict(tmp_path: Path) -> None:
    assert mean_std([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, 1.2909944487358056))
    assert mean_std([7.0]) == (7.0, 0.0)
    with pytest.raises(ConfigError, match="both choose the seed"):
        reproduce("table1", configs=CONFIGS, out=tmp_path, overrides=["seed=3"], seeds=2)
    with pytest.raises(ConfigError, match="seeds 0 must be >= 1"):
        reproduce("table1", configs=CONFIGS, out=tmp_path, seeds=0)
    with pytest.raises(ConfigError, match=r"cells \[0, 4\]: table1 has cells 1 to 3"):
        reproduce("table1", configs=CONFIGS, out=tmp_path, only=[0, 4])


def test_only_some_cells(tmp_path: Path) -> None:
    summary = reproduce("table1", configs=CONFIGS, out=tmp_path, overrides=TINY, only=[2], echo=print)
    assert [c["column"] for c in summary["cells"]] == ["FL (lr=0.1)"]
    assert not (tmp_path / "table1" / "table1_fdml").exists()


def _interruptible(cmd: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """``cmd`` as a terminal would start it: SIGINT at its default (this test process may have inherited
    it ignored, as a job started in the background of a non-interactive shell does)."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )


def test_ctrl_c_stops_a_reproduction_at_a_round_boundary_and_says_how_to_resume(tmp_path: Path) -> None:
    """Ctrl-C on ``fedveil reproduce`` reaches its running ``fedveil run`` once; the run stops after the
    round it is in (not at its next evaluation: there is none before its 100,000th round), queued runs
    never start, and the message says how to resume."""
    many = [*(x for x in TINY if not x.startswith("rounds=")), "rounds=100000"]
    cmd = [sys.executable, "-m", "fedveil.cli", "reproduce", "table1", "--cells", "1", "--seeds", "2"]
    cmd += ["--jobs", "1", "--threads", "1", "--configs", str(CONFIGS), "--out", str(tmp_path)]
    for item in many:
        cmd += ["--set", item]
    proc = _interruptible(cmd)
    first = tmp_path / "table1" / "table1_fdml" / "seed0"
    try:
        wait_for_file(first / "checkpoint.npz", proc, 300, poll=0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err
    assert "table1: interrupted" in err and "run the same command again" in err and "Traceback" not in err
    ckpt = load_checkpoint(first)
    assert ckpt is not None and 1 <= ckpt.round < 100000
    assert not (first / "results.json").exists()
    log = (first / "log.txt").read_text()
    assert f"interrupted after round {ckpt.round}, whose checkpoint is in {first}" in log
    assert log.strip().endswith("--resume"), "the run says which command continues it"
    assert not (tmp_path / "table1" / "table1_fdml" / "seed1").exists(), "a queued run started"
