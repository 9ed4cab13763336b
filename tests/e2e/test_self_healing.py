"""Engines killed with SIGKILL under load, against `deepinfer serve` (1 PE + 2 CE): no request is lost
(streams on a killed CE migrate and end with the undisturbed text), the pool heals to its target by
itself, the PE lets go of the dead CE's transfer agent, `deepinfer scale` afterwards does what it
says, and every stage ends at rest."""

import httpx
import pytest

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, wait_until
from tests.helpers.faults import DECODE, PREFILL, Streams, complete, kill, wait_at_rest, workers

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
    streams = Streams(serve, PROMPTS, MAX_TOKENS, ignore_eos=True)
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
    fenced = {w.info.worker_id: 1 for w in workers(serve, DECODE)}  # one reservation's block, at most
    view = wait_at_rest(serve, prefix_blocks=fenced)
    assert all(v[:3] == (0, 0, 0) and v[4] == 0 and v[3] <= fenced.get(w, 0) for w, v in view.items()), view
