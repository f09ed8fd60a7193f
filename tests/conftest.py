"""Shared fixtures: a tiny deterministic population that stands in for TouchAuth in protocol tests, and
the headless Chromium page the browser tests drive."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from fedveil.data.federated import FederatedDataset, UserData


class ToyPopulation:
    """Users in two phone models; each user's samples are noisy copies of a private (30, 10) pattern."""

    def __init__(self, users_per_model: int = 6, test_users: int = 22, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.patterns: dict[str, np.ndarray] = {}
        records = []
        for model in ("A", "B"):
            for u in range(users_per_model):
                uid = f"{model}{u:03d}"
                self.patterns[uid] = rng.normal(0, 1, (30, 10)).astype(np.float32)
                records.append(UserData(uid, {"phone_model": model}, {}))
        self.train = FederatedDataset(records)
        self._test = np.stack(
            [
                rng.normal(0, 1, (30, 10))[None] + 0.3 * rng.normal(0, 1, (40, 30, 10))
                for _ in range(test_users)
            ]
        ).astype(np.float32)

    def train_user_ids(self, phone_model: str | None = None) -> list[str]:
        if phone_model is None:
            return list(self.train.user_ids)
        return self.train.users_where(phone_model=phone_model)

    def sample_training(self, user_id: str, n: int, rng: np.random.Generator) -> np.ndarray:
        noise = rng.normal(0, 0.3, (n, 30, 10)).astype(np.float32)
        return self.patterns[user_id][None] + noise

    def test_samples(self) -> tuple[list[str], np.ndarray]:
        return [f"T{i}" for i in range(len(self._test))], self._test


@pytest.fixture
def toy_population() -> ToyPopulation:
    return ToyPopulation()


@pytest.fixture(autouse=True)
def _torch_threads() -> None:
    torch.set_num_threads(1)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def chromium_page():
    """A page of Debian's Chromium, headless, driven by Playwright: the browser tests' one launcher
    (Playwright cannot download its own browsers offline; ``scripts/bootstrap`` installs chromium)."""
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "Debian's chromium is needed: apt-get install chromium (.ci/run does)"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        context = browser.new_context(ignore_https_errors=True)
        yield context.new_page()
        browser.close()
