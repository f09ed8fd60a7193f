"""Observers of a FedAvg run: the views an honest-but-curious server or an eavesdropper actually gets.

:class:`WireObserver` is a runtime ``tap`` (``SimulationRuntime(..., tap=observer.tap)``): it sees every
encoded message in both directions, exactly the bytes the codec produced, and decodes them as an
eavesdropper on an unencrypted link (or the server itself) would. From them it builds:

- :meth:`WireObserver.client_views`: per-client update views of a round (each upload minus the broadcast
  it answered), what undefended FedAvg shows the server;
- :meth:`WireObserver.aggregate_view`: the change of the global model between two broadcasts, what a
  client (or anyone receiving the model) sees when only the aggregate is released;
- a :class:`~fedveil.attacks.views.SealedView` for every message that is ciphertext to the observer (an
  enclave's sealed records), so an attack on an enclave-protected path reports "no plaintext view".

Which parameters a view names comes from the run's :class:`~fedveil.protocols.fedavg.ParameterPlan`:
private parameters (the AIoT projector) are ``hidden`` and the attacker's model holds its guess for them;
frozen parameters are not in an upload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from fedveil.attacks.views import SealedView, UpdateView, update_view_from_upload
from fedveil.core.codec import decode
from fedveil.errors import FedveilError, ValidationError
from fedveil.models.flat import FlatModel
from fedveil.protocols.fedavg import ParameterPlan
from fedveil.protocols.messages import FitReply, FitRequest

__all__ = ["WireObserver"]


@dataclass
class _Round:
    request: FitRequest | None = None
    replies: list[FitReply] = field(default_factory=list)
    sealed: list[int] = field(default_factory=list)


class WireObserver:
    """A tap that keeps what it decodes of a FedAvg run, round by round (module docstring).

    ``attacker_model`` builds the network as the attacker knows it (architecture, plus its guess for the
    private parameters); each view gets a fresh one with the broadcast's shared weights loaded.
    ``sealed_types`` names message classes whose payload is ciphertext to this observer.
    """

    def __init__(
        self,
        flat: FlatModel,
        plan: ParameterPlan,
        attacker_model: Callable[[], nn.Module],
        *,
        local_steps: Callable[[FitRequest, int], int] | None = None,
        sealed_types: tuple[type, ...] = (),
    ) -> None:
        self.flat = flat
        self.plan = plan
        self.attacker_model = attacker_model
        self.local_steps = local_steps or (
            lambda req, n: req.local_epochs * -(-n // req.batch_size)  # ceil(n / B) steps per epoch
        )
        self.sealed_types = sealed_types
        self.rounds: dict[int, _Round] = {}
        self.undecodable = 0

    def tap(self, direction: str, data: bytes) -> None:
        """The runtime's tap: decode and file one message (undecodable bytes are counted, not raised)."""
        try:
            msg = decode(bytes(data))
        except FedveilError:
            self.undecodable += 1
            return
        if isinstance(msg, self.sealed_types):
            self.rounds.setdefault(int(getattr(msg, "round", 0)), _Round()).sealed.append(len(data))
        elif isinstance(msg, FitRequest) and direction == "to_client":
            self.rounds.setdefault(msg.round, _Round()).request = msg
        elif isinstance(msg, FitReply) and direction == "from_client":
            self.rounds.setdefault(msg.round, _Round()).replies.append(msg)

    def _model(self, shared: np.ndarray) -> nn.Module:
        model = self.attacker_model()
        guess = FlatModel(model).initial()
        guess[self.plan.shared_index] = shared
        return FlatModel(model).load_into_module(guess)

    def _names_shapes(self) -> tuple[list[str], list[tuple[int, ...]]]:
        shared = set(self.plan.upload_index.tolist())
        offsets = np.cumsum([0, *self.flat.sizes])
        names, shapes = [], []
        for i, name in enumerate(self.flat.names):
            if int(offsets[i]) in shared:
                names.append(name)
                shapes.append(self.flat.shapes[i])
        return names, shapes

    def client_views(
        self, rnd: int, observer: str = "server: per-client update"
    ) -> list[UpdateView | SealedView]:
        """One view per upload of round ``rnd``: the client's delta, or ciphertext when it was sealed."""
        seen = self.rounds.get(rnd)
        if seen is None:
            raise ValidationError(
                f"the observer saw nothing of round {rnd}; it saw rounds {sorted(self.rounds)}"
            )
        views: list[UpdateView | SealedView] = [SealedView(observer, n) for n in seen.sealed]
        if seen.replies and seen.request is None:
            raise ValidationError(f"round {rnd}: uploads seen without the broadcast they answer")
        if seen.request is None:
            return views
        names, shapes = self._names_shapes()
        sent_upload = seen.request.weights[np.searchsorted(self.plan.shared_index, self.plan.upload_index)]
        hidden = tuple(self.plan.private_names)
        snapshot = self._model(seen.request.weights)  # one model per broadcast: the views share the snapshot
        for reply in seen.replies:
            views.append(
                update_view_from_upload(
                    observer=observer,
                    model=snapshot,
                    names=names,
                    shapes=shapes,
                    sent=sent_upload,
                    received=reply.weights,
                    lr=seen.request.lr,
                    local_steps=self.local_steps(seen.request, reply.num_samples),
                    num_samples=reply.num_samples,
                    hidden=hidden,
                )
            )
        return views

    def aggregate_view(self, rnd: int, observer: str = "client: aggregate update") -> UpdateView:
        """The change of the global model from round ``rnd``'s broadcast to round ``rnd + 1``'s."""
        a, b = self.rounds.get(rnd), self.rounds.get(rnd + 1)
        if a is None or b is None or a.request is None or b.request is None:
            raise ValidationError(
                f"the aggregate view of round {rnd} needs the broadcasts of {rnd} and {rnd + 1}"
            )
        names, shapes = self._names_shapes()
        pick = np.searchsorted(self.plan.shared_index, self.plan.upload_index)
        samples = sum(r.num_samples for r in a.replies)
        mean_samples = max(1, round(samples / len(a.replies))) if a.replies else 1
        return update_view_from_upload(
            observer=observer,
            model=self._model(a.request.weights),
            names=names,
            shapes=shapes,
            sent=a.request.weights[pick],
            received=b.request.weights[pick],
            lr=a.request.lr,
            local_steps=self.local_steps(a.request, mean_samples),
            num_samples=samples or None,
            hidden=tuple(self.plan.private_names),
        )
