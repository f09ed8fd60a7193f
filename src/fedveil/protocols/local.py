"""Client-side local training of the FedAvg engine: functional optimizers over a flat parameter vector.

Every FedAvg-style protocol (FL-traditional, FedUV and its baselines, the image FedAvg of
:mod:`fedveil.protocols.fedavg`) trains locally with the same loop: a sequence of mini-batches, a loss of
the flat parameters and a batch, and an optimizer step. The step is written as a pure function of
``(params, optimizer state, gradient)`` so that one implementation serves two execution paths:

- :func:`local_train` trains one client;
- :func:`local_train_cohort` trains many clients at once with :func:`torch.func.vmap` over their
  parameter vectors and batches (clients whose batch shapes agree), which is faster on a CPU for small
  models. ``tests/test_protocols_local.py`` shows both give the same parameters.

The optimizers follow PyTorch's update rules exactly (tested against :mod:`torch.optim`): SGD with
momentum ``mu`` and weight decay ``lambda`` (``g <- g + lambda p``; ``b <- mu b + g`` with ``b_1 = g``;
``p <- p - lr b``) and Adam (Kingma & Ba 2015, Alg. 1, with PyTorch's bias correction and ``eps`` added
after the square root). A ``mask`` of 0/1 per parameter keeps frozen parameters (PPFL's released layers)
exactly unchanged.

Gradients come from :func:`torch.func.grad_and_value` (composable with ``vmap``), or with ``eager=True``
from plain autograd: the way for a loss whose model mutates its buffers in the forward pass (BatchNorm
in train mode updating its running statistics, which ``torch.func`` transforms refuse).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch.func import grad_and_value, vmap

from fedveil.errors import ConfigError

__all__ = ["LocalOptimizer", "epoch_batches", "local_train", "local_train_cohort"]

Loss = Callable[..., torch.Tensor]
"""``loss(params (P,), *batch) -> scalar``: the client's objective on one mini-batch."""


@dataclass(frozen=True)
class LocalOptimizer:
    """A client optimizer: ``sgd`` (with ``momentum``, ``weight_decay``) or ``adam`` (``betas``, ``eps``).

    ``lr`` is the base rate and ``lr_decay`` its per-round time-based decay: round ``t`` (from 1) uses
    ``lr / (1 + lr_decay (t - 1))`` (Keras' decay, the reading of FedUV Appendix B). Optimizer state
    (momentum buffers, Adam moments) lives for one round of local training, as in FedAvg where a client
    builds a fresh optimizer for each round's ``ClientUpdate``.
    """

    name: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adam"):
            raise ConfigError(f"optimizer {self.name!r} is not one of sgd, adam")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr {self.lr!r} must be a finite number > 0")
        for field_name in ("momentum", "weight_decay", "lr_decay"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{field_name} {value!r} must be a finite number >= 0")
        if self.momentum >= 1:
            raise ConfigError(f"momentum {self.momentum!r} must be < 1")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"Adam betas {self.betas!r} must lie in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"Adam eps {self.eps!r} must be > 0")

    def lr_at(self, rnd: int) -> float:
        """The learning rate of round ``rnd`` (1, 2, ...)."""
        return self.lr / (1.0 + self.lr_decay * (rnd - 1))


def epoch_batches(
    x: torch.Tensor,
    y: torch.Tensor,
    rng: np.random.Generator,
    *,
    epochs: int,
    batch_size: int,
    min_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A client's mini-batches for ``epochs`` passes over ``(x, y)``, reshuffled by ``rng`` every epoch,
    in batches of ``batch_size`` (the last one may be smaller; batches under ``min_size`` are dropped).
    The batches are taken on ``x``'s device."""
    batches = []
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(x))).to(x.device)
        for s in range(0, len(x), batch_size):
            idx = order[s : s + batch_size]
            if len(idx) >= min_size:
                batches.append((x[idx], y[idx]))
    return batches


def _step(
    opt: LocalOptimizer,
    lr: float,
    t: int,
    p: torch.Tensor,
    g: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One optimizer step ``t`` (from 1) on parameters ``p`` with gradient ``g``; pure (works under vmap)."""
    if opt.weight_decay:
        g = g + opt.weight_decay * p
    if opt.name == "sgd":
        if opt.momentum:
            buf = g if t == 1 else opt.momentum * state[0] + g
            update, state = buf, (buf,)
        else:
            update = g
    else:
        b1, b2 = opt.betas
        m = (1 - b1) * g if t == 1 else b1 * state[0] + (1 - b1) * g
        v = (1 - b2) * g * g if t == 1 else b2 * state[1] + (1 - b2) * g * g
        state = (m, v)
        bias1, bias2 = 1 - b1**t, 1 - b2**t
        update = (m / bias1) / ((v / bias2).sqrt() + opt.eps)
    if mask is not None:
        update = update * mask
    return p - lr * update, state


def _step_inplace(
    opt: LocalOptimizer,
    lr: float,
    t: int,
    p: torch.Tensor,
    g: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`_step` computed in place in ``p``, ``g`` and the state: the same operations in the same
    order (so bit-identical results), holding the parameters, gradient, optimizer state and one
    temporary instead of a new copy of each (a TEE's memory, PPFL)."""
    with torch.no_grad():
        if opt.weight_decay:
            g.add_(opt.weight_decay * p)
        if opt.name == "sgd":
            if opt.momentum:
                update = g if t == 1 else state[0].mul_(opt.momentum).add_(g)
                state = (update,)
            else:
                update = g
        else:
            b1, b2 = opt.betas
            m = g.mul(1 - b1) if t == 1 else state[0].mul_(b1).add_((1 - b1) * g)
            v = ((1 - b2) * g).mul_(g) if t == 1 else state[1].mul_(b2).add_((1 - b2) * g * g)
            state = (m, v)
            bias1, bias2 = 1 - b1**t, 1 - b2**t
            update = (m / bias1) / ((v / bias2).sqrt() + opt.eps)
        if mask is not None:
            update = update * mask
        p.sub_(lr * update)
    return p, state


def _loop(
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    p: torch.Tensor,
    batches: Sequence[tuple[torch.Tensor, ...]],
    opt: LocalOptimizer,
    lr: float | Sequence[float],
    mask: torch.Tensor | None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local-training loop over ``step`` (gradient and loss; plain or vmapped): params, mean loss.

    ``lr`` is one rate for every step, or one rate per step (a schedule within the round, e.g. PPFL's
    per-epoch decay)."""
    if not batches:
        raise ConfigError("local training needs at least one mini-batch")
    rates = [float(lr)] * len(batches) if isinstance(lr, (int, float)) else [float(r) for r in lr]
    if len(rates) != len(batches):
        raise ConfigError(f"{len(rates)} learning rates for {len(batches)} mini-batches")
    state: tuple[torch.Tensor, ...] = ()
    losses = []
    for t, batch in enumerate(batches, start=1):
        g, value = step(p, *batch)
        p, state = (_step_inplace if inplace else _step)(opt, rates[t - 1], t, p, g, state, mask)
        losses.append(value)
    return p, torch.stack(losses).mean(dim=0)


def local_train(
    loss: Loss,
    p: torch.Tensor,
    batches: Sequence[tuple[torch.Tensor, ...]],
    opt: LocalOptimizer,
    lr: float | Sequence[float],
    mask: torch.Tensor | None = None,
    *,
    inplace: bool = False,
    eager: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's local training: a step of ``opt`` on each batch in order.

    ``p`` is the flat parameter vector received, ``batches`` the mini-batches (tuples of the loss's
    arguments after the parameters), ``lr`` this round's rate (or one per step). Returns the trained
    parameters and the mean training loss over the steps. ``inplace=True`` trains ``p`` itself (the
    caller hands it over) with in-place steps, bit-identical and lighter on memory. ``eager=True`` takes
    gradients by plain autograd (module docstring), with equal numbers.
    """
    step = _eager_grad_and_value(loss) if eager else grad_and_value(loss)
    return _loop(step, p, batches, opt, lr, mask, inplace)


def _eager_grad_and_value(loss: Loss) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``grad_and_value(loss)`` by plain autograd (module docstring: models that mutate buffers)."""

    def step(p: torch.Tensor, *batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = p.detach().requires_grad_(True)
        value = loss(leaf, *batch)
        (g,) = torch.autograd.grad(value, leaf)
        return g, value.detach()

    return step


def local_train_cohort(
    loss: Loss,
    p: torch.Tensor,
    batches: Sequence[tuple[torch.Tensor, ...]],
    opt: LocalOptimizer,
    lr: float | Sequence[float],
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`local_train` for ``K`` clients at once: ``p`` is ``(K, P)``, each batch tensor ``(K, ...)``.

    The clients' steps run as one vectorised computation (``vmap`` over the leading axis); each client
    still sees only its own parameters and batches. Returns ``(K, P)`` parameters and ``(K,)`` mean losses.
    """
    return _loop(vmap(grad_and_value(loss)), p, batches, opt, lr, mask)
