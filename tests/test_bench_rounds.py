"""``fedveil bench rounds`` and ``bench enclave --boundary``: the benchmarks run and report their fields."""

from __future__ import annotations

import json

import pytest

from fedveil.cli import main

SMALL = [
    "--set",
    "data.train_users_per_model=[6, 6]",
    "--set",
    "data.test_users_per_model=[2, 2]",
    "--set",
    "fdml.num_required=4",
    "--set",
    "fdml.samples_per_client=4",
]


def test_bench_rounds_json(capsys) -> None:
    assert (
        main(
            [
                "bench",
                "rounds",
                "--rounds",
                "2",
                "--repeats",
                "2",
                "--threads",
                "1",
                "--warmup",
                "3",
                "--profile",
                *SMALL,
                "--json",
            ]
        )
        == 0
    )
    top = json.loads(capsys.readouterr().out)
    # two cases side by side: the config's lr (FDML's 1e-4), and the trained case's (the default 3e-3)
    assert top["lr"] == 1e-4 and top["trained"]["lr"] == 3e-3 and "trained" not in top["trained"]
    for row in (top, top["trained"]):
        assert row["participants"] == 4 and row["samples"] == 4 and row["warmup_rounds"] == 3
        assert len(row["rounds_per_second_runs"]) == 2 and row["rounds_per_second"] > 0
        assert row["bytes_up_per_round"] > 0 and row["enclave_boundary"] == "process"
        # the floor, measured in the same run
        assert row["device_flops_per_round"] > 0 and row["peak_gemm_gflops"] > 0
        parts = (
            row["device_flops_per_round"] / (row["peak_gemm_gflops"] * 1e9)
            + row["alg1_seconds"]
            + row["sealed_bytes_per_round"] / row["aes_gcm_bytes_per_second"]
            + row["copied_bytes_per_round"] / row["memcpy_bytes_per_second"]
        )
        assert abs(row["floor_seconds"] - parts) <= 1e-9 * parts
        assert abs(row["fraction_of_floor"] - row["floor_seconds"] * row["rounds_per_second"]) <= 1e-9
        # the broadcast is coded once for its recipients; every sealed byte is sealed and opened
        assert 0 < row["bytes_down_coded_per_round"] < row["bytes_down_per_round"]
        up, coded = row["bytes_up_per_round"], row["bytes_down_coded_per_round"]
        assert row["copied_bytes_per_round"] == 2 * (up + coded) + up
        assert row["sealed_bytes_per_round"] == 2 * (up + 4 * 4 * 64 * 4)
        # on the CPU nothing crosses to a GPU: no crossing term in the floor
        assert "host_to_device_bytes_per_round" not in row and "host_to_device_bytes_per_second" not in row
        # the profile's phases add up to the profiled round, and the device and enclave phases were found
        prof = row["profile_seconds_per_round"]
        phases = sum(v for k, v in prof.items() if k != "profiled_round_seconds")
        assert abs(phases - prof["profiled_round_seconds"]) <= 1e-9
        for phase in (
            "device_forward",
            "device_backward",
            "device_sealing",
            "enclave_step5_alg1",
            "enclave_step9_eq2",
            "enclave_step9_stream",
        ):
            assert prof[phase] > 0, phase
    # the floor's Alg. 1 runs on a round's embeddings as the timed network makes them: at 1e-4 the
    # network is untrained (every triplet active), at the training lr part of the triplets fall inactive
    assert top["alg1_active_fraction"] == 1.0 > top["trained"]["alg1_active_fraction"] > 0


def test_bench_rounds_prints_both_cases(capsys) -> None:
    """Without --json: one line per case, each with its lr and its fraction of the floor."""
    argv = ["bench", "rounds", "--rounds", "1", "--repeats", "1", "--threads", "1", "--warmup", "0"]
    assert main([*argv, "--trained-lr", "0.01", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("FDML, the config's lr 0.0001: ")
    assert lines[1].startswith("FDML, trained lr 0.01: ")
    assert all("fraction of floor" in line for line in lines)


def test_bench_rounds_of_fl_traditional(capsys) -> None:
    """Table I's FL-traditional rounds: its written-out step's FLOPs are counted, its floor has no enclave
    part, and the profile splits the round into the devices' step, the average and the codec."""
    small = [
        "--set", "data.train_users_per_model=[6, 6]", "--set", "data.test_users_per_model=[2, 2]",
        "--set", "fedavg.clients_per_round=4", "--set", "fedavg.samples_per_client=4",
    ]  # fmt: skip
    argv = ["bench", "rounds", "--protocol", "fedavg", "--rounds", "2", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--warmup", "1", "--profile", *small, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["protocol"] == "fedavg" and row["participants"] == 4 and row["samples"] == 4
    assert "trained" not in row and row["lr"] == 0.1  # no Alg. 1, so no trained-embeddings case
    assert row["alg1_seconds"] == 0.0 and row["alg1_active_fraction"] is None
    assert row["sealed_bytes_per_round"] == 0.0
    assert row["enclave_boundary"] == "none"
    up, coded = row["bytes_up_per_round"], row["bytes_down_coded_per_round"]
    assert coded * 4 == row["bytes_down_per_round"]  # one broadcast, metered once per device
    assert row["copied_bytes_per_round"] == 2 * (up + coded) + up
    prof = row["profile_seconds_per_round"]
    assert set(prof) == {"device_step", "aggregation", "codec", "other", "profiled_round_seconds"}
    assert prof["device_step"] > 0 and prof["aggregation"] > 0 and prof["codec"] > 0
    # the written-out step is counted as it runs, and does the FLOPs of each device's own autograd
    assert main([*argv, "--warmup", "0", "--one-by-one", *small, "--json"]) == 0
    one_by_one = json.loads(capsys.readouterr().out)
    assert row["device_flops_per_round"] == one_by_one["device_flops_per_round"] > 0
    with pytest.raises(SystemExit):
        main(["bench", "rounds", "--protocol", "fedsgd"])
    assert "invalid choice: 'fedsgd'" in capsys.readouterr().err
    assert main([*argv, "--trained-lr", "0.01", *small]) == 2
    assert "trained_lr 0.01: the trained case is FDML's" in capsys.readouterr().err


def test_bench_enclave_through_the_boundary(capsys) -> None:
    """Synthetic and trained embeddings side by side, each count through the boundary and directly."""
    argv = ["bench", "enclave", "--participants", "4,8", "--repeats", "1", "--boundary", "inprocess"]
    assert main([*argv, "--train-rounds", "2", *SMALL, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["participants"], r["source"]) for r in rows] == [
        (4, "synthetic"),
        (4, "trained"),
        (8, "synthetic"),
        (8, "trained"),
    ]
    assert all(r["max_abs_diff"] == 0.0 and r["boundary"] == "inprocess" for r in rows)
    details = rows[1]["source_details"]
    assert details["train_rounds"] == 2 and details["train_cohort"] == [4, 4]
    assert main([*argv, "--embeddings", "synthetic"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "source" in table[1]
    assert [line.split()[:2] for line in table[2:]] == [["4", "synthetic"], ["8", "synthetic"]]


def test_bench_codec_json(capsys) -> None:
    assert main(["bench", "codec", "--elements", "1000", "--repeats", "3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["elements"] == 1000 and row["wire_bytes"] == 4000 + row["overhead_bytes"]
    assert row["round_trip_seconds"] > 0


def test_flops_of_a_vmapped_network_are_counted_on_the_one_by_one_path(capsys) -> None:
    """CameraAuth's ResNet-34 has no written-out backward: its round's FLOPs are the cohort's forward
    plus each device's forward and backward, counted directly (vmap's grouped convolutions over-count)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from fedveil.models.faces import ResNet34Embedding

    args = [
        "bench", "rounds", "--rounds", "1", "--repeats", "1", "--threads", "1", "--warmup", "0",
        "--set", "data.kind=cameraauth-synthetic", "--set", "data.train_people=8",
        "--set", "data.test_people=21", "--set", "data.train_photos=6", "--set", "data.test_photos=40",
        "--set", "data.image_size=32", "--set", "model.width=0.25",
        "--set", "fdml.num_required=4", "--set", "fdml.samples_per_client=4", "--json",
    ]  # fmt: skip
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)
    model = ResNet34Embedding(width=0.25, norm="group")
    x = torch.randn(4, 3, 32, 32)
    with FlopCounterMode(display=False) as forward:
        model(x)
    with FlopCounterMode(display=False) as both:
        model(x).sum().backward()
    expected = 4 * (forward.get_total_flops() + both.get_total_flops())
    assert row["device_flops_per_round"] == row["trained"]["device_flops_per_round"] == expected


def test_bench_rounds_refuses_a_negative_warmup(capsys) -> None:
    assert main(["bench", "rounds", "--warmup", "-1", *SMALL]) == 2
    assert "--warmup -1 must be >= 0" in capsys.readouterr().err


def test_a_gpu_floor_adds_the_crossing_between_host_and_gpu_at_the_measured_rates() -> None:
    """On a GPU the codec and the enclave still work in host memory: every message sent down crosses to
    the GPU and every upload back, at the copy rates measured each way (known answer, no GPU needed)."""
    from fedveil.experiments.bench.rounds import _floor

    rates = {
        "peak_gemm_gflops": 1000.0,
        "aes_gcm_bytes_per_second": 2e9,
        "memcpy_bytes_per_second": 1e10,
    }
    common = dict(flops=4e9, alg1=None, sealed_bytes=2e6, copied_bytes=3e7)
    crossing = {"host_to_device": 5e6, "device_to_host": 8e6}
    on_cpu = _floor(**common, crossing_bytes=crossing, rates=rates)
    assert on_cpu["floor_seconds"] == pytest.approx(4e9 / 1e12 + 2e6 / 2e9 + 3e7 / 1e10, rel=1e-12)
    assert "host_to_device_bytes_per_round" not in on_cpu
    gpu_rates = {**rates, "host_to_device_bytes_per_second": 1e9, "device_to_host_bytes_per_second": 4e9}
    on_gpu = _floor(**common, crossing_bytes=crossing, rates=gpu_rates)
    assert on_gpu["host_to_device_bytes_per_round"] == 5e6 and on_gpu["device_to_host_bytes_per_round"] == 8e6
    assert on_gpu["floor_seconds"] == pytest.approx(
        on_cpu["floor_seconds"] + 5e6 / 1e9 + 8e6 / 4e9, rel=1e-12
    )


def test_host_device_copy_rates_are_refused_for_the_cpu() -> None:
    from fedveil.experiments.bench.floor import host_device_bytes_per_second

    with pytest.raises(ValueError, match=r"'cpu'.*GPU"):
        host_device_bytes_per_second("cpu")
