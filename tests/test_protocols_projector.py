"""The AIoT private-projector protocol: a spy over a whole run (no projector bytes on the wire, in any
float encoding), frozen BatchNorm statistics bit-identical, Eq. 7's warm-up schedule as the devices use
it, Eq. 5's inference, and the bad inputs the issue lists."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch
from torch import nn

from fedveil.core.codec import decode
from fedveil.data.faces import face_devices, synthetic_faces
from fedveil.errors import ConfigError
from fedveil.models.faces import ArcFace, MobileFaceNet
from fedveil.models.flat import FlatModel
from fedveil.protocols import projector as projector_module
from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
from fedveil.protocols.local import LocalOptimizer, local_train
from fedveil.protocols.messages import FitReply, FitRequest
from fedveil.protocols.projector import (
    ProjectorClients,
    ProjectorSettings,
    backbone_flat,
    backbone_plan,
    identify,
    warmup_rates,
)
from fedveil.runtime.simulation import SimulationRuntime

OPT = LocalOptimizer(lr=0.01, momentum=0.9)


def _setup(
    settings: ProjectorSettings, *, identities: int = 12, per_device: int = 3, tap=None, seed: int = 0
):
    torch.manual_seed(seed)
    faces, _ = synthetic_faces(identities, 2, size=32, seed=seed)
    data = face_devices(faces, per_device)
    backbone = MobileFaceNet(image_size=32, width=0.25)
    flat = backbone_flat(backbone)
    plan = backbone_plan(flat, freeze_bn=settings.freeze_bn)
    initial = flat.initial()
    pool = ProjectorClients(
        backbone, data, embedding_dim=backbone.embedding_dim, optimizer=OPT, seed=seed, settings=settings
    )
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(seed), tap=tap)
    cfg = ImageFedAvgConfig(clients_per_round=3, local_epochs=1, batch_size=4, optimizer=OPT, eval_every=0)
    server = ModelServer(cfg, flat, np.random.default_rng(seed + 1), plan=plan, initial=initial)
    server.setup(runtime)
    return server, pool, runtime, flat, initial


def _rounds(server, runtime, rounds: int, after=None) -> None:
    async def go() -> None:
        for rnd in range(1, rounds + 1):
            await server.run_round(rnd, runtime)
            if after is not None:
                after()

    asyncio.run(go())


def _encodings(values: np.ndarray) -> list[bytes]:
    """Windows of 4 consecutive values in every float encoding a leak might use."""
    out = []
    flat = values.reshape(-1)
    for start in range(0, flat.size - 4, 97):
        window = flat[start : start + 4]
        for dtype in ("<f4", ">f4", "<f8", ">f8", "<f2"):
            out.append(window.astype(dtype).tobytes())
    return out


def test_projectors_never_reach_the_wire() -> None:
    wire: list[tuple[str, bytes]] = []
    settings = ProjectorSettings()
    server, pool, runtime, flat, initial = _setup(settings, tap=lambda d, data: wire.append((d, bytes(data))))
    snapshots = {cid: [pool.projector_weights(cid)] for cid in pool.client_ids()}

    def keep() -> None:
        for cid in pool.client_ids():
            snapshots[cid].append(pool.projector_weights(cid))

    _rounds(server, runtime, 4, keep)
    trained = [c for c, s in snapshots.items() if not np.array_equal(s[0], s[-1])]
    assert trained, "some device must have trained its projector"
    haystack = b"".join(data for _, data in wire)
    assert any(d == "from_client" for d, _ in wire) and any(d == "to_client" for d, _ in wire)
    for cid, states in snapshots.items():
        for state in states:
            for needle in _encodings(state):
                assert needle not in haystack, f"projector bytes of {cid} on the wire"
    # Only f_theta1 travels: requests carry the backbone (with its BatchNorm statistics), replies its weights.
    for _, data in wire:
        msg = decode(data)
        if isinstance(msg, FitRequest):
            assert msg.weights.size == flat.num_params
        elif isinstance(msg, FitReply):
            assert msg.weights.size == pool.num_weights < flat.num_params
    # The search finds what is there: the backbone's weights sent in round 1 are on the wire.
    assert initial[1000:1004].tobytes() in haystack


def test_frozen_batchnorm_statistics_are_bit_identical() -> None:
    server, pool, runtime, _, initial = _setup(ProjectorSettings(freeze_bn=True))
    module_stats = {n: b.clone() for n, b in pool.backbone.named_buffers()}
    _rounds(server, runtime, 3)
    final = server.full_weights()
    weights, stats = slice(0, pool.num_weights), slice(pool.num_weights, None)
    assert final[stats].tobytes() == initial[stats].tobytes()
    assert not np.array_equal(final[weights], initial[weights])
    for name, buffer in pool.backbone.named_buffers():
        assert torch.equal(buffer, module_stats[name]), name


def test_unfrozen_batchnorm_statistics_are_updated_and_averaged() -> None:
    server, pool, runtime, flat, initial = _setup(ProjectorSettings(freeze_bn=False))
    _rounds(server, runtime, 2)
    final = server.full_weights()
    stats = slice(pool.num_weights, None)
    assert not np.array_equal(final[stats], initial[stats])
    running_var = [n for n in flat.buffer_names if n.endswith("running_var")]
    assert running_var and all(
        np.all(flat.unflatten(torch.from_numpy(final))[n].numpy() > 0) for n in running_var
    )


def test_warmup_schedule_is_eq7_and_spans_rounds(monkeypatch) -> None:
    assert warmup_rates(0.1, 0, 3, 4) == pytest.approx([0.025, 0.05, 0.075])
    assert warmup_rates(0.1, 3, 3, 4) == pytest.approx([0.1, 0.1, 0.1])
    assert warmup_rates(0.1, 0, 2, 0) == [0.1, 0.1]
    seen: dict[int, list[float]] = {}
    real = projector_module.local_train

    def spy(objective, p0, batches, opt, rates, **kw):  # type: ignore[no-untyped-def]
        seen.setdefault(len(seen), list(rates))
        return real(objective, p0, batches, opt, rates, **kw)

    monkeypatch.setattr(projector_module, "local_train", spy)
    server, pool, runtime, _, _ = _setup(ProjectorSettings(warmup_batches=3), identities=6, per_device=3)
    server.cfg = ImageFedAvgConfig(clients_per_round=1, batch_size=4, optimizer=OPT, eval_every=0)
    server.members = server.members[:1]
    _rounds(server, runtime, 2)
    # One device, 3 identities x 3 photos = 9 photos in batches of 4: 4, 4, 1 (a lone photo is dropped).
    assert seen[0] == pytest.approx([0.01 / 3, 0.02 / 3])
    assert seen[1] == pytest.approx([0.01, 0.01])
    assert pool.batches_done[pool.client_ids()[0]] == 4


def test_eager_gradients_equal_torch_func() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.PReLU(3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    flat = FlatModel(model)
    p = torch.from_numpy(flat.initial())
    batches = [(torch.randn(5, 1, 6, 6), torch.tensor([0, 1, 0, 1, 1]))] * 3

    def loss(q, x, y):  # type: ignore[no-untyped-def]
        return nn.functional.cross_entropy(flat(q, x), y)

    a, la = local_train(loss, p.clone(), batches, OPT, 0.1)
    b, lb = local_train(loss, p.clone(), batches, OPT, 0.1, eager=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(la, lb)


def test_flat_model_with_buffers_round_trips() -> None:
    torch.manual_seed(1)
    model = MobileFaceNet(image_size=32, width=0.25)
    with torch.no_grad():
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.uniform_(0.5, 1.5)
    flat = FlatModel(model, buffers=True)
    assert flat.num_params == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers() if b.is_floating_point()
    )
    vector = flat.initial()
    x = torch.rand(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(flat(torch.from_numpy(vector), x), model(x))
    other = FlatModel(MobileFaceNet(image_size=32, width=0.25), buffers=True)
    other.load_into_module(vector)
    np.testing.assert_array_equal(other.initial(), vector)


def test_identify_is_eq5_nearest_reference() -> None:
    gallery = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    probes = np.array([[9.0, 1.0], [1.0, 1.0], [1.0, 8.0]])
    np.testing.assert_array_equal(identify(gallery, np.array([7, 8, 9]), probes), [8, 7, 9])


def test_bad_input(caplog) -> None:
    backbone = nn.Sequential(MobileFaceNet(image_size=32, width=0.25))
    backbone.add_module("head", ArcFace(512, 4))
    with pytest.raises(ConfigError, match=r"head\.weight.*projector"):
        backbone_flat(backbone)
    faces, _ = synthetic_faces(7, 2, size=32)
    data = face_devices(faces, 3)  # the last device holds a single identity
    with caplog.at_level(logging.WARNING):
        pool = ProjectorClients(
            MobileFaceNet(image_size=32, width=0.25), data, embedding_dim=512, optimizer=OPT, seed=0
        )
    assert pool.client_ids() == ["device-0000", "device-0001"]
    assert "device-0002" in pool.excluded and "needs >= 2" in caplog.text
    lone = face_devices(synthetic_faces(2, 2, size=32)[0], 1)
    with pytest.raises(ConfigError, match="two or more identities"):
        ProjectorClients(
            MobileFaceNet(image_size=32, width=0.25), lone, embedding_dim=512, optimizer=OPT, seed=0
        )
    flat = backbone_flat(MobileFaceNet(image_size=32, width=0.25))
    small = FitRequest(1, 0.1, 1, 1, flat.initial())
    wrong = FitRequest(1, 0.1, 1, 4, np.zeros(3, np.float32))
    replies = pool.handle_batch({"device-0000": small, "device-0001": wrong})
    assert "batch_size 1" in str(replies["device-0000"])
    assert "expected" in str(replies["device-0001"])
    with pytest.raises(ConfigError, match="warmup_batches"):
        ProjectorSettings(warmup_batches=-1)
