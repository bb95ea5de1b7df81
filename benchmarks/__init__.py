"""Benchmarks of autotune's speed claims: ``python -m benchmarks`` (see run.py and RESULTS.md)."""
