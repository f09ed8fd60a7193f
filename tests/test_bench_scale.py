"""``fedveil bench scale``: clients share one array of images (registering clients copies no pixels), a
Ray shard builds only its clients, and the command prints one row per setting, each from its own
process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from fedveil.cli import main
from fedveil.experiments.bench.scale import scale_clients

pytestmark = pytest.mark.usefixtures("small_fashion_mnist")  # the clients' images: 1,200, not 60,000


def test_clients_view_one_shared_array_and_a_shard_builds_only_its_own() -> None:
    pool = scale_clients(300, 50, seed=0)
    ids = pool.client_ids()
    assert len(ids) == 300
    first, last = pool.data.array(ids[0], "x"), pool.data.array(ids[-1], "x")
    assert first.shape == (50, 1, 28, 28) and first.base is not None
    assert np.shares_memory(first.base, last.base)
    shard = scale_clients(300, 50, seed=0, ids=ids[1::3])
    assert shard.client_ids() == list(ids[1::3])
    np.testing.assert_array_equal(shard.data.array(ids[1], "x"), pool.data.array(ids[1], "x"))


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="its second row runs on Ray, the fedveil[ray] extra (installed by scripts/bootstrap)",
)
def test_bench_scale_prints_a_row_per_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """The command in this process; each row still comes from its own ``--one`` process (and Ray's)."""
    command = ["bench", "scale", "--clients", "60", "--actors", "1", "--ray-clients", "20"]
    command += ["--per-round", "4", "--rounds", "1", "--samples", "5", "--json"]
    assert main(command) == 0, capsys.readouterr().err[-2000:]
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [(r["clients"], r["actors"]) for r in rows] == [(60, 0), (20, 1)]
    for r in rows:
        assert r["seconds_per_round"] > 0 and r["rounds_per_second"] == pytest.approx(
            1 / r["seconds_per_round"]
        )
        assert r["peak_rss_bytes"] > 10 * 2**20 and r["dropouts"] == 0
    assert rows[1]["rss_covers"].startswith("driver only")


def test_bad_counts_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedveil", "bench", "scale", "--clients", "ten"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "is not a comma-separated list of integers" in done.stderr
