"""Gradient inversion on FDML's global-model difference (fedveil.experiments.attacks.fdml_inversion)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from fedveil.attacks.image_metrics import reconstruction_metrics
from fedveil.attacks.views import NoPlaintextView, SealedView
from fedveil.cli import main
from fedveil.data.touchauth import TouchAuthConfig, generate_touchauth
from fedveil.errors import ValidationError
from fedveil.experiments.attacks.fdml_inversion import (
    device_labels,
    fdml_round_difference,
    invert_model_difference,
)
from fedveil.experiments.fdml.triplet_reference import reference_loss
from fedveil.models.touchauth import TouchAuthNet

ITERATIONS = 300


@pytest.fixture(scope="module")
def rounds() -> tuple[TouchAuthNet, list[np.ndarray], list[np.ndarray], torch.Tensor]:
    """The initial network, a round of two SYNTHETIC users (two windows each), one of two others, and the
    attacker's prior: the mean window of eight further users."""
    population = generate_touchauth(
        TouchAuthConfig(seed=0, train_users_per_model=(12,), test_users_per_model=(1,))
    )
    ids = population.train_user_ids()
    rng = np.random.default_rng(0)
    windows = [population.sample_training(u, 2, rng) for u in ids[:4]]
    prior = np.concatenate([population.sample_training(u, 8, rng) for u in ids[4:]]).mean(axis=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = TouchAuthNet()
    return net, windows[:2], windows[2:], torch.from_numpy(prior)


def test_sgd_difference_is_the_triplet_gradient_of_the_round(rounds) -> None:
    """Known answer: after SGD, -(w_{t+1} - w_t) / lr is Eq. 2's mean, i.e. dL/dW of Alg. 1's loss over the
    round divided by the number of devices (equal windows per device), by autograd through the reference."""
    net, targets, _, _ = rounds
    view = fdml_round_difference(net, targets, optimizer="sgd", lr=1e-2)
    x = torch.from_numpy(np.concatenate(targets)).unsqueeze(1)
    labels = torch.from_numpy(device_labels([2, 2]))
    exact = copy.deepcopy(net).double()
    loss = reference_loss(exact(x.double()), labels, margin=1.0, strategy="batch-all")
    expected = torch.autograd.grad(loss, list(exact.parameters()))
    observed = view.as_gradient()
    got = torch.cat([observed[name].double().flatten() for name, _ in exact.named_parameters()])
    want = torch.cat([g.flatten() for g in expected]) / 2
    assert float((got - want).norm() / want.norm()) < 1e-3  # float32 rounding of w_{t+1} - w_t


def test_inversion_moves_towards_the_round_and_the_control_does_not(rounds) -> None:
    """From the prior, the attack on the round's difference ends closer to the round's true windows than
    the same attack on the difference of a round the targets were not in, which moves away from them (its
    error exceeds the prior's); the gradient direction is matched. Whether the attack also beats the prior
    is left to the table (docs/results.md): on this draw it does, by about a tenth; on the table's, not."""
    net, targets, others, prior = rounds
    labels = device_labels([2, 2])
    originals = torch.from_numpy(np.concatenate(targets)).unsqueeze(1)
    kwargs = {"iterations": ITERATIONS, "lr": 0.01, "seed": 1, "prior": prior}
    result = invert_model_difference(fdml_round_difference(net, targets), labels, **kwargs)
    control = invert_model_difference(fdml_round_difference(net, others), labels, **kwargs)
    attack_mse = reconstruction_metrics(originals, result.images)["mse_mean"]
    control_mse = reconstruction_metrics(originals, control.images)["mse_mean"]
    prior_mse = reconstruction_metrics(originals, prior.expand_as(originals).clone())["mse_mean"]
    assert result.final_loss < 0.5 * result.losses[0]
    assert attack_mse < 0.8 * control_mse
    assert control_mse > prior_mse


def test_one_device_round_leaves_no_difference_to_invert(rounds) -> None:
    """A round of one device has no negative, so no triplet: the difference is zero and the attack says so."""
    net, targets, _, _ = rounds
    view = fdml_round_difference(net, targets[:1], optimizer="adam")
    assert all(not bool(d.any()) for d in view.update.values())
    with pytest.raises(ValidationError, match="zero everywhere"):
        invert_model_difference(view, device_labels([2]), iterations=2)


def test_sealed_view_is_refused() -> None:
    sealed = SealedView("the wire: device to enclave", num_bytes=4096)
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        invert_model_difference(sealed, device_labels([2, 2]), iterations=2)


def test_cli_writes_and_prints_the_table(tmp_path, capsys) -> None:
    assert (
        main(
            [
                "attack",
                "fdml-inversion",
                "--cohorts",
                "1,2",
                "--iterations",
                "3",
                "--json",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "fdml_inversion.json").read_text())
    assert (
        printed["rounds"].keys() == written["rounds"].keys() == {"K=1/sgd", "K=1/adam", "K=2/sgd", "K=2/adam"}
    )
    assert written["rounds"]["K=1/sgd"]["attack"] is None
    assert set(written["rounds"]["K=2/adam"]) >= {
        "attack",
        "control/other-round",
        "baseline/prior-mean-window",
    }
