"""`benchmarks/sse_floor.py` end to end at its smallest: the bare server and the bare ASGI app on
uvicorn in processes of their own, the service-layer benchmark's SSE clients reading whole streams
(the benchmark refuses a run in which a request came back with fewer events than it was sent)."""

from benchmarks import sse_floor


def test_both_servers_deliver_whole_streams(capsys):
    argv = ["--streams", "4", "--events", "5", "--step-ms", "5", "--clients", "2", "--seconds", "1"]
    assert sse_floor.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("| bare ", "| uvicorn "))]
    assert len(rows) == 2, out
    for row in rows:
        events, requests = int(row[2]), int(row[4])
        assert requests >= 4 and events == 5 * requests, out
