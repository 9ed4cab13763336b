"""The DP step-kind vote of NORMAL engines, with two real gloo processes (SPEC §3)."""

import socket

import pytest
import torch.multiprocessing as mp

from deepinfer_core.scheduler.dp_vote import DPVote
from tests.helpers.sched import complete_step, make_scheduler, make_seq

ALL_EVERY, ANY_EVERY = 3, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        queue.put((rank, {name: fn(rank) for name, fn in _SCENARIOS.items()}))
    finally:
        dist.destroy_process_group()


def _running_sched(rank: int, **kw):
    """A NORMAL DP rank that already decodes one sequence."""
    s = make_scheduler(num_blocks=kw.pop("num_blocks", 64), dp_vote=DPVote(None, ALL_EVERY, ANY_EVERY), **kw)
    seq = make_seq(prompt_len=4, max_tokens=100, first_token=1000 * rank)
    s.add_sequence(seq)
    s.waiting.clear()
    s.block_manager.allocate(seq)
    seq.num_cached_tokens = 4
    seq.append_token(1)
    s.running.append(seq)
    s.decode_step = 1  # not a vote point
    return s


def _trace(s, steps: int):
    trace = []
    for _ in range(steps):
        out = s.schedule()
        trace.append((s.decode_step, out.prompt_run, len(out.scheduled_seqs)))
        complete_step(s, out)
    return trace


def _lone_request(rank: int):
    """Only rank 0 has waiting work: ALL points refuse, the first ANY point prefills on both."""
    s = _running_sched(rank)
    if rank == 0:
        s.add_sequence(make_seq(prompt_len=4, first_token=500))
    return _trace(s, 6)


def _both_want(rank: int):
    s = _running_sched(rank)
    s.decode_step = ALL_EVERY  # the next step is an ALL point
    s.add_sequence(make_seq(prompt_len=4, first_token=500 + rank))
    return _trace(s, 2)


def _wants_but_cannot_schedule(rank: int):
    """Rank 0 wants to prefill but its KV is full; no rank schedules: everyone decodes."""
    s = _running_sched(rank, num_blocks=3, block_size=4, max_model_len=16)
    if rank == 0:
        s.config = type(s.config)(**{**s.config.__dict__, "prefill_kv_watermark": 1.0})
        s.add_sequence(make_seq(prompt_len=12, first_token=500))
    s.decode_step = ANY_EVERY  # the next step is an ANY point
    return _trace(s, 1)


_SCENARIOS = {"lone": _lone_request, "both": _both_want, "stuck": _wants_but_cannot_schedule}


@pytest.fixture(scope="module")
def traces():
    """Every scenario on two real gloo ranks: {scenario: {rank: trace}}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=150) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {name: {rank: results[rank][name] for rank in results} for name in _SCENARIOS}


@pytest.mark.timeout(240)
def test_lone_request_waits_for_the_any_point_and_the_idle_rank_runs_an_empty_prefill(traces):
    r = traces["lone"]
    # steps at decode_step 1, 2 decode; 3 is an ALL point: rank 1 does not want -> decode;
    # 4 decodes; 5 is an ANY point -> prefill: rank 0 schedules, rank 1 runs an empty prefill.
    kinds0 = [p for _, p, _ in r[0]]
    kinds1 = [p for _, p, _ in r[1]]
    assert kinds0 == kinds1, "ranks must take the same step kind"
    assert kinds0[:4] == [False, False, False, False] and kinds0[4] is True
    assert r[0][4][2] == 1 and r[1][4][2] == 0  # rank 1's prefill step is empty
    assert r[0][5][1] is False  # after the prefill, decode resumes


def test_all_point_prefills_when_every_rank_wants(traces):
    r = traces["both"]
    assert r[0][0][1] is True and r[1][0][1] is True
    assert r[0][0][2] == 1 and r[1][0][2] == 1


def test_second_vote_falls_back_to_decode_when_no_rank_could_schedule(traces):
    r = traces["stuck"]
    assert r[0][0][1] is False and r[1][0][1] is False
    assert r[0][0][2] == 1  # the running sequence decoded instead of an empty-prefill livelock
