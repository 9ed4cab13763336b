"""A prefill engine SIGKILLed mid-prefill under `deepinfer serve --api-workers 2`, its requests all
routed by the extra API process (not the head, where the controller sees the death): the CE
reservations that process's router had handed the dead PE are fenced, then freed within seconds of
the death — the head relays it with the registry the extra process mirrors — not after the lease
and its grace (45 s). Every request is retried on the replacement and completes."""

import threading
import time

import httpx
import pytest

from services.gateway.front import PROCESS_HEADER
from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, metric_value, wait_until
from tests.helpers.faults import (
    PREFILL,
    complete,
    kill,
    long_prompt,
    wait_at_rest,
    wait_fence_lifted,
    workers,
)

REQUESTS = 16


@pytest.fixture(scope="module")
def serve(cluster):
    s = ServeProcess("--ray-address", cluster.ray_address, "--api-workers", "2", *SMALL_ENGINE)
    yield s
    s.stop()


def _clients_on(serve, process: int, count: int, attempts: int = 400) -> list[httpx.Client]:
    """`count` clients whose kept-alive connection the kernel gave to API process `process`."""
    clients = []
    for _ in range(attempts):
        client = httpx.Client(timeout=240)
        if client.get(f"{serve.url}/health").headers[PROCESS_HEADER] == str(process):
            clients.append(client)
            if len(clients) == count:
                return clients
        else:
            client.close()
    for client in clients:
        client.close()
    raise AssertionError(f"in {attempts} connections only {len(clients)} reached API process {process}")


def _prefills_in_flight(serve) -> float:
    """Prefill calls the routers have sent and not seen end, summed over the API processes (a PE
    picked, less the hand-offs timed): the routers' own count, not an engine's poll, which a short
    prefill slips between."""
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    picked = metric_value(text, "deepinfer:router_decisions_total", pool="prefill")
    return picked - metric_value(text, "deepinfer:kv_transfer_seconds_count")


def test_a_prefill_engine_killed_under_an_extra_api_process_frees_its_reservations_in_seconds(serve):
    lifted = serve.metric("deepinfer:kv_fences_lifted_total")  # every process's, summed
    clients = _clients_on(serve, 1, REQUESTS)
    before = _prefills_in_flight(serve)
    results: list = [None] * REQUESTS

    def send(i: int) -> None:
        body = {"prompt": long_prompt(i), "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        try:
            results[i] = clients[i].post(f"{serve.base_url}/completions", json=body)
        except httpx.HTTPError as e:
            results[i] = e

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(REQUESTS)]
    try:
        for t in threads:
            t.start()
        # process 1's router has 3 or more prefill calls on the PE, their targets handed out
        assert wait_until(lambda: _prefills_in_flight(serve) >= before + 3, timeout_s=60, interval_s=0.02)
        victim = workers(serve, PREFILL)[0]
        kill(victim)
        killed_at = time.monotonic()
        # the counter, not the polled gauge (a fence lifted within a poll is never seen there): the
        # moment process 1's router freed a reservation it had fenced against the dead PE
        lifted_at = wait_until(
            lambda: serve.metric("deepinfer:kv_fences_lifted_total") >= lifted + 1 and time.monotonic(),
            timeout_s=60,
            interval_s=0.1,
        )
        freed_after, fenced_seen = wait_fence_lifted(serve, killed_at, timeout_s=60)
        for t in threads:
            t.join(240)
    finally:
        for client in clients:
            client.close()
    outcomes = [(r.status_code, r.headers[PROCESS_HEADER]) if isinstance(r, httpx.Response) else r for r in results]
    lift_after = lifted_at - killed_at if lifted_at else float("inf")
    print(
        f"PE killed under API process 1: a fence lifted {lift_after:.1f} s after the kill, fenced reservations "
        f"seen {fenced_seen}, none left {freed_after:.1f} s after it; outcomes {outcomes}; "
        f"reservation lease renewals {serve.metric('deepinfer:lease_renewals_total', stage='decode'):.0f}"
    )
    # the kill cut prefills process 1 had handed out, and the death was relayed to its router: their
    # fences were lifted within seconds (the head had none of these requests), not after 45 s
    assert lift_after < 10.0
    assert freed_after < 10.0
    assert all(isinstance(o, tuple) and o[0] == 200 for o in outcomes), outcomes  # every request completed
    # by process 1, on the connection it was pinned to (rarely one is made again: the kernel may
    # then give it to the head; the fence above was process 1's all the same)
    assert [o[1] for o in outcomes].count("1") >= REQUESTS - 2, outcomes
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)
    assert [w.info.worker_id for w in workers(serve, PREFILL)] != [victim.info.worker_id]
    assert complete(serve, "and the next one", 4, ignore_eos=True)["finish_reason"] == "length"
    view = wait_at_rest(serve, timeout_s=30)
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view
