"""Reconstruction quality: MSE, PSNR, SSIM per image, and matching a reconstructed batch to its originals.

Images are ``(B, C, H, W)`` tensors (or arrays) with pixel values in ``[0, 1]`` (data range ``L = 1``):

- ``mse``: the mean squared error over ``C * H * W`` pixels;
- ``psnr``: ``10 log10(L^2 / mse)`` dB (``inf`` for identical images);
- ``ssim``: the structural similarity of Wang, Bovik, Sheikh and Simoncelli, "Image Quality Assessment:
  From Error Visibility to Structural Similarity" (IEEE TIP 2004), Eq. 13,

      SSIM(x, y) = (2 mu_x mu_y + C1)(2 sigma_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(sigma_x^2 + sigma_y^2 + C2)),

  with ``C1 = (K1 L)^2``, ``C2 = (K2 L)^2``, ``K1 = 0.01``, ``K2 = 0.03``, the local statistics weighted by
  an 11 x 11 circular-symmetric Gaussian window of standard deviation 1.5 (Sec. III-C) at every position
  where the window fits inside the image ("valid"), the map averaged into the mean SSIM (Eq. 17), and the
  per-channel means averaged over channels. Images smaller than 11 pixels use the largest odd window that
  fits (same sigma).

A gradient inversion attack on a batch returns its images in an arbitrary order:
:func:`match_permutation` pairs each original with a reconstruction by the minimum-total-MSE assignment
(Hungarian algorithm, ``scipy.optimize.linear_sum_assignment``), and :func:`reconstruction_metrics` reports
every figure after that matching, labels compared under the same pairing.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numpy.typing import ArrayLike
from scipy.optimize import linear_sum_assignment
from torch.nn import functional as F

from fedveil.errors import ValidationError

__all__ = [
    "SSIM_K1",
    "SSIM_K2",
    "SSIM_SIGMA",
    "SSIM_WINDOW",
    "as_images",
    "gaussian_window",
    "match_permutation",
    "mse",
    "psnr",
    "reconstruction_metrics",
    "ssim",
]

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1 = 0.01
SSIM_K2 = 0.03
DATA_RANGE = 1.0


def as_images(images: torch.Tensor | ArrayLike, name: str) -> torch.Tensor:
    """``images`` as a float64 ``(B, C, H, W)`` tensor in host memory (where every metric is computed, a
    reconstruction made on a GPU included); a single ``(C, H, W)`` image becomes a batch of 1."""
    t = images.detach() if isinstance(images, torch.Tensor) else torch.as_tensor(np.asarray(images))
    if t.ndim == 3:
        t = t.unsqueeze(0)
    if t.ndim != 4 or min(t.shape) == 0:
        raise ValidationError(f"{name} has shape {tuple(t.shape)}: expected non-empty (B, C, H, W) images")
    t = t.to("cpu", torch.float64)
    if not torch.isfinite(t).all():
        raise ValidationError(f"{name} has NaN or inf pixels")
    return t


def _pair(
    original: torch.Tensor | ArrayLike, reconstructed: torch.Tensor | ArrayLike
) -> tuple[torch.Tensor, torch.Tensor]:
    a = as_images(original, "original")
    b = as_images(reconstructed, "reconstructed")
    if a.shape != b.shape:
        raise ValidationError(
            f"reconstructed images have shape {tuple(b.shape)}, the originals {tuple(a.shape)}: "
            "expected the same shape"
        )
    return a, b


def mse(original: torch.Tensor | ArrayLike, reconstructed: torch.Tensor | ArrayLike) -> torch.Tensor:
    """Mean squared error of each image pair, ``(B,)`` float64."""
    a, b = _pair(original, reconstructed)
    return (a - b).pow(2).flatten(1).mean(1)


def psnr(original: torch.Tensor | ArrayLike, reconstructed: torch.Tensor | ArrayLike) -> torch.Tensor:
    """Peak signal-to-noise ratio ``10 log10(1 / mse)`` in dB of each pair (data range 1), ``(B,)``."""
    m = mse(original, reconstructed)
    return torch.where(m > 0, 10.0 * torch.log10(DATA_RANGE**2 / m), torch.full_like(m, math.inf))


def gaussian_window(size: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> torch.Tensor:
    """The normalised ``size x size`` Gaussian window of Wang et al. 2004 (sum 1), float64."""
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    w = torch.outer(g, g)
    return w / w.sum()


def ssim(original: torch.Tensor | ArrayLike, reconstructed: torch.Tensor | ArrayLike) -> torch.Tensor:
    """Mean SSIM (Wang et al. 2004, Eq. 13 and 17; module docstring) of each pair, ``(B,)`` float64."""
    a, b = _pair(original, reconstructed)
    channels, height, width = a.shape[1:]
    size = min(SSIM_WINDOW, height, width)
    size -= 1 - size % 2
    window = gaussian_window(size).expand(channels, 1, size, size)

    def local_mean(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window, groups=channels)

    mu_a, mu_b = local_mean(a), local_mean(b)
    var_a = local_mean(a * a) - mu_a**2
    var_b = local_mean(b * b) - mu_b**2
    cov = local_mean(a * b) - mu_a * mu_b
    c1 = (SSIM_K1 * DATA_RANGE) ** 2
    c2 = (SSIM_K2 * DATA_RANGE) ** 2
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return ssim_map.mean(dim=(2, 3)).mean(dim=1)


def match_permutation(
    original: torch.Tensor | ArrayLike, reconstructed: torch.Tensor | ArrayLike
) -> np.ndarray:
    """The pairing of reconstructions to originals with the least total MSE, ``(B,)`` int64.

    ``perm[i]`` is the index of the reconstruction paired with ``original[i]``, so
    ``reconstructed[perm]`` is in the originals' order (the identity for a batch of one).
    """
    a, b = _pair(original, reconstructed)
    cost = torch.cdist(a.flatten(1), b.flatten(1)).pow(2) / a[0].numel()
    _, cols = linear_sum_assignment(cost.numpy())
    return cols.astype(np.int64)


def _summary(values: torch.Tensor) -> tuple[list[float], float, float]:
    vals = [float(v) for v in values]
    return vals, float(np.mean(vals)), float(np.median(vals))


def _labels(labels: torch.Tensor | ArrayLike, batch: int, name: str) -> np.ndarray:
    arr = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if arr.shape != (batch,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValidationError(
            f"{name} has shape {arr.shape} and dtype {arr.dtype}: expected ({batch},) integers"
        )
    return arr.astype(np.int64)


def reconstruction_metrics(
    original: torch.Tensor | ArrayLike,
    reconstructed: torch.Tensor | ArrayLike,
    true_labels: torch.Tensor | ArrayLike | None = None,
    predicted_labels: torch.Tensor | ArrayLike | None = None,
) -> dict[str, object]:
    """MSE, PSNR and SSIM of a reconstructed batch after :func:`match_permutation`, and label accuracy.

    Returns ``permutation`` (as in :func:`match_permutation`), per-image lists ``mse``, ``psnr``, ``ssim``
    in the originals' order, their ``*_mean`` and ``*_median``, and, when both label arrays are given,
    ``label_accuracy`` (``predicted_labels[perm[i]] == true_labels[i]``, the images' pairing) and
    ``label_multiset_accuracy`` (the fraction of true labels recovered regardless of which image carries
    them: the size of the multiset intersection over ``B``).
    """
    a, b = _pair(original, reconstructed)
    perm = match_permutation(a, b)
    matched = b[torch.from_numpy(perm)]
    out: dict[str, object] = {"permutation": perm.tolist()}
    for name, fn in (("mse", mse), ("psnr", psnr), ("ssim", ssim)):
        per_image, mean, median = _summary(fn(a, matched))
        out[name] = per_image
        out[f"{name}_mean"] = mean
        out[f"{name}_median"] = median
    if (true_labels is None) != (predicted_labels is None):
        raise ValidationError("label accuracy needs both true_labels and predicted_labels (got only one)")
    if true_labels is not None and predicted_labels is not None:
        truth = _labels(true_labels, a.shape[0], "true_labels")
        pred = _labels(predicted_labels, a.shape[0], "predicted_labels")
        out["label_accuracy"] = float(np.mean(pred[perm] == truth))
        common = sum(min(int(np.sum(truth == c)), int(np.sum(pred == c))) for c in np.unique(truth))
        out["label_multiset_accuracy"] = common / a.shape[0]
    return out
