"""The request path through the two legs, with in-process stand-ins for the leg channel and the decode
deployment's Serve handle (the real channel is specified in test_leg_channel.py; tests/e2e runs engines)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from decode_pool import StandInLegs, token_receiver
from ray.exceptions import ActorDiedError

from engine.messages import EngineRequest, PrefillResult, ReplicaFailed, ReplyTo, Sampling, TokenBatch
from router.errors import NoReplicaError
from router.legs.leg_channel import ReplicaLost
from router.legs.orchestrator import MOVE_BACKOFF_S, Orchestrator
from router.messages import RequestSummary, Route

PROMPT = list(range(100, 200))
KV = {"remote_engine_id": "p", "remote_block_ids": [[1, 2, 3]], "do_remote_prefill": True}


class _Call:
    def __init__(self, result: Any) -> None:
        self._result = result
        self.cancelled = False

    def __await__(self) -> Any:
        async def get() -> Any:
            if isinstance(self._result, BaseException):
                raise self._result
            return self._result

        return get().__await__()

    def cancel(self) -> None:
        self.cancelled = True


HANG = object()  # a stream that never sends its next batch


class _Stream:
    """A decode engine's batches (or an exception: the replica fails there); `cancelled` once the router
    gave the stream up (the engine request would be aborted)."""

    def __init__(self, batches: list[Any]) -> None:
        self._batches = batches
        self.cancelled = False

    async def gen(self) -> AsyncIterator[TokenBatch]:
        try:
            for b in self._batches:
                await asyncio.sleep(0)
                if b is HANG:
                    await asyncio.Event().wait()
                if isinstance(b, BaseException):
                    # A replica's failure reaches the router after the batches it sent before it.
                    await asyncio.sleep(0.02)
                    raise b
                yield b
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled = True
            raise


class FakePrefill:
    """Prefill legs: each returns the next of `results` (or raises it)."""

    def __init__(self, results: list[Any]) -> None:
        self.results = results
        self.calls: list[tuple[EngineRequest, str]] = []

    def start(self, req: EngineRequest, replica_id: str) -> _Call:
        self.calls.append((req, replica_id))
        return _Call(self.results.pop(0))


class FakeDecode(StandInLegs):
    """Decode legs send each stream's batches over the real token channel to the router's receiver
    (`tokens`), as a decode replica does; `release` and `export` stand in for the decode deployment's
    Serve handle."""

    def __init__(self, streams: list[list[Any]]) -> None:
        super().__init__(self._next_stream)
        self.streams = streams
        self.calls: list[tuple[EngineRequest, str]] = []
        self.opened: list[_Stream] = []
        self.release = FakeRelease()
        self.tokens = token_receiver()

    def _next_stream(self, req: EngineRequest, replica_id: str) -> AsyncIterator[TokenBatch]:
        s = _Stream(self.streams.pop(0))
        self.opened.append(s)
        return s.gen()

    def generate(self, req: EngineRequest, reply_to: ReplyTo, replica_id: str) -> asyncio.Task[int]:
        assert reply_to.address == self.tokens.address
        self.calls.append((req, replica_id))
        return super().generate(req, reply_to, replica_id)


class Legs:
    """The leg channel: prefill legs to `prefill`, decode legs to `decode`."""

    def __init__(self, prefill: FakePrefill, decode: FakeDecode) -> None:
        self.prefill = prefill.start
        self.generate = decode.generate


def orchestrator(prefill: FakePrefill, decode: FakeDecode, **kwargs: Any) -> Orchestrator:
    return Orchestrator(Legs(prefill, decode), decode, tokens=decode.tokens, **kwargs)  # type: ignore[arg-type]


def chosen(route: Route) -> Route:
    """`route` as the decider makes it: naming its replicas (P1, D1 where the test names none)."""
    return msgspec.structs.replace(
        route,
        prefill_replica=route.prefill_replica or ("P1" if route.prefill else None),
        decode_replica=route.decode_replica or "D1",
    )


class FakeRelease:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], str | None, tuple[str, ...]]] = []

    def remote(
        self, kv: dict[str, Any], replica_hint: str | None = None, replica_avoid: tuple[str, ...] = ()
    ) -> _Call:
        self.calls.append((kv, replica_hint, replica_avoid))
        return _Call(True)


def prefill_result(kv: dict[str, Any] | None) -> PrefillResult:
    return PrefillResult(
        request_id="r-p",
        replica_id="P1",
        node_id="n1",
        kv_transfer_params=kv,
        num_prompt_tokens=len(PROMPT),
        num_cached_tokens=0,
        prefill_ms=5.0,
    )


def tokens(*ids: int, final: bool = False) -> TokenBatch:
    if not final:
        return TokenBatch(token_ids=list(ids), text="x" * len(ids))
    return TokenBatch(
        token_ids=list(ids),
        text="x" * len(ids),
        finish_reason="length",
        num_prompt_tokens=len(PROMPT),
        num_cached_tokens=len(PROMPT) - 4,
        replica_id="D1",
        node_id="n1",
    )


async def run(orch: Orchestrator, route: Route) -> tuple[list[TokenBatch], RequestSummary]:
    batches, completions = [], []
    async for event in orch.run("r", PROMPT, Sampling(max_tokens=3), chosen(route)):
        (batches if isinstance(event, TokenBatch) else completions).append(event)
    assert len(completions) == 1, "exactly one terminal summary"
    return batches, completions[0]


async def test_disaggregated_request_hands_the_prefill_kv_params_to_decode() -> None:
    prefill = FakePrefill([prefill_result(KV)])
    decode = FakeDecode([[tokens(1), tokens(2, 3, final=True)]])
    orch = orchestrator(prefill, decode, block_size=32)
    batches, done = await run(orch, Route(prefill=True, prefill_replica="P1", decode_replica="D1"))
    assert [t for b in batches for t in b.token_ids] == [1, 2, 3]
    assert prefill.calls[0][1] == "P1" and decode.calls[0][1] == "D1"  # each leg goes where the policy chose
    assert decode.calls[0][0].kv_transfer_params == KV
    assert done.path == "disaggregated" and done.prefill_replica == "P1" and done.decode_replica == "D1"
    assert done.kv_transferred_tokens == 3 * 32 and done.completion_tokens == 3


async def test_prefill_without_kv_params_makes_decode_prefill_in_full_and_says_so() -> None:
    decode = FakeDecode([[tokens(7, final=True)]])
    orch = orchestrator(FakePrefill([prefill_result(None)]), decode, block_size=32)
    _, done = await run(orch, Route(prefill=True))
    assert decode.calls[0][0].kv_transfer_params is None
    assert done.path == "decode_full_prefill"
    assert "no KV transfer parameters" in done.note
    assert done.kv_transferred_tokens == 0


async def test_local_prefill_skips_the_prefill_leg() -> None:
    prefill = FakePrefill([])
    orch = orchestrator(prefill, FakeDecode([[tokens(1, final=True)]]), block_size=32)
    _, done = await run(orch, Route(prefill=False, decode_replica="D1"))
    assert prefill.calls == [] and done.path == "local_prefill" and done.prefill_replica == ""


class Failover:
    """Stands in for the request's lifecycle (router/request/lifecycle.py) that `Orchestrator.serve` takes:
    the router's next routes, and who heard of failures."""

    def __init__(self, *routes: Route) -> None:
        self.routes = list(routes)
        self.asked: list[tuple[list[int], Sampling]] = []
        self.failed: list[tuple[str, str]] = []
        self.request_id = "r"
        self.prompt = PROMPT
        self.sampling = Sampling()
        self.route = Route(prefill=False)
        self.attempts = 3
        self.prefills_done = 0
        self.trace_headers = None
        self.stages: list[str] = []

    def stage(self, name: str, began: float, ended: float) -> None:
        self.stages.append(name)

    def prefill_done(self) -> None:
        self.prefills_done += 1

    async def reroute(self, prompt: list[int], sampling: Sampling) -> Route:
        self.asked.append((prompt, sampling))
        return chosen(self.routes.pop(0))

    def replica_failed(self, replica_id: str, reason: str) -> None:
        self.failed.append((replica_id, reason))


async def serve(
    orch: Orchestrator, route: Route, failover: Failover, *, attempts: int = 3, max_tokens: int = 3
) -> tuple[list[int], RequestSummary]:
    ids, completions = [], []
    failover.sampling = Sampling(max_tokens=max_tokens, temperature=0.0)
    failover.route = chosen(route)
    failover.attempts = attempts
    async for event in orch.serve(failover):  # type: ignore[arg-type]
        if isinstance(event, TokenBatch):
            ids += event.token_ids
        else:
            completions.append(event)
    assert len(completions) == 1, "exactly one terminal summary"
    return ids, completions[0]


def from_replica(batch: TokenBatch, replica_id: str) -> TokenBatch:
    return msgspec.structs.replace(batch, replica_id=replica_id)


async def test_a_lost_prefill_replica_sends_the_request_on_a_new_route() -> None:
    prefill = FakePrefill([ReplicaLost("P1", "its leg channel is closed"), prefill_result(KV)])
    orch = orchestrator(prefill, FakeDecode([[tokens(1, 2, 3, final=True)]]), block_size=32)
    failover = Failover(Route(prefill=True, prefill_replica="P2", decode_replica="D1"))
    ids, done = await serve(orch, Route(prefill=True, prefill_replica="P1"), failover)
    assert [replica for _, replica in prefill.calls] == ["P1", "P2"]
    assert failover.failed == [("P1", "its leg channel is closed")]  # the leg went there: known for sure
    assert ids == [1, 2, 3] and done.path == "disaggregated" and done.completion_tokens == 3
    assert "continued after prefill replica P1: its leg channel is closed after 0 tokens" in done.note


async def test_a_failed_prefill_engine_is_reported_and_its_request_routed_again() -> None:
    prefill = FakePrefill([ReplicaFailed("P1", "its vLLM engine core died"), prefill_result(KV)])
    orch = orchestrator(prefill, FakeDecode([[tokens(1, 2, 3, final=True)]]), block_size=32)
    failover = Failover(Route(prefill=True, prefill_replica="P2"))
    await serve(orch, Route(prefill=True, prefill_replica="P1"), failover)
    assert failover.failed == [("P1", "its vLLM engine core died")]
    assert failover.asked == [(PROMPT, Sampling(max_tokens=3, temperature=0.0))]


async def test_a_decode_replica_lost_mid_stream_continues_elsewhere_from_the_tokens_so_far() -> None:
    decode = FakeDecode(
        [
            [from_replica(tokens(11), "D1"), ReplicaLost("D1", "its replica process died")],
            [tokens(12), tokens(13, final=True)],
        ]
    )
    orch = orchestrator(FakePrefill([prefill_result(KV)]), decode, block_size=32)
    failover = Failover(Route(prefill=False, decode_replica="D2"))
    ids, done = await serve(orch, Route(prefill=True, decode_replica="D1"), failover)
    # One stream for the client: the continuation's prompt is the original plus what was streamed, its
    # max_tokens what was left, and it recomputes (the KV handed to D1 is gone with it).
    assert ids == [11, 12, 13]
    second, hint = decode.calls[1]
    assert second.prompt_token_ids == [*PROMPT, 11] and second.sampling.max_tokens == 2
    assert second.kv_transfer_params is None and hint == "D2"
    assert second.request_id != decode.calls[0][0].request_id
    assert failover.failed == [("D1", "its replica process died")]
    assert done.prompt_tokens == len(PROMPT) and done.completion_tokens == 3
    assert "continued after decode replica D1: its replica process died after 1 tokens" in done.note


async def test_a_continuation_goes_to_the_replica_its_new_route_names() -> None:
    decode = FakeDecode(
        [[tokens(11), ReplicaFailed("D1", "its vLLM engine core died")], [tokens(12, 13, final=True)]]
    )
    orch = orchestrator(FakePrefill([]), decode, block_size=32)
    failover = Failover(Route(prefill=False, decode_replica="D2", avoid=("D1",)))
    await serve(orch, Route(prefill=False, decode_replica="D1"), failover)
    assert [replica for _, replica in decode.calls] == ["D1", "D2"]


@pytest.mark.parametrize("route", [Route(prefill=True, decode_replica="D1"), Route(prefill=False)])
async def test_a_route_that_names_no_replica_for_a_leg_is_refused(route: Route) -> None:
    orch = orchestrator(FakePrefill([]), FakeDecode([]), block_size=32)
    with pytest.raises(NoReplicaError, match="the route names no"):
        async for _ in orch.run("r", PROMPT, Sampling(max_tokens=3), route):
            pass


async def test_failing_again_at_once_waits_before_the_next_move(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    real_sleep, this_task = asyncio.sleep, asyncio.current_task()

    async def sleep(s: float, *args: Any) -> Any:
        # asyncio.sleep is one function for the whole loop: other tasks' sleeps (the stand-in streams',
        # a background poller left by an earlier test) still sleep and are not counted.
        if asyncio.current_task() is not this_task:
            return await real_sleep(s, *args)
        if s >= MOVE_BACKOFF_S:
            slept.append(s)
        return args[0] if args else None

    monkeypatch.setattr("router.legs.orchestrator.asyncio.sleep", sleep)
    dead = ReplicaFailed("D1", "its vLLM engine core died")
    decode = FakeDecode([[dead], [dead], [dead], [tokens(1, 2, 3, final=True)]])
    orch = orchestrator(FakePrefill([]), decode, block_size=32)
    failover = Failover(*[Route(prefill=False, decode_replica="D1")] * 3)
    ids, _ = await serve(orch, Route(prefill=False, decode_replica="D1"), failover, attempts=3)
    assert ids == [1, 2, 3] and slept == [0.5, 1.0]  # the first move at once


async def test_a_failed_engine_names_itself_and_the_request_goes_on() -> None:
    decode = FakeDecode(
        [[tokens(11), ReplicaFailed("D1", "its vLLM engine core died")], [tokens(12, 13, final=True)]]
    )
    orch = orchestrator(FakePrefill([]), decode, block_size=32)
    failover = Failover(Route(prefill=False, decode_replica="D2"))
    ids, _ = await serve(orch, Route(prefill=False, decode_replica="D1"), failover)
    assert ids == [11, 12, 13] and failover.failed == [("D1", "its vLLM engine core died")]


async def test_failover_gives_up_after_its_attempts_with_a_message_fit_for_a_client() -> None:
    lost = ReplicaLost("D1", "its leg channel is closed")
    decode = FakeDecode([[lost], [lost]])
    orch = orchestrator(FakePrefill([]), decode, block_size=32)
    failover = Failover(Route(prefill=False, decode_replica="D2"))
    with pytest.raises(NoReplicaError) as info:
        await serve(orch, Route(prefill=False, decode_replica="D1"), failover, attempts=1)
    assert len(decode.calls) == 2
    message = str(info.value)
    assert message.startswith("no replica could finish the request: decode replica D1: its leg channel")
    assert "Traceback" not in message and "ReplicaLost" not in message


async def test_a_consumer_that_stops_early_cancels_the_decode_stream() -> None:
    decode = FakeDecode([[tokens(1), HANG, tokens(3, final=True)]])  # the engine is still generating
    orch = orchestrator(FakePrefill([prefill_result(KV)]), decode, block_size=32)
    events = orch.run("r", PROMPT, Sampling(max_tokens=3), chosen(Route(prefill=True)))
    first = await anext(events)
    assert isinstance(first, TokenBatch)
    await events.aclose()  # the client went away
    await settled()  # the call's cancellation reaches the replica
    assert decode.opened[0].cancelled


async def settled() -> None:
    """Let the orchestrator's background releases run."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_request_cancelled_before_decode_pulled_its_kv_frees_it_on_the_prefill_engine() -> None:
    decode = FakeDecode([[HANG]])
    orch = orchestrator(FakePrefill([prefill_result(KV)]), decode, block_size=32)
    task = asyncio.ensure_future(run(orch, Route(prefill=True, prefill_replica="P1", decode_replica="D1")))
    await settled()  # prefilled; the decode call is out, its first batch never comes
    assert decode.calls
    task.cancel()  # the client left, or its deadline passed
    with pytest.raises(asyncio.CancelledError):
        await task
    await settled()
    # Asked of the chosen decode replica: if it holds the request, vLLM's abort there has freed it already.
    assert decode.release.calls == [(KV, "D1", ())]


async def test_a_decode_replica_failing_before_it_pulled_the_kv_has_another_one_free_it() -> None:
    decode = FakeDecode([[ReplicaFailed("D1", "its vLLM engine core died")], [tokens(1, 2, 3, final=True)]])
    orch = orchestrator(FakePrefill([prefill_result(KV), prefill_result(KV)]), decode, block_size=32)
    failover = Failover(Route(prefill=True, decode_replica="D2"))
    ids, _ = await serve(orch, Route(prefill=True, decode_replica="D1"), failover)
    await settled()
    assert ids == [1, 2, 3]
    assert decode.release.calls == [(KV, "D1", ("D1",))]  # Serve chooses another replica to tell P


@pytest.mark.parametrize(
    ("route", "prefilled"),
    [(Route(prefill=True), KV), (Route(prefill=True), None), (Route(prefill=False), None)],
    ids=["pulled", "no-kv-params", "local-prefill"],
)
async def test_no_release_when_there_is_no_unpulled_kv(route: Route, prefilled: Any) -> None:
    decode = FakeDecode([[tokens(1), HANG]])
    orch = orchestrator(FakePrefill([prefill_result(prefilled)]), decode, block_size=32)
    events = orch.run("r", PROMPT, Sampling(max_tokens=3), chosen(route))
    await anext(events)
    await events.aclose()
    await settled()
    assert decode.release.calls == []


PIN = {"do_remote_decode": True, "remote_engine_id": "decode-D1", "remote_block_ids": [[4, 5]]}


def pinned(*ids: int) -> TokenBatch:
    return msgspec.structs.replace(tokens(*ids, final=True), pinned_kv=PIN)


async def test_readback_params_go_to_the_prefill_leg_and_the_pin_comes_back() -> None:
    readback = {"do_remote_decode": True, "remote_engine_id": "decode-D0", "remote_block_ids": [[9]]}
    prefill = FakePrefill([prefill_result(KV)])
    orch = orchestrator(prefill, FakeDecode([[tokens(1), pinned(2, 3)]]), block_size=32)
    _, done = await run(orch, Route(prefill=True, readback_params=readback, pin_kv=True))
    assert prefill.calls[0][0].kv_transfer_params == readback
    assert done.pinned_kv == PIN and done.output_token_ids == [1, 2, 3]


async def test_a_local_prefill_of_a_session_asks_decode_to_pin_its_blocks() -> None:
    decode = FakeDecode([[pinned(1)], [tokens(1, final=True)]])
    orch = orchestrator(FakePrefill([]), decode, block_size=32)
    _, done = await run(orch, Route(prefill=False, pin_kv=True))
    params = decode.calls[0][0].kv_transfer_params
    assert params == {"do_remote_prefill": False, "do_remote_decode": False}  # moves nothing, pins
    assert done.path == "local_prefill" and done.kv_transferred_tokens == 0 and done.pinned_kv == PIN
    _, done = await run(orch, Route(prefill=False))
    assert decode.calls[1][0].kv_transfer_params is None and done.pinned_kv is None
    assert done.output_token_ids == []  # kept only for a pin


class FakeExport:
    """The decode deployment's `export` method: answers with pinned params, None, or an exception."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[EngineRequest, str | None]] = []

    def remote(
        self, req: EngineRequest, replica_hint: str | None = None, replica_avoid: tuple[str, ...] = ()
    ) -> _Call:
        self.calls.append((req, replica_hint))
        return _Call(self.result)


EXPORTED = {"do_remote_decode": True, "remote_block_ids": [[4, 5, 6, 7]], "remote_num_tokens": 65}


async def export_run(result: Any) -> tuple[FakeExport, FakePrefill, RequestSummary]:
    prefill = FakePrefill([prefill_result(KV)])
    decode = FakeDecode([[tokens(1, final=True)]])
    decode.export = FakeExport(result)  # type: ignore[attr-defined]
    orch = orchestrator(prefill, decode, block_size=16)
    route = Route(prefill=True, prefill_replica="P1", export_replica="D2", export_tokens=48)
    _, done = await run(orch, route)
    return decode.export, prefill, done  # type: ignore[attr-defined]


async def test_an_export_pins_the_prefix_on_the_chosen_decode_replica_and_the_prefill_leg_pulls_it() -> None:
    export, prefill, done = await export_run(EXPORTED)
    req, hint = export.calls[0]
    # Only the chosen replica may answer; the prompt is the prefix and one token more (every prefix block is
    # then a cache hit), generating one token.
    assert hint == "D2" and req.prompt_token_ids == PROMPT[:49] and req.sampling.max_tokens == 1
    # The prefill leg pulls exactly the exported prefix: three whole blocks.
    pull = prefill.calls[0][0].kv_transfer_params
    assert pull == {**EXPORTED, "remote_block_ids": [[4, 5, 6]], "remote_num_tokens": 48}
    assert done.export == "pinned" and done.note == ""


@pytest.mark.parametrize(
    ("result", "outcome"), [(None, "declined"), (ActorDiedError(), "lost")], ids=["declined", "lost"]
)
async def test_an_export_that_pins_nothing_leaves_the_prefill_leg_to_compute_and_says_so(
    result: Any, outcome: str
) -> None:
    _, prefill, done = await export_run(result)
    assert prefill.calls[0][0].kv_transfer_params is None
    assert done.export == outcome and "computed the prefix" in done.note
    assert done.path == "disaggregated"  # the request itself is served


class SlowExport(FakeExport):
    def __init__(self, result: Any, release: asyncio.Event) -> None:
        super().__init__(result)
        self.release = release

    def remote(
        self, req: EngineRequest, replica_hint: str | None = None, replica_avoid: tuple[str, ...] = ()
    ) -> Any:
        self.calls.append((req, replica_hint))
        release, result = self.release, self.result

        class _Slow(_Call):
            def __await__(self) -> Any:
                async def get() -> Any:
                    await release.wait()
                    return result

                return get().__await__()

        return _Slow(result)


async def test_a_leg_decided_after_an_exporting_one_reaches_their_prefill_replica_after_it() -> None:
    release = asyncio.Event()
    prefill = FakePrefill([prefill_result(KV), prefill_result(KV)])
    decode = FakeDecode([[tokens(1, final=True)], [tokens(1, final=True)]])
    decode.export = SlowExport(EXPORTED, release)  # type: ignore[attr-defined]
    orch = orchestrator(prefill, decode, block_size=16)
    exporting = Route(prefill=True, prefill_replica="P1", export_replica="D2", export_tokens=48)
    first = asyncio.create_task(run(orch, exporting))
    await asyncio.sleep(0)  # decided (and its ticket taken) first
    second = asyncio.create_task(run(orch, Route(prefill=True, prefill_replica="P1")))
    await asyncio.sleep(0.05)
    assert prefill.calls == []  # the second waits for the first, whose export is not pinned yet
    release.set()
    await asyncio.gather(first, second)
    assert [req.kv_transfer_params is not None for req, _ in prefill.calls] == [True, False]


async def test_an_export_that_does_not_answer_in_time_leaves_the_prefill_leg_to_compute() -> None:
    prefill = FakePrefill([prefill_result(KV)])
    decode = FakeDecode([[tokens(1, final=True)]])
    decode.export = SlowExport(EXPORTED, asyncio.Event())  # type: ignore[attr-defined]
    orch = orchestrator(prefill, decode, block_size=16, export_timeout_s=0.05)
    route = Route(prefill=True, prefill_replica="P1", export_replica="D2", export_tokens=48)
    _, done = await run(orch, route)
    assert done.export == "timeout" and prefill.calls[0][0].kv_transfer_params is None
