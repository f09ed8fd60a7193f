"""FlatModel takes its parameters as one flat vector or as the tensors already apart, with equal outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedveil.models.flat import FlatModel


def test_the_tensors_apart_give_the_flat_vectors_output_and_wrong_shapes_are_refused() -> None:
    torch.manual_seed(0)
    flat = FlatModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)))
    p = torch.randn(flat.num_params)
    x = torch.randn(3, 5)
    apart = tuple(t.clone() for t in flat.unflatten(p).values())
    assert torch.equal(flat(apart, x), flat(p, x))
    assert list(flat.unflatten(apart[:2])) == ["0.weight", "0.bias"]
    with pytest.raises(ValueError, match=r"tensors shaped \[\(4,\), \(4, 5\)\]"):
        flat(apart[1::-1], x)
    with pytest.raises(ValueError, match="are not the model's"):
        flat((*apart, torch.zeros(1)), x)
