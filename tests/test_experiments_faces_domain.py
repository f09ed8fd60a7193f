"""The face-population hardness measurement: verification pairs and TAR@FAR on a known answer, and a
tiny end-to-end run of pre-training, evaluation and fine-tuning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedveil.data.faces import FaceImages, sample_grid
from fedveil.experiments.aiot.faces_domain import FaceDomainRun, measure_domain_gap, verification


class _AngleOfChannel0(nn.Module):
    """Embeds a photo as the point on the circle at the angle its channel 0 encodes (its identity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angle = x[:, 0].mean(dim=(1, 2)) * 2 * np.pi
        return torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)


def test_verification_counts_pairs_and_a_perfect_embedding_accepts_every_genuine_pair() -> None:
    ids, wild = 50, 3
    identity = np.repeat(np.arange(ids), wild + 1)
    x = np.zeros((len(identity), 3, 4, 4), dtype=np.float32)
    x[:, 0] = (identity / ids)[:, None, None] * 0.9
    reference = np.tile([True] + [False] * wild, ids)
    faces = FaceImages(x, identity.astype(np.int64), tuple(map(str, range(ids))), "fixture")
    out = verification(_AngleOfChannel0(), faces, reference)
    assert out["genuine_pairs"] == ids * wild and out["impostor_pairs"] == ids * (ids - 1) * wild
    assert out["tar_at_far_1e-3"] == 1.0 and out["tar_at_far_1e-4"] == 1.0


def test_a_tiny_domain_gap_run_reports_each_stage(tmp_path: Path) -> None:
    run = FaceDomainRun(
        size=32,
        width=0.25,
        public_identities=12,
        private_train_identities=8,
        test_identities=6,
        wild=2,
        epochs=1,
        finetune_epochs=1,
        batch_size=16,
        threads=1,
    )
    result = measure_domain_gap(run, progress=False)
    assert result["synthetic_data"] is True and "SYNTHETIC" in result["data"]
    for row in (
        result["pretrained_on_public"]["public_test"],
        result["pretrained_on_public"]["private_test"],
        result["finetuned_on_private"]["private_test"],
    ):
        assert row["genuine_pairs"] == 12 and row["impostor_pairs"] == 60
        assert 0 <= row["tar_at_far_1e-3"] <= 1
    assert sample_grid(tmp_path / "faces.png", identities=2, wild=2, size=32).read_bytes()[:4] == b"\x89PNG"
