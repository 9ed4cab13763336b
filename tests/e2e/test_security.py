"""A secured `deepinfer serve` on one machine: API keys from the flag, a key file and
$DEEPINFER_API_KEYS (any accepted, others 401, in every API process), HTTPS and gRPC over TLS with
client certificates required, `deepinfer status` over that TLS, internal ports that refuse calls
without the cluster token, and no listening socket of the whole process tree (Ray's GCS, raylet,
agents and workers, the engines' UCX, the extra API process) outside the loopback interface.

Its own Ray cluster (not the package's shared one): Ray's own listeners are part of what is checked."""

import ssl

import grpc
import httpx
import pytest

pytest.importorskip("cryptography")

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc, router_pb2_grpc, worker_pb2_grpc  # noqa: E402
from services.gateway.front import PROCESS_HEADER  # noqa: E402
from tests.helpers.cluster import SMALL_ENGINE, ServeProcess  # noqa: E402
from tests.helpers.sockets import listeners  # noqa: E402
from tests.helpers.tls import Certs, make_certs  # noqa: E402

KEYS = ["k-flag", "k-file-1", "k-file-2", "k-env-1", "k-env-2"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def serve(certs, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# one key a line\n{KEYS[1]}\n\n  {KEYS[2]}  \n")
    tls = ["--ssl-certfile", certs.server_cert, "--ssl-keyfile", certs.server_key, "--ssl-ca-certs", certs.ca]
    s = ServeProcess(
        *("--api-key", KEYS[0], "--api-key-file", str(key_file), *tls, "--api-workers", "2", *SMALL_ENGINE),
        env={"DEEPINFER_API_KEYS": f"{KEYS[3]}, {KEYS[4]}"},
    )
    yield s
    s.stop()


def _https(certs: Certs, client_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs.ca)
    if client_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return context


def _grpc_credentials(certs: Certs, client_cert: bool = True) -> grpc.ChannelCredentials:
    if not client_cert:
        return grpc.ssl_channel_credentials(certs.read(certs.ca))
    return grpc.ssl_channel_credentials(*(certs.read(p) for p in (certs.ca, certs.client_key, certs.client_cert)))


def _models(serve, context, key: str) -> tuple[int, str]:
    """One new connection: (status, the API process that answered)."""
    with httpx.Client(verify=context, timeout=30) as client:
        r = client.get(f"{serve.base_url}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    return r.status_code, r.headers.get(PROCESS_HEADER, "")


def test_every_key_from_flag_file_and_env_is_accepted_by_every_process_and_others_get_401(serve, certs):
    assert serve.url.startswith("https://")
    context = _https(certs)
    seen = {key: set() for key in KEYS}
    for _ in range(12):  # new connections: the kernel spreads them over both API processes
        for key in KEYS:
            status, process = _models(serve, context, key)
            assert status == 200, key
            seen[key].add(process)
        if all(len(p) == 2 for p in seen.values()):
            break
    assert all(p == {"0", "1"} for p in seen.values()), seen
    for wrong in ("k-other", "", "k-flagk-file-1", "# one key a line"):
        assert {_models(serve, context, wrong)[0] for _ in range(4)} == {401}


def test_https_and_grpc_over_tls_need_a_client_certificate(serve, certs):
    body = {"model": "deepinfer-tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEYS[3]}"}
    r = httpx.post(f"{serve.base_url}/completions", json=body, headers=auth, verify=_https(certs), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{serve.base_url}/models", headers=auth, verify=_https(certs, client_cert=False), timeout=10)

    request = gateway_pb2.GenerateRequest(text="Hello", params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    metadata = [("authorization", f"Bearer {KEYS[2]}")]
    with grpc.secure_channel(serve.grpc_address, _grpc_credentials(certs)) as ch:
        replies = list(gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=60, metadata=metadata))
        assert sum(len(m.delta.token_ids) for m in replies) == 3
        with pytest.raises(grpc.RpcError) as e:
            gateway_pb2_grpc.GatewayStub(ch).Models(gateway_pb2.ModelsRequest(), timeout=10)  # no key
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(serve.grpc_address, _grpc_credentials(certs, client_cert=False)) as ch:
        with pytest.raises(grpc.RpcError) as e:
            gateway_pb2_grpc.GatewayStub(ch).Models(gateway_pb2.ModelsRequest(), timeout=10, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_deepinfer_status_works_over_tls_with_a_key(serve, certs):
    tls = ["--ssl-ca-certs", certs.ca, "--ssl-certfile", certs.client_cert, "--ssl-keyfile", certs.client_key]
    r = serve.cli("status", "--api-key", KEYS[1], *tls, timeout_s=60)
    assert r.returncode == 0, r.stderr
    assert "ready" in r.stdout and "prefill pool: 1 worker" in r.stdout
    r = serve.cli("status", *tls, timeout_s=60)
    assert r.returncode == 2 and "UNAUTHENTICATED" in r.stderr


def _worker_addresses(serve, certs) -> list[str]:
    with grpc.secure_channel(serve.grpc_address, _grpc_credentials(certs)) as ch:
        status = gateway_pb2_grpc.ClusterStub(ch).Status(
            common_pb2.StatusRequest(), timeout=10, metadata=[("authorization", f"Bearer {KEYS[0]}")]
        )
    return [w.info.address for p in status.pools for w in p.workers]


def test_the_router_and_the_workers_refuse_calls_without_the_cluster_token(serve, certs):
    workers = _worker_addresses(serve, certs)
    assert len(workers) >= 2 and serve.router_address  # prefill, decode (and an encoder for a vision model)
    calls = [(serve.router_address, router_pb2_grpc.RouterStub, "Status")]
    calls += [(address, worker_pb2_grpc.WorkerStub, "Stats") for address in workers]
    for address, stub_class, method in calls:
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub_class(ch), method)(common_pb2.StatusRequest(), timeout=10, metadata=[])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, address


def test_nothing_of_the_process_tree_listens_outside_loopback(serve, certs):
    found = listeners(serve.proc.pid)
    ports = {listener.port for listener in found}
    public = [int(a.rsplit(":", 1)[1]) for a in (serve.url, serve.grpc_address)]
    internal = [int(a.rsplit(":", 1)[1]) for a in (serve.router_address, *_worker_addresses(serve, certs))]
    assert set(public + internal) <= ports  # the listing sees the servers it must see
    assert any("gcs_server" in listener.command for listener in found)  # and Ray's
    outside = [listener for listener in found if not listener.loopback]
    assert not outside, "\n".join(f"{x.protocol} {x.address}:{x.port} pid {x.pid} {x.command[:120]}" for x in outside)
