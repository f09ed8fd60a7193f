"""The Table V benchmark of the enclave's Alg. 1 (fedveil.experiments.bench.enclave, ``fedveil bench``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.bench.enclave import PAPER_TABLE_V_SECONDS, bench_enclave, clustered_embeddings


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
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["participants"] for r in rows] == [3, 4] and rows[0]["strategy"] == "batch-all"
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "paper (s)" in table and "max rel err" in table and len(table.splitlines()) == 4


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "enclave", "--participants", "8,x"])
    assert exc.value.code == 2 and "comma-separated list of integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench"])
    assert main(["bench", "enclave", "--participants", "3", "--memory-limit-mib", "0"]) == 2
    assert "--memory-limit-mib 0.0" in capsys.readouterr().err
