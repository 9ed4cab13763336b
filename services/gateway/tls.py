"""TLS on the gateway's public ports: HTTPS (uvicorn) and gRPC over TLS, from one set of files.

With `ca_certs` a client must present a certificate signed by one of those CAs (mutual TLS) on
both ports. Every API process (`--api-workers`) reads the same files: each serves its own TLS
sessions on the shared ports.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Optional

import grpc


@dataclass(frozen=True)
class TLSConfig:
    certfile: Optional[str] = None
    """The server's certificate chain (PEM); None: plain HTTP and insecure gRPC."""
    keyfile: Optional[str] = None
    """Its private key (PEM); None: in `certfile`."""
    ca_certs: Optional[str] = None
    """CA bundle (PEM) of the client certificates, which are then required."""

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def check(self) -> None:
        """ValueError when the settings do not make a server configuration."""
        if not self.enabled and (self.keyfile or self.ca_certs):
            raise ValueError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile")
        if self.enabled:
            try:  # every file read now: a bad one fails the start, not each connection
                self.server_context()
            except ssl.SSLError as e:
                raise ValueError(f"TLS settings: {e}") from None

    def uvicorn_options(self) -> dict:
        """uvicorn.Config's TLS arguments."""
        if not self.enabled:
            return {}
        options = {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}
        if self.ca_certs:
            options.update(ssl_ca_certs=self.ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    def grpc_credentials(self) -> grpc.ServerCredentials:
        with open(self.certfile, "rb") as f:
            chain = f.read()
        key = chain
        if self.keyfile:
            with open(self.keyfile, "rb") as f:
                key = f.read()
        ca = None
        if self.ca_certs:
            with open(self.ca_certs, "rb") as f:
                ca = f.read()
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs:
            context.load_verify_locations(self.ca_certs)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    @property
    def http_scheme(self) -> str:
        return "https" if self.enabled else "http"
