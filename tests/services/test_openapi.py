"""The served `/openapi.json` is complete (request bodies from the request models, every error
response), and a property-based run of schemathesis against it, through the gateway's real HTTP
server, finds no 5xx: whatever a client sends that the schema allows or not, a client error is a 4xx."""

import httpx
import pytest
from hypothesis import HealthCheck, settings

from services.gateway.core import GatewayConfig
from services.gateway.validation import INT32_MAX
from tests.helpers.front import ServedFront

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402


@pytest.fixture(scope="module")
def served():
    # a short context and few sequences: whatever is generated stays cheap to serve
    config = GatewayConfig("m", 64, max_concurrent_sequences=32)
    served = ServedFront(config)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def spec(served) -> dict:
    r = httpx.get(f"{served.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


def test_every_generate_route_declares_its_body_and_its_errors(spec):
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        post = spec["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert {"400", "401", "404", "413", "415", "422", "429", "500"} <= set(post["responses"])
        error = post["responses"]["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "Retry-After" in post["responses"]["429"]["headers"]
        assert model in schemas
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["top_k"]["anyOf"][0]["maximum"] == INT32_MAX
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "user", "assistant"]
    assert "ErrorDetail" in schemas and "StreamOptions" in schemas


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_makes_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=30)
