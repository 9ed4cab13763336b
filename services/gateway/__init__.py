"""The gateway: OpenAI-compatible HTTP (`http_app.py`) and gRPC (`grpc_service.py`) over one
core (`core.py`) that validates, tokenizes and streams from the router."""
