"""The Table V benchmark of the enclave's Alg. 1 (fedveil.experiments.bench.enclave, ``fedveil bench``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.bench.enclave import (
    PAPER_TABLE_V_SECONDS,
    SYNTHETIC,
    TrainedEmbeddings,
    bench_enclave,
    clustered_embeddings,
    cohort_embeddings,
)

#: A tiny FDML run: 12 training users, cohorts of 4 x 4.
TINY_RUN = (
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[2, 2]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
)


def test_rows_carry_timing_memory_error_and_the_paper_column() -> None:
    rows = bench_enclave([5, 64], samples=2, dim=6, strategy="batch-all", repeats=2, seed=1)
    assert [r["participants"] for r in rows] == [5, 64]
    assert [r["paper_seconds"] for r in rows] == [None, PAPER_TABLE_V_SECONDS[64]] == [None, 0.48]
    for r, n in zip(rows, (10, 128), strict=True):
        assert r["embeddings"] == n and r["seconds"] > 0 and r["cpu_seconds"] >= 0
        assert 0 < r["peak_bytes"] <= r["workspace_bytes"]
        assert 0 < r["num_active"] <= r["num_valid"] == n * 1 * (n - 2)
        assert r["max_rel_err"] is not None and r["max_rel_err"] <= 1e-4  # float32 against float64
        assert r["reference"].startswith("float64 torch autograd")


def test_reference_is_skipped_when_the_triplet_grid_does_not_fit() -> None:
    (row,) = bench_enclave([4], samples=3, dim=2, strategy="semi-hard", repeats=1, reference_limit=1000)
    assert row["max_rel_err"] is None and row["reference"].startswith("skipped: the N^3 = 1728 triplet grid")


def test_embeddings_are_seeded_unit_float32_vectors_grouped_by_participant() -> None:
    x, y = clustered_embeddings(3, 4, 5, np.random.default_rng(2))
    again, _ = clustered_embeddings(3, 4, 5, np.random.default_rng(2))
    assert x.dtype == np.float32 and x.shape == (12, 5)
    np.testing.assert_array_equal(x, again)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(y, np.repeat(np.arange(3), 4))


@pytest.mark.parametrize(
    "kwargs",
    [{"participants": [1]}, {"participants": []}, {"samples": 1}, {"repeats": 0}, {"strategy": "hardest"}],
)
def test_bad_settings_raise_config_error(kwargs: dict) -> None:
    settings = {"participants": [4], "samples": 2, "dim": 3, "strategy": "batch-all", **kwargs}
    with pytest.raises(ConfigError):
        bench_enclave(**settings)


def test_cli_prints_json_rows_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "enclave", "--participants", "3,4", "--samples", "3", "--dim", "4", "--repeats", "1"]
    args += ["--embeddings", "synthetic"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["participants"] for r in rows] == [3, 4] and rows[0]["strategy"] == "batch-all"
    assert all(r["source"] == "synthetic" and r["source_details"] == {"noise": 0.5} for r in rows)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "paper (s)" in table and "max rel err" in table and len(table.splitlines()) == 4


def test_cli_times_trained_embeddings_beside_the_synthetic_ones(capsys: pytest.CaptureFixture[str]) -> None:
    """By default each count gets a synthetic row and a row on the embeddings of a short FDML run's
    network (here a tiny run: 12 users, 3 rounds), the same fields, the reference checked on both."""
    args = ["bench", "enclave", "--participants", "3,5", "--samples", "3", "--repeats", "1"]
    sets = [word for item in TINY_RUN for word in ("--set", item)]
    assert main([*args, "--train-rounds", "3", "--train-lr", "0.01", *sets, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["participants"], r["source"]) for r in rows] == [
        (3, "synthetic"),
        (3, "trained"),
        (5, "synthetic"),
        (5, "trained"),
    ]
    for r in rows:
        assert r["embeddings"] == 3 * r["participants"] and r["dim"] == 64
        assert r["max_rel_err"] is not None and r["max_rel_err"] <= 1e-4
    details = rows[1]["source_details"]
    assert details["train_rounds"] == 3 and details["train_lr"] == 0.01 and details["train_cohort"] == [4, 4]
    assert details["train_loss_first"] > 0 and details["train_loss_last"] > 0
    assert main([*args, "--embeddings", "trained", "--train-rounds", "0", *sets]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in table[2:]] == [["3", "trained"], ["5", "trained"]]


def test_trained_embeddings_are_the_trained_networks_and_seeded() -> None:
    source = TrainedEmbeddings(TINY_RUN, rounds=3, lr=0.01)
    x, y = source(4, 3, 64, np.random.default_rng(5))
    again, _ = source(4, 3, 64, np.random.default_rng(5))
    assert x.dtype == np.float32 and x.shape == (12, 64) and len(source.losses) == 3
    np.testing.assert_array_equal(x, again)
    np.testing.assert_array_equal(y, np.repeat(np.arange(4), 3))
    # the same cohort through the network as initialised: other embeddings, so the run trained it
    flat, trained = source._network
    untrained, _ = cohort_embeddings(source.population, flat, flat.initial(), 4, 3, np.random.default_rng(5))
    want, _ = cohort_embeddings(source.population, flat, trained, 4, 3, np.random.default_rng(5))
    np.testing.assert_array_equal(x, want)
    assert not np.allclose(x, untrained)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (([4], 3, 32), "dim 32: trained embeddings are the FDML network's outputs, 64 wide"),
        (([4, 13], 3, 64), "13 participants, but the population has 12 training users"),
    ],
)
def test_trained_sizes_are_refused_before_the_run(sizes: tuple, message: str) -> None:
    source = TrainedEmbeddings(TINY_RUN, rounds=50)
    with pytest.raises(ConfigError, match=message):
        bench_enclave(*sizes, "batch-all", sources=(SYNTHETIC, source))
    assert source.losses == [] and "_network" not in vars(source)  # no round ran


def test_cli_refuses_a_width_the_network_does_not_have(capsys: pytest.CaptureFixture[str]) -> None:
    sets = [word for item in TINY_RUN for word in ("--set", item)]
    assert main(["bench", "enclave", "--participants", "3", "--dim", "4", *sets]) == 2
    err = capsys.readouterr().err
    assert "dim 4: trained embeddings are the FDML network's outputs, 64 wide" in err
    assert main(["bench", "enclave", "--participants", "3", "--train-rounds", "-1", *sets]) == 2
    assert "training rounds -1 must be >= 0 (--train-rounds)" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "enclave", "--participants", "8,x"])
    assert exc.value.code == 2 and "comma-separated list of integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench"])
    assert main(["bench", "enclave", "--participants", "3", "--memory-limit-mib", "0"]) == 2
    assert "--memory-limit-mib 0.0" in capsys.readouterr().err
