"""PPFL's Table 2 attacks, its LiRA row and its transfer sweep's public model on a CUDA device give the CPU's
results within stated tolerances (``pytest -m gpu``; every test here is skipped, saying so, where torch
sees no CUDA device): the trainings the attacks target, the observer's head, the membership attacks'
scoring and LiRA's shadows all run there, and the reports record the device.

Not bit for bit: cuBLAS and cuDNN pick other kernels than the CPU's, so each float32 result differs in its
last bits, and the differences grow a little with every training step. Weights trained by SGD stay within
``max |Δw| <= 1e-4 max |w|`` (as in tests/test_gpu.py). An attack's scores come from models trained on
each path, so a candidate whose score sits next to another's can swap ranks: each AUC, and each accuracy
over the tiny runs' 48 test images, is held within ``SCORE_TOLERANCE`` (a few swapped pairs, two
predictions), far below the gap between an attack and chance that Table 2 is about. The CPU-side promises
(same bits for ``cpu`` and ``auto``, a misspelt device refused, parts never mixed across devices) are tested
in tests/test_experiments_ppfl_attacks.py, tests/test_experiments_ppfl_lira.py and tests/test_cli_ppfl.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from fedveil.attacks import lira as lira_attack
from fedveil.attacks.scores import model_logits
from fedveil.experiments.attacks.runs import membership_run
from fedveil.experiments.fedavg_images import FedAvgRun, split_images
from fedveil.experiments.ppfl import attacks as ppfl_attacks
from fedveil.experiments.ppfl import lira as ppfl_lira
from fedveil.experiments.ppfl.runner import train_central
from fedveil.models.device import module_device
from fedveil.models.zoo import build_model
from fedveil.protocols.ppfl import PpflConfig
from test_experiments_ppfl_attacks import TINY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]

RELATIVE = 1e-4
SCORE_TOLERANCE = 0.05


def _images(device: str) -> FedAvgRun:
    run = membership_run(
        data="synthetic-fashion-mnist:1500", clients=3, samples_per_client=16, rounds=2, local_epochs=1
    )
    return replace(run, device=device)


def _close_scores(cpu: dict[str, Any], cuda: dict[str, Any]) -> None:
    """Each row of two reports alike: sealed rows the same, AUCs and accuracies within the tolerance."""
    assert cpu.keys() == cuda.keys()
    for key, row in cpu.items():
        if isinstance(row, dict) and "auc" in row:
            assert abs(row["auc"] - cuda[key]["auc"]) <= SCORE_TOLERANCE, key
        elif isinstance(row, dict):
            assert row == cuda[key], key
        else:
            assert abs(row - cuda[key]) <= SCORE_TOLERANCE, key


def test_table_2_on_cuda_gives_the_cpus_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """PPFL trains on the GPU, the observer's head and the membership attacks' models are there, and the
    rows match the CPU's within the tolerances."""
    where: list[str] = []
    real = ppfl_attacks.per_example_loss

    def losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        where.append(f"{module_device(model)} {x.device}")
        return real(model, x, y)

    monkeypatch.setattr(ppfl_attacks, "per_example_loss", losses)
    cuda = ppfl_attacks.ppfl_attack_table(images=_images("cuda"), **TINY)
    assert where and all(w == "cuda:0 cuda:0" for w in where)
    cpu = ppfl_attacks.ppfl_attack_table(images=_images("cpu"), **TINY)
    assert cuda["run"]["device"] == "cuda:0" and cpu["run"]["device"] == "cpu"
    _close_scores(cpu["attacks"], cuda["attacks"])


def test_lira_on_cuda_trains_and_scores_every_model_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """E2E's and PPFL's targets and shadows, and the kept view's head, are trained on the GPU and scored
    there; LiRA's rows match the CPU's within the tolerances."""
    scored: list[str] = []

    def logits(model: torch.nn.Module, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        scored.append(str(module_device(model)))
        return model_logits(model, x, **kw)

    monkeypatch.setattr(lira_attack, "model_logits", logits)
    kw = {"systems": ("e2e", "ppfl-kept"), "shadows": 4, "aux_examples": 40, "head_epochs": 1}
    cuda = ppfl_lira.ppfl_lira_table(images=_images("cuda:0"), **kw)
    assert scored == ["cuda:0"] * 10
    cpu = ppfl_lira.ppfl_lira_table(images=_images("cpu"), **kw)
    assert cuda["run"]["device"] == "cuda:0"
    _close_scores(cpu["attacks"], cuda["attacks"])


def test_transfers_public_model_trains_on_cuda_and_comes_back_to_the_host() -> None:
    """PPFL Appendix A.1's server training: the CPU's weights within ``RELATIVE``, returned in host memory
    for the enclave."""
    split = split_images(_images("cpu"))
    model = build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=1)
    trained = {
        device: train_central(model, split.members, PpflConfig(), 2, seed=3, device=device)
        for device in ("cpu", "cuda")
    }
    assert all(p.device.type == "cpu" for p in trained["cuda"].parameters())
    for a, b in zip(trained["cpu"].parameters(), trained["cuda"].parameters(), strict=True):
        assert (a - b).abs().max() <= RELATIVE * a.abs().max()
