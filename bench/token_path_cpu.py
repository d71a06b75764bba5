"""CPU per streamed token of the processes that handle the tokens, pdserve against plain vLLM, in one run.

Each system (as `pdserve bench --side-by-side` names them: `aggregated`, `pd`, `vllm`, `aggregated@REV`)
is started here in turn and sent the same seeded closed-loop workload after a warm-up. The CPU time
(user + system) of its token-path processes is read before and after:
    pdserve: the Serve replica actors of its router and its engines (and `pdserve up`, which only watches)
    vllm:    its API server process
Engine cores (`VLLM::EngineCore`, the model's compute) and Ray's daemons are reported apart, and so is what
the token path and the daemons spend idle (CPU-seconds per second, read before the windows): a fixed cost
that a window's CPU per token includes its share of.

    .venv/bin/python -m bench.token_path_cpu --systems aggregated@0b48427,aggregated,vllm

On a shared machine one run's ratio moves by more than most changes do; `--rounds N` runs the systems N times,
in turn forward and backward (each system sees each place in the order), and prints each round's ratios and
their median. Each round starts every system anew; with `--warm` the systems stay up instead, the vLLM base
(last) beside each pdserve system in turn, so a round's systems are measured seconds apart, warm (processes
are told apart by which system started them):

    .venv/bin/python -m bench.token_path_cpu --warm --rounds 8 --systems pd+http,aggregated+http,vllm

On engine doubles (no engine compute; 20 ms a token), the serving layer's own limits, before against after:

    .venv/bin/python -m bench.token_path_cpu --systems doubles@REV,doubles --concurrency 16,64,128 \
        --input-len fixed:512 --output-len fixed:100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import msgspec
import psutil

from bench.live.cli import DEFAULT_SLO, LOCAL_TOPOLOGY, build_parser, measure
from bench.live.systems import VLLM_SYSTEMS, known, started

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


def cpu_by_kind(
    procs: Iterable[psutil.Process], belongs: Callable[[psutil.Process], bool] = lambda p: True
) -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) of each classified process that `belongs` (to the system read), keyed
    (kind, pid)."""
    out = {}
    for p in procs:
        try:
            k = kind(" ".join(p.cmdline()) or p.name())
            if k is not None and belongs(p):
                t = p.cpu_times()
                out[(k, p.pid)] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


class Owners:
    """Which system each process is part of: those that appeared while the system started, and whatever they
    start later. Systems up side by side (`--warm`) are read apart by it."""

    def __init__(self) -> None:
        self._system: dict[int, str] = {}

    @contextmanager
    def started(self, system: str) -> Iterator[str]:
        """`system` started (bench/live/systems.py), its processes noted; yields its address."""
        before = set(psutil.pids())
        with started(system, LOCAL_TOPOLOGY) as address:
            for pid in set(psutil.pids()) - before:
                self._system.setdefault(pid, system)
            try:
                yield address
            finally:
                self._system = {pid: s for pid, s in self._system.items() if s != system}

    def of(self, proc: psutil.Process) -> str | None:
        if (system := self._system.get(proc.pid)) is None:
            for parent in proc.parents():
                if (system := self._system.get(parent.pid)) is not None:
                    self._system[proc.pid] = system
                    break
        return system


def spent(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> dict[str, float]:
    """CPU seconds per kind between two readings (a process that started in between counts from zero)."""
    total: dict[str, float] = {"token": 0.0, "engine": 0.0, "daemon": 0.0}
    for key, seconds in after.items():
        total[key[0]] += seconds - before.get(key, 0.0)
    return total


class Ratio(NamedTuple):
    """One system against the base system at one concurrency, in one round."""

    system: str
    clients: int
    cpu_per_token: float  # its token-path CPU per streamed token over the base's
    tokens_per_s: float  # its streamed tokens/s over the base's


def ratios(rows: list[tuple[int, str, int, float, float, float]], base_system: str) -> list[Ratio]:
    """Rows of (round, system, clients, tokens streamed, tokens/s, token-path CPU s): each other system's
    ratios to `base_system` in the same round and at the same concurrency."""
    base = {(n, c): (tokens, rate, cpu) for n, system, c, tokens, rate, cpu in rows if system == base_system}
    out = []
    for n, system, c, tokens, rate, cpu in rows:
        if system != base_system:
            b_tokens, b_rate, b_cpu = base[(n, c)]
            per_token = (cpu / max(tokens, 1)) / max(b_cpu / max(b_tokens, 1), 1e-12)
            out.append(Ratio(system, c, per_token, rate / b_rate))
    return out


def by_system(per_round: list[Ratio]) -> dict[tuple[str, int], list[Ratio]]:
    """The rounds' ratios of each (system, concurrency), in first-seen order."""
    groups: dict[tuple[str, int], list[Ratio]] = {}
    for r in per_round:
        groups.setdefault((r.system, r.clients), []).append(r)
    return groups


def median_ratio(rounds: list[Ratio]) -> Ratio:
    """One (system, concurrency)'s median ratios over its rounds."""
    cpu = statistics.median(r.cpu_per_token for r in rounds)
    return Ratio(rounds[0].system, rounds[0].clients, cpu, statistics.median(r.tokens_per_s for r in rounds))


def _bench_args(argv: list[str]) -> argparse.Namespace:
    """`pdserve bench`'s arguments, completed as its main completes them (no token, the default SLO)."""
    args = build_parser().parse_args(argv)
    args.slo = msgspec.structs.replace(DEFAULT_SLO, **args.slo)
    args.token = None
    return args


class _Bench:
    """The measurements of one run: a row per (round, system, concurrency), and each system's idle daemons."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.owners = Owners()
        self.rows: list[tuple[int, str, int, float, Any, dict[str, float]]] = []
        # (round, system) -> CPU-seconds per second idle: (daemons, token path)
        self.idle: dict[tuple[int, str], tuple[float, float]] = {}

    def restarted(self, systems: list[str]) -> None:
        """Each round starts every system in turn and stops it after."""
        for n in range(self.args.rounds):
            for system in systems if n % 2 == 0 else systems[::-1]:
                print(f"starting {system} (round {n + 1} of {self.args.rounds}) ...", flush=True)
                with self.owners.started(system) as address:
                    self.idle[n, system] = self._idle(system)
                    self._windows(n, system, address)

    def warm(self, systems: list[str]) -> None:
        """The vLLM systems start once and stay up; each pdserve system starts in turn beside them, and the
        rounds alternate between the systems up, warm, seconds apart rather than a start apart."""
        base = [s for s in systems if s in VLLM_SYSTEMS]
        phases: list[str | None] = [s for s in systems if s not in VLLM_SYSTEMS] or [None]
        with contextlib.ExitStack() as up:
            addresses = {}
            for system in base:
                print(f"starting {system} ...", flush=True)
                addresses[system] = up.enter_context(self.owners.started(system))
            for phase, pdserve in enumerate(phases):
                with contextlib.ExitStack() as phase_up:
                    if pdserve is not None:
                        print(f"starting {pdserve} beside {', '.join(base)} ...", flush=True)
                        addresses[pdserve] = phase_up.enter_context(self.owners.started(pdserve))
                    running = [s for s in systems if s in addresses]
                    idle = {s: self._idle(s) for s in running}
                    for fresh in [pdserve] if phase else running:
                        if fresh is not None:  # a first window of its own, unread: caches, connections
                            self._windows(-1, fresh, addresses[fresh])
                    for k in range(self.args.rounds):
                        n = phase * self.args.rounds + k
                        for system in running if k % 2 == 0 else running[::-1]:
                            self.idle[n, system] = idle[system]
                            self._windows(n, system, addresses[system])
                    if pdserve is not None:
                        del addresses[pdserve]

    def _idle(self, system: str) -> tuple[float, float]:
        """CPU-seconds per second of the system's daemons and of its token path, serving and sent nothing:
        the fixed cost (a window's token-path CPU includes the latter's share of it)."""
        belongs = partial(self._belongs, system)
        before = cpu_by_kind(psutil.process_iter(), belongs)
        time.sleep(self.args.idle_s)
        used = spent(before, cpu_by_kind(psutil.process_iter(), belongs))
        return used["daemon"] / self.args.idle_s, used["token"] / self.args.idle_s

    def _windows(self, n: int, system: str, address: str) -> None:
        """The workload at each concurrency against one system, after a warm-up; a row each (round n < 0:
        none, the system is being warmed)."""
        belongs = partial(self._belongs, system)
        for clients in [int(c) for c in self.args.concurrency.split(",")]:
            common = ["--mode", "concurrency", "--concurrency", str(clients), "--warmup", "0"]
            common += ["--input-len", self.args.input_len, "--output-len", self.args.output_len]
            warmup = _bench_args([*common, "--num-requests", str(clients)])
            run = _bench_args([*common, "--num-requests", str(max(self.args.num_requests, clients))])
            asyncio.run(measure(warmup, address))
            before = cpu_by_kind(psutil.process_iter(), belongs)
            _, _, results = asyncio.run(measure(run, address))
            used = spent(before, cpu_by_kind(psutil.process_iter(), belongs))
            (r,) = results
            if n >= 0:
                self.rows.append((n, system, clients, r.output_tokens_per_s * r.duration_s, r, used))

    def _belongs(self, system: str, proc: psutil.Process) -> bool:
        return self.owners.of(proc) == system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="aggregated,vllm")
    ap.add_argument("--concurrency", default="16", help="clients; a comma list runs each in turn")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--input-len", default="fixed:256")
    ap.add_argument("--output-len", default="fixed:128")
    ap.add_argument("--idle-s", type=float, default=10.0, help="how long the idle daemons are read")
    ap.add_argument(
        "--rounds", type=int, default=1, help="the systems run this many times, alternating order"
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="keep the systems up between rounds: the vLLM base beside each pdserve system in turn",
    )
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    if unknown := [s for s in systems if not known(s)]:
        ap.error(f"unknown system {', '.join(unknown)}")
    if args.warm and systems[-1] not in VLLM_SYSTEMS:
        ap.error(f"--warm keeps the base (the last system) up throughout: it must be one of {VLLM_SYSTEMS}")
    bench = _Bench(args)
    if args.warm:
        bench.warm(systems)
    else:
        bench.restarted(systems)
    rows, idle = bench.rows, bench.idle
    print(
        f"\n{'round':>5} {'system':<22} {'c':>4} {'tok/s':>7} {'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
        f" {'failed':>6} {'token-path CPU s':>17} {'µs/token':>9} {'ms/request':>11} {'engine CPU s':>13}"
        f" {'daemons CPU s/s':>16} {'idle':>5} {'token path idle':>15}"
    )
    for n, system, clients, tokens, r, used in rows:
        daemons = used["daemon"] / r.duration_s
        per_request = used["token"] / max(r.requests, 1) * 1e3
        print(
            f"{n + 1:5d} {system:<22} {clients:4d} {r.output_tokens_per_s:7.0f}"
            f" {r.ttft_s['p50'] * 1e3:7.0f}ms {r.tpot_s['p50'] * 1e3:7.1f}ms {r.tpot_s['p99'] * 1e3:7.1f}ms"
            f" {sum(r.failed.values()):6d}"
            f" {used['token']:17.2f} {used['token'] / max(tokens, 1) * 1e6:9.0f} {per_request:11.2f}"
            f" {used['engine']:13.2f} {daemons:16.2f} {idle[n, system][0]:5.2f} {idle[n, system][1]:15.3f}"
        )
    base_system = systems[-1]
    per_round = ratios(
        [(n, s, c, tokens, r.output_tokens_per_s, used["token"]) for n, s, c, tokens, r, used in rows],
        base_system,
    )
    groups = by_system(per_round)
    print(f"\nratios to {base_system} at the same concurrency: CPU per token, tokens/s (each round)")
    for (system, clients), group in groups.items():
        cells = "  ".join(f"{r.cpu_per_token:5.2f}x {r.tokens_per_s:5.2f}x" for r in group)
        print(f"{system:<22} {clients:4d} {cells}")
    if args.rounds > 1:
        print("\nmedian over the rounds")
        for group in groups.values():
            m = median_ratio(group)
            cells = f"{m.cpu_per_token:6.2f}x {m.tokens_per_s:6.2f}x"
            print(f"{m.system:<22} {m.clients:4d} {cells}  ({len(group)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
