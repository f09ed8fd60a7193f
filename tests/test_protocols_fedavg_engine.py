"""The FedAvg engine on image-like data: batched = one by one, hooks (private, frozen, transform, server lr),
evaluation, metering through the codec, and a spy showing private parameters never reach the wire."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from fedveil.core.codec import decode
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.flat import FlatModel
from fedveil.protocols.fedavg import (
    ClipAndNoise,
    FitResult,
    ImageFedAvgConfig,
    ModelClients,
    ModelServer,
    ParameterPlan,
    evaluate_model,
    fedavg_aggregate,
)
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import FitReply, FitRequest
from fedveil.runtime.simulation import SimulationRuntime


class Tiny(nn.Module):
    """A small CNN with a private-able head (``head``) on 1x8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.body = nn.Linear(4 * 4 * 4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1)
        return self.head(torch.relu(self.body(h)))


def _data(
    clients: int = 6, per_client: int = 12, seed: int = 0
) -> tuple[FederatedDataset, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    protos = rng.uniform(0, 1, size=(3, 1, 8, 8)).astype(np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 3, n)
        x = np.clip(protos[y] + rng.normal(0, 0.25, (n, 1, 8, 8)), 0, 1).astype(np.float32)
        return x, y.astype(np.int64)

    users = []
    for i in range(clients):
        x, y = draw(per_client + (i % 2) * 5)
        users.append(UserData(f"c{i}", {}, {"x": x, "y": y}))
    tx, ty = draw(300)
    return FederatedDataset(users), tx, ty


def _run(cfg, *, batched=True, rounds=3, plan_kw=None, transform=None, tap=None, seed=0):
    torch.manual_seed(seed)
    flat = FlatModel(Tiny())
    data, tx, ty = _data()
    plan = ParameterPlan(flat, **(plan_kw or {}))
    initial = flat.initial()
    pool = ModelClients(
        flat,
        data,
        optimizer=cfg.optimizer,
        seed=4,
        plan=plan,
        initial=initial,
        transform=transform,
        batched=batched,
    )
    rt = SimulationRuntime(pool, rng=np.random.default_rng(2), tap=tap)
    server = ModelServer(cfg, flat, np.random.default_rng(1), plan=plan, initial=initial)
    server.setup(rt)

    async def go():
        return [await server.run_round(r, rt) for r in range(1, rounds + 1)]

    reports = asyncio.run(go())
    return server, pool, reports, (tx, ty), initial


CFG = ImageFedAvgConfig(clients_per_round=4, local_epochs=2, batch_size=5, optimizer=LocalOptimizer(lr=0.1))


@pytest.mark.parametrize(
    "opt", [LocalOptimizer(lr=0.1), LocalOptimizer(lr=0.05, momentum=0.9), LocalOptimizer("adam", lr=0.01)]
)
def test_batched_cohort_equals_client_by_client(opt) -> None:
    cfg = replace(CFG, optimizer=opt)
    a, _, ra, _, _ = _run(cfg, batched=True)
    b, _, rb, _, _ = _run(cfg, batched=False)
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-5, atol=1e-6)
    assert [r.loss for r in ra] == pytest.approx([r.loss for r in rb], rel=1e-5)


def test_training_improves_test_accuracy_and_reports_loss() -> None:
    server, _, reports, (tx, ty), initial = _run(replace(CFG, clients_per_round=6), rounds=15)
    flat = server.flat
    before = evaluate_model(flat.load_into_module(initial), tx, ty)
    after = server.evaluate(tx, ty)
    assert after["accuracy"] > max(0.8, before["accuracy"] + 0.3)
    assert after["loss"] < before["loss"]
    assert reports[-1].loss < reports[0].loss
    assert all(r.applied and r.participants == 6 and r.bytes_up > 0 and r.bytes_down > 0 for r in reports)
    assert reports[0].extra["lr"] == pytest.approx(0.1)


def test_server_lr_is_polifl_eq1() -> None:
    plain, _, _, _, initial = _run(CFG, rounds=1)
    half, _, _, _, _ = _run(replace(CFG, server_lr=0.5), rounds=1)
    np.testing.assert_allclose(half.weights, initial + 0.5 * (plain.weights - initial), rtol=1e-5, atol=1e-6)


def test_fedavg_aggregate_weights_by_samples() -> None:
    results = {
        "a": FitResult(np.array([1.0, 0.0], np.float32), 1),
        "b": FitResult(np.array([4.0, 3.0], np.float32), 2),
    }
    np.testing.assert_allclose(fedavg_aggregate(1, results, np.zeros(2, np.float32)), [3.0, 2.0])


def test_private_parameters_never_reach_the_wire() -> None:
    wire: list[bytes] = []
    server, pool, _, _, initial = _run(
        CFG, rounds=3, plan_kw={"private": ["head"]}, tap=lambda d, data: wire.append(bytes(data))
    )
    plan = server.plan
    assert server.weights.size == plan.shared_index.size < plan.num_params
    trained = [
        cid
        for cid in pool.client_ids()
        if not np.array_equal(pool.private_weights(cid), initial[plan.private_index])
    ]
    assert trained, "some client must have trained its private head"
    haystack = b"".join(wire)
    for cid in trained:
        private = pool.private_weights(cid)
        for start in range(0, private.size - 4, 8):
            assert private[start : start + 4].tobytes() not in haystack
    for data in wire:
        msg = decode(data)
        if isinstance(msg, (FitRequest, FitReply)):
            assert msg.weights.size == plan.shared_index.size


def test_frozen_parameters_do_not_change_and_are_not_uploaded() -> None:
    plain = _run(CFG, rounds=1)[2][0]
    server, _, reports, _, initial = _run(CFG, rounds=2, plan_kw={"frozen": ["conv", "body"]})
    plan = server.plan
    np.testing.assert_array_equal(
        server.weights[: plan.upload_in_shared[0]], initial[: plan.upload_in_shared[0]]
    )
    assert not np.array_equal(server.weights, initial)
    assert reports[0].bytes_up < plain.bytes_up / 5


def test_clip_and_noise_bounds_the_update() -> None:
    clip = ClipAndNoise(clip_norm=0.01, noise_std=0.0)
    big = torch.full((50,), 1.0)
    assert float(torch.linalg.vector_norm(clip(big, np.random.default_rng(0)))) == pytest.approx(
        0.01, rel=1e-5
    )
    small = torch.full((50,), 1e-5)
    torch.testing.assert_close(clip(small, np.random.default_rng(0)), small)
    noisy = ClipAndNoise(clip_norm=1.0, noise_std=2.0, cohort_size=4)(
        torch.zeros(20000), np.random.default_rng(1)
    )
    assert float(noisy.std()) == pytest.approx(0.5, rel=0.03)
    server, _, _, _, initial = _run(CFG, rounds=1, transform=ClipAndNoise(clip_norm=1e-3, noise_std=0.0))
    assert float(np.linalg.norm(server.weights - initial)) <= 1e-3 * (1 + 1e-4)
    for bad in ({"clip_norm": 0.0, "noise_std": 1.0}, {"clip_norm": 1.0, "noise_std": -1.0}):
        with pytest.raises(ConfigError):
            ClipAndNoise(**bad)


def test_bad_input() -> None:
    flat = FlatModel(Tiny())
    with pytest.raises(ConfigError, match="'projector' is not in the model"):
        ParameterPlan(flat, private=["projector"])
    with pytest.raises(ConfigError, match="uploads nothing"):
        ParameterPlan(flat, private=["head"], frozen=["conv", "body"])
    data, _, _ = _data()
    pool = ModelClients(flat, data, optimizer=LocalOptimizer(), seed=0)
    reply = pool.handle_batch({"c0": FitRequest(1, 0.1, 1, 4, np.zeros(5, np.float32))})["c0"]
    assert isinstance(reply, ValidationError) and "expected" in str(reply)
    with pytest.raises(ValidationError, match="inputs and labels"):
        evaluate_model(Tiny(), np.zeros((2, 1, 8, 8), np.float32), np.zeros(3, np.int64))
    with pytest.raises(ConfigError, match="batch_size 0"):
        ImageFedAvgConfig(batch_size=0)
    with pytest.raises(ConfigError, match="server_lr"):
        _run(replace(CFG, server_lr=0.0), rounds=1)


class _OneHugeUpload(ModelClients):
    """Clients of which the first to reply in round 1 uploads finite but absurd weights (3e38)."""

    def handle_batch(self, msgs):
        out = super().handle_batch(msgs)
        first = next(iter(out))
        if isinstance(out[first], FitReply) and out[first].round == 1:
            self.victim = first
            out[first] = replace(out[first], weights=np.full_like(out[first].weights, 3e38))
        return out


@pytest.mark.parametrize("bound", [None, 5.0])
def test_one_absurd_upload_is_a_dropout_and_training_goes_on(bound) -> None:
    """The engine refuses an upload whose change to the weights it was sent exceeds ``max_upload_norm``
    (a dropout with its reason), averages the others, and the model keeps learning in the next rounds;
    without the bound the average would hold 1e37-sized weights and every later update would fail."""
    cfg = CFG if bound is None else replace(CFG, max_upload_norm=bound)
    torch.manual_seed(0)
    flat = FlatModel(Tiny())
    data, _, _ = _data()
    initial = flat.initial()
    pool = _OneHugeUpload(flat, data, optimizer=cfg.optimizer, seed=4, initial=initial)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(2))
    server = ModelServer(cfg, flat, np.random.default_rng(1), initial=initial)
    server.setup(rt)
    weights = [server.weights]
    for rnd in (1, 2, 3):
        report = asyncio.run(server.run_round(rnd, rt))
        assert report.applied and report.gradients == (3 if rnd == 1 else 4)
        weights.append(server.weights)
    (drop,) = rt.stats().dropouts
    assert drop.client == pool.victim and "exceeds max_upload_norm" in drop.reason
    assert all(np.isfinite(w).all() and np.abs(w).max() < 10 for w in weights)
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(weights))
    with pytest.raises(ConfigError, match="max_upload_norm"):
        replace(CFG, max_upload_norm=0.0)


class _FoldSpy:
    """The simulation as a Communicator, recording each upload the engine's fold takes in and what each
    request returned."""

    def __init__(self, runtime: SimulationRuntime) -> None:
        self.runtime = runtime
        self.uploads: dict[str, np.ndarray] = {}
        self.returned: list[dict] = []

    def available(self):
        return self.runtime.available()

    def stats(self):
        return self.runtime.stats()

    async def request(self, msgs, *, fold=None, **kwargs):
        def spy(cid, msg):
            self.uploads[cid] = np.array(msg.weights)
            return fold(cid, msg)

        replies = await self.runtime.request(msgs, fold=None if fold is None else spy, **kwargs)
        self.returned.append(replies)
        return replies


def _one_round(aggregate, spy: bool):
    torch.manual_seed(0)
    flat = FlatModel(Tiny())
    data, _, _ = _data()
    initial = flat.initial()
    pool = ModelClients(flat, data, optimizer=CFG.optimizer, seed=4, initial=initial)
    comm = SimulationRuntime(pool, rng=np.random.default_rng(2))
    comm = _FoldSpy(comm) if spy else comm
    server = ModelServer(CFG, flat, np.random.default_rng(1), initial=initial, aggregate=aggregate)
    server.setup(comm)
    report = asyncio.run(server.run_round(1, comm))
    return server, report, comm


def test_the_default_aggregate_folds_each_upload_and_the_runtime_keeps_no_weights() -> None:
    """With :func:`fedavg_aggregate` the engine hands the runtime a fold: what the request returns holds
    no weights, and the model is the uploads' weighted mean within :class:`FedAvgSum`'s stated tolerance
    of the all-at-once hook (a custom aggregate, which keeps receiving every upload); the round's loss
    is the same number."""
    folded, report, spy = _one_round(fedavg_aggregate, spy=True)
    (returned,) = spy.returned
    assert len(returned) == CFG.clients_per_round == len(spy.uploads)
    assert all(
        isinstance(r, FitResult) and r.weights is None and r.num_samples > 0 for r in returned.values()
    )
    assert all(r.loss is not None for r in returned.values())

    held, held_report, _ = _one_round(
        lambda rnd, results, current: fedavg_aggregate(rnd, results, current), False
    )
    counts = {c: r.num_samples for c, r in returned.items()}
    n = sum(counts.values())
    magnitude = sum(counts[c] / n * np.abs(spy.uploads[c].astype(np.float64)) for c in counts)
    ulp = np.spacing(np.maximum(np.abs(folded.weights), np.abs(held.weights)))
    assert np.all(np.abs(folded.weights.astype(np.float64) - held.weights) <= ulp + 2.0**-23 * magnitude)
    expected = sum(counts[c] * spy.uploads[c].astype(np.float64) for c in counts) / n
    assert np.all(np.abs(folded.weights - expected) <= 0.5 * ulp + 1e-12 * magnitude)
    assert report.loss == held_report.loss and report.applied and report.participants == CFG.clients_per_round


class _NoFold:
    """A Communicator that ignores ``fold`` (drops it) and returns the replies themselves."""

    def __init__(self, runtime: SimulationRuntime) -> None:
        self.runtime = runtime

    def available(self):
        return self.runtime.available()

    def stats(self):
        return self.runtime.stats()

    async def request(self, msgs, *, fold=None, **kwargs):
        return await self.runtime.request(msgs, **kwargs)


def test_a_communicator_that_ignores_the_fold_is_refused_by_name() -> None:
    torch.manual_seed(0)
    flat = FlatModel(Tiny())
    data, _, _ = _data()
    pool = ModelClients(flat, data, optimizer=CFG.optimizer, seed=4, initial=flat.initial())
    comm = _NoFold(SimulationRuntime(pool, rng=np.random.default_rng(2)))
    server = ModelServer(CFG, flat, np.random.default_rng(1), initial=flat.initial())
    server.setup(comm)
    with pytest.raises(
        ConfigError, match="returned 4 replies but folded 0: a Communicator must pass each reply"
    ):
        asyncio.run(server.run_round(1, comm))
