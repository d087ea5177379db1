"""Benchmarks of tpcompile against other ways to run tensor parallelism (`python -m bench`)."""
