"""Wire formats of the cluster (package `deepinfer.v1`) and their generated modules.

`make proto` regenerates `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` from the `.proto`
files; `tests/services/test_proto.py` fails when they are stale.
"""
