"""Benchmarks (run as scripts: `python bench/<name>.py`); see bench/README.md."""
