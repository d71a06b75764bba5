"""Discrete-event simulation of a P/D cluster in virtual time, driven by a trace and routed by a real Policy.

The cluster: `prefill_replicas` prefill replicas and `decode_replicas` decode replicas, each its own node
(an 8-GPU replica fills a node, so every P -> D transfer crosses the network). Every replica holds a
capacity-bounded LRU prefix cache (`cache.LruBlockCache`) whose BlockStored/BlockRemoved events feed the
router's index, so the policy under test sees what it would see live (minus event delay); on a decode
replica, the blocks of running sequences are allocated (pinned) until they finish. Per request:

1. Arrival: the policy gets a `ReplicaView` per replica from the live router's load accounting
   (`router.view.load.LoadTracker`, told of dispatches, prefill completions and finishes as the router is,
   and of decode KV usage as an engine's statistics would report it), and decides.
2. Prefill, on the chosen prefill replica (FIFO queue, one prompt at a time; prefill is compute-bound, so
   batching prompts would not raise throughput) or, for a local prefill, on the decode replica itself. The
   cache hit is taken when the prefill starts (as vLLM's scheduler does), from that replica's LRU; the
   service time is `ServiceTimeModel.prefill_s(uncached tokens, cached tokens)`.
3. KV transfer P -> D of the prompt tokens the decode replica does not already hold (vLLM's NixlConnector
   pulls only the blocks missing from the decode engine's prefix cache); D's cache then holds the prompt.
   Readback (`readback_ttl_s`, vLLM's bidirectional KV transfer, for every policy alike): a decode replica
   keeps a finished turn's blocks pinned for that long, and the session's next prefill, wherever it runs,
   pulls the prefix it shares with that turn's prompt instead of computing it (the pull is charged to the
   prefill replica's time, though vLLM overlaps it with other requests' compute: conservative). Pinned
   blocks cannot be evicted and take their share of the decode replica's cache (`cache.LruBlockCache.pin`)
   and of its KV usage as the router sees it, until a prefill reads them or the TTL passes; a turn
   prefilled on the decode replica leaves its predecessor's pin to expire (vLLM does the same).
   Exports (`readback_exports`, with readback): the policy may instead have a prefill replica pull the
   longest prefix any decode replica holds in its cache; that replica pins it at the decision, for the same
   TTL (the router's export request: a one-token request on the decode engine, whose compute is not
   modelled). The prompt takes its place in the prefill queue at the decision but cannot start before one
   decode step later (the router waits for the pin), and neither can the prompts queued behind it: the
   router sends each prefill replica its legs in decision order, the order its queue estimates assume.
   A pin that expires before the prefill starts is not pulled: the prompt is computed.
4. Decode: every active sequence on a replica advances one token per `tpot_s(batch, context)`; the rate is
   recomputed whenever the batch changes. A local prefill on the replica is chunked between its decode steps
   as vLLM schedules it (`ServiceTimeModel.mixed_prefill`): while it runs, each step is as slow as the larger
   of the decode step and the prompt's chunk, so co-located sequences slow down rather than stop. TTFT =
   first decode step. Where the timing has contention (`Timing.contention`: CPU engines sharing cores), a
   prefill takes longer, and a batch steps slower, with the requests in flight on other replicas; every
   batch's rate is recomputed whenever that count changes, a prefill's length is set when it starts.
5. Finish: `policy.on_finish`; in a closed-loop replay the session's next turn is sent after its recorded
   gap.

Several routers (`routers`, as the topology's `server.routers`): each is a `_Router`, with its own policy
instance (sessions, recent work) and its own `LoadTracker`, told of what it dispatched itself (and of every
decode replica's KV usage, which every router reads from the engines). Every `router_sync_s` virtual seconds
each router publishes its `LoadTracker.dispatched()` and sets the others' as its peers (`set_peers`), as the
live routers do through the registry, so between two syncs a router sees the others' work as it was at the
last one. Each request reaches a router drawn at random (seeded by `seed`), independently per turn: a
session's turns reach different routers, the worst case for what a router remembers of a session (an SDK
client normally keeps to one router). The KV index is the same for every router (each gets every engine's KV
events), so they share one. The request's policy `on_finish` goes to the router that decided it.

Load: open-loop traces arrive at `arrival_s / time_scale`; closed-loop traces run `concurrency` session
slots, each replaying sessions one after another (seeded order), with every gap multiplied by `gap_scale`
and capped at `max_gap_s` (human pauses of hours would otherwise leave slots idle), or, when the trace gives
each session a start time (`Trace.session_starts`: the live benchmark's sessions), start each session once
at its time and count every request. The measurement window
ends when the last open-loop request arrives, or when a closed-loop slot first finds no session left to
start; utilisation and latency percentiles are measured over requests that arrived inside the window (cache
metrics over all)."""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from bench.replay.cache import CacheEvents, LruBlockCache
from bench.replay.traces import Session, Trace, TraceRequest
from engine.messages import ReplicaLoad
from router.messages import Decision, Readback, ReplicaView, RouteRequest
from router.policy.types import Policy, PrefixLookup
from router.service_time import ServiceTimeModel, Timing
from router.view.load import LoadTracker


class SimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prefill_replicas: int = 8
    decode_replicas: int = 8
    # Per-replica prefix cache capacity in blocks; None = unbounded.
    capacity_blocks: int | None = None
    # Open loop: arrival times are divided by this (2.0 = twice the recorded rate).
    time_scale: float = 1.0
    # Closed loop: sessions in flight at once.
    concurrency: int = 32
    gap_scale: float = 1.0
    max_gap_s: float = 300.0
    # Closed loop: the first `concurrency` sessions start uniformly over this many seconds.
    stagger_s: float = 60.0
    # Decode replicas keep a finished turn's KV pinned this long for the session's next prefill to pull
    # (None: no readback; prefill replicas compute whatever they do not hold).
    readback_ttl_s: float | None = None
    # With readback: the policy may also pull any decode replica's cached prefix (an export), not only the
    # session's pin.
    readback_exports: bool = True
    seed: int = 0
    timing: Timing = ServiceTimeModel()
    # Routers in front of the cluster, each request to one drawn at random per turn (module docstring), and
    # the virtual seconds between their load reports to each other.
    routers: int = 1
    router_sync_s: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill_replicas < 0 or self.decode_replicas < 1:
            raise ValueError("need prefill_replicas >= 0 and decode_replicas >= 1")
        if self.time_scale <= 0 or self.gap_scale < 0 or self.concurrency < 1:
            raise ValueError("time_scale must be > 0, gap_scale >= 0, concurrency >= 1")
        if self.routers < 1 or self.router_sync_s <= 0:
            raise ValueError("need routers >= 1 and router_sync_s > 0")


class RequestRecord(msgspec.Struct, kw_only=True):
    """What happened to one request (times in virtual seconds)."""

    request_id: str
    session_id: str
    arrival: float
    num_blocks: int
    output_tokens: int = 0
    prefill_replica: str | None = None
    decode_replica: str = ""
    local_prefill: bool = False
    predicted_cached_tokens: int = 0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    cached_blocks: int = 0
    cached_tokens: int = 0
    # Of cached_tokens, those pulled from the session's previous decode replica (readback).
    pulled_tokens: int = 0
    computed_tokens: int = 0
    transferred_tokens: int = 0
    first_token: float = 0.0
    finish: float = 0.0
    in_window: bool = True
    # The router that decided it (0 with one router).
    router: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than two)."""
        if self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    @property
    def queue_wait(self) -> float:
        return self.prefill_start - self.arrival


class _Job:
    """A request in flight."""

    __slots__ = (
        "decision",
        "export",
        "pinned",
        "ready_at",
        "rec",
        "route",
        "router",
        "session_pos",
        "slot",
        "trace_req",
    )

    def __init__(self, trace_req: TraceRequest, route: RouteRequest, rec: RequestRecord) -> None:
        self.trace_req = trace_req
        self.route = route
        self.rec = rec
        self.router: _Router | None = None  # the router that decided it
        self.decision: Decision | None = None
        self.session_pos: tuple[Session, int] | None = None
        self.slot = -1
        self.pinned = False  # its blocks are pinned on its decode replica (a running sequence)
        self.export: _Pin | None = None  # the prefix a decode replica pinned for this prefill to pull
        self.ready_at = 0.0  # when its prefill may start (after its export is pinned)


class PrefillServer:
    """A FIFO of prompts computed one at a time against this replica's cache."""

    def __init__(self, replica_id: str, cache: LruBlockCache) -> None:
        self.replica_id = replica_id
        self.cache = cache
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.computed_tokens = 0
        self.busy: list[tuple[float, float]] = []
        # When it started (0: with the replay) and stopped (None: it runs to the end): what it cost.
        self.started = 0.0
        self.stopped: float | None = None


class DecodeServer(PrefillServer):
    """A decode replica: a continuous batch whose per-token rate follows the batch, plus local prefills."""

    def __init__(self, replica_id: str, cache: LruBlockCache) -> None:
        super().__init__(replica_id, cache)
        self.remaining: dict[_Job, float] = {}
        self.context_tokens = 0
        self.last_advance = 0.0
        self.version = 0
        # While it prefills a prompt itself: the length of its mixed steps (chunked prefill), else None.
        self.mixed_step_s: float | None = None


class _Router:
    """One router: its own policy instance and its own load accounting, told of what it dispatched itself and
    of the others' work as they last reported it."""

    __slots__ = ("index", "load", "policy")

    def __init__(self, index: int, policy: Policy, load: LoadTracker) -> None:
        self.index = index
        self.policy = policy
        self.load = load

    def views(self) -> tuple[list[ReplicaView], list[ReplicaView]]:
        """What this router sees: its own dispatch accounting (`LoadTracker`, the live router's code), the
        other routers' as of the last sync, and the decode replicas' KV usage as their engines report it."""
        return self.load.views("prefill"), self.load.views("decode")


class _Pin:
    """A finished turn's blocks a decode replica keeps for readback."""

    __slots__ = ("expires", "live", "prompt", "replica")

    def __init__(self, replica: str, prompt: tuple[int, ...], expires: float):
        self.replica = replica
        self.prompt = prompt  # the turn's prompt blocks, all pinned (its running sequence's blocks, kept)
        self.expires = expires
        self.live = True


# Event kinds, ordered so that at equal times completions run before arrivals (frees capacity first), and so
# do the routers' load reports (an arrival at a sync's instant sees it); timers (the autoscaler's) last.
_PREFILL_DONE, _TRANSFER_DONE, _DECODE_CHECK, _SYNC, _ARRIVAL, _EXPORTED, _SLOT_START, _TIMER = range(8)


class Simulator:
    def __init__(
        self,
        trace: Trace,
        policy: Policy | Sequence[Policy],
        config: SimConfig,
        *,
        index_factory: Callable[[], tuple[CacheEvents, PrefixLookup]],
    ) -> None:
        """`policy`: one per router (`config.routers`; with one router, the policy itself), each a fresh
        instance. `index_factory` builds the router-side index: the sink the caches' events go to and the
        lookup the policies query (normally one object, router.view.kv_index.KvIndex behind an adapter)."""
        policies = list(policy) if isinstance(policy, Sequence) else [policy]
        if len(policies) != config.routers:
            raise ValueError(f"{len(policies)} policies for {config.routers} routers: give one per router")
        self.trace = trace
        self.cfg = config
        self.timing = config.timing
        self.block_tokens = trace.block_tokens
        events, self.lookup = index_factory()
        self._events = events
        self.prefill = [
            PrefillServer(f"p{i}", LruBlockCache(f"p{i}", config.capacity_blocks, events))
            for i in range(config.prefill_replicas)
        ]
        self.decode = [
            DecodeServer(f"d{i}", LruBlockCache(f"d{i}", config.capacity_blocks, events))
            for i in range(config.decode_replicas)
        ]
        self._servers: dict[str, PrefillServer] = {s.replica_id: s for s in [*self.prefill, *self.decode]}
        self.routers = [_Router(i, p, self._load_tracker()) for i, p in enumerate(policies)]
        # Which router each request reaches (a stream of its own: the session order's is not disturbed).
        self._router_rng = random.Random(f"routers/{config.seed}")
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.window_end: float | None = None
        self._pending_sessions: deque[Session] = deque()
        # Readback: each session's latest pin (the one offered), and every live pin by expiry.
        self._pins: dict[str, _Pin] = {}
        self._pin_expiry: list[tuple[float, int, _Pin]] = []
        # The most blocks allocated on one decode replica at once (running sequences and readback pins), as a
        # fraction of its capacity.
        self.pinned_peak = 0.0
        self.decide_s = 0.0
        # Requests sent and not finished, and whether service times depend on them (engines that share cores
        # with each other and the serving layer: `Timing.contention`).
        self.in_flight = 0
        self._contended = config.timing.contention(1) != (1.0, 1.0)
        self.decisions = 0

    def _load_tracker(self) -> LoadTracker:
        load = LoadTracker(self.cfg.timing)
        # Every replica is its own node (see the module docstring).
        for s in self.prefill:
            load.add_replica(s.replica_id, "prefill", node_id=s.replica_id)
        for s in self.decode:
            load.add_replica(s.replica_id, "decode", node_id=s.replica_id)
        return load

    # -- event plumbing ---------------------------------------------------------------------------------
    def _at(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def run(self) -> list[RequestRecord]:
        self._seed_arrivals()
        if len(self.routers) > 1:
            self._at(self.cfg.router_sync_s, _SYNC, None)
        while self._heap:
            t, kind, _, payload = heapq.heappop(self._heap)
            self.now = t
            if self._pin_expiry and self._pin_expiry[0][0] <= t:
                self._expire_pins()
            if kind == _ARRIVAL:
                self._arrive(payload)
            elif kind == _PREFILL_DONE:
                self._prefill_done(payload)
            elif kind == _EXPORTED:
                self._start_prefill(payload)
            elif kind == _TRANSFER_DONE:
                self._join_decode(payload[0], payload[1])
            elif kind == _DECODE_CHECK:
                server, version = payload
                if version == server.version:
                    self._decode_check(server)
            elif kind == _SYNC:
                self._sync_routers()
            elif kind == _TIMER:
                payload()
            else:
                self._start_next_session(payload)
        if self.window_end is None:
            self.window_end = max((r.arrival for r in self.records), default=0.0)
        for r in self.records:
            r.in_window = r.arrival <= self.window_end
        return self.records

    def _seed_arrivals(self) -> None:
        if not self.trace.closed_loop:
            for s in self.trace.sessions:
                for r in s.requests:
                    self._at(r.arrival_s / self.cfg.time_scale, _ARRIVAL, self._new_job(r))
            return
        if self.trace.session_starts is not None:
            # Each session once, at its own start (the live benchmark's sessions): no slots, no window end.
            for session, start in zip(self.trace.sessions, self.trace.session_starts, strict=True):
                self._send_turn(session, 0, -1, start)
            return
        order = list(self.trace.sessions)
        rng = random.Random(self.cfg.seed)
        rng.shuffle(order)
        self._pending_sessions = deque(order)
        for slot in range(min(self.cfg.concurrency, len(order))):
            self._at(rng.uniform(0.0, self.cfg.stagger_s), _SLOT_START, slot)

    def _start_next_session(self, slot: int) -> None:
        if not self._pending_sessions:
            if self.window_end is None:
                self.window_end = self.now
            return
        session = self._pending_sessions.popleft()
        self._send_turn(session, 0, slot, self.now)

    def _send_turn(self, session: Session, pos: int, slot: int, at: float) -> None:
        job = self._new_job(session.requests[pos])
        job.session_pos = (session, pos)
        job.slot = slot
        self._at(at, _ARRIVAL, job)

    def _new_job(self, r: TraceRequest) -> _Job:
        route = RouteRequest(
            request_id=r.request_id,
            session_id=r.session_id,
            num_prompt_tokens=r.num_prompt_tokens,
            block_hashes=list(r.block_hashes),
            block_size=self.block_tokens,
            max_tokens=r.num_output_tokens,
            export_ttl_s=self.cfg.readback_ttl_s if self.cfg.readback_exports else None,
            other_routers=self.cfg.routers > 1,
        )
        rec = RequestRecord(
            request_id=r.request_id,
            session_id=r.session_id,
            arrival=0.0,
            num_blocks=len(r.block_hashes),
            output_tokens=r.num_output_tokens,
        )
        return _Job(r, route, rec)

    # -- membership (bench/replay/autoscaler.py) ---------------------------------------------------------
    def at(self, t: float, callback: Callable[[], None]) -> None:
        """Run `callback` at virtual time `t`."""
        self._at(t, _TIMER, callback)

    def pending(self) -> bool:
        """Whether anything is left to happen (a timer that reschedules itself stops when nothing is)."""
        return bool(self._heap)

    def add_replica(self, role: str) -> PrefillServer:
        """A replica that starts now: routers see it only once `make_routable` (its start is done)."""
        servers: list[Any] = self.prefill if role == "prefill" else self.decode
        rid = f"{role[0]}{len(servers)}"
        cache = LruBlockCache(rid, self.cfg.capacity_blocks, self._events)
        server = PrefillServer(rid, cache) if role == "prefill" else DecodeServer(rid, cache)
        server.started = self.now
        if isinstance(server, DecodeServer):
            server.last_advance = self.now
        servers.append(server)
        self._servers[rid] = server
        return server

    def make_routable(self, server: PrefillServer) -> None:
        for router in self.routers:
            router.load.add_replica(server.replica_id, _role(server), node_id=server.replica_id)

    def drain(self, server: PrefillServer) -> None:
        """Routers stop sending to the replica; what it holds runs to its end."""
        for router in self.routers:
            if server.replica_id in {v.replica_id for v in router.load.views(_role(server))}:
                router.load.set_draining(server.replica_id, True)

    def idle(self, server: PrefillServer) -> bool:
        busy = server.running is not None or bool(server.queue)
        return not busy and not (isinstance(server, DecodeServer) and server.remaining)

    def retire(self, server: PrefillServer) -> None:
        """A drained (or still starting) replica stops: routers forget it, and so does the KV index."""
        server.stopped = self.now
        for router in self.routers:
            router.load.remove_replica(server.replica_id)
        self._events.on_removed(server.replica_id, server.cache.lru_order())

    def replica_load(self, server: PrefillServer) -> ReplicaLoad:
        """What the replica would report to its pool's autoscaling policy (engine/replica.py): the routers'
        queued prefill seconds on it, whether it has work, and the engine's KV usage, sequences and step."""
        queued = sum(
            d.queued_prefill_s
            for router in self.routers
            if (d := router.load.dispatched().get(server.replica_id)) is not None
        )
        if not isinstance(server, DecodeServer):
            busy = server.running is not None or bool(server.queue)
            return ReplicaLoad(queued_prefill_s=queued, busy=float(busy))
        cap = self.cfg.capacity_blocks
        used = server.context_tokens + server.cache.pinned_blocks * self.block_tokens
        running = len(server.remaining)
        return ReplicaLoad(
            queued_prefill_s=queued,
            busy=float(running > 0 or server.running is not None),
            kv_usage=0.0 if cap is None else min(1.0, used / (cap * self.block_tokens)),
            running=running,
            waiting=len(server.queue),
            step_s=self._tpot(server) if running else 0.0,
        )

    # -- routing -----------------------------------------------------------------------------------------
    def _sync_routers(self) -> None:
        """Every router publishes its work in flight and reads the others' (the registry's poll)."""
        reports = [r.load.dispatched() for r in self.routers]
        for i, router in enumerate(self.routers):
            router.load.set_peers(reports[:i] + reports[i + 1 :])
        if self._heap:  # anything left to happen: the routers keep polling
            self._at(self.now + self.cfg.router_sync_s, _SYNC, None)

    def _router_for(self) -> _Router:
        """The router a request reaches: drawn at random per request when there are several."""
        if len(self.routers) == 1:
            return self.routers[0]
        return self.routers[self._router_rng.randrange(len(self.routers))]

    def _report_kv_usage(self, server: DecodeServer) -> None:
        cap = self.cfg.capacity_blocks
        # Pinned blocks are allocated, not free: the engine counts them as used.
        used = server.context_tokens + server.cache.pinned_blocks * self.block_tokens
        usage = 0.0 if cap is None else used / (cap * self.block_tokens)
        for router in self.routers:  # every router reads the engines' statistics
            router.load.update_kv_usage(server.replica_id, usage)
        if cap is not None:
            self.pinned_peak = max(self.pinned_peak, server.cache.pinned_blocks / cap)

    def _arrive(self, job: _Job) -> None:
        self._change_in_flight(1)
        rec = job.rec
        rec.arrival = self.now
        self.records.append(rec)
        job.route.readback = self._readback(job.trace_req, self.now)
        job.router = router = self._router_for()
        rec.router = router.index
        p_views, d_views = router.views()
        t0 = time.perf_counter()
        decision = router.policy.choose(job.route, p_views, d_views, self.lookup)
        self.decide_s += time.perf_counter() - t0
        self.decisions += 1
        job.decision = decision
        rec.decode_replica = decision.decode
        rec.local_prefill = decision.local_prefill or decision.prefill is None or not self.prefill
        rec.predicted_cached_tokens = decision.predicted_cached_tokens
        router.load.on_dispatch(job.route, decision)
        if rec.local_prefill:
            self._enqueue(job)
            return
        rec.prefill_replica = decision.prefill
        if decision.readback_export and decision.readback_replica is not None:
            source = self._servers[decision.readback_replica]
            assert isinstance(source, DecodeServer)
            self._export(job, source, decision.predicted_cached_tokens // self.block_tokens)
            job.ready_at = self.now + self._tpot(source)
        self._enqueue(job)

    def _enqueue(self, job: _Job) -> None:
        assert job.decision is not None
        rec = job.rec
        server = self._servers[job.decision.decode if rec.local_prefill else rec.prefill_replica or ""]
        server.queue.append(job)
        if server.running is None:
            self._start_prefill(server)

    def _export(self, job: _Job, server: DecodeServer, blocks: int) -> None:
        """The decode replica pins the prompt's first `blocks` blocks (all in its cache) for the prefill."""
        ttl = self.cfg.readback_ttl_s
        assert ttl is not None
        prefix = job.trace_req.block_hashes[: server.cache.prefix_hits(job.trace_req.block_hashes[:blocks])]
        server.cache.pin(prefix)
        job.export = pin = _Pin(server.replica_id, tuple(prefix), self.now + ttl)
        heapq.heappush(self._pin_expiry, (pin.expires, id(pin), pin))
        self._report_kv_usage(server)

    def _readback(self, r: TraceRequest, at: float) -> Readback | None:
        """What the session's previous decode replica still keeps pinned of this prompt's prefix at `at`."""
        pin = self._pins.get(r.session_id)
        if pin is None or not pin.live:
            return None
        shared = 0
        for a, b in zip(pin.prompt, r.block_hashes, strict=False):
            if a != b:
                break
            shared += 1
        if not shared:
            return None
        return Readback(pin.replica, shared * self.block_tokens, expires_in_s=pin.expires - at)

    def _pin(self, job: _Job) -> None:
        """The decode engine keeps the finished turn's blocks for a later pull."""
        ttl = self.cfg.readback_ttl_s
        assert ttl is not None
        server = self._servers[job.rec.decode_replica]
        prompt = job.trace_req.block_hashes
        assert job.pinned  # a running sequence's blocks: all present, now kept past its end
        pin = _Pin(server.replica_id, prompt, self.now + ttl)
        self._pins[job.trace_req.session_id] = pin
        heapq.heappush(self._pin_expiry, (pin.expires, id(pin), pin))
        assert isinstance(server, DecodeServer)
        self._report_kv_usage(server)

    def _unpin(self, pin: _Pin) -> None:
        if not pin.live:
            return
        pin.live = False
        server = self._servers[pin.replica]
        server.cache.unpin(pin.prompt)
        assert isinstance(server, DecodeServer)
        self._report_kv_usage(server)

    def _expire_pins(self) -> None:
        while self._pin_expiry and self._pin_expiry[0][0] <= self.now:
            self._unpin(heapq.heappop(self._pin_expiry)[2])

    # -- prefill -----------------------------------------------------------------------------------------
    def _start_prefill(self, server: PrefillServer) -> None:
        if server.running is not None or not server.queue:
            return
        if server.queue[0].ready_at > self.now:
            # Its export is not pinned yet; the prompts behind it wait too (the router sends a replica's
            # legs in decision order, which the policy's queue estimates assume).
            self._at(server.queue[0].ready_at, _EXPORTED, server)
            return
        job = server.queue.popleft()
        server.running = job
        rec = job.rec
        on_decode = isinstance(server, DecodeServer)
        hits = server.cache.access(job.trace_req.block_hashes, pin=on_decode)
        job.pinned = on_decode
        n = job.route.num_prompt_tokens
        # The engine always computes at least the last prompt token (it needs its logits).
        local_tokens = min(hits * self.block_tokens, n - 1)
        cached_tokens = local_tokens
        if job.export is not None:
            # An export pinned for this prompt: pulled if still pinned (the session's own pin, if any, was
            # not handed to this prefill and is left to expire).
            if job.export.live:
                cached_tokens = max(local_tokens, min(len(job.export.prompt) * self.block_tokens, n - 1))
            self._unpin(job.export)
        elif not on_decode:
            rb = self._readback(job.trace_req, self.now)  # the pin may have expired while queued
            if rb is not None:
                cached_tokens = max(local_tokens, min(rb.tokens, n - 1))
            # The prefill engine reads the pin (or tells the decode engine it needs none): unpinned.
            pin = self._pins.pop(job.trace_req.session_id, None)
            if pin is not None:
                self._unpin(pin)
        pulled = cached_tokens - local_tokens
        new_tokens = n - cached_tokens
        slower_prefill, slower_step = self.timing.contention(self._others(server))
        prefill_s = self.timing.prefill_s(new_tokens, cached_tokens) * slower_prefill
        if isinstance(server, DecodeServer):
            # Chunked between the batch's decode steps, which go on one token per (slower) mixed step.
            self._advance_decode(server)
            batch, context = len(server.remaining), server.context_tokens
            steps, step = self.timing.mixed_prefill(
                new_tokens,
                cached_tokens,
                batch,
                context,
                prefill_s=prefill_s,
                tpot_s=self.timing.tpot_s(batch, context) * slower_step,
            )
            duration = steps * step
            server.mixed_step_s = step
            self._reschedule_decode(server)
        else:
            duration = prefill_s
        if pulled:
            duration += self.timing.transfer_s(pulled)
        rec.cached_blocks = max(hits, cached_tokens // self.block_tokens)
        rec.cached_tokens = cached_tokens
        rec.pulled_tokens = pulled
        rec.computed_tokens = new_tokens
        rec.prefill_start = self.now
        rec.prefill_end = self.now + duration
        server.computed_tokens += new_tokens
        server.busy.append((self.now, self.now + duration))
        self._at(self.now + duration, _PREFILL_DONE, server)

    def _prefill_done(self, server: PrefillServer) -> None:
        job = server.running
        assert job is not None and job.decision is not None and job.router is not None
        server.running = None
        job.router.load.on_prefill_done(job.route.request_id)
        if isinstance(server, DecodeServer):
            self._advance_decode(server)  # at the mixed rate, until now
            server.mixed_step_s = None
            self._join_decode(job, server)
        else:
            decode = self._servers[job.decision.decode]
            assert isinstance(decode, DecodeServer)
            held = decode.cache.prefix_hits(job.trace_req.block_hashes) * self.block_tokens
            tokens = max(0, job.route.num_prompt_tokens - held)
            job.rec.transferred_tokens = tokens
            self._at(self.now + self.timing.transfer_s(tokens), _TRANSFER_DONE, (job, decode))
        self._start_prefill(server)
        if isinstance(server, DecodeServer):
            self._reschedule_decode(server)

    # -- decode ------------------------------------------------------------------------------------------
    def _tpot(self, server: DecodeServer) -> float:
        if server.mixed_step_s is not None:
            return server.mixed_step_s
        step = self.timing.tpot_s(len(server.remaining), server.context_tokens)
        return step * self.timing.contention(self._others(server))[1] if self._contended else step

    def _others(self, server: PrefillServer) -> int:
        """Requests in flight on other replicas than `server` (sent and not finished, wherever they are)."""
        own = len(server.queue) + (server.running is not None)
        if isinstance(server, DecodeServer):
            own += len(server.remaining)
        return max(0, self.in_flight - own)

    def _change_in_flight(self, delta: int) -> None:
        """A request sent (+1) or finished (-1). With contention every batch's rate depends on the count:
        each is credited at its old rate up to now, then rescheduled at the new one."""
        if not self._contended:
            self.in_flight += delta
            return
        for server in self.decode:
            self._advance_decode(server)
        self.in_flight += delta
        for server in self.decode:
            self._reschedule_decode(server)

    def _advance_decode(self, server: DecodeServer) -> None:
        """Credit every active sequence with the tokens generated since the last batch change."""
        elapsed = self.now - server.last_advance
        server.last_advance = self.now
        if elapsed <= 0 or not server.remaining:
            return
        done = elapsed / self._tpot(server)
        for job in server.remaining:
            server.remaining[job] -= done

    def _join_decode(self, job: _Job, server: DecodeServer) -> None:
        self._advance_decode(server)
        if job.rec.local_prefill is False:
            # The pulled KV lands in the decode engine's prefix cache, allocated while the sequence runs.
            server.cache.access(job.trace_req.block_hashes, pin=True)
            job.pinned = True
        server.remaining[job] = float(job.route.max_tokens)
        server.context_tokens += job.route.num_prompt_tokens
        self._report_kv_usage(server)
        job.rec.first_token = self.now + self._tpot(server)
        self._reschedule_decode(server)

    def _reschedule_decode(self, server: DecodeServer) -> None:
        server.version += 1
        if not server.remaining:
            return
        least = min(server.remaining.values())
        self._at(self.now + max(0.0, least) * self._tpot(server), _DECODE_CHECK, (server, server.version))

    def _decode_check(self, server: DecodeServer) -> None:
        self._advance_decode(server)
        finished = [j for j, left in server.remaining.items() if left <= 1e-9]
        for job in finished:
            del server.remaining[job]
            server.context_tokens -= job.route.num_prompt_tokens
            self._finish(job)
        self._report_kv_usage(server)
        self._reschedule_decode(server)

    def _finish(self, job: _Job) -> None:
        assert job.decision is not None and job.router is not None
        job.rec.finish = self.now
        self._change_in_flight(-1)
        if self.cfg.readback_ttl_s is not None:
            self._pin(job)  # the finished sequence's blocks stay allocated for readback
        elif job.pinned:
            self._servers[job.rec.decode_replica].cache.unpin(job.trace_req.block_hashes)
        job.pinned = False
        job.router.load.on_finish(job.route.request_id)
        job.router.policy.on_finish(job.route, job.decision)
        if job.session_pos is None:
            return
        session, pos = job.session_pos
        if pos + 1 < len(session.requests):
            gap = min(session.requests[pos + 1].gap_s, self.cfg.max_gap_s) * self.cfg.gap_scale
            self._send_turn(session, pos + 1, job.slot, self.now + gap)
        elif job.slot >= 0:
            self._at(self.now, _SLOT_START, job.slot)

    # -- results -----------------------------------------------------------------------------------------
    def busy_time(self, replica_ids: Iterable[str], until: float) -> list[float]:
        out = []
        for rid in replica_ids:
            out.append(sum(max(0.0, min(e, until) - s) for s, e in self._servers[rid].busy if s < until))
        return out

    def computed_tokens(self, servers: Sequence[PrefillServer]) -> list[int]:
        return [s.computed_tokens for s in servers]

    def replica_peak(self, servers: Sequence[PrefillServer]) -> int:
        """The most of these replicas that ran (or started) at once."""
        edges = sorted(
            [(s.started, 1) for s in servers] + [(s.stopped, -1) for s in servers if s.stopped is not None],
            key=lambda e: (e[0], e[1]),
        )
        peak = running = 0
        for _, step in edges:
            running += step
            peak = max(peak, running)
        return peak

    def replica_seconds(self, servers: Sequence[PrefillServer]) -> float:
        """Seconds the replicas ran, each from its start to its stop or the replay's end."""
        return sum((self.now if s.stopped is None else s.stopped) - s.started for s in servers)


def _role(server: PrefillServer) -> Any:
    return "decode" if isinstance(server, DecodeServer) else "prefill"
