"""The AIoT private-projector protocol (Sec. 3-4) on the FedAvg engine.

A server pre-trains the face representation model ``f_theta1`` (MobileFaceNet) with an ArcFace classifier
on a public population and sends it to the devices. Each device appends its own **private projector**
``Proj_theta2``, a new randomly initialised ArcFace layer over its local identities (Eq. 1:
``alpha = f_theta1(x)``, ``o = Proj_theta2(alpha)``), fine-tunes both jointly on cross-entropy (Eqs. 2-3)
and uploads only ``f_theta1``; the server averages the uploads (FedAvg). The projector never leaves the
device: it is not in the vector the server sends or receives (``tests/test_protocols_projector.py``
searches every byte on the wire for it), and a device's projector has as many classes as it has
identities, so projectors of different devices could not even be averaged.

The paper's strategies for federated fine-tuning (Sec. 4), both options of :class:`ProjectorSettings`:

- **Frozen BatchNorm statistics** (Sec. 4.1): during local training BatchNorm normalises with the
  running mean and variance of the pre-trained model and never updates them (its affine ``gamma`` and
  ``beta`` still train). The statistics travel from the server with the weights and are not uploaded.
  Without freezing (the ablation), BatchNorm uses batch statistics, updates its running statistics on
  the device as usual, and they are uploaded and averaged with the weights.
- **Warm-up** (Sec. 4.2, Eq. 7): the learning rate of a device's ``i``-th local mini-batch is
  ``i * eta / m`` for ``i <= m``, then ``eta``; ``i`` counts the device's mini-batches since it joined
  the fine-tuning (across rounds: a device that trains in several rounds warms up once). ``m = 0``
  disables it.

Defaults are the paper's Sec. 5.2: 20 rounds, 1 local epoch, learning rate 0.001 (the paper does not
name its optimizer; ours is SGD with momentum 0.9, insightface's choice for ArcFace, in
``configs/aiot/``). A device with fewer than two identities cannot train an ArcFace projector (there is
nothing to tell apart): it is excluded with a logged reason (:attr:`ProjectorClients.excluded`). A
mini-batch of one photo is dropped (BatchNorm in train mode cannot normalise a single example).

Inference (Eq. 5): a probe's identity is the reference whose embedding is nearest in Euclidean distance
(:func:`identify`); verification compares pairs (:mod:`fedveil.experiments.aiot.runner`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedveil.core.communicator import ClientId
from fedveil.data.federated import FederatedDataset
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.device import resolve_device
from fedveil.models.faces import ArcFace
from fedveil.models.flat import FlatModel
from fedveil.protocols.common import as_tensor, client_rng
from fedveil.protocols.fedavg import ParameterPlan
from fedveil.protocols.local import LocalOptimizer, epoch_batches, local_train
from fedveil.protocols.messages import FitReply, FitRequest

__all__ = [
    "ProjectorClients",
    "ProjectorSettings",
    "backbone_flat",
    "backbone_plan",
    "identify",
    "warmup_rates",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProjectorSettings:
    """The device side's options (module docstring): ``freeze_bn`` (Sec. 4.1), ``warmup_batches`` ``m``
    of Eq. 7 (0: none), and the projector's ArcFace ``scale`` and ``margin`` (64 and 0.5, Sec. 5.2)."""

    freeze_bn: bool = True
    warmup_batches: int = 5
    scale: float = 64.0
    margin: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.warmup_batches, bool) or self.warmup_batches < 0:
            raise ConfigError(
                f"warmup_batches {self.warmup_batches!r} must be an integer >= 0 (0: no warm-up)"
            )
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(f"ArcFace scale {self.scale!r} must be a finite number > 0")
        if not (math.isfinite(self.margin) and 0 <= self.margin < math.pi / 2):
            raise ConfigError(f"ArcFace margin {self.margin!r} must lie in [0, pi/2)")


def warmup_rates(lr: float, done: int, steps: int, warmup_batches: int) -> list[float]:
    """Eq. 7: the rates of mini-batches ``done + 1 .. done + steps`` of a device: ``i * lr / m`` while
    ``i <= m``, then ``lr`` (every rate ``lr`` when ``m = 0``)."""
    if warmup_batches == 0:
        return [lr] * steps
    return [lr * min(i, warmup_batches) / warmup_batches for i in range(done + 1, done + steps + 1)]


def _batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def backbone_flat(backbone: nn.Module) -> FlatModel:
    """The shared model's flat view: ``f_theta1``'s parameters, then its BatchNorm statistics.

    A projector inside the backbone would be shared with the server: refused here, naming its
    parameters (the projector is each device's own, :class:`ProjectorClients`)."""
    for name, module in backbone.named_modules():
        if isinstance(module, ArcFace):
            owned = [f"{name}.{n}" if name else n for n, _ in module.named_parameters()]
            raise ConfigError(
                f"parameters {owned} belong to an ArcFace projector registered as part of the shared model; "
                "the projector never leaves the device: pass the representation network f_theta1 alone"
            )
    return FlatModel(backbone, buffers=True)


def backbone_plan(flat: FlatModel, *, freeze_bn: bool) -> ParameterPlan:
    """What travels: everything is sent; BatchNorm statistics are uploaded only when not frozen."""
    return ParameterPlan(flat, frozen=flat.buffer_names if freeze_bn and flat.buffer_names else None)


class ProjectorClients:
    """The devices of the AIoT protocol (a ``ClientPool``; module docstring).

    ``backbone`` is ``f_theta1`` (any module mapping photos to embeddings of ``embedding_dim``);
    ``data``'s devices hold ``x`` and local labels ``y`` (:func:`~fedveil.data.faces.face_devices`).
    Each device's projector is drawn from its own generator (``client_rng(seed, i)``) and kept across
    rounds with its warm-up counter. A :class:`FitRequest` carries the shared vector (parameters, then
    BatchNorm statistics: :func:`backbone_flat`); the reply carries the parameters, and the statistics
    too when they are not frozen. ``device`` (:func:`~fedveil.models.device.resolve_device`) is where the
    backbone and the projectors train: they move there, and each device's photos move there once.
    """

    def __init__(
        self,
        backbone: nn.Module,
        data: FederatedDataset,
        *,
        embedding_dim: int,
        optimizer: LocalOptimizer,
        seed: int,
        settings: ProjectorSettings | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        backbone.to(self.device)
        self.flat = backbone_flat(backbone)
        self.backbone = backbone
        self.settings = settings or ProjectorSettings()
        self.optimizer = optimizer
        self.data = data
        self.num_weights = sum(p.numel() for p in backbone.parameters())
        self.excluded: dict[ClientId, str] = {}
        self.projectors: dict[ClientId, ArcFace] = {}
        self.rngs: dict[ClientId, np.random.Generator] = {}
        self.batches_done: dict[ClientId, int] = {}
        self._cache: dict[ClientId, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, cid in enumerate(data.user_ids):
            y = data.array(cid, "y")
            classes = int(y.max()) + 1 if len(y) else 0
            if len(np.unique(y)) < 2:
                self.excluded[cid] = (
                    f"device {cid} holds {len(np.unique(y))} identity; an ArcFace projector needs >= 2"
                )
                log.warning("excluded from training: %s", self.excluded[cid])
                continue
            rng = client_rng(seed, i)
            gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
            projector = ArcFace(
                embedding_dim, classes, scale=self.settings.scale, margin=self.settings.margin
            )
            with torch.no_grad():
                bound = math.sqrt(6.0 / (classes + embedding_dim))
                projector.weight.uniform_(-bound, bound, generator=gen)
            projector.to(self.device)
            self.projectors[cid], self.rngs[cid], self.batches_done[cid] = projector, rng, 0
        self.ids = [c for c in data.user_ids if c not in self.excluded]
        if not self.ids:
            raise ConfigError("no device holds two or more identities; nothing can train a projector")

    def client_ids(self) -> list[ClientId]:
        """The devices that can train (those with >= 2 identities)."""
        return self.ids

    def projector_weights(self, cid: ClientId) -> np.ndarray:
        """Device ``cid``'s projector (a copy; for the device's own use and the spy test)."""
        return self.projectors[cid].weight.detach().cpu().numpy().copy()

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """What the simulated devices keep across rounds, for a resumed simulation: each device's
        projector (arrays ``projector.<i>.<name>``, ``i`` its position in :meth:`client_ids`) and warm-up
        counter (``batches_done``); their generators are the pool's ``rngs``
        (:func:`~fedveil.protocols.common.pool_rng_states`). A real device keeps its own projector on its
        own disk and it never travels; this is the simulation's state, saved on the machine that
        simulates the devices."""
        arrays = {
            f"projector.{i}.{name}": t.detach().cpu().numpy().copy()
            for i, cid in enumerate(self.ids)
            for name, t in self.projectors[cid].state_dict().items()
        }
        return arrays, {"batches_done": [self.batches_done[cid] for cid in self.ids]}

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (every device's projector, shapes checked)."""
        done = meta.get("batches_done")
        if not isinstance(done, list) or len(done) != len(self.ids):
            raise ConfigError(
                f"checkpoint holds the warm-up counters of {len(done) if isinstance(done, list) else 0} "
                f"devices, this simulation has {len(self.ids)}: it is another run's"
            )
        for i, cid in enumerate(self.ids):
            projector = self.projectors[cid]
            state = {}
            for name, t in projector.state_dict().items():
                key = f"projector.{i}.{name}"
                if key not in arrays or arrays[key].shape != tuple(t.shape):
                    raise ConfigError(f"checkpoint has no projector {key} of shape {tuple(t.shape)}")
                state[name] = torch.from_numpy(np.array(arrays[key], dtype=np.float32))
            projector.load_state_dict(state)
            self.batches_done[cid] = int(done[i])

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Local fine-tuning for every addressed device."""
        out: dict[ClientId, object] = {}
        for cid, m in msgs.items():
            if not isinstance(m, FitRequest):
                out[cid] = ValidationError(f"an AIoT device cannot handle {type(m).__name__}")
            elif m.batch_size < 2:
                out[cid] = ValidationError(
                    f"batch_size {m.batch_size}: an ArcFace projector trains on >= 2 photos"
                )
            elif m.weights.shape != (self.flat.num_params,):
                out[cid] = ValidationError(
                    f"weights of shape {m.weights.shape}, expected ({self.flat.num_params},)"
                )
            else:
                out[cid] = self._fit(cid, m)
        return out

    def _tensors(self, cid: ClientId) -> tuple[torch.Tensor, torch.Tensor]:
        if cid not in self._cache:
            x, y = self.data.array(cid, "x"), self.data.array(cid, "y")
            self._cache[cid] = (
                torch.tensor(x, dtype=torch.float32).to(self.device),
                torch.tensor(y, dtype=torch.int64).to(self.device),
            )
        return self._cache[cid]

    def _fit(self, cid: ClientId, m: FitRequest) -> FitReply:
        flat, settings = self.flat, self.settings
        received = as_tensor(m.weights).to(self.device)
        buffers = {n: t for n, t in flat.unflatten(received.clone()).items() if n in flat.buffer_names}
        projector = self.projectors[cid]
        head_flat = FlatModel(projector)
        p0 = torch.cat([received[: self.num_weights], torch.from_numpy(head_flat.initial()).to(self.device)])

        def objective(p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            views = flat.unflatten(p[: self.num_weights])
            alpha = functional_call(self.backbone, {**views, **buffers}, (x,))
            head = head_flat.unflatten(p[self.num_weights :])
            return nn.functional.cross_entropy(functional_call(projector, head, (alpha, y)), y)

        xt, yt = self._tensors(cid)
        batches = epoch_batches(
            xt, yt, self.rngs[cid], epochs=m.local_epochs, batch_size=m.batch_size, min_size=2
        )
        rates = warmup_rates(m.lr, self.batches_done[cid], len(batches), settings.warmup_batches)
        self.backbone.train()
        if settings.freeze_bn:
            for bn in _batch_norms(self.backbone):
                bn.eval()
        p, loss = local_train(objective, p0, batches, self.optimizer, rates, eager=not settings.freeze_bn)
        self.batches_done[cid] += len(batches)
        weights = p.detach()[: self.num_weights]
        head_flat.load_into_module(p.detach()[self.num_weights :].cpu().numpy())
        upload = [weights]
        if not settings.freeze_bn:
            upload += [buffers[n].reshape(-1) for n in flat.buffer_names]
        return FitReply(m.round, len(xt), float(loss), torch.cat(upload).cpu().numpy().astype(np.float32))


def identify(gallery: np.ndarray, gallery_labels: np.ndarray, probes: np.ndarray) -> np.ndarray:
    """Eq. 5: each probe embedding's label is that of the nearest gallery embedding (Euclidean)."""
    if gallery.ndim != 2 or probes.ndim != 2 or gallery.shape[1] != probes.shape[1]:
        raise ValidationError(f"embeddings of shapes {gallery.shape} and {probes.shape} do not match")
    if len(gallery) != len(gallery_labels) or len(gallery) == 0:
        raise ValidationError(f"{len(gallery)} gallery embeddings for {len(gallery_labels)} labels")
    d = (probes**2).sum(1)[:, None] - 2 * probes @ gallery.T + (gallery**2).sum(1)[None]
    return np.asarray(gallery_labels)[np.argmin(d, axis=1)]
