"""A model's parameters as one flat float32 vector, the form they take on the wire.

Protocols send weights and gradients as a single 1-D float32 array (one codec buffer, one
aggregation kernel). :class:`FlatModel` maps such a vector to the module's parameters without
copying and evaluates the module functionally, so many clients can share one module object.

With ``buffers=True`` the module's floating-point buffers (BatchNorm's running mean and variance) follow
the parameters in the vector: the whole state a server sends when the statistics travel with the model
(the AIoT projector protocol, where they are frozen at the pre-trained values or averaged like weights).
Integer buffers (``num_batches_tracked``) are never part of it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

__all__ = ["FlatModel", "float_buffers"]


def float_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s floating-point buffers by name (BatchNorm's running statistics; not its counters)."""
    return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]


class FlatModel:
    """Functional view of ``module`` through a flat vector of its parameters (and, with ``buffers``, its
    floating-point buffers after them: module docstring). ``num_params`` is the vector's length,
    ``buffer_names`` the buffers it holds."""

    def __init__(self, module: nn.Module, *, buffers: bool = False) -> None:
        self.module = module
        tensors = list(module.named_parameters()) + (float_buffers(module) if buffers else [])
        self.names = [n for n, _ in tensors]
        self.buffer_names = [n for n, _ in float_buffers(module)] if buffers else []
        self.shapes = [tuple(t.shape) for _, t in tensors]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.num_params = sum(self.sizes)

    def _tensors(self) -> list[torch.Tensor]:
        kept = [b for _, b in float_buffers(self.module)] if self.buffer_names else []
        return list(self.module.parameters()) + kept

    def initial(self) -> np.ndarray:
        """The module's current parameters (and buffers) as a flat float32 vector (a host copy)."""
        return torch.cat([t.detach().reshape(-1) for t in self._tensors()]).cpu().numpy().astype(np.float32)

    def unflatten(self, flat: torch.Tensor | Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped as each named tensor. ``flat`` is the whole vector (``num_params``)
        or its leading tensors only, e.g. the parameters without the buffers that follow them; or those
        tensors already apart and shaped, in order (as :func:`fedveil.protocols.local.local_train` hands
        them to a loss given their ``shapes``), which are named as they are."""
        if not isinstance(flat, torch.Tensor):
            tensors = tuple(flat)
            shapes = [tuple(t.shape) for t in tensors]
            if shapes != self.shapes[: len(tensors)]:
                raise ValueError(f"tensors shaped {shapes[:4]}... are not the model's {self.shapes[:4]}...")
            return dict(zip(self.names, tensors, strict=False))
        count = len(self.names)
        if flat.shape[0] != self.num_params:
            ends = list(itertools.accumulate(self.sizes))
            if flat.shape[0] not in ends:
                raise ValueError(f"a vector of {flat.shape[0]} entries does not end at a tensor boundary")
            count = ends.index(flat.shape[0]) + 1
        pieces = torch.split(flat, self.sizes[:count])
        return {n: t.view(s) for n, t, s in zip(self.names[:count], pieces, self.shapes[:count], strict=True)}

    def __call__(self, flat: torch.Tensor | Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The module's output on ``x`` with parameters taken from ``flat`` (either form of
        :meth:`unflatten`)."""
        return functional_call(self.module, self.unflatten(flat), (x,))

    def load_into_module(self, flat: np.ndarray) -> nn.Module:
        """Copy ``flat`` into the module's parameters (and buffers) and return the module (for evaluation)."""
        with torch.no_grad():
            for p, piece in zip(
                self._tensors(),
                torch.split(torch.from_numpy(np.array(flat)), self.sizes),
                strict=True,
            ):
                p.copy_(piece.view(p.shape))
        return self.module
