"""The FedUV codeword attack: the server recovers codewords from undefended FedAvg updates; controls sit
at chance."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from fedveil.attacks.codeword import class_scores, codeword_attack, compare_codeword
from fedveil.attacks.views import SealedView, UpdateView
from fedveil.errors import ValidationError
from fedveil.experiments.attacks.feduv_codeword import feduv_codeword_table


@pytest.fixture(scope="module")
def table() -> dict:
    """FedUV and softmax, 5 users, 2 rounds, 3 users per round, a narrow net (SYNTHETIC MNIST-UV)."""
    return feduv_codeword_table(
        methods=("feduv", "softmax"), writers=5, rounds=2, fraction=0.6, width_divisor=32, seed=0
    )


def test_server_recovers_feduv_codewords_from_updates(table: dict) -> None:
    rep = table["attacks"]["feduv"]
    assert rep["users_attacked"] >= 3
    assert rep["target"]["bit_accuracy_mean"] > 0.9
    assert rep["target"]["within_radius"] >= rep["users_attacked"] - 1  # recovered by a BCH decoder


def test_feduv_controls_are_at_chance(table: dict) -> None:
    rep = table["attacks"]["feduv"]
    bound = 4 * rep["null_std_error"]
    for control in ("control_other_user", "control_random_codeword"):
        assert abs(rep[control]["bit_accuracy_mean"] - 0.5) < bound
        assert rep[control]["within_radius"] == 0


def test_softmax_class_is_identified_and_control_is_not(table: dict) -> None:
    rep = table["attacks"]["softmax"]
    assert rep["target_top1"] == 1.0
    assert rep["control_random_class_top1"] < 0.5


def _view(bias: np.ndarray, weight: np.ndarray) -> UpdateView:
    net = nn.Linear(weight.shape[1], weight.shape[0])
    update = {"weight": torch.tensor(weight), "bias": torch.tensor(bias)}
    return UpdateView("server", "delta", update, net)


def test_bits_come_from_the_sign_of_the_summed_bias_deltas() -> None:
    views = [
        _view(np.array([1.0, -2.0, 0.5]), np.zeros((3, 2))),
        _view(np.array([1.0, 1.0, -1.0]), np.zeros((3, 2))),
    ]
    guess = codeword_attack(views, bias="bias")
    np.testing.assert_array_equal(guess.bits, [0, 1, 1])
    assert compare_codeword(guess.bits, np.array([0, 1, 0], np.uint8), radius=0) == {
        "bit_accuracy": pytest.approx(2 / 3),
        "hamming": 1,
        "within_radius": False,
    }
    norms = class_scores(
        [_view(np.zeros(3), np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 0.0]]))], weight="weight", bias=None
    )
    assert int(np.argmax(norms)) == 1


def test_attack_refuses_a_sealed_view_and_an_empty_transcript() -> None:
    with pytest.raises(ValidationError, match="no plaintext view"):
        codeword_attack([SealedView("eavesdropper", 100)])
    with pytest.raises(ValidationError, match="no update"):
        codeword_attack([])


def test_cli_prints_json(tmp_path, capsys) -> None:
    from fedveil.cli import main

    rc = main(
        [
            "attack",
            "feduv-codeword",
            "--methods",
            "fedaws",
            "--writers",
            "4",
            "--rounds",
            "2",
            "--fraction",
            "0.5",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["attacks"]["fedaws"]["target_top1"] == 1.0
    assert json.loads((tmp_path / "feduv_codeword.json").read_text())["run"]["data"] == "SYNTHETIC MNIST-UV"
