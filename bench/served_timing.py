"""Time pdserve clusters as a client sees them, and fit `router.service_time.measured` to it.

    .venv/bin/python -m bench.served_timing [--topology deploy/local.yaml] [--out served-timing.json]

bench/engine_timing.py times the engines at their own interface, back to back. A request to a cluster pays
more: the gRPC door, the router, the replica actor, the token channel back, and on a small machine the CPU
those share with the engines; and an agent's turn reaches an engine that sat idle through the tool call.
This script starts the topology's engines as pdserve clusters in turn (bench/live/systems.py), each routed
by session hash (`router.policy: session_hash`) so that the client chooses every request's decode replica,
and times requests at the client, each after an idle pause:
- `aggregated` (one decode engine, no prefill pool; `--system aggregated2` for two, the other left idle): a
  decode step, B cached prompts generating K+1 tokens (the client's time per output token, averaged over the
  batch); a prefill, N new prompt tokens after C of the same session's cached ones, one output token (the
  client's time to first token less one step), N within a few tokens of the plan's and never the same count
  twice (`_Client.fresh`), as an agent's turns bring;
- `pd` (every request through the prefill engine and a NIXL pull): the time to first token of N new tokens,
  less the aggregated fit's prefill and step: what the prefill hop and the pull add;
- `aggregated2` (two decode engines, one a core, so nothing is left for the serving layer but the engines'
  cores): a session-shaped turn (256 cached tokens, 32 new, 32 output) on one engine while k streams run on
  the other: how much slower its time to first token and its tokens get with k, fitted as 1 + x * sqrt(k)
  (`MeasuredTiming.prefill_contention`, `decode_contention`). What a batch costs its own members is in the
  decode step's fit; this is what engines sharing a machine cost each other.
It fits them in `MeasuredTiming`'s form (bench/engine_timing.py's `fit`), writes the samples and the fit as
JSON and prints the `router.service_time` section. `python -m bench.replay_vs_live --timing FILE` replays
with either file.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import statistics
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import msgspec

from bench.engine_timing import Plan, fit, write_report
from bench.live.systems import started
from bench.live.targets import Target, open_target
from bench.live.workload import RAMP_OUTPUT, TOKEN_RANGE, Request, ramp
from router.policy.cache_blind import session_replica
from router.service_time import MeasuredEngine, MeasuredTiming

REPO = Path(__file__).resolve().parents[1]
IDLE_S = 0.3  # before each timed request: the engines idle, as through an agent's tool call
TIMEOUT_S = 120.0

# Up to the model's whole context: an agent's turn is a few new tokens after a long cached one.
PLAN = Plan(
    prefill_new=(32, 128, 512, 1024, 1536, 2000),
    prefill_cached=(0, 512, 1024, 1536, 1984),
    decode_batch=(1, 4, 16),
    decode_context=(64, 512),
    decode_steps=32,
    transfer_tokens=(64, 256, 1024),
    repeats=5,
)
CONTENTION_STREAMS = (0, 1, 2, 4, 8)
CONTENTION_STREAMS_QUICK = (0, 2)
QUICK = Plan(
    prefill_new=(32, 256),
    prefill_cached=(0, 256),
    decode_batch=(1, 4),
    decode_context=(64,),
    decode_steps=8,
    transfer_tokens=(64, 256),
    repeats=1,
)


class _Client:
    """Fresh prompts, each sent to the cluster as a session of its own, on a replica of the client's choosing:
    the cluster runs `router.policy: session_hash` (router/policy/cache_blind.py), so a session's id decides
    its decode replica, and every answer is checked against it. What is timed runs on `home`; what loads the
    machine beside it (`measure_contention`) on `away`."""

    def __init__(self, target: Target, max_model_len: int, decode_replicas: list[str]) -> None:
        if not decode_replicas:
            raise RuntimeError("the cluster lists no decode replica")
        self.target = target
        self.room = max_model_len - 2
        self.replicas = sorted(decode_replicas)
        self.home = self.replicas[0]
        self.away = self.replicas[-1]
        self._rng = random.Random(0)
        self._ids = itertools.count()
        self._counts: set[int] = set()
        self._placed: dict[str, str] = {}  # session -> the decode replica it hashes to

    def prompt(self, n: int) -> list[int]:
        return [self._rng.randint(*TOKEN_RANGE) for _ in range(n)]

    def fresh(self, n: int, most: int) -> int:
        """A count of new tokens as near `n` as no earlier timed prompt of this client has used (n, n+1, n-1,
        ...; at most `most`). vLLM on a CPU runs an engine step of a token count it has not run lately about a
        fifth slower (docs/benchmarks.md, "The replay against the live cluster"), and an agent's turn
        almost never brings a count it has: timing one size over and over would time warm steps only."""
        for k in range(max(n, most)):
            for count in (n + k, n - k):
                if 1 <= count <= most and count not in self._counts:
                    self._counts.add(count)
                    return count
        raise ValueError(f"no unused token count in 1..{most}")

    def session(self, on: str | None = None) -> str:
        """A new session id whose turns go to decode replica `on` (default: `home`)."""
        on = on or self.home
        sid = next(s for s in (f"timing-{i}" for i in self._ids) if session_replica(s, self.replicas) == on)
        self._placed[sid] = on
        return sid

    async def warm(self) -> None:
        """Prompts up to the whole context first (`ramp`) on every decode replica, as `pdserve bench` warms
        up: the first ones after a start cost up to twice what they do after, and the live run a replay is
        compared with is warm."""
        for replica in self.replicas:
            for req in ramp(self.room - RAMP_OUTPUT, 0, self._rng):
                self._counts.add(len(req.token_ids))
                await self.send(req.token_ids, req.max_tokens, self.session(replica))

    async def send(self, prompt: list[int], max_tokens: int, session: str) -> tuple[float, float]:
        """(time to first token, time per output token after it) at the client."""
        timed = await self.target.send(
            Request(token_ids=prompt, max_tokens=max_tokens, group=-1, session_id=session), TIMEOUT_S
        )
        if not timed.ok or timed.ttft is None:
            raise RuntimeError(f"a timing request ended {timed.status}")
        if timed.decode_replica != self._placed[session]:
            raise RuntimeError(
                f"a timing request for decode replica {self._placed[session]} was decoded on "
                f"{timed.decode_replica or 'an unnamed one'}: the cluster must route by session_hash"
            )
        return timed.ttft, timed.tpot or 0.0


async def _step_s(client: _Client, batch: int, context: int, steps: int) -> float:
    prompts = [(client.prompt(context), client.session()) for _ in range(batch)]
    await asyncio.gather(*(client.send(p, 1, s) for p, s in prompts))  # cached from here on
    await asyncio.sleep(IDLE_S)
    timed = await asyncio.gather(*(client.send(p, steps + 1, s) for p, s in prompts))
    return statistics.mean(tpot for _, tpot in timed)


async def _ttft_s(client: _Client, new: int, cached: int) -> float:
    session = client.session()
    head = client.prompt(cached)
    if cached:
        await client.send(head, 1, session)  # the session's replica now holds it
    await asyncio.sleep(IDLE_S)
    ttft, _ = await client.send(head + client.prompt(client.fresh(new, client.room - cached)), 1, session)
    return ttft


async def _median(repeats: int, once: Callable[[], Awaitable[float]]) -> float:
    return statistics.median([await once() for _ in range(repeats)])


async def measure_aggregated(client: _Client, plan: Plan, say: Callable[[str], None]) -> dict[str, list]:
    await client.warm()
    await _ttft_s(client, 64, 64)
    await _step_s(client, 2, 64, 4)
    decode = []
    for batch, context in itertools.product(plan.decode_batch, plan.decode_context):
        if context + plan.decode_steps <= client.room:
            s = await _median(plan.repeats, partial(_step_s, client, batch, context, plan.decode_steps))
            decode.append({"batch": batch, "context": batch * (context + plan.decode_steps / 2), "s": s})
            say(f"decode step, {batch:3d} sequences of {context:5d} tokens: {s * 1e3:8.2f} ms")
    ttft = []
    for new, cached in itertools.product(plan.prefill_new, plan.prefill_cached):
        if new + cached <= client.room:
            s = await _median(plan.repeats, partial(_ttft_s, client, new, cached))
            ttft.append({"new": new, "cached": cached, "ttft": s})
            say(f"time to first token, {new:5d} new after {cached:5d} cached: {s * 1e3:8.2f} ms")
    return {"decode": decode, "ttft": ttft}


async def measure_pd(client: _Client, plan: Plan, say: Callable[[str], None]) -> list[dict[str, float]]:
    await client.warm()
    await _ttft_s(client, 64, 0)
    out = []
    for tokens in plan.transfer_tokens:
        if tokens <= client.room:
            s = await _median(plan.repeats, partial(_ttft_s, client, tokens, 0))
            out.append({"tokens": tokens, "ttft": s})
            say(f"time to first token through the prefill pool, {tokens:5d} tokens: {s * 1e3:8.2f} ms")
    return out


async def _contended_s(client: _Client, others: int, repeats: int) -> tuple[float, float]:
    """Median (time to first token, time per output token) of a session's turn on `home` while `others`
    streams run on `away`: what engines sharing a machine cost each other, not what a batch costs its own."""
    running = True

    async def stream(i: int) -> None:
        while running:
            await client.send(client.prompt(64), 200, client.session(client.away))

    streams = [asyncio.create_task(stream(i)) for i in range(others)]
    try:
        await asyncio.sleep(0.5)  # every stream under way
        ttft, tpot = [], []
        for _ in range(repeats):
            session, head = client.session(), client.prompt(256)
            await client.send(head, 1, session)
            await asyncio.sleep(IDLE_S)
            new = client.prompt(client.fresh(32, client.room - 256 - 33))
            first, per_token = await client.send(head + new, 33, session)
            ttft.append(first)
            tpot.append(per_token)
    finally:
        running = False
        await asyncio.gather(*streams)
    return statistics.median(ttft), statistics.median(tpot)


async def measure_contention(
    client: _Client, streams: tuple[int, ...], repeats: int, say: Callable[[str], None]
) -> list[dict[str, float]]:
    if client.away == client.home:
        raise RuntimeError("contention is timed on two decode replicas; the cluster has one")
    await client.warm()
    await _contended_s(client, 0, 1)
    out = []
    for k in streams:
        ttft, tpot = await _contended_s(client, k, repeats)
        out.append({"others": k, "ttft": ttft, "tpot": tpot})
        say(
            f"a turn while {k} other streams run: first token {ttft * 1e3:8.2f} ms, "
            f"{tpot * 1e3:6.2f} ms a token"
        )
    return out


def fit_contention(samples: list[dict[str, float]]) -> tuple[float, float]:
    """(prefill, decode) x of slowdown = 1 + x * sqrt(k), against the k = 0 sample, least squares, >= 0."""
    quiet = next(s for s in samples if s["others"] == 0)
    loaded = [s for s in samples if s["others"] > 0]
    roots = [math.sqrt(s["others"]) for s in loaded]

    def slope(key: str) -> float:
        excess = [s[key] / quiet[key] - 1.0 for s in loaded]
        den = sum(r * r for r in roots)
        return max(0.0, sum(r * e for r, e in zip(roots, excess, strict=True)) / den) if den else 0.0

    return slope("ttft"), slope("tpot")


def fit_served(
    aggregated: dict[str, list], pd: list[dict[str, float]], contention: list[dict[str, float]] | None = None
) -> tuple[dict[str, list], MeasuredTiming]:
    """The samples in engine_timing's shape and their fit: a prefill is the time to first token less one
    step of its own sequence; a pull what the P/D path adds to that prefill and step. `contention` (timed
    on two engines) gives the slowdown the replay charges an engine while the other runs; every other point
    was timed on one engine with the other idle."""
    decode = aggregated["decode"]
    decode_only = fit({"prefill": [{"new": 1, "cached": 0, "s": 0.0}], "decode": decode,
                       "transfer": [{"tokens": 1, "s": 0.0}]})  # fmt: skip
    steps = MeasuredEngine(fit=decode_only)
    prefill = [
        {"new": p["new"], "cached": p["cached"], "s": p["ttft"] - steps.tpot_s(1, p["new"] + p["cached"])}
        for p in aggregated["ttft"]
    ]
    prefill_only = fit({"prefill": prefill, "decode": decode, "transfer": [{"tokens": 1, "s": 0.0}]})
    engine = MeasuredEngine(fit=prefill_only)
    transfer = []
    for p in pd:
        tokens = int(p["tokens"])
        hop = p["ttft"] - engine.prefill_s(tokens, 0) - engine.tpot_s(1, tokens)
        transfer.append({"tokens": tokens, "s": max(0.0, hop)})
    samples: dict[str, list] = {"prefill": prefill, "decode": decode, "transfer": transfer}
    fitted = fit(samples)
    if contention:
        samples["contention"] = contention
        x_prefill, x_decode = fit_contention(contention)
        fitted = msgspec.structs.replace(fitted, prefill_contention=x_prefill, decode_contention=x_decode)
    return samples, fitted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", type=Path, default=REPO / "deploy" / "local.yaml")
    ap.add_argument("--out", type=Path, default=Path("served-timing.json"))
    ap.add_argument("--quick", action="store_true", help="a few points, once each (a smoke test)")
    ap.add_argument(
        "--system",
        choices=("aggregated", "aggregated2"),
        default="aggregated",
        help="where the prefill and the decode step are timed: the topology the replay is for (aggregated2: "
        "two decode engines, one a core, nothing left to the serving layer but the engines' cores)",
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else PLAN
    say = lambda line: print(line, flush=True)  # noqa: E731

    async def against(address: str, part: Callable[[_Client, Plan, Callable[[str], None]], object]) -> object:
        target = open_target(address)
        try:
            served = await target.served()
            decode = [r["replica_id"] for r in served.replicas if r["role"] == "decode"]
            return await part(_Client(target, served.max_model_len, decode), plan, say)  # type: ignore[misc]
        finally:
            await target.aclose()

    measured: dict[str, object] = {}

    def contention(client: _Client, plan: Plan, say: Callable[[str], None]) -> Awaitable[list]:
        return measure_contention(client, streams, plan.repeats, say)

    streams = CONTENTION_STREAMS_QUICK if args.quick else CONTENTION_STREAMS
    parts = ((args.system, measure_aggregated), ("pd", measure_pd), ("aggregated2:contention", contention))
    for name, part in parts:
        system = name.split(":")[0]
        say(f"starting {system} ...")
        try:
            with started(f"{system}:session_hash", args.topology) as address:
                measured[name] = asyncio.run(against(address, part))
        except (RuntimeError, TimeoutError) as exc:
            print(f"bench.served_timing: {system}: {exc}", file=sys.stderr)
            return 1
    samples, fitted = fit_served(
        measured[args.system],  # type: ignore[arg-type]
        measured["pd"],  # type: ignore[arg-type]
        measured["aggregated2:contention"],  # type: ignore[arg-type]
    )
    what = {
        "topology": str(args.topology),
        "measured": "at the client, through pdserve (bench.served_timing)",
        "client": measured,
        "samples": samples,
    }
    write_report(args.out, fitted, what)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
