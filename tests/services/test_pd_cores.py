"""A real PE and CE (worker cores in this process, real NIXL agents) behind the router, without
gRPC or Ray: the first token travels once (PE -> router), the CE's stream starts after it, and
what the client gets equals the NORMAL engine's output."""

import asyncio
import contextlib

import pytest

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from services.common.errors import ErrorCode, ServiceError  # noqa: E402
from services.common.workers import POOL_DECODE, POOL_PREFILL  # noqa: E402
from services.router.clients import LocalWorkerClient  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from services.router.core import RouterCore  # noqa: E402
from services.router.registry import PoolRegistry  # noqa: E402
from services.workers.decode_core import DecodeCore  # noqa: E402
from services.workers.prefill_core import PrefillCore  # noqa: E402
from services.workers.spec import EngineSettings, WorkerSpec  # noqa: E402
from services.workers.worker_server import build_engine, worker_info  # noqa: E402
from tests.services.test_router_retries import router_retries  # noqa: E402

ARGS = dict(device="cpu", num_gpu_blocks=128, max_model_len=256, block_size=8)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def engines():
    """(PE, CE, the NORMAL reference): engines outlive the cores each test starts on them."""
    settings = EngineSettings(**ARGS)
    specs = [WorkerSpec("pe-0", POOL_PREFILL, settings), WorkerSpec("ce-0", POOL_DECODE, settings)]
    pe, ce = (build_engine(spec) for spec in specs)
    return pe, ce, LLM(**ARGS), specs


@contextlib.asynccontextmanager
async def _cluster(engines):
    pe_engine, ce_engine, _, specs = engines
    infos = [worker_info(spec, engine, "local") for spec, engine in zip(specs, (pe_engine, ce_engine))]
    pe, ce = PrefillCore(pe_engine, "pe-0"), DecodeCore(ce_engine, "ce-0")
    cores = {"pe-0": pe, "ce-0": ce}
    registry = PoolRegistry(lambda info: LocalWorkerClient(cores[info.worker_id]))
    for core in cores.values():
        core.start()
    try:
        for info in infos:
            await registry.add(info)
        yield RouterCore(registry, RouterConfig(pools=(POOL_PREFILL, POOL_DECODE))), pe, ce
    finally:
        for core in cores.values():
            core.stop()


def _reference(engines, params: SamplingParams):
    return engines[2].generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]


async def _client_view(router: RouterCore, params: SamplingParams) -> tuple[list[int], str, str]:
    tokens, text, finish = [], "", None
    async for delta in router.generate("r", PROMPT, params):
        assert delta.token_offset == len(tokens) and delta.text_offset == len(text)
        tokens += delta.token_ids
        text += delta.text
        finish = delta.finish_reason or finish
    return tokens, text, finish


async def _handed_off(pe: PrefillCore, ce: DecodeCore, rid: str, params: SamplingParams):
    """Reserve on the CE, prefill on the PE; the PE's first delta and every delta of the CE's stream."""
    target = await ce.reserve(rid, PROMPT, params)
    result = await pe.prefill(rid, PROMPT, params, target)
    return result.first, [d async for d in ce.stream(rid)]


def test_the_decode_stream_starts_after_the_first_token(engines):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _reference(engines, params)

    async def run():
        async with _cluster(engines) as (_, pe, ce):
            return await _handed_off(pe, ce, "after-first", params)

    first, rest = asyncio.run(run())
    assert (first.token_offset, first.token_ids) == (0, want.token_ids[:1])
    assert rest[0].token_offset == 1 and rest[0].token_ids and rest[0].text_offset == len(first.text)
    assert [t for d in rest for t in d.token_ids] == want.token_ids[1:]
    assert first.text + "".join(d.text for d in rest) == want.text and rest[-1].finish_reason == "length"


def test_a_first_token_that_ends_the_request_leaves_only_the_finish_to_the_stream(engines):
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def run():
        async with _cluster(engines) as (_, pe, ce):
            return await _handed_off(pe, ce, "one-token", params)

    first, rest = asyncio.run(run())
    assert len(first.token_ids) == 1 and first.finish_reason is None
    assert len(rest) == 1 and rest[0].token_offset == 1 and rest[0].token_ids == [] and rest[0].text == ""
    assert rest[0].text_offset == len(first.text) and rest[0].finish_reason == "length"


def test_what_the_client_gets_equals_the_normal_engine(engines):
    first_text = _reference(engines, SamplingParams(temperature=0, max_tokens=1)).text
    stop = first_text.strip()[-1:]
    assert stop, "the first token needs visible text for the stop-string case"
    cases = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]),  # ends at the first token
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop], min_tokens=3),  # must not
    ]
    want = [_reference(engines, p) for p in cases]

    async def run():
        async with _cluster(engines) as (router, _, _):
            return [await _client_view(router, p) for p in cases]

    got = asyncio.run(run())
    assert got == [(w.token_ids, w.text, w.finish_reason) for w in want]


def test_a_prompt_the_prefill_engine_refuses_is_the_clients_fault_and_not_retried(engines):
    image_token = engines[0].mm_processor.image_token_id

    async def run():
        async with _cluster(engines) as (router, _, ce):
            with pytest.raises(ServiceError) as e:
                async for _ in router.generate("img", [*PROMPT, image_token], SamplingParams(max_tokens=3)):
                    pass
            await asyncio.sleep(0.2)  # the CE's reservation is aborted in the background
            return e.value, ce.stats()

    before = router_retries()
    error, ce_load = asyncio.run(run())
    assert error.code is ErrorCode.INVALID_ARGUMENT and "image placeholder" in error.message
    assert router_retries() == before and ce_load.reservations == 0
