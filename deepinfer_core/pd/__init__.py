"""Prefill/decode disaggregation: the PROMPT and COMPLETION engines and a two-process harness."""
