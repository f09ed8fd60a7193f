"""Brute-force reference for FDML Alg. 1: torch autograd over every triplet.

Independent of :mod:`fedveil.enclave.triplet`: the valid triplets ``(a, p, n)`` are enumerated explicitly
from the full ``N x N x N`` index grid, the distances are norms of explicit difference vectors (no Gram
matrix), each triplet's hinge is gathered from them, and torch's autograd differentiates the mean active
hinge. The definitions are those of :mod:`fedveil.enclave.triplet`: hinge ``(d(a, p) + margin) -
d(a, n)``, active when ``> 0`` (and, for ``"semi-hard"``, ``d(a, p) < d(a, n)``), ``u = 0`` at a zero
distance. Runs in float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from fedveil.errors import ConfigError

__all__ = ["REFERENCE_MEMORY_BYTES", "reference_fits", "reference_loss", "reference_loss_and_derivatives"]

REFERENCE_MEMORY_BYTES = 2**31
"""Memory the reference may take: ``N^3`` validity grids, triplet indices and difference vectors."""


def reference_fits(num_embeddings: int, dim: int, memory_bytes: int = REFERENCE_MEMORY_BYTES) -> bool:
    """Whether the reference for ``num_embeddings`` embeddings of ``dim`` values fits in ``memory_bytes``.

    Counts three ``N^3`` boolean grids, at worst ``N^3 / 4`` valid triplets of three int64 indices
    (``9 N^3`` bytes in all) and the ``N^2`` difference vectors with their gradients (``32 N^2 d``).
    """
    n = int(num_embeddings)
    return 9 * n**3 + 32 * n**2 * int(dim) <= memory_bytes


def _safe_norm(diff: torch.Tensor) -> torch.Tensor:
    """Norms over the last axis with gradient 0 (not NaN) at a zero vector."""
    import torch

    sq = (diff * diff).sum(dim=-1)
    positive = sq > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, sq, torch.ones_like(sq))), 0.0)


def _triplets(labels: torch.Tensor) -> torch.Tensor:
    """Indices ``(T, 3)`` of the valid ``(a, p, n)`` of all ``N^3``: same label, ``a != p``, other label."""
    import torch

    n = labels.shape[0]
    index = torch.arange(n)
    same = labels[:, None] == labels[None, :]
    valid = same[:, :, None] & (index[:, None, None] != index[None, :, None]) & ~same[:, None, :]
    return torch.nonzero(valid)


def reference_loss_and_derivatives(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    margin: float,
    strategy: str = "batch-all",
    memory_bytes: int = REFERENCE_MEMORY_BYTES,
) -> tuple[float, np.ndarray]:
    """``(loss, dloss/dembeddings)`` in float64 by autograd over the explicitly enumerated triplets.

    ``embeddings`` ``(N, d)``, ``labels`` ``(N,)``; raises :class:`~fedveil.errors.ConfigError` when
    :func:`reference_fits` says the enumeration does not fit in ``memory_bytes``.
    """
    if strategy not in ("batch-all", "semi-hard"):
        raise ConfigError(f"strategy {strategy!r} is not one of batch-all, semi-hard")
    n, d = embeddings.shape
    if not reference_fits(n, d, memory_bytes):
        raise ConfigError(
            f"{n} embeddings of dimension {d}: the N^3 = {n**3} triplet grid does not fit in "
            f"memory_bytes={memory_bytes}"
        )
    import torch

    x = torch.tensor(np.asarray(embeddings, dtype=np.float64), requires_grad=True)
    loss = reference_loss(x, torch.as_tensor(np.asarray(labels)), margin=margin, strategy=strategy)
    if not loss.requires_grad:
        return 0.0, np.zeros(embeddings.shape, np.float64)
    loss.backward()
    return float(loss.detach()), x.grad.numpy()


def reference_loss(x: torch.Tensor, labels: torch.Tensor, *, margin: float, strategy: str) -> torch.Tensor:
    """Alg. 1's loss of embeddings ``x`` ``(N, d)`` with ``labels`` ``(N,)`` as a differentiable tensor:
    the mean active hinge over the enumerated triplets (module docstring), a constant 0 when none is
    active. Any dtype; no memory check (:func:`reference_fits`)."""
    import torch

    a, p, q = _triplets(labels).unbind(dim=1)
    dist = _safe_norm(x[:, None, :] - x[None, :, :])
    d_ap, d_an = dist[a, p], dist[a, q]
    hinge = (d_ap + margin) - d_an
    active = hinge > 0
    if strategy == "semi-hard":
        active &= d_ap < d_an
    count = int(active.sum())
    if count == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return hinge[active].sum() / count
