"""TTFT and TPOT of the same requests through prefill/decode disaggregation and through one engine.

Both runs go through everything a user's request does (gRPC, router, Serve handles, vLLM): once on the
P/D topology (a prefill engine, a decode engine, KV over NIXL), once on the same topology with no prefill
pool (one plain vLLM engine, no KV connector). Same prompts, same order, greedy, one at a time and then
with several in flight. Prints one table with both and their ratio.

    .venv/bin/python -m bench.serving_latency [--topology deploy/local.yaml] [--requests 12] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from cluster.cli import READY_LINE
from engine.host import free_ports

REPO = Path(__file__).resolve().parents[1]
PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def _topology(base: Path, out: Path, *, disaggregated: bool) -> dict[str, Any]:
    topo = yaml.safe_load(base.read_text())
    grpc, metrics, dashboard = free_ports(3)  # distinct: the topology refuses a port used twice
    topo["server"]["grpc_port"], topo["server"]["metrics_port"] = grpc, metrics
    topo["ray"]["dashboard_port"] = dashboard
    if disaggregated:
        # Every request through prefill -> NIXL -> decode (no local-prefill shortcut): this measures the path.
        topo["router"]["mode"] = "disaggregate"
    else:
        topo["pools"]["prefill"]["replicas"] = 0
    out.write_text(yaml.safe_dump(topo))
    return topo


class LocalCluster:
    """`pdserve up -f topology` in a subprocess, ready once it prints its ready line; `down()` stops it."""

    def __init__(self, topology: Path) -> None:
        self.ready_s = 0.0
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [PDSERVE, "up", "-f", str(topology)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        ready = threading.Event()
        self.log: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith(READY_LINE):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError("pdserve up failed:\n" + "".join(self.log[-40:]))
        self.ready_s = time.monotonic() - started

    def down(self) -> None:
        subprocess.run([PDSERVE, "down"], capture_output=True, timeout=300)
        self.proc.wait(timeout=120)


def _one(client: Any, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    """Client-side TTFT and TPOT (s) of one streamed request."""
    sent = time.monotonic()
    first = last = 0.0
    n = 0
    for message in client.generate(
        token_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True, temperature=0.0
    ):
        if message.token_ids:
            last = time.monotonic()
            if n == 0:
                first = last
            n += len(message.token_ids)
    return first - sent, (last - first) / max(n - 1, 1)


def _measure(
    target: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> list[tuple[float, float]]:
    from router.client import PdserveClient

    client = PdserveClient(target, timeout=600)
    try:
        _one(client, prompts[0][:64], 4)  # warm-up (first-request costs: connections, allocator)
        if concurrency == 1:
            return [_one(client, p, max_tokens) for p in prompts]
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: _one(client, p, max_tokens), prompts))
    finally:
        client.close()


def _prompts(n: int, lengths: list[int]) -> list[list[int]]:
    # Distinct token ids per prompt: no prefix is shared, so every prompt is a full prefill.
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        out.append([(7 + i * 131 + j * 17) % 1900 + 50 for j in range(length)])
    return out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", type=Path, default=REPO / "deploy" / "local.yaml")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--lengths", default="256,1024", help="prompt lengths in tokens, cycled")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4, help="second pass: requests in flight")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    prompts = _prompts(args.requests, [int(x) for x in args.lengths.split(",")])
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("pd", "single"):
            path = Path(tmp) / f"{mode}.yaml"
            topo = _topology(args.topology, path, disaggregated=mode == "pd")
            cluster = LocalCluster(path)
            try:
                target = f"127.0.0.1:{topo['server']['grpc_port']}"
                results[mode] = {
                    "ready_s": cluster.ready_s,
                    "seq": _measure(target, prompts, args.max_tokens, 1),
                    "conc": _measure(target, prompts, args.max_tokens, args.concurrency),
                }
            finally:
                cluster.down()
    print(
        f"\n{args.requests} requests, prompt lengths {args.lengths}, {args.max_tokens} output tokens, greedy"
    )
    print(
        f"cold start (pdserve up until serving): P/D {results['pd']['ready_s']:.1f} s, "
        f"single {results['single']['ready_s']:.1f} s"
    )
    print(f"{'metric':<34}{'P/D':>12}{'single':>12}{'P/D / single':>14}")
    for phase, label in (("seq", "1 in flight"), ("conc", f"{args.concurrency} in flight")):
        for idx, name in ((0, "TTFT"), (1, "TPOT")):
            for stat, fn in (("p50", lambda v: statistics.median(v)), ("p95", lambda v: _pct(v, 0.95))):
                pd = fn([r[idx] for r in results["pd"][phase]]) * 1e3
                single = fn([r[idx] for r in results["single"][phase]]) * 1e3
                print(f"{f'{name} {stat} ms ({label})':<34}{pd:>12.1f}{single:>12.1f}{pd / single:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
