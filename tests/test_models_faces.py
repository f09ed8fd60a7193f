"""MobileFaceNet and the ArcFace head (AIoT paper Sec. 5.2, Table 3): the paper's parameter count, the
margin's known answer, and Table 3's efficiency figures through the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.models.faces import ArcFace, MobileFaceNet, ResNet34Embedding


def test_mobilefacenet_has_the_papers_parameter_count_and_a_512_d_embedding() -> None:
    model = MobileFaceNet()
    assert sum(p.numel() for p in model.parameters()) == 1_200_512  # AIoT Table 3: 1.20M
    assert model(torch.zeros(2, 3, 112, 112)).shape == (2, 512)
    small = MobileFaceNet(width=0.5, image_size=64)
    assert small(torch.zeros(2, 3, 64, 64)).shape == (2, 512)
    assert sum(p.numel() for p in small.parameters()) < 400_000


def test_bad_shapes_are_refused_with_the_value() -> None:
    with pytest.raises(ConfigError, match="image_size 100 must be a multiple of 16"):
        MobileFaceNet(image_size=100)
    with pytest.raises(ConfigError, match=r"expects \(B, \(3, 112, 112\)\) images, got \(2, 1, 112, 112\)"):
        MobileFaceNet()(torch.zeros(2, 1, 112, 112))
    with pytest.raises(ConfigError, match="at least 2 classes"):
        ArcFace(512, 1)


def test_arcface_adds_the_angular_margin_to_the_label_only() -> None:
    """Two classes on the unit circle: an embedding at angle 0.3 rad from class 0 and 0.3 + pi/2 from
    class 1 gets s cos(0.3 + m) for its label and s cos(0.3 + pi/2) for the other class."""
    head = ArcFace(2, 2, scale=64.0, margin=0.5)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    e = torch.tensor([[math.cos(0.3), -math.sin(0.3)]]) * 3.0  # the norm does not matter
    logits = head(e, torch.tensor([0]))
    assert logits[0, 0].item() == pytest.approx(64 * math.cos(0.8), abs=1e-4)
    assert logits[0, 1].item() == pytest.approx(64 * math.cos(0.3 + math.pi / 2), abs=1e-4)
    # past pi - m the fallback cos(theta) - m sin(m) keeps the logit decreasing in theta
    far = torch.tensor([[-1.0, 0.01]])
    fallback = head(far, torch.tensor([0]))[0, 0].item() / 64
    cos = head.cosine(far)[0, 0].item()
    assert fallback == pytest.approx(cos - math.sin(math.pi - 0.5) * 0.5, abs=1e-5)


def test_aiot_efficiency_reports_table_3(capsys) -> None:
    assert main(["aiot", "efficiency", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["parameters"] == 1_200_512
    assert row["macs"] == pytest.approx(221.2e6, rel=0.01)  # the paper's counter: 233M "FLOPs"
    assert row["flops"] == 2 * row["macs"] == row["madd"]
    assert 4.5e6 < row["disk_bytes"] < 5.5e6  # float32 weights and BatchNorm statistics
    assert row["train_memory_bytes"] > 4 * row["parameters"]


def test_resnet34_embedding_has_torchvisions_backbone() -> None:
    """CameraAuth's network: ResNet-34's backbone (torchvision: 21,797,672 parameters with its 1000-way
    classifier of 513,000) and a 512 -> 64 linear embedding."""
    net = ResNet34Embedding()
    assert sum(p.numel() for p in net.backbone.parameters()) == 21_797_672 - 513_000
    assert sum(p.numel() for p in net.embedding.parameters()) == 512 * 64 + 64
    assert net(torch.zeros(2, 3, 64, 64)).shape == (2, 64)
    with pytest.raises(ConfigError, match="sides >= 32"):
        net(torch.zeros(1, 3, 16, 16))


def test_bench_mobilefacenet_reports_images_per_second(capsys) -> None:
    argv = ["bench", "mobilefacenet", "--image-size", "32", "--width", "0.25", "--batch-size", "4"]
    assert main([*argv, "--threads", "1", "--repeats", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert [(r["threads"], r["batchnorm"]) for r in row["rows"]] == [(1, "training"), (1, "frozen")]
    assert all(r["images_per_second"] > 0 for r in row["rows"])
    assert [r["threads"] for r in row["client_updates"]] == [1]
    assert row["client_updates"][0]["client_updates_per_second"] > 0
    assert main([*argv, "--batch-size", "1"]) == 2
