"""``fedveil bench scale``: clients share one array of images (registering clients copies no pixels), a
Ray shard builds only its clients, and the command prints one row per setting, each from its own
process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fedveil.experiments.bench.scale import scale_clients


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


def test_bench_scale_prints_a_row_per_setting() -> None:
    command = [sys.executable, "-m", "fedveil", "bench", "scale", "--clients", "60", "--actors", "1"]
    command += ["--ray-clients", "20", "--per-round", "4", "--rounds", "1", "--samples", "5", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
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
