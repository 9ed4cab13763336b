"""The S3 calls of the KV store's bucket tier that NIXL's OBJ plugin does not make: reach, list, delete.

NIXL moves the entries' bytes (PUT, ranged GET) and answers which objects exist (HEAD); it has
no call that lists a bucket or deletes an object, and the byte limit needs both. Those go through
boto3 (the `s3` extra) to the same endpoint with the same credentials (the standard AWS chain:
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, a profile, an instance role).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUFFIX = ".kvblock"
AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",
)
"""The standard AWS variables a bucket store reads; `deepinfer serve` hands those it has to the
engines of a Ray cluster started elsewhere (whose workers do not inherit its environment)."""
_DELETE_BATCH = 1000  # S3's most keys per DeleteObjects


class StoreUnreachable(ValueError):
    """The store's bucket cannot be used; the message names the cause."""


@dataclass
class Listed:
    key: bytes
    size: int
    modified: float
    """Seconds since the epoch."""


class Bucket:
    def __init__(self, bucket: str, prefix: str, endpoint: str | None = None, region: str | None = None):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise StoreUnreachable(
                f"an s3:// KV store needs boto3 to list and delete objects ({e}): pip install 'deepinfer[s3]'"
            ) from e
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(
            connect_timeout=5,
            read_timeout=30,
            retries={"max_attempts": 3, "mode": "standard"},
            # S3-compatible stores (MinIO, Ceph) need not know the newer default checksum headers
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self.client = boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)
        except ValueError as e:  # a malformed endpoint
            raise StoreUnreachable(f"KV store {self.url}: {e}") from e

    def object_key(self, key: bytes) -> str:
        return f"{self.prefix}{key.hex()}{SUFFIX}"

    def check(self) -> None:
        """Raise StoreUnreachable unless the bucket answers (exists, and these credentials may use it)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            why = {"404": "no such bucket", "NoSuchBucket": "no such bucket", "403": "access denied"}.get(code, code)
            raise StoreUnreachable(f"KV store {self.url}: {why} ({e})") from e
        except BotoCoreError as e:  # no credentials, endpoint unreachable, bad URL
            raise StoreUnreachable(f"KV store {self.url}: {e}") from e

    def list(self) -> Iterator[Listed]:
        """The entries under the prefix (one request per 1000)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for obj in page.get("Contents", ()):
                name = obj["Key"][len(self.prefix) :]
                if not name.endswith(SUFFIX) or "/" in name:
                    continue
                try:
                    key = bytes.fromhex(name[: -len(SUFFIX)])
                except ValueError:
                    continue
                yield Listed(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def delete(self, keys: list[bytes]) -> None:
        """Delete the entries of `keys` (those already gone are no error)."""
        for i in range(0, len(keys), _DELETE_BATCH):
            chunk = keys[i : i + _DELETE_BATCH]
            answer = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": self.object_key(k)} for k in chunk], "Quiet": True}
            )
            for error in answer.get("Errors", ()):
                logger.warning("deleting %s from %s failed: %s", error.get("Key"), self.url, error.get("Message"))


def engine_env(environ: dict[str, str]) -> dict[str, str]:
    """The AWS variables of `environ` that engines need to reach the bucket."""
    return {name: environ[name] for name in AWS_ENV if environ.get(name)}
