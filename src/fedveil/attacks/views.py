"""Observer views: exactly what one observer of a federated run saw, the input of every attack.

An attack never reaches into a protocol's state. It is handed what a particular observer (the server,
an eavesdropper on the wire, a curious client) actually saw, and what that observer knows of the model:

- :class:`UpdateView`: one upload in plaintext (a gradient of one local step, or the model delta after
  local training), named by parameter, for the parameters that observer saw. Parameters that stay on the
  device (the AIoT private projector, the PPFL layers still inside a TEE) are listed in ``hidden``: the
  attacker's ``model`` holds its *guess* for them (an "upper bound" attacker gets the true values).
- :class:`ModelView`: a model released to the observer (the global model after training, or the final
  aggregate), for membership and property inference.
- :class:`SealedView`: ciphertext only (an upload sealed to an enclave). No attack runs on it; each
  attack raises :class:`NoPlaintextView`, which reports say as "no plaintext view".

Update views are built from what the engine sent and received through the codec
(:func:`update_view_from_upload`), so an attack sees the bytes the runtime delivered, not a copy of a
client's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from fedveil.errors import ValidationError

__all__ = [
    "ModelView",
    "NoPlaintextView",
    "ObserverView",
    "SealedView",
    "UpdateView",
    "require_model_view",
    "require_update_view",
    "update_view_from_upload",
]

UpdateKind = Literal["gradient", "delta"]


class NoPlaintextView(ValidationError):
    """An attack was pointed at a sealed (ciphertext) view: there is nothing in plaintext to attack."""


@dataclass(frozen=True)
class UpdateView:
    """One upload an observer saw in plaintext.

    ``update`` maps parameter names of ``model`` to tensors of the same shapes: for ``kind="gradient"``
    the gradient of the mean loss over the client's batch (one local step, as DLG assumes); for
    ``kind="delta"`` the change ``theta_local - theta_global`` after ``local_steps`` steps of SGD with
    learning rate ``lr`` (FedAvg's upload minus the model the client received). ``model`` is the network
    the update was computed on as the attacker knows it, with the broadcast weights loaded; ``hidden``
    names the parameters the observer did not see (their values in ``model`` are the attacker's guess).
    ``num_samples`` is the client's batch size or sample count when the observer knows it.
    """

    observer: str
    kind: UpdateKind
    update: Mapping[str, torch.Tensor]
    model: nn.Module
    num_samples: int | None = None
    lr: float | None = None
    local_steps: int | None = None
    hidden: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("gradient", "delta"):
            raise ValidationError(f"update kind {self.kind!r}: expected 'gradient' or 'delta'")
        params = dict(self.model.named_parameters())
        for name, tensor in self.update.items():
            if name not in params:
                raise ValidationError(
                    f"{self.observer}: the update names parameter {name!r}, which the model does not "
                    f"have (it has {sorted(params)[:4]}...); pass the model the update was computed on"
                )
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValidationError(
                    f"{self.observer}: update of {name!r} has shape {tuple(tensor.shape)}, the model's "
                    f"parameter has {tuple(params[name].shape)}: the update does not belong to this model"
                )
            if not torch.isfinite(tensor).all():
                raise ValidationError(f"{self.observer}: update of {name!r} has NaN or inf entries")
        for name in self.hidden:
            if name not in params:
                raise ValidationError(f"{self.observer}: hidden parameter {name!r} is not in the model")
            if name in self.update:
                raise ValidationError(f"{self.observer}: parameter {name!r} is both seen and hidden")
        if not self.update:
            raise ValidationError(f"{self.observer}: the update names no parameter")

    def as_gradient(self) -> dict[str, torch.Tensor]:
        """The update as a gradient estimate: itself, or ``-delta / (lr * local_steps)`` for a delta."""
        if self.kind == "gradient":
            return {k: v.detach() for k, v in self.update.items()}
        if not self.lr or not self.local_steps:
            raise ValidationError(
                f"{self.observer}: a model delta needs lr and local_steps to be read as a gradient"
            )
        scale = -1.0 / (self.lr * self.local_steps)
        return {k: v.detach() * scale for k, v in self.update.items()}


@dataclass(frozen=True)
class ModelView:
    """A trained model as an observer received it (e.g. the released global model)."""

    observer: str
    model: nn.Module


@dataclass(frozen=True)
class SealedView:
    """What an observer of an enclave-protected path saw: ciphertext, ``num_bytes`` of it."""

    observer: str
    num_bytes: int
    sealed_to: str = "enclave"


ObserverView = UpdateView | ModelView | SealedView


def require_update_view(view: ObserverView, attack: str) -> UpdateView:
    """``view`` as an :class:`UpdateView`, or :class:`NoPlaintextView` / :class:`ValidationError`."""
    if isinstance(view, SealedView):
        raise NoPlaintextView(
            f"{attack}: no plaintext view: {view.observer} saw {view.num_bytes} bytes of ciphertext "
            f"sealed to the {view.sealed_to}; there is no gradient to invert"
        )
    if not isinstance(view, UpdateView):
        raise ValidationError(
            f"{attack} needs an UpdateView (a gradient or model delta), got {type(view).__name__}"
        )
    return view


def require_model_view(view: ObserverView, attack: str) -> ModelView:
    """``view`` as a :class:`ModelView`, or :class:`NoPlaintextView` / :class:`ValidationError`."""
    if isinstance(view, SealedView):
        raise NoPlaintextView(
            f"{attack}: no plaintext view: {view.observer} saw {view.num_bytes} bytes of ciphertext "
            f"sealed to the {view.sealed_to}; there is no model to query"
        )
    if not isinstance(view, ModelView):
        raise ValidationError(f"{attack} needs a ModelView (a trained model), got {type(view).__name__}")
    return view


def update_view_from_upload(
    *,
    observer: str,
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    sent: np.ndarray,
    received: np.ndarray,
    lr: float,
    local_steps: int,
    num_samples: int | None = None,
    hidden: Sequence[str] = (),
) -> UpdateView:
    """The delta view of one FedAvg upload: ``received - sent``, split into the named shared parameters.

    ``sent`` is the flat vector the server broadcast and ``received`` the flat vector the client uploaded
    (both as decoded from the wire), laid out as ``names`` / ``shapes``; ``model`` must already hold the
    broadcast weights (and the attacker's guess for ``hidden``).
    """
    sent = np.asarray(sent, dtype=np.float32)
    received = np.asarray(received, dtype=np.float32)
    if sent.shape != received.shape or sent.ndim != 1:
        raise ValidationError(
            f"{observer}: upload of shape {received.shape} does not match the broadcast {sent.shape}"
        )
    sizes = [int(np.prod(s)) for s in shapes]
    if sum(sizes) != sent.size:
        raise ValidationError(
            f"{observer}: the named parameters hold {sum(sizes)} values, the upload has {sent.size}"
        )
    delta = torch.from_numpy(received - sent)
    update = {
        n: piece.view(s).clone() for n, piece, s in zip(names, torch.split(delta, sizes), shapes, strict=True)
    }
    return UpdateView(
        observer=observer,
        kind="delta",
        update=update,
        model=model,
        num_samples=num_samples,
        lr=lr,
        local_steps=local_steps,
        hidden=tuple(hidden),
    )
