"""``fedveil bench policy``: the cost of PoliFL enforcement.

- one policy advance (a derivative and its canonical reductions) of Sec. 3.3's FL policy, the running
  sum's policy of an accumulation (intersected with a new local model's policy and advanced), each time
  on a fresh state (the memoised derivative cache cleared, so the figure is the computation, not a
  lookup);
- a large policy: parsing a union of 20,000 alternatives (``get_data(group=0) . runFL + ...``, about
  600,000 characters; the parser is linear: about half a second), reading the same text again (the
  parsed policy is kept) and a verdict on it (one group's ``get_data`` then ``runFL``);
- the sandbox: compiling a small program with RestrictedPython, and running it (a forked child per run)
  against calling the same function directly;
- a trusted library function against the computation it wraps: ``filter(sensors=['mic','loc'])`` on one
  synthetic MPU user's data through :func:`fedveil.protocols.polifl.filter_sensors` (policy check,
  derivative, new pair) and the same zeroing called directly.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from fedveil.privacy.pairs import DataPolicyPair, Side, apply
from fedveil.privacy.policy import Call, advance, allows, derivative, forget_parsed, inter, parse
from fedveil.privacy.sandbox import compile_program, run_program

__all__ = ["bench_policy"]

FL = "get_data . train_local . accumulate* . (train_local . accumulate* + average*) . return"
PROGRAM = "def main(pair):\n    out = get_data(pair)\n    return out.policy\n"


def _get_data(pair: DataPolicyPair) -> DataPolicyPair:
    return apply("get_data", [pair], lambda v: v, side=Side.DEVICE)


def _library_overhead(repeats: int) -> dict[str, float]:
    from fedveil.data.mpu import SENSORS, synthetic_mpu
    from fedveil.protocols.polifl import _zero_sensors, filter_sensors

    user = next(iter(synthetic_mpu(2, seed=0).values()))
    value = {"x": user["x"], "y": user["y"], "sensor_columns": SENSORS}
    pair = DataPolicyPair(value, parse("filter(sensors=['mic','loc']) . runFL"))
    library, direct = [], []
    for _ in range(repeats):
        derivative.cache_clear()
        start = time.perf_counter()
        filter_sensors(pair, ["mic", "loc"])
        library.append(time.perf_counter() - start)
        start = time.perf_counter()
        _zero_sensors(value, ["mic", "loc"])
        direct.append(time.perf_counter() - start)
    return {
        "library_filter_microseconds_median": 1e6 * statistics.median(library),
        "direct_filter_microseconds_median": 1e6 * statistics.median(direct),
        "filter_examples": len(user["y"]),
    }


def _large_union(alternatives: int) -> dict[str, Any]:
    """Seconds to parse a union of ``alternatives`` alternatives (wall clock and this process's CPU
    time), to read it again and to decide one command sequence on it."""
    text = " + ".join(f"get_data(group={i}) . runFL" for i in range(alternatives))
    forget_parsed()
    derivative.cache_clear()
    start, cpu = time.perf_counter(), time.process_time()
    policy = parse(text)
    parse_seconds, parse_cpu = time.perf_counter() - start, time.process_time() - cpu
    start = time.perf_counter()
    parse(text)
    again_seconds = time.perf_counter() - start
    start = time.perf_counter()
    allowed = allows(policy, [Call.of("get_data", {"group": alternatives // 2}), Call.of("runFL")])
    verdict_seconds = time.perf_counter() - start
    return {
        "union_alternatives": alternatives,
        "union_characters": len(text),
        "union_parse_seconds": parse_seconds,
        "union_parse_cpu_seconds": parse_cpu,
        "union_parse_again_seconds": again_seconds,
        "union_verdict_seconds": verdict_seconds,
        "union_verdict_allowed": allowed,
    }


def bench_policy(*, repeats: int = 2000, sandbox_runs: int = 20, union: int = 20_000) -> dict[str, Any]:
    """Microseconds per policy advance and per sandbox call, seconds for a ``union``-alternative policy
    (module docstring)."""
    policy = parse(FL)
    local = advance(policy, [Call.of("get_data"), Call.of("train_local")])
    accumulate = Call.of("accumulate")
    times = []
    running = local
    for _ in range(repeats):
        derivative.cache_clear()
        start = time.perf_counter()
        running = derivative(inter(running, local), accumulate)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    program = compile_program(PROGRAM, "bench")
    compile_seconds = time.perf_counter() - start
    pair = DataPolicyPair(1.0, policy)
    runs, direct = [], []
    for _ in range(sandbox_runs):
        start = time.perf_counter()
        run_program(program, "main", pair, library={"get_data": _get_data})
        runs.append(time.perf_counter() - start)
        start = time.perf_counter()
        _get_data(pair)
        direct.append(time.perf_counter() - start)
    return {
        "policy": FL,
        "advance_microseconds_median": 1e6 * statistics.median(times),
        "repeats": repeats,
        "sandbox_compile_milliseconds": 1e3 * compile_seconds,
        "sandbox_run_milliseconds_median": 1e3 * statistics.median(runs),
        "direct_call_microseconds_median": 1e6 * statistics.median(direct),
        "sandbox_runs": sandbox_runs,
        **_library_overhead(max(1, repeats // 10)),
        **_large_union(union),
    }
