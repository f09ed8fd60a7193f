"""FDML's CameraAuth (Sec. VII-B): the population (synthetic and a VGGFace2-layout
folder fixture), the reduced ResNet-34 options, config checks, and FDML and FL-traditional end to end
through ``fedveil run`` on a tiny CameraAuth config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from fedveil.cli import main
from fedveil.data.cameraauth import cameraauth_from_folder, synthetic_cameraauth
from fedveil.errors import ConfigError
from fedveil.experiments.config import load_config
from fedveil.models.faces import ResNet34Embedding


def test_synthetic_population_has_the_papers_shape_at_a_small_size() -> None:
    pop = synthetic_cameraauth(train_people=5, test_people=11, train_photos=7, test_photos=40, size=32)
    assert pop.synthetic and "SYNTHETIC" in pop.source
    ids = pop.train_user_ids()
    assert len(ids) == 5 and pop.train_user_ids("camera") == ids and pop.train_user_ids("A") == []
    assert dict(pop.train.user(ids[0]).attributes) == {"phone_model": "camera"}
    x = pop.sample_training(ids[0], 7, np.random.default_rng(0))
    assert x.shape == (7, 3, 32, 32) and x.dtype == np.float32
    assert len({xi.tobytes() for xi in x}) == 7  # all of the person's photos, none twice
    assert pop.sample_training(ids[0], 9, np.random.default_rng(0)).shape == (9, 3, 32, 32)
    test_ids, samples = pop.test_samples()
    assert len(test_ids) == 11 and samples.shape == (11, 40, 3, 32, 32) and not samples.flags.writeable
    assert not set(test_ids) & set(ids)
    with pytest.raises(ConfigError, match="positive integer"):
        pop.sample_training(ids[0], 0, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=">= 11 test people"):
        synthetic_cameraauth(train_people=5, test_people=3, train_photos=4, test_photos=4, size=32)


def _vggface2(root: Path, people: int, photos: int) -> None:
    rng = np.random.default_rng(0)
    for p in range(people):
        folder = root / f"n{p + 1:06d}"
        folder.mkdir(parents=True)
        for i in range(photos - (p == 0) * (photos - 2)):  # the first person has only 2 photos
            pixels = rng.integers(0, 256, (20, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i + 1:04d}_01.jpg", quality=90)


def test_folder_population_draws_people_with_enough_photos(tmp_path: Path) -> None:
    _vggface2(tmp_path, 15, 5)
    pop = cameraauth_from_folder(
        tmp_path, train_people=3, test_people=11, train_photos=5, test_photos=4, size=32, seed=1
    )
    assert not pop.synthetic and len(pop.train_user_ids()) == 3
    people = set(pop.train_user_ids()) | set(pop.test_samples()[0])
    assert len(people) == 14 and "n000001" not in people  # too few photos: never drawn
    assert pop.test_samples()[1].shape == (11, 4, 3, 32, 32)
    assert pop.test_samples()[1].min() >= 0 and pop.test_samples()[1].max() <= 1
    with pytest.raises(ConfigError, match="14 people have >= 5 photos; CameraAuth needs 15"):
        cameraauth_from_folder(tmp_path, train_people=4, test_people=11, train_photos=5, test_photos=4)
    with pytest.raises(ConfigError, match="does not exist"):
        cameraauth_from_folder(tmp_path / "missing")


def test_reduced_resnet34_options() -> None:
    small = ResNet34Embedding(64, width=0.25, norm="group")
    assert sum(p.numel() for p in small.parameters()) == 1_343_504
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in small.modules())
    small.eval()
    one = torch.rand(1, 3, 32, 32)
    with torch.no_grad():  # GroupNorm: a photo's embedding does not depend on the batch it is in
        torch.testing.assert_close(small(one), small(torch.cat([one, torch.rand(3, 3, 32, 32)]))[:1])
    with pytest.raises(ConfigError, match="width"):
        ResNet34Embedding(64, width=0)
    with pytest.raises(ConfigError, match="norm"):
        ResNet34Embedding(64, norm="layer")


def test_config_checks_the_network_against_the_data(tmp_path: Path) -> None:
    assert load_config(None, ["data.kind=cameraauth-synthetic"]).network == "resnet34"
    assert load_config(None, []).network == "touchauth"
    with pytest.raises(ConfigError, match="does not read"):
        load_config(None, ["data.kind=cameraauth-synthetic", "model.network=touchauth"])
    with pytest.raises(ConfigError, match="does not read"):
        load_config(None, ["model.network=resnet34"])
    with pytest.raises(ConfigError, match="VGGFace2-layout folder"):
        load_config(None, ["data.kind=cameraauth-folder"])
    with pytest.raises(ConfigError, match="image_size"):
        load_config(None, ["data.kind=cameraauth-synthetic", "data.image_size=16"])


TINY = """
name: cam-tiny
protocol: {protocol}
seed: 0
rounds: 2
data:
  kind: cameraauth-synthetic
  train_people: 12
  test_people: 21
  train_photos: 6
  test_photos: 40
  image_size: 32
model:
  width: 0.25
fdml:
  num_required: 6
  samples_per_client: 4
  lr: 1.0e-3
fedavg:
  clients_per_round: 6
  samples_per_client: 4
  lr: 0.1
enclave:
  boundary: inprocess
runtime:
  threads: 1
"""


@pytest.mark.parametrize("protocol", ["fdml", "fedavg"])
def test_cameraauth_runs_end_to_end(tmp_path: Path, protocol: str) -> None:
    config = tmp_path / "cam.yaml"
    doc = yaml.safe_load(TINY.format(protocol=protocol))
    for unread in ("fedavg",) if protocol == "fdml" else ("fdml", "enclave"):
        del doc[unread]  # a run refuses the other protocol's keys: they would have no effect
    config.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert 0 <= results["accuracy_percent"] <= 100 and results["test_users"] == 21
    assert results["rounds_applied"] == 2 and results["bytes_up"] > 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines if "round" in r] == [1, 2]
