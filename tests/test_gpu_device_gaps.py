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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]

RELATIVE = 1e-4
"""``max |Δe| <= RELATIVE * max |e|``: one forward pass on CUDA against the CPU (module docstring)."""
ACCURACY_POINTS = 1.0
RATE_TOLERANCE = 0.01

SMALL = [
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "enclave.boundary=none",
]


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
