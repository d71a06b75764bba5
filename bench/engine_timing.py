"""Measure the engines of a topology on this machine and fit `router.service_time.measured`: the service
times the routing cost and `pdserve replay --topology` then use instead of the H200 model.

    .venv/bin/python -m bench.engine_timing [--topology deploy/local.yaml] [--out engine-timing.json]

The topology's prefill and decode engines (model, dtype, block size, engine arguments, cores) run in this
process as their replicas host them (prefill/engine.py, decode/engine.py), with vLLM's NIXL connector between
them, and are timed at the engine's own interface (no router, no Serve):
- prefill: N new prompt tokens after C that the decode engine's prefix cache holds (an earlier request
  computed them), one output token: the request's seconds;
- decode: B requests whose prompts the decode engine holds, K+1 output tokens against 1: (t(K+1) - t(1)) / K
  a step, at the batch's context;
- transfer: a prompt of T tokens prefilled on the prefill engine, then pulled by the decode engine: NIXL's
  own transfer seconds (vLLM's connector statistics) against T.
Each point is the median of its repeats; each part is fitted by least squares with non-negative
coefficients (router/service_time.py `MeasuredTiming` says the form). Writes the samples and the fit as
JSON and prints the `router.service_time` section to put in a topology. Engines on GPUs with more than one
GPU each (Ray-placed workers) are not measured here: their replicas need the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import yaml

from bench.live.workload import TOKEN_RANGE
from cluster.serve_app import engine_spec
from cluster.topology import Topology
from cluster.topology_file import TopologyError, load_topology
from decode.engine import DecodeEngine
from engine.messages import EngineRequest, Sampling
from engine.spec import EngineSpec
from prefill.engine import PrefillEngine
from router.service_time import MeasuredTiming

REPO = Path(__file__).resolve().parents[1]


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What is measured: the points of each part and the repeats of each point."""

    prefill_new: tuple[int, ...] = (32, 128, 512, 1024, 1536)
    prefill_cached: tuple[int, ...] = (0, 256, 1024)
    decode_batch: tuple[int, ...] = (1, 4, 16, 32)
    decode_context: tuple[int, ...] = (64, 512, 1024)
    decode_steps: int = 32
    transfer_tokens: tuple[int, ...] = (64, 256, 1024, 1536)
    repeats: int = 3


QUICK = Plan(
    prefill_new=(32, 512),
    prefill_cached=(0, 256),
    decode_batch=(1, 4),
    decode_context=(64, 256),
    decode_steps=8,
    transfer_tokens=(64, 512),
    repeats=1,
)


def fit_nonnegative(columns: Sequence[Sequence[float]], seconds: Sequence[float]) -> list[float]:
    """Least-squares coefficients of `seconds` against `columns` (one list per coefficient), none negative: a
    coefficient the unconstrained fit makes negative is fixed at 0 and the rest refitted."""
    a = np.array(columns, dtype=float).T
    y = np.array(seconds, dtype=float)
    free = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while free:
        solved, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (solved >= 0).all():
            coef[free] = solved
            break
        free.pop(int(np.argmin(solved)))
    return [float(c) for c in coef]


def fit(samples: dict[str, list[dict[str, float]]]) -> MeasuredTiming:
    """The three parts' coefficients from the samples (`measure`'s shape)."""
    pre = samples["prefill"]
    pairs = [s["new"] * s["cached"] + s["new"] * (s["new"] + 1) / 2 for s in pre]
    p0, p1, p2 = fit_nonnegative([[1.0] * len(pre), [s["new"] for s in pre], pairs], [s["s"] for s in pre])
    dec = samples["decode"]
    d0, d1, d2 = fit_nonnegative(
        [[1.0] * len(dec), [s["batch"] for s in dec], [s["context"] for s in dec]], [s["s"] for s in dec]
    )
    tra = samples["transfer"]
    t0, t1 = fit_nonnegative([[1.0] * len(tra), [s["tokens"] for s in tra]], [s["s"] for s in tra])
    return MeasuredTiming(
        prefill_fixed_s=p0,
        prefill_token_s=p1,
        prefill_pair_s=p2,
        decode_step_s=d0,
        decode_seq_s=d1,
        decode_context_token_s=d2,
        transfer_fixed_s=t0,
        transfer_token_s=t1,
    )


class _Engines:
    """The topology's prefill and decode engines in this process, one request id after another."""

    def __init__(self, prefill: PrefillEngine, decode: DecodeEngine, max_model_len: int) -> None:
        self.prefill, self.decode = prefill, decode
        self.max_model_len = max_model_len
        self._ids = itertools.count()
        self._rng = random.Random(0)

    def prompt(self, n: int) -> list[int]:
        """Fresh ids: no earlier prompt shares their first block."""
        return [self._rng.randint(*TOKEN_RANGE) for _ in range(n)]

    def request(self, prompt: list[int], max_tokens: int, kv: dict[str, Any] | None = None) -> EngineRequest:
        return EngineRequest(
            request_id=f"timing-{next(self._ids)}",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            kv_transfer_params=kv,
        )

    async def decode_s(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Seconds until every one of `prompts` has its `max_tokens` tokens from the decode engine."""

        async def one(prompt: list[int]) -> None:
            async for _ in self.decode.generate(self.request(prompt, max_tokens)):
                pass

        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - started


async def _median(repeats: int, once: Callable[[], Awaitable[float]]) -> float:
    return statistics.median([await once() for _ in range(repeats)])


async def _prefill_s(engines: _Engines, new: int, cached: int) -> float:
    head = engines.prompt(cached)
    if cached:
        await engines.decode_s([head], 1)  # the decode engine's prefix cache now holds it
    return await engines.decode_s([head + engines.prompt(new)], 1)


async def _step_s(engines: _Engines, batch: int, context: int, steps: int) -> float:
    prompts = [engines.prompt(context) for _ in range(batch)]
    await engines.decode_s(prompts, 1)  # computes them: cached from here on
    short = await engines.decode_s(prompts, 1)
    return max(0.0, (await engines.decode_s(prompts, steps + 1) - short) / steps)


async def _pull_s(engines: _Engines, tokens: int) -> float:
    prompt = engines.prompt(tokens)
    done = await engines.prefill.prefill(engines.request(prompt, 1))
    if done.kv_transfer_params is None:
        raise RuntimeError("the prefill engine handed no KV over: is its NIXL connector on?")
    before = engines.decode.counters.nixl_transfer_seconds
    async for _ in engines.decode.generate(engines.request(prompt, 1, done.kv_transfer_params)):
        pass
    await asyncio.sleep(0.2)  # the engine's statistics of that step reach its counters
    return engines.decode.counters.nixl_transfer_seconds - before


async def measure(
    engines: _Engines, plan: Plan, say: Callable[[str], None]
) -> dict[str, list[dict[str, float]]]:
    """The samples of each part, after a warm-up of each (its first requests pay one-off costs)."""
    await _prefill_s(engines, 256, 256)
    await _step_s(engines, 2, 64, 4)
    await _pull_s(engines, 256)
    room = engines.max_model_len - plan.decode_steps - 2
    prefill: list[dict[str, float]] = []
    for new, cached in itertools.product(plan.prefill_new, plan.prefill_cached):
        if new + cached <= room:
            s = await _median(plan.repeats, partial(_prefill_s, engines, new, cached))
            prefill.append({"new": new, "cached": cached, "s": s})
            say(f"prefill {new:5d} new after {cached:5d} cached: {s * 1e3:8.2f} ms")
    decode: list[dict[str, float]] = []
    k = plan.decode_steps
    for batch, context in itertools.product(plan.decode_batch, plan.decode_context):
        if context <= room:
            s = await _median(plan.repeats, partial(_step_s, engines, batch, context, k))
            decode.append({"batch": batch, "context": batch * (context + k / 2), "s": s})
            say(f"decode step, {batch:3d} sequences of {context:5d} tokens: {s * 1e3:8.2f} ms")
    transfer: list[dict[str, float]] = []
    for tokens in plan.transfer_tokens:
        if tokens <= room:
            s = await _median(plan.repeats, partial(_pull_s, engines, tokens))
            transfer.append({"tokens": tokens, "s": s})
            say(f"KV pull of {tokens:5d} tokens: {s * 1e3:8.2f} ms")
    return {"prefill": prefill, "decode": decode, "transfer": transfer}


def _one_engine(spec: EngineSpec) -> EngineSpec:
    """The spec a replica of the pool gets: its first core binding."""
    return msgspec.structs.replace(spec, cpu_threads_bind=spec.cpu_threads_bind[:1])


def start_engines(topo: Topology) -> _Engines:
    if topo.pools.prefill.replicas == 0:
        raise TopologyError(
            "pools.prefill.replicas", "the KV pull is measured between a prefill and a decode engine"
        )
    if topo.pools.decode.engine_gpus > 1 or topo.pools.prefill.engine_gpus > 1:
        raise TopologyError(
            "pools", "engines of more than one GPU are placed by Ray: measure them on the cluster"
        )
    prefill = PrefillEngine(
        _one_engine(engine_spec(topo, "prefill")), replica_id="p", node_id="local", node_ip="127.0.0.1"
    )
    prefill.start()
    decode = DecodeEngine(
        _one_engine(engine_spec(topo, "decode")), replica_id="d", node_id="local", node_ip="127.0.0.1"
    )
    decode.start()
    return _Engines(prefill, decode, topo.model.max_model_len)


def write_report(out: Path, fitted: MeasuredTiming, what: dict[str, Any]) -> None:
    """The samples and the fit as JSON (`what`, the machine, the time, the fit), and the topology's section
    printed."""
    machine = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}"}
    when = {"when": time.strftime("%Y-%m-%d %H:%M:%S")}
    fit_doc = {"fit": msgspec.to_builtins(fitted)}
    out.write_text(json.dumps(what | machine | when | fit_doc, indent=1))
    print(f"\nsamples and fit: {out}\nthe topology's section:\n")
    print(yaml.safe_dump({"router": {"service_time": {"measured": fit_doc["fit"]}}}, sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", type=Path, default=REPO / "deploy" / "local.yaml")
    ap.add_argument("--out", type=Path, default=Path("engine-timing.json"))
    ap.add_argument("--quick", action="store_true", help="a few points, once each (a smoke test)")
    args = ap.parse_args(argv)
    try:
        topo = load_topology(args.topology)
        engines = start_engines(topo)
    except TopologyError as exc:
        print(f"bench.engine_timing: {exc}", file=sys.stderr)
        return 2
    try:
        samples = asyncio.run(
            measure(engines, QUICK if args.quick else Plan(), lambda line: print(line, flush=True))
        )
    finally:
        engines.prefill.shutdown()
        engines.decode.shutdown()
    fitted = fit(samples)
    write_report(
        args.out,
        fitted,
        {"topology": str(args.topology), "model": topo.model.name, "samples": samples},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
