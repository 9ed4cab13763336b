"""`deepinfer serve --decode 2 --decode-ep 2`: each decode engine is an instance of two ranks (two
Ray actors, gloo), each rank a decode target of its own. Greedy outputs equal the single-process
engine's, the requests land on every rank, status and /metrics show each rank, the pool scales by
whole instances, and a dead rank fails only its own instance: the other keeps serving."""

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from deepinfer_core import LLM, SamplingParams
from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, metric_value, wait_until
from tests.helpers.faults import Streams

PROMPTS = ["Hello, my name is", "The capital of France is", "x", "A much longer prompt " * 12] * 2
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def wide(cluster):
    # no migration: a stream on the broken instance ends with an error, so the ones that finish
    # whole are exactly those the other instance was serving
    serve = ServeProcess("--decode", "2", "--decode-ep", "2", "--migration-limit", "0",
                         "--ray-address", cluster.ray_address, *SMALL_ENGINE)  # fmt: skip
    yield serve
    serve.stop()


def _complete(serve: ServeProcess, prompt: str) -> str:
    client = openai.OpenAI(base_url=serve.base_url, api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model="deepinfer-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    return r.choices[0].text


@pytest.fixture(scope="module")
def served(wide) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the router spreads them over the ranks
        return list(pool.map(lambda p: _complete(wide, p), PROMPTS))


@pytest.mark.timeout(600)
def test_greedy_outputs_equal_the_single_process_engine(served):
    llm = LLM(max_model_len=512, block_size=16, num_gpu_blocks=512, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert served == [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def _rank_workers(text: str) -> list[str]:
    return sorted(set(re.findall(r'worker="(decode-\d+\.\d+)"', text)))


def test_requests_land_on_every_rank_and_metrics_show_each_rank(wide, served):
    def every_rank_counted() -> str:
        # the gateway's view of the workers' counters is as fresh as its last poll of them
        text = httpx.get(f"{wide.url}/metrics", timeout=10).text
        ranks = _rank_workers(text)
        served = all(metric_value(text, "deepinfer:handoffs_total", worker=w) >= 1 for w in ranks)
        return text if len(ranks) == 4 and served else ""

    text = wait_until(every_rank_counted, timeout_s=30) or httpx.get(f"{wide.url}/metrics", timeout=10).text
    ranks = _rank_workers(text)
    assert len(ranks) == 4, ranks
    for worker in ranks:
        assert metric_value(text, "deepinfer:handoffs_total", worker=worker) >= 1, worker
    assert sum(metric_value(text, "deepinfer:dummy_steps_total", worker=w) for w in ranks) >= 1
    for name in ("deepinfer:eplb_rearrangements_total", "deepinfer:moe_load_imbalance"):
        assert f'{name}{{role="decode",worker="{ranks[0]}"}}' in text


def test_status_counts_instances_and_shows_each_rank(wide, served):
    r = wide.cli("status")
    assert r.returncode == 0, r.stderr
    assert "decode pool: 2 instance(s) of 2 ranks (4 rank workers), target 2" in r.stdout, r.stdout
    assert len(re.findall(r"decode-\d+\.0 .* 0/2", r.stdout)) == 2, r.stdout
    assert len(re.findall(r"decode-\d+\.1 .* 1/2", r.stdout)) == 2, r.stdout


def _decode_ranks(serve) -> dict[str, list]:
    """Instance id -> its rank workers in the router, by rank."""
    from tests.e2e.test_scaling_and_faults import _status

    instances: dict[str, list] = {}
    for w in next((p.workers for p in _status(serve).pools if p.pool == 3), []):
        instances.setdefault(w.info.worker_id.rsplit(".", 1)[0], []).append(w)
    return {i: sorted(ws, key=lambda w: w.info.worker_id) for i, ws in instances.items()}


@pytest.mark.timeout(400)
def test_scale_removes_and_adds_whole_instances(wide, served):
    before = _decode_ranks(wide)
    streams = Streams(wide, ["scale me"] * 4, 60, ignore_eos=True)  # the drained instance's streams finish first
    r = wide.cli("scale", "--decode", "1")
    assert r.returncode == 0, r.stderr
    assert "decode pool: 1 instance(s) of 2 ranks (2 rank workers), target 1" in r.stdout, r.stdout
    left = _decode_ranks(wide)
    assert len(left) == 1 and set(left) < set(before) and len(next(iter(left.values()))) == 2, left
    assert all(errors == [] and reasons == ["length"] for reasons, errors in streams.join())
    r = wide.cli("scale", "--decode", "2")
    assert r.returncode == 0, r.stderr
    assert "decode pool: 2 instance(s) of 2 ranks (4 rank workers), target 2" in r.stdout, r.stdout
    after = _decode_ranks(wide)
    (added,) = set(after) - set(left)
    assert [w.info.worker_id for w in after[added]] == [f"{added}.0", f"{added}.1"]
    assert _complete(wide, "after the scale") != ""


@pytest.mark.timeout(400)
def test_a_killed_rank_fails_only_its_instance_which_is_replaced_while_the_other_keeps_serving(wide, served):
    """Last in the module: it breaks an instance. Both its ranks leave the router (the survivor's
    peer monitor ends its process, the controller sees a rank's actor die) and its streams end
    with an error; the other instance's streams finish whole, new requests succeed during the
    outage, and the controller replaces the broken instance whole."""

    streams = Streams(wide, ["scale me"] * 8, 300, ignore_eos=True)
    assert wait_until(lambda: min(streams.chunks) >= 2, timeout_s=120)  # all eight are decoding
    instances = _decode_ranks(wide)
    assert len(instances) == 2 and all(len(r) == 2 for r in instances.values()), instances
    broken, healthy = sorted(instances, key=lambda i: -sum(w.inflight for w in instances[i]))
    on_healthy = sum(w.inflight for w in instances[healthy])
    assert on_healthy >= 1 and sum(w.inflight for w in instances[broken]) >= 1, instances
    os.kill(instances[broken][1].info.pid, signal.SIGKILL)
    started = time.monotonic()

    assert wait_until(lambda: broken not in _decode_ranks(wide), timeout_s=60), "the broken instance left the router"
    outage = [_complete(wide, p) for p in PROMPTS[:3]]  # served by the healthy instance alone
    assert all(outage) and broken not in _decode_ranks(wide)
    results = streams.join()
    assert time.monotonic() - started < 180
    assert all(errors or reasons == ["length"] for reasons, errors in results), results
    whole = [r for r in results if r == (["length"], [])]
    assert len(whole) >= on_healthy, (on_healthy, results)
    assert len(whole) < len(results), "the broken instance's streams ended with an error"
    assert healthy in _decode_ranks(wide) and len(_decode_ranks(wide)[healthy]) == 2

    def replaced() -> bool:
        now = _decode_ranks(wide)
        return len(now) == 2 and broken not in now and all(len(r) == 2 for r in now.values())

    assert wait_until(replaced, timeout_s=240), _decode_ranks(wide)
    assert _complete(wide, "after the replacement") != ""
