"""Model weights on disk: safetensors only (never pickle or ``torch.load`` of bytes from elsewhere).

:func:`load_weights` reads a ``.safetensors`` file into a copy of a model after checking that it holds
exactly the model's parameters and buffers, each of the model's shape and a floating dtype, all finite;
any difference is a :class:`~fedveil.errors.ConfigError` that names the tensor and the file.
:func:`save_weights` writes a model's state for it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from fedveil.core.atomic import atomic_write
from fedveil.errors import ConfigError

__all__ = ["load_weights", "save_weights"]


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Write ``model``'s state (parameters and buffers, float32 contiguous copies) as safetensors."""
    state = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    save_file(state, str(tmp))
    atomic_write(target, tmp.read_bytes())
    tmp.unlink()


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """A copy of ``model`` holding the weights of the safetensors file ``path`` (module docstring)."""
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"weights file {source} does not exist: give a .safetensors file of the model")
    try:
        tensors = load_file(str(source))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{source} is not a readable safetensors file: {exc}") from exc
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ConfigError(
            f"{source} does not hold {type(model).__name__}'s weights: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}"
        )
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ConfigError(
                f"{source}: tensor {name} has shape {tuple(got.shape)}; {type(model).__name__} needs "
                f"{tuple(want.shape)}"
            )
        if not got.dtype.is_floating_point and got.dtype != want.dtype:
            raise ConfigError(f"{source}: tensor {name} has dtype {got.dtype}, expected {want.dtype}")
        if got.dtype.is_floating_point and not bool(torch.isfinite(got).all()):
            raise ConfigError(f"{source}: tensor {name} holds NaN or infinite values")
    loaded = copy.deepcopy(model)
    loaded.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})
    return loaded
