"""Client-side local training of the FedAvg engine: optimizers stepping a flat parameter vector in place.

Every FedAvg-style protocol (FL-traditional, FedUV and its baselines, the image FedAvg of
:mod:`fedveil.protocols.fedavg`) trains locally with the same loop: a sequence of mini-batches, a loss of
the flat parameters and a batch, and an optimizer step. One step function, in place on whatever it is
given, serves every execution path:

- :func:`local_train` trains one client: the flat vector as a whole, or, given the shapes of the tensors
  it holds, tensor by tensor (views into the vector, gradients by plain autograd), which spares each step
  the flat gradient's assembly;
- :func:`local_train_cohort` trains many clients at once with :func:`torch.func.vmap` over their
  parameter vectors and batches (clients whose batch shapes agree), which is faster on a CPU for small
  models. ``tests/test_protocols_local.py`` shows every path gives the same parameters.

The steps write the parameters, the optimizer state and the step's gradient in place: besides the model's
parameters, gradient and state, a step allocates at most one temporary of their size, and the trained
vector is the one handed back (a TEE's memory, PPFL; a client's memory passes, image FedAvg).

The optimizers follow PyTorch's update rules exactly (tested against :mod:`torch.optim`): SGD with
momentum ``mu`` and weight decay ``lambda`` (``g <- g + lambda p``; ``b <- mu b + g`` with ``b_1 = g``;
``p <- p - lr b``) and Adam (Kingma & Ba 2015, Alg. 1, with PyTorch's bias correction and ``eps`` added
after the square root). A ``mask`` of 0/1 per parameter keeps frozen parameters (PPFL's released layers)
exactly unchanged. Each entry sees the same operations in the same order on every path, so the paths
agree bit for bit where their gradients do.

Flat gradients come from :func:`torch.func.grad_and_value` (composable with ``vmap``), or with
``eager=True`` from plain autograd: the way for a loss whose model mutates its buffers in the forward pass
(BatchNorm in train mode updating its running statistics, which ``torch.func`` transforms refuse).
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
"""``loss(params, *batch) -> scalar``: the client's objective on one mini-batch; ``params`` is the flat
vector ``(P,)``, or the tuple of its tensors when :func:`local_train` is given their ``shapes``."""


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
) -> tuple[torch.Tensor, ...]:
    """One optimizer step ``t`` (from 1) on parameters ``p`` with gradient ``g``, in place in ``p``;
    returns the new optimizer state. The one implementation of the update rules (module docstring) for
    every path: a flat vector, a ``(K, P)`` cohort (``mask`` broadcasts) or one tensor of a model.

    ``g`` is the step's own: it is overwritten (it becomes the update, or the momentum buffer), so the
    step allocates at most one temporary of ``p``'s size (Adam's update, weight decay's ``lambda p``, a
    masked momentum update) besides the state it keeps."""
    with torch.no_grad():
        if opt.weight_decay:
            g.add_(opt.weight_decay * p)
        owned = True  # ``update`` is a temporary of this step, free to overwrite
        if opt.name == "sgd":
            if opt.momentum:
                update = g if t == 1 else state[0].mul_(opt.momentum).add_(g)
                state, owned = (update,), False
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
            update, owned = (update.mul_(mask) if owned else update * mask), True
        p.sub_(update.mul_(lr) if owned else lr * update)
    return state


def _rates(lr: float | Sequence[float], steps: int) -> list[float]:
    """One learning rate per step: ``lr`` repeated, or ``lr`` itself (a schedule within the round)."""
    if not steps:
        raise ConfigError("local training needs at least one mini-batch")
    rates = [float(lr)] * steps if isinstance(lr, (int, float)) else [float(r) for r in lr]
    if len(rates) != steps:
        raise ConfigError(f"{len(rates)} learning rates for {steps} mini-batches")
    return rates


Gradients = Callable[..., tuple[Sequence[torch.Tensor], torch.Tensor]]
"""``gradients(*batch) -> (one gradient per trained tensor, loss)``, the gradients the step's own."""


def _loop(
    gradients: Gradients,
    tensors: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor | None],
    batches: Sequence[tuple[torch.Tensor, ...]],
    opt: LocalOptimizer,
    rates: Sequence[float],
) -> torch.Tensor:
    """The local-training loop: on each batch, the gradients of ``tensors`` and a :func:`_step` on each
    tensor in place (with its mask) at that step's rate (:func:`_rates`); returns the mean loss over the
    steps."""
    states: list[tuple[torch.Tensor, ...]] = [() for _ in tensors]
    losses = []
    for t, batch in enumerate(batches, start=1):
        grads, value = gradients(*batch)
        for i, (p, g, mask) in enumerate(zip(tensors, grads, masks, strict=True)):
            states[i] = _step(opt, rates[t - 1], t, p, g, states[i], mask)
        losses.append(value)
    return torch.stack(losses).mean(dim=0)


def _flat_gradients(step: Callable[..., tuple[torch.Tensor, torch.Tensor]], p: torch.Tensor) -> Gradients:
    """:data:`Gradients` of the flat vector ``p`` from ``step(p, *batch) -> (gradient, loss)``. A gradient
    that is a broadcast of fewer values (a loss linear in ``p``, as ``p.sum()``) is written out first, so
    the step can overwrite it."""

    def gradients(*batch: torch.Tensor) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
        g, value = step(p, *batch)
        return (g.contiguous(),), value

    return gradients


def _tensor_gradients(loss: Loss, tensors: tuple[torch.Tensor, ...]) -> Gradients:
    """:data:`Gradients` of each of ``tensors`` (views of one buffer, made leaves), by plain autograd.

    The gradients are accumulated into each tensor's ``.grad`` and taken from there, as ``torch.optim``
    takes them: autograd then hands over the tensor its backward computed when nothing else holds it, and
    a copy when something does (the same gradient reaching two tensors), so each is the step's own. A
    tensor the loss does not reach gets a zero gradient, as the flat vector's entries do."""

    def gradients(*batch: torch.Tensor) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
        value = loss(tensors, *batch)
        value.backward(inputs=list(tensors))
        grads = []
        for p in tensors:
            grads.append(torch.zeros_like(p) if p.grad is None else p.grad)
            p.grad = None
        return grads, value.detach()

    return gradients


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
    shapes: Sequence[tuple[int, ...]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's local training: a step of ``opt`` on each batch in order.

    ``p`` is the flat parameter vector received, ``batches`` the mini-batches (tuples of the loss's
    arguments after the parameters), ``lr`` this round's rate (or one per step). Returns the trained
    parameters and the mean training loss over the steps. The steps run in place in one copy of ``p``
    (``inplace=True``: in ``p`` itself, which the caller hands over, with no copy at all).

    ``shapes`` (e.g. :attr:`fedveil.models.flat.FlatModel.shapes`) are the tensors ``p`` holds, in
    order: the loss then receives them as a tuple of views into the trained vector (a
    :class:`~fedveil.models.flat.FlatModel` takes either form), their gradients are taken one tensor at a
    time by plain autograd, and each tensor steps in place, so no step assembles a flat gradient.
    Without ``shapes`` the loss receives the flat vector and its gradient is one flat vector, from
    :func:`torch.func.grad_and_value`, or with ``eager=True`` from plain autograd (module docstring).
    The two forms give equal numbers.
    """
    rates = _rates(lr, len(batches))
    p = p.detach() if inplace else p.detach().clone()
    if shapes is None:
        step = _eager_grad_and_value(loss) if eager else grad_and_value(loss)
        return p, _loop(_flat_gradients(step, p), [p], [mask], batches, opt, rates)
    tensors = _views(p, shapes)
    for tensor in tensors:
        tensor.requires_grad_(True)
    masks = [None] * len(tensors) if mask is None else list(_views(mask, shapes))
    return p, _loop(_tensor_gradients(loss, tensors), tensors, masks, batches, opt, rates)


def _views(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped as ``shapes`` in order, which must cover it exactly."""
    sizes = [math.prod(s) for s in shapes]
    if sum(sizes) != flat.shape[-1]:
        raise ConfigError(f"tensor shapes of {sum(sizes)} entries in all for a vector of {flat.shape[-1]}")
    return tuple(piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True))


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
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`local_train` for ``K`` clients at once: ``p`` is ``(K, P)``, each batch tensor ``(K, ...)``.

    The clients' steps run as one vectorised computation (``vmap`` over the leading axis); each client
    still sees only its own parameters and batches. Returns ``(K, P)`` parameters and ``(K,)`` mean losses;
    the steps run in place in a copy of ``p`` (``inplace=True``: in ``p`` itself, handed over).
    """
    rates = _rates(lr, len(batches))
    p = p.detach() if inplace else p.detach().clone()
    return p, _loop(_flat_gradients(vmap(grad_and_value(loss)), p), [p], [mask], batches, opt, rates)
