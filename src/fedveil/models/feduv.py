"""The user-verification networks of FedUV's Table 2 and its positive-only loss.

Table 2 (Appendix B), read layer by layer; ``convxd(c1, c2, k, p)`` has padding ``p = 1`` unless
stated, every block is ``conv -> relu -> max_pool(s) -> GN(2)`` (``nn.GroupNorm(2, c2)``), then
``Flatten -> FC(1024, c) -> Scaling`` (Scaling only for FedUV). ``c`` is the code length for FedUV and
the number of users for softmax and FedAwS. The blocks and their feature maps for the paper's inputs::

    VoxCeleb (1, 16384)   conv1d(1, 64, 15)    pool 4 -> (64, 4093)
                          conv1d(64, 128, 9)   pool 8 -> (128, 511)
                          conv1d(128, 256, 7)  pool 8 -> (256, 64)
                          conv1d(256, 512, 5)  pool 8 -> (512, 8)
                          conv1d(512, 1024, 3) pool 8 -> (1024, 1)
    CelebA (3, 64, 64)    conv2d(3, 64, 3)     pool 2 -> (64, 32, 32)
                          conv2d(64, 128, 3)   pool 2 -> (128, 16, 16)
                          conv2d(128, 256, 3)  pool 2 -> (256, 8, 8)
                          conv2d(256, 512, 3)  pool 2 -> (512, 4, 4)
                          conv2d(512, 1024, 3) pool 4 -> (1024, 1, 1)
    MNIST-UV (4, 28, 28)  conv2d(4, 64, 3, p=3) pool 2 -> (64, 16, 16)
                          conv2d(64, 128, 3)   pool 2 -> (128, 8, 8)
                          conv2d(128, 256, 3)  pool 2 -> (256, 4, 4)
                          conv2d(256, 512, 3)  pool 2 -> (512, 2, 2)
                          conv2d(512, 1024, 3) pool 2 -> (1024, 1, 1)

VoxCeleb needs one reading the table leaves open. With ``p = 1`` the convolutions shorten the signal
by ``k - 3`` samples (16384 -> 16372 -> pool -> 4093 -> 4087 -> ...), and floor-rounded pooling would
reach length 7 before the last ``max_pool1d(8)``, i.e. an empty output. We keep the table's kernels
and padding and round the VoxCeleb poolings up (``ceil_mode=True``): 4093 -> 511 -> 64 -> 8 -> 1, so
``Flatten`` gives the 1024 features ``FC(1024, c)`` expects. (Length-preserving padding ``p = k // 2``
would also reach 1; it contradicts the stated default ``p = 1``.) Padding and pooling hold no
parameters, so the counts below do not depend on this choice.

Parameters (weights + biases of the convolutions, GroupNorm affine, FC with bias):
feature extractor ``g_theta`` VoxCeleb 2,538,240; CelebA 6,274,560; MNIST-UV 6,275,136; plus
``1025 * c`` for ``FC(1024, c)`` (e.g. 130,175 for ``c = 127``, 1,025,000 for 1,000 users).

The positive loss (Eq. 4 with Alg. 2's scaling) is
``l_pos = max(0, 1 - (1/c) v_y^T sigma(W g_theta(x)))`` with ``sigma`` the :class:`Scaling` layer; by
Lemma 1 it is 0 exactly when ``sigma(W g_theta(x)) = v_y``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedveil.errors import ConfigError, ValidationError

EMBEDDING_DIM = 1024
"""Width of ``g_theta(x)``, the input of ``FC(1024, c)`` in all three nets."""

GROUPS = 2
"""``GN(2)``: GroupNorm with two groups after every block."""


class Scaling(nn.Module):
    """Alg. 2's ``sigma``: scale ``z`` ``(..., c)`` to norm ``sqrt(c)``, i.e. ``sqrt(c) z / ||z||``.

    A zero vector stays zero (the norm is clamped below by ``eps``) instead of becoming NaN.
    """

    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``(..., c)`` -> ``(..., c)`` with every last-axis vector of norm ``sqrt(c)``."""
        norm = torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min(self.eps)
        return z * (math.sqrt(z.shape[-1]) / norm)


def _block(dims: int, c_in: int, c_out: int, kernel: int, pool: int, padding: int = 1) -> list[nn.Module]:
    """One Table 2 block: ``convxd(c_in, c_out, k, p) -> relu -> max_poolxd(pool) -> GN(2)``."""
    if dims == 1:
        conv: nn.Module = nn.Conv1d(c_in, c_out, kernel, padding=padding)
        pooling: nn.Module = nn.MaxPool1d(pool, ceil_mode=True)
    else:
        conv = nn.Conv2d(c_in, c_out, kernel, padding=padding)
        pooling = nn.MaxPool2d(pool)
    return [conv, nn.ReLU(), pooling, nn.GroupNorm(GROUPS, c_out)]


class UvNet(nn.Module):
    """``x -> g_theta(x)`` (``features``, flattened to 1024) ``-> FC(1024, c)`` ``[-> Scaling]``.

    ``num_outputs`` is ``c``: the code length for FedUV (with ``scaling=True``), the number of users
    for softmax and FedAwS (``scaling=False``; the rows of ``fc.weight`` are then the class
    embeddings). ``bias=False`` drops the FC bias, for methods that read ``W`` as class embeddings.
    """

    input_shape: tuple[int, ...] = ()

    def __init__(
        self, blocks: list[nn.Module], num_outputs: int, *, scaling: bool, bias: bool = True
    ) -> None:
        super().__init__()
        if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
            raise ConfigError(f"num_outputs (c) must be a positive integer, not {num_outputs!r}")
        self.features = nn.Sequential(*blocks, nn.Flatten())
        self.fc = nn.Linear(EMBEDDING_DIM, num_outputs, bias=bias)
        self.scale: nn.Module = Scaling() if scaling else nn.Identity()

    @property
    def num_outputs(self) -> int:
        """``c``, the FC output size."""
        return self.fc.out_features

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """``g_theta(x)``: inputs ``(B, *input_shape)`` -> embeddings ``(B, 1024)``."""
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, *input_shape)`` -> ``(B, c)``: ``sigma(W g_theta(x))``, or ``W g_theta(x)`` unscaled."""
        return self.scale(self.fc(self.embed(x)))


class VoxCelebNet(UvNet):
    """Table 2, VoxCeleb column: raw audio ``(B, 1, 16384)`` (2 s at 8 kHz) -> ``(B, c)``.

    conv1d(1, 64, 15) pool 4, conv1d(64, 128, 9) pool 8, conv1d(128, 256, 7) pool 8,
    conv1d(256, 512, 5) pool 8, conv1d(512, 1024, 3) pool 8; all ``p = 1``, ReLU, GN(2), pooling
    rounded up (module docstring). ``g_theta`` has 2,538,240 parameters.
    """

    input_shape = (1, 2**14)

    def __init__(self, num_outputs: int, *, scaling: bool, bias: bool = True) -> None:
        blocks = [
            *_block(1, 1, 64, 15, 4),
            *_block(1, 64, 128, 9, 8),
            *_block(1, 128, 256, 7, 8),
            *_block(1, 256, 512, 5, 8),
            *_block(1, 512, 1024, 3, 8),
        ]
        super().__init__(blocks, num_outputs, scaling=scaling, bias=bias)


class CelebANet(UvNet):
    """Table 2, CelebA column: faces ``(B, 3, 64, 64)`` -> ``(B, c)``.

    conv2d(3, 64, 3), conv2d(64, 128, 3), conv2d(128, 256, 3), conv2d(256, 512, 3) each with pool 2,
    conv2d(512, 1024, 3) with pool 4; all ``p = 1``, ReLU, GN(2). ``g_theta`` has 6,274,560 parameters.
    """

    input_shape = (3, 64, 64)

    def __init__(self, num_outputs: int, *, scaling: bool, bias: bool = True) -> None:
        blocks = [
            *_block(2, 3, 64, 3, 2),
            *_block(2, 64, 128, 3, 2),
            *_block(2, 128, 256, 3, 2),
            *_block(2, 256, 512, 3, 2),
            *_block(2, 512, 1024, 3, 4),
        ]
        super().__init__(blocks, num_outputs, scaling=scaling, bias=bias)


class MnistUvNet(UvNet):
    """Table 2, MNIST-UV column: four 28 x 28 digit images as channels ``(B, 4, 28, 28)`` -> ``(B, c)``.

    conv2d(4, 64, 3, p=3), conv2d(64, 128, 3), conv2d(128, 256, 3), conv2d(256, 512, 3),
    conv2d(512, 1024, 3), each ``p = 1`` unless stated, pool 2, ReLU, GN(2). The first padding of 3
    grows 28 to 32 so five poolings reach 1 x 1. ``g_theta`` has 6,275,136 parameters.
    """

    input_shape = (4, 28, 28)

    def __init__(self, num_outputs: int, *, scaling: bool, bias: bool = True) -> None:
        blocks = [
            *_block(2, 4, 64, 3, 2, padding=3),
            *_block(2, 64, 128, 3, 2),
            *_block(2, 128, 256, 3, 2),
            *_block(2, 256, 512, 3, 2),
            *_block(2, 512, 1024, 3, 2),
        ]
        super().__init__(blocks, num_outputs, scaling=scaling, bias=bias)


UV_NETS: dict[str, type[UvNet]] = {"voxceleb": VoxCelebNet, "celeba": CelebANet, "mnist_uv": MnistUvNet}


def build_uv_net(dataset: str, num_outputs: int, *, scaling: bool, bias: bool = True) -> UvNet:
    """The Table 2 net for ``dataset`` (a key of :data:`UV_NETS`) with ``c = num_outputs`` outputs."""
    if dataset not in UV_NETS:
        raise ConfigError(f"no Table 2 network for dataset {dataset!r}; choose one of {sorted(UV_NETS)}")
    return UV_NETS[dataset](num_outputs, scaling=scaling, bias=bias)


def feduv_scores(outputs: torch.Tensor, codewords: torch.Tensor) -> torch.Tensor:
    """Eq. 5 / Alg. 2 scores ``e = (1/c) v_y^T sigma(W g_theta(x))``, one per row: ``(B,)``.

    ``outputs`` are the scaled network outputs; ``codewords`` the ``{-1, +1}`` vectors, one shared
    ``(c,)`` (one user's data) or one per row ``(B, c)``. With ``||outputs|| = sqrt(c)`` a score lies in
    ``[-1, 1]``; warm-up and verification threshold it.
    """
    if outputs.ndim != 2:
        raise ValidationError(f"outputs must have shape (B, c), not {tuple(outputs.shape)}")
    c = outputs.shape[1]
    if codewords.shape not in ((c,), tuple(outputs.shape)):
        raise ValidationError(
            f"codewords must have shape ({c},) or {tuple(outputs.shape)} to match outputs, "
            f"not {tuple(codewords.shape)}"
        )
    return (outputs * codewords.to(outputs.dtype)).sum(dim=1) / c


def feduv_positive_loss(outputs: torch.Tensor, codewords: torch.Tensor) -> torch.Tensor:
    """FedUV's positive loss (Eq. 4, Alg. 2): ``mean_b max(0, 1 - (1/c) v_y^T sigma(W g_theta(x_b)))``.

    ``outputs`` ``(B, c)`` are ``sigma(W g_theta(x))`` (a :class:`UvNet` with ``scaling=True``);
    ``codewords`` ``(c,)`` or ``(B, c)`` in ``{-1, +1}``. Returns a scalar in ``[0, 2]``.
    """
    return torch.relu(1.0 - feduv_scores(outputs, codewords)).mean()
