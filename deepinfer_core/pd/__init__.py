"""Prefill/decode disaggregation: the PROMPT and COMPLETION engines."""
