"""`deepinfer serve --decode-ep 2`: the decode engine is an instance of two ranks (two Ray actors,
gloo), each a decode target of its own. Greedy outputs equal the single-process engine's, the
requests land on both ranks, and status and /metrics show each rank."""

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

PROMPTS = ["Hello, my name is", "The capital of France is", "x", "A much longer prompt " * 12] * 2
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def wide(cluster):
    serve = ServeProcess("--decode-ep", "2", "--ray-address", cluster.ray_address, *SMALL_ENGINE)
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


def test_requests_land_on_both_ranks_and_metrics_show_each_rank(wide, served):
    text = httpx.get(f"{wide.url}/metrics", timeout=10).text
    ranks = _rank_workers(text)
    assert len(ranks) == 2, ranks
    for worker in ranks:
        assert metric_value(text, "deepinfer:handoffs_total", worker=worker) >= 1, worker
    assert sum(metric_value(text, "deepinfer:dummy_steps_total", worker=w) for w in ranks) >= 1
    for name in ("deepinfer:eplb_rearrangements_total", "deepinfer:moe_load_imbalance"):
        assert f'{name}{{role="decode",worker="{ranks[0]}"}}' in text


def test_status_shows_each_rank_of_the_instance(wide, served):
    r = wide.cli("status")
    assert r.returncode == 0, r.stderr
    assert re.search(r"decode-\d+\.0 .* 0/2", r.stdout) and re.search(r"decode-\d+\.1 .* 1/2", r.stdout), r.stdout


@pytest.mark.timeout(400)
def test_a_killed_rank_fails_its_whole_instance_and_its_streams_migrate_or_end_with_an_error(wide, served):
    """Last in the module: it breaks the instance. Both ranks leave the router (the survivor's peer
    monitor ends its process); every stream on either rank either migrates to a healthy instance
    (the controller replaces the broken one) and finishes whole, or ends with an error: none hangs."""
    from tests.e2e.test_scaling_and_faults import Streams, _status

    streams = Streams(wide, 4, max_tokens=400)
    assert wait_until(lambda: min(streams.chunks) >= 2, timeout_s=120)  # all four are decoding
    decode = next(p for p in _status(wide).pools if p.pool == 3)
    ranks = sorted(decode.workers, key=lambda w: w.info.worker_id)
    assert {w.inflight for w in ranks} != {0}
    broken = {w.info.worker_id for w in ranks}
    os.kill(ranks[1].info.pid, signal.SIGKILL)
    started = time.monotonic()
    results = streams.join()
    assert all(errors or reasons == ["length"] for reasons, errors in results), results
    assert time.monotonic() - started < 180

    def gone() -> bool:
        return not broken & {w.info.worker_id for p in _status(wide).pools if p.pool == 3 for w in p.workers}

    assert wait_until(gone, timeout_s=60), "both ranks of the broken instance left the router"
