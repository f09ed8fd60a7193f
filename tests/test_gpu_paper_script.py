"""``scripts/gpu-paper``: the paper-scale AIoT run in slices, each continuing the last one's bundle.

What the GPU sessions rely on is checked here on the CPU (the script's ``--dry-run``) at a tiny config: a
slice stopped mid-run (at the end of a round: the SIGINT the script sends at its budget, or passes on
from a signal it receives, through the same ``timeout``), bundled, then continued from its bundle in a
fresh folder, slice after slice, ends with the uninterrupted run's ``results.json``. The one ``gpu`` test
checks on a CUDA machine that such a run computes every phase there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fedveil.experiments.aiot import runner as aiot
from fedveil.experiments.aiot.runner import load_aiot_run
from fedveil.models.device import module_device
from processes import wait_for_file
from test_cli_aiot_run import tiny_aiot

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-paper"

TINY = tiny_aiot(rounds=3, trials=1, methods=["pretrained", "solo", "ours"], solo_devices=2)


def _env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    """The environment of slice ``name``: its own OUT and WORK, the tiny config on the cpu."""
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / f"{name}-out"),
        "WORK": str(tmp_path / f"{name}-work"),
        "CONFIG": str(tmp_path / "tiny.yaml"),
        "SETS": "",
        **extra,
    }


def _bundled(out: Path) -> tuple[set[str], dict[str, Any]]:
    """The members of ``out``'s bundle and its results.json's results (empty when it has none)."""
    with tarfile.open(out / "aiot-paper.tar.gz") as tar:
        names = set(tar.getnames())
        member = tar.extractfile("run/results.json") if "run/results.json" in names else None
        results = json.loads(member.read())["results"] if member is not None else {}
    return names, results


def test_slices_stopped_mid_run_and_continued_from_their_bundles_end_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    (tmp_path / "tiny.yaml").write_text(TINY)
    whole = aiot.run_aiot(
        load_aiot_run(tmp_path / "tiny.yaml", {"device": "cpu"}), tmp_path / "whole", progress=False
    )

    # slice 1: stopped by a signal once a round of solo's first device is checkpointed
    first = subprocess.Popen(
        [str(SCRIPT), "--dry-run"], env=_env(tmp_path, "first"), stderr=subprocess.PIPE, text=True
    )
    wait_for_file(tmp_path / "first-work" / "run" / "checkpoint.npz", first, 90)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert "a signal stopped the run" in err and "not done" in err
    names, results = _bundled(tmp_path / "first-out")
    assert {"run/pretrained.safetensors", "run/checkpoint.npz", "run/device.json", "slices.log"} <= names
    assert "ours/0" not in results, "stopped mid-run"
    assert {p.name for p in (tmp_path / "first-out").iterdir()} == {"aiot-paper.tar.gz", "gpu-paper.log"}

    # slice 2: its budget is spent before it trains anything; its bundle still carries the run on
    second = subprocess.run(
        [str(SCRIPT), "--dry-run"],
        env=_env(tmp_path, "second", RESUME=str(tmp_path / "first-out" / "aiot-paper.tar.gz"), BUDGET="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 0, second.stderr
    assert "continuing" in second.stderr and "budget" in second.stderr and "not done" in second.stderr
    assert "pretrained 1/1" in second.stderr, "the status line reads the run out of the bundle"

    # slice 3: continues in a fresh folder to the end
    third = subprocess.run(
        [str(SCRIPT), "--dry-run"],
        env=_env(tmp_path, "third", RESUME=str(tmp_path / "second-out" / "aiot-paper.tar.gz")),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert third.returncode == 0, third.stderr
    assert "the run finished" in third.stderr and "done: results.json" in third.stderr
    names, results = _bundled(tmp_path / "third-out")
    assert results == whole["results"]
    assert "run/checkpoint.npz" not in names and "run/scores.png" in names
    with tarfile.open(tmp_path / "third-out" / "aiot-paper.tar.gz") as tar:
        history = tar.extractfile("slices.log").read().decode()  # type: ignore[union-attr]
    slices = [history.index(said) for said in ("starts afresh", "a signal", "budget", "the run finished")]
    assert history.count("gpu-paper: dry run:") == 3 and slices == sorted(slices), "every slice's, in order"


def test_a_resume_that_is_not_a_bundle_and_a_bad_budget_are_refused_naming_them(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(TINY)
    bad = tmp_path / "other.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "tiny.yaml", arcname="tiny.yaml")
    done = subprocess.run(
        [str(SCRIPT), "--dry-run"],
        env=_env(tmp_path, "bad", RESUME=str(bad)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and f"RESUME={bad} is not a bundle of scripts/gpu-paper" in done.stderr
    assert not (tmp_path / "bad-out" / "aiot-paper.tar.gz").exists()
    done = subprocess.run(
        [str(SCRIPT), "--dry-run"],
        env=_env(tmp_path, "budget", BUDGET="7m"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "BUDGET=7m is not a whole number of seconds" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here")
def test_a_run_on_cuda_computes_every_phase_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cuda`` (the script's) reaches the pre-training, the devices of every method (the protocol,
    centralized, SOLO) and the evaluation."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    seen: list[tuple[str, str]] = []
    real_train, real_evaluate, real_pool = aiot.train_faces, aiot.evaluate_faces, aiot.ProjectorClients

    def train(*args: Any, device: Any, **kwargs: Any) -> Any:
        seen.append(("pre-training", torch.device(device).type))
        return real_train(*args, device=device, **kwargs)

    def evaluate(model: torch.nn.Module, *args: Any) -> dict[str, Any]:
        seen.append(("evaluation", module_device(model).type))
        return real_evaluate(model, *args)

    def pool(*args: Any, **kwargs: Any) -> Any:
        made = real_pool(*args, **kwargs)
        seen.append(("devices", made.device.type))
        return made

    monkeypatch.setattr(aiot, "train_faces", train)
    monkeypatch.setattr(aiot, "evaluate_faces", evaluate)
    monkeypatch.setattr(aiot, "ProjectorClients", pool)
    overrides = {"device": "cuda", "methods": ["pretrained", "centralized", "solo", "ours"]}
    aiot.run_aiot(load_aiot_run(tmp_path / "tiny.yaml", overrides), tmp_path / "run", progress=False)
    assert {phase for phase, _ in seen} == {"pre-training", "devices", "evaluation"}
    assert {device for _, device in seen} == {"cuda"}, seen
    assert sum(phase == "devices" for phase, _ in seen) == 1 + 2 + 1, "centralized, 2 solo devices, ours"


def test_the_paper_config_is_small_yaml_with_the_papers_network() -> None:
    """``configs/aiot/paper.yaml`` differs from ``small.yaml`` in the network alone (and in its name and the
    host's threads, which change no number), so the two runs' difference is the network's."""
    paper = load_aiot_run(REPO / "configs" / "aiot" / "paper.yaml")
    small = load_aiot_run(REPO / "configs" / "aiot" / "small.yaml")
    assert (paper.size, paper.width) == (112, 1.0)
    assert paper.model_name == "mobilefacenet (image_size 112, width 1.0)"
    assert replace(paper, name=small.name, size=small.size, width=small.width, threads=small.threads) == small
