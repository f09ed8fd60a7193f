"""The image classifiers of PPFL's Table 1 (Sec. 5.2) and DLG's sigmoid LeNet.

Table 1 writes each network as a chain: ``C<n>`` a convolution with ``n`` filters (5 x 5 in LeNet, 3 x 3
in AlexNet, VGG9 and VGG16), ``FC<n>`` a fully connected layer, ``MP`` max pooling, ``AP<s>`` average
pooling with stride ``s``, ``D<p>`` dropout with rate ``p``; "all C and FC layers are followed by ReLU".
We read that as every layer but the output ``FC<num_classes>``: a ReLU on the logits would clamp every
negative logit to 0 and stop its gradient, and none of the cited networks has one. Pooling is 2 x 2 with
stride 2 unless the table gives a stride. Built here, with the parameter counts (weights + biases, plus
BatchNorm's two affine vectors) for 10 classes on MNIST ``(1, 28, 28)`` / CIFAR-10 ``(3, 32, 32)``:

=============  ==================================================================  ==========  ==========
network        Table 1 (``x2`` = twice)                                            28x28x1     32x32x3
=============  ==================================================================  ==========  ==========
LeNet          C20-MP-C50-MP-FC500-FC10                                             1,256,080   1,632,080
AlexNet        C128x3-AP16-FC10                                                       297,738     303,882
VGG9           C32-C64-MP-C128x2-MP-D0.05-C256x2-MP-D0.1-FC512x2-FC10               2,573,450   3,491,530
VGG16          C64x2-MP-C128x2-MP-C256x3-C512x3-MP-FC4096x2-FC1000-FC10            47,400,898  62,082,114
MobileNetV2    unmodified (Sandler et al. 2018)                                     2,236,106   2,236,682
DLG LeNet      Zhu et al. 2019: 3 x (C12 5x5, sigmoid), FC                             13,426      15,826
=============  ==================================================================  ==========  ==========

Readings the table leaves open, and what we chose:

* **LeNet** has McMahan et al. (2017)'s MNIST CNN shape (two 5 x 5 convolutions, each followed by 2 x 2
  max pooling, one hidden FC layer) with LeCun's widths 20/50/500. The convolutions use padding 2
  ("same", as in McMahan et al.'s CNN, whose 1,663,370 parameters imply 7 x 7 maps before the FC layer),
  so 28 -> 28 -> MP 14 -> 14 -> MP 7 and ``FC500`` takes 50 * 7 * 7 = 2,450 inputs; on 32 x 32 it is
  50 * 8 * 8 = 3,200. (Caffe's unpadded LeNet would give 50 * 4 * 4 = 800 inputs and 431,080 parameters.)
* **AlexNet** is Belilovsky et al. (2019)'s greedy layer-wise CNN: three size-preserving (padding 1) 3 x 3
  convolutions of 128 filters, then average pooling with a 16 x 16 window and stride 16, so 32 x 32 gives
  2 x 2 x 128 = 512 features and 28 x 28 gives 1 x 1 x 128 = 128.
* **VGG9** is FedMA's VGG-9 (Wang et al. 2020; padding 1; 3,491,530 parameters on CIFAR-10, as they
  report). ``D0.05`` drops whole feature maps (``nn.Dropout2d``, as in FedMA's code), ``D0.1`` single
  features; FedMA's extra dropout before the output layer is not in the table and not built.
* **VGG16** is built exactly as the table writes it: 10 convolutions (64, 64, 128, 128, 256 x 3,
  512 x 3; padding 1) with 3 max poolings, then FC4096-FC4096-FC1000-FC10 without dropout. Simonyan &
  Zisserman's configuration D has 13 convolutions (a second 512 x 3 block) and 5 poolings, ends at FC1000
  and has 138,357,544 parameters at 224 x 224; the table's network has a fourth FC layer for the 10
  CIFAR-10 classes, and its first FC layer sees 512 * 4 * 4 = 8,192 features on 32 x 32 (512 * 3 * 3 on
  28 x 28). It is meant for 32 x 32: on 224 x 224 that layer would hold 512 * 28 * 28 * 4096 weights.
* **MobileNetV2** is Sandler et al. (2018) unchanged (width 1.0, torchvision's layer order and
  initialisation): 3,504,872 parameters with 1,000 classes; only the stem's input channels and the
  output layer depend on ``in_channels`` and ``num_classes``. (Table 1 says "68 layers"; the network has
  52 convolutions, 52 BatchNorms and 1 FC layer, whatever the count means.)

**Layer units.** For PPFL's greedy layer-wise training (Sec. 4.2, Algorithms 1-2: train layer ``l``
inside the TEE atop the frozen layers ``1..l-1``) every network is an ordered list of *layer units*,
:meth:`LayerwiseNet.layer_units`, and ``forward(x)`` is exactly ``u_L(...u_2(u_1(x)))``. A unit is one
trainable layer together with the parameter-free operations that follow it up to the next trainable layer
(activation, pooling, dropout), so every parameter lies in exactly one unit. The first FC unit starts with
``nn.Flatten``, so convolutional units output feature maps ``(B, C, H, W)`` and FC units ``(B, F)``. The
last unit is the output layer, also reachable as :attr:`LayerwiseNet.classifier`. MobileNetV2's units are
its stem, each of its 17 inverted-residual blocks, its last 1 x 1 convolution (with the global average
pooling and the 0.2 dropout that follow it) and the classifier.

The DLG network (Zhu et al., NeurIPS 2019, "Deep Leakage from Gradients", ``LeNet`` in their code) has
three 5 x 5 convolutions of 12 channels, padding 2, strides 2, 2, 1, each followed by a sigmoid, then one
FC layer: 12 * 8 * 8 = 768 inputs on 32 x 32, 12 * 7 * 7 = 588 on 28 x 28. Their code initialises every
weight and bias from ``uniform(-0.5, 0.5)`` (:func:`dlg_uniform_init_`), which :class:`LeNetSigmoid` does
by default.

Every network takes ``num_classes``, ``in_channels`` and ``image_size`` (the side of a square input) and
computes its flattened FC input size from them; an image too small for its poolings is a
:class:`~fedveil.errors.ConfigError` naming the size and the minimum (:attr:`LayerwiseNet.min_image_size`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from fedveil.errors import ConfigError

MOBILENETV2_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
"""Sandler et al. (2018), Table 2: ``(t, c, n, s)`` = expansion, output channels, repeats, first stride."""


def _check_count(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1, else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, not {value!r}")
    return value


def _pooled(side: int, times: int) -> int:
    """Side after ``times`` 2 x 2 max poolings of stride 2 (each rounds down)."""
    for _ in range(times):
        side //= 2
    return side


def _conv_unit(c_in: int, c_out: int, kernel: int, *after: nn.Module) -> nn.Sequential:
    """``C<c_out>``: a size-preserving ``kernel x kernel`` convolution, ReLU, then ``after``."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2), nn.ReLU(), *after)


def _fc_units(in_features: int, widths: list[int], num_classes: int) -> list[nn.Module]:
    """``Flatten``, then ``FC<w>`` + ReLU for each hidden width, then the output ``FC<num_classes>``."""
    units: list[nn.Module] = []
    flatten: list[nn.Module] = [nn.Flatten()]
    for width in widths:
        units.append(nn.Sequential(*flatten, nn.Linear(in_features, width), nn.ReLU()))
        in_features, flatten = width, []
    units.append(nn.Sequential(*flatten, nn.Linear(in_features, num_classes)))
    return units


class LayerwiseNet(nn.Module):
    """A classifier ``(B, in_channels, image_size, image_size)`` -> logits ``(B, num_classes)`` that is the
    composition of its layer units (module docstring): ``forward`` runs ``self.units`` in order."""

    min_image_size: ClassVar[int] = 1
    """The smallest ``image_size`` every pooling of the network still maps to at least one pixel."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.num_classes = _check_count("num_classes", num_classes)
        self.in_channels = _check_count("in_channels", in_channels)
        self.image_size = _check_count("image_size", image_size)
        if image_size < self.min_image_size:
            raise ConfigError(
                f"image_size {image_size} is too small for {type(self).__name__}: its poolings need "
                f"image_size >= {self.min_image_size}"
            )
        self.units = nn.ModuleList()

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(in_channels, image_size, image_size)``, the shape of one input."""
        return (self.in_channels, self.image_size, self.image_size)

    @property
    def classifier(self) -> nn.Module:
        """The output layer, i.e. the last layer unit."""
        return self.units[-1]

    def layer_units(self) -> list[nn.Module]:
        """The layer units in forward order; ``forward`` is their composition."""
        return list(self.units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, *input_shape)`` -> logits ``(B, num_classes)``: every unit applied in order."""
        for unit in self.units:
            x = unit(x)
        return x


class LeNet(LayerwiseNet):
    """Table 1 LeNet ``C20-MP-C50-MP-FC500-FC10`` with 5 x 5 convolutions of padding 2 (module docstring).

    Units: conv20 (+ReLU, MP), conv50 (+ReLU, MP), FC500 (+ReLU), FC<num_classes>. Two poolings need
    ``image_size >= 4``. 1,256,080 parameters on 28 x 28 x 1, 1,632,080 on 32 x 32 x 3 (10 classes).
    """

    min_image_size = 4

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__(num_classes, in_channels, image_size)
        side = _pooled(image_size, 2)
        self.units.extend(
            [
                _conv_unit(in_channels, 20, 5, nn.MaxPool2d(2)),
                _conv_unit(20, 50, 5, nn.MaxPool2d(2)),
                *_fc_units(50 * side * side, [500], num_classes),
            ]
        )


class AlexNet(LayerwiseNet):
    """Table 1 AlexNet ``C128x3-AP16-FC10``: Belilovsky et al. (2019)'s greedy layer-wise CNN.

    Units: three 3 x 3 conv128 (+ReLU; the third also ``AvgPool2d(16, stride=16)``), FC<num_classes>.
    The pooling needs ``image_size >= 16``. 297,738 parameters on 28 x 28 x 1, 303,882 on 32 x 32 x 3.
    """

    min_image_size = 16

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__(num_classes, in_channels, image_size)
        side = (image_size - 16) // 16 + 1
        self.units.extend(
            [
                _conv_unit(in_channels, 128, 3),
                _conv_unit(128, 128, 3),
                _conv_unit(128, 128, 3, nn.AvgPool2d(16, stride=16)),
                *_fc_units(128 * side * side, [], num_classes),
            ]
        )


class VGG9(LayerwiseNet):
    """Table 1 VGG9 ``C32-C64-MP-C128x2-MP-D0.05-C256x2-MP-D0.1-FC512x2-FC10``: FedMA's VGG-9.

    Units: conv32, conv64 (+MP), conv128, conv128 (+MP, Dropout2d 0.05), conv256, conv256 (+MP,
    Dropout 0.1), FC512, FC512, FC<num_classes>; 3 x 3 convolutions of padding 1, ReLU after each hidden
    layer. Three poolings need ``image_size >= 8``. 2,573,450 parameters on 28 x 28 x 1, 3,491,530 (FedMA's
    count) on 32 x 32 x 3.
    """

    min_image_size = 8

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__(num_classes, in_channels, image_size)
        side = _pooled(image_size, 3)
        self.units.extend(
            [
                _conv_unit(in_channels, 32, 3),
                _conv_unit(32, 64, 3, nn.MaxPool2d(2)),
                _conv_unit(64, 128, 3),
                _conv_unit(128, 128, 3, nn.MaxPool2d(2), nn.Dropout2d(0.05)),
                _conv_unit(128, 256, 3),
                _conv_unit(256, 256, 3, nn.MaxPool2d(2), nn.Dropout(0.1)),
                *_fc_units(256 * side * side, [512, 512], num_classes),
            ]
        )


class VGG16(LayerwiseNet):
    """Table 1 VGG16 ``C64x2-MP-C128x2-MP-C256x3-C512x3-MP-FC4096x2-FC1000-FC10``, as the table writes it.

    Units: conv64, conv64 (+MP), conv128, conv128 (+MP), conv256 x 3, conv512 x 2, conv512 (+MP),
    FC4096, FC4096, FC1000, FC<num_classes>; 3 x 3 convolutions of padding 1, ReLU after each hidden layer,
    no dropout. This is not Simonyan & Zisserman's VGG16 (configuration D: 13 convolutions, 5 poolings,
    FC4096-FC4096-FC1000, 138,357,544 parameters): the table lists 10 convolutions, 3 poolings and an added
    FC10. Three poolings need ``image_size >= 8``. 47,400,898 parameters on 28 x 28 x 1, 62,082,114 on
    32 x 32 x 3.
    """

    min_image_size = 8

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__(num_classes, in_channels, image_size)
        side = _pooled(image_size, 3)
        self.units.extend(
            [
                _conv_unit(in_channels, 64, 3),
                _conv_unit(64, 64, 3, nn.MaxPool2d(2)),
                _conv_unit(64, 128, 3),
                _conv_unit(128, 128, 3, nn.MaxPool2d(2)),
                _conv_unit(128, 256, 3),
                _conv_unit(256, 256, 3),
                _conv_unit(256, 256, 3),
                _conv_unit(256, 512, 3),
                _conv_unit(512, 512, 3),
                _conv_unit(512, 512, 3, nn.MaxPool2d(2)),
                *_fc_units(512 * side * side, [4096, 4096, 1000], num_classes),
            ]
        )


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    """MobileNetV2's ``conv (no bias) -> BatchNorm`` with ``(kernel - 1) // 2`` padding."""
    conv = nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
    return [conv, nn.BatchNorm2d(c_out)]


class InvertedResidual(nn.Module):
    """Sandler et al. (2018), Table 1: ``1x1 expand (t) -> 3x3 depthwise (stride s) -> 1x1 linear project``,
    BatchNorm after each convolution, ReLU6 after the first two, and a skip connection when the stride is 1
    and the channel count is unchanged. With ``t = 1`` the expansion is left out."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [*_conv_bn(c_in, hidden, 1), nn.ReLU6()]
        layers += [
            *_conv_bn(hidden, hidden, 3, stride, groups=hidden),
            nn.ReLU6(),
            *_conv_bn(hidden, c_out, 1),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, c_in, H, W)`` -> ``(B, c_out, H / s, W / s)`` (rounded up)."""
        out = self.conv(x)
        return x + out if self.residual else out


class MobileNetV2(LayerwiseNet):
    """MobileNetV2 (Sandler et al. 2018), unmodified, width multiplier 1.0 (PPFL Table 1, Sec. 6.6).

    Units: stem ``conv3x3(32, stride 2) -> BN -> ReLU6``; the 17 inverted-residual blocks of
    :data:`MOBILENETV2_SETTINGS`; ``conv1x1(1280) -> BN -> ReLU6 -> global average pool -> Dropout(0.2)``;
    the classifier ``Flatten -> FC<num_classes>``. Initialised as torchvision does (convolutions Kaiming
    normal with fan-out, BatchNorm 1 / 0, FC normal(0, 0.01) with zero bias). Every stride-2 layer pads, so
    any ``image_size >= 1`` works. 3,504,872 parameters with 1,000 classes; 2,236,106 on 28 x 28 x 1 and
    2,236,682 on 32 x 32 x 3 with 10 classes. In train mode BatchNorm updates its running statistics in
    place, which ``torch.func`` transforms (``vmap``/``grad``) reject; batched per-client training needs
    ``torch.func.replace_all_batch_norm_modules_`` first (eval mode works as is).
    """

    last_channels: ClassVar[int] = 1280

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__(num_classes, in_channels, image_size)
        self.units.append(nn.Sequential(*_conv_bn(in_channels, 32, 3, 2), nn.ReLU6()))
        c_in = 32
        for expand, c_out, repeats, stride in MOBILENETV2_SETTINGS:
            for i in range(repeats):
                self.units.append(InvertedResidual(c_in, c_out, stride if i == 0 else 1, expand))
                c_in = c_out
        self.units.append(
            nn.Sequential(
                *_conv_bn(c_in, self.last_channels, 1),
                nn.ReLU6(),
                nn.AdaptiveAvgPool2d(1),
                nn.Dropout(0.2),
            )
        )
        self.units.append(nn.Sequential(nn.Flatten(), nn.Linear(self.last_channels, num_classes)))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)


def dlg_uniform_init_(module: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """DLG's ``weights_init`` (Zhu et al. 2019, their code): every parameter from ``uniform(-0.5, 0.5)``.

    Parameters are drawn in ``module.parameters()`` order (each layer's weight, then its bias), the order
    their ``net.apply(weights_init)`` visits them; ``generator`` (default: torch's global RNG) makes it
    reproducible. Returns ``module``.
    """
    with torch.no_grad():
        for param in module.parameters():
            param.uniform_(-0.5, 0.5, generator=generator)
    return module


class LeNetSigmoid(LayerwiseNet):
    """DLG's ``LeNet`` (Zhu et al., NeurIPS 2019, "Deep Leakage from Gradients", their code).

    Units: three ``conv5x5(12, padding 2) -> Sigmoid`` with strides 2, 2, 1, then ``Flatten ->
    FC<num_classes>`` with ``12 * s * s`` inputs, ``s = ceil(ceil(image_size / 2) / 2)``: 768 on 32 x 32,
    588 on 28 x 28. Padding keeps every side >= 1, so any ``image_size >= 1`` works. With ``dlg_init``
    (the default, as in their experiments) all parameters are redrawn by :func:`dlg_uniform_init_` from
    ``generator``; otherwise PyTorch's default initialisation stays. 13,426 parameters on 28 x 28 x 1,
    15,826 on 32 x 32 x 3 (10 classes).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        *,
        dlg_init: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_classes, in_channels, image_size)
        side = image_size
        for stride in (2, 2, 1):
            side = (side - 1) // stride + 1
        self.units.extend(
            [
                nn.Sequential(nn.Conv2d(in_channels, 12, 5, stride=2, padding=2), nn.Sigmoid()),
                nn.Sequential(nn.Conv2d(12, 12, 5, stride=2, padding=2), nn.Sigmoid()),
                nn.Sequential(nn.Conv2d(12, 12, 5, stride=1, padding=2), nn.Sigmoid()),
                nn.Sequential(nn.Flatten(), nn.Linear(12 * side * side, num_classes)),
            ]
        )
        if dlg_init:
            dlg_uniform_init_(self, generator)

    @property
    def fc_in_features(self) -> int:
        """Inputs of the FC layer, ``12 * s * s`` (768 on 32 x 32, 588 on 28 x 28)."""
        return self.units[-1][1].in_features
