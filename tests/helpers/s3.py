"""An S3-compatible server on 127.0.0.1 for the KV store's bucket tier: moto's, real HTTP S3 API
(the store reaches it through NIXL's OBJ plugin and boto3 alike)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.helpers.nixl import obj_plugin_problem

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_REGION": "us-east-1"}


def require_obj_plugin() -> None:
    """Skip the calling module unless NIXL's OBJ plugin and moto's server are both here."""
    pytest.importorskip("moto.server", reason="moto[server] (the dev extra) runs the S3 server")
    pytest.importorskip("boto3")
    problem = obj_plugin_problem()
    if problem is not None:
        pytest.skip(problem, allow_module_level=True)


@contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server's endpoint URL, with test credentials in the environment (engine processes
    started meanwhile inherit them) for as long as it runs."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(endpoint: str, name: str):
    """A new bucket on the server; returns a boto3 client of it."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return client


def objects(client, bucket: str) -> dict[str, int]:
    """Key -> size of every object in the bucket."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", ())}
