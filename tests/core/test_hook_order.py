"""SPEC §2: the hook timeline of LLMEngine.step(), per role, recorded by a real engine subclass."""

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_type import EngineType
from tests.helpers.engines import copy_handoff, greedy, make_engine, prefill_on


class Recording(LLMEngine):
    """Records hook calls, the forward launch and the sample-end synchronisation."""

    def __init__(self, *a, **kw):
        self.calls: list[str] = []
        super().__init__(*a, **kw)
        runner = self.worker.runner
        launch = runner.launch

        def recorded_launch(out, rows):
            self.calls.append("launch")
            handle = launch(out, rows)
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

    def post_process(self, out, result):
        self.calls.append("post_process")
        return super().post_process(out, result)


def _step(engine) -> list[str]:
    engine.calls.clear()
    engine.step()
    return list(engine.calls)


def test_normal_prefill_then_decode_then_finalize_order():
    e = make_engine(EngineType.NORMAL, cls=Recording)
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
    seq = prefill_on(pe, "r", [5, 6, 7, 8], greedy(2))
    copy_handoff(pe, seq, ce, greedy(2))
    assert _step(ce) == ["post_schedule", "launch", "do_save_kvcache", "sample_end", "post_process"]
    assert _step(ce) == ["post_schedule", "launch", "do_save_kvcache", "finalize_seq", "sample_end", "post_process"]
