"""FL-traditional: FedAvg with a softmax head, FDML's baseline (Sec. VIII-B1 of 000_5f3e2740eb021610.txt).

"We replace the DML loss with the cross-entropy loss, and the last layer of the original embedding
network is connected with a fully connected layer whose output has as many dimensions as the number
of participants. The participant of FL-traditional will only perform one training iteration in each
training round. The other settings ... are the same as our FDML research platform." So each round
selects a phone model and ``clients_per_round`` of its devices (as FDML does), each device takes
``local_steps`` SGD steps on ``samples_per_client`` freshly sampled training samples labelled with
its own class, and the server averages the returned models weighted by sample counts (FedAvg,
McMahan et al. 2017). Evaluation uses the embedding network only (the head is dropped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import grad, vmap

from fedveil.core.aggregation import weighted_average
from fedveil.core.communicator import ClientId, Communicator
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.flat import FlatModel
from fedveil.protocols.common import ClientData, RoundReport, as_tensor, client_rng, expect, fill_traffic
from fedveil.protocols.common import select_group_cohort as select_cohort
from fedveil.protocols.messages import Register, RegistrationCall, TrainReply, TrainRequest
from fedveil.protocols.registration import register_clients
from fedveil.protocols.settings import FedAvgConfig


class EmbeddingClassifier(nn.Module):
    """An embedding network followed by a linear softmax head with one output per training user."""

    def __init__(self, embedding: nn.Module, embedding_dim: int, num_classes: int) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = nn.Linear(embedding_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)``."""
        return self.head(self.embedding(x))


class FedAvgServer:
    """The server of FL-traditional: selection as FDML, FedAvg of the returned models."""

    def __init__(self, cfg: FedAvgConfig, initial_weights: np.ndarray, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.rng = rng
        self._weights = np.array(initial_weights, dtype=np.float32)
        self.groups: dict[str, list[ClientId]] = {}

    @property
    def weights(self) -> np.ndarray:
        """The global model's flat parameters (embedding network first, then the head)."""
        return self._weights.copy()

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The global weights and the selection generator's state, for a resumed run."""
        return {"weights": self.weights}, {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (shape checked)."""
        weights = np.array(arrays["weights"], dtype=np.float32)
        if weights.shape != self._weights.shape:
            raise ConfigError(f"checkpoint weights of shape {weights.shape}, model has {self._weights.shape}")
        self._weights = weights
        self.rng.bit_generator.state = dict(meta["rng"])

    async def register(self, comm: Communicator, *, group_by: str = "phone_model") -> None:
        """Registration, as FDML's step 1."""
        self.groups, _ = await register_clients(comm, "fedavg", group_by=group_by)

    async def run_round(self, rnd: int, comm: Communicator) -> RoundReport:
        """Select, train locally, average."""
        cfg = self.cfg
        before = comm.stats().copy()
        _, cohort = select_cohort(self.groups, cfg.clients_per_round, self.rng)
        request = TrainRequest(rnd, cfg.lr, cfg.samples_per_client, cfg.local_steps, self._weights)

        def check(cid: ClientId, msg: TrainReply) -> None:
            expect(msg.round == rnd, f"reply for round {msg.round}, expected {rnd}")
            expect(
                msg.weights.shape == self._weights.shape,
                f"weights of shape {msg.weights.shape}, expected {self._weights.shape}",
            )
            expect(
                msg.num_samples == cfg.samples_per_client,
                f"num_samples {msg.num_samples}, expected {cfg.samples_per_client}",
            )

        replies = await comm.request(
            {c: request for c in cohort},
            phase="train",
            min_replies=len(cohort),
            timeout=cfg.timeout,
            expected=TrainReply,
            validate=check,
        )
        applied = len(replies) >= cfg.min_replies
        if applied:
            self._weights = weighted_average(
                {c: m.weights for c, m in replies.items()},
                {c: float(m.num_samples) for c, m in replies.items()},
            )
        report = RoundReport(rnd, applied, None, 1, len(cohort), len(replies))
        return fill_traffic(report, before, comm.stats())


class FedAvgClients:
    """Devices of FL-traditional: ``local_steps`` of SGD on cross-entropy with their own class label.

    ``batched=True`` computes all addressed devices' local updates together (``vmap`` over devices);
    ``batched=False`` one by one; both give equal numbers (``tests/test_protocols_fedavg.py``).
    """

    def __init__(
        self,
        data: ClientData,
        flat: FlatModel,
        *,
        attributes: Mapping[ClientId, Mapping[str, str]],
        seed: int,
        batched: bool = True,
        input_shape: tuple[int, ...] = (1, 30, 10),
    ) -> None:
        self.data = data
        self.flat = flat
        self.attributes = attributes
        self.ids = list(data.train_user_ids())
        self.label = {cid: i for i, cid in enumerate(self.ids)}
        self.rngs = {cid: client_rng(seed, i) for i, cid in enumerate(self.ids)}
        self.batched = batched
        self.input_shape = input_shape

    def client_ids(self) -> list[ClientId]:
        """Every device of the population."""
        return self.ids

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Registration or local training for the addressed devices."""
        out: dict[ClientId, object] = {}
        train: dict[ClientId, TrainRequest] = {}
        for cid, m in msgs.items():
            if isinstance(m, RegistrationCall):
                out[cid] = Register("fedavg", dict(self.attributes[cid]))
            elif isinstance(m, TrainRequest):
                train[cid] = m
            else:
                out[cid] = ValidationError(f"device cannot handle {type(m).__name__}")
        if train:
            out.update(self._train(train))
        return out

    def _loss(self, p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.flat(p, x), y)

    def _train(self, msgs: Mapping[ClientId, TrainRequest]) -> dict[ClientId, object]:
        weights: dict[int, torch.Tensor] = {}
        data = {}
        for cid, m in msgs.items():
            weights.setdefault(id(m.weights), as_tensor(m.weights))
            x = self.data.sample_training(cid, m.num_samples, self.rngs[cid])
            x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(
                m.num_samples, *self.input_shape
            )
            data[cid] = (x, torch.full((m.num_samples,), self.label[cid], dtype=torch.long))
        new: dict[ClientId, np.ndarray] = {}
        if self.batched:
            groups: dict[tuple[int, int, float, int], list[ClientId]] = {}
            for cid, m in msgs.items():
                groups.setdefault((id(m.weights), m.num_samples, m.lr, m.local_steps), []).append(cid)
            step = vmap(grad(self._loss), in_dims=(0, 0, 0))
            for (wid, _, lr, steps), group in groups.items():
                xs = torch.stack([data[c][0] for c in group])
                ys = torch.stack([data[c][1] for c in group])
                p = weights[wid].expand(len(group), -1).clone()
                for _ in range(steps):
                    p = p - lr * step(p, xs, ys)
                new.update({c: p[i].numpy() for i, c in enumerate(group)})
        else:
            for cid, m in msgs.items():
                p = weights[id(m.weights)].clone()
                for _ in range(m.local_steps):
                    p = p - m.lr * grad(self._loss)(p, *data[cid])
                new[cid] = p.numpy()
        return {cid: TrainReply(m.round, m.num_samples, new[cid]) for cid, m in msgs.items()}
