"""Model weights from safetensors files: a round trip, and every way a file can fail to fit the model
is a ConfigError naming the tensor or the file (no pickle anywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fedveil.errors import ConfigError
from fedveil.models.weights import load_weights, save_weights
from fedveil.models.zoo import build_model


def _lenet(seed: int = 0) -> torch.nn.Module:
    return build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=seed)


def test_round_trip_gives_the_same_values(tmp_path: Path) -> None:
    source, target = _lenet(1), _lenet(2)
    path = tmp_path / "w.safetensors"
    save_weights(source, path)
    loaded = load_weights(target, path)
    for a, b in zip(source.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(next(target.parameters()), next(loaded.parameters()))  # a copy was loaded


def test_files_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    model = _lenet()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in state.items() if k != "units.3.0.bias"}, str(missing))
    with pytest.raises(ConfigError, match=r"missing \['units.3.0.bias'\]"):
        load_weights(model, missing)
    shaped = tmp_path / "shape.safetensors"
    save_file({**state, "units.3.0.bias": torch.zeros(7)}, str(shaped))
    with pytest.raises(ConfigError, match=r"tensor units.3.0.bias has shape \(7,\); LeNet needs \(10,\)"):
        load_weights(model, shaped)
    nan = tmp_path / "nan.safetensors"
    save_file({**state, "units.3.0.bias": torch.full((10,), float("nan"))}, str(nan))
    with pytest.raises(ConfigError, match=r"units\.3\.0\.bias holds NaN"):
        load_weights(model, nan)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x80\x04\x95 not a safetensors file")
    with pytest.raises(ConfigError, match="is not a readable safetensors file"):
        load_weights(model, garbage)
    with pytest.raises(ConfigError, match="does not exist"):
        load_weights(model, tmp_path / "nowhere.safetensors")
