"""The kernel bench: every Triton kernel checked against its torch reference (`checks`), timed at
its target shapes against the device's copy and matmul ceilings (`timing`), and whole engine steps
at a real model's shapes (`engine_run`). Run it as `python -m benchmarks.kernel_bench` (`cli`)."""
