"""FedUV (Alg. 2), softmax and FedAwS: secrets stay home, batched equals one-by-one, losses, warm-up."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedveil.core import codec
from fedveil.data.mnist_uv import MnistUvConfig, UvSplits, generate_mnist_uv
from fedveil.errors import ConfigError, FedveilError, ValidationError
from fedveil.models.feduv import Scaling, feduv_positive_loss
from fedveil.privacy.codes import bch_code
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
    check_target_tpr,
    spreadout_regularizer,
    spreadout_step,
    verify,
    warmup_threshold,
)
from fedveil.protocols.feduv_messages import (
    BaseVector,
    Deploy,
    Deployed,
    EvalReply,
    EvalRequest,
    UvTrainReply,
    UvTrainRequest,
)
from fedveil.runtime.simulation import LatencyModel, PhaseFaults, SimulationRuntime

CODE_LENGTH = 127
CFG = UvTrainConfig(fraction=0.5, local_epochs=2, batch_size=3)
EVALUATIONS = (("train", "train"), ("test", "test"), ("test", "unseen"))


@pytest.fixture(scope="module")
def data() -> UvSplits:
    return generate_mnist_uv(
        MnistUvConfig(
            seed=7, writers=6, train=5, val=4, test=3, unseen_writers=3, sub_images_per_digit=(2, 2, 2)
        )
    )


class TinyNet(nn.Module):
    """A stand-in for the Table 2 net with the same interface (``features`` then ``fc``), ~2k weights."""

    def __init__(self, outputs: int, *, bias: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(196, 8), nn.Tanh())
        self.fc = nn.Linear(8, outputs, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def _setup(
    data: UvSplits,
    method: str,
    *,
    batched: bool = True,
    cfg: UvTrainConfig = CFG,
    pool_wrapper=None,
    faults: Mapping[str, PhaseFaults] | None = None,
) -> tuple[UvServer, SimulationRuntime, UvClients]:
    torch.manual_seed(0)
    users = len(data.train)
    outputs = CODE_LENGTH if method == "feduv" else users
    model = UvModel(TinyNet(outputs, bias=method != "fedaws"))
    rng = np.random.default_rng(1)
    server: UvServer
    if method == "feduv":
        uv, server = FedUVMethod(), FedUVServer(cfg, model, rng, code_length=CODE_LENGTH)
    elif method == "softmax":
        uv, server = SoftmaxMethod(), SoftmaxServer(cfg, model, rng)
    else:
        uv, server = FedAwSMethod(), FedAwSServer(cfg, model, rng, spreadout_steps=2)
    pool = UvClients(uv, model, data, seed=5, batched=batched)
    wrapped = pool if pool_wrapper is None else pool_wrapper(pool)
    runtime = SimulationRuntime(wrapped, rng=np.random.default_rng(2), faults=faults)
    asyncio.run(server.setup(runtime))
    return server, runtime, pool


def _train_deploy_evaluate(server: UvServer, runtime: SimulationRuntime, rounds: int = 2) -> list[dict]:
    async def go() -> list[dict]:
        for rnd in range(1, rounds + 1):
            await server.run_round(rnd, runtime)
        await server.deploy(runtime, 0.75)
        return [(await server.evaluate(runtime, g, i, bins=500)).summary() for g, i in EVALUATIONS]

    return asyncio.run(go())


# --- codeword selection (Alg. 2) ----------------------------------------------------------------------


def test_codeword_selection_gives_every_user_a_unique_codeword_the_server_never_sees(data) -> None:
    server, _, pool = _setup(data, "feduv")
    assert isinstance(server, FedUVServer)
    code = bch_code(CODE_LENGTH)
    assert server.members == pool.client_ids()
    words = [pool._users[c].codeword for c in server.members]
    vectors = np.stack([w.vector for w in words])
    assert set(np.unique(vectors)) == {-1.0, 1.0} and vectors.shape == (6, CODE_LENGTH)
    for cid, word in zip(server.members, words, strict=True):
        np.testing.assert_array_equal(word.base_bits, server.base_vectors[cid])
        assert word.random_bits.size == code.k - 32
    corr = vectors @ vectors.T / CODE_LENGTH
    assert corr[~np.eye(6, dtype=bool)].max() <= code.max_correlation + 1e-9
    assert len({w.random_bits.tobytes() for w in words}) == 6
    assert not any(hasattr(server, name) for name in ("codewords", "random_bits"))


class SpyPool:
    """Records every byte string the users send up, exactly as the runtime receives it."""

    def __init__(self, pool: UvClients) -> None:
        self.pool = pool
        self.received: list[bytes] = []

    def client_ids(self) -> list[str]:
        return self.pool.client_ids()

    def handle_batch(self, msgs):
        out = {}
        for cid, reply in self.pool.handle_batch(msgs).items():
            if isinstance(reply, Exception):
                out[cid] = reply
                continue
            data = codec.encode(reply)
            self.received.append(data)
            out[cid] = data
        return out


def _int_forms(bits: np.ndarray) -> list[bytes]:
    value = int("".join(map(str, bits.tolist())), 2)
    width = (bits.size + 7) // 8
    out = [value.to_bytes(width, "big"), value.to_bytes(width, "little"), str(value).encode()]
    if bits.size <= 64:
        out += [np.uint64(value).tobytes(), np.uint64(value).byteswap().tobytes()]
    return out


def _encodings(bits: np.ndarray) -> list[bytes]:
    """Every way the codec (raw little-endian buffers, JSON header) could carry a bit vector."""
    bits = bits.astype(np.uint8)
    signs = 1 - 2 * bits.astype(np.int64)
    forms = []
    for values in (bits, 1 - bits, signs, -signs):
        for dtype in ("<f4", ">f4", "<f8", "<f2", "i1", "<i2", "<i4", "<i8", "u1", "?"):
            if dtype in ("u1", "?") and values.min() < 0:
                continue
            forms.append(values.astype(dtype).tobytes())
        forms.append(",".join(str(int(v)) for v in values).encode())
        forms.append(", ".join(str(int(v)) for v in values).encode())
        forms.append(",".join(f"{float(v)}" for v in values).encode())
    for b in (bits, 1 - bits):
        forms += [np.packbits(b).tobytes(), np.packbits(b, bitorder="little").tobytes()]
        forms.append("".join(map(str, b.tolist())).encode())
        forms += _int_forms(b)
    return forms


def _found(secret_forms: list[bytes], received: list[bytes]) -> bool:
    return any(form in data for form in secret_forms for data in received)


def test_no_byte_string_the_server_receives_contains_a_codeword_or_its_random_bits(data) -> None:
    spy: list[SpyPool] = []

    def wrap(pool: UvClients) -> SpyPool:
        spy.append(SpyPool(pool))
        return spy[0]

    server, runtime, pool = _setup(data, "feduv", pool_wrapper=wrap)
    _train_deploy_evaluate(server, runtime)
    received = spy[0].received
    held = [server.weights.tobytes(), *(b.tobytes() for b in server.base_vectors.values())]
    kinds = {codec.decode(d).__class__.__name__ for d in received}
    assert kinds == {"CodewordReady", "UvTrainReply", "Deployed", "EvalReply"}
    for cid in server.members:
        word = pool._users[cid].codeword
        assert not _found(_encodings(word.bits), received), f"v_u of {cid} reached the server"
        assert not _found(_encodings(word.random_bits), received), f"r_u of {cid} reached the server"
        assert not _found(_encodings(word.message), received), f"m_u of {cid} reached the server"
        assert not _found(_encodings(word.bits) + _encodings(word.random_bits), held)
    # Positive control: the same search finds the secrets when a reply does carry them.
    word = pool._users[server.members[0]].codeword
    leaky = UvTrainReply(1, 1, 0.0, np.concatenate([np.ones(3, np.float32), word.vector]))
    assert _found(_encodings(word.bits), [codec.encode(leaky)])
    r_value = int("".join(map(str, word.random_bits.tolist())), 2)
    as_count = EvalReply(0, 0, np.zeros(2, np.int64), np.array([5, r_value], np.int64))
    as_number = Deployed(r_value)
    for leak in (as_count, as_number):
        assert _found(_encodings(word.random_bits), [codec.encode(leak)])


# --- batched equals one-by-one ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["feduv", "softmax", "fedaws"])
def test_batched_equals_one_by_one(data, method: str) -> None:
    a, rta, pa = _setup(data, method, batched=True)
    b, rtb, pb = _setup(data, method, batched=False)
    ev_a, ev_b = _train_deploy_evaluate(a, rta), _train_deploy_evaluate(b, rtb)
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-5, atol=1e-6)
    thresholds_a = [pa._users[c].threshold for c in a.members]
    thresholds_b = [pb._users[c].threshold for c in b.members]
    np.testing.assert_allclose(thresholds_a, thresholds_b, atol=1e-5)
    for x, y in zip(ev_a, ev_b, strict=True):
        assert x["genuine"] == y["genuine"] and x["impostor"] == y["impostor"] and x["users"] == 6
        assert x["auc"] == pytest.approx(y["auc"], abs=1e-3)


@pytest.mark.parametrize("method", ["feduv", "fedaws"])
def test_batched_evaluation_equals_one_by_one_exactly(data, method: str) -> None:
    a, _, pa = _setup(data, method, batched=True)
    _, _, pb = _setup(data, method, batched=False)
    ids = pa.client_ids()
    weights = {c: a._weights_for(c, a.weights) for c in ids}
    for pool in (pa, pb):
        pool.handle_batch({c: Deploy(0.8, weights[c]) for c in ids})
    for genuine, impostor in EVALUATIONS:
        request = EvalRequest(genuine, impostor, 300)
        ra, rb = pa.handle_batch(dict.fromkeys(ids, request)), pb.handle_batch(dict.fromkeys(ids, request))
        for c in ids:
            assert np.array_equal(ra[c].genuine_counts, rb[c].genuine_counts)
            assert np.array_equal(ra[c].impostor_counts, rb[c].impostor_counts)
            assert (ra[c].genuine_accepted, ra[c].impostor_accepted) == (
                rb[c].genuine_accepted,
                rb[c].impostor_accepted,
            )


# --- training (Alg. 1) --------------------------------------------------------------------------------


def test_one_local_step_is_sgd_on_the_positive_loss(data) -> None:
    """Known answer: a full-batch step equals autograd on Eq. 4 through the net's own forward."""
    _, _, pool = _setup(data, "feduv")
    cid = pool.client_ids()[2]
    net = pool.model.net
    w = pool.model.initial()
    reply = pool.handle_batch({cid: UvTrainRequest(1, 0.1, 1, 5, w)})[cid]
    x = torch.tensor(data.train.array(cid, "x"))
    v = torch.tensor(pool._users[cid].codeword.vector)
    loss = feduv_positive_loss(Scaling()(net(x)), v)
    grads = torch.autograd.grad(loss, list(net.parameters()))
    expected = torch.cat([(p - 0.1 * g).reshape(-1) for p, g in zip(net.parameters(), grads, strict=True)])
    np.testing.assert_allclose(reply.weights, expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert reply.loss == pytest.approx(loss.item(), rel=1e-5) and reply.num_samples == 5


def test_method_losses_and_scores_follow_their_definitions() -> None:
    torch.manual_seed(3)
    g, w, b = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3)
    e1 = torch.tensor([0.0, 1.0, 0.0])
    logits = g @ w.T + b
    assert float(SoftmaxMethod().loss(g, w, b, e1)) == pytest.approx(
        float(nn.functional.cross_entropy(logits, torch.ones(4, dtype=torch.long)))
    )
    cos = nn.functional.cosine_similarity(g, w[1][None], dim=1)
    assert float(FedAwSMethod().loss(g, w, None, e1)) == pytest.approx(
        float((0.9 - cos).clamp(min=0).square().mean())
    )
    np.testing.assert_allclose(SoftmaxMethod().scores(g, w[1]).numpy(), cos.numpy(), rtol=1e-6)
    v = torch.tensor([1.0, -1.0, 1.0])
    out = Scaling()(logits)
    assert float(FedUVMethod().loss(g, w, b, v)) == pytest.approx(
        float(feduv_positive_loss(out, v)), rel=1e-6
    )
    scores = FedUVMethod().scores(FedUVMethod().representation(g, w, b), v)
    np.testing.assert_allclose(
        scores.numpy(), nn.functional.cosine_similarity(logits, v[None], dim=1).numpy(), rtol=1e-5
    )


def test_training_lowers_the_positive_loss(data) -> None:
    server, runtime, _ = _setup(
        data, "feduv", cfg=UvTrainConfig(fraction=1.0, local_epochs=3, batch_size=5, lr=1.0)
    )

    async def go() -> list[float]:
        return [(await server.run_round(r, runtime)).loss for r in range(1, 9)]

    losses = asyncio.run(go())
    assert losses[-1] < 0.6 * losses[0]


def test_learning_rate_decay_and_cohort_size() -> None:
    cfg = UvTrainConfig()
    assert (
        cfg.lr_at(1) == 0.1
        and cfg.lr_at(101) == pytest.approx(0.05)
        and cfg.lr_at(20_000) == pytest.approx(0.1 / 200.99)
    )
    assert cfg.cohort_size(1000) == 10 and cfg.cohort_size(50) == 1
    assert (
        UvTrainConfig(fraction=0.3).cohort_size(10) == 3 and UvTrainConfig(fraction=1.0).cohort_size(7) == 7
    )


def test_failed_replies_are_dropouts_and_leave_the_model_unchanged(data) -> None:
    faults = {"train": PhaseFaults(1.0, LatencyModel("constant", 0.1, 0.0))}
    server, runtime, _ = _setup(data, "softmax", faults=faults)
    before = server.weights
    report = asyncio.run(server.run_round(1, runtime))
    assert not report.applied and report.dropouts == {"train": 3}
    np.testing.assert_array_equal(server.weights, before)


# --- FedAwS -------------------------------------------------------------------------------------------


def test_fedaws_users_get_only_their_own_embedding_and_the_server_spreads_them(data) -> None:
    seen: dict[str, np.ndarray] = {}

    class Recorder(SpyPool):
        def handle_batch(self, msgs):
            seen.update({c: np.array(m.weights) for c, m in msgs.items() if isinstance(m, UvTrainRequest)})
            return self.pool.handle_batch(msgs)

    server, runtime, _ = _setup(data, "fedaws", pool_wrapper=Recorder)
    assert isinstance(server, FedAwSServer)
    rows = server.model.slice_of("fc.weight")
    before = server.weights
    asyncio.run(server.run_round(1, runtime))
    assert len(seen) == 3
    for cid, w in seen.items():
        emb = w[rows].reshape(6, -1)
        own = server.classes[cid]
        assert np.count_nonzero(np.abs(emb).sum(axis=1)) == 1 and np.abs(emb[own]).sum() > 0
        np.testing.assert_array_equal(
            np.delete(w, np.arange(rows.start, rows.stop)),
            np.delete(before, np.arange(rows.start, rows.stop)),
        )
    after = server.weights[rows].reshape(6, -1)
    w0 = torch.tensor(before[rows].reshape(6, -1))
    assert float(spreadout_regularizer(torch.tensor(after))) <= float(spreadout_regularizer(w0)) + 1e-3


def test_spreadout_regulariser_known_answers() -> None:
    two = torch.tensor([[1.0, 0.0], [math.cos(0.5), math.sin(0.5)]])
    d = 2 * math.sin(0.25)
    assert float(spreadout_regularizer(two, margin=1.0)) == pytest.approx(2 * (1.0 - d) ** 2, rel=1e-5)
    assert float(spreadout_regularizer(torch.eye(4) * 3.0)) == pytest.approx(0.0, abs=1e-6)
    crowded = np.array([[1.0, 0.0, 0.0], [1.0, 0.1, 0.0], [1.0, 0.0, 0.1]], np.float32)
    spread = spreadout_step(crowded, margin=math.sqrt(2), steps=20, lr=0.5)
    assert float(spreadout_regularizer(torch.tensor(spread))) < 0.5 * float(
        spreadout_regularizer(torch.tensor(crowded))
    )


# --- warm-up and verification -------------------------------------------------------------------------


def test_warmup_threshold_known_answers() -> None:
    scores = np.linspace(0.1, 1.0, 10)
    assert warmup_threshold(scores, 0.9) == pytest.approx(0.1)
    assert warmup_threshold(scores, 0.5) == pytest.approx(0.5)
    assert warmup_threshold(scores[::-1], 0.7) == pytest.approx(0.3)
    assert warmup_threshold(np.arange(15.0), 0.9) == 0.0  # i = floor(1.5) = 1
    assert warmup_threshold([0.4, 0.2], 0.9) == 0.2  # i = floor(0.2) -> at least 1
    assert verify(np.array([0.1, 0.5, 0.6]), 0.5).tolist() == [False, True, True]


@settings(max_examples=80, deadline=None)
@given(
    scores=st.lists(st.floats(-1, 1, allow_nan=False), min_size=1, max_size=60),
    q=st.floats(0.01, 0.99),
)
def test_warmup_accepts_at_least_a_fraction_q(scores: list[float], q: float) -> None:
    tau = warmup_threshold(np.array(scores), q)
    assert np.mean(verify(np.array(scores), tau)) >= q
    assert tau in scores


@pytest.mark.parametrize("q", [0.0, 1.0, 1.5, -0.1, float("nan"), True, "0.9"])
def test_target_tpr_outside_the_open_unit_interval_is_refused(q: object) -> None:
    with pytest.raises(FedveilError, match=f"q={q!r}"):
        check_target_tpr(q)
    with pytest.raises(FedveilError, match="strictly between 0 and 1"):
        warmup_threshold(np.ones(3), q)  # type: ignore[arg-type]


def test_deploy_refuses_a_bad_q_and_evaluation_needs_deployment(data) -> None:
    server, runtime, _ = _setup(data, "softmax")
    with pytest.raises(ConfigError, match=r"q=1\.2"):
        asyncio.run(server.deploy(runtime, 1.2))
    with pytest.raises(ConfigError, match="deploy"):
        asyncio.run(server.evaluate(runtime, "test", "test"))


# --- bad settings -------------------------------------------------------------------------------------


def test_bad_settings_fail_naming_the_value(data) -> None:
    with pytest.raises(ConfigError, match="fraction 0"):
        UvTrainConfig(fraction=0)
    with pytest.raises(ConfigError, match="batch_size 0"):
        UvTrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="lr -1"):
        UvTrainConfig(lr=-1)
    model = UvModel(TinyNet(63))
    with pytest.raises(ConfigError, match="c=63"):
        FedUVServer(CFG, model, np.random.default_rng(0), code_length=CODE_LENGTH)
    with pytest.raises(ConfigError, match="l_r >= 32"):
        FedUVServer(CFG, UvModel(TinyNet(127)), np.random.default_rng(0), code_length=127, base_bits=40)
    with pytest.raises(ConfigError, match="bias=False"):
        FedAwSServer(CFG, UvModel(TinyNet(6)), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="'features'"):
        UvModel(nn.Linear(3, 4))
    softmax = SoftmaxServer(CFG, UvModel(TinyNet(5)), np.random.default_rng(0))
    runtime = SimulationRuntime(
        UvClients(SoftmaxMethod(), UvModel(TinyNet(5)), data, seed=0), rng=np.random.default_rng(0)
    )
    with pytest.raises(ConfigError, match="6 users but the net has c=5"):
        asyncio.run(softmax.setup(runtime))
    with pytest.raises(ConfigError, match="setup"):
        softmax.select([])


def test_a_user_refuses_messages_of_another_method(data) -> None:
    _, _, pool = _setup(data, "softmax")
    cid = pool.client_ids()[0]
    reply = pool.handle_batch({cid: BaseVector(127, 64, np.zeros(32, np.uint8))})[cid]
    assert isinstance(reply, ValidationError) and "softmax" in str(reply)


def test_a_base_vector_leaving_too_few_random_bits_fails_only_that_user(data) -> None:
    _, _, pool = _setup(data, "feduv")
    good, bad = pool.client_ids()[:2]
    replies = pool.handle_batch(
        {good: BaseVector(127, 64, np.ones(32, np.uint8)), bad: BaseVector(127, 64, np.ones(40, np.uint8))}
    )
    assert replies[good].code_n == 127
    assert isinstance(replies[bad], ConfigError) and "l_r=24" in str(replies[bad])
