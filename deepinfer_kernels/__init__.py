"""Kernels: each op has a pure-torch reference (the CPU path) beside its Triton kernel.

This package imports only torch (and triton lazily); it knows nothing of the engine.
"""
