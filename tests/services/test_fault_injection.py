"""Faults injected into a real P/D cluster in this process (1 PE + 2 CE engines, real NIXL over UCX
loopback, the real router): every 4th KV write failing, decode streams breaking mid-request, delays,
clients leaving at random points, a late KV write into an aborted reservation. Every request
completes with the undisturbed output (or, for the ones the client left, ends), and afterwards every
stage is at its baseline: no in-flight count, request, reservation, quarantined lease, KV block or
stream left anywhere."""

import asyncio
import random

import pytest

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.config import PDConfig  # noqa: E402
from services.common.workers import POOL_DECODE, POOL_PREFILL  # noqa: E402
from services.metrics import definitions as m  # noqa: E402
from services.router.clients import LocalWorkerClient  # noqa: E402
from services.workers.spec import EngineSettings, WorkerSpec  # noqa: E402
from services.workers.worker_server import build_engine  # noqa: E402
from tests.helpers.fault_injection import Faults, at_rest, fail_every_nth_post, pd_cluster  # noqa: E402
from tests.services.test_router_retries import router_retries  # noqa: E402

ARGS = dict(device="cpu", num_gpu_blocks=128, max_model_len=256, block_size=8)
PROMPTS = [[5 + i, 6, 7, 8, 9, 10, 11 + i] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    """(PE, {CE id: CE}, specs, the undisturbed outputs); the engines outlive each test's cores."""
    settings = EngineSettings(**ARGS)
    specs = {"pe-0": WorkerSpec("pe-0", POOL_PREFILL, settings)}
    specs.update({f"ce-{i}": WorkerSpec(f"ce-{i}", POOL_DECODE, settings) for i in range(2)})
    pe = build_engine(specs["pe-0"])
    ces = {wid: build_engine(specs[wid]) for wid in ("ce-0", "ce-1")}
    want = [o.outputs[0] for o in LLM(**ARGS).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    return pe, ces, specs, want


async def _view(router, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    tokens, text, finish = [], "", None
    async for d in router.generate(rid, prompt, params):
        assert d.token_offset == len(tokens) and d.text_offset == len(text)  # nothing repeated or dropped
        tokens += d.token_ids
        text += d.text
        finish = d.finish_reason or finish
    return tokens, text, finish


def _run(engines, faults: Faults, body, **config):
    pe, ces, specs, _ = engines

    async def run():
        async with pd_cluster(pe, ces, specs, faults, **config) as (router, cores):
            result = await body(router, cores)
            return result, await at_rest(router, cores)

    return asyncio.run(asyncio.wait_for(run(), 120))


def _assert_at_rest(view: dict) -> None:
    assert all(not any(v) for v in view.values()), view


def test_every_fourth_kv_write_failing_loses_no_request_and_no_block(engines, monkeypatch):
    pe, _, _, want = engines
    failed = fail_every_nth_post(pe.agent, 4)
    retries = router_retries()

    async def body(router, cores):
        return await asyncio.gather(*(_view(router, f"w{i}", p, GREEDY) for i, p in enumerate(PROMPTS * 2)))

    try:
        got, view = _run(engines, Faults(), body)
    finally:
        del pe.agent.post  # the instance attribute: the class's own again
    assert got == [(w.token_ids, w.text, "length") for w in want * 2]
    assert failed and router_retries() >= retries + len(failed)
    _assert_at_rest(view)


def test_decode_streams_that_break_mid_request_migrate_token_identically(engines):
    want = engines[3]
    faults = Faults(break_after={"ce-0": 3})  # every stream on ce-0 breaks after three deltas
    before = m.MIGRATIONS.labels("unavailable")._value.get()

    async def body(router, cores):
        return await asyncio.gather(*(_view(router, f"b{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))

    got, view = _run(engines, faults, body)
    assert got == [(w.token_ids, w.text, "length") for w in want]
    assert faults.broken >= 1 and m.MIGRATIONS.labels("unavailable")._value.get() - before == faults.broken
    _assert_at_rest(view)


def test_a_stream_broken_past_the_migration_limit_ends_with_a_clear_error(engines):
    faults = Faults(break_after={"ce-0": 2, "ce-1": 2})  # wherever it goes, it breaks again

    async def body(router, cores):
        try:
            await _view(router, "doomed", PROMPTS[0], GREEDY)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return e
        return None

    error, view = _run(engines, faults, body, migration_limit=2)
    assert error is not None and "after 2 migration(s)" in str(error) and faults.broken == 3
    _assert_at_rest(view)


def test_clients_leaving_at_random_points_under_delays_leave_nothing_held(engines):
    faults = Faults(delay_s={"reserve": 0.01, "prefill": 0.02, "stream": 0.01}, break_after={"ce-1": 5})
    rng = random.Random(28)

    async def leave(router, i: int) -> None:
        task = asyncio.ensure_future(_view(router, f"c{i}", PROMPTS[i % len(PROMPTS)], GREEDY))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def body(router, cores):
        await asyncio.gather(*(leave(router, i) for i in range(40)))

    _, view = _run(engines, faults, body)
    _assert_at_rest(view)


def test_a_late_kv_write_into_an_aborted_reservation_never_reaches_another_request(engines):
    """Fencing: a CE reservation is aborted while its PE has yet to write; another request reserves
    on that CE at once; then the late write lands. The late blocks were fenced (quarantined) until
    the PE's notice, never handed to the second request, whose output is the undisturbed one."""
    pe, ces, specs, want = engines

    async def body(router, cores):
        ce, pe_core = cores["ce-0"], cores["pe-0"]
        late = await ce.reserve("late", PROMPTS[0], GREEDY)
        await ce.abort("late")  # the router gave up on it; the PE does not know yet
        other = await ce.reserve("other", PROMPTS[1], GREEDY)
        assert not set(late.block_ids) & set(other.block_ids)
        await pe_core.prefill("late", PROMPTS[0], GREEDY, late)  # the delayed write lands now
        result = await pe_core.prefill("other", PROMPTS[1], GREEDY, other)
        rest = [d async for d in ce.stream("other")]
        return result.first.token_ids + [t for d in rest for t in d.token_ids]

    tokens, view = _run(engines, Faults(), body)
    assert tokens == want[1].token_ids
    _assert_at_rest(view)


def test_a_prefill_slower_than_the_lease_keeps_its_reservation_by_heartbeats(engines, monkeypatch):
    """The router reserves with a short lease and renews it while the prefill runs: a prefill that
    takes three leases' time still lands (without the heartbeats its reservation would expire and
    the PE refuse the target), with the undisturbed output; nothing is held afterwards."""
    want = engines[3]
    faults = Faults(delay_s={"prefill": 1.2})
    pd = PDConfig(renewed_lease_s=0.4)
    renewed = []
    real = LocalWorkerClient.renew_lease

    async def counted(self, request_id, prefill, lease_s, expires_at, timeout):
        end = await real(self, request_id, prefill, lease_s, expires_at, timeout)
        renewed.append((prefill, end))
        return end

    async def body(router, cores):
        return await _view(router, "slow", PROMPTS[0], GREEDY)

    monkeypatch.setattr(LocalWorkerClient, "renew_lease", counted)
    got, view = _run(engines, faults, body, pd=pd)
    assert got == (want[0].token_ids, want[0].text, "length")
    assert len([end for prefill, end in renewed if not prefill and end > 0]) >= 2, renewed
    _assert_at_rest(view)


def test_at_high_concurrency_no_ce_is_admitted_beyond_its_kv_blocks(engines):
    """120 requests at once of 7 prompt + 10 output tokens: 3 blocks of 8 each (17 tokens), 128 blocks
    per CE. Counted in tokens the router would put 60 on a CE (180 blocks: preemptions); counted in
    blocks at most 42 go to each, the rest wait, and no CE preempts any request."""
    pe, ces, specs, _ = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5 + i % 60, 6 + i // 60, 7, 8, 9, 10, 11] for i in range(120)]  # no two alike
    preemptions = {wid: ce.scheduler.num_preemptions for wid, ce in ces.items()}
    peak: dict[str, int] = {}

    async def body(router, cores):
        async def watch():
            while True:
                for wid in ces:
                    peak[wid] = max(peak.get(wid, 0), router.registry.workers[wid].inflight_blocks)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*(_view(router, f"hc{i}", p, params) for i, p in enumerate(prompts)))
        finally:
            watcher.cancel()

    got, view = _run(engines, Faults(), body)
    assert all(finish == "length" and len(tokens) == 10 for tokens, _, finish in got)
    num_blocks = ARGS["num_gpu_blocks"]
    assert all(0 < peak[wid] <= num_blocks for wid in ces), peak
    assert max(peak.values()) > num_blocks // 2, peak  # the CEs were filled, not left idle
    assert {wid: ce.scheduler.num_preemptions for wid, ce in ces.items()} == preemptions
    _assert_at_rest(view)


@pytest.mark.parametrize("after", [20, 22])
def test_a_break_inside_a_run_of_partial_characters_continues_with_the_same_tokens_and_text(engines, after):
    """The tiny model writes runs of bytes that are not whole characters here ("story 2"): a migration
    that started from the last token would decode them differently as the end of its prompt; it starts
    from the last whole character instead, and the client is sent no token twice."""
    from deepinfer_core.builtin import TINY_MODEL_DIR
    from deepinfer_core.tokenizer import load_tokenizer

    prompt = load_tokenizer(TINY_MODEL_DIR).encode("story 2: once upon a time")
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = LLM(**ARGS).generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert "\ufffd" in want.text  # the case: partial characters in the output
    faults = Faults(break_after={"ce-0": after})

    async def body(router, cores):
        return await _view(router, "bytes", prompt, params)

    got, view = _run(engines, faults, body)
    assert faults.broken == 1 and got == (want.token_ids, want.text, "length")
    _assert_at_rest(view)


def test_a_migrated_stream_whose_output_holds_the_image_placeholder_id_continues_identically(engines):
    """The built-in model is multimodal, and its greedy output for this prompt holds the image
    placeholder id (its 6th token). The continuation's prompt then holds it too, with no image: the
    engine takes the resumed output as plain tokens instead of refusing a placeholder without an image."""
    prompt = [228, 383, 816, 177, 343, 439, 838]
    placeholder = engines[0].mm_processor.image_token_id
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(**ARGS).generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert want.token_ids[5] == placeholder  # the case
    faults = Faults(break_after={"ce-0": 8})

    async def body(router, cores):
        return await asyncio.gather(*(_view(router, f"img{i}", prompt, params) for i in range(2)))

    got, view = _run(engines, faults, body)
    assert faults.broken >= 1 and got == [(want.token_ids, want.text, "length")] * 2
    _assert_at_rest(view)


def test_streams_sent_four_tokens_a_delta_migrate_token_identically(engines):
    """With a stream interval of 4 (`--stream-interval`), a break leaves no one-token delta after the
    first: the continuation starts after the first token, makes the rest again, and the client is
    sent each token once."""
    want = engines[3]
    faults = Faults(break_after={"ce-0": 2})

    async def body(router, cores):
        for wid in ("ce-0", "ce-1"):
            cores[wid].streams.stream_interval = 4
        try:
            return await asyncio.gather(*(_view(router, f"i{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
        finally:
            for wid in ("ce-0", "ce-1"):
                cores[wid].streams.stream_interval = 1

    got, view = _run(engines, faults, body)
    assert got == [(w.token_ids, w.text, "length") for w in want]
    assert faults.broken >= 1
    _assert_at_rest(view)
