"""Measuring a model's cost: live tensor memory, FLOPs, and the size of its weights on disk.

- :class:`LiveBytes`: a ``TorchDispatchMode`` that counts the bytes of every tensor storage allocated
  under it while it is alive and keeps the peak (PPFL's measured ``S_l``, a face model's training memory).
- :func:`efficiency`: AIoT Table 3's figures for an embedding network and its training head: parameters,
  FLOPs of one forward pass of one example (torch's own counter, ``torch.utils.flop_counter``: 2 FLOPs
  per multiply-accumulate of convolutions and matrix products; BatchNorm, activations and additions
  are not counted), multiply-accumulates (half of that), ``madd`` (multiplies and adds counted apart:
  twice the multiply-accumulates, the convention of the paper's "MAdd" column), the safetensors file of
  the network's weights, and the peak live memory of one training step on one example (parameters,
  gradients, activations), with BatchNorm's statistics frozen as the AIoT devices fine-tune (Sec. 4.1;
  a training-mode BatchNorm cannot normalise one example's 1 x 1 feature maps).
"""

from __future__ import annotations

import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from fedveil.models.weights import save_weights

__all__ = ["LiveBytes", "efficiency"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages allocated under it while they are alive; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live:
                    self._live.add(key)
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out


def efficiency(
    model: nn.Module, head: nn.Module, input_shape: tuple[int, ...], *, seed: int = 0
) -> dict[str, int]:
    """AIoT Table 3 for ``model`` (module docstring); ``head(embeddings, labels)`` gives the logits of
    the training loss (ArcFace). The model's state is restored after the step."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(1, *input_shape, generator=gen)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    flops = int(counter.get_total_flops())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_weights(model, path)
        disk = path.stat().st_size
    params = list(model.parameters()) + list(head.parameters())
    resident = sum(p.numel() * p.element_size() for p in params)
    model.eval()  # BatchNorm frozen, as the AIoT devices fine-tune (Sec. 4.1); gradients still flow
    meter = LiveBytes()
    with meter:
        loss = nn.functional.cross_entropy(
            head(model(x), torch.zeros(1, dtype=torch.int64)), torch.zeros(1, dtype=torch.int64)
        )
        loss.backward()
    for p in params:
        p.grad = None
    model.load_state_dict(state)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "flops": flops,
        "macs": flops // 2,
        "madd": 2 * (flops // 2),
        "disk_bytes": disk,
        "train_memory_bytes": resident + meter.peak,
    }
