"""A decode request's outputs, gathered per streamed batch: what vLLM's output processor puts for one request
lands in a `BatchedOutputs` instead of vLLM's per-request collector (`stream_in_batches` swaps it in), so the
request's task wakes once per batch rather than once per engine step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from engine.messages import EngineRequest, StreamBatch


class BatchedOutputs:
    """Where vLLM's output processor puts one request's outputs (in place of its RequestOutputCollector,
    whose `put` this matches): each engine step's delta is merged into the pending one, as vLLM's own
    collector merges when its reader lags, and the reader is woken only once a batch is due: the first
    token at once, then `max_tokens` tokens or `max_wait_s` after the batch's first, the end, or an error.
    A stream then costs a task wake per batch instead of one per engine step."""

    def __init__(self, max_tokens: int, max_wait_s: float) -> None:
        self._max_tokens = max_tokens
        self._max_wait_s = max_wait_s
        self._pending: Any = None  # a RequestOutput (merged deltas) or an Exception
        self._started = 0.0  # when the pending batch's first output came
        self._first_sent = False
        self._due = asyncio.Event()

    def put(self, output: Any) -> None:
        pending = self._pending
        if isinstance(pending, Exception):
            return  # the error ends the stream; later outputs do not matter
        if pending is None or isinstance(output, Exception):
            self._pending = pending = output
            self._started = time.monotonic()
        else:
            pending.add(output, aggregate=True)
        if (
            isinstance(pending, Exception)
            or not self._first_sent
            or pending.finished
            or len(pending.outputs[0].token_ids) >= self._max_tokens
            or time.monotonic() - self._started >= self._max_wait_s
        ):
            self._due.set()

    async def get(self) -> Any:
        await self._due.wait()
        out, self._pending = self._pending, None
        self._due.clear()
        if isinstance(out, Exception):
            raise out
        if out.outputs[0].token_ids:
            self._first_sent = True
        return out


async def stream_in_batches(
    llm: Any, req: EngineRequest, prompt: dict[str, Any], params: Any, batch: StreamBatch
) -> AsyncGenerator[Any, None]:
    """vLLM's AsyncLLM.generate for `req`, with the request's outputs put into a `BatchedOutputs` instead of
    vLLM's per-step collector: each item is a streamed batch."""
    from vllm.v1.engine.exceptions import EngineDeadError

    # trace_headers: vLLM's own spans join the request's trace.
    queue = await llm.add_request(req.request_id, prompt, params, trace_headers=req.trace_context)
    source: Any = queue
    state = llm.output_processor.request_states.get(queue.request_id)
    if state is not None and state.queue is queue:  # else it finished already: its output is in `queue`
        source = state.queue = BatchedOutputs(batch.tokens, batch.ms / 1e3)
        if queue.output is not None:  # put while add_request awaited the engine core
            source.put(queue.output)
    try:
        while True:
            out = await source.get()
            yield out
            if out.finished:
                return
    except EngineDeadError:
        raise
    except BaseException:
        # As vLLM's generate: a request given up (closed, cancelled, failed) is aborted in the engine.
        await llm.abort(queue.request_id, internal=True)
        raise
