"""Drive one workload with zero-overhead scheduling off and on and compare what the requests got
(tests/engine/test_zero_overhead_scheduling.py; deepinfer_core/engine/overlap.py)."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.overlap import PLACEHOLDER
from deepinfer_core.roles import EngineType
from tests.helpers.engines import make_engine


def overlap_engine(zos: bool, engine_type: EngineType = EngineType.NORMAL, **kw):
    engine = make_engine(engine_type, **kw)
    engine.zero_overhead_scheduling = zos
    return engine


class StepTrace:
    """Records launches and read-backs of the runner, in order: ("launch", k) / ("result", k)."""

    def __init__(self, engine):
        self.events: list[tuple[str, int]] = []
        self.scheduled: list[list[str]] = []  # request ids per launched step
        runner = engine.worker.runner
        launch = runner.launch

        def traced(out, rows, *rest):
            k = len(self.scheduled)
            self.scheduled.append([s.request_id for s in out.scheduled_seqs])
            self.events.append(("launch", k))
            handle = launch(out, rows, *rest)
            finish = handle.result

            def result():
                if ("result", k) not in self.events:
                    self.events.append(("result", k))
                return finish()

            handle.result = result
            return handle

        runner.launch = traced


def watch_hashing(engine) -> list[int]:
    """Checks every prefix-cache commit: the hashed blocks never hold a placeholder. Returns the
    number of blocks hashed per commit."""
    bm = engine.scheduler.block_manager
    commit = bm.commit_full_blocks
    hashed = []

    def checked(seq):
        full = (seq.num_cached_tokens // bm.block_size) * bm.block_size
        assert PLACEHOLDER not in seq.token_ids[:full], "a block was hashed with a placeholder in it"
        before = len(seq.block_hashes)
        commit(seq)
        hashed.append(len(seq.block_hashes) - before)

    bm.commit_full_blocks = checked
    return hashed


def drive(engine, requests, later=(), add_later_at=None, abort_at=None, max_calls=2000):
    """Step until idle. `requests`/`later`: (request id, prompt ids, params, multi_modal_data);
    `later` is added before call `add_later_at`. `abort_at`: {request id: abort once it has
    streamed this many tokens}. Returns (final outputs by id, every output in order)."""
    for rid, ids, params, mm in requests:
        engine.add_request(rid, params=params, prompt_token_ids=ids, multi_modal_data=mm)
    done, stream = {}, []
    abort_at = dict(abort_at or {})
    for call in range(max_calls):
        if call == add_later_at:
            for rid, ids, params, mm in later:
                engine.add_request(rid, params=params, prompt_token_ids=ids, multi_modal_data=mm)
        elif not engine.has_unfinished_requests() and (add_later_at is None or call > add_later_at):
            return done, stream
        for out in engine.step():
            stream.append(out)
            assert out.request_id not in done, "a finished request is reported once"
            for c in out.outputs:
                assert PLACEHOLDER not in c.token_ids
            if out.finished:
                done[out.request_id] = out
            limit = abort_at.get(out.request_id)
            if limit is not None and len(out.outputs[0].token_ids) >= limit:
                engine.abort_request(out.request_id)
                del abort_at[out.request_id]
    raise AssertionError("the engine did not go idle")


def output_fields(out, exact_logprobs: bool = True):
    samples = []
    for c in out.outputs:
        lps = c.logprobs if exact_logprobs else (None if c.logprobs is None else [sorted(d) for d in c.logprobs])
        cum = c.cumulative_logprob if exact_logprobs or c.cumulative_logprob is None else round(c.cumulative_logprob, 3)
        samples.append((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.error, lps, cum))
    return (out.finished, out.num_cached_tokens, out.prompt_logprobs, samples)


def assert_same_outputs(sync: dict, zos: dict, exact_logprobs: bool = True) -> None:
    assert sync.keys() == zos.keys()
    for rid in sync:
        assert output_fields(sync[rid], exact_logprobs) == output_fields(zos[rid], exact_logprobs), rid
        if not exact_logprobs:
            for a, b in zip(sync[rid].outputs, zos[rid].outputs):
                for da, db in zip(a.logprobs or [], b.logprobs or []):
                    assert da == pytest.approx(db, abs=1e-5), rid


def overlap_prompts(engine) -> list[list[int]]:
    texts = [
        "Hello there",
        "The quick brown fox jumps over the lazy dog " * 3,
        "a",
        "Once upon a time in a land far away, there lived",
        "One two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    ]
    return [engine.tokenizer.encode(t) for t in texts]
