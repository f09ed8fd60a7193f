"""FL-traditional (FedAvg + softmax head): batched equals one-by-one, the written-out backward equals
autograd, averaging, bad settings."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.core import codec
from fedveil.core.aggregation import weighted_average
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet
from fedveil.protocols import fedavg
from fedveil.protocols.fedavg import EmbeddingClassifier, FedAvgClients, FedAvgConfig, FedAvgServer
from fedveil.protocols.messages import TrainReply, TrainRequest
from fedveil.runtime.simulation import LatencyModel, PhaseFaults, SimulationRuntime

CFG = FedAvgConfig(clients_per_round=4, samples_per_client=3, lr=0.1)


def _setup(pop, cfg=CFG, *, batched=True, faults=None):
    torch.manual_seed(0)
    ids = pop.train_user_ids()
    flat = FlatModel(EmbeddingClassifier(TouchAuthNet(), 64, len(ids)))
    attrs = {u: dict(pop.train.user(u).attributes) for u in ids}
    pool = FedAvgClients(pop, flat, attributes=attrs, seed=0, batched=batched)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(2), faults=faults or {})
    server = FedAvgServer(cfg, flat.initial(), np.random.default_rng(1))
    asyncio.run(server.register(rt))
    return server, rt, pool, flat


def _rounds(server, rt, n):
    async def go():
        return [await server.run_round(r, rt) for r in range(1, n + 1)]

    return asyncio.run(go())


@pytest.mark.parametrize("local_steps", [1, 2])
def test_batched_equals_one_by_one(toy_population, local_steps) -> None:
    """A few whole rounds: the batched devices (one step: the written-out backward; two: vmap) end at
    the one-by-one autograd devices' weights."""
    a, rta, pool, _ = _setup(toy_population, replace(CFG, local_steps=local_steps), batched=True)
    b, rtb, _, _ = _setup(toy_population, replace(CFG, local_steps=local_steps), batched=False)
    assert pool.written_backward
    _rounds(a, rta, 3)
    _rounds(b, rtb, 3)
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-5, atol=1e-6)


def _pools(pop, flat):
    ids = pop.train_user_ids()
    attrs = {u: dict(pop.train.user(u).attributes) for u in ids}
    fast = FedAvgClients(pop, flat, attributes=attrs, seed=0)
    slow = FedAvgClients(pop, flat, attributes=attrs, seed=0, written_backward=False)
    return fast, slow


@pytest.mark.parametrize("local_steps", [1, 2])
def test_written_backward_equals_vmap_per_device(toy_population, monkeypatch, local_steps) -> None:
    """Each device's new weights from the written-out backward (one step) equal vmap's; with two steps
    both pools take vmap. The pools draw the same samples (same seed, same calls)."""
    torch.manual_seed(0)
    ids = toy_population.train_user_ids()
    flat = FlatModel(EmbeddingClassifier(TouchAuthNet(), 64, len(ids)))
    fast, slow = _pools(toy_population, flat)
    assert fast.written_backward and not slow.written_backward
    w = flat.initial()
    msgs = {c: TrainRequest(1, 0.1, 5, local_steps, w) for c in ids[2:9]}
    expected = slow.handle_batch(msgs)
    if local_steps == 1:

        def no_vmap(*args, **kwargs):
            raise AssertionError("a one-step cohort went through vmap")

        monkeypatch.setattr(fedavg, "local_train_cohort", no_vmap)
    got = fast.handle_batch(msgs)
    for c in msgs:
        assert got[c].num_samples == 5
        torch.testing.assert_close(
            torch.from_numpy(got[c].weights), torch.from_numpy(expected[c].weights), rtol=1e-5, atol=1e-6
        )
        assert not np.array_equal(got[c].weights, w)


def test_encoded_replies_are_the_bytes_of_the_replies(toy_population, monkeypatch) -> None:
    """With ``encoded_replies`` (the in-process simulation) a one-step cohort writes its new weights
    straight into its replies' frames: each is byte for byte ``encode`` of the reply the plain pool
    gives, whole rounds end at the same weights bit for bit, and a non-finite weight written there is a
    dropout when the runtime decodes it."""
    torch.manual_seed(0)
    ids = toy_population.train_user_ids()
    flat = FlatModel(EmbeddingClassifier(TouchAuthNet(), 64, len(ids)))
    attrs = {u: dict(toy_population.train.user(u).attributes) for u in ids}
    plain = FedAvgClients(toy_population, flat, attributes=attrs, seed=0)
    framed = FedAvgClients(toy_population, flat, attributes=attrs, seed=0, encoded_replies=True)
    w = flat.initial()
    msgs = {c: TrainRequest(3, 0.1, 5, 1, w) for c in ids[2:9]}
    want, got = plain.handle_batch(msgs), framed.handle_batch(msgs)
    for c in msgs:
        assert isinstance(got[c], memoryview) and bytes(got[c]) == codec.encode(want[c])
    two = {c: TrainRequest(3, 0.1, 5, 2, w) for c in ids[2:4]}  # two steps: vmap, plain replies
    assert all(isinstance(r, TrainReply) for r in framed.handle_batch(two).values())

    def run(encoded: bool, rounds: int = 3) -> np.ndarray:
        server, rt, pool, _ = _setup(toy_population)
        pool.encoded_replies = encoded
        _rounds(server, rt, rounds)
        return server.weights

    np.testing.assert_array_equal(run(True), run(False))
    step = FedAvgClients._traced_sgd_step

    def poisoned(self, *args, out=None):
        new = step(self, *args, out=out)
        new[0, 5] = float("nan")
        return new

    monkeypatch.setattr(FedAvgClients, "_traced_sgd_step", poisoned)
    server, rt, pool, _ = _setup(toy_population)
    pool.encoded_replies = True
    report = _rounds(server, rt, 1)[0]
    assert report.dropouts == {"train": 1} and report.gradients == 3
    assert "non-finite" in rt.stats().dropouts[0].reason


def test_written_backward_gradient_is_each_devices_autograd(toy_population) -> None:
    """Brute force: with lr 1 the step's ``w - new`` is each device's own gradient, which autograd gives
    from that device's loss alone (cross-entropy, mean over its own samples)."""
    torch.manual_seed(1)
    ids = toy_population.train_user_ids()
    flat = FlatModel(EmbeddingClassifier(TouchAuthNet(), 64, len(ids)))
    fast, _ = _pools(toy_population, flat)
    k, n = 5, 4
    rng = np.random.default_rng(3)
    x = torch.from_numpy(np.stack([toy_population.sample_training(u, n, rng) for u in ids[:k]]))
    x = x.reshape(k, n, 1, 30, 10)
    y = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 7, 2], [9, 3, 3, 3], [4, 4, 4, 4]])
    w = torch.from_numpy(flat.initial())
    new = fast._traced_sgd_step(w, x, y, 1.0)
    assert new.shape == (k, flat.num_params)
    for i in range(k):
        p = w.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy(flat(p, x[i]), y[i]).backward()
        torch.testing.assert_close(w - new[i], p.grad, rtol=1e-5, atol=1e-6)


def test_written_backward_needs_a_traceable_embedding(toy_population) -> None:
    """Another embedding network (no ``trace``/``layer_deltas``) trains by vmap."""
    torch.manual_seed(0)
    ids = toy_population.train_user_ids()
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(300, 64))
    flat = FlatModel(EmbeddingClassifier(net, 64, len(ids)))
    fast, slow = _pools(toy_population, flat)
    assert not fast.written_backward
    msgs = {c: TrainRequest(1, 0.1, 3, 1, flat.initial()) for c in ids[:4]}
    got, expected = fast.handle_batch(msgs), slow.handle_batch(msgs)
    for c in msgs:
        np.testing.assert_array_equal(got[c].weights, expected[c].weights)


def test_one_local_step_is_sgd_on_the_clients_class(toy_population) -> None:
    _, _, pool, flat = _setup(toy_population)
    w = flat.initial()
    cid = pool.client_ids()[3]
    rng_state = pool.rngs[cid].bit_generator.state
    reply = pool.handle_batch({cid: TrainRequest(1, 0.1, 3, 1, w)})[cid]
    pool.rngs[cid].bit_generator.state = rng_state
    x = torch.from_numpy(pool.data.sample_training(cid, 3, pool.rngs[cid])).reshape(3, 1, 30, 10)
    p = torch.tensor(w, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(flat(p, x), torch.full((3,), 3))
    loss.backward()
    np.testing.assert_allclose(reply.weights, (p - 0.1 * p.grad).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_training_improves_the_classifier(toy_population) -> None:
    server, rt, pool, flat = _setup(toy_population, replace(CFG, lr=0.1))
    ids = pool.client_ids()
    rng = np.random.default_rng(5)
    x = torch.from_numpy(np.stack([toy_population.sample_training(u, 4, rng) for u in ids])).reshape(
        -1, 1, 30, 10
    )
    y = torch.arange(len(ids)).repeat_interleave(4)

    def loss():
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(flat(torch.from_numpy(server.weights), x), y))

    before = loss()
    _rounds(server, rt, 60)
    assert loss() < 0.9 * before


def test_missing_replies_leave_the_model_unchanged(toy_population) -> None:
    faults = {"train": PhaseFaults(1.0, LatencyModel("constant", 0.1, 0.0))}
    server, rt, _, _ = _setup(toy_population, faults=faults)
    w0 = server.weights
    (report,) = _rounds(server, rt, 1)
    assert not report.applied and report.dropouts["train"] == 4
    np.testing.assert_array_equal(server.weights, w0)


def test_weighted_average_is_fedavg() -> None:
    v = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([3.0, 6.0], np.float32)}
    np.testing.assert_allclose(weighted_average(v, {"a": 1, "b": 3}), [2.5, 5.0])
    with pytest.raises(ValidationError, match="no vectors"):
        weighted_average({}, {})
    with pytest.raises(ValidationError, match="positive"):
        weighted_average(v, {"a": 0, "b": 1})
    with pytest.raises(ValidationError, match="shape"):
        weighted_average({"a": np.zeros(2), "b": np.zeros(3)}, {"a": 1, "b": 1})


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 10_000), min_size=1, max_size=7),
    shape=st.sampled_from([(1,), (5,), (32768,), (70_001,), (3, 40_000)]),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(1, 4),
)
def test_weighted_average_equals_the_whole_vector_sum_bit_for_bit(
    weights: list[int], shape: tuple[int, ...], dtype: type, seed: int, workers: int
) -> None:
    """Averaged a cache-sized block at a time, on one thread or split among several, FedAvg gives
    exactly what ``acc += (n_k / n) * w_k`` over whole vectors gives, in float64, cast to float32."""
    rng = np.random.default_rng(seed)
    vectors = {f"c{i}": rng.normal(0, 3, shape).astype(dtype) for i in range(len(weights))}
    counts = {f"c{i}": w for i, w in enumerate(weights)}
    plain = np.zeros(shape, np.float64)
    for cid, v in vectors.items():
        plain += (counts[cid] / sum(weights)) * v
    got = weighted_average(vectors, counts, workers=workers)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, plain.astype(np.float32))
    with pytest.raises(ValidationError, match="workers 0 must be"):
        weighted_average(vectors, counts, workers=0)


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="lr -1"):
        FedAvgConfig(lr=-1)
    with pytest.raises(ConfigError, match="local_steps 0"):
        FedAvgConfig(local_steps=0)
