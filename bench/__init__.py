"""Benchmarks: speed and accuracy figures, printed (not asserted); see bench/README.md."""
