"""FDML rounds (Fig. 2, Alg. 3): batched equals client-by-client, Alg. 3 restarts and thresholds,
Strategy-AS vs Strategy-UC, and bad replies as dropouts."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedveil.core import codec
from fedveil.errors import ConfigError
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet
from fedveil.protocols.fdml import FDMLClients, FDMLConfig, FDMLServer, LocalEnclave
from fedveil.protocols.messages import BackpropRequest, EmbedReply, EmbedRequest, GradReply
from fedveil.runtime.simulation import LatencyModel, PhaseFaults, SimulationRuntime

CFG = FDMLConfig(num_required=4, samples_per_client=3, lr=1e-3, margin=1.0)


def _setup(pop, cfg=CFG, *, batched=True, faults=None, seed=0, pool_cls=FDMLClients, **pool_kw):
    torch.manual_seed(seed)
    flat = FlatModel(TouchAuthNet())
    attrs = {u: dict(pop.train.user(u).attributes) for u in pop.train_user_ids()}
    pool = pool_cls(pop, flat, attributes=attrs, seed=seed, batched=batched, **pool_kw)
    rt = SimulationRuntime(pool, rng=np.random.default_rng([seed, 2]), faults=faults or {})
    server = FDMLServer(
        cfg,
        flat.initial(),
        64,
        LocalEnclave(margin=cfg.margin, strategy=cfg.strategy),
        np.random.default_rng([seed, 1]),
    )
    asyncio.run(server.register(rt))
    return server, rt, pool, flat


def _rounds(server, rt, n, start=1):
    async def go():
        return [await server.run_round(r, rt) for r in range(start, start + n)]

    return asyncio.run(go())


def test_registration_groups_devices_by_phone_model(toy_population) -> None:
    server, _, _, _ = _setup(toy_population)
    assert sorted(server.groups) == ["A", "B"]
    assert all(len(v) == 6 for v in server.groups.values())


def test_batched_clients_equal_client_by_client(toy_population) -> None:
    """Both phases of the batched path give the client-by-client numbers for every device."""
    _, _, fast, flat = _setup(toy_population, batched=True)
    _, _, slow, _ = _setup(toy_population, batched=False)
    w = flat.initial()
    ids = fast.client_ids()
    request = EmbedRequest(1, 1, 3, w)
    e_fast = fast.handle_batch({c: request for c in ids})
    e_slow = slow.handle_batch({c: request for c in ids})
    rng = np.random.default_rng(0)
    derivs = {}
    for c in ids:
        np.testing.assert_allclose(e_fast[c].embeddings, e_slow[c].embeddings, rtol=1e-5, atol=1e-6)
        derivs[c] = BackpropRequest(1, 1, rng.normal(size=(3, 64)).astype(np.float32))
    g_fast = fast.handle_batch(derivs)
    g_slow = slow.handle_batch(derivs)
    for c in ids:
        assert g_fast[c].num_samples == g_slow[c].num_samples == 3
        scale = np.abs(g_slow[c].gradient).max()
        np.testing.assert_allclose(g_fast[c].gradient, g_slow[c].gradient, rtol=0, atol=1e-5 * scale)


def test_batched_training_follows_the_same_trajectory(toy_population) -> None:
    a, rta, _, _ = _setup(toy_population, batched=True)
    b, rtb, _, _ = _setup(toy_population, batched=False)
    ra = _rounds(a, rta, 3)
    rb = _rounds(b, rtb, 3)
    assert [r.loss for r in ra] == pytest.approx([r.loss for r in rb], rel=1e-4)
    assert rta.stats().bytes_up == rtb.stats().bytes_up


def test_client_gradient_is_the_chain_rule_through_the_embeddings(toy_population) -> None:
    """Step 7 by hand: the gradient equals d/dθ sum_j <δ_j, e_j(θ)> computed directly."""
    _, _, pool, flat = _setup(toy_population, batched=True)
    w = flat.initial()
    cid = pool.client_ids()[0]
    reply = pool.handle_batch({cid: EmbedRequest(1, 1, 3, w)})[cid]
    x = pool._pending[cid].inputs
    d = np.random.default_rng(0).normal(size=reply.embeddings.shape).astype(np.float32)
    g = pool.handle_batch({cid: BackpropRequest(1, 1, d)})[cid].gradient
    p = torch.tensor(w, requires_grad=True)
    (flat(p, x) * torch.from_numpy(d)).sum().backward()
    np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_devices_not_waited_for_do_not_keep_their_round_state(toy_population) -> None:
    """With rate_p < 1 the devices whose gradients the round did not wait for are never asked to back-
    propagate; what they kept (inputs, the cohort's traced activations) goes when the next round starts."""
    cfg = replace(CFG, rate_p=0.5, t_grad=1e9, min_gradients=2)
    lognormal = {"grad": PhaseFaults(latency=LatencyModel("lognormal", 0.5, 0.5))}
    server, rt, pool, _ = _setup(toy_population, cfg, faults=lognormal)
    for rnd in range(1, 6):
        report = _rounds(server, rt, 1, start=rnd)[0]
        assert report.applied and report.gradients == 2
        # only this round's unasked devices are left, never an earlier round's
        assert len(pool._pending) == 2 and {p.round for p in pool._pending.values()} == {rnd}


def test_training_reduces_the_triplet_loss(toy_population) -> None:
    server, rt, _, _ = _setup(toy_population, replace(CFG, lr=3e-3))
    reports = _rounds(server, rt, 30)
    first = np.mean([r.loss for r in reports[:5]])
    last = np.mean([r.loss for r in reports[-5:]])
    assert last < 0.7 * first
    assert all(r.applied for r in reports)
    assert all(r.bytes_up > 0 and r.bytes_down > 0 for r in reports)


def test_alg3_restarts_when_embeddings_do_not_arrive(toy_population) -> None:
    faults = {"embed": PhaseFaults(0.5, LatencyModel("constant", 0.1, 0.0))}
    server, rt, _, _ = _setup(toy_population, replace(CFG, k=1.5), faults=faults)
    reports = _rounds(server, rt, 12)
    assert any(r.attempts > 1 for r in reports)
    for r in reports:
        assert r.participants == CFG.num_required or not r.applied


def test_alg3_goes_on_after_rate_p_of_the_gradients(toy_population) -> None:
    cfg = replace(CFG, rate_p=0.5)
    faults = {"grad": PhaseFaults(0.0, LatencyModel("exponential", 1.0, 0.0))}
    server, rt, _, _ = _setup(toy_population, cfg, faults=faults)
    reports = _rounds(server, rt, 4)
    assert all(r.gradients == math.ceil(4 * 0.5) for r in reports)
    assert all(not r.applied for r in reports)  # 2 gradients < min_gradients = 3
    server2, rt2, _, _ = _setup(toy_population, replace(cfg, min_gradients=2), faults=faults)
    assert all(r.applied for r in _rounds(server2, rt2, 4))


def test_strategy_as_abandons_and_uc_continues(toy_population) -> None:
    faults = {"grad": PhaseFaults(0.4, LatencyModel("constant", 0.1, 0.0))}
    cfg = replace(CFG, num_required=6, t_grad=1.0)
    uc, rt_uc, _, _ = _setup(toy_population, cfg, faults=faults)
    as_, rt_as, _, _ = _setup(toy_population, replace(cfg, on_missing_gradients="abandon"), faults=faults)
    r_uc = _rounds(uc, rt_uc, 20)
    r_as = _rounds(as_, rt_as, 20)
    assert [r.gradients for r in r_uc] == [r.gradients for r in r_as]
    for a, u in zip(r_as, r_uc, strict=True):
        assert a.applied == (a.gradients == a.participants)
        assert u.applied == (u.gradients > 2)
    assert sum(r.applied for r in r_uc) > sum(r.applied for r in r_as)


class HostileClients(FDMLClients):
    """Devices that answer step 4 or step 8 with a broken message."""

    def __init__(self, *args, attack: str, phase: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.attack = attack
        self.phase = phase
        self.victim: str | None = None

    def handle_batch(self, msgs):
        out = super().handle_batch(msgs)
        kind = EmbedReply if self.phase == "embed" else GradReply
        if not isinstance(next(iter(out.values())), kind):
            return out
        self.victim = self.victim or sorted(msgs)[0]
        first = self.victim
        if first not in out:
            return out
        reply = out[first]
        array_name = "embeddings" if self.phase == "embed" else "gradient"
        arr = np.array(getattr(reply, array_name))
        data = codec.encode(reply)
        if self.attack == "shape":
            out[first] = replace(reply, **{array_name: arr[:-1]})
        elif self.attack == "dtype":
            out[first] = data.replace(b'"<f4"', b'"<f8"')
        elif self.attack == "nan":
            out[first] = _patch_first_float(data, arr, np.nan)
        elif self.attack == "inf":
            out[first] = _patch_first_float(data, arr, np.inf)
        elif self.attack == "missing":
            out[first] = data.replace(b'"round":', b'"rouxd":')
        elif self.attack == "round":
            out[first] = replace(reply, round=reply.round + 1)
        elif self.attack == "oversize":
            out[first] = replace(
                reply, **{array_name: np.zeros(arr.size * 10**6 // arr.size + 10**6, np.float32)}
            )
        return out


def _patch_first_float(data: bytes, arr: np.ndarray, value: float) -> bytes:
    """Overwrite the first element of the message's only array (the data section starts at the first
    multiple of 8 after the 8-byte prefix and the header)."""
    header_len = int.from_bytes(data[4:8], "little")
    at = (8 + header_len + 7) // 8 * 8
    return data[:at] + np.float32(value).tobytes() + data[at + 4 :]


@pytest.mark.parametrize("phase", ["embed", "grad"])
@pytest.mark.parametrize("attack", ["shape", "dtype", "nan", "inf", "missing", "round", "oversize"])
def test_bad_replies_are_dropouts_and_the_round_goes_on(toy_population, attack, phase, caplog) -> None:
    cfg = replace(CFG, k=1.5, min_gradients=2)
    server, rt, _, _ = _setup(toy_population, cfg, pool_cls=HostileClients, attack=attack, phase=phase)
    rt.max_message_bytes = 2 * 2**20
    with caplog.at_level("INFO", logger="fedveil.runtime.simulation"):
        (report,) = _rounds(server, rt, 1)
    drops = [d for d in rt.stats().dropouts if d.phase == phase and d.reason.startswith("invalid")]
    assert len(drops) == 1, rt.stats().dropouts
    assert report.applied
    assert "dropout" in caplog.text


def test_bad_config_is_refused_with_the_value() -> None:
    with pytest.raises(ConfigError, match=r"rate_p 1\.5"):
        FDMLConfig(rate_p=1.5)
    with pytest.raises(ConfigError, match="strategy 'hardest'"):
        FDMLConfig(strategy="hardest")
    with pytest.raises(ConfigError, match="Strategy-AS"):
        FDMLConfig(on_missing_gradients="drop")
    with pytest.raises(ConfigError, match=r"k 0\.5"):
        FDMLConfig(k=0.5)


def test_grad_reply_must_match_the_devices_embeddings(toy_population) -> None:
    _, _, pool, _ = _setup(toy_population)
    cid = pool.client_ids()[0]
    out = pool.handle_batch({cid: BackpropRequest(9, 1, np.zeros((3, 64), np.float32))})
    assert not isinstance(out[cid], GradReply)


class _PlainNet(torch.nn.Module):
    """A model without ``trace``: the batched path falls back to ``vmap(grad(...))``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(300, 32), torch.nn.Tanh(), torch.nn.Linear(32, 64)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_vmap_fallback_equals_client_by_client(toy_population) -> None:
    torch.manual_seed(0)
    flat = FlatModel(_PlainNet())
    attrs = {u: dict(toy_population.train.user(u).attributes) for u in toy_population.train_user_ids()}
    fast = FDMLClients(toy_population, flat, attributes=attrs, seed=0, batched=True)
    slow = FDMLClients(toy_population, flat, attributes=attrs, seed=0, batched=False)
    ids = fast.client_ids()[:5]
    request = EmbedRequest(1, 1, 3, flat.initial())
    e_fast, e_slow = (
        fast.handle_batch({c: request for c in ids}),
        slow.handle_batch({c: request for c in ids}),
    )
    rng = np.random.default_rng(1)
    back = {c: BackpropRequest(1, 1, rng.normal(size=(3, 64)).astype(np.float32)) for c in ids}
    g_fast, g_slow = fast.handle_batch(back), slow.handle_batch(back)
    for c in ids:
        np.testing.assert_allclose(e_fast[c].embeddings, e_slow[c].embeddings, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g_fast[c].gradient, g_slow[c].gradient, rtol=1e-4, atol=1e-5)


def test_an_aggregate_of_the_wrong_size_never_reaches_adam(toy_population, monkeypatch, caplog) -> None:
    """Every upload is checked against the model, so step 9 cannot release another size; if an enclave
    did (or a non-finite one), the server leaves the round unapplied and says why, rather than letting
    the optimizer fail (``attempting to assign a gradient of size ...``) or its moments turn infinite."""
    server, rt, _, _ = _setup(toy_population, replace(CFG, min_gradients=1))
    size = server.params.numel()
    for bad in (np.zeros(size + 1, np.float32), np.full(size, np.inf, np.float32)):
        monkeypatch.setattr(LocalEnclave, "step_nine", lambda self, *a, bad=bad: (bad, {}))
        before = server.weights
        with caplog.at_level("ERROR", logger="fedveil.protocols.fdml"):
            (report,) = _rounds(server, rt, 1)
        assert not report.applied and np.array_equal(server.weights, before)
        assert f"aggregate of shape {bad.shape}" in caplog.text
    monkeypatch.undo()
    (report,) = _rounds(server, rt, 1, start=3)
    assert report.applied and not np.array_equal(server.weights, before)
