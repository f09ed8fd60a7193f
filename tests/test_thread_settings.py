"""The host limits numpy's BLAS pool on purpose: while Alg. 1 runs under the ``fedveil`` command,
threadpoolctl reports the BLAS pool at the configured size, whatever it was before; the benchmarks
record the settings they ran with. No timing is asserted (speed is in docs/benchmarks.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from fedveil.cli import main
from fedveil.enclave import triplet
from fedveil.errors import ConfigError
from fedveil.runtime.threads import BLAS_THREADS_ENV, DEFAULT_BLAS_THREADS, blas_threads, thread_settings


def _blas_threads() -> list[int]:
    return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]


@pytest.fixture
def seen_during_alg1(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The BLAS pools' sizes each time Alg. 1's computation runs."""
    seen: list[list[int]] = []
    run = triplet._Computation.run

    def spy(self: Any) -> Any:
        seen.append(_blas_threads())
        return run(self)

    monkeypatch.setattr(triplet._Computation, "run", spy)
    return seen


ENCLAVE_BENCH = ["bench", "enclave", "--participants", "3", "--samples", "3", "--dim", "4", "--repeats", "1"]
ENCLAVE_BENCH += ["--embeddings", "synthetic"]


@pytest.mark.parametrize("configured", [None, "2"])
def test_alg1_under_the_command_runs_with_the_configured_blas_threads(
    configured: str | None,
    seen_during_alg1: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if configured is None:
        monkeypatch.delenv(BLAS_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(BLAS_THREADS_ENV, configured)
    want = DEFAULT_BLAS_THREADS if configured is None else int(configured)
    with threadpool_limits(limits=7, user_api="blas"):  # whatever the process had before
        assert main([*ENCLAVE_BENCH, "--json"]) == 0
        assert set(_blas_threads()) == {7}  # restored after the command
    assert seen_during_alg1 and all(pools and set(pools) == {want} for pools in seen_during_alg1)
    rows = json.loads(capsys.readouterr().out)
    assert all({p["threads"] for p in r["threads"]["blas"]} == {want} for r in rows)
    assert rows[0]["threads"]["env"][BLAS_THREADS_ENV] == configured


def test_a_bad_setting_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(BLAS_THREADS_ENV, "many")
    assert main([*ENCLAVE_BENCH]) == 2
    assert f"{BLAS_THREADS_ENV}='many' must be a positive integer" in capsys.readouterr().err


def test_blas_threads_restores_and_reports() -> None:
    with threadpool_limits(limits=3, user_api="blas"):
        with blas_threads(1) as n:
            assert n == 1 and set(_blas_threads()) == {1}
            assert {p["threads"] for p in thread_settings()["blas"]} == {1}
        assert set(_blas_threads()) == {3}
    with pytest.raises(ConfigError, match="must be >= 1"), blas_threads(0):
        pass
