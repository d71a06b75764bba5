"""The engine host's own pieces: how a request's stream ends when the engine hangs or the
request is given up, on a stand-in for vLLM's AsyncLLM surface (the engine itself: tests/e2e)."""

import asyncio
from typing import Any

import pytest
from replicas import tiny_spec

from engine.batched_outputs import BatchedOutputs
from engine.host import EngineHost
from engine.messages import EngineRequest, ReplicaFailed, Sampling, StreamBatch


class _Collector:
    """vLLM's per-request output queue (RequestOutputCollector): an exception put there is raised."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()


class _StandInLLM:
    """The surface of vLLM's AsyncLLM that EngineHost._outputs and failure use: `generate` yields what a
    test puts on the request's queue (until a finished output), and `output_processor.propagate_error`
    puts an exception on every open request's queue, as vLLM's own is for a dead engine."""

    def __init__(self) -> None:
        self.errored = False
        self.open: dict[str, _Collector] = {}
        self.closed: list[str] = []
        self.params: dict[str, Any] = {}
        self.output_processor = self

    def propagate_error(self, e: Exception) -> None:
        for c in self.open.values():
            c.queue.put_nowait(e)

    async def generate(self, prompt: object, params: object, *, request_id: str, **_: object) -> Any:
        c = self.open[request_id] = _Collector()
        self.params[request_id] = params
        try:
            while True:
                out = await c.queue.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if getattr(out, "finished", False):
                    return
        finally:
            self.closed.append(request_id)  # vLLM aborts the request here when it did not finish
            del self.open[request_id]


def _host(hang_timeout_s: float) -> tuple[EngineHost, _StandInLLM]:
    spec = tiny_spec("decode", engine="vllm", hang_timeout_s=hang_timeout_s)
    host = EngineHost(spec, replica_id="d1", node_id="n1", node_ip="127.0.0.1")
    host._llm = llm = _StandInLLM()
    return host, llm


async def test_a_hung_engines_streams_end_as_replica_failed_when_the_watchdog_asks() -> None:
    host, llm = _host(hang_timeout_s=0.05)
    request = EngineRequest(request_id="r1", prompt_token_ids=[1, 2], sampling=Sampling())
    outputs = host._outputs(request, None)
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.01)
    llm.open["r1"].queue.put_nowait("token")
    assert await first == "token"
    waiting = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.1)  # no step for longer than hang_timeout_s, one request in flight
    assert not waiting.done()  # nothing raises by itself: the watchdog's question ends it
    reason = host.failure()
    assert reason is not None and "no step for" in reason
    with pytest.raises(ReplicaFailed) as failed:
        await waiting
    assert failed.value.reason == reason and host._inflight == 0
    with pytest.raises(ReplicaFailed):  # sticky: nothing new starts on it
        await anext(host._outputs(request, None))


async def test_closing_a_stream_closes_vllms_at_once_which_aborts_the_request() -> None:
    host, llm = _host(hang_timeout_s=30)
    outputs = host._outputs(EngineRequest(request_id="r2", prompt_token_ids=[1], sampling=Sampling()), None)
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.01)
    llm.open["r2"].queue.put_nowait("token")
    await first
    await outputs.aclose()
    assert llm.closed == ["r2"] and host._inflight == 0 and host.failure() is None


def _output(ids: list[int], finished: bool = False) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    text = "".join(f" t{i}" for i in ids)
    completion = CompletionOutput(
        index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None, finish_reason=None
    )
    return RequestOutput("r", None, [1, 2], None, [completion], finished)


async def _taken(outputs: BatchedOutputs) -> Any:
    return await asyncio.wait_for(outputs.get(), 1.0)


async def test_batched_outputs_wake_the_reader_once_per_batch_with_the_steps_merged() -> None:
    """The first token at once, then `max_tokens` tokens (or the wait, or the end) per wake-up: the engine
    steps in between are merged into one delta, as vLLM's own collector merges for a lagging reader."""
    outputs = BatchedOutputs(max_tokens=3, max_wait_s=60.0)
    outputs.put(_output([5]))
    first = await _taken(outputs)
    assert first.outputs[0].token_ids == [5]
    outputs.put(_output([6]))
    outputs.put(_output([7]))
    reader = asyncio.ensure_future(outputs.get())
    await asyncio.sleep(0.01)
    assert not reader.done()  # two tokens pending: no batch yet
    outputs.put(_output([8]))
    batch = await asyncio.wait_for(reader, 1.0)
    assert (list(batch.outputs[0].token_ids), batch.outputs[0].text) == ([6, 7, 8], " t6 t7 t8")
    outputs.put(_output([9]))
    outputs.put(_output([10], finished=True))  # the end is due at once
    last = await _taken(outputs)
    assert list(last.outputs[0].token_ids) == [9, 10] and last.finished


async def test_batched_outputs_are_due_after_the_wait_and_an_error_at_once() -> None:
    outputs = BatchedOutputs(max_tokens=100, max_wait_s=0.02)
    outputs.put(_output([]))  # an empty delta (e.g. before a pulled prompt's first token) is not the first
    assert (await _taken(outputs)).outputs[0].token_ids == []
    outputs.put(_output([5]))
    assert (await _taken(outputs)).outputs[0].token_ids == [5]
    outputs.put(_output([6]))
    await asyncio.sleep(0.03)
    outputs.put(_output([7]))  # the wait passed since this batch's first token
    assert list((await _taken(outputs)).outputs[0].token_ids) == [6, 7]
    outputs.put(_output([8]))
    outputs.put(RuntimeError("engine dead"))
    outputs.put(_output([9]))  # after the error: dropped
    with pytest.raises(RuntimeError, match="engine dead"):
        await _taken(outputs)


class _StandInBatchingLLM(_StandInLLM):
    """`add_request` as vLLM's: registers the request's collector with the output processor, whose
    `request_states[id].queue.put` the engine's steps then call."""

    def __init__(self) -> None:
        super().__init__()
        self.request_states: dict[str, Any] = {}
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: object, params: object, **_: object) -> Any:
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.output_processor import RequestOutputCollector

        queue = RequestOutputCollector(RequestOutputKind.DELTA, request_id + "-internal")
        self.request_states[queue.request_id] = type("State", (), {"queue": queue})()
        queue.put(_output([5]))  # a step's output came while the request was being added
        return queue

    def step(self, ids: list[int], finished: bool = False) -> None:
        for state in self.request_states.values():
            state.queue.put(_output(ids, finished))

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self.aborted.append(request_id)


async def test_a_batched_stream_takes_the_requests_outputs_and_aborts_it_when_given_up() -> None:
    spec = tiny_spec("decode", engine="vllm", hang_timeout_s=30)
    host = EngineHost(spec, replica_id="d1", node_id="n1", node_ip="127.0.0.1")
    host._llm = llm = _StandInBatchingLLM()
    request = EngineRequest(request_id="r3", prompt_token_ids=[1], sampling=Sampling())
    outputs = host._outputs(request, None, StreamBatch(tokens=2, ms=60_000.0))
    first = await anext(outputs)
    assert list(first.outputs[0].token_ids) == [5]  # put before the handover, not lost
    llm.step([6])
    llm.step([7])
    assert list((await anext(outputs)).outputs[0].token_ids) == [6, 7]
    llm.step([8])
    await outputs.aclose()  # the client went away mid-batch
    assert llm.aborted == ["r3-internal"] and host._inflight == 0


async def test_a_one_token_legs_token_is_not_detokenized_and_a_streams_tokens_are() -> None:
    """A prefill leg's (or a KV pin's) one token is discarded: vLLM is asked for no text, which spares it a
    detokenizer primed with the whole prompt. Streamed tokens keep their text."""
    host, llm = _host(hang_timeout_s=30)
    request = EngineRequest(request_id="p1", prompt_token_ids=list(range(64)), sampling=Sampling())
    leg = asyncio.ensure_future(host._one_token(request, {"do_remote_decode": True}))
    await asyncio.sleep(0.01)
    llm.open["p1"].queue.put_nowait(_output([5], finished=True))
    assert (await asyncio.wait_for(leg, 1.0)).finished
    one_token = llm.params["p1"]
    assert one_token.detokenize is False and one_token.max_tokens == 1 and not one_token.stop
    assert host._sampling_params(Sampling(stop=["\n"]), None).detokenize is True
