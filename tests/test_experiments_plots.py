"""The timing summaries of :mod:`fedveil.experiments.plots`: one implementation of PoliFL Sec. 5's
percentiles behind a round's ``metrics.jsonl`` fields (seconds) and the PoliFL service's per-phase job
outcome (milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest

from fedveil.core.communicator import DeviceTiming
from fedveil.experiments.plots import summarise_timings, summarise_timings_by_phase

TIMINGS = [
    DeviceTiming("a", "train", 10, 20, ttd=0.1, tte=1.0, ttr=0.2, ttp=None),
    DeviceTiming("b", "train", 10, 20, ttd=0.3, tte=2.0, ttr=0.4, ttp=None),
    DeviceTiming("c", "train", 10, 20, ttd=0.5, tte=4.0, ttr=0.6, ttp=None),
    DeviceTiming("d", "job", 5, 5, ttd=0.01, tte=0.02, ttr=0.03, ttp=0.04),
]


def test_a_rounds_fields_are_seconds_at_the_median_the_95th_percentile_and_the_maximum() -> None:
    train = [t for t in TIMINGS if t.phase == "train"]
    got = summarise_timings(train)
    assert set(got) == {f"{p}_{s}" for p in ("ttd", "tte", "ttr") for s in ("p50", "p95", "max")}, (
        "a measure no record carries (ttp) is left out"
    )
    assert got["tte_p50"] == 2.0 and got["tte_max"] == 4.0
    assert got["ttd_p95"] == pytest.approx(float(np.percentile([0.1, 0.3, 0.5], 95)))
    assert summarise_timings([]) == {}


def test_the_service_outcome_is_per_phase_in_milliseconds_with_the_replies() -> None:
    got = summarise_timings_by_phase(TIMINGS)
    assert list(got) == ["job", "train"]
    assert got["job"] == {
        "replies": 1.0,
        **{
            f"{p}_{s}_ms": v * 1000.0
            for p, v in zip(("ttd", "tte", "ttr", "ttp"), (0.01, 0.02, 0.03, 0.04), strict=True)
            for s in ("p50", "p90", "max")
        },
    }
    train = got["train"]
    assert train["replies"] == 3.0 and "ttp_p50_ms" not in train
    assert train["tte_p50_ms"] == 2000.0 and train["tte_max_ms"] == 4000.0
    assert train["ttd_p90_ms"] == pytest.approx(float(np.percentile([100.0, 300.0, 500.0], 90)))


def test_an_unknown_unit_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unit 'min' is not one of s, ms"):
        summarise_timings(TIMINGS, unit="min")
