"""Benchmarks: each script prints its tables and ratios and runs both as `python benchmarks/X.py` and
as `python -m benchmarks.X` from the repository root; the kernel bench is the `kernel_bench` package
(`python -m benchmarks.kernel_bench`). Measured results are kept in docs/benchmarks.md."""
