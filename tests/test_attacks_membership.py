"""Membership inference (Yeom loss threshold, Nasr white-box, LiRA) on tiny MLPs and Gaussian data.

Two targets: an overfit model (60 training points, 400 full-batch Adam steps) whose members are its
training points, and a control that never saw any candidate (members and non-members are both fresh
draws), on which every attack must be at chance within sampling error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedveil.attacks.lira import lira_attack, lira_scores, lira_variants, logit_confidence
from fedveil.attacks.mia_nasr import nasr_attack, nasr_features, parameter_layers, snapshot_model
from fedveil.attacks.mia_yeom import per_example_loss, yeom_attack, yeom_scores
from fedveil.attacks.views import ModelView, NoPlaintextView, SealedView, UpdateView
from fedveil.errors import ConfigError, ValidationError

DIM = 10


def gaussian_task(rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes decided by the first feature plus noise of twice its scale (a third are mislabelled)."""
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x[:, 0] + 2.0 * rng.normal(size=n) > 0).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def train_mlp(x: torch.Tensor, y: torch.Tensor, seed: int, steps: int = 400) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 2))
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimiser.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimiser.step()
    return model


class Setting:
    def __init__(self) -> None:
        rng = np.random.default_rng(2024)
        self.member_x, self.member_y = gaussian_task(rng, 60)
        nonmember_x, nonmember_y = gaussian_task(rng, 60)
        self.x = torch.cat([self.member_x, nonmember_x])
        self.y = torch.cat([self.member_y, nonmember_y])
        self.is_member = np.arange(120) < 60
        self.overfit = train_mlp(self.member_x, self.member_y, seed=1)
        # The control never saw any of the 240 candidates below.
        control_x, control_y = gaussian_task(rng, 200)
        self.control = train_mlp(control_x, control_y, seed=2, steps=200)
        self.fresh_x, self.fresh_y = gaussian_task(rng, 240)
        self.fresh_label = np.arange(240) % 2 == 0


@pytest.fixture(scope="module")
def setting() -> Setting:
    torch.set_num_threads(1)
    return Setting()


def within_null(report, sigmas: float = 4.0) -> bool:
    return abs(report.auc - 0.5) < sigmas * report.auc_null_std_error


def chance_precision_band(report, sigmas: float = 4.0) -> bool:
    """Precision of a guesser: hypergeometric mean and standard deviation given how many it flagged."""
    flagged = report.true_positives + report.false_positives
    total, p = report.labels.size, report.chance_precision
    sd = math.sqrt(p * (1 - p) / flagged * (total - flagged) / (total - 1))
    return abs(report.precision - p) <= sigmas * sd


# Yeom et al. 2018


def test_yeom_score_is_minus_the_cross_entropy(setting: Setting) -> None:
    view = ModelView("server", setting.overfit)
    with torch.no_grad():
        expected = -F.cross_entropy(setting.overfit(setting.x), setting.y, reduction="none")
    np.testing.assert_allclose(yeom_scores(view, setting.x, setting.y), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        per_example_loss(setting.overfit, setting.x, setting.y, batch_size=7), -expected, rtol=1e-4, atol=1e-6
    )


def test_yeom_separates_members_of_an_overfit_model(setting: Setting) -> None:
    view = ModelView("server", setting.overfit)
    report = yeom_attack(view, setting.x, setting.y, setting.is_member)
    assert report.auc > 0.8
    assert report.threshold_source == "none" and report.precision is None
    tau = float(per_example_loss(setting.overfit, setting.member_x, setting.member_y).mean())
    with_tau = yeom_attack(view, setting.x, setting.y, setting.is_member, mean_train_loss=tau)
    assert with_tau.threshold_source == "attack" and with_tau.threshold == -tau
    assert with_tau.precision > 0.6 and with_tau.auc == report.auc


def test_yeom_is_at_chance_on_the_control(setting: Setting) -> None:
    report = yeom_attack(
        ModelView("server", setting.control), setting.fresh_x, setting.fresh_y, setting.fresh_label
    )
    assert within_null(report)
    assert report.auc_null_std_error == pytest.approx(math.sqrt(241 / (12 * 120 * 120)))


def test_yeom_rejects_bad_input(setting: Setting) -> None:
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        yeom_attack(SealedView("wire", 4096), setting.x, setting.y, setting.is_member)
    with pytest.raises(ValidationError, match="is_member"):
        yeom_attack(ModelView("s", setting.overfit), setting.x, setting.y, setting.is_member[:-1])
    with pytest.raises(ValidationError, match="only"):
        yeom_attack(ModelView("s", setting.overfit), setting.x, setting.y, np.ones(120, bool))
    with pytest.raises(ValidationError, match="y must"):
        yeom_attack(ModelView("s", setting.overfit), setting.x, setting.y[:-1], setting.is_member)
    with pytest.raises(ValidationError, match="integer class labels"):
        yeom_attack(ModelView("s", setting.overfit), setting.x, setting.y.float(), setting.is_member)
    with pytest.raises(ValidationError, match="finite"):
        yeom_attack(ModelView("s", setting.overfit), setting.x * float("nan"), setting.y, setting.is_member)
    with pytest.raises(ValidationError, match="classes"):
        yeom_attack(ModelView("s", setting.overfit), setting.x, setting.y + 2, setting.is_member)
    with pytest.raises(ConfigError, match="mean_train_loss"):
        yeom_attack(
            ModelView("s", setting.overfit), setting.x, setting.y, setting.is_member, mean_train_loss=-1.0
        )


# Nasr et al. 2019


def test_nasr_features_match_per_example_autograd(setting: Setting) -> None:
    model = setting.overfit
    x, y = setting.x[60:65], setting.y[60:65]  # non-members: losses well above float32 resolution
    features, names = nasr_features([model], x, y, top_k=3)
    assert names == [
        "s0/log_loss",
        "s0/true_class_confidence",
        "s0/top0",
        "s0/top1",
        "s0/log_grad_norm/0",
        "s0/log_grad_norm/2",
    ]
    for i in range(5):
        model.zero_grad()
        logits = model(x[i : i + 1])
        loss = F.cross_entropy(logits, y[i : i + 1])
        loss.backward()
        probs = logits.softmax(1)[0].detach()
        norms = [
            math.sqrt(sum(float((model.get_parameter(n).grad ** 2).sum()) for n in group))
            for group in parameter_layers(model).values()
        ]
        expected = [math.log(loss.item()), float(probs[y[i]]), *sorted(probs.tolist(), reverse=True)]
        np.testing.assert_allclose(features[i], expected + [math.log(v) for v in norms], rtol=1e-4, atol=1e-6)
    model.zero_grad()


def test_nasr_precision_beats_chance_on_the_overfit_model(setting: Setting) -> None:
    rng = np.random.default_rng(5)
    report = nasr_attack(
        ModelView("server", setting.overfit), setting.x, setting.y, setting.is_member, rng=rng
    )
    assert report.threshold_source == "attack" and report.chance_precision == 0.5
    assert report.labels.size == 60 and report.details["known_members"] == 30
    assert report.precision > 0.7 and report.auc > 0.75
    np.testing.assert_array_equal(report.labels, setting.is_member[report.indices])


def test_nasr_is_at_chance_on_the_control(setting: Setting) -> None:
    view = ModelView("server", setting.control)
    report = nasr_attack(
        view, setting.fresh_x, setting.fresh_y, setting.fresh_label, rng=np.random.default_rng(6)
    )
    assert chance_precision_band(report)
    assert within_null(report)


def test_nasr_is_seeded_and_concatenates_snapshots(setting: Setting) -> None:
    views = [ModelView("client", setting.control), ModelView("client", setting.overfit)]
    runs = [
        nasr_attack(views, setting.x, setting.y, setting.is_member, rng=np.random.default_rng(9), hidden=0)
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0].scores, runs[1].scores)
    np.testing.assert_array_equal(runs[0].indices, runs[1].indices)
    assert runs[0].details["snapshots"] == 2 and runs[0].details["features"] == 12
    other = nasr_attack(views, setting.x, setting.y, setting.is_member, rng=np.random.default_rng(10))
    assert not np.array_equal(other.indices, runs[0].indices)


def test_snapshot_of_a_delta_view_is_the_locally_trained_model(setting: Setting) -> None:
    base = setting.control
    delta = {n: torch.full_like(p, 0.25) for n, p in base.named_parameters() if n.startswith("2.")}
    view = UpdateView(
        "server", "delta", delta, base, num_samples=8, lr=0.1, local_steps=1, hidden=("0.weight",)
    )
    model = snapshot_model(view)
    torch.testing.assert_close(model.get_parameter("2.bias"), base.get_parameter("2.bias") + 0.25)
    torch.testing.assert_close(model.get_parameter("0.weight"), base.get_parameter("0.weight"))
    assert model is not base
    gradient = UpdateView("server", "gradient", delta, base)
    with pytest.raises(ValidationError, match="gradient"):
        snapshot_model(gradient)


def test_nasr_rejects_bad_input(setting: Setting) -> None:
    rng = np.random.default_rng(0)
    views = [ModelView("client", setting.overfit), SealedView("client", 1024)]
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        nasr_attack(views, setting.x, setting.y, setting.is_member, rng=rng)
    view = ModelView("server", setting.overfit)
    with pytest.raises(ValidationError, match="is_member"):
        nasr_attack(view, setting.x, setting.y, setting.is_member[:10], rng=rng)
    with pytest.raises(ValidationError, match="held out"):
        nasr_attack(view, setting.x[:4], setting.y[:4], [True, False, False, False], rng=rng)
    with pytest.raises(ConfigError, match="known_fraction"):
        nasr_attack(view, setting.x, setting.y, setting.is_member, rng=rng, known_fraction=1.0)
    with pytest.raises(ConfigError, match="grad_layers"):
        nasr_attack(view, setting.x, setting.y, setting.is_member, rng=rng, grad_layers=["9"])
    with pytest.raises(ValidationError, match="no observer view"):
        nasr_attack([], setting.x, setting.y, setting.is_member, rng=rng)


# Carlini et al. 2022 (LiRA)


def test_logit_confidence_is_the_stable_log_odds() -> None:
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    x = torch.tensor([[1.0, 2.0, 0.5], [900.0, 0.0, -900.0]])
    y = torch.tensor([1, 0])
    phi = logit_confidence(model, x, y)
    p = torch.softmax(x[0].double(), 0)[1]
    assert phi[0] == pytest.approx(float(torch.log(p / (1 - p))))
    assert phi[1] == pytest.approx(900.0)


def test_lira_scores_are_the_gaussian_likelihood_ratio() -> None:
    shadow = np.array([[1.0, 5.0], [2.0, 6.0], [3.0, 9.0], [4.0, 8.0], [0.0, 7.0]])
    inside = np.array([[True, False], [True, True], [False, True], [False, False], [True, False]])
    target = np.array([2.5, 6.5])

    def logpdf(v: float, data: list[float]) -> float:
        mu, sd = np.mean(data), np.std(data, ddof=1)
        return -0.5 * ((v - mu) / sd) ** 2 - math.log(sd) - 0.5 * math.log(2 * math.pi)

    online = lira_scores(target, shadow, inside)
    assert online[0] == pytest.approx(logpdf(2.5, [1, 2, 0]) - logpdf(2.5, [3, 4]))
    assert online[1] == pytest.approx(logpdf(6.5, [6, 9]) - logpdf(6.5, [5, 8, 7]))
    offline = lira_scores(target, shadow, inside, online=False)
    z = (2.5 - 3.5) / np.std([3, 4], ddof=1)
    assert offline[0] == pytest.approx(math.log(0.5 * math.erfc(-z / math.sqrt(2))))
    pooled = lira_scores(target, shadow, inside, online=False, global_variance=True)
    sd = math.sqrt(
        ((3 - 3.5) ** 2 + (4 - 3.5) ** 2 + (5 - 20 / 3) ** 2 + (8 - 20 / 3) ** 2 + (7 - 20 / 3) ** 2) / 3
    )
    assert pooled[1] == pytest.approx(math.log(0.5 * math.erfc(-((6.5 - 20 / 3) / sd) / math.sqrt(2))))
    with pytest.raises(ValidationError, match="OUT in 1 shadow"):
        lira_scores(target, shadow[:3], inside[:3])


def test_lira_separates_members_of_an_overfit_model(setting: Setting) -> None:
    view = ModelView("server", setting.overfit)
    report = lira_attack(
        view, setting.x, setting.y, setting.is_member, train_mlp, rng=np.random.default_rng(3), num_shadow=8
    )
    assert report.attack == "lira_online" and report.threshold == 0.0
    assert report.details["global_variance"] is True
    assert report.auc > 0.8
    offline = lira_attack(
        view,
        setting.x,
        setting.y,
        setting.is_member,
        train_mlp,
        rng=np.random.default_rng(3),
        num_shadow=8,
        online=False,
    )
    assert offline.threshold_source == "best_balanced_accuracy"
    assert offline.auc > 0.7
    both = lira_variants(
        view, setting.x, setting.y, setting.is_member, train_mlp, rng=np.random.default_rng(3), num_shadow=8
    )
    # one set of shadows serves both tests: the same reports as two separate runs with the same draws
    assert both["online"].auc == report.auc and both["offline"].auc == offline.auc


def test_lira_is_at_chance_on_the_control(setting: Setting) -> None:
    x, y, truth = setting.fresh_x[:120], setting.fresh_y[:120], setting.fresh_label[:120]
    report = lira_attack(
        ModelView("server", setting.control),
        x,
        y,
        truth,
        train_mlp,
        rng=np.random.default_rng(4),
        num_shadow=6,
    )
    assert within_null(report)


def test_lira_shadow_halves_and_reproducibility(setting: Setting) -> None:
    x, y, truth = setting.x[40:80], setting.y[40:80], setting.is_member[40:80]
    seen: list[np.ndarray] = []

    def recording_train(xs: torch.Tensor, ys: torch.Tensor, seed: int) -> nn.Module:
        seen.append(np.array([int(torch.nonzero((x == row).all(1))[0]) for row in xs]))
        return train_mlp(xs, ys, seed, steps=30)

    flips = [lambda b: b, lambda b: -b]
    first = lira_attack(
        ModelView("s", setting.overfit),
        x,
        y,
        truth,
        recording_train,
        rng=np.random.default_rng(8),
        num_shadow=4,
        augmentations=flips,
        global_variance=False,
    )
    counts = np.bincount(np.concatenate(seen), minlength=40)
    np.testing.assert_array_equal(counts, np.full(40, 2))
    second = lira_attack(
        ModelView("s", setting.overfit),
        x,
        y,
        truth,
        recording_train,
        rng=np.random.default_rng(8),
        num_shadow=4,
        augmentations=flips,
        global_variance=False,
    )
    np.testing.assert_array_equal(first.scores, second.scores)
    assert first.details["queries"] == 2 and first.details["global_variance"] is False


def test_lira_resumes_from_its_shadow_cache(setting: Setting, tmp_path) -> None:
    """A run cut off after some shadows resumes from the cached phis: the same scores, no retraining;
    a cache from another population is refused."""
    x, y, truth = setting.x[40:80], setting.y[40:80], setting.is_member[40:80]
    trained: list[int] = []
    cut_at = [0]  # the shadow (1-based) whose training is cut off; 0: none

    def train(xs: torch.Tensor, ys: torch.Tensor, seed: int) -> nn.Module:
        trained.append(seed)
        if len(trained) == cut_at[0]:
            raise RuntimeError("cut off")
        return train_mlp(xs, ys, seed, steps=30)

    def attack(xs: torch.Tensor, cache) -> dict:
        view = ModelView("s", setting.overfit)
        rng = np.random.default_rng(8)
        return lira_variants(view, xs, y, truth, train, rng=rng, num_shadow=4, cache=cache)

    whole = attack(x, None)
    trained.clear()
    cut_at[0] = 3
    with pytest.raises(RuntimeError, match="cut off"):
        attack(x, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["shadow0.npz", "shadow1.npz"]
    cut_at[0] = 0
    trained.clear()
    resumed = attack(x, tmp_path / "cache")
    assert len(trained) == 2  # only shadows 2 and 3 were trained
    for variant in ("online", "offline"):
        np.testing.assert_array_equal(resumed[variant].scores, whole[variant].scores)
    with pytest.raises(ConfigError, match="another LiRA run"):
        attack(x + 1.0, tmp_path / "cache")


def test_lira_rejects_bad_input(setting: Setting) -> None:
    rng = np.random.default_rng(0)
    args = (setting.x, setting.y, setting.is_member, train_mlp)
    with pytest.raises(NoPlaintextView, match="no plaintext view"):
        lira_attack(SealedView("wire", 10), *args, rng=rng)
    with pytest.raises(ConfigError, match="num_shadow"):
        lira_attack(ModelView("s", setting.overfit), *args, rng=rng, num_shadow=3)
    with pytest.raises(ValidationError, match="is_member"):
        lira_attack(ModelView("s", setting.overfit), setting.x, setting.y, [True], train_mlp, rng=rng)
    with pytest.raises(ValidationError, match=r"nn\.Module"):
        lira_attack(
            ModelView("s", setting.overfit),
            setting.x,
            setting.y,
            setting.is_member,
            lambda a, b, s: None,
            rng=rng,
            num_shadow=4,
        )
