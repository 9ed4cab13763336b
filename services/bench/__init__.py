"""`deepinfer bench`: a load generator and latency meter for any OpenAI-compatible server.

`serve` drives one load (a dataset, an arrival process) against an endpoint and reports TTFT,
TPOT, ITL, E2E latency, throughput and goodput, with the result JSON laid out as `vllm bench
serve` lays its own, so results from either tool can be read by the same scripts. `sweep`
starts `deepinfer serve` in several configurations and finds each one's goodput over a range
of request rates.
"""
