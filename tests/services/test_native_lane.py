"""The fast lane's compiled half (`services/native/delta_lane.c`) against the Python it stands in for.

- Its event bytes are `StreamChunks`' (completions and chat) in uvicorn's chunked framing, for
  random texts full of what JSON and SSE must escape.
- Its reading of a `DeltaBatch`'s wire bytes: with no lane armed, every item reaches `inbox.put`
  as the Python dispatch gives it (random batches); an armed lane takes exactly the plain deltas
  at its edge, and hands every other one to `put` untouched.
- What it took comes back as one delta (`take_pending`), in the attempt's offsets, with the
  clean point `SampleProgress.place` would have recorded.
- A worker's turn encoded (`encode_batch`) is the message `batch_to_proto` fills; a turn it
  cannot encode (logprobs, values the message cannot hold) is left to the Python encoder.
- Its refusals: not armed, not at the edge, a connection that cannot take a write, a write that
  fails (the request ends through `sink_failed`, the dispatch goes on).
"""

import random

import pytest

from deepinfer_proto import common_pb2, worker_pb2
from services import native
from services.common.deltas import SampleDelta, TokenLogprob
from services.common.messages import batch_message, batch_to_proto
from services.gateway.chunks import StreamChunks, _text
from services.gateway.core import Choice

pytestmark = pytest.mark.skipif(native.delta_lane is None, reason="services.native was not built")

HARD = ['"', "\\", "\n", "\r", "\t", "\b", "\f", "\x00", "\x01", "\x1f", "\x7f", "\x85", "\u2028", "\u2029", "é",
        "中", "😀", "\ufffd", "/", "<", " ", "a", "\u00a0", "\u0080", "\uffff", "\U0010ffff"]  # fmt: skip


def _random_text(rng: random.Random) -> str:
    n = rng.randrange(0, 12)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            out.append(rng.choice(HARD))
        elif r < 0.8:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        else:
            cp = rng.randrange(0x80, 0x110000)
            out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x")
    return "".join(out)


def test_its_json_strings_are_the_python_encoders():
    rng = random.Random(7)
    for s in HARD + ["", "plain", "".join(HARD)] + [_random_text(rng) for _ in range(3000)]:
        assert native.delta_lane.json_string(s) == _text(s).encode(), repr(s)


class Transport:
    def __init__(self, fail: bool = False):
        self.written: list[bytes] = []
        self.closing = False
        self.fail = fail

    def write(self, data: bytes) -> None:
        if self.fail:
            raise OSError("the connection broke")
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


class Cycle:
    disconnected = False
    response_complete = False


class Flow:
    write_paused = False


class Inbox:
    """What `dispatch` uses of a `RequestInbox`."""

    def __init__(self, lane=None):
        self.native = lane
        self.put_msgs: list = []
        self.failures: list = []

    def put(self, msg) -> None:
        self.put_msgs.append(msg)

    def sink_failed(self, e) -> None:
        self.failures.append(e)


class Formatter:
    id, model, created, top_logprobs = "cmpl-1", "m", 123, None


def _lane(chat: bool = False, transport=None):
    chunks = StreamChunks(Formatter(), chat=chat)
    head, tail = chunks.running_parts(0, chat)
    transport = transport or Transport()
    cycle, flow = Cycle(), Flow()
    return native.NativeLane(transport, cycle, flow, head, tail, chat), chunks, transport, cycle, flow


def _framed(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def _batch(*items: tuple[str, SampleDelta]) -> bytes:
    return batch_to_proto(list(items)).SerializeToString()


def _dispatch(batch: bytes, inboxes: dict) -> None:
    native.delta_lane.dispatch(batch, inboxes, common_pb2.SampleDelta.FromString)


@pytest.mark.parametrize("chat", [False, True])
def test_an_armed_lane_writes_the_python_lanes_events(chat):
    lane, chunks, transport, _, _ = _lane(chat)
    lane.arm(0, 0, 0, 0)
    inbox = Inbox(lane)
    rng = random.Random(3 if chat else 4)
    choice, tokens, text, want = Choice(0, 3), 0, "", []
    for _ in range(300):
        piece = _random_text(rng)
        ids = [rng.randrange(0, 1 << 31) for _ in range(rng.choice([0, 1, 1, 1, 2]))]
        delta = SampleDelta(0, tokens, ids, len(text), piece)
        _dispatch(_batch(("r", delta)), {"r": inbox})
        choice.add(delta)
        event = (chunks.chat if chat else chunks.completion)(choice, delta)
        if event and (ids or piece):  # nothing new: the router passes nothing on (`SampleAssembler.push`)
            want.append(_framed(event))
        tokens, text = tokens + len(ids), text + piece
    assert inbox.put_msgs == [] and inbox.failures == []
    assert transport.written == want
    assert lane.edge == (tokens, len(text))
    taken = lane.take_pending()
    assert taken[:4] == (0, choice.token_ids, 0, text)
    assert lane.take_pending() is None and lane.pending == 0


def _grpc_lane(request_id: str = "req-1"):
    """A front door's `GrpcLane` taking messages (its compiled half: `.native`; what it wrote: `.outbox`)."""
    from services.gateway.grpc_lane import GrpcLane

    lane = GrpcLane(request_id)
    lane.open = True
    return lane


def test_an_armed_grpc_lane_writes_the_messages_the_handler_would_send():
    """Each delta taken becomes the `GenerateResponse` the gRPC front door builds for the router's
    delta (`fill_delta`): the client's offsets (after a migration too), the sample's cached tokens."""
    from deepinfer_proto import gateway_pb2
    from services.common.deltas import SampleAssembler
    from services.common.messages import fill_delta

    rng = random.Random(11)
    for base_tokens, base_chars, cached in [(0, 0, 0), (5, 17, 0), (3, 4, 9), (200, 300, 0)]:
        owner = _grpc_lane(f"r-{base_tokens}")
        lane = owner.native
        assembler = SampleAssembler(0)
        assembler.tokens, assembler.text = [1] * base_tokens, "x" * base_chars
        assembler.sent_tokens, assembler.sent_chars = base_tokens, base_chars
        assembler.num_cached_tokens = cached
        lane.arm(base_tokens, base_chars, base_tokens, base_chars, cached)
        inbox = Inbox(lane)
        tokens, text, want, got = 0, "", [], []
        for i in range(200):
            piece = _random_text(rng)
            ids = [rng.randrange(0, 1 << 31) for _ in range(rng.choice([0, 1, 1, 1, 2]))]
            seen = rng.choice([0, 0, 0, cached + i])  # what the worker says of the cache, now and then
            delta = SampleDelta(0, tokens, ids, len(text), piece, num_cached_tokens=seen)
            _dispatch(_batch(("r", delta)), {"r": inbox})
            got += owner.outbox  # sent by the handler
            owner.outbox.clear()
            routed = assembler.push(
                SampleDelta(0, tokens + base_tokens, ids, len(text) + base_chars, piece, num_cached_tokens=seen)
            )
            if routed is not None:
                msg = gateway_pb2.GenerateResponse(request_id=f"r-{base_tokens}")
                fill_delta(msg.delta, routed)
                want.append(msg.SerializeToString())
            tokens, text = tokens + len(ids), text + piece
        assert inbox.put_msgs == [] and inbox.failures == []
        assert got == want
        for message in got:  # and each parses as the message
            assert gateway_pb2.GenerateResponse.FromString(message).SerializeToString() == message


def test_a_grpc_lane_steps_aside_while_its_owner_is_not_ready():
    from services.gateway.grpc_lane import OUTBOX_LIMIT

    owner = _grpc_lane()
    lane = owner.native
    lane.arm(0, 0, 0, 0)
    inbox = Inbox(lane)
    owner.open = False  # the handler has not sent its first message, or has ended
    _dispatch(_batch(("r", SampleDelta(0, 0, [7], 0, "a"))), {"r": inbox})
    assert not owner.outbox and len(inbox.put_msgs) == 1 and lane.pending == 0
    owner.open = True
    for i in range(OUTBOX_LIMIT + 3):  # the handler does not come for them: the lane stops at the limit
        _dispatch(_batch(("r", SampleDelta(0, i, [7], i, "a"))), {"r": inbox})
    assert len(owner.outbox) == OUTBOX_LIMIT and lane.pending == OUTBOX_LIMIT and len(inbox.put_msgs) == 4


def test_with_no_lane_armed_every_item_reaches_put_as_the_python_dispatch_gives_it():
    rng = random.Random(11)
    for _ in range(200):
        items = []
        for _ in range(rng.randrange(0, 6)):
            n = rng.randrange(0, 3)
            d = SampleDelta(
                index=rng.randrange(0, 3),
                token_offset=rng.randrange(0, 1000),
                token_ids=[rng.randrange(0, 1 << 31) for _ in range(n)],
                text_offset=rng.randrange(0, 5000),
                text=_random_text(rng),
                logprobs=[TokenLogprob(1, -0.5, {1: -0.5, 2: -1.5})] * n if rng.random() < 0.2 else None,
                finish_reason=rng.choice([None, None, "stop", "length", "error"]),
                stop_reason=rng.choice([None, 7, "zz"]),
                error=rng.choice([None, "boom"]),
                num_cached_tokens=rng.randrange(0, 3),
            )
            items.append((rng.choice(["a", "b", "c", "gone"]), d))
        raw = _batch(*items)
        mine = {k: Inbox(None if k != "b" else _lane()[0]) for k in "abc"}  # b's lane is not armed
        theirs = {k: Inbox() for k in "abc"}
        _dispatch(raw, mine)
        native._dispatch_python(raw, theirs)
        for k in "abc":
            assert mine[k].put_msgs == theirs[k].put_msgs


def test_an_armed_lane_takes_only_plain_deltas_at_its_edge():
    lane, _, transport, _, _ = _lane()
    lane.arm(10, 30, 4, 12)  # after a migration: the attempt's output starts at token 4, char 12
    inbox = Inbox(lane)
    at_edge = SampleDelta(0, 6, [5], 18, " w5")
    refused = [
        SampleDelta(0, 6, [5], 18, " w5", finish_reason="length"),
        SampleDelta(0, 6, [5], 18, " w5", logprobs=[TokenLogprob(5, -0.1, {5: -0.1})]),
        SampleDelta(0, 6, [5], 18, " w5", error="x"),
        SampleDelta(0, 5, [5], 18, " w5"),  # not at the edge
        SampleDelta(0, 6, [5], 17, " w5"),
    ]
    for d in refused:
        _dispatch(_batch(("r", d)), {"r": inbox})
    assert len(inbox.put_msgs) == len(refused) and transport.written == []
    assert [m.SerializeToString() for m in inbox.put_msgs] == [
        batch_to_proto([("r", d)]).items[0].delta.SerializeToString() for d in refused
    ]
    _dispatch(_batch(("r", at_edge), ("r", SampleDelta(0, 7, [6, 7], 21, "\ufffd"))), {"r": inbox})
    assert len(transport.written) == 2 and lane.edge == (13, 34)
    token_offset, ids, text_offset, text, cached, first_at, last_at, clean = lane.take_pending()
    assert (token_offset, ids, text_offset, text, cached) == (6, [5, 6, 7], 18, " w5\ufffd", 0)
    assert first_at <= last_at and clean == (11, 33)  # the one-token delta; the other ends on U+FFFD


def test_a_lane_steps_aside_while_it_is_disarmed_or_its_connection_cannot_take_a_write():
    lane, _, transport, cycle, flow = _lane()
    inbox = Inbox(lane)
    delta = SampleDelta(0, 0, [1], 0, " w1")
    _dispatch(_batch(("r", delta)), {"r": inbox})  # not armed
    lane.arm(0, 0, 0, 0)
    for attr, owner in (("write_paused", flow), ("disconnected", cycle), ("response_complete", cycle)):
        setattr(owner, attr, True)
        _dispatch(_batch(("r", delta)), {"r": inbox})
        setattr(owner, attr, False)
    transport.closing = True
    _dispatch(_batch(("r", delta)), {"r": inbox})
    transport.closing = False
    assert len(inbox.put_msgs) == 5 and transport.written == [] and lane.pending == 0
    lane.disarm()
    _dispatch(_batch(("r", delta)), {"r": inbox})
    assert len(inbox.put_msgs) == 6
    lane.arm(0, 0, 0, 0)
    _dispatch(_batch(("r", delta)), {"r": inbox})
    with pytest.raises(RuntimeError):  # armed again while what it took is not taken back: a bug
        lane.arm(1, 3, 0, 0)


def test_a_failed_write_ends_that_request_and_the_dispatch_goes_on():
    lane, _, _, _, _ = _lane(transport=Transport(fail=True))
    lane.arm(0, 0, 0, 0)
    broken, other = Inbox(lane), Inbox()
    _dispatch(_batch(("r", SampleDelta(0, 0, [1], 0, " w1")), ("o", SampleDelta(0, 0, [2], 0, " w2"))),
              {"r": broken, "o": other})  # fmt: skip
    assert [type(e) for e in broken.failures] == [OSError] and not lane.armed and broken.put_msgs == []
    assert len(other.put_msgs) == 1


def test_a_batch_that_does_not_parse_is_refused():
    with pytest.raises(ValueError):
        _dispatch(b"\x0a\x05ab", {})
    empty = worker_pb2.DeltaBatch().SerializeToString()
    _dispatch(empty, {})


def _random_delta(rng: random.Random) -> SampleDelta:
    n = rng.randrange(0, 4)
    return SampleDelta(
        index=rng.choice([0, 0, 1, 7]),
        token_offset=rng.choice([0, rng.randrange(0, 1 << 32)]),
        token_ids=[rng.choice([0, 1, rng.randrange(0, 1 << 31), -rng.randrange(1, 1 << 31)]) for _ in range(n)],
        text_offset=rng.choice([0, rng.randrange(0, 1 << 32)]),
        text=_random_text(rng),
        finish_reason=rng.choice([None, "", "stop", "length", "error"]),
        stop_reason=rng.choice([None, 0, 7, -3, "", "zz"]),
        error=rng.choice([None, "", "boom"]),
        num_cached_tokens=rng.choice([0, rng.randrange(0, 1 << 32)]),
    )


def test_a_workers_turn_encodes_to_the_message_the_python_encoder_fills():
    rng = random.Random(5)
    for _ in range(500):
        items = [(rng.choice(["a", "r-1", "é", ""]), _random_delta(rng)) for _ in range(rng.randrange(0, 8))]
        raw = native.encode_batch(items)
        assert worker_pb2.DeltaBatch.FromString(raw) == batch_to_proto(items), items
    assert native.encode_batch([]) == b""


def test_a_turn_it_cannot_encode_is_left_to_the_python_encoder():
    plain = ("r", SampleDelta(0, 0, [1], 0, " w1"))
    for odd in (
        ("r", SampleDelta(0, 0, [1], 0, " w1", logprobs=[TokenLogprob(1, -0.5, {1: -0.5})])),
        ("r", SampleDelta(0, 0, [1 << 40], 0, "")),  # not an int32
        ("r", SampleDelta(0, -1, [1], 0, "")),  # not a uint32
        ("r", SampleDelta(0, 0, [1], 0, "\ud800")),  # not UTF-8
        ("r", SampleDelta(0, 0, (1,), 0, "")),  # not a list
    ):
        assert native.encode_batch([plain, odd]) is None
    with_logprobs = [plain, ("r", SampleDelta(1, 2, [3, 4], 5, "ab", [TokenLogprob(3, -0.5, {3: -0.5})] * 2))]
    assert batch_message(with_logprobs) == batch_to_proto(with_logprobs)
    assert batch_message([plain]) == batch_to_proto([plain])


def test_deltas_without_text_come_back_with_empty_text():
    """A token whose bytes do not yet end a character has no text: the replay still gets a str."""
    lane, _, transport, _, _ = _lane()
    lane.arm(0, 0, 0, 0)
    _dispatch(_batch(("r", SampleDelta(0, 0, [7], 0, "")), ("r", SampleDelta(0, 1, [8], 0, ""))), {"r": Inbox(lane)})
    assert lane.take_pending()[:4] == (0, [7, 8], 0, "")
    assert len(transport.written) == 2  # a completion's event carries "" all the same


def test_a_lane_in_a_reference_cycle_is_collected():
    import gc
    import weakref

    lane, _, transport, _, _ = _lane()
    transport.lane = lane  # the connection leading back to the lane
    gone = weakref.ref(transport)
    del lane, transport
    gc.collect()
    assert gone() is None
