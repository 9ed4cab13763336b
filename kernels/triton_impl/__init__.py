"""Triton implementations of the ops in `kernels.ops`; imported lazily by `kernels.registry`.

Each module here imports triton at the top: nothing outside `kernels.ops` and the bench
imports them directly.
"""
