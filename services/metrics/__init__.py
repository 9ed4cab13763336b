"""Prometheus metrics, with vLLM-like names (`deepinfer:*`) and role/worker labels."""
