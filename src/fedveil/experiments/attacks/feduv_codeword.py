"""The attack beside [FedUV]'s codeword claim: the server reads each user's codeword off its updates.

[FedUV] Sec. 4.2: the server never learns a user's secret codeword ``v_u``. It does see, in undefended
FedAvg, every selected user's locally trained model. :func:`feduv_codeword_table` trains FedUV, softmax
and FedAwS on the SYNTHETIC MNIST-UV data at a small scale with the server's communicator recorded
(:class:`ServerTranscript`: the training requests it sent and the replies it received, per user), turns
each user's rounds into :class:`~fedveil.attacks.views.UpdateView` s of the head (``fc``), and runs
:mod:`fedveil.attacks.codeword` on them:

- FedUV: bit accuracy of the recovered codeword against the user's true one (chance 0.5, with its
  binomial null standard error ``0.5 / sqrt(c U)``), and how many users' guesses fall within the BCH code's
  error-correcting radius ``t`` (recovered by a bounded-distance decoder); both also from the user's
  first round alone. Controls: the same guess scored against another user's codeword and against a
  codeword of the code drawn at random.
- softmax and FedAwS: the analogous target is the user's class row ``w_u``; the server assigned it and
  broadcasts it, so it is exposed by design. The attack identifies the user's class from its update
  (top-1 accuracy, chance ``1 / K``); control: scored against a class drawn at random.

The true codewords and classes are read from the client pool only to score the attack.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedveil.attacks.codeword import class_scores, codeword_attack, compare_codeword
from fedveil.attacks.views import UpdateView
from fedveil.core.atomic import atomic_write
from fedveil.core.communicator import ClientId, CommStats, Communicator, Fold, Message, Validator
from fedveil.data.mnist_uv import MnistUvConfig, generate_mnist_uv
from fedveil.errors import ConfigError
from fedveil.experiments.feduv.runner import mnist_uv_net
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.privacy.codes import BchCode
from fedveil.protocols.feduv import (
    FedAwSMethod,
    FedAwSServer,
    FedUVMethod,
    FedUVServer,
    SoftmaxMethod,
    SoftmaxServer,
    UvClients,
    UvModel,
    UvServer,
    UvTrainConfig,
)
from fedveil.protocols.feduv_messages import UvTrainReply, UvTrainRequest
from fedveil.runtime.simulation import SimulationRuntime

__all__ = ["ServerTranscript", "feduv_codeword_table", "train_observed"]

METHODS = ("feduv", "softmax", "fedaws")


@dataclass
class ServerTranscript:
    """A :class:`~fedveil.core.communicator.Communicator` that passes everything to ``inner`` and keeps
    what the server itself sees of training: per user, each ``(request, reply)`` pair of a round."""

    inner: Communicator
    rounds: dict[ClientId, list[tuple[UvTrainRequest, UvTrainReply]]] = field(default_factory=dict)

    def available(self) -> Sequence[ClientId]:
        """The inner communicator's clients."""
        return self.inner.available()

    def stats(self) -> CommStats:
        """The inner communicator's counters."""
        return self.inner.stats()

    async def request(
        self,
        msgs: Mapping[ClientId, Message],
        *,
        phase: str,
        min_replies: int,
        timeout: float,
        expected: type | tuple[type, ...],
        validate: Validator | None = None,
        fold: Fold | None = None,
    ) -> dict[ClientId, Message]:
        """Forward to ``inner``; keep every training reply beside the request it answers (as accepted,
        before a ``fold`` sees it)."""

        def keep(cid: ClientId, reply: Message) -> Message:
            if isinstance(reply, UvTrainReply) and isinstance(msgs[cid], UvTrainRequest):
                self.rounds.setdefault(cid, []).append((msgs[cid], reply))
            return reply if fold is None else fold(cid, reply)

        return await self.inner.request(
            msgs,
            phase=phase,
            min_replies=min_replies,
            timeout=timeout,
            expected=expected,
            validate=validate,
            fold=keep,
        )


def _server(method: str, train: UvTrainConfig, model: UvModel, seed: int, code_length: int) -> UvServer:
    rng = np.random.default_rng([seed, 1])
    if method == "feduv":
        return FedUVServer(train, model, rng, code_length=code_length)
    if method == "softmax":
        return SoftmaxServer(train, model, rng)
    return FedAwSServer(train, model, rng)


def train_observed(
    method: str,
    data: Any,
    *,
    writers: int,
    rounds: int,
    train: UvTrainConfig,
    code_length: int,
    width_divisor: int,
    seed: int,
    device: str | torch.device = "cpu",
) -> tuple[UvClients, ServerTranscript, UvServer]:
    """Set up and train ``method`` for ``rounds`` rounds of Alg. 1 in the simulation, the server's
    communicator recorded, the users training on ``device`` (:class:`~fedveil.protocols.feduv.UvClients`:
    their examples moved there once; the server and its transcript in host memory); returns the users (for
    scoring only), the transcript and the server."""
    if method not in METHODS:
        raise ConfigError(f"method {method!r}: choose from {', '.join(METHODS)}")
    torch.manual_seed(seed)
    outputs = code_length if method == "feduv" else writers
    model = UvModel(mnist_uv_net(outputs, bias=method != "fedaws", width_divisor=width_divisor))
    uv_method = {"feduv": FedUVMethod, "softmax": SoftmaxMethod, "fedaws": FedAwSMethod}[method]()
    pool = UvClients(uv_method, model, data, seed=seed, device=device)
    server = _server(method, train, model, seed, code_length)
    comm = ServerTranscript(SimulationRuntime(pool, rng=np.random.default_rng([seed, 2])))

    async def go() -> None:
        await server.setup(comm)
        for rnd in range(1, rounds + 1):
            await server.run_round(rnd, comm)

    asyncio.run(go())
    return pool, comm, server


def _head_views(model: UvModel, pairs: Sequence[tuple[UvTrainRequest, UvTrainReply]]) -> list[UpdateView]:
    """One :class:`UpdateView` of the head (``fc.weight``, ``fc.bias`` if any) per round of a user."""
    names = [n for n in ("fc.weight", "fc.bias") if n in model.flat.names]
    views = []
    for request, reply in pairs:
        delta = np.asarray(reply.weights, np.float32) - np.asarray(request.weights, np.float32)
        net = copy.deepcopy(model.net)
        FlatModel(net).load_into_module(np.asarray(request.weights, np.float32))
        update = {}
        for n in names:
            sl = model.slice_of(n)
            shape = dict(net.named_parameters())[n].shape
            update[n] = torch.from_numpy(delta[sl].copy()).view(shape)
        views.append(UpdateView("server: one user's FedAvg upload", "delta", update, net, lr=request.lr))
    return views


def _codeword_rows(
    pool: UvClients, comm: ServerTranscript, model: UvModel, code: BchCode, rng: np.random.Generator
) -> dict[str, Any]:
    """FedUV: bit accuracy and recovery per user, with two controls: the guess scored against another
    user's codeword, and against a codeword of the code drawn at random with ``rng``."""
    users = [c for c in pool.client_ids() if c in comm.rounds]
    truth = {c: pool._users[c].codeword.bits for c in users}  # ground truth, for scoring only
    target, first, control, drawn_rows = [], [], [], []
    for i, cid in enumerate(users):
        views = _head_views(model, comm.rounds[cid])
        other = users[(i + 1) % len(users)]
        guess = codeword_attack(views).bits
        target.append(compare_codeword(guess, truth[cid], code.t))
        first.append(compare_codeword(codeword_attack(views[:1]).bits, truth[cid], code.t))
        control.append(compare_codeword(guess, truth[other], code.t))
        drawn = code.encode(rng.integers(0, 2, code.k, dtype=np.uint8))
        drawn_rows.append(compare_codeword(guess, drawn, code.t))

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        acc = np.array([r["bit_accuracy"] for r in rows])
        return {
            "bit_accuracy_mean": float(acc.mean()),
            "bit_accuracy_min": float(acc.min()),
            "hamming_median": float(np.median([r["hamming"] for r in rows])),
            "within_radius": int(sum(r["within_radius"] for r in rows)),
        }

    return {
        "code": {"n": code.n, "k": code.k, "d": code.d, "t": code.t},
        "users_attacked": len(users),
        "rounds_per_user_mean": float(np.mean([len(comm.rounds[c]) for c in users])),
        "chance": 0.5,
        "null_std_error": 0.5 / math.sqrt(code.n * len(users)),
        "target": summary(target),
        "target_first_round": summary(first),
        "control_other_user": summary(control),
        "control_random_codeword": summary(drawn_rows),
    }


def _class_rows(
    pool: UvClients, comm: ServerTranscript, model: UvModel, rng: np.random.Generator
) -> dict[str, Any]:
    """Softmax / FedAwS: top-1 identification of the user's class row, with the control: the guess
    scored against a class drawn uniformly with ``rng``."""
    users = [c for c in pool.client_ids() if c in comm.rounds]
    truth = {c: pool._users[c].class_index for c in users}  # ground truth, for scoring only
    bias = "fc.bias" if model.has_bias else None
    hits, control = [], []
    for cid in users:
        guess = int(np.argmax(class_scores(_head_views(model, comm.rounds[cid]), bias=bias)))
        hits.append(guess == truth[cid])
        control.append(guess == int(rng.integers(model.num_outputs)))
    k = model.num_outputs
    return {
        "users_attacked": len(users),
        "classes": k,
        "chance": 1.0 / k,
        "null_std_error": math.sqrt((1.0 / k) * (1 - 1.0 / k) / len(users)),
        "target_top1": float(np.mean(hits)),
        "control_random_class_top1": float(np.mean(control)),
        "exposed_by_design": "the server assigns the class index and broadcasts W (FedAwS sends each user "
        "only its own row w_u)",
    }


def feduv_codeword_table(
    *,
    methods: Sequence[str] = METHODS,
    writers: int = 10,
    rounds: int = 20,
    fraction: float = 0.3,
    code_length: int = 127,
    width_divisor: int = 8,
    seed: int = 0,
    out: Path | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Train each of ``methods`` on SYNTHETIC MNIST-UV (``writers`` users, 50 training examples each) for
    ``rounds`` rounds with ``fraction`` of the users per round, and attack the server's view (module
    docstring). The users train on ``device`` (:func:`~fedveil.models.device.resolve_device`, resolved
    before anything is generated); the attack reads the uploads the server holds, in host memory. Returns
    (and writes to ``out/feduv_codeword.json``) one entry per method, and the device."""
    where = resolve_device(device)
    data = generate_mnist_uv(
        MnistUvConfig(seed=seed, writers=writers, train=50, val=15, test=15, unseen_writers=writers)
    )
    train = UvTrainConfig(fraction=fraction)
    rng = np.random.default_rng([seed, 3])
    table: dict[str, Any] = {}
    for method in methods:
        pool, comm, server = train_observed(
            method,
            data,
            writers=writers,
            rounds=rounds,
            train=train,
            code_length=code_length,
            width_divisor=width_divisor,
            seed=seed,
            device=where,
        )
        if isinstance(server, FedUVServer):
            table[method] = _codeword_rows(pool, comm, server.model, server.code, rng)
        else:
            table[method] = _class_rows(pool, comm, server.model, rng)
    summary = {
        "run": {
            "data": "SYNTHETIC MNIST-UV",
            "writers": writers,
            "rounds": rounds,
            "fraction": fraction,
            "code_length": code_length,
            "width_divisor": width_divisor,
            "seed": seed,
            "device": str(where),
            "observer": "server: each selected user's FedAvg upload and the model it was sent",
        },
        "attacks": table,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(
            out / "feduv_codeword.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode()
        )
    return summary
