"""Observer views built from the wire of a FedAvg run: per-client deltas, the aggregate, private parts
hidden, sealed messages reported as ciphertext."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedveil.attacks.observe import WireObserver
from fedveil.attacks.views import NoPlaintextView, SealedView, UpdateView, require_update_view
from fedveil.core.codec import encode
from fedveil.errors import ValidationError
from fedveil.models.flat import FlatModel
from fedveil.protocols.fedavg import ParameterPlan
from fedveil.protocols.messages import SealedGradReply
from test_protocols_fedavg_engine import CFG, Tiny, _run


def _observe(plan_kw=None):
    torch.manual_seed(0)
    flat = FlatModel(Tiny())
    plan = ParameterPlan(flat, **(plan_kw or {}))
    obs = WireObserver(flat, plan, Tiny)
    server, pool, _, _, initial = _run(CFG, rounds=2, plan_kw=plan_kw, tap=obs.tap)
    return obs, server, pool, initial


def test_client_views_are_upload_minus_broadcast() -> None:
    obs, _, _, initial = _observe()
    views = obs.client_views(1)
    assert len(views) == CFG.clients_per_round
    # one snapshot per broadcast: attacks that simulate updates per snapshot (Melis) group the views by it
    assert len({id(v.model) for v in views}) == 1
    view = views[0]
    assert isinstance(view, UpdateView) and view.kind == "delta" and view.hidden == ()
    assert view.lr == pytest.approx(0.1)
    assert view.local_steps == CFG.local_epochs * -(-view.num_samples // CFG.batch_size)
    received = obs.rounds[1].replies[0].weights
    flat_delta = torch.cat([view.update[n].reshape(-1) for n in FlatModel(view.model).names])
    np.testing.assert_allclose(flat_delta.numpy(), received - initial, atol=1e-6)
    np.testing.assert_allclose(FlatModel(view.model).initial(), initial)
    grads = view.as_gradient()
    np.testing.assert_allclose(
        grads["head.bias"].numpy(), -view.update["head.bias"].numpy() / (0.1 * view.local_steps)
    )
    agg = obs.aggregate_view(1)
    np.testing.assert_allclose(
        torch.cat([agg.update[n].reshape(-1) for n in FlatModel(agg.model).names]).numpy(),
        obs.rounds[2].request.weights - initial,
        atol=1e-6,
    )


def test_private_head_is_hidden_and_guessed() -> None:
    obs, server, pool, initial = _observe({"private": ["head"]})
    view = obs.client_views(2)[0]
    assert set(view.hidden) == {"head.weight", "head.bias"}
    assert "head.weight" not in view.update and "conv.weight" in view.update
    guess = torch.cat([dict(view.model.named_parameters())[n].detach().reshape(-1) for n in view.hidden])
    trained = [
        pool.private_weights(c)
        for c in pool.client_ids()
        if not np.array_equal(pool.private_weights(c), initial[server.plan.private_index])
    ]
    assert trained
    for private in trained:
        assert not np.allclose(guess.numpy(), private)


def test_sealed_uploads_give_sealed_views_and_attacks_refuse_them() -> None:
    flat = FlatModel(Tiny())
    obs = WireObserver(flat, ParameterPlan(flat), Tiny, sealed_types=(SealedGradReply,))
    obs.tap("from_client", encode(SealedGradReply(3, 0, 8, np.full(40, 1, np.uint8))))
    obs.tap("from_client", b"not a message")
    (view,) = obs.client_views(3)
    assert isinstance(view, SealedView) and view.num_bytes > 40
    assert obs.undecodable == 1
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        require_update_view(view, "dlg")
    with pytest.raises(ValidationError, match="saw nothing of round 4"):
        obs.client_views(4)
    with pytest.raises(ValidationError, match="broadcasts of 3 and 4"):
        obs.aggregate_view(3)
