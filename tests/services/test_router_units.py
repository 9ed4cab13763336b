"""Router policies, n fan-out and the stream assembler, as plain units."""

from deepinfer_core.outputs import CompletionOutput
from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import OutputDiffer, SampleAssembler, SampleDelta
from services.router.decode_policy import DecodeCandidate, DecodePolicy, blocks_for
from services.router.fanout import split_samples
from services.router.prefill_policy import PrefillCandidate, PrefillPolicy


def test_prefill_policy_buckets_by_length_then_least_queued():
    policy = PrefillPolicy((512, 2048))
    assert [policy.bucket(n) for n in (1, 512, 513, 2048, 2049, 100_000)] == [0, 0, 1, 1, 2, 2]
    pes = [PrefillCandidate(f"pe-{i}", q) for i, q in enumerate([50, 0, 900, 10, 20, 0])]
    # six PEs, three buckets: pe-0 and pe-3 serve short prompts, pe-1/pe-4 medium, pe-2/pe-5 long
    assert policy.pick(100, pes) == "pe-3"
    assert policy.pick(1000, pes) == "pe-1"
    assert policy.pick(5000, pes) == "pe-5"
    # fewer PEs than buckets: everyone serves every length, least queued wins
    assert policy.pick(5000, pes[:2]) == "pe-1"
    assert policy.pick(10, []) is None


def test_decode_policy_weighs_requests_and_kv_blocks_and_skips_full_engines():
    policy = DecodePolicy()
    a = DecodeCandidate("a", running=10, kv_blocks=100, capacity_blocks=1000, max_running=100, block_size=10)
    b = DecodeCandidate("b", running=2, kv_blocks=800, capacity_blocks=1000, max_running=100, block_size=10)
    c = DecodeCandidate("c", running=30, kv_blocks=50, capacity_blocks=1000, max_running=100, block_size=10)
    assert policy.pick(100, [a, b, c]) == "a"  # b holds most KV, c most requests
    assert policy.pick(9200, [a, b, c]) == "c"  # only c has the blocks for that many tokens
    assert policy.pick(9800, [a, b, c]) is None
    full = DecodeCandidate("d", running=4, kv_blocks=0, capacity_blocks=1000, max_running=4, block_size=10)
    assert policy.pick(1, [full]) is None


def test_decode_policy_counts_whole_blocks_not_tokens():
    """17 tokens take 3 blocks of 8: an engine with 2 free blocks (16 free token slots) is full for it."""
    policy = DecodePolicy()
    ce = DecodeCandidate("ce", running=42, kv_blocks=126, capacity_blocks=128, max_running=256, block_size=8)
    assert policy.pick(17, [ce]) is None and policy.pick(16, [ce]) == "ce"
    assert blocks_for(17, 8) == 3 and blocks_for(16, 8) == 2 and blocks_for(0, 8) == 0


def test_split_samples_gives_each_sample_its_seed():
    parts = split_samples(SamplingParams(n=3, seed=10, temperature=1.0, prompt_logprobs=1))
    assert [(p.n, p.seed) for p in parts] == [(1, 10), (1, 11), (1, 12)]
    assert [p.prompt_logprobs for p in parts] == [1, None, None]
    assert [p.seed for p in split_samples(SamplingParams(n=2))] == [None, None]


def test_output_differ_sends_new_tokens_and_text_moving_back():
    differ = OutputDiffer()
    d1 = differ.diff(CompletionOutput(0, "ab", [1, 2]))
    assert (d1.token_offset, d1.token_ids, d1.text_offset, d1.text) == (0, [1, 2], 0, "ab")
    assert differ.diff(CompletionOutput(0, "ab", [1, 2])) is None
    d2 = differ.diff(CompletionOutput(0, "a", [1, 2, 3], finish_reason="stop", stop_reason="b"))
    assert (d2.token_offset, d2.token_ids, d2.text_offset, d2.text, d2.finish_reason) == (2, [3], 1, "", "stop")


def test_assembler_holds_back_a_possible_stop_string_and_splices_overlaps():
    asm = SampleAssembler(0, holdback_chars=2)  # stop string of three characters
    asm.apply(SampleDelta(token_offset=0, token_ids=[7], text_offset=0, text="hello"))  # PE's first token
    out = asm.take()
    assert out.token_ids == [7] and out.text == "hel"
    # a delta overlapping what the assembler has (from offset 0) splices in; then the stop string "lo!" is cut off
    asm.apply(SampleDelta(token_offset=0, token_ids=[7, 8], text_offset=0, text="hello!"))
    asm.apply(
        SampleDelta(token_offset=2, token_ids=[], text_offset=3, text="", finish_reason="stop", stop_reason="lo!")
    )
    out = asm.take()
    assert out.token_ids == [8] and out.text == "" and out.finish_reason == "stop"
    assert asm.text == "hel" and asm.take() is None
