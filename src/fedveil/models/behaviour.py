"""The user-behaviour model of PoliFL Sec. 6.3 (after Katevas et al. 2017): a time-distributed linear
layer of 50 parametric ReLUs over each step's sensor readings, two LSTM layers, and a dense sigmoid
output (here a logit; the loss applies the sigmoid). The paper's LSTMs have 500 units (3M parameters);
``hidden`` reduces them for this machine and is named in every result."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["EngagementNet", "NextWordLSTM", "binary_logit_loss", "sequence_loss"]


class EngagementNet(nn.Module):
    """``(B, T, sensors)`` windows -> ``(B,)`` engagement logits (module docstring)."""

    def __init__(self, sensors: int = 15, *, per_step: int = 50, hidden: int = 500, layers: int = 2) -> None:
        super().__init__()
        self.step = nn.Linear(sensors, per_step)
        self.act = nn.PReLU(per_step)
        self.lstm = nn.LSTM(per_step, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the last step's engagement."""
        b, t, s = x.shape
        h = self.act(self.step(x.reshape(b * t, s))).reshape(b, t, -1)
        seq, _ = self.lstm(h)
        return self.out(seq[:, -1, :]).squeeze(-1)


def binary_logit_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of logits against 0/1 labels (any dtype)."""
    return nn.functional.binary_cross_entropy_with_logits(logits, y.to(logits.dtype))


class NextWordLSTM(nn.Module):
    """PoliFL Sec. 6.1's word model (the PyTorch word-language-model example): an embedding, a 2-layer
    LSTM of ``hidden`` units and a linear decoder over the vocabulary; ``(B, T)`` token ids (any dtype)
    -> ``(B, T, vocab)`` logits of each next token."""

    def __init__(self, vocab: int, *, embedding: int = 200, hidden: int = 200, layers: int = 2) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.decode = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits at every position."""
        seq, _ = self.lstm(self.embed(x.long()))
        return self.decode(seq)


def sequence_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1).long())
