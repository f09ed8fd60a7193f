"""Training on a CUDA device gives the CPU's numbers to float32 rounding (``pytest -m gpu``; every test here
is skipped, saying so, where torch sees no CUDA device; ``scripts/gpu-check`` runs them on a GPU machine):
the FedAvg engine (client data moved once), FDML's devices and rounds (the enclave still given host
arrays), FedUV's users, AIoT's pre-training, devices and evaluation, PPFL's REEs and emulated client
TEEs (which seal host arrays), DLG, and ``bench scale`` and ``bench peers``' fedveil rows.

Not bit for bit: cuBLAS and cuDNN pick other kernels than the CPU's (other summation orders, fused
multiply-adds, TF32 where allowed), so each float32 result differs in its last bits, and the differences
grow a little with every step. The tolerances below state how much: ``max |Δw| <= 1e-4 max |w|`` after a
few rounds of SGD. FDML's server steps with Adam, which divides each gradient coordinate by its own
magnitude, so a coordinate whose gradient is almost zero can move by up to ``lr`` either way on the two
paths: its devices' gradients are compared for the same weights, and a whole run by its losses.
The resolver's CPU-side promises (``auto`` is the CPU here, ``cuda`` absent is a named error, misspelt
values are refused) are tested in ``tests/test_device_option.py``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedveil
from fedveil.attacks.dlg import dlg_attack
from fedveil.attacks.inversion import (
    client_gradient_view,
    dummy_gradients,
    gradient_target,
    squared_l2_distance,
)
from fedveil.cli import main
from fedveil.core.attestation_verify import EnclaveClientSession
from fedveil.data.faces import face_devices, synthetic_faces
from fedveil.data.images import synthetic_fashion_mnist
from fedveil.data.mnist_uv import MnistUvConfig, generate_mnist_uv
from fedveil.experiments.aiot.faces_domain import embed_faces, train_faces
from fedveil.experiments.bench.floor import peak_gemm_flops_per_second
from fedveil.experiments.bench.peers import bench_peers
from fedveil.experiments.bench.rounds import bench_rounds
from fedveil.experiments.bench.scale import measure_setting, scale_clients
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import build_clients, build_population
from fedveil.experiments.fedavg_images import split_images
from fedveil.experiments.ppfl.runner import load_ppfl_run, train_ppfl
from fedveil.models.device import module_device
from fedveil.models.faces import MobileFaceNet
from fedveil.models.flat import FlatModel
from fedveil.models.zoo import build_model
from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelClients, ModelServer
from fedveil.protocols.feduv import SoftmaxMethod, SoftmaxServer, UvClients, UvModel, UvTrainConfig
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import BackpropRequest, EmbedRequest, FitRequest
from fedveil.protocols.ppfl import PpflClients
from fedveil.protocols.projector import ProjectorClients, backbone_flat
from fedveil.runtime.simulation import SimulationRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]

REPO = Path(__file__).resolve().parents[1]
RELATIVE = 1e-4
"""``max |Δw| <= RELATIVE * max |w|``: CUDA against CPU after a few rounds (module docstring)."""


def _separable(clients: int = 8, per_client: int = 24) -> fedveil.FederatedDataset:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=clients * per_client)
    x = (rng.normal(size=(len(y), 8)) + 2.0 * y[:, None]).astype(np.float32)
    return fedveil.FederatedDataset(
        fedveil.UserData(f"client{i}", {}, {"x": x[i::clients], "y": y[i::clients]}) for i in range(clients)
    )


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _close(cpu: np.ndarray, cuda: np.ndarray) -> None:
    scale = float(np.max(np.abs(cpu)))
    assert float(np.max(np.abs(cpu - cuda))) <= RELATIVE * scale, (float(np.max(np.abs(cpu - cuda))), scale)


@pytest.mark.parametrize("dp", [{}, {"clip_norm": 1.0, "noise_multiplier": 0.5, "delta": 1e-5}])
def test_fedavg_on_cuda_equals_the_cpu(dp: dict[str, float]) -> None:
    data = _separable()
    kwargs: dict[str, Any] = dict(rounds=4, clients_per_round=4, lr=0.1, batch_size=6, local_epochs=2, seed=3)
    cpu = fedveil.train_fedavg(_mlp(), data, device="cpu", **kwargs, **dp)
    cuda = fedveil.train_fedavg(_mlp(), data, device="cuda", **kwargs, **dp)
    for key, value in cpu.state_dict.items():
        assert cuda.state_dict[key].device.type == "cpu"  # the result is the host's
        _close(value.numpy(), cuda.state_dict[key].numpy())
    for a, b in zip(cpu.history, cuda.history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


@pytest.mark.parametrize("batched", [True, False])
def test_client_data_moves_to_the_device_once(batched: bool) -> None:
    flat = FlatModel(_mlp())
    pool = ModelClients(
        flat, _separable(), optimizer=LocalOptimizer(lr=0.1), seed=0, batched=batched, device="cuda"
    )
    assert next(flat.module.parameters()).device.type == "cuda"
    cfg = ImageFedAvgConfig(clients_per_round=8, batch_size=6, eval_every=0)
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(1))
    server = ModelServer(cfg, flat, np.random.default_rng(2))
    server.setup(runtime)
    asyncio.run(server.run_round(1, runtime))
    first = {cid: (x.data_ptr(), y.data_ptr()) for cid, (x, y) in pool._cache.items()}
    assert len(first) == 8 and all(x.is_cuda and y.is_cuda for x, y in pool._cache.values())
    asyncio.run(server.run_round(2, runtime))
    assert {cid: (x.data_ptr(), y.data_ptr()) for cid, (x, y) in pool._cache.items()} == first
    assert isinstance(server.weights, np.ndarray)


def _tiny_fdml(device: str) -> Any:
    return load_config(
        REPO / "configs/table1_fdml.yaml",
        [
            "data.train_users_per_model=[24,24,24,24]",
            "data.test_users_per_model=[6,6,6,6]",
            "fdml.num_required=16",
            f"device={device}",
        ],
    )


def test_fdml_devices_gradients_on_cuda_equal_the_cpus() -> None:
    cfg = _tiny_fdml("cuda")
    population = build_population(cfg)
    cuda = build_clients(cfg, population)
    cpu = build_clients(replace(cfg, device="cpu"), population)
    assert next(cuda.flat.module.parameters()).is_cuda
    ids = cpu.client_ids()[:8]
    request = EmbedRequest(1, 1, 8, cpu.flat.initial())
    e_cpu, e_cuda = (
        cpu.handle_batch(dict.fromkeys(ids, request)),
        cuda.handle_batch(dict.fromkeys(ids, request)),
    )
    rng = np.random.default_rng(1)
    back = {c: BackpropRequest(1, 1, rng.normal(size=(8, 64)).astype(np.float32)) for c in ids}
    g_cpu, g_cuda = cpu.handle_batch(back), cuda.handle_batch(back)
    for c in ids:
        assert isinstance(e_cuda[c].embeddings, np.ndarray) and isinstance(g_cuda[c].gradient, np.ndarray)
        _close(e_cpu[c].embeddings, e_cuda[c].embeddings)
        _close(g_cpu[c].gradient, g_cuda[c].gradient)


def test_fdml_rounds_on_cuda_follow_the_cpus_and_the_enclave_gets_host_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[type] = []
    for name in ("seal_embeddings", "seal_gradient"):
        original = getattr(EnclaveClientSession, name)

        def spy(self: Any, rnd: int, value: Any, *a: Any, original: Any = original, **k: Any) -> Any:
            seen.extend(type(v) for v in (value if isinstance(value, tuple) else (value,)))
            return original(self, rnd, value, *a, **k)

        monkeypatch.setattr(EnclaveClientSession, name, spy)
    losses = {}
    for device in ("cpu", "cuda"):
        sets = [
            "rounds=3",
            "eval.every=0",
            "data.train_users_per_model=[24,24,24,24]",
            "data.test_users_per_model=[6,6,6,6]",
            "fdml.num_required=16",
        ]
        out = tmp_path / device
        argv = ["run", str(REPO / "configs/table1_fdml.yaml"), "--out", str(out), "--no-progress"]
        assert main([*argv, *[a for s in sets for a in ("--set", s)], "--device", device]) == 0
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[device] = [line["loss"] for line in lines if "loss" in line]
    assert seen and set(seen) == {np.ndarray}
    assert len(losses["cpu"]) == 3
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)
    # the run records the GPU as resolved: ``auto`` resumes it, the CPU is refused naming both
    gpu = f"cuda:{torch.cuda.current_device()}"
    assert json.loads((tmp_path / "cuda" / "device.json").read_text()) == {"device": gpu}
    again = ["run", str(REPO / "configs/table1_fdml.yaml"), "--out", str(tmp_path / "cuda"), "--no-progress"]
    again += [a for s in sets for a in ("--set", s)]
    assert main([*again, "--resume"]) == 0
    capsys.readouterr()
    assert main([*again, "--resume", "--device", "cpu"]) == 2
    assert (
        f"computed on {gpu}, and this run is on cpu: resume it with --device {gpu}" in capsys.readouterr().err
    )


def test_dlg_on_cuda_poses_and_starts_the_cpus_problem() -> None:
    """DLG's L-BFGS amplifies the last-bit differences of CUDA's kernels step by step (a line search free
    quasi-Newton method on a non-convex objective), so the attack is compared where the paths must agree:
    the observed gradients, the objective at the seeded start (tightly), and a two-iteration run
    (``1e-2`` relative on its best objective); its result is in host memory."""

    data = synthetic_fashion_mnist(1, seed=0)
    net = build_model("lenet-sigmoid", num_classes=10, in_channels=1, image_size=28, seed=0)
    view = client_gradient_view(net, torch.from_numpy(data.x[:1]), torch.from_numpy(data.y[:1]))
    targets = {d: gradient_target(view, "DLG", image_shape=(1, 28, 28), device=d) for d in ("cpu", "cuda")}
    assert all(g.is_cuda for g in targets["cuda"].observed)
    for a, b in zip(targets["cpu"].observed, targets["cuda"].observed, strict=True):
        _close(a.numpy(), b.cpu().numpy())
    start = torch.rand((1, 1, 28, 28), generator=torch.Generator().manual_seed(0))
    label = torch.softmax(torch.randn((1, 10), generator=torch.Generator().manual_seed(1)), dim=-1)
    objective = {
        d: float(squared_l2_distance(dummy_gradients(t, start.to(d), label.to(d)), t.observed))
        for d, t in targets.items()
    }
    assert objective["cuda"] == pytest.approx(objective["cpu"], rel=1e-4)
    runs = {
        d: dlg_attack(view, image_shape=(1, 28, 28), iterations=2, seed=0, device=d) for d in ("cpu", "cuda")
    }
    assert runs["cuda"].images.device.type == "cpu" and runs["cuda"].labels.device.type == "cpu"
    assert runs["cuda"].final_loss == pytest.approx(runs["cpu"].final_loss, rel=1e-2)


def test_aiot_devices_fine_tune_on_cuda_as_on_the_cpu() -> None:
    faces, _ = synthetic_faces(8, 3, size=32, seed=0)
    replies = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        backbone = MobileFaceNet(image_size=32, width=0.25)
        request = FitRequest(1, 0.01, 2, 4, backbone_flat(backbone).initial())
        pool = ProjectorClients(
            backbone,
            face_devices(faces, 4),
            embedding_dim=backbone.embedding_dim,
            optimizer=LocalOptimizer(lr=0.01, momentum=0.9),
            seed=0,
            device=device,
        )
        replies[device] = pool.handle_batch(dict.fromkeys(pool.client_ids(), request))
        assert all(x.device.type == device for x, _ in pool._cache.values())
    for cid, reply in replies["cpu"].items():
        assert isinstance(replies["cuda"][cid].weights, np.ndarray)
        _close(reply.weights, replies["cuda"][cid].weights)
        assert replies["cuda"][cid].loss == pytest.approx(reply.loss, rel=1e-4)


class _UvNet(torch.nn.Module):
    """A small net of the FedUV interface (``features`` then ``fc``)."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.AvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(196, 16), torch.nn.Tanh()
        )
        self.fc = torch.nn.Linear(16, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


@pytest.mark.parametrize("batched", [True, False])
def test_feduv_users_train_on_cuda_as_on_the_cpu(batched: bool) -> None:
    data = generate_mnist_uv(
        MnistUvConfig(
            seed=7, writers=6, train=5, val=4, test=3, unseen_writers=3, sub_images_per_digit=(2, 2, 2)
        )
    )
    weights = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = UvModel(_UvNet(len(data.train)))
        server = SoftmaxServer(
            UvTrainConfig(fraction=0.5, local_epochs=2, batch_size=3), model, np.random.default_rng(1)
        )
        pool = UvClients(SoftmaxMethod(), model, data, seed=5, batched=batched, device=device)
        runtime = SimulationRuntime(pool, rng=np.random.default_rng(2))

        async def go(server: Any = server, runtime: Any = runtime) -> None:
            await server.setup(runtime)
            for rnd in (1, 2, 3):
                await server.run_round(rnd, runtime)

        asyncio.run(go())
        assert all(x.device.type == device for x in pool._train_x.values())
        weights[device] = server.weights
    _close(weights["cpu"], weights["cuda"])


@pytest.mark.parametrize("batched", [True, False])
def test_ppfl_rees_and_tees_on_cuda_release_the_cpus_layers(
    batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The REEs' frozen layers and the emulated TEEs' training on cuda (the cohort's vectorised step, or
    each TEE's own): the released layers are the CPU's, each TEE seals host arrays."""
    monkeypatch.setattr(PpflClients, "_batched", lambda self, stage: batched)
    sealed: list[type] = []
    original = EnclaveClientSession.seal_update

    def spy(self: Any, rnd: int, values: Any, *a: Any, **k: Any) -> Any:
        sealed.append(type(values))
        return original(self, rnd, values, *a, **k)

    monkeypatch.setattr(EnclaveClientSession, "seal_update", spy)
    released = {}
    for device in ("cpu", "cuda"):
        overrides = {
            "clients": 4,
            "samples_per_client": 20,
            "test_samples": 40,
            "e2e": False,
            "ppfl": {"rounds_per_stage": 1, "clients_per_round": 2, "local_epochs": 1},
            "device": device,
        }
        run = load_ppfl_run(REPO / "configs/ppfl/quick.yaml", overrides)
        pool = train_ppfl(run, split_images(run.images())).pool
        cid = pool.client_ids()[0]
        if device == "cuda":
            assert pool._on_device[cid] and all(
                p.is_cuda for unit in pool._on_device[cid] for p in unit.parameters()
            )
            assert all(tee.device.type == "cuda" for tee in pool.tees.values())
            assert all(module_device(pool.net(s)).type == "cuda" for s in range(len(pool.stages)))
        assert all(not p.is_cuda for unit in pool.frozen[cid] for p in unit.parameters())
        released[device] = torch.cat([p.flatten() for unit in pool.frozen[cid] for p in unit.parameters()])
    _close(released["cpu"].numpy(), released["cuda"].numpy())
    assert sealed and set(sealed) == {np.ndarray}


def test_aiot_pre_training_and_evaluation_on_cuda_follow_the_cpus() -> None:
    """Pre-training (:func:`train_faces`: Adam, which moves every coordinate by about ``lr`` a step
    whatever its gradient, so at ``lr`` 1e-5 for 3 steps the paths stay within the tolerance) from the
    same start, then the evaluation's embeddings of one network on each device."""
    faces, _ = synthetic_faces(8, 2, size=32, seed=0)
    trained = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = MobileFaceNet(image_size=32, width=0.25)
        train_faces(model, faces, epochs=1, lr=1e-5, batch_size=8, seed=0, progress=False, device=device)
        assert module_device(model).type == device
        trained[device] = torch.cat(
            [v.detach().float().reshape(-1).cpu() for v in model.state_dict().values()]
        )
    _close(trained["cpu"].numpy(), trained["cuda"].numpy())
    torch.manual_seed(0)
    model = MobileFaceNet(image_size=32, width=0.25)
    on_cpu = embed_faces(model, faces.x)
    on_cuda = embed_faces(model.to("cuda"), faces.x)
    assert isinstance(on_cuda, np.ndarray)
    _close(on_cpu, on_cuda)


@pytest.mark.usefixtures("small_fashion_mnist")  # bench scale's data set: 1,200 + 200 images
def test_bench_scale_clients_train_on_cuda_as_on_the_cpu() -> None:
    pool = scale_clients(20, 5, seed=0, device="cuda")
    assert next(pool.flat.module.parameters()).is_cuda
    setting: dict[str, Any] = dict(clients=20, per_round=4, rounds=2, samples=5, actors=0, seed=0, threads=1)
    rows = {d: measure_setting(**setting, device=d) for d in ("cpu", "cuda")}
    assert rows["cuda"]["device"] == "cuda" and rows["cpu"]["device"] == "cpu"
    assert rows["cuda"]["accuracy"] == pytest.approx(rows["cpu"]["accuracy"], abs=0.02)  # 4 of 200 images


@pytest.mark.usefixtures("small_fashion_mnist")
def test_bench_peers_fedveil_row_on_cuda(tmp_path: Path) -> None:
    result = bench_peers(
        frameworks=["fedveil"],
        cohorts=[4],
        rounds=1,
        clients=20,
        samples=5,
        threads=1,
        out=tmp_path,
        device="cuda",
    )
    (row,) = result["rows"]
    assert row["device"] == "cuda" and row["framework"] == "fedveil" and 0 <= row["accuracy"] <= 1
    # held to the GPU's floor: its peak per second of wall time, over the round's wall seconds
    assert "cuda" in row["floor_basis"] and 0 < row["fraction_of_floor"] <= 1.5
    expected = row["flops_per_round"] / row["peak_gemm_flops_per_second"] / row["seconds_per_round"]
    assert row["fraction_of_floor"] == pytest.approx(expected, rel=1e-9)


def test_bench_rounds_on_cuda_is_held_to_the_gpus_floor() -> None:
    """FDML rounds on the GPU: the floor's peak GEMM is the GPU's (above the CPU's), and every message
    crosses between host memory (codec, enclave) and the GPU at the copy rates measured each way."""
    row = bench_rounds(
        rounds=2,
        repeats=1,
        warmup=1,
        threads=1,
        overrides=(
            "device=cuda",
            "fdml.num_required=8",
            "data.train_users_per_model=[10,10,10,10]",
            "data.test_users_per_model=[2,2,2,2]",
        ),
    )
    assert row["peak_gemm_gflops"] > peak_gemm_flops_per_second(1) / 1e9
    assert row["host_to_device_bytes_per_round"] == row["bytes_down_coded_per_round"]
    assert row["device_to_host_bytes_per_round"] == row["bytes_up_per_round"]
    assert row["host_to_device_bytes_per_second"] > 0 and row["device_to_host_bytes_per_second"] > 0
    assert 0 < row["fraction_of_floor"] <= 1.5
