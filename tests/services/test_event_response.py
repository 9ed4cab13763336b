"""`EventStream`, the streamed completions' HTTP response, over a hand-driven ASGI connection: the
events go out through the server's own `send` once the start went through the app's, the body
ends properly, the client leaving ends the event generator (its clean-up runs) at once, and the
admitted work is let go in every case."""

import asyncio

import pytest

from services.gateway.event_response import SERVER_SEND, EventStream


class _Connection:
    def __init__(self):
        self.app_sent: list[dict] = []
        self.server_sent: list[dict] = []
        self.left = asyncio.Event()

    async def app_send(self, message):
        self.app_sent.append(message)

    async def server_send(self, message):
        self.server_sent.append(message)

    async def receive(self):
        await self.left.wait()
        return {"type": "http.disconnect"}

    def scope(self) -> dict:
        return {"type": "http", SERVER_SEND: self.server_send}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_events_go_through_the_server_send_and_the_body_ends():
    async def events():
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    async def run():
        conn, ended = _Connection(), []
        await EventStream(events(), on_end=lambda: ended.append(True))(conn.scope(), conn.receive, conn.app_send)
        return conn, ended

    conn, ended = _run(run())
    assert [m["type"] for m in conn.app_sent] == ["http.response.start"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in conn.app_sent[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in conn.server_sent] == [
        (b"data: 1\n\n", True),
        (b"data: [DONE]\n\n", True),
        (b"", False),
    ]
    assert ended == [True]


def test_the_client_leaving_ends_the_generator_and_lets_go_of_the_work():
    async def run():
        conn, ended, cleaned = _Connection(), [], asyncio.Event()

        async def events():
            try:
                yield b"data: 1\n\n"
                await asyncio.sleep(60)  # waiting for a token that never comes
                yield b"data: 2\n\n"
            finally:
                cleaned.set()  # where the request is aborted upstream

        response = EventStream(events(), on_end=lambda: ended.append(True))
        call = asyncio.ensure_future(response(conn.scope(), conn.receive, conn.app_send))
        await asyncio.sleep(0.05)
        conn.left.set()
        await call  # ends without raising: the response is over
        return conn, ended, cleaned.is_set()

    conn, ended, cleaned = _run(run())
    assert cleaned and ended == [True]
    assert [m["body"] for m in conn.server_sent] == [b"data: 1\n\n"]


def test_a_failing_generator_raises_and_still_lets_go():
    async def events():
        yield b"data: 1\n\n"
        raise RuntimeError("bug")

    async def run():
        conn, ended = _Connection(), []
        with pytest.raises(RuntimeError, match="bug"):
            await EventStream(events(), on_end=lambda: ended.append(True))(conn.scope(), conn.receive, conn.app_send)
        return ended

    assert _run(run()) == [True]


def test_without_a_server_send_the_app_send_carries_the_body():
    async def events():
        yield b"data: 1\n\n"

    async def run():
        conn = _Connection()
        await EventStream(events(), on_end=lambda: None)({"type": "http"}, conn.receive, conn.app_send)
        return conn

    conn = _run(run())
    assert [m["type"] for m in conn.app_sent] == ["http.response.start", "http.response.body", "http.response.body"]


def test_a_client_leaving_before_the_first_delta_cancels_the_wait_at_once():
    """`ClientWatch.until_gone`: the wait (here for a first delta that never comes) is cancelled in
    the request's own task as soon as the server says the client left, its clean-up runs, and it
    raises CANCELLED; the task itself is not left cancelled."""
    from services.common.errors import ErrorCode, ServiceError
    from services.gateway.client_watch import ClientWatch

    async def run():
        conn, cleaned = _Connection(), asyncio.Event()

        async def first_delta():
            try:
                await asyncio.sleep(60)
            finally:
                cleaned.set()  # where the request is aborted upstream

        watch = ClientWatch(conn.receive)
        asyncio.get_running_loop().call_later(0.05, conn.left.set)
        start = asyncio.get_running_loop().time()
        with pytest.raises(ServiceError) as e:
            await watch.until_gone(first_delta())
        took = asyncio.get_running_loop().time() - start
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0)  # still runnable: not cancelled
        return e.value.code, cleaned.is_set(), took, watch.left()

    code, cleaned, took, left = _run(run())
    assert code is ErrorCode.CANCELLED and cleaned and left
    assert took < 1.0


def test_a_watch_lets_the_wait_finish_and_then_stays_out_of_the_way():
    """The wait ends first: its result comes back, and a client leaving afterwards (or the watch
    stopping) cancels nothing."""
    from services.gateway.client_watch import ClientWatch

    async def run():
        conn = _Connection()
        watch = ClientWatch(conn.receive)

        async def answer():
            await asyncio.sleep(0.01)
            return 42

        got = await watch.until_gone(answer())
        conn.left.set()
        await asyncio.sleep(0.05)  # the watch sees the client leave: nothing is waiting on it now
        watch.stop()
        await asyncio.sleep(0.01)
        return got, watch.left()

    assert _run(run()) == (42, True)


def test_a_server_cancel_is_not_mistaken_for_the_client_leaving():
    from services.gateway.client_watch import ClientWatch

    async def run():
        conn = _Connection()
        watch = ClientWatch(conn.receive)
        waiting = asyncio.ensure_future(watch.until_gone(asyncio.sleep(60)))
        await asyncio.sleep(0.02)
        waiting.cancel()  # the server shutting down, say
        with pytest.raises(asyncio.CancelledError):
            await waiting
        watch.stop()

    _run(run())


def _served_writes(events, http: str = "httptools") -> list[bytes]:
    """What uvicorn's HTTP/1.1 protocol (`http`) writes for one request to a direct route that
    answers with `EventStream(events)`, write by write."""
    import uvicorn
    from uvicorn.server import ServerState

    from benchmarks.gateway_path_parts import CountingTransport, http_request
    from services.gateway.event_response import EventStreamApp

    async def route(scope, receive, send):
        await EventStream(events(), on_end=lambda: None)(scope, receive, send)

    async def run():
        app = EventStreamApp()
        app.direct[("POST", "/s")] = route
        config = uvicorn.Config(app, http=http, lifespan="off", log_level="warning")
        config.load()
        state = ServerState()
        protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        transport = CountingTransport(10000, keep=True)
        protocol.connection_made(transport)
        protocol.data_received(http_request("/s", b"{}"))
        await asyncio.gather(*state.tasks)
        protocol.connection_lost(None)
        return transport.kept

    return _run(run())


def test_on_uvicorn_the_head_leaves_with_the_first_event_and_the_end_with_the_last():
    from services.gateway.chunks import Last

    async def events():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"
        yield Last(b"data: 3\n\ndata: [DONE]\n\n")

    writes = _served_writes(events)
    assert len(writes) == 3, writes
    head, first = writes[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head
    assert first == b"9\r\ndata: 1\n\n\r\n"
    assert writes[1:] == [b"9\r\ndata: 2\n\n\r\n", b"17\r\ndata: 3\n\ndata: [DONE]\n\n\r\n0\r\n\r\n"]
    # the same bytes as four writes would have carried: the head uvicorn builds, the framing `send` gives
    reference = _served_writes(events, http="h11")
    assert b"".join(writes).lower() == b"".join(reference).lower()


def test_a_stream_of_one_item_is_its_head_and_then_its_end():
    from services.gateway.chunks import Last

    async def events():
        yield Last(b"data: 1\n\ndata: [DONE]\n\n")

    writes = _served_writes(events)
    assert len(writes) == 2 and writes[0].endswith(b"\r\n\r\n"), writes
    assert writes[1] == b"17\r\ndata: 1\n\ndata: [DONE]\n\n\r\n0\r\n\r\n"


def test_a_stream_with_no_events_is_a_started_and_ended_body():
    async def events():
        return
        yield

    async def run():
        conn = _Connection()
        await EventStream(events(), on_end=lambda: None)(conn.scope(), conn.receive, conn.app_send)
        return conn

    conn = _run(run())
    assert [m["type"] for m in conn.app_sent] == ["http.response.start"]
    assert [(m["body"], m["more_body"]) for m in conn.server_sent] == [(b"", False)]
