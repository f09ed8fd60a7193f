"""`fedveil bench ...`: the speed and memory benchmarks recorded in docs/benchmarks.md."""
