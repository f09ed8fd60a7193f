"""``fedveil aiot faces``: how hard the synthetic face population is.

A server pre-trains MobileFaceNet with an ArcFace head on the **public** domain
(:func:`~fedveil.data.faces.synthetic_faces`), as the AIoT paper pre-trains on MS-Celeb-1M; the model is
evaluated on held-out identities of the **private** domain (and of the public one, for reference), then
fine-tuned centrally on the private domain's training identities with a fresh ArcFace head and evaluated
again. Centrally BatchNorm's statistics adapt to the new domain (freezing them, as AIoT Sec. 4.1 does
for federated fine-tuning on small non-IID device batches, left the private TAR at FAR 1e-3 at 0.065
against 0.28 in a trial with an earlier colour model of the population). The gap between the two
private-domain figures is the room federated fine-tuning has to close (the paper: 64.3% -> 73.6% TAR at
FAR 1e-3).

Verification (AIoT Sec. 5.3): each held-out identity's reference photo against every wild photo, cosine
similarity of the L2-normalised embeddings; genuine pairs are the identity's own wild photos, impostor
pairs every other identity's; TAR at FAR 1e-3 and 1e-4 by :func:`~fedveil.eval.verification.tpr_at_fpr`
(with ``identities x (identities - 1) x wild`` impostor pairs: 39,600 for 100 identities x 4 wild photos,
enough to resolve 1e-4). ArcFace models generalise to unseen identities only when trained on many: in
a trial with an earlier colour model, 150 public identities left the held-out TAR below 0.1, 800 above 0.5.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from fedveil.data.faces import FaceImages, synthetic_faces
from fedveil.errors import ConfigError
from fedveil.eval.verification import tpr_at_fpr
from fedveil.models.device import check_device_spec, module_device, resolve_device
from fedveil.models.faces import ArcFace, MobileFaceNet

__all__ = ["FaceDomainRun", "embed_faces", "measure_domain_gap", "train_faces", "verification"]

FARS = (1e-3, 1e-4)


@dataclass(frozen=True)
class FaceDomainRun:
    """Sizes of the measurement (module docstring); the defaults run in a few minutes on 2 cores, at a
    reduced MobileFaceNet (``size`` 64, ``width`` 0.5) that every result names. ``device``
    (:func:`~fedveil.models.device.resolve_device`): where the model trains and embeds the photos."""

    size: int = 64
    width: float = 0.5
    public_identities: int = 800
    private_train_identities: int = 400
    test_identities: int = 100
    wild: int = 4
    epochs: int = 8
    finetune_epochs: int = 8
    batch_size: int = 64
    lr: float = 3e-3
    finetune_lr: float = 3e-3
    seed: int = 0
    threads: int = 2
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        for name in (
            "public_identities",
            "private_train_identities",
            "test_identities",
            "wild",
            "batch_size",
        ):
            if getattr(self, name) < 2:
                raise ConfigError(f"{name} {getattr(self, name)} must be >= 2")
        if self.epochs < 1 or self.finetune_epochs < 0:
            raise ConfigError(
                f"epochs {self.epochs} must be >= 1 and finetune_epochs {self.finetune_epochs} >= 0"
            )


def embed_faces(model: nn.Module, x: np.ndarray, *, batch: int = 256, normalise: bool = True) -> np.ndarray:
    """Embeddings of ``x`` ``(n, 3, S, S)`` with ``model`` in eval mode, L2-normalised unless
    ``normalise=False`` (AIoT Eq. 5 compares raw embeddings), in host memory. They are computed where
    ``model``'s parameters are (:func:`~fedveil.models.device.module_device`): each batch of ``batch``
    photos moves there, and its embeddings come back."""
    device = module_device(model)
    model.eval()
    out = []
    with torch.no_grad():
        for s in range(0, len(x), batch):
            e = model(torch.from_numpy(x[s : s + batch]).to(device))
            out.append((nn.functional.normalize(e) if normalise else e).cpu().numpy())
    return np.concatenate(out)


def verification(model: nn.Module, faces: FaceImages, reference: np.ndarray) -> dict[str, Any]:
    """TAR at FAR 1e-3 and 1e-4 of reference-vs-wild pairs (module docstring)."""
    e = embed_faces(model, faces.x)
    ref_id, wild_id = faces.identity[reference], faces.identity[~reference]
    scores = e[reference] @ e[~reference].T
    same = ref_id[:, None] == wild_id[None]
    genuine, impostor = scores[same], scores[~same]
    tar = tpr_at_fpr(genuine, impostor, FARS)
    return {
        "tar_at_far_1e-3": float(tar[0]),
        "tar_at_far_1e-4": float(tar[1]),
        "genuine_pairs": int(genuine.size),
        "impostor_pairs": int(impostor.size),
    }


def train_faces(
    model: MobileFaceNet,
    faces: FaceImages,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    freeze_bn: bool = False,
    desc: str = "train",
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> ArcFace:
    """Central training of ``model`` with a fresh ArcFace head (scale 64, margin 0.5) over ``faces``'
    identities (Adam, the rate decayed on a cosine to 0); ``freeze_bn`` keeps BatchNorm's statistics
    (AIoT Sec. 4.1). Returns the head.

    ``device`` (:func:`~fedveil.models.device.resolve_device`): ``model`` moves there (and stays, as
    :meth:`torch.nn.Module.to` leaves it), the head is made there and the photos move there once; the
    batch order is drawn on the CPU from ``seed``, so every device sees the same batches."""
    where = resolve_device(device)
    model.to(where)
    gen = torch.Generator().manual_seed(seed)
    head = ArcFace(model.embedding_dim, len(faces.names)).to(where)
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    steps = epochs * -(-len(faces) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, steps))
    x, y = torch.from_numpy(faces.x).to(where), torch.from_numpy(faces.identity).to(where)
    bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress)
    for _ in range(epochs):
        model.train()
        if freeze_bn:
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        order = torch.randperm(len(y), generator=gen).to(where)
        for s in range(0, len(y), batch_size):
            idx = order[s : s + batch_size]
            if len(idx) < 2:
                continue
            loss = nn.functional.cross_entropy(head(model(x[idx]), y[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.2f}")
    bar.close()
    return head


def measure_domain_gap(run: FaceDomainRun, *, progress: bool = True) -> dict[str, Any]:
    """Pre-train on public, evaluate on private, fine-tune on private, evaluate again (module docstring),
    on ``run.device``."""
    device = resolve_device(run.device)
    torch.set_num_threads(run.threads)
    torch.manual_seed(run.seed)
    start = time.perf_counter()
    n_pub, n_train, n_test = run.public_identities, run.private_train_identities, run.test_identities
    public, _ = synthetic_faces(n_pub, run.wild, domain="public", size=run.size, seed=run.seed)
    public_test, public_ref = synthetic_faces(
        n_test, run.wild, domain="public", size=run.size, seed=run.seed, first_identity=n_pub
    )
    private, _ = synthetic_faces(n_train, run.wild, domain="private", size=run.size, seed=run.seed)
    private_test, private_ref = synthetic_faces(
        n_test, run.wild, domain="private", size=run.size, seed=run.seed, first_identity=n_train
    )
    model = MobileFaceNet(image_size=run.size, width=run.width)
    train_faces(
        model,
        public,
        epochs=run.epochs,
        lr=run.lr,
        batch_size=run.batch_size,
        seed=run.seed,
        desc="pre-train (public)",
        progress=progress,
        device=device,
    )
    pre_public = verification(model, public_test, public_ref)
    pre_private = verification(model, private_test, private_ref)
    train_faces(
        model,
        private,
        epochs=run.finetune_epochs,
        lr=run.finetune_lr,
        batch_size=run.batch_size,
        seed=run.seed + 1,
        desc="fine-tune (private)",
        progress=progress,
        device=device,
    )
    post_private = verification(model, private_test, private_ref)
    return {
        "run": asdict(run),
        "data": private.source + "; " + public.source,
        "synthetic_data": True,
        "model": f"mobilefacenet (image_size {run.size}, width {run.width})",
        "parameters": sum(p.numel() for p in model.parameters()),
        "pretrained_on_public": {"public_test": pre_public, "private_test": pre_private},
        "finetuned_on_private": {"private_test": post_private},
        "seconds": time.perf_counter() - start,
    }
