"""Workers: one engine each (PE, CE or NORMAL), on an engine thread, behind a gRPC server,
hosted by a Ray actor. `engine_host.py` runs the engine; `*_core.py` are the plain-Python
request handlers; `service.py` is the thin gRPC layer; `actor.py` the Ray actor."""
