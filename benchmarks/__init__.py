"""Benchmarks: ratios against reference implementations, measured side by side in one run."""
