"""Face models of the AIoT paper (Sec. 5.2): MobileFaceNet and the ArcFace head.

:class:`MobileFaceNet` is Chen et al. (2018)'s network ("MobileFaceNets: Efficient CNNs for Accurate
Real-Time Face Verification on Mobile Devices", Table 1) at 112 x 112 x 3, with the AIoT paper's
512-dimensional embedding:

====================  ==================================  ==========
input                 operator                            t, c, n, s
====================  ==================================  ==========
112 x 112 x 3         conv 3x3                            -, 64, 1, 2
56 x 56 x 64          depthwise conv 3x3                  -, 64, 1, 1
56 x 56 x 64          bottleneck                          2, 64, 5, 2
28 x 28 x 64          bottleneck                          4, 128, 1, 2
14 x 14 x 128         bottleneck                          2, 128, 6, 1
14 x 14 x 128         bottleneck                          4, 128, 1, 2
7 x 7 x 128           bottleneck                          2, 128, 2, 1
7 x 7 x 128           conv 1x1                            -, 512, 1, 1
7 x 7 x 512           linear GDConv 7x7                   -, 512, 1, 1
1 x 1 x 512           linear conv 1x1                     -, 512, 1, 1
====================  ==================================  ==========

Every convolution is followed by BatchNorm; PReLU follows all but the linear ones; a bottleneck
(MobileNetV2's inverted residual: 1x1 expansion by ``t``, 3x3 depthwise with stride ``s``, linear 1x1
projection) adds its input when ``s = 1`` and the channels agree; the first of ``n`` repeated bottlenecks
has stride ``s``, the others 1. The embedding is the last layer's 512 outputs after a final BatchNorm.
``width`` scales every channel count (a reduction for runs on a small machine; ``width=1`` is the paper's
network, 1.20M parameters with the 512-d embedding, as AIoT Table 3 says) and ``image_size`` may be any
multiple of 16 (the global depthwise convolution covers the last feature map whatever its side).

:class:`ArcFace` (Deng et al. 2019, Eq. 3): logits ``s * cos(theta_j)`` for every class ``j`` but the
label, ``s * cos(theta_y + m)`` for the label, with ``cos(theta_j)`` between the L2-normalised embedding
and class weight; where ``theta_y + m`` would pass pi, insightface's fallback
``cos(theta_y) - m * sin(m)`` keeps the logit monotone. Scale 64 and margin 0.5, the AIoT paper's
setting, by default.

:class:`ResNet34Embedding` is He et al. (2016)'s ResNet-34 (basic blocks ``[3, 4, 6, 3]`` of 64, 128, 256,
512 channels after a 7 x 7 stride-2 convolution and a max pooling, then global average pooling) whose
classifier is replaced by a linear map to a 64-d embedding: FDML's CameraAuth network (Sec. VII-B). Its
backbone has torchvision's 21,284,672 parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedveil.errors import ConfigError

__all__ = ["ArcFace", "MobileFaceNet", "ResNet34Embedding"]

BOTTLENECKS: tuple[tuple[int, int, int, int], ...] = (
    (2, 64, 5, 2),
    (4, 128, 1, 2),
    (2, 128, 6, 1),
    (4, 128, 1, 2),
    (2, 128, 2, 1),
)
"""Chen et al. (2018) Table 1: ``(t, c, n, s)`` of each bottleneck group."""


def _conv_bn(
    cin: int, cout: int, kernel: int, stride: int, *, groups: int = 1, act: bool = True
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(
            cin, cout, kernel, stride, padding=kernel // 2 if kernel == 3 else 0, groups=groups, bias=False
        ),
        nn.BatchNorm2d(cout),
    ]
    if act:
        layers.append(nn.PReLU(cout))
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    """MobileNetV2's inverted residual as MobileFaceNet uses it (PReLU; module docstring)."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            _conv_bn(cin, hidden, 1, 1),
            _conv_bn(hidden, hidden, 3, stride, groups=hidden),
            _conv_bn(hidden, cout, 1, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block, plus its input when the shapes agree."""
        out = self.body(x)
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """Chen et al. (2018) MobileFaceNet with an ``embedding_dim``-d output (module docstring)."""

    def __init__(self, embedding_dim: int = 512, *, image_size: int = 112, width: float = 1.0) -> None:
        super().__init__()
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ConfigError(f"embedding_dim {embedding_dim!r} must be an integer >= 1")
        if (
            isinstance(image_size, bool)
            or not isinstance(image_size, int)
            or image_size < 16
            or image_size % 16
        ):
            raise ConfigError(f"image_size {image_size!r} must be a multiple of 16 (the paper: 112)")
        if not (isinstance(width, (int, float)) and 0 < width <= 4):
            raise ConfigError(f"width {width!r} must lie in (0, 4] (1 is the paper's network)")

        def ch(c: int) -> int:
            return max(8, round(c * width / 8) * 8) if width != 1 else c

        self.embedding_dim = embedding_dim
        self.image_size = image_size
        self.width = float(width)
        stem = ch(64)
        layers: list[nn.Module] = [_conv_bn(3, stem, 3, 2), _conv_bn(stem, stem, 3, 1, groups=stem)]
        cin = stem
        for t, c, n, s in BOTTLENECKS:
            for i in range(n):
                layers.append(Bottleneck(cin, ch(c), s if i == 0 else 1, t))
                cin = ch(c)
        last = ch(512)
        side = image_size // 16
        layers += [
            _conv_bn(cin, last, 1, 1),
            nn.Sequential(nn.Conv2d(last, last, side, groups=last, bias=False), nn.BatchNorm2d(last)),
            nn.Sequential(nn.Conv2d(last, embedding_dim, 1, bias=False), nn.BatchNorm2d(embedding_dim)),
            nn.Flatten(),
        ]
        self.features = nn.Sequential(*layers)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(3, image_size, image_size)``."""
        return (3, self.image_size, self.image_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, 3, S, S)`` -> embeddings ``(B, embedding_dim)`` (not normalised)."""
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ConfigError(f"MobileFaceNet expects (B, {self.input_shape}) images, got {tuple(x.shape)}")
        return self.features(x)


class ArcFace(nn.Module):
    """ArcFace's additive angular margin head (module docstring): embeddings and labels -> logits."""

    def __init__(
        self, embedding_dim: int, num_classes: int, *, scale: float = 64.0, margin: float = 0.5
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ConfigError(f"an ArcFace head needs at least 2 classes (identities), not {num_classes}")
        if not (0 <= margin < math.pi / 2) or not scale > 0:
            raise ConfigError(f"ArcFace scale {scale} must be > 0 and margin {margin} in [0, pi/2)")
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_dim))
        nn.init.xavier_uniform_(self.weight)
        self.scale, self.margin = float(scale), float(margin)
        self._cos_m, self._sin_m = math.cos(margin), math.sin(margin)
        self._threshold = math.cos(math.pi - margin)
        self._fallback = math.sin(math.pi - margin) * margin

    def cosine(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``cos(theta_j)`` between each L2-normalised embedding and class weight: ``(B, classes)``."""
        return nn.functional.linear(nn.functional.normalize(embeddings), nn.functional.normalize(self.weight))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Logits with the margin on each example's label (Deng et al. 2019, Eq. 3)."""
        cos = self.cosine(embeddings).clamp(-1.0, 1.0)
        target = cos.gather(1, labels.view(-1, 1))
        sin = torch.sqrt((1.0 - target * target).clamp_min(0.0))
        shifted = target * self._cos_m - sin * self._sin_m
        shifted = torch.where(target > self._threshold, shifted, target - self._fallback)
        return self.scale * cos.scatter(1, labels.view(-1, 1), shifted)


NORMS = ("batch", "group")


def _norm(kind: str, channels: int) -> nn.Module:
    """BatchNorm, or GroupNorm with ``channels / 4`` groups (at most 32; Wu & He 2018)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(max(1, min(32, channels // 4)), channels)


class BasicBlock(nn.Module):
    """ResNet's two 3 x 3 convolutions with a shortcut (a 1 x 1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            _norm(norm, cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            _norm(norm, cout),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(body(x) + shortcut(x))``."""
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet34Embedding(nn.Module):
    """ResNet-34 with an ``embedding_dim``-d linear output (module docstring); any input side >= 32.

    ``width`` scales every channel count (multiples of 8; 1 is He et al.'s network) and ``norm`` chooses
    BatchNorm (``"batch"``, torchvision's) or GroupNorm (``"group"``: no dependence on the batch, for
    FDML's devices, whose batch is 8 photos of one person and whose test photos are embedded alone)."""

    def __init__(
        self, embedding_dim: int = 64, *, in_channels: int = 3, width: float = 1.0, norm: str = "batch"
    ) -> None:
        super().__init__()
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ConfigError(f"embedding_dim {embedding_dim!r} must be an integer >= 1")
        if not (math.isfinite(width) and 0 < width <= 4):
            raise ConfigError(f"width {width!r} must lie in (0, 4] (1 is the paper's ResNet-34)")
        if norm not in NORMS:
            raise ConfigError(f"norm {norm!r} is not one of {', '.join(NORMS)}")

        def ch(c: int) -> int:
            return max(8, 8 * round(c * width / 8))

        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, ch(64), 7, 2, 3, bias=False),
            _norm(norm, ch(64)),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        cin = ch(64)
        for cout, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(BasicBlock(cin, ch(cout), stride if i == 0 else 1, norm))
                cin = ch(cout)
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.backbone = nn.Sequential(*layers)
        self.embedding = nn.Linear(cin, embedding_dim)
        self.embedding_dim = embedding_dim
        self.width, self.norm = width, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> embeddings ``(B, embedding_dim)``."""
        if x.ndim != 4 or min(x.shape[2:]) < 32:
            raise ConfigError(f"ResNet-34 expects (B, C, H, W) images with sides >= 32, got {tuple(x.shape)}")
        return self.embedding(self.backbone(x))
