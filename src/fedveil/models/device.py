"""Where training runs: the one ``device`` setting of every system, and its resolver.

A run's ``device`` is ``auto`` (CUDA when torch sees a GPU, else the CPU), ``cpu``, ``cuda`` (the current
CUDA device) or ``cuda:N`` (GPU ``N``); resolved, a GPU is always ``cuda:N``, the one name every report and
record gives it. Every system's config, every ``run`` command's ``--device`` and
the attack and benchmark functions take it as text and turn it into a :class:`torch.device` here, once:
:func:`check_device_spec` when a config is loaded (the spelling), :func:`resolve_device` when training
starts (the machine). A client's examples move to the resolved device once per run (the samples FDML's
devices draw afresh each round move as they are drawn); what crosses into the enclave is copied back to
host memory as numpy arrays (the enclave stays on the CPU, as a TEE would), and so is every reply.

On the CPU, ``device: cpu`` and ``auto`` compute exactly what fedveil computed before it had the
setting: no tensor is copied or converted on the way (``Tensor.to`` and ``Tensor.cpu`` return a CPU
tensor itself). Importing this module does not import torch (a config check or a command's options
stay light); resolving does.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fedveil.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DEVICE_SPECS", "check_device_spec", "module_device", "resolve_device", "synchronize"]

DEVICE_SPECS = "auto, cpu, cuda or cuda:N"
"""The spellings a ``device`` setting accepts, as error messages and help texts name them."""

_SPEC = re.compile(r"auto|cpu|cuda(:(0|[1-9][0-9]*))?")


def check_device_spec(spec: str) -> str:
    """``spec`` if it is spelled as a ``device`` setting (:data:`DEVICE_SPECS`), else a
    :class:`~fedveil.errors.ConfigError` naming it. Says nothing about this machine's devices
    (:func:`resolve_device` does): a config written for a GPU machine loads anywhere."""
    if not isinstance(spec, str) or _SPEC.fullmatch(spec) is None:
        raise ConfigError(f"device: {spec!r} is not one of {DEVICE_SPECS} (e.g. cuda:0)")
    return spec


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """The :class:`torch.device` that ``spec`` (:data:`DEVICE_SPECS`, or a device) names on this machine.

    ``auto`` is ``cuda`` when :func:`torch.cuda.is_available` and ``cpu`` otherwise. ``cuda`` and
    ``cuda:N`` need a CUDA device (and ``N`` below :func:`torch.cuda.device_count`): a
    :class:`~fedveil.errors.ConfigError` naming the value says what this machine has instead.

    A GPU comes back with its index, ``cuda:N`` (``cuda``, and ``auto`` on a GPU machine, are the current
    GPU, :func:`torch.cuda.current_device`), as a tensor's ``device`` names it: every report and record
    that writes ``str()`` of a resolved device spells one GPU one way, whichever spelling asked for it."""
    import torch

    text = str(spec) if isinstance(spec, torch.device) else check_device_spec(spec)
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    if not text.startswith("cuda"):
        raise ConfigError(f"device: {text!r} is not one of {DEVICE_SPECS}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device: {text!r} asks for CUDA, but torch {torch.__version__} sees no CUDA device on this "
            "machine: use device cpu (or auto), or a torch build and machine with a GPU"
        )
    device = torch.device(text)
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if device.index >= count:
        raise ConfigError(
            f"device: {text!r} names GPU {device.index}, but this machine has {count} "
            f"(cuda:0 to cuda:{count - 1}): choose one of them or cuda"
        )
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device runs kernels asynchronously): a timer read
    after it measures the work, not its launch. On the CPU it returns at once."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters are (the CPU for a module without any): where its inputs go."""
    import torch

    return next((p.device for p in module.parameters()), torch.device("cpu"))
