"""`fedveil polifl scale`: PoliFL Sec. 5.3 / 5.4 (Fig. 4, Fig. 5) over the networked runtime.

One small real run (module fixture): the CLI with ``--json`` starts a mutual-TLS gRPC server and two
agent processes on loopback, Fig. 4 trains one device for 3 rounds per task, Fig. 5 runs one round of 5
simultaneous replay devices per task; the tests check the printed summary and the per-round and
per-device rows of ``results.json`` against what the measurement must satisfy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedveil.cli import main
from fedveil.core import codec
from fedveil.errors import ConfigError
from fedveil.experiments.polifl.scale import PAPER, ReplayDevices, draw_tte, measure_scale, task_run
from fedveil.models.flat import FlatModel
from fedveil.privacy.pairs import DataPolicyPair
from fedveil.privacy.policy import parse
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import FitReply, FitRequest
from fedveil.protocols.polifl import JobReady, JobStart

DEVICES, ROUNDS, SCALE, SEED = 5, 3, 0.002, 3
TASKS = ("text", "images")

Run = tuple[dict[str, Any], dict[str, Any], Path]
"""The printed ``--json`` summary, ``results.json`` and the output folder."""


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("scale")
    cmd = [
        sys.executable,
        "-m",
        "fedveil",
        "polifl",
        "scale",
        "--devices",
        str(DEVICES),
        "--rounds",
        str(ROUNDS),
        "--tasks",
        ",".join(TASKS),
        "--tte-scale",
        str(SCALE),
        "--processes",
        "2",
        "--seed",
        str(SEED),
        "--json",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    results = json.loads((out / "results.json").read_text())
    return printed, results, out


def test_json_summary_has_both_figures_per_task(scale_run: Run) -> None:
    printed, _, out = scale_run
    assert printed["settings"]["tte_scale"] == SCALE
    assert printed["settings"]["devices"] == DEVICES and printed["settings"]["rounds"] == ROUNDS
    assert "fig4_rounds" not in printed and "fig5_arrivals" not in printed
    for fig in ("fig4", "fig5"):
        assert set(printed[fig]) == set(TASKS)
        for row in printed[fig].values():
            for key in ("ttd", "tte", "ttr", "ttp"):
                assert set(row[key]) >= {"p50", "p90", "max"}
            assert row["model_bytes"] > 0 and row["bytes_down"] > row["model_bytes"]
            assert "round_seconds" in row
    assert (out / "fig4.png").stat().st_size > 0 and (out / "fig5.png").stat().st_size > 0


def _encoded_request_bytes(task: str, params: int, rnd: int) -> int:
    """Bytes of the engine's broadcast of a ``params``-long model in round ``rnd`` of ``task``."""
    run = task_run(task, 100, SEED)
    zeros = np.zeros(params, dtype=np.float32)
    return len(codec.encode(FitRequest(rnd, run.lr, run.local_epochs, run.batch_size, zeros)))


def test_fig4_one_device_every_round_timed_and_sized(scale_run: Run) -> None:
    _, results, _ = scale_run
    sizes = {}
    for task in TASKS:
        rows = results["fig4_rounds"][task]
        assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
        params = results["fig4"][task]["params"]
        for r in rows:
            assert all(r[k] >= 0 for k in ("ttd", "tte", "ttr", "ttp", "aggregate"))
            # the round's wall time holds the device's whole request and the server's aggregation
            assert r["round_seconds"] >= r["ttd"] + r["tte"] + r["ttr"] + r["aggregate"] - 1e-3
            # what went down is the encoded FitRequest of the model; the reply carries the same model
            assert r["bytes_down"] == _encoded_request_bytes(task, params, r["round"])
            assert r["bytes_up"] > 4 * params
        sizes[task] = (params, rows[0]["bytes_down"])
    # bytes on the wire grow with the model (text's LSTM is larger than LeNet)
    (p0, b0), (p1, b1) = sizes["text"], sizes["images"]
    assert (p0 > p1) == (b0 > b1)


def test_fig5_every_device_in_arrival_order_round_gated_by_slowest(scale_run: Run) -> None:
    _, results, _ = scale_run
    rng = np.random.default_rng(SEED)
    replayed = {t: draw_tte(t, DEVICES, SCALE, rng) for t in results["settings"]["tasks"]}
    for task in TASKS:
        rows = results["fig5_arrivals"][task]
        summary = results["fig5"][task]
        assert sorted(r["device"] for r in rows) == [f"{task}-{i:05d}" for i in range(DEVICES)]
        arrivals = [r["arrival"] for r in rows]
        assert arrivals == sorted(arrivals)
        for r in rows:
            assert all(r[k] >= 0 for k in ("ttd", "tte", "ttr", "ttp"))
            assert r["arrival"] == pytest.approx(r["ttd"] + r["tte"] + r["ttr"])
            i = int(r["device"].rsplit("-", 1)[1])
            assert r["tte_replayed"] == pytest.approx(replayed[task][i])
            assert r["tte"] >= r["tte_replayed"]
            assert r["bytes_down"] == _encoded_request_bytes(task, summary["params"], 1)
        assert summary["replies"] == DEVICES
        assert summary["round_seconds"] >= summary["slowest_device_seconds"] >= max(r["tte"] for r in rows)
        assert summary["tte_replayed_distribution"]["mean"] == pytest.approx(PAPER[task]["tte_mean"] * SCALE)


def test_replay_devices_enforce_the_policy_and_wait_their_tte() -> None:
    flat = FlatModel(torch.nn.Linear(3, 2))
    value = {"x": np.zeros((4, 3), dtype=np.float32), "y": np.zeros(4, dtype=np.int64)}
    allowed = DataPolicyPair(value, parse('get_data(data_type="x").runFL.return'))
    no_fl = DataPolicyPair(value, parse('get_data(data_type="x").return'))
    slept: list[float] = []
    update = np.full(flat.num_params, 0.5, dtype=np.float32)
    devices = ReplayDevices(
        flat,
        {"a": allowed, "b": no_fl},
        update=update,
        update_loss=1.25,
        tte={"a": 0.75},
        sleep=slept.append,
        optimizer=LocalOptimizer("sgd", 0.1),
        seed=0,
    )
    job = JobStart("j", ("get_data(data_type='x')",), "", 0.0, 0.0)
    ready = devices.handle_batch({"a": job, "b": job})
    assert isinstance(ready["a"], JobReady) and ready["a"].accepted and ready["a"].num_samples == 4
    assert isinstance(ready["b"], JobReady) and not ready["b"].accepted and "runFL" in ready["b"].reason
    weights = np.arange(flat.num_params, dtype=np.float32)
    out = devices.handle_batch(
        {"a": FitRequest(2, 0.1, 1, 4, weights), "b": FitRequest(2, 0.1, 1, 4, weights)}
    )
    assert isinstance(out["a"], FitReply) and out["a"].round == 2 and out["a"].num_samples == 4
    np.testing.assert_array_equal(out["a"].weights, weights + update)
    assert isinstance(out["b"], Exception) and slept == [0.75]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"devices": 0}, "devices 0"),
        ({"rounds": -2}, "rounds -2"),
        ({"processes": 0}, "processes 0"),
        ({"tte_scale": -0.5}, "tte_scale -0.5"),
        ({"tte_scale": float("nan")}, "tte_scale nan"),
        ({"tasks": ["text", "speech"]}, "'speech'"),
        ({"tasks": []}, "no tasks"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        measure_scale(**kwargs)


def test_cli_refuses_a_bad_tte_scale(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["polifl", "scale", "--tte-scale", "-1", "--json"]) == 2
    assert "tte_scale -1" in capsys.readouterr().err
