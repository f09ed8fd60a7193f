"""FDML rounds per second with each of the enclave-boundary speed-ups turned off, side by side.

``python benchmarks/fdml_rounds_ablation.py [--reps 3] [--rounds 10]`` runs ``fedveil bench rounds``'s
measurement (64 participants x 8 samples, enclave in its own process) in a fresh process per variant, the
variants interleaved rep by rep so that a change in the machine's load hits them alike, and prints the
median rounds/s of each:

- ``pipe, no heap retention``: the transport and allocator as before (requests through the pipe).
- ``shared memory``: large requests through the shared memfd region.
- ``+ enclave heap``: and the enclave process keeps freed memory (glibc tunables).
- ``+ host heap``: and the host too (``fedveil.core.heap.retain_freed_memory``): what fedveil runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = {
    "pipe, no heap retention": {"shared": False, "enclave_heap": False, "host_heap": False},
    "shared memory": {"shared": True, "enclave_heap": False, "host_heap": False},
    "+ enclave heap": {"shared": True, "enclave_heap": True, "host_heap": False},
    "+ host heap": {"shared": True, "enclave_heap": True, "host_heap": True},
}

ONE = """
import json, sys
import fedveil.experiments.bench.rounds as br
import fedveil.runtime.enclave_host as eh
from fedveil.core.heap import HEAP_RETAINING_ENV
v = json.loads(sys.argv[1])
if not v["shared"]:
    eh.SHARED_MIN_BYTES = 1 << 62
if not v["enclave_heap"]:
    eh.ENCLAVE_ENV = {k: x for k, x in eh.ENCLAVE_ENV.items() if k not in HEAP_RETAINING_ENV}
if not v["host_heap"]:
    br.retain_freed_memory = lambda: False
print(json.dumps(br.bench_rounds(rounds=int(sys.argv[2]), repeats=1)["rounds_per_second"]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each variant (default 3)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run (default 10)")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        for name, variant in VARIANTS.items():
            done = subprocess.run(
                [sys.executable, "-c", ONE, json.dumps(variant), str(args.rounds)],
                capture_output=True,
                text=True,
                check=True,
            )
            rates[name].append(float(done.stdout.strip().splitlines()[-1]))
            print(f"rep {rep + 1}: {name}: {rates[name][-1]:.3f} rounds/s", file=sys.stderr)
    base = statistics.median(rates["pipe, no heap retention"])
    rows = [
        {
            "variant": name,
            "rounds_per_second_median": statistics.median(r),
            "runs": r,
            "vs_pipe": statistics.median(r) / base,
        }
        for name, r in rates.items()
    ]
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
