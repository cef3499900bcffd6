"""DTorch benchmarks: `python -m benchmarks [--only a,b] [--quick]` (see benchmarks/__main__.py)."""
