"""The partial-participation diagnostic: per-device FDML gradients add up to the whole cohort's, the
triplet loss's translation invariance cancels the embedding bias exactly, and a partial update is
unbiased (its mean over many random subsets approaches the full update)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.partial import device_gradients, gradient_agreement, main
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet

SMALL = ["data.train_users_per_model=[10, 10]", "data.test_users_per_model=[11, 11]"]


def test_device_gradients_sum_to_the_autograd_gradient_of_the_cohort_loss() -> None:
    torch.manual_seed(0)
    flat = FlatModel(TouchAuthNet(64))
    w = flat.initial()
    rng = np.random.default_rng(1)
    samples = [rng.normal(0, 1, (4, 30, 10)).astype(np.float32) for _ in range(5)]
    per_device = device_gradients(flat, w, samples, margin=1.0, strategy="batch-all")
    assert per_device.shape == (5, flat.num_params)
    # brute force: autograd of sum_j <dL/de_j, f(x_j)> with Alg. 1's derivatives held fixed (the chain rule)
    x = torch.from_numpy(np.concatenate(samples)).reshape(-1, 1, 30, 10)
    p = torch.from_numpy(w).requires_grad_(True)
    emb = flat(p, x)
    labels = np.repeat(np.arange(5), 4)
    d = loss_and_derivatives(emb.detach().numpy(), labels, margin=1.0).derivatives
    (emb * torch.from_numpy(np.asarray(d, np.float32))).sum().backward()
    want = p.grad.numpy().astype(np.float64)
    np.testing.assert_allclose(per_device.sum(axis=0), want, rtol=1e-4, atol=1e-7)
    # the loss sees only differences of embeddings: the embedding bias's gradient cancels over the cohort
    bias = slice(flat.num_params - 64, flat.num_params)
    assert flat.names[-1] == "embed.bias"
    assert np.abs(per_device[:, bias]).max() > 1e3 * np.abs(per_device[:, bias].sum(axis=0)).max()


def test_partial_updates_are_unbiased_and_noisier_than_the_full_one() -> None:
    cfg = load_config(Path(__file__).parents[1] / "configs" / "table1_fdml.yaml", SMALL)
    report = gradient_agreement(cfg, cohort=4, applied=3, draws=2, subsets=400, seed=0)
    assert report["signal_share"]["embed.bias"] < 1e-6
    # averaging many partial updates approaches the full one (unbiased), one alone is far from it
    mean, one = report["subset_mean"], report["subset"]
    assert mean["cosine"] > 0.8 > one["cosine"]
    assert mean["relative_distance"] < one["relative_distance"] / 3
    for key in ("subset", "other_cohort", "small_cohort"):
        shares = report[key]["deviation_share"]
        assert sum(shares.values()) == pytest.approx(1.0) and report[key]["relative_distance"] > 0
    assert report["subset"]["deviation_share"]["embed.bias"] > 1e-3  # the uncancelled translation


def test_bad_settings_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(Path(__file__).parents[1] / "configs" / "table1_fdml.yaml", SMALL)
    with pytest.raises(ConfigError, match="applied 5 must be between 2 and the cohort size 4"):
        gradient_agreement(cfg, cohort=4, applied=5)
    with pytest.raises(ConfigError, match="two disjoint cohorts need"):
        gradient_agreement(cfg, cohort=8, applied=4, draws=1)
    with pytest.raises(ConfigError, match="weights of shape"):
        gradient_agreement(cfg, np.zeros(3, np.float32), cohort=4, applied=3)
    with pytest.raises(SystemExit, match=r"no checkpoint\.npz"):
        main(["--checkpoint", str(tmp_path)])
    config = tmp_path / "small.yaml"
    config.write_text(
        (Path(__file__).parents[1] / "configs" / "table1_fdml.yaml").read_text()
        + "data:\n  train_users_per_model: [10, 10]\n  test_users_per_model: [11, 11]\n"
    )
    assert (
        main(["--config", str(config), "--cohort", "4", "--applied", "2", "--draws", "1", "--subsets", "3"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["applied"] == 2
