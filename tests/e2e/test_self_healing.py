"""Engines killed with SIGKILL under load, against `deepinfer serve` (1 PE + 2 CE): no request is lost
(streams on a killed CE migrate and end with the undisturbed text), the pool heals to its target by
itself, the PE lets go of the dead CE's transfer agent, `deepinfer scale` afterwards does what it
says, and every stage ends at rest."""

import threading

import httpx
import pytest

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, wait_until
from tests.helpers.faults import (
    DECODE,
    PREFILL,
    Streams,
    complete,
    kill,
    long_prompt,
    wait_at_rest,
    wait_fence_lifted,
    workers,
)

PROMPTS = [f"story {i}: once upon a time" for i in range(4)]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def serve(cluster):
    s = ServeProcess("--ray-address", cluster.ray_address, "--decode", "2", *SMALL_ENGINE)
    yield s
    s.stop()


def _differences(texts: list[str], reference: list[str]) -> str:
    """Where each differing stream leaves the reference, with the text around it."""
    out = []
    for i, (got, want) in enumerate(zip(texts, reference)):
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.append(
                f"stream {i} at char {k} of {len(want)} (got {len(got)}): {want[max(0, k - 30) : k + 30]!r} != {got[max(0, k - 30) : k + 30]!r}"
            )
    return "; ".join(out)


def _others(serve, pool: int, gone: str) -> list:
    return [w for w in workers(serve, pool) if w.info.worker_id != gone]


def test_a_decode_engine_killed_under_four_greedy_streams_loses_none_and_the_pool_heals(serve):
    reference = [complete(serve, p, MAX_TOKENS, ignore_eos=True)["text"] for p in PROMPTS]
    restarts = serve.metric("deepinfer:worker_restarts_total", pool="decode")
    migrations = serve.metric("deepinfer:migrations_total")
    streams = Streams(serve, PROMPTS, MAX_TOKENS, ignore_eos=True, temperature=0)
    assert wait_until(lambda: min(streams.chunks) >= 2, timeout_s=120)  # all four are decoding
    victim = max(workers(serve, DECODE), key=lambda w: w.inflight)
    kill(victim)
    results = streams.join()
    assert results == [(["length"], [])] * 4, results
    assert streams.texts == reference, _differences(streams.texts, reference)  # greedy: the undisturbed text
    assert victim.inflight >= 1 and serve.metric("deepinfer:migrations_total") >= migrations + 1
    assert wait_until(lambda: len(_others(serve, DECODE, victim.info.worker_id)) == 2, timeout_s=180)
    assert serve.metric("deepinfer:worker_restarts_total", pool="decode") == restarts + 1
    # the PE let go of the dead CE's agent: one peer per live CE, none stale
    assert wait_until(lambda: workers(serve, PREFILL)[0].load.transfer_peers == 2, timeout_s=30)
    view = wait_at_rest(serve)
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view


def test_scale_after_a_death_does_what_it_says(serve):
    victim = workers(serve, DECODE)[0]
    kill(victim)
    r = serve.cli("scale", "--decode", "1")  # the dead engine is not counted as one of the pool
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: len(workers(serve, DECODE)) == 1, timeout_s=30)
    assert victim.info.worker_id not in {w.info.worker_id for w in workers(serve, DECODE)}
    r = serve.cli("status")
    assert r.returncode == 0 and "decode pool: 1 worker(s), target 1" in r.stdout, r.stdout
    assert complete(serve, "still here", 4, ignore_eos=True)["finish_reason"] == "length"


def test_requests_wait_for_a_killed_prefill_engine_s_replacement(serve):
    """The only PE dies: a request sent at once waits (within its admission deadline) for the new
    one and succeeds; nothing is held afterwards but the fenced blocks of a reservation the dead PE
    was given (it never confirmed an abort, so they wait out the lease: a late write cannot land)."""
    victim = workers(serve, PREFILL)[0]
    kill(victim)
    r = httpx.post(
        f"{serve.base_url}/completions",
        json={"prompt": "after the prefill engine died", "max_tokens": 5, "ignore_eos": True},
        timeout=240,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert [w.info.worker_id for w in workers(serve, PREFILL)] != [victim.info.worker_id]
    view = wait_at_rest(serve)  # a reservation the dead PE was given is freed once its death is seen
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view


def test_a_prefill_engine_killed_mid_prefill_of_long_prompts_frees_the_reservations_in_seconds(serve):
    """The PE is SIGKILLed while the long prompts it was given are prefilling: the CE reservations it
    was writing into are fenced (it never confirmed an abort), then freed as soon as its death is seen
    — within seconds, not the lease and its grace. Every request is retried on the replacement and
    completes (or ends with a clear error), the next request succeeds, and every stage is at rest."""
    import time

    retries = serve.metric("deepinfer:router_retries_total")
    prompts = [long_prompt(i) for i in range(24)]
    results: list = [None] * len(prompts)

    def send(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        try:
            results[i] = httpx.post(f"{serve.base_url}/completions", json=body, timeout=240)
        except httpx.HTTPError as e:
            results[i] = e

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # the router's own count: prefill calls in flight on the PE now, their targets handed out
    assert wait_until(lambda: workers(serve, PREFILL)[0].inflight >= 3, timeout_s=60, interval_s=0.02)
    victim = workers(serve, PREFILL)[0]
    kill(victim)
    freed_after, fenced_seen = wait_fence_lifted(serve, time.monotonic())
    for t in threads:
        t.join(240)
    codes = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in results]
    others = [
        (c, r.text if isinstance(r, httpx.Response) else r) for c, r in zip(codes, results) if c not in (200, 503)
    ]
    assert not others, f"{others}\nthe server's errors:\n{serve.error_output()}"  # only these: a long list is cut
    for r in results:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 4
        else:  # a clear error, never a hang or a wrong answer
            assert "error" in r.json(), r.text
    assert serve.metric("deepinfer:router_retries_total") > retries  # prefills were cut by the kill
    print(
        f"PE killed: fenced reservations seen {fenced_seen}, all freed {freed_after:.1f} s after the kill; "
        f"{codes.count(200)}/{len(codes)} completed"
    )
    assert freed_after < 10.0
    assert complete(serve, "and the next one", 4, ignore_eos=True)["finish_reason"] == "length"
    view = wait_at_rest(serve, timeout_s=30)
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view
