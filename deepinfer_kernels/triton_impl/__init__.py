"""Triton implementations of the ops in `deepinfer_kernels.ops`; imported lazily by `deepinfer_kernels.registry`.

Each module here imports triton at the top: nothing outside `deepinfer_kernels.ops` and the bench
imports them directly.
"""
