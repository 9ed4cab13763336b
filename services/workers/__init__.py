"""Workers: one engine each (PE, CE or NORMAL), on an engine thread, behind a gRPC server,
hosted by a Ray actor. `roles.py` says which engine, core and servicer each pool runs;
`engine_host.py` runs the engine; `decode_core.py` / `prefill_core.py` are the plain-Python
request handlers; `service.py` the thin gRPC layer; `worker_server.py` the process (and its
Ray actor)."""
