"""The data and models of PoliFL's use cases: the synthetic MPU population (shape, seeding, the sensors
that carry signal), per-user text from license files (a fixture folder in the same layout as Debian's
``/usr/share/common-licenses``) or the synthetic fallback, and the two LSTMs' shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedveil.data.mpu import SENSORS, synthetic_mpu
from fedveil.data.text import license_users, synthetic_users, text_users, tokenize
from fedveil.errors import ConfigError
from fedveil.eval.verification import roc_auc
from fedveil.models.behaviour import EngagementNet, NextWordLSTM, binary_logit_loss, sequence_loss


def test_mpu_population_shape_and_seed() -> None:
    a = synthetic_mpu(20, seed=3, window=4)
    b = synthetic_mpu(20, seed=3, window=4)
    assert len(a) == 20 and list(a) == list(b)
    user = a["user000"]
    assert user["x"].shape[1:] == (4, len(SENSORS)) and user["x"].dtype == np.float32
    assert len(user["x"]) == len(user["y"]) and len(user["test_x"]) == len(user["test_y"]) > 0
    np.testing.assert_array_equal(user["x"], b["user000"]["x"])
    rate = np.mean(np.concatenate([u["y"] for u in a.values()]))
    assert 0.15 < rate < 0.5
    with pytest.raises(ConfigError, match="window"):
        synthetic_mpu(5, window=0)


def test_mic_and_location_carry_signal() -> None:
    """The last step's mic and location readings alone rank engagement better than chance."""
    users = synthetic_mpu(60, seed=0)
    x = np.concatenate([u["x"][:, -1, :] for u in users.values()])
    y = np.concatenate([u["y"] for u in users.values()])
    for sensor in ("mic", "loc"):
        score = x[:, SENSORS.index(sensor)]
        assert roc_auc(score[y == 1], score[y == 0]) > 0.6


def test_license_users_from_a_fixture_folder(tmp_path: Path) -> None:
    text = "\n\n".join(f"Paragraph {i}: you may copy, modify and distribute the program." for i in range(60))
    (tmp_path / "TOY-1").write_text(text)
    (tmp_path / "TOY").symlink_to(tmp_path / "TOY-1")
    users, words = license_users(4, vocab=20, seq_len=8, root=tmp_path)
    assert words[0] == "<unk>" and "the" in words and len(words) == 20
    assert 1 <= len(users) <= 4
    for u in users.values():
        assert u["x"].shape[1] == 8 and u["y"].shape == u["x"].shape
        np.testing.assert_array_equal(u["x"][:, 1:], u["y"][:, :-1].astype(np.float32))
    assert tokenize("You may NOT copy, it's v3.") == ["you", "may", "not", "copy", ",", "it's", "v", "3", "."]
    with pytest.raises(ConfigError, match="no license texts"):
        license_users(root=tmp_path / "missing")


def test_synthetic_text_fallback_is_labelled(monkeypatch: pytest.MonkeyPatch) -> None:
    data, words = synthetic_users(3, vocab=30, seq_len=8, samples=4, seed=1)
    assert len(data) == 3 and len(words) == 30
    import fedveil.data.text as text

    monkeypatch.setattr(text, "LICENSES", Path("/nonexistent"))
    monkeypatch.setattr(
        text, "license_users", lambda *a, **k: (_ for _ in ()).throw(ConfigError("no license texts"))
    )
    _, _, source = text_users(3, vocab=30, seq_len=8)
    assert source.startswith("SYNTHETIC")


def test_model_shapes_and_losses() -> None:
    net = EngagementNet(len(SENSORS), per_step=6, hidden=5)
    logits = net(torch.zeros(7, 3, len(SENSORS)))
    assert logits.shape == (7,)
    assert float(binary_logit_loss(logits, torch.ones(7, dtype=torch.int64)).detach()) > 0
    lm = NextWordLSTM(50, embedding=8, hidden=9)
    out = lm(torch.zeros(2, 6))
    assert out.shape == (2, 6, 50)
    assert float(sequence_loss(out, torch.zeros(2, 6, dtype=torch.int64)).detach()) == pytest.approx(
        np.log(50), rel=0.2
    )
