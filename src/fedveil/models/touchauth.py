"""The TouchAuth embedding network of FDML (Appendix).

The Appendix lists it as PyTorch code::

    Conv2d(1, 64, (1, 10), 1)
    Conv2d(64, 128, (1, 1), 1)
    MaxPool2d((3, 1), (2, 1))
    Conv2d(128, 256, (1, 1), 1)
    Conv2d(256, 256, (1, 1), 1)
    Linear(64)

with a ReLU after each convolution. A sample is 30 touch events of 10 features, so the input is
``(batch, 1, 30, 10)``; the feature maps are (64, 30, 1) -> (128, 30, 1) -> pool -> (128, 14, 1) ->
(256, 14, 1) -> (256, 14, 1), flattened to 3,584 features and projected to a 64-d embedding.

The parameters are exactly those ``nn.Conv2d`` and ``nn.Linear`` modules. :meth:`TouchAuthNet.forward`
evaluates them as what they are on this input: a (1, 10) kernel over a 10-wide row and (1, 1)
kernels are the same affine map applied to every touch event, so each convolution is computed as a
matrix product over events. That gives the same numbers as the convolutions
(:meth:`TouchAuthNet.conv_forward`, compared in the tests) several times faster on a CPU, above all
for per-client gradients under ``torch.func.vmap``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EVENTS_PER_SAMPLE = 30
EVENT_DIM = 10


class TouchAuthNet(nn.Module):
    """FDML's TouchAuth embedding network: ``(B, 1, 30, 10)`` float32 -> ``(B, embedding_dim)``."""

    def __init__(self, embedding_dim: int = 64, events: int = EVENTS_PER_SAMPLE) -> None:
        super().__init__()
        self.events = events
        pooled = (events - 3) // 2 + 1
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, (1, EVENT_DIM), 1),
            nn.ReLU(),
            nn.Conv2d(64, 128, (1, 1), 1),
            nn.ReLU(),
            nn.MaxPool2d((3, 1), (2, 1)),
            nn.Conv2d(128, 256, (1, 1), 1),
            nn.ReLU(),
            nn.Conv2d(256, 256, (1, 1), 1),
            nn.ReLU(),
        )
        self.embed = nn.Linear(256 * pooled, embedding_dim)

    def conv_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The Appendix's layers run as convolutions (the reference for :meth:`forward`)."""
        return self.embed(torch.flatten(self.features(x), 1))

    def _affine_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(weight as (out, in), bias)`` of the four convolutions and the final linear layer."""
        convs = [self.features[i] for i in (0, 2, 5, 7)]
        layers = [(c.weight.reshape(c.out_channels, -1), c.bias) for c in convs]
        return [*layers, (self.embed.weight, self.embed.bias)]

    def _run(
        self, x: torch.Tensor, keep: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """Forward pass; with ``keep`` also each affine layer's input and the max-pool's argmax."""
        (w1, b1), (w2, b2), (w3, b3), (w4, b4), (w5, b5) = self._affine_layers()
        batch = x.shape[0]
        h0 = x.reshape(batch, self.events, EVENT_DIM)
        h1 = F.linear(h0, w1, b1).relu_()
        pooled, index = F.max_pool1d(F.linear(h1, w2, b2).relu_().transpose(1, 2), 3, 2, return_indices=True)
        h2 = pooled.transpose(1, 2)
        h3 = F.linear(h2, w3, b3).relu_()
        h4 = F.linear(h3, w4, b4).relu_().transpose(1, 2).reshape(batch, -1)
        out = F.linear(h4, w5, b5)
        return out, [h0, h1, h2, h3, h4] if keep else [], index if keep else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map touch samples ``(B, 1, events, 10)`` to embeddings ``(B, embedding_dim)``."""
        return self._run(x, keep=False)[0]

    def trace(self, x: torch.Tensor) -> TouchAuthTrace:
        """Embeddings of ``x`` plus what :meth:`group_gradients` needs to back-propagate them later
        without re-running the forward pass (an FDML device keeps these between steps 4 and 7)."""
        with torch.no_grad():
            out, inputs, index = self._run(x, keep=True)
            weights = [w.detach().clone() for w, _ in self._affine_layers()]
        return TouchAuthTrace(out, tuple(inputs), index, tuple(weights))

    def layer_deltas(
        self, trace: TouchAuthTrace, rows: torch.Tensor | slice, derivatives: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The written-out backward pass of ``sum_j <derivatives_j, f(x_j)>`` over the traced ``rows``.

        ``derivatives`` ``(len(rows), embedding_dim)`` is dL/de of each sample. Returns, for each of the
        five affine layers in ``self.parameters()`` order, its input ``h_{k-1}`` and output derivative
        ``δ_k``, each ``(samples, positions, features)`` (positions: the events a layer is applied to; 1 for
        the final linear layer). ``δ_5`` is ``derivatives``; below it ``δ_k = (δ_{k+1} W_{k+1}) ⊙ relu'``,
        routed back through the max-pool by its argmax. A layer's weight gradient over any set of samples
        is ``sum δ_k^T h_{k-1}`` over them and their positions, its bias gradient ``sum δ_k``.
        """
        batch = derivatives.shape[0]
        h0, h1, h2, h3, h4 = (h[rows] for h in trace.inputs)
        _, w2, w3, w4, w5 = trace.weights
        d5 = derivatives.reshape(batch, -1)
        g4 = (d5 @ w5).reshape(batch, -1, h3.shape[1]).transpose(1, 2)
        d4 = _relu_backward(g4, h4.reshape(batch, -1, h3.shape[1]).transpose(1, 2))
        d3 = _relu_backward(d4 @ w4, h3)
        g2 = _relu_backward(d3 @ w3, h2).transpose(1, 2)
        d2 = torch.zeros(batch, g2.shape[1], h1.shape[1], dtype=g2.dtype, device=g2.device)
        d2.scatter_add_(2, trace.pool_index[rows], g2)
        d2 = d2.transpose(1, 2)
        d1 = _relu_backward(d2 @ w2, h1)
        return [(h0, d1), (h1, d2), (h2, d3), (h3, d4), (h4.unsqueeze(1), d5.unsqueeze(1))]

    def group_gradients(
        self, trace: TouchAuthTrace, rows: torch.Tensor, derivatives: torch.Tensor, groups: int
    ) -> torch.Tensor:
        """Per-group parameter gradients of ``sum_j <derivatives_j, f(x_j)>`` as one ``(groups, P)`` matrix.

        ``rows`` (``groups * n`` indices into the traced batch) list ``groups`` consecutive runs of ``n``
        samples (one run per FDML device) and ``derivatives`` ``(groups * n, embedding_dim)`` the dL/de
        each device received. The backward pass is written out (:meth:`layer_deltas`): each layer's output
        derivative is ``δ_k = (δ_{k+1} W_{k+1}) ⊙ relu'``, routed back through the max-pool by its argmax;
        each device's weight gradient is then ``sum δ_k^T h_{k-1}`` over its own samples and events (a
        batched matrix product) and its bias gradient ``sum δ_k``. Columns follow ``self.parameters()``, so
        a row is the flat gradient a device uploads (FDML Fig. 2, step 7).
        """
        return torch.cat(self.group_gradient_pieces(trace, rows, derivatives, groups), dim=1)

    def group_gradient_pieces(
        self, trace: TouchAuthTrace, rows: torch.Tensor, derivatives: torch.Tensor, groups: int
    ) -> list[torch.Tensor]:
        """:meth:`group_gradients` before its columns are joined: one ``(groups, size)`` block per
        parameter, in ``self.parameters()`` order (a device's flat gradient is its rows, concatenated)."""
        batch = rows.shape[0]
        if batch % groups:
            raise ValueError(f"{batch} samples do not split into {groups} equal groups")
        first = int(rows[0]) if batch else 0
        picked: torch.Tensor | slice = rows
        if torch.equal(rows, torch.arange(first, first + batch, device=rows.device)):
            picked = slice(first, first + batch)
        pieces = []
        for h, delta in self.layer_deltas(trace, picked, derivatives):
            h_g = h.reshape(groups, -1, h.shape[-1])
            d_g = delta.reshape(groups, -1, delta.shape[-1])
            pieces.append(torch.bmm(d_g.transpose(1, 2), h_g).reshape(groups, -1))
            pieces.append(d_g.sum(1))
        return pieces


def _relu_backward(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``grad ⊙ relu'``, with ``out`` the ReLU's output (``out > 0`` exactly where its input was): one
    fused pass, the kernel autograd's ReLU backward uses. The same numbers as ``grad * (out > 0)`` but
    for the sign of a zero (``+0`` where the product gives ``-0``), which no sum below can tell."""
    return torch.ops.aten.threshold_backward(grad, out, 0)


@dataclass(frozen=True)
class TouchAuthTrace:
    """One traced forward pass of :class:`TouchAuthNet`: embeddings ``out`` ``(B, d)``, the input of each
    of the five affine layers, the max-pool argmax ``(B, 128, 14)`` and the weights used."""

    out: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    pool_index: torch.Tensor
    weights: tuple[torch.Tensor, ...]
