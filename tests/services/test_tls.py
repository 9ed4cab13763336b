"""TLS on the gateway's front door (`GatewayFront` with a `TLSConfig`): an HTTPS and a TLS gRPC
client that trust the server's CA are served; one that does not trust it, or talks plain text, is
refused; with `ca_certs` a client must show a certificate that CA signed, on both ports.
Real uvicorn and gRPC servers on 127.0.0.1 over a scripted worker; certificates made here."""

import asyncio
import ssl
import threading

import grpc
import httpx
import pytest

pytest.importorskip("cryptography")

from deepinfer_core.builtin import TINY_MODEL_DIR  # noqa: E402
from deepinfer_core.tokenizer import load_tokenizer  # noqa: E402
from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from services.controller.service import ClusterService  # noqa: E402
from services.gateway.core import GatewayConfig, GatewayCore  # noqa: E402
from services.gateway.front import GatewayFront  # noqa: E402
from services.gateway.router_client import LocalRouterClient  # noqa: E402
from services.gateway.tls import TLSConfig  # noqa: E402
from tests.helpers.scripted_worker import ScriptedWorker, scripted_router  # noqa: E402
from tests.helpers.tls import Certs, make_certs  # noqa: E402

BODY = {"model": "m", "prompt": [5, 1], "max_tokens": 4}


class Front:
    """A GatewayFront serving on a loop of its own thread, on free ports of 127.0.0.1."""

    def __init__(self, tls: TLSConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.front = self._run(self._start(tls))
        self.https = f"https://127.0.0.1:{self.front.http_port}"
        self.grpc_address = f"127.0.0.1:{self.front.grpc_port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self, tls: TLSConfig) -> GatewayFront:
        router = await scripted_router(ScriptedWorker())
        core = GatewayCore(GatewayConfig("m", 4096), load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(router))
        front = GatewayFront(core, ClusterService(router, lambda context: None), tls=tls)
        front.bind("127.0.0.1", 0, 0)
        await front.start()
        return front

    def stop(self) -> None:
        self._run(self.front.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def tls_front(certs):
    front = Front(TLSConfig(certfile=certs.server_cert, keyfile=certs.server_key))
    yield front
    front.stop()


@pytest.fixture(scope="module")
def mtls_front(certs):
    front = Front(TLSConfig(certfile=certs.server_cert, keyfile=certs.server_key, ca_certs=certs.ca))
    yield front
    front.stop()


def _trusting(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


def _grpc_models(address: str, credentials) -> gateway_pb2.ModelsReply:
    with grpc.secure_channel(address, credentials) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).Models(gateway_pb2.ModelsRequest(), timeout=10)


def test_a_client_trusting_the_ca_is_served_over_https_and_grpc(certs, tls_front):
    r = httpx.post(f"{tls_front.https}/v1/completions", json=BODY, verify=_trusting(certs.ca), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    reply = _grpc_models(tls_front.grpc_address, grpc.ssl_channel_credentials(certs.read(certs.ca)))
    assert [m.id for m in reply.models] == ["m"]
    with grpc.secure_channel(tls_front.grpc_address, grpc.ssl_channel_credentials(certs.read(certs.ca))) as ch:
        stream = gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(model="m", text="hi", params=common_pb2.SamplingParams(max_tokens=3)),
            timeout=30,
        )
        assert sum(len(m.delta.token_ids) for m in stream) == 3


def test_a_client_without_trust_or_without_tls_is_refused(certs, tls_front):
    for verify in (_trusting(certs.other_ca), True):  # an unrelated CA; the system's CAs
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{tls_front.https}/v1/models", verify=verify, timeout=10)
    with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
        httpx.get(tls_front.https.replace("https:", "http:") + "/v1/models", timeout=10)
    for credentials in (grpc.ssl_channel_credentials(certs.read(certs.other_ca)), None):
        with pytest.raises(grpc.RpcError) as e:
            if credentials is None:
                with grpc.insecure_channel(tls_front.grpc_address) as ch:
                    gateway_pb2_grpc.GatewayStub(ch).Models(gateway_pb2.ModelsRequest(), timeout=10)
            else:
                _grpc_models(tls_front.grpc_address, credentials)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_with_ca_certs_a_client_certificate_is_required(certs, mtls_front):
    mine = (certs.client_cert, certs.client_key)
    r = httpx.get(f"{mtls_front.https}/v1/models", verify=_trusting(certs.ca, mine), timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    ca, key, chain = (certs.read(p) for p in (certs.ca, certs.client_key, certs.client_cert))
    reply = _grpc_models(mtls_front.grpc_address, grpc.ssl_channel_credentials(ca, key, chain))
    assert [m.id for m in reply.models] == ["m"]

    stranger = (certs.stranger_cert, certs.stranger_key)  # a certificate another CA signed
    for context in (_trusting(certs.ca), _trusting(certs.ca, stranger)):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{mtls_front.https}/v1/models", verify=context, timeout=10)
    stranger_key, stranger_chain = certs.read(certs.stranger_key), certs.read(certs.stranger_cert)
    for credentials in (
        grpc.ssl_channel_credentials(ca),
        grpc.ssl_channel_credentials(ca, stranger_key, stranger_chain),
    ):
        with pytest.raises(grpc.RpcError) as e:
            _grpc_models(mtls_front.grpc_address, credentials)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_settings_that_make_no_server_are_refused_at_start(certs, tmp_path):
    with pytest.raises(ValueError, match="--ssl-certfile"):
        TLSConfig(ca_certs=certs.ca).check()
    TLSConfig(certfile=certs.server_cert, keyfile=certs.server_key, ca_certs=certs.ca).check()
    with pytest.raises(ValueError, match="TLS settings"):
        TLSConfig(certfile=certs.server_cert, keyfile=certs.client_key).check()  # the key of another cert
    assert TLSConfig().uvicorn_options() == {} and not TLSConfig().enabled
