"""PoliFL on the FedAvg engine (fedveil.protocols.polifl): the trusted library enforces policies on the
right side, filtered sensors never reach training (spy), devices refuse jobs their policy forbids,
DP aggregation has the stated noise and clipping, a stage's model carries the intersection of the
contributing policies, and release runs the budget checks the policy requires."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from fedveil.data.mpu import SENSORS, synthetic_mpu
from fedveil.errors import ConfigError
from fedveil.models.behaviour import EngagementNet, binary_logit_loss
from fedveil.models.flat import FlatModel
from fedveil.privacy.groups import GroupLedger
from fedveil.privacy.pairs import DataPolicyPair, PolicyViolation
from fedveil.privacy.policy import parse, show
from fedveil.protocols.fedavg import ClipAndNoise, FitResult, ImageFedAvgConfig, ModelServer
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.polifl import (
    DPAggregate,
    PolicyDevices,
    PolicyGroup,
    accumulate,
    average,
    enforce_budget,
    filter_sensors,
    get_data,
    in_geofence_cond,
    prepare_pair,
    release_model,
    run_stage,
    stage_of,
    start_pair,
    train_local,
)
from fedveil.runtime.simulation import SimulationRuntime

ALL = "get_data(data_type='MPU') . runFL . check_privacy_budget(max_eps=5) . return"
NOMIC = (
    "get_data(data_type='MPU') . filter(sensors=['mic','loc']) . runFL"
    " . check_privacy_budget(max_eps=2) . return"
)
MIC, LOC = SENSORS.index("mic"), SENSORS.index("loc")


def _value(seed: int = 0, n: int = 12) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 3, len(SENSORS))).astype(np.float32),
        "y": rng.integers(0, 2, n),
        "sensor_columns": SENSORS,
    }


def test_filter_zeroes_the_named_sensors_only_when_the_policy_allows_it() -> None:
    value = _value()
    pair = get_data(DataPolicyPair(value, parse(NOMIC)), data_type="MPU")
    out = filter_sensors(pair, ["loc", "mic"])._value()
    assert not out["x"][..., [MIC, LOC]].any()
    keep = [i for i in range(len(SENSORS)) if i not in (MIC, LOC)]
    np.testing.assert_array_equal(out["x"][..., keep], value["x"][..., keep])
    with pytest.raises(PolicyViolation, match=r"filter\(sensors=\['mic'\]\) is not allowed"):
        filter_sensors(pair, ["mic"])
    plain = get_data(DataPolicyPair(value, parse(ALL)), data_type="MPU")
    with pytest.raises(PolicyViolation, match="would accept: runFL"):
        filter_sensors(plain, ["mic", "loc"])


def test_geofence_keeps_the_examples_inside() -> None:
    value = {"x": np.arange(4.0), "y": np.arange(4), "location": np.array([[0, 0], [1, 1], [5, 5], [2, 0.5]])}
    pair = DataPolicyPair(value, parse("in_geofence_cond . runFL"))
    out = in_geofence_cond(pair, 0, 0, 2, 1)._value()
    assert out["x"].tolist() == [0.0, 1.0, 3.0]
    with pytest.raises(ConfigError, match="lat0 <= lat1"):
        in_geofence_cond(pair, 3, 0, 2, 1)


def test_library_functions_combine_policies_and_refuse_on_the_wrong_side() -> None:
    fl = parse("get_data . train_local . accumulate* . (train_local . accumulate* + average*) . return")
    data = get_data(DataPolicyPair(np.ones(3), fl))
    model = start_pair(np.zeros(3))
    local = train_local(model, data, lambda g, d: g + d)
    assert show(local.policy) == "accumulate* . (average* + train_local . accumulate*) . return"
    total = accumulate(local, DataPolicyPair(np.zeros(3), local.policy))
    new = average(start_pair(np.zeros(3)), total, 2, eta=1.0)
    np.testing.assert_allclose(new._value(), 0.5 * np.ones(3))
    with pytest.raises(PolicyViolation, match="train_local is not allowed"):
        train_local(new, data, lambda g, d: g)


def test_budget_checks_refuse_naming_the_group_never_the_value() -> None:
    both = DataPolicyPair(
        np.array([123456.0]),
        parse("check_privacy_budget(max_eps=2) . return & check_privacy_budget(max_eps=5) . return"),
    )
    value, commands = release_model(both, {"g1": 1.9, "g2": 1.0})
    assert commands == ["check_privacy_budget(max_eps=2)", "return"] and value.tolist() == [123456.0]
    with pytest.raises(PolicyViolation, match="group g2 has spent epsilon 3") as err:
        release_model(both, {"g1": 1.0, "g2": 3.0})
    assert "123456" not in str(err.value)
    with pytest.raises(PolicyViolation, match="not a budget command"):
        enforce_budget(both, "return", 1.0, {})


def test_dp_aggregation_clips_and_adds_the_stated_noise() -> None:
    current = np.zeros(20000, dtype=np.float32)
    big = np.full(20000, 1.0, dtype=np.float32)
    results = {c: FitResult(big, 10) for c in ("a", "b", "c", "d")}
    clip = DPAggregate(clip_norm=2.0, noise_std=1e-9, rng=np.random.default_rng(0))(1, results, current)
    assert np.linalg.norm(clip) == pytest.approx(2.0, rel=1e-3)
    zero = {c: FitResult(current.copy(), 10) for c in ("a", "b", "c", "d")}
    noisy = DPAggregate(clip_norm=2.0, noise_std=3.0, rng=np.random.default_rng(0))(1, zero, current)
    assert np.std(noisy) == pytest.approx(3.0 / 4, rel=0.03)
    plain = DPAggregate(clip_norm=None, noise_std=0.0, rng=np.random.default_rng(0))
    weighted = plain(
        1,
        {"a": FitResult(np.ones(2, np.float32), 1), "b": FitResult(np.zeros(2, np.float32), 3)},
        np.zeros(2),
    )
    np.testing.assert_allclose(weighted, [0.25, 0.25])


def test_local_noise_shares_sum_to_sigma() -> None:
    m, sigma = 16, 2.0
    shares = [
        ClipAndNoise(1.0, sigma / np.sqrt(m), 1)(torch.zeros(40000), np.random.default_rng(i))
        for i in range(m)
    ]
    assert float(torch.stack(shares).sum(0).std()) == pytest.approx(sigma, rel=0.03)


def test_stage_of_takes_the_strictest_noise() -> None:
    a = PolicyGroup("a", parse(ALL), ("get_data",), 0.01, ("u1",))
    b = PolicyGroup("b", parse(NOMIC), ("get_data",), 0.02, ("u2",))
    stage = stage_of([a, b], 10)
    assert stage.name == "a+b" and stage.noise_std == 0.02 and stage.members == ["u1", "u2"]
    c = PolicyGroup("c", parse(ALL), ("get_data",), None, ("u3",))
    with pytest.raises(ConfigError, match="DP noise for every group or for none"):
        stage_of([a, c], 10)
    with pytest.raises(ConfigError, match="rounds 0"):
        stage_of([a], 0)


def _setup(commands: tuple[str, ...], raw_mic: float | None = None, program: str = "") -> tuple:
    users = synthetic_mpu(6, seed=1, notifications=(10, 12))
    ids = sorted(users)
    torch.manual_seed(0)
    flat = FlatModel(EngagementNet(len(SENSORS), per_step=4, hidden=4))
    pairs = {}
    for i, c in enumerate(ids):
        x = users[c]["x"].copy()
        if raw_mic is not None:
            x[..., [MIC, LOC]] = raw_mic * (i + 1)
        policy = parse(NOMIC if i < 3 else ALL)
        pairs[c] = DataPolicyPair({"x": x, "y": users[c]["y"], "sensor_columns": SENSORS}, policy)
    opt = LocalOptimizer("sgd", 0.1)
    devices = PolicyDevices(flat, pairs, optimizer=opt, seed=0, loss=binary_logit_loss, batched=False)
    runtime = SimulationRuntime(devices, rng=np.random.default_rng(1))
    cfg = ImageFedAvgConfig(clients_per_round=3, batch_size=8, optimizer=opt, eval_every=0)
    server = ModelServer(cfg, flat, np.random.default_rng(2))
    nomic = PolicyGroup("nomic", parse(NOMIC), commands, 4.0, tuple(ids[:3]), program)
    return devices, runtime, server, nomic, flat


def _stage(
    raw_mic: float | None = None,
    commands: tuple[str, ...] = ("get_data(data_type='MPU')", "filter(sensors=['mic','loc'])"),
    program: str = "",
):
    devices, runtime, server, group, flat = _setup(commands, raw_mic, program)
    stage = stage_of([group], 3)
    ledger = GroupLedger(["nomic"], delta=1e-5)
    result = asyncio.run(
        run_stage(
            stage,
            job="t",
            model=start_pair(flat.initial()),
            server=server,
            comm=runtime,
            ledger=ledger,
            clip_norm=1.0,
            dp_mode="central",
            rng=np.random.default_rng(3),
        )
    )
    return devices, result, ledger


def test_filtered_sensors_never_reach_training() -> None:
    """Spy: the trainer's data has zero mic/loc columns, and the trained model does not depend on them."""
    devices, first, ledger = _stage(raw_mic=1.0)
    assert devices.trainer is not None
    for cid in devices.prepared:
        assert not devices.trainer.data.array(cid, "x")[..., [MIC, LOC]].any()
    _, second, _ = _stage(raw_mic=-7.0)
    np.testing.assert_array_equal(first.model._value(), second.model._value())
    assert show(first.model.policy) == "check_privacy_budget(max_eps=2) . return"
    assert ledger.rounds("nomic") == 3 and 0 < ledger.epsilon("nomic") < np.inf
    assert first.z == 4.0 and first.q == 1.0


def test_devices_refuse_a_job_their_policy_forbids() -> None:
    with pytest.raises(PolicyViolation, match="no device of stage nomic accepted"):
        _stage(commands=("get_data(data_type='MPU')",))
    devices = _setup(("get_data(data_type='MPU')",))[0]
    ids = sorted(devices.pairs)
    pair = devices.pairs[ids[0]]
    with pytest.raises(PolicyViolation, match="would accept: filter"):
        prepare_pair(pair, ("get_data(data_type='MPU')",))
    with pytest.raises(PolicyViolation, match="not a device command"):
        prepare_pair(pair, ("average",))


def test_a_sandboxed_device_program_prepares_as_the_commands_do() -> None:
    program = (
        "def prepare(data):\n    d = get_data(data, data_type='MPU')\n"
        "    return filter(d, sensors=['mic', 'loc'])\n"
    )
    _, by_program, _ = _stage(raw_mic=1.0, program=program)
    _, by_commands, _ = _stage(raw_mic=1.0)
    np.testing.assert_array_equal(by_program.model._value(), by_commands.model._value())
    peek = "def prepare(data):\n    return data.value\n"
    with pytest.raises(
        PolicyViolation, match=r"no device .* accepted job t; first refusal: the job's device program failed"
    ):
        _stage(program=peek)
