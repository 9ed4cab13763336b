"""Pieces every service shares: error codes and the one mapping of engine errors, typed messages
(deltas, worker info and load, prefill results) and their proto forms, the request limits, the
stream merge, and gRPC / asyncio set-up."""
