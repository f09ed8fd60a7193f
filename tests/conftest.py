"""Shared fixtures: a tiny deterministic population that stands in for TouchAuth in protocol tests, a
small Fashion-MNIST on disk for commands that load it, and the headless Chromium page the browser tests
drive."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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


SMALL_FASHION_MNIST = {"train": 1200, "t10k": 200}
"""Images per split of :func:`small_fashion_mnist_root` (the files' prefixes: ``train``, ``t10k``)."""


@pytest.fixture(scope="session")
def small_fashion_mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``$FEDVEIL_DATA_DIR`` whose ``fashion-mnist`` folder holds Fashion-MNIST in its published on-disk
    layout (uncompressed IDX files): 1,200 training and 200 test images drawn from the synthetic stand-in,
    written once per session."""
    from fedveil.data.images import synthetic_fashion_mnist
    from idx_files import write_idx

    root = tmp_path_factory.mktemp("data")
    folder = root / "fashion-mnist"
    folder.mkdir()
    for prefix, n in SMALL_FASHION_MNIST.items():
        data = synthetic_fashion_mnist(n, seed=0, split="train" if prefix == "train" else "test")
        pixels = np.round(data.x[:, 0] * 255).astype(np.uint8)
        for kind, array in (("images-idx3", pixels), ("labels-idx1", data.y.astype(np.uint8))):
            write_idx(folder / f"{prefix}-{kind}-ubyte", array)
    return root


@pytest.fixture
def small_fashion_mnist(small_fashion_mnist_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$FEDVEIL_DATA_DIR`` at :func:`small_fashion_mnist_root` for one test (its child processes
    included): for commands that load ``fashion-mnist`` where the test's checks do not depend on its size,
    instead of generating the stand-in's 60,000 + 10,000 images."""
    monkeypatch.setenv("FEDVEIL_DATA_DIR", str(small_fashion_mnist_root))
    return small_fashion_mnist_root


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
