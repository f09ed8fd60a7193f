"""The enclave-boundary benchmark (tiny sizes; the Table V sizes are run by ``fedveil bench enclave``)."""

from __future__ import annotations

import pytest

from fedveil.errors import ConfigError
from fedveil.experiments.bench.boundary import bench_enclave_boundary
from fedveil.experiments.bench.enclave import PAPER_TABLE_V_SECONDS


def test_rows_report_both_paths_and_identical_derivatives() -> None:
    rows = bench_enclave_boundary((3, 64), samples=2, dim=4, repeats=1, boundary="inprocess")
    assert [r["participants"] for r in rows] == [3, 64]
    assert rows[0]["paper_table_v_s"] is None
    assert rows[1]["paper_table_v_s"] == PAPER_TABLE_V_SECONDS[64] == 0.48
    for row in rows:
        assert row["embeddings"] == row["participants"] * 2
        assert row["direct_s"] > 0 and row["boundary_s"] >= row["enclave_call_s"] > 0
        assert row["overhead"] == pytest.approx(row["boundary_s"] / row["direct_s"] - 1)
        assert row["call_overhead"] == pytest.approx(row["enclave_call_s"] / row["direct_s"] - 1)
        assert row["max_abs_diff"] == 0.0
        assert 0 < row["peak_bytes"] <= row["memory_limit_bytes"]


@pytest.mark.parametrize(
    "kwargs",
    [{"participants": ()}, {"participants": (1,)}, {"repeats": 0}, {"samples": 1}, {"dim": 0}],
)
def test_bad_sizes_are_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="need repeats"):
        bench_enclave_boundary(**{"participants": (4,), **kwargs})


def test_an_unknown_boundary_is_refused() -> None:
    with pytest.raises(ConfigError, match="boundary 'remote'"):
        bench_enclave_boundary((4,), samples=2, dim=4, repeats=1, boundary="remote")
