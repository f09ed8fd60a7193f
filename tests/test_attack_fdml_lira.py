"""User-level LiRA against an embedding network: the likelihood ratio against a brute-force reference,
the prototype statistic against explicit loops, a planted memoriser (AUC near 1) beside a control (near
chance), and ``fedveil attack fdml-lira`` end to end at a tiny size."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from fedveil.attacks.lira import lira_scores
from fedveil.attacks.lira_metric import prototype_confidence, user_lira_attack
from fedveil.attacks.views import ModelView
from fedveil.cli import main
from fedveil.errors import ConfigError, ValidationError
from fedveil.experiments.attacks.fdml_lira import fdml_lira_table


def _brute_force(
    target: np.ndarray, shadow: np.ndarray, inside: np.ndarray, *, online: bool, pooled: bool
) -> list[float] | None:
    """LiRA's score per example by explicit loops over examples and queries, with the standard library's
    normal distribution: the Gaussians' means and (unbiased, or pooled over examples) deviations; ``None``
    where a density or a tail probability is below the smallest normal double."""
    num_shadow, n, q = shadow.shape

    def groups(mask: np.ndarray) -> list[list[list[float]]]:
        return [
            [[float(shadow[s, i, k]) for s in range(num_shadow) if mask[s, i]] for k in range(q)]
            for i in range(n)
        ]

    def fits(values: list[list[list[float]]]) -> list[list[tuple[float, float]]]:
        deviations = []
        for k in range(q):
            if pooled:
                residual = sum(sum((v - statistics.mean(row[k])) ** 2 for v in row[k]) for row in values)
                dof = sum(len(row[k]) for row in values) - n
                deviations.append([math.sqrt(residual / dof)] * n)
            else:
                deviations.append([statistics.stdev(row[k]) for row in values])
        return [
            [(statistics.mean(row[k]), max(deviations[k][i], 1e-6)) for k in range(q)]
            for i, row in enumerate(values)
        ]

    out_fit = fits(groups(~inside))
    in_fit = fits(groups(inside))
    scores = []
    for i in range(n):
        per_query = []
        for k in range(q):
            value = float(target[i, k])
            mu_out, sd_out = out_fit[i][k]
            if online:
                mu_in, sd_in = in_fit[i][k]
                densities = (
                    statistics.NormalDist(mu_in, sd_in).pdf(value),
                    statistics.NormalDist(mu_out, sd_out).pdf(value),
                )
                if min(densities) < sys.float_info.min:  # subnormal or zero: too few digits to compare
                    return None
                per_query.append(math.log(densities[0]) - math.log(densities[1]))
            else:
                # erfc, not NormalDist.cdf, whose 1 + erf loses the lower tail's digits (at z = -7.7 the
                # log is off by 4e-3)
                tail = 0.5 * math.erfc((mu_out - value) / (sd_out * math.sqrt(2.0)))
                if tail < sys.float_info.min:
                    return None
                per_query.append(math.log(tail))
        scores.append(statistics.mean(per_query))
    return scores


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_shadow=st.integers(4, 9),
    n=st.integers(1, 6),
    q=st.integers(1, 3),
    online=st.booleans(),
    pooled=st.booleans(),
)
def test_lira_scores_match_a_brute_force_reference(
    seed: int, num_shadow: int, n: int, q: int, online: bool, pooled: bool
) -> None:
    rng = np.random.default_rng(seed)
    inside = rng.uniform(size=(num_shadow, n)).argsort(axis=0) < num_shadow // 2
    shadow = rng.normal(0.0, 1.0, (num_shadow, n, q)) + 2.0 * inside[:, :, None]
    target = rng.normal(1.0, 1.0, (n, q))
    fast = lira_scores(target, shadow, inside, online=online, global_variance=pooled)
    reference = _brute_force(target, shadow, inside, online=online, pooled=pooled)
    assume(reference is not None)
    np.testing.assert_allclose(fast, reference, rtol=1e-7, atol=1e-9)


def test_prototype_confidence_matches_explicit_loops() -> None:
    rng = np.random.default_rng(3)
    emb = rng.normal(0.0, 1.0, (4, 3, 5)) + rng.normal(0.0, 2.0, (4, 1, 5))
    centroids = emb.mean(axis=1)
    squared = [
        [float(((emb[u, s] - centroids[j]) ** 2).sum()) for j in range(4)] for u in range(4) for s in range(3)
    ]
    tau = statistics.mean(squared[u * 3 + k][u] for u in range(4) for k in range(3))
    expected = []
    for u in range(4):
        per_sample = []
        for s in range(3):
            z = [-d / tau for d in squared[u * 3 + s]]
            p = math.exp(z[u]) / sum(math.exp(v) for v in z)
            per_sample.append(math.log(p / (1.0 - p)))
        expected.append(statistics.mean(per_sample))
    np.testing.assert_allclose(prototype_confidence(emb), expected, rtol=1e-9)
    # a rescaled embedding space leaves the statistic as it was
    np.testing.assert_allclose(prototype_confidence(7.5 * emb), expected, rtol=1e-9)


def test_prototype_confidence_refuses_what_it_cannot_score() -> None:
    with pytest.raises(ValidationError, match="users >= 2"):
        prototype_confidence(np.zeros((1, 3, 2)))
    with pytest.raises(ValidationError, match="sit on their centroid"):
        prototype_confidence(np.ones((3, 2, 2)))
    with pytest.raises(ValidationError, match="NaN or inf"):
        prototype_confidence(np.full((3, 2, 2), np.nan))


class Memoriser(nn.Module):
    """A planted "network" that memorises the users it was trained on: an input within ``radius`` of a
    trained user's centre is pulled to 10% of its distance from that centre; any other input passes."""

    def __init__(self, centres: np.ndarray, radius: float = 2.5) -> None:
        super().__init__()
        self.register_buffer("centres", torch.as_tensor(centres, dtype=torch.float32).reshape(-1, 8))
        self.radius = radius

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.centres.shape[0] == 0:
            return x
        distance = torch.cdist(x, self.centres)
        nearest = distance.argmin(dim=1)
        close = distance.gather(1, nearest[:, None]) < self.radius
        centre = self.centres[nearest]
        return torch.where(close, centre + 0.1 * (x - centre), x)


def _world(users: int = 40, per_user: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, (users, 8))
    samples = centres[:, None, :] + rng.normal(0.0, 0.5, (users, per_user, 8))
    is_member = np.zeros(users, bool)
    is_member[rng.permutation(users)[: users // 2]] = True
    return centres, samples, is_member


def test_planted_memoriser_is_found_and_the_control_sits_at_chance() -> None:
    centres, samples, is_member = _world()
    others = np.random.default_rng(9).normal(0.0, 1.0, (20, 8)) + 40.0  # users far from every candidate
    reports = user_lira_attack(
        ModelView("planted", Memoriser(centres[is_member])),
        samples,
        is_member,
        lambda inside, seed: Memoriser(centres[inside]),
        rng=np.random.default_rng(1),
        num_shadow=8,
        controls={"control": ModelView("disjoint users", Memoriser(others))},
    )
    for variant in ("online", "offline"):
        assert reports[f"target/{variant}"].auc > 0.9
        control = reports[f"control/{variant}"]
        assert abs(control.auc - 0.5) < 3 * control.auc_null_std_error
    assert reports["target/online"].details["statistic"] == "prototype_confidence"


def test_user_lira_refuses_bad_settings() -> None:
    centres, samples, is_member = _world(users=8)
    view = ModelView("planted", Memoriser(centres[is_member]))

    def train(inside: np.ndarray, seed: int) -> nn.Module:
        return Memoriser(centres[inside])

    with pytest.raises(ConfigError, match="may not be named 'target'"):
        user_lira_attack(
            view,
            samples,
            is_member,
            train,
            rng=np.random.default_rng(0),
            num_shadow=4,
            controls={"target": view},
        )
    with pytest.raises(ConfigError, match="num_shadow must be an integer >= 4"):
        user_lira_attack(view, samples, is_member, train, rng=np.random.default_rng(0), num_shadow=3)
    with pytest.raises(ValidationError, match=r"must return a torch\.nn\.Module, got ndarray"):
        user_lira_attack(
            view, samples, is_member, lambda inside, seed: centres, rng=np.random.default_rng(0), num_shadow=4
        )
    with pytest.raises(ValidationError, match="samples >= 2"):
        user_lira_attack(view, samples[:, :1], is_member, train, rng=np.random.default_rng(0), num_shadow=4)


def test_fdml_lira_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["attack", "fdml-lira", "--users", "8", "--shadows", "4", "--rounds", "2", "--devices", "4"]
    threads = torch.get_num_threads()
    assert main([*argv, "--threads", "1", "--out", str(tmp_path), "--json"]) == 0
    assert torch.get_num_threads() == threads  # the run's one thread is given back
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "fdml_lira.json").read_text())
    run = printed["run"]
    assert (run["members"], run["non_members"], run["epsilon"]) == (4, 4, None)
    assert run["min_resolvable_fpr"] == 0.25
    expected = {
        f"{who}/{variant}"
        for who in ("target", "control/disjoint-users")
        for variant in ("online", "offline")
    }
    assert set(printed["attacks"]) == expected | {"target/spread"}
    for report in printed["attacks"].values():
        assert 0.0 <= report["auc"] <= 1.0
        assert report["tpr_at_fpr"]["0.001"] is None and report["tpr_at_fpr"]["0.01"] is None


def test_fdml_lira_refuses_bad_settings_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="users must be an even integer >= 4"):
        fdml_lira_table(users=7)
    with pytest.raises(ConfigError, match="num_threads must be a positive integer or None, got 0"):
        fdml_lira_table(users=8, num_threads=0)
    assert main(["attack", "fdml-lira", "--users", "2"]) != 0
    assert "users must be an even integer >= 4" in capsys.readouterr().err
