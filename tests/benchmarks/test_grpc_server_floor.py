"""`benchmarks/grpc_server_floor.py` end to end at its smallest: both servers in processes of their
own, grpc's clients reading every message (the benchmark refuses a run that lost one)."""

from benchmarks import grpc_server_floor


def test_both_servers_deliver_every_message(capsys):
    assert (
        grpc_server_floor.main(
            ["--streams", "6", "--messages", "15", "--step-ms", "5", "--clients", "2", "--calls", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| grpcio ") or line.startswith("| h2 ")]
    assert len(rows) == 2 and all(" 180 |" in row for row in rows), out
    assert "server CPU per message" in out
