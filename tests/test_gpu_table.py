"""``benchmarks/gpu_table.py``: a ``scripts/gpu-check`` run's table, read off its files (known answers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_table", REPO / "benchmarks" / "gpu_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(step: str, device: str, result: object, ok: bool = True) -> str:
    return json.dumps({"step": step, "device": device, "ok": ok, "seconds": 1, "result": result}) + "\n"


def test_each_measure_on_cuda_beside_the_cpus_with_the_speed_up(tmp_path: Path) -> None:
    rows = [{"framework": "fedveil", "seconds_per_round": 0.5}, {"framework": "pfl", "seconds_per_round": 9}]
    (tmp_path / "results.jsonl").write_text(
        _line("bench-fedavg", "cuda", {"batched_updates_per_second": 1.0})
        + _line("bench-fedavg", "cuda", {"batched_updates_per_second": 900.0})  # the last line wins
        + _line("bench-fedavg", "cpu", {"batched_updates_per_second": 12.5})
        + _line("bench-rounds", "cuda", {"floor_seconds": 0.002, "fraction_of_floor": 0.25})
        + _line("bench-rounds", "cpu", {"floor_seconds": 0.01, "fraction_of_floor": 0.4})
        + _line("bench-peers", "cuda", {"rows": rows})
        + _line("bench-mobilefacenet", "cuda", None, ok=False)  # a step that failed
        + '{"step": "bench-mobilefacenet", "device": "cpu", "ok": tr'  # a line cut off mid-write
    )
    (tmp_path / "gpu-check.log").write_text(
        "gpu-check: torch 2.5.1+cu124 on NVIDIA H100 80GB HBM3\n"
        "gpu-check: bench-fedavg on cuda (limit 150 s): python3 -m fedveil bench fedavg --device cuda\n"
    )
    table = _module().gpu_table(tmp_path)
    assert table.startswith("GPU: NVIDIA H100 80GB HBM3, torch 2.5.1+cu124\n")
    assert "| FedAvg client updates/s, batched (vmap) | 900 | 12.5 | 72.00x |" in table  # rate: cuda / cpu
    assert "| FDML floor, s/round (lr 1e-4) | 0.002 | 0.01 | 5.00x |" in table  # seconds: cpu / cuda
    assert "| FDML fraction of the floor (lr 1e-4) | 0.250 | 0.400 | n/a |" in table
    assert "| fedveil's peers row, s/round | 0.5 | not run | n/a |" in table
    assert "| MobileFaceNet images/s, BatchNorm training | not run | not run | n/a |" in table
    assert "- bench-fedavg on cuda: `python3 -m fedveil bench fedavg --device cuda`" in table


def test_the_command_wants_one_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = _module()
    assert module.main([]) == 2 and module.main([str(tmp_path / "missing")]) == 2
    assert "usage" in capsys.readouterr().err
    assert module.main([str(tmp_path)]) == 0
    assert "GPU: unknown (no gpu-check.log)" in capsys.readouterr().out
