"""Melis et al. 2019 batch-property inference on the updates of a tiny MLP.

The main task is a two-class Gaussian problem; the property is a subgroup independent of the label whose
last input feature is shifted by +3, so batches that hold it produce different gradients. Clients' batches
(32 examples) are drawn from a pool the attacker never sees; the attacker holds its own auxiliary data.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedveil.attacks.pia_melis import melis_attack, simulate_updates, update_vector
from fedveil.attacks.views import ModelView, NoPlaintextView, SealedView, UpdateView
from fedveil.errors import ConfigError, ValidationError

DIM = 10
BATCH = 32
LR, STEPS = 0.1, 3


def sample(rng: np.random.Generator, has_property: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    n = has_property.size
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x[:, 0] + rng.normal(size=n) > 0).astype(np.int64)
    x[has_property, -1] += 3.0
    return torch.from_numpy(x), torch.from_numpy(y)


def make_model(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 2))


def client_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """What an honest client uploads, computed with plain autograd / torch.optim (independently)."""
    local = copy.deepcopy(model)
    if kind == "gradient":
        F.cross_entropy(local(x), y).backward()
        return {n: p.grad.clone() for n, p in local.named_parameters()}
    optimiser = torch.optim.SGD(local.parameters(), lr=LR)
    for _ in range(STEPS):
        optimiser.zero_grad()
        F.cross_entropy(local(x), y).backward()
        optimiser.step()
    return {
        n: p.detach() - q.detach()
        for (n, p), q in zip(local.named_parameters(), model.parameters(), strict=True)
    }


def observed_views(
    models: list[nn.Module], kind: str, count: int, fraction: float, rng: np.random.Generator
) -> tuple[list[UpdateView], np.ndarray]:
    views, truth = [], np.arange(count) % 2 == 0
    for i in range(count):
        model = models[i % len(models)]
        prop = np.zeros(BATCH, dtype=bool)
        prop[: round(fraction * BATCH)] = truth[i]
        x, y = sample(rng, prop)
        extra = {"lr": LR, "local_steps": STEPS} if kind == "delta" else {}
        views.append(
            UpdateView("server", kind, client_update(model, x, y, kind), model, num_samples=BATCH, **extra)
        )
    return views, truth


@pytest.fixture(scope="module")
def auxiliary() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(11)
    prop = rng.random(400) < 0.5
    x, y = sample(rng, prop)
    return x, y, prop


def test_simulated_updates_match_autograd_and_sgd() -> None:
    model = make_model(0)
    rng = np.random.default_rng(0)
    xs, ys = zip(*(sample(rng, np.zeros(6, dtype=bool)) for _ in range(3)), strict=True)
    xb, yb = torch.stack(xs), torch.stack(ys)
    names = [n for n, _ in model.named_parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    for kind, extra in (("gradient", {}), ("delta", {"lr": LR, "local_steps": STEPS})):
        rows = simulate_updates(model, xb, yb, names=names, kind=kind, **extra)
        assert rows.shape == (3, sum(p.numel() for p in model.parameters()))
        for b in range(3):
            expected = client_update(model, xb[b], yb[b], kind)
            torch.testing.assert_close(rows[b], torch.cat([expected[n].flatten() for n in names]))
    only_bias = simulate_updates(model, xb, yb, names=["2.bias"], kind="gradient")
    assert only_bias.shape == (3, 2)
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("kind", "fraction", "least"), [("gradient", 1.0, 0.8), ("delta", 0.5, 0.75)])
def test_property_that_changes_the_gradients_is_inferred(
    auxiliary: tuple[torch.Tensor, torch.Tensor, np.ndarray], kind: str, fraction: float, least: float
) -> None:
    models = [make_model(1), make_model(2)]
    views, truth = observed_views(models, kind, 80, fraction, np.random.default_rng(3))
    ax, ay, aprop = auxiliary
    report = melis_attack(
        views, truth, ax, ay, aprop, rng=np.random.default_rng(4), property_fraction=fraction
    )
    assert report.attack == "melis_batch_property"
    assert report.details["snapshots"] == 2 and report.details["training_updates"] == 2 * 2 * 256
    assert report.threshold_source == "attack"
    assert report.auc > least
    assert report.auc - 0.5 > 4 * report.auc_null_std_error


def test_random_property_is_at_chance(auxiliary: tuple[torch.Tensor, torch.Tensor, np.ndarray]) -> None:
    rng = np.random.default_rng(5)
    views, _ = observed_views([make_model(1)], "gradient", 120, 0.0, rng)
    ax, ay, _ = auxiliary
    unrelated_truth = rng.random(120) < 0.5
    unrelated_aux = rng.random(ax.shape[0]) < 0.5
    report = melis_attack(views, unrelated_truth, ax, ay, unrelated_aux, rng=np.random.default_rng(6))
    assert abs(report.auc - 0.5) < 4 * report.auc_null_std_error


def test_attack_is_seeded_and_uses_the_chosen_parameters(
    auxiliary: tuple[torch.Tensor, torch.Tensor, np.ndarray],
) -> None:
    views, truth = observed_views([make_model(1)], "gradient", 20, 1.0, np.random.default_rng(7))
    ax, ay, aprop = auxiliary
    runs = [
        melis_attack(
            views,
            truth,
            ax,
            ay,
            aprop,
            rng=np.random.default_rng(8),
            batches_per_snapshot=32,
            params=["0.weight"],
        )
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0].scores, runs[1].scores)
    assert runs[0].details["update_values"] == 16 * DIM and runs[0].details["parameters"] == "0.weight"
    assert update_vector(views[0], ["2.bias"]).tolist() == views[0].update["2.bias"].double().tolist()


def test_bad_input_is_rejected(auxiliary: tuple[torch.Tensor, torch.Tensor, np.ndarray]) -> None:
    model = make_model(1)
    views, truth = observed_views([model], "gradient", 6, 1.0, np.random.default_rng(9))
    ax, ay, aprop = auxiliary
    rng = np.random.default_rng(0)
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        melis_attack([*views[:2], SealedView("server", 2048)], [True, False, True], ax, ay, aprop, rng=rng)
    with pytest.raises(ValidationError, match="UpdateView"):
        melis_attack([ModelView("server", model)], [True], ax, ay, aprop, rng=rng)
    with pytest.raises(ValidationError, match="has_property"):
        melis_attack(views, truth[:-1], ax, ay, aprop, rng=rng)
    with pytest.raises(ValidationError, match="only"):
        melis_attack(views, np.ones(6, dtype=bool), ax, ay, aprop, rng=rng)
    with pytest.raises(ValidationError, match="aux_property"):
        melis_attack(views, truth, ax, ay, aprop[:10], rng=rng)
    with pytest.raises(ValidationError, match="auxiliary data has"):
        melis_attack(views, truth, ax[:40], ay[:40], aprop[:40], rng=rng)
    unsized = [UpdateView("server", "gradient", v.update, v.model) for v in views]
    with pytest.raises(ConfigError, match="batch_size"):
        melis_attack(unsized, truth, ax, ay, aprop, rng=rng)
    with pytest.raises(ConfigError, match="property_fraction"):
        melis_attack(views, truth, ax, ay, aprop, rng=rng, property_fraction=0.0)
    with pytest.raises(ValidationError, match="lacks parameters"):
        melis_attack(views, truth, ax, ay, aprop, rng=rng, params=["0.bias", "9.weight"])
    no_lr = [UpdateView("server", "delta", v.update, v.model, num_samples=BATCH) for v in views]
    with pytest.raises(ValidationError, match="local_steps"):
        melis_attack(no_lr, truth, ax, ay, aprop, rng=rng)
