"""The model zoo: PPFL's Table 1 networks and DLG's sigmoid LeNet by name ([PPFL] Sec. 5.2).

:func:`build_model` is how experiments pick a network: ``lenet``, ``alexnet``, ``vgg9``, ``vgg16`` and
``mobilenetv2`` are PPFL's Table 1 (see :mod:`fedveil.models.vision` for how each reading of the table
was made and its parameter counts), ``lenet-sigmoid`` is the LeNet of Zhu et al. (2019), "Deep Leakage
from Gradients", with their ``uniform(-0.5, 0.5)`` initialisation. Every zoo model is a
:class:`~fedveil.models.vision.LayerwiseNet`: ``forward`` is the composition of its ``layer_units()``,
the units PPFL's greedy layer-wise training (Sec. 4.2) trains one at a time.

Importing this module loads torch and, besides it, only :mod:`fedveil.errors` and
:mod:`fedveil.models.vision`.
"""

from __future__ import annotations

import torch
from torch import nn

from fedveil.errors import ConfigError
from fedveil.models.vision import VGG9, VGG16, AlexNet, LayerwiseNet, LeNet, LeNetSigmoid, MobileNetV2

__all__ = ["INITS", "MODELS", "build_model", "count_parameters", "darknet_bound", "darknet_init_"]

MODELS: dict[str, type[LayerwiseNet]] = {
    "lenet": LeNet,
    "alexnet": AlexNet,
    "vgg9": VGG9,
    "vgg16": VGG16,
    "mobilenetv2": MobileNetV2,
    "lenet-sigmoid": LeNetSigmoid,
}
"""Zoo name -> network class; every class takes ``(num_classes, in_channels, image_size)``."""

INITS = ("torch", "darknet")
"""How :func:`build_model` draws the initial parameters: ``torch``, each layer's PyTorch default
(Kaiming-uniform with ``a = sqrt(5)``: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``); ``darknet``, Darknet's
(:func:`darknet_init_`)."""


def darknet_bound(fan_in: int) -> float:
    """Darknet's uniform bound for a layer with ``fan_in`` inputs per output: ``sqrt(2 / fan_in)``."""
    return (2.0 / fan_in) ** 0.5


def darknet_init_(model: nn.Module) -> nn.Module:
    """Darknet's initialisation, in place: every convolution's and fully connected layer's weights from
    ``U(-s, s)`` with ``s = sqrt(2 / fan_in)`` and their biases zero (``make_convolutional_layer`` and
    ``make_connected_layer``: ``scale * rand_uniform(-1, 1)``, biases from ``calloc``).

    PPFL's implementation trains in Darknet (Sec. 5), so this is how its
    networks start. The weights' variance, ``2 / (3 fan_in)``, is twice PyTorch's default: a deep ReLU
    network without batch norm such as VGG9 keeps a usable signal from it, where PyTorch's default leaves
    VGG9 at chance for several epochs at PPFL's learning rate. Other parameters (batch norm) keep their
    defaults, which are Darknet's too (scales one, shifts zero)."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            bound = darknet_bound(module.weight[0].numel())
            with torch.no_grad():
                module.weight.uniform_(-bound, bound)
                if module.bias is not None:
                    module.bias.zero_()
    return model


def build_model(
    name: str,
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 28,
    seed: int | None = None,
    init: str = "torch",
) -> nn.Module:
    """The zoo network ``name`` (a key of :data:`MODELS`) for ``(in_channels, image_size, image_size)``
    inputs and ``num_classes`` outputs, its parameters drawn as ``init`` says (:data:`INITS`).

    With ``seed`` the initial parameters are drawn from ``torch.manual_seed(seed)`` inside
    :func:`torch.random.fork_rng`, so the same seed gives the same parameters and torch's global RNG is
    left as it was; without one they come from the global RNG. Unknown names, sizes the network cannot
    take and bad seeds raise :class:`~fedveil.errors.ConfigError`.
    """
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"seed must be None or an integer >= 0, not {seed!r}")
    if init not in INITS:
        raise ConfigError(f"unknown initialisation {init!r}; choose one of {', '.join(INITS)}")
    network = MODELS[name]

    def make() -> nn.Module:
        model = network(num_classes, in_channels, image_size)
        return darknet_init_(model) if init == "darknet" else model

    if seed is None:
        return make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model`` (trainable or frozen; buffers such as BatchNorm's running
    statistics are not parameters)."""
    return sum(p.numel() for p in model.parameters())
