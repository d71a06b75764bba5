"""CPU per streamed token of the processes that handle the tokens, pdserve against plain vLLM, in one run.

Each system (as `pdserve bench --side-by-side` names them: `aggregated`, `pd`, `vllm`, `aggregated@REV`)
is started here in turn and sent the same seeded closed-loop workload after a warm-up. The CPU time
(user + system) of its token-path processes is read before and after:
    pdserve: the Serve replica actors of its router and its engines (and `pdserve up`, which only watches)
    vllm:    its API server process
Engine cores (`VLLM::EngineCore`, the model's compute) and Ray's daemons are reported apart.

    .venv/bin/python -m bench.token_path_cpu --systems aggregated@0b48427,aggregated,vllm

On engine doubles (no engine compute; 20 ms a token), the serving layer's own limits, before against after:

    .venv/bin/python -m bench.token_path_cpu --systems doubles@REV,doubles --concurrency 16,64,128 \
        --input-len fixed:512 --output-len fixed:100
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterable

import msgspec
import psutil

from bench.live.cli import DEFAULT_SLO, LOCAL_TOPOLOGY, build_parser, measure
from bench.live.systems import known, started

# What a process is, by its command line: token path, engine, or Ray/Serve daemon.
_ENGINE = ("VLLM::EngineCore", "VLLM::Worker")
_TOKEN_PATH = (
    "ServeReplica:pdserve:router",
    "pdserve up",  # where the router ran before it was a replica (an older REV); today it only watches
    "ServeReplica:pdserve:decode",
    "ServeReplica:pdserve:prefill",
    "vllm.entrypoints.openai.api_server",
)
_DAEMONS = ("gcs_server", "raylet", "dashboard", "ServeController", "log_monitor", "runtime_env", "ray::")


def kind(cmdline: str) -> str | None:
    """ "token", "engine" or "daemon" for a process of a system under test; None for anything else."""
    if any(m in cmdline for m in _ENGINE):
        return "engine"
    if any(m in cmdline for m in _TOKEN_PATH):
        return "token"
    if any(m in cmdline for m in _DAEMONS):
        return "daemon"
    return None


def cpu_by_kind(procs: Iterable[psutil.Process]) -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) of each classified process, keyed (kind, pid)."""
    out = {}
    for p in procs:
        try:
            k = kind(" ".join(p.cmdline()) or p.name())
            if k is not None:
                t = p.cpu_times()
                out[(k, p.pid)] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def spent(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> dict[str, float]:
    """CPU seconds per kind between two readings (a process that started in between counts from zero)."""
    total: dict[str, float] = {"token": 0.0, "engine": 0.0, "daemon": 0.0}
    for key, seconds in after.items():
        total[key[0]] += seconds - before.get(key, 0.0)
    return total


def _bench_args(argv: list[str]) -> argparse.Namespace:
    """`pdserve bench`'s arguments, completed as its main completes them (no token, the default SLO)."""
    args = build_parser().parse_args(argv)
    args.slo = msgspec.structs.replace(DEFAULT_SLO, **args.slo)
    args.token = None
    return args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="aggregated,vllm")
    ap.add_argument("--concurrency", default="16", help="clients; a comma list runs each in turn")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--input-len", default="fixed:256")
    ap.add_argument("--output-len", default="fixed:128")
    ap.add_argument("--idle-s", type=float, default=10.0, help="how long the idle daemons are read")
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    if unknown := [s for s in systems if not known(s)]:
        ap.error(f"unknown system {', '.join(unknown)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    idle: dict[str, float] = {}
    for system in systems:
        print(f"starting {system} ...", flush=True)
        with started(system, LOCAL_TOPOLOGY) as address:
            before = cpu_by_kind(psutil.process_iter())
            time.sleep(args.idle_s)  # started and serving, no request: the fixed cost
            idle[system] = spent(before, cpu_by_kind(psutil.process_iter()))["daemon"] / args.idle_s
            for clients in levels:
                common = ["--mode", "concurrency", "--concurrency", str(clients)]
                common += ["--input-len", args.input_len, "--output-len", args.output_len, "--warmup", "0"]
                warmup = _bench_args([*common, "--num-requests", str(clients)])
                run = _bench_args([*common, "--num-requests", str(max(args.num_requests, clients))])
                asyncio.run(measure(warmup, address))
                before = cpu_by_kind(psutil.process_iter())
                _, _, results = asyncio.run(measure(run, address))
                used = spent(before, cpu_by_kind(psutil.process_iter()))
                (r,) = results
                rows.append((system, clients, r.output_tokens_per_s * r.duration_s, r, used))
    print(
        f"\n{'system':<22} {'c':>4} {'tok/s':>7} {'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
        f" {'failed':>6} {'token-path CPU s':>17} {'µs/token':>9} {'ms/request':>11} {'engine CPU s':>13}"
        f" {'daemons CPU s/s':>16} {'idle':>5}"
    )
    for system, clients, tokens, r, used in rows:
        daemons = used["daemon"] / r.duration_s
        per_request = used["token"] / max(r.requests, 1) * 1e3
        print(
            f"{system:<22} {clients:4d} {r.output_tokens_per_s:7.0f} {r.ttft_s['p50'] * 1e3:7.0f}ms"
            f" {r.tpot_s['p50'] * 1e3:7.1f}ms {r.tpot_s['p99'] * 1e3:7.1f}ms {sum(r.failed.values()):6d}"
            f" {used['token']:17.2f} {used['token'] / max(tokens, 1) * 1e6:9.0f} {per_request:11.2f}"
            f" {used['engine']:13.2f} {daemons:16.2f} {idle[system]:5.2f}"
        )
    base_system = systems[-1]
    print(f"\nratios to {base_system} at the same concurrency: CPU per token, tokens/s")
    base = {c: (tokens, r, used) for system, c, tokens, r, used in rows if system == base_system}
    for system, clients, tokens, r, used in rows:
        if system == base_system:
            continue
        b_tokens, b_r, b_used = base[clients]
        per_token = (used["token"] / tokens) / max(b_used["token"] / b_tokens, 1e-12)
        ratio = r.output_tokens_per_s / b_r.output_tokens_per_s
        print(f"{system:<22} {clients:4d} {per_token:6.2f}x {ratio:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
