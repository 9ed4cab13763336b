"""DeepInfer services: gateway, router, workers, cluster controller and the CLI.

All networking and Ray live here; the engine (`deepinfer_core`) knows none of it.
"""
