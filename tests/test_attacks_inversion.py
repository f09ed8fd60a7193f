"""Gradient inversion (DLG, iDLG, Inverting Gradients) and the image metrics they are scored with."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedveil.attacks.dlg import dlg_attack
from fedveil.attacks.idlg import idlg_attack, infer_labels
from fedveil.attacks.image_metrics import match_permutation, mse, psnr, reconstruction_metrics, ssim
from fedveil.attacks.inversion import (
    client_gradient_view,
    evaluate_inversion,
    save_inversion_grid,
)
from fedveil.attacks.inverting_gradients import inverting_gradients_attack, step_milestones
from fedveil.attacks.views import NoPlaintextView, SealedView, UpdateView
from fedveil.errors import ConfigError, ValidationError

SHAPE = (1, 12, 12)


def tiny_net(seed: int, channels: int = 3, classes: int = 10) -> nn.Module:
    """A sigmoid CNN in the style of the DLG paper's LeNet, sized for 1x12x12 inputs (1396 parameters)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, channels, 5, padding=2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(channels, channels, 5, padding=2),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(channels * 36, classes),
    )
    for p in net.parameters():
        nn.init.uniform_(p, -0.5, 0.5)
    return net


def private_batch(seed: int, batch: int = 1, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand((batch, *SHAPE), generator=gen)
    y = torch.randperm(classes, generator=gen)[:batch]
    return x, y


# ---------------------------------------------------------------- image metrics


def ssim_reference(a: np.ndarray, b: np.ndarray) -> float:
    """Wang et al. 2004 mean SSIM of one (C, H, W) pair, window by window in plain numpy."""
    size, sigma = 11, 1.5
    c1, c2 = (0.01 * 1.0) ** 2, (0.03 * 1.0) ** 2
    r = np.arange(size) - (size - 1) / 2
    w = np.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * sigma**2))
    w /= w.sum()
    per_channel = []
    for ch in range(a.shape[0]):
        vals = []
        for i in range(a.shape[1] - size + 1):
            for j in range(a.shape[2] - size + 1):
                pa, pb = a[ch, i : i + size, j : j + size], b[ch, i : i + size, j : j + size]
                ma, mb = (w * pa).sum(), (w * pb).sum()
                va, vb = (w * (pa - ma) ** 2).sum(), (w * (pb - mb) ** 2).sum()
                cov = (w * (pa - ma) * (pb - mb)).sum()
                vals.append(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
        per_channel.append(np.mean(vals))
    return float(np.mean(per_channel))


def test_ssim_matches_brute_force_reference() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (2, 3, 13, 15))
    b = np.clip(a + rng.normal(0, 0.2, a.shape), 0, 1)
    got = ssim(a, b).numpy()
    want = [ssim_reference(a[i], b[i]) for i in range(2)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    assert 0.1 < got.min() < got.max() < 0.95


def test_metrics_known_values() -> None:
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.uniform(0.2, 0.8, (3, 1, 16, 16)))
    b = (a + 0.1).clamp(0, 1)
    assert torch.equal(mse(a, a), torch.zeros(3))
    assert torch.isinf(psnr(a, a)).all()
    np.testing.assert_allclose(ssim(a, a).numpy(), 1.0, atol=1e-12)
    np.testing.assert_allclose(mse(a, b).numpy(), 0.01, rtol=1e-9)
    np.testing.assert_allclose(psnr(a, b).numpy(), 20.0, rtol=1e-9)
    np.testing.assert_allclose(ssim(a, b).numpy(), ssim(b, a).numpy(), rtol=1e-12)
    # two constant images: only the luminance term remains, (2 m n + C1) / (m^2 + n^2 + C1)
    c1 = 0.01**2
    const = ssim(torch.full((1, 2, 12, 12), 0.3), torch.full((1, 2, 12, 12), 0.6))
    assert float(const[0]) == pytest.approx((2 * 0.3 * 0.6 + c1) / (0.09 + 0.36 + c1), rel=1e-6)
    assert float(ssim(a, 1 - a).mean()) < 0  # an inverted image is anti-correlated
    with pytest.raises(ValidationError, match="expected the same shape"):
        mse(a, b[:, :, :8])


def test_match_permutation_recovers_a_shuffled_batch() -> None:
    rng = np.random.default_rng(2)
    originals = rng.uniform(0, 1, (5, 1, 12, 12))
    labels = np.array([3, 1, 4, 1, 5])
    order = np.array([2, 0, 4, 1, 3])
    shuffled = originals[order] + rng.normal(0, 0.01, originals.shape)
    perm = match_permutation(originals, shuffled)
    np.testing.assert_array_equal(order[perm], np.arange(5))
    metrics = reconstruction_metrics(originals, shuffled, labels, labels[order])
    assert metrics["permutation"] == perm.tolist()
    assert metrics["mse_median"] < 2e-4 and metrics["ssim_mean"] > 0.99
    assert metrics["label_accuracy"] == 1.0 and metrics["label_multiset_accuracy"] == 1.0
    wrong = labels[order].copy()
    wrong[perm[0]] = 9
    assert reconstruction_metrics(originals, shuffled, labels, wrong)["label_accuracy"] == pytest.approx(0.8)
    with pytest.raises(ValidationError, match="both"):
        reconstruction_metrics(originals, shuffled, labels)


# ---------------------------------------------------------------- observer views


def test_client_gradient_view_is_the_mean_cross_entropy_gradient() -> None:
    model = tiny_net(0)
    x, y = private_batch(0, batch=2)
    view = client_gradient_view(model, x, y, hidden=("5.bias",))
    assert view.kind == "gradient" and view.num_samples == 2 and view.hidden == ("5.bias",)
    assert "5.bias" not in view.update and all(p.grad is None for p in model.parameters())
    loss = nn.functional.cross_entropy(model(x), y)
    want = torch.autograd.grad(loss, model[5].weight)[0]
    torch.testing.assert_close(view.update["5.weight"], want)


def test_gradient_of_another_model_is_rejected_naming_the_parameter() -> None:
    x, y = private_batch(0)
    with pytest.raises(ValidationError, match=r"'0\.weight' has shape"):
        client_gradient_view(tiny_net(0, channels=3), x, y, attacker_model=tiny_net(0, channels=4))
    view = client_gradient_view(tiny_net(0), x, y)
    with pytest.raises(ValidationError, match=r"'5\.weight' has shape \(10, 108\)"):
        UpdateView(view.observer, "gradient", view.update, tiny_net(0, channels=3, classes=7))
    with pytest.raises(ValidationError, match=r"does not accept images of shape \(1, 20, 20\)"):
        dlg_attack(view, image_shape=(1, 20, 20), iterations=1)


@pytest.mark.parametrize(
    "attack", [dlg_attack, idlg_attack, inverting_gradients_attack], ids=["DLG", "iDLG", "IG"]
)
def test_sealed_view_has_no_plaintext_to_attack(attack) -> None:
    sealed = SealedView(observer="server", num_bytes=4096)
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        attack(sealed, image_shape=SHAPE, iterations=1)


# ---------------------------------------------------------------- DLG


def test_dlg_recovers_a_single_image_and_its_label() -> None:
    x, y = private_batch(3)
    view = client_gradient_view(tiny_net(1), x, y)
    result = dlg_attack(view, image_shape=SHAPE, iterations=40, seed=0, snapshot_every=10)
    metrics = evaluate_inversion(result, x, y)
    assert metrics["mse"][0] < 1e-3 and metrics["ssim"][0] > 0.95
    assert result.labels.tolist() == y.tolist() and metrics["label_accuracy"] == 1.0
    assert result.label_source == "optimised" and result.restarts == 1
    assert [it for it, _ in result.history] == [0, 10, 20, 30, 40]
    assert all(img.shape == (1, *SHAPE) for _, img in result.history)
    assert len(result.losses) == 41 and result.losses[-1] < 1e-4 * result.losses[0]
    assert result.images.min() >= 0 and result.images.max() <= 1
    assert result.iterations_per_second > 0 and result.evaluations >= 40


def test_dlg_is_reproducible_under_a_seed() -> None:
    x, y = private_batch(4)
    view = client_gradient_view(tiny_net(2), x, y)
    a = dlg_attack(view, image_shape=SHAPE, iterations=3, seed=7)
    b = dlg_attack(view, image_shape=SHAPE, iterations=3, seed=7)
    c = dlg_attack(view, image_shape=SHAPE, iterations=3, seed=8)
    assert torch.equal(a.images, b.images) and a.losses == b.losses
    assert not torch.equal(a.history[0][1], c.history[0][1])


def test_dlg_restarts_stop_at_the_first_converged_run() -> None:
    x, y = private_batch(3)
    view = client_gradient_view(tiny_net(1), x, y)
    converged = dlg_attack(view, image_shape=SHAPE, iterations=40, restarts=3)
    assert converged.restarts == 1
    unreachable = dlg_attack(view, image_shape=SHAPE, iterations=2, restarts=2, restart_tolerance=0.0)
    assert unreachable.restarts == 2


def test_dlg_with_a_hidden_projector_matches_only_the_seen_parameters() -> None:
    x, y = private_batch(5)
    truth = tiny_net(3)
    guess = tiny_net(4)
    view = client_gradient_view(truth, x, y, hidden=("5.weight", "5.bias"), attacker_model=guess)
    assert torch.equal(view.model[0].weight, truth[0].weight)
    assert not torch.equal(view.model[5].weight, truth[5].weight)
    before = {k: v.clone() for k, v in view.model.state_dict().items()}
    result = dlg_attack(view, image_shape=SHAPE, iterations=2, optimize_hidden=True)
    assert result.images.shape == (1, *SHAPE)
    assert all(torch.equal(before[k], v) for k, v in view.model.state_dict().items())
    with pytest.raises(ConfigError, match="optimize_hidden"):
        dlg_attack(client_gradient_view(truth, x, y), image_shape=SHAPE, iterations=1, optimize_hidden=True)


def test_bad_settings_name_the_value() -> None:
    x, y = private_batch(0)
    view = client_gradient_view(tiny_net(0), x, y)
    with pytest.raises(ConfigError, match="iterations must be a positive integer, got 0"):
        dlg_attack(view, image_shape=SHAPE, iterations=0)
    with pytest.raises(ConfigError, match="init must be one of"):
        dlg_attack(view, image_shape=SHAPE, iterations=1, init="zeros")
    with pytest.raises(ConfigError, match=r"image_shape must be three positive integers"):
        dlg_attack(view, image_shape=(12, 12), iterations=1)
    with pytest.raises(ConfigError, match="tv_weight"):
        inverting_gradients_attack(view, image_shape=SHAPE, iterations=1, tv_weight=-1.0)


# ---------------------------------------------------------------- iDLG


def test_idlg_infers_the_label_at_batch_one() -> None:
    for seed in range(12):
        x, y = private_batch(100 + seed)
        view = client_gradient_view(tiny_net(seed), x, y)
        assert infer_labels(view, image_shape=SHAPE).tolist() == y.tolist()
    # a FedAvg delta of one SGD step reads as the same gradient
    x, y = private_batch(200)
    grad = client_gradient_view(tiny_net(0), x, y)
    delta = {k: -0.1 * g for k, g in grad.update.items()}
    dview = UpdateView("server", "delta", delta, grad.model, num_samples=1, lr=0.1, local_steps=1)
    assert infer_labels(dview, image_shape=SHAPE).tolist() == y.tolist()


def test_idlg_recovers_the_image_with_the_inferred_label() -> None:
    x, y = private_batch(6)
    view = client_gradient_view(tiny_net(5), x, y)
    result = idlg_attack(view, image_shape=SHAPE, iterations=30)
    metrics = evaluate_inversion(result, x, y)
    assert result.label_source == "inferred" and metrics["label_accuracy"] == 1.0
    assert metrics["mse"][0] < 1e-3


def test_idlg_batch_heuristic_recovers_distinct_labels_and_misses_repeats() -> None:
    x, y = private_batch(7, batch=3)
    view = client_gradient_view(tiny_net(6), x, y)
    assert sorted(infer_labels(view, image_shape=SHAPE).tolist()) == sorted(y.tolist())
    # a repeated label: the heuristic assumes distinct labels, so it recovers at most one of the pair
    x2 = x[:2]
    y2 = torch.tensor([4, 4])
    labels = infer_labels(client_gradient_view(tiny_net(6), x2, y2), image_shape=SHAPE)
    assert len(set(labels.tolist())) == 2
    metrics = reconstruction_metrics(x2, x2, y2, labels)
    assert metrics["label_multiset_accuracy"] <= 0.5


def test_idlg_needs_a_seen_linear_last_layer() -> None:
    x, y = private_batch(0)
    hidden = client_gradient_view(tiny_net(0), x, y, hidden=("5.weight",))
    with pytest.raises(ValidationError, match=r"last layer's weight '5\.weight' is hidden"):
        idlg_attack(hidden, image_shape=SHAPE, iterations=1)
    torch.manual_seed(0)
    conv_head = nn.Sequential(nn.Conv2d(1, 10, 12), nn.Flatten())
    view = client_gradient_view(conv_head, x, y)
    with pytest.raises(ValidationError, match=r"last layer '0' is a Conv2d"):
        infer_labels(view, image_shape=SHAPE)


# ---------------------------------------------------------------- Inverting Gradients


def test_inverting_gradients_reduces_the_error_of_its_initialisation() -> None:
    x, y = private_batch(8)
    view = client_gradient_view(tiny_net(7), x, y)
    result = inverting_gradients_attack(view, image_shape=SHAPE, iterations=120, tv_weight=1e-4, seed=1)
    initial = float(mse(x, result.history[0][1])[0])
    final = evaluate_inversion(result, x, y)
    assert final["mse"][0] < 0.1 * initial
    assert final["label_accuracy"] == 1.0 and result.label_source == "inferred"
    assert result.losses[-1] < result.losses[0]
    given = inverting_gradients_attack(view, image_shape=SHAPE, iterations=2, labels=torch.tensor([3]))
    assert given.labels.tolist() == [3] and given.label_source == "given"
    assert step_milestones(4800) == (1800, 3000, 4200)


# ---------------------------------------------------------------- the grid


def test_grid_png_is_written(tmp_path) -> None:
    x, y = private_batch(9, batch=2)
    view = client_gradient_view(tiny_net(8), x, y)
    result = dlg_attack(view, image_shape=SHAPE, iterations=4, snapshot_every=1)
    path = save_inversion_grid(tmp_path / "grids" / "dlg.png", x, result, original_labels=y, max_rows=4)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > image.shape[1]  # four rows of two images: taller than wide
    with pytest.raises(ConfigError, match=r"must end in \.png"):
        save_inversion_grid(tmp_path / "dlg.jpg", x, result)
    assert math.isfinite(evaluate_inversion(result, x, y)["mse_mean"])
