"""Where the ``device`` setting reaches beyond training, on a CUDA device (``pytest -m gpu``; every test here
is skipped, saying so, where torch sees no CUDA device): FDML's evaluation runs on the run's GPU and gives
the CPU's numbers; a GPU's name is ``cuda:N`` in every record.

Not bit for bit: cuBLAS and cuDNN pick other kernels than the CPU's, so each float32 embedding differs in
its last bits (tests/test_gpu.py): within ``RELATIVE`` (``max |Δe| <= 1e-4 max |e|``) for one forward pass
of the same weights. The Sec. VII-C metrics threshold distances between those embeddings, so a pair whose
distance sits at the threshold can fall on the other side: accuracy is held within ``ACCURACY_POINTS``
percentage points and EER and AUC within ``RATE_TOLERANCE``. The CPU-side promises (the same bits as
before on the CPU, each batch fed where the network is) are tested in tests/test_device_gaps.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fedveil.experiments.config import load_config
from fedveil.experiments.fdml import central, runner
from fedveil.models.device import module_device, resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet
from test_device_gaps import SMALL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]

RELATIVE = 1e-4
"""``max |Δe| <= RELATIVE * max |e|``: one forward pass on CUDA against the CPU (module docstring)."""
ACCURACY_POINTS = 1.0
RATE_TOLERANCE = 0.01


def _close(cpu: np.ndarray, cuda: np.ndarray) -> None:
    scale = float(np.max(np.abs(cpu)))
    assert float(np.max(np.abs(cpu - cuda))) <= RELATIVE * scale, (float(np.max(np.abs(cpu - cuda))), scale)


def test_fdml_evaluation_on_cuda_equals_the_cpus(toy_population: Any) -> None:
    cfg = load_config(None, ["protocol=fdml", "rounds=1", "device=cuda", *SMALL])
    trainer = runner.build_trainer(cfg, toy_population)
    trainer.close()
    assert str(trainer.device) == f"cuda:{torch.cuda.current_device()}"
    assert module_device(trainer.embed_flat.module) == trainer.device
    weights = trainer.embedding_weights()
    _, samples = toy_population.test_samples()
    on_cuda = runner.embed_samples(trainer.embed_flat, weights, samples, batch=7)
    torch.manual_seed(0)
    on_host = FlatModel(TouchAuthNet(runner.EMBEDDING_DIM))
    on_cpu = runner.embed_samples(on_host, weights, samples, batch=7, device="cpu")
    assert isinstance(on_cuda, np.ndarray) and on_cuda.shape == on_cpu.shape
    _close(on_cpu, on_cuda)
    cuda_metrics, _ = runner.evaluate(trainer, toy_population, cfg.eval.seed)
    cpu_metrics, _ = runner.evaluate_weights(on_host, weights, toy_population, cfg.eval.seed, device="cpu")
    assert abs(cuda_metrics["accuracy_percent"] - cpu_metrics["accuracy_percent"]) <= ACCURACY_POINTS
    for key in ("eer", "auc"):
        assert abs(cuda_metrics[key] - cpu_metrics[key]) <= RATE_TOLERANCE, key


def test_central_evaluation_of_a_net_on_cuda_equals_the_cpus() -> None:
    torch.manual_seed(0)
    net = TouchAuthNet().eval()
    samples = np.random.default_rng(0).normal(size=(4, 6, 30, 10)).astype(np.float32)
    on_cpu = central.embed_samples(net, samples, batch=5)
    on_cuda = central.embed_samples(net.to("cuda"), samples, batch=5)
    assert isinstance(on_cuda, np.ndarray)
    _close(on_cpu, on_cuda)


@pytest.mark.parametrize("spec", ["cuda", "auto", "cuda:0"])
def test_a_resolved_gpu_is_named_as_its_tensors_name_it(spec: str) -> None:
    where = resolve_device(spec)
    index = 0 if spec == "cuda:0" else torch.cuda.current_device()
    assert str(where) == f"cuda:{index}" == str(torch.zeros(1, device=where).device)


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3)).eval()


def test_membership_statistics_of_candidates_on_cuda_equal_the_hosts() -> None:
    """Candidates and their labels handed over on the GPU: the labels come to the host beside the logits
    (no mixed-device gather), LiRA's cache fingerprint reads them back, and every statistic is the host's
    within float32 rounding (LiRA's margin of the same logits is the same float64 arithmetic: equal)."""
    from fedveil.attacks import lira
    from fedveil.attacks.mia_nasr import nasr_features
    from fedveil.attacks.mia_yeom import per_example_loss
    from fedveil.attacks.scores import as_examples

    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(40, 1, 4, 4)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, size=40))
    net = _classifier()
    on_gpu = _classifier().to("cuda")
    xc, yc = x.to("cuda"), y.to("cuda")
    assert as_examples(xc, yc)[1].device.type == "cpu"
    assert lira._fingerprint(xc, yc, 2) == lira._fingerprint(x, y, 2)
    logits = torch.from_numpy(rng.normal(size=(40, 3)).astype(np.float32))
    assert np.array_equal(lira.logit_margin(logits.to("cuda"), yc), lira.logit_margin(logits, y))
    _close(lira.logit_confidence(net, x, y), lira.logit_confidence(on_gpu, xc, yc))
    _close(per_example_loss(net, x, y), per_example_loss(on_gpu, xc, yc))
    cpu_features, names = nasr_features([net], x, y)
    gpu_features, gpu_names = nasr_features([on_gpu], xc, yc)
    assert names == gpu_names
    _close(cpu_features, gpu_features)


def test_reconstruction_metrics_and_grid_of_images_on_cuda_are_the_hosts(tmp_path: Any) -> None:
    from fedveil.attacks.image_metrics import match_permutation, reconstruction_metrics
    from fedveil.attacks.inversion import InversionResult, save_inversion_grid

    rng = np.random.default_rng(1)
    original = torch.from_numpy(rng.uniform(size=(3, 1, 8, 8)).astype(np.float32))
    rebuilt = original[[2, 0, 1]] + 0.01
    assert match_permutation(original.to("cuda"), rebuilt.to("cuda")).tolist() == [1, 2, 0]
    on_host = reconstruction_metrics(original, rebuilt)
    assert reconstruction_metrics(original.to("cuda"), rebuilt) == on_host
    assert reconstruction_metrics(original.to("cuda"), rebuilt.to("cuda")) == on_host
    result = InversionResult(
        attack="dlg",
        images=rebuilt,
        labels=torch.zeros(3, dtype=torch.int64),
        history=[(0, rebuilt)],
        losses=[0.0],
        final_loss=0.0,
        seconds=1.0,
        iterations=1,
        restarts=1,
        evaluations=1,
        label_source="given",
    )
    path = save_inversion_grid(tmp_path / "grid.png", original.to("cuda"), result)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
