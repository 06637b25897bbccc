"""Benchmarks of longrun against raw floors measured in the same run (`python -m sim.bench`).

Not part of the tests. The server runs in its own process (`sim.bench.server`)
pinned to core 1, the load generator on core 0; every figure is printed with its
floor, the ratio, the target and PASS/FAIL. `python -m sim.bench --smoke` runs every target at a
small size without verdicts (CI runs it after the tests).
"""
