"""SPEC §2: the hook timeline of LLMEngine.step(), per role, recorded by a real engine subclass.

The synchronous step is SPEC §2 as written; with zero-overhead scheduling (the NORMAL and
COMPLETION default) the same hooks run, but each call reads back the step the previous call
launched, after launching its own (deepinfer_core/engine/overlap.py)."""

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.roles import EngineType
from tests.helpers.engines import copy_handoff, greedy, make_engine, prefill_on


class Recording(LLMEngine):
    """Records hook calls, the forward launch and the sample-end synchronisation."""

    def __init__(self, *a, **kw):
        self.calls: list[str] = []
        super().__init__(*a, **kw)
        runner = self.worker.runner
        launch = runner.launch

        def recorded_launch(out, rows, *rest):
            self.calls.append("launch")
            handle = launch(out, rows, *rest)
            finish = handle.result

            def result():
                self.calls.append("sample_end")
                return finish()

            handle.result = result
            return handle

        runner.launch = recorded_launch

    def _rec(name):  # noqa: N805
        def hook(self, *a):
            self.calls.append(name)
            return getattr(LLMEngine, name)(self, *a)

        return hook

    init_pd_split = _rec("init_pd_split")
    post_schedule = _rec("post_schedule")
    finalize_seq = _rec("finalize_seq")
    do_save_kvcache = _rec("do_save_kvcache")
    pe_prepare_save_kvcache = _rec("pe_prepare_save_kvcache")
    pe_do_save_kvcache = _rec("pe_do_save_kvcache")
    send_processed_prompts = _rec("send_processed_prompts")

    def post_process(self, out, result, *in_flight):
        self.calls.append("post_process")
        return super().post_process(out, result, *in_flight)


def _step(engine) -> list[str]:
    engine.calls.clear()
    engine.step()
    return list(engine.calls)


def test_normal_prefill_then_decode_then_finalize_order():
    e = make_engine(EngineType.NORMAL, cls=Recording)
    e.zero_overhead_scheduling = False
    assert "init_pd_split" not in e.calls
    e.add_request("r", prompt_token_ids=[5, 6, 7], params=greedy(2))
    assert _step(e) == [
        "post_schedule",
        "launch",
        "pe_prepare_save_kvcache",
        "sample_end",
        "post_process",
        "pe_do_save_kvcache",
    ]
    assert _step(e) == ["post_schedule", "launch", "do_save_kvcache", "sample_end", "post_process"]
    # the request finished in the previous step: its release happens in this step's pre-sampler sync
    assert _step(e) == ["post_schedule", "launch", "do_save_kvcache", "finalize_seq", "sample_end", "post_process"]
    assert not e.has_unfinished_requests()


def test_prompt_step_order_and_no_finalize():
    e = make_engine(EngineType.PROMPT, cls=Recording)
    assert e.calls == ["init_pd_split"]
    e.add_request("r", prompt_token_ids=[5, 6, 7], params=greedy(1))
    expected = [
        "post_schedule",
        "launch",
        "pe_prepare_save_kvcache",
        "sample_end",
        "post_process",
        "pe_do_save_kvcache",
        "send_processed_prompts",
    ]
    assert _step(e) == expected
    assert _step(e) == expected  # an empty PROMPT step keeps the same beat
    assert "finalize_seq" not in e.calls


def test_completion_step_order():
    pe = make_engine(EngineType.PROMPT)
    ce = make_engine(EngineType.COMPLETION, cls=Recording)
    assert ce.calls == ["init_pd_split"]
    ce.zero_overhead_scheduling = False
    seq = prefill_on(pe, "r", [5, 6, 7, 8], greedy(2))
    copy_handoff(pe, seq, ce, greedy(2))
    assert _step(ce) == ["post_schedule", "launch", "do_save_kvcache", "sample_end", "post_process"]
    assert _step(ce) == ["post_schedule", "launch", "do_save_kvcache", "finalize_seq", "sample_end", "post_process"]


def test_normal_overlapped_order():
    """Each call launches its step, runs that step's pre-sampler hooks, then reads back and
    post-processes the step of the call before; the first call returns nothing."""
    e = make_engine(EngineType.NORMAL, cls=Recording)
    e.zero_overhead_scheduling = True
    e.add_request("r", prompt_token_ids=[5, 6, 7], params=greedy(2))
    assert _step(e) == ["post_schedule", "launch", "pe_prepare_save_kvcache"]
    assert _step(e) == [
        "post_schedule",
        "launch",
        "do_save_kvcache",
        "sample_end",  # the prefill's
        "post_process",
        "pe_do_save_kvcache",
    ]
    # the decode's token is the last (max_tokens): retired unread, released in this step as without
    # overlap; nothing is left to launch, so the decode is read back and the empty step finished
    assert _step(e) == [
        "post_schedule",
        "launch",
        "do_save_kvcache",
        "finalize_seq",
        "sample_end",
        "post_process",
        "sample_end",
        "post_process",
    ]
    assert not e.has_unfinished_requests()


def test_completion_overlapped_order():
    pe = make_engine(EngineType.PROMPT)
    ce = make_engine(EngineType.COMPLETION, cls=Recording)
    ce.zero_overhead_scheduling = True
    seq = prefill_on(pe, "r", [5, 6, 7, 8], greedy(3))
    copy_handoff(pe, seq, ce, greedy(3))
    assert _step(ce) == ["post_schedule", "launch", "do_save_kvcache"]
    assert _step(ce) == ["post_schedule", "launch", "do_save_kvcache", "sample_end", "post_process"]
    assert _step(ce) == [
        "post_schedule",
        "launch",
        "do_save_kvcache",
        "finalize_seq",
        "sample_end",
        "post_process",
        "sample_end",
        "post_process",
    ]
    assert not ce.has_unfinished_requests()


def test_prompt_engine_never_overlaps(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1")
    assert not make_engine(EngineType.PROMPT).zero_overhead_scheduling
