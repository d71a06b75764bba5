"""`python -m bench.intake_isolation`'s systems and its one table (the run itself needs a cluster: the command
is in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import asyncio
import threading

import httpx
import pytest

from bench import intake_sink
from bench.intake_isolation import Outcome, Refusals, report, systems
from engine.ports import free_ports
from pdserve_client.sdk import AsyncPdserveClient, PdserveError


def test_systems_are_doubles_at_a_revision_this_tree_or_the_sink() -> None:
    assert systems("doubles@5670910, doubles,sink") == ["doubles@5670910", "doubles", "sink"]
    for wrong in ("pd", "doubles@", "vllm,doubles", "sink@abc", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            systems(wrong)


def _outcome(loaded: list[float], unexpected: tuple[str, ...] = ()) -> Outcome:
    return Outcome(
        idle=[0.002, 0.002, 0.003],
        loaded=loaded,
        grpc=Refusals(seconds=[0.025, 0.030]),
        http=Refusals(seconds=[0.050], unexpected=list(unexpected)),
        how="4 at once (2 per door), 3 bursts",
    )


def test_the_table_has_a_row_per_system_and_fails_on_what_was_not_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert report([("doubles@abc", _outcome([0.020, 0.040])), ("doubles", _outcome([0.004]))]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["doubles@abc"][:4] == ["2", "40", "40", "20.00x"]
    assert rows["doubles"][:4] == ["2", "4", "4", "2.00x"]
    assert rows["doubles"][4:] == ["30", "30", "50", "50"]
    assert report([("doubles", _outcome([0.004], ("http 200: accepted",)))]) == 1
    assert report([("doubles", _outcome([]))]) == 1


async def test_the_sink_reads_each_over_long_prompt_whole_and_refuses_it_on_both_doors() -> None:
    grpc_port, http_port = free_ports(2)
    ready, stop = threading.Event(), threading.Event()
    sink = asyncio.create_task(intake_sink.serve(grpc_port, http_port, ready, stop))
    try:
        assert await asyncio.to_thread(ready.wait, 10)
        text = "word " * 800_000  # 4 MB, under the receive limit
        async with AsyncPdserveClient(f"127.0.0.1:{grpc_port}") as client:
            for _ in range(2):
                with pytest.raises(PdserveError, match=intake_sink.REFUSAL):
                    async for _ in client.generate(prompt=text, max_tokens=8, timeout=10):
                        pass
        body = b'{"messages": [{"role": "user", "content": "' + text.encode() + b'"}]}'
        async with httpx.AsyncClient(timeout=10) as http:  # one connection, two requests in turn
            for _ in range(2):
                response = await http.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", content=body)
                assert response.status_code == 400
                assert response.json() == {"error": {"message": "refused by the sink"}}
    finally:
        stop.set()
        await asyncio.wait_for(sink, 10)
