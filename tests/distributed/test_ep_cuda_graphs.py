"""Expert-parallel decode under CUDA graphs (skipped without a GPU): a one-rank NCCL instance on the
padded dispatch captures its decode steps, MoE all-to-alls inside, and generates the greedy tokens
of the same instance run eagerly and of an engine without expert parallelism; graphs keep
replaying through EPLB rearrangements with the same tokens; an idle step replays a graph with no
real token; padding rows of a graph are not counted as expert load.

    pytest -q tests/distributed/test_ep_cuda_graphs.py
"""

import pytest
import torch

from deepinfer_core.config import EplbConfig
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.ep import free_port, make_rank_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]  # 3 rows: graph bucket 4, one padding row
MAX_NEW = 12
ENGINE_KW = {"device": "cuda", "dtype": "float32", "max_model_len": 64, "max_num_batched_tokens": 64,
             "max_num_seqs": 8, "num_gpu_blocks": 64}  # fmt: skip


@pytest.fixture(scope="module")
def group():
    from deepinfer_core.distributed.group import join_instance, leave_instance

    torch.cuda.set_device(0)
    g = join_instance(0, 1, f"127.0.0.1:{free_port()}", "nccl", join_timeout_s=60, collective_timeout_s=60)
    yield g
    leave_instance()


def _generate(engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), params=greedy(MAX_NEW), prompt_token_ids=p)
    done = run_to_completion(engine)
    return [list(done[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))]


def _count_replays(runner) -> list[int]:
    """A one-item list counting the runner's decode graph replays."""
    replays = [0]
    run = runner.graphs.run

    def counted(inp):
        replays[0] += 1
        return run(inp)

    runner.graphs.run = counted
    return replays


def _counted_load(engine) -> int:
    """Token copies counted as expert load since the engine started (the balancer drains the counter)."""
    return int(engine.balancer.window.sum()) + int(engine.worker.ep.load.sum())


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _generate(make_engine(**ENGINE_KW))


def test_captured_ep_decode_equals_eager_and_the_engine_without_ep(group, reference):
    eager = make_rank_engine(group, moe_dispatch="padded", enforce_eager=True, **ENGINE_KW)
    assert eager.worker.runner.graphs is None
    eager_tokens = _generate(eager)
    graphed = make_rank_engine(group, moe_dispatch="padded", **ENGINE_KW)
    runner = graphed.worker.runner
    assert runner.use_cuda_graph and runner.graphs.buckets == [1, 2, 4, 8]
    replays = _count_replays(runner)
    tokens = _generate(graphed)
    assert replays[0] >= MAX_NEW - 1, replays  # every decode step replayed a captured graph
    assert tokens == eager_tokens == reference
    # the graphs ran 3 real rows in bucket 4: the padding row is routed but never counted
    assert _counted_load(graphed) == _counted_load(eager) > 0


def test_the_exact_all_to_all_keeps_ep_decode_eager(group):
    engine = make_rank_engine(group, moe_dispatch="all_to_all", **ENGINE_KW)
    assert not engine.worker.runner.use_cuda_graph and engine.worker.runner.graphs is None


def test_rearrangements_between_replays_keep_the_tokens(group, reference):
    eplb = EplbConfig(enabled=True, num_redundant_experts=4, rearrange_interval=3, measure_interval=1)
    engine = make_rank_engine(group, moe_dispatch="padded", eplb=eplb, **ENGINE_KW)
    ep, runner = engine.worker.ep, engine.worker.runner
    replays = _count_replays(runner)
    storage = [t.data_ptr() for t in (ep.load, *ep.placement.place_on(ep.load.device))]
    storage += [t.data_ptr() for m in ep.experts for _, t in m.named_parameters(recurse=False)]
    trace, placements = [], set()  # (rearrangements, replays) per step; placements seen

    def after_schedule(out) -> None:
        trace.append((engine.balancer.num_rearrangements, replays[0]))
        placements.add(str(ep.placement.phy2log.tolist()))

    engine.post_schedule = after_schedule
    assert _generate(engine) == reference
    assert engine.balancer.num_rearrangements >= 2 and len(placements) >= 2, (trace, placements)
    first = next(i for i, (n, _) in enumerate(trace) if n > 0)
    assert trace[-1][1] > trace[first][1], "graphs replayed after a rearrangement"
    now = [t.data_ptr() for t in (ep.load, *ep.placement.place_on(ep.load.device))]
    assert now + [t.data_ptr() for m in ep.experts for _, t in m.named_parameters(recurse=False)] == storage


def test_an_idle_step_replays_a_graph_with_no_real_token(group, reference):
    engine = make_rank_engine(group, moe_dispatch="padded", **ENGINE_KW)
    runner = engine.worker.runner
    idle = [0]
    run_idle = runner.graphs.run_idle

    def counted():
        idle[0] += 1
        run_idle()

    runner.graphs.run_idle = counted
    before = _counted_load(engine)
    for _ in range(3):
        assert engine.step() == []  # nothing scheduled: the dummy step of an idle rank
    torch.cuda.synchronize()
    assert idle[0] == 3 and runner.num_dummy_steps == 3
    assert _counted_load(engine) == before
    assert _generate(engine) == reference  # idle replays left the cache and the graphs intact
