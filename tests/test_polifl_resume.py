"""A PoliFL stage (one ``runFL`` call of the sandboxed program) is checkpointed after each of its rounds: a
run cut off inside a stage goes on after its last checkpointed round, trains no round before it again,
and ends with the uninterrupted run's model, history and epsilon."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedveil.experiments.polifl import runner as polifl
from fedveil.experiments.polifl.runner import load_polifl_run
from test_cli_polifl import _config


class _PowerCut(Exception):
    """A crash raised where the crash-test hook would kill the process."""


def test_a_run_cut_off_inside_a_stage_goes_on_after_its_last_round_to_the_uninterrupted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_polifl_run(_config(tmp_path))
    whole = polifl.run_polifl(cfg, tmp_path / "whole", strategies=("cascaded",), progress=False)
    passed: list[str] = []

    def hook(name: str, rnd: int) -> None:
        passed.append(f"{name}:{rnd}")
        if passed[-1] == "polifl_checkpoint:5":  # the second stage (rounds 4-6), after its round 5
            raise _PowerCut(passed[-1])

    monkeypatch.setattr(polifl, "crash_point", hook)
    out = tmp_path / "cut"
    with pytest.raises(_PowerCut):
        polifl.run_polifl(cfg, out, strategies=("cascaded",), progress=False)
    folder = out / "cascaded"
    state = json.loads((folder / "state.json").read_text())
    call = state["partial"]["call"]  # the program's calls so far: run_fl, then its release
    assert call == len(state["calls"]) == 2 and state["partial"]["rounds"] == 2
    assert [p.name for p in folder.glob("call*.round*.npz")] == ["call2.round2.npz"], "the last round's model"
    passed.clear()
    resumed = polifl.run_polifl(cfg, out, strategies=("cascaded",), progress=False, resume=True)
    assert passed == [], "the stage goes on after round 5: no round before it is trained again"
    a, b = whole["strategies"]["cascaded"], resumed["strategies"]["cascaded"]
    assert a["history"] == b["history"] and a["privacy"] == b["privacy"]
    with np.load(tmp_path / "whole" / "cascaded" / "weights.npz") as x, np.load(folder / "weights.npz") as y:
        np.testing.assert_array_equal(x["weights"], y["weights"])
    assert json.loads((folder / "state.json").read_text())["partial"] is None
    assert not list(folder.glob("call*.round*.npz")), "the stage's checkpoint is gone once it ends"
