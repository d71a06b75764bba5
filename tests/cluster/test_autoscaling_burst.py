"""Autoscaling on a running cluster: a 5x burst of clients scales prefill and decode up until the load is back
within their targets, the quiet after scales both down, and every replica scaled away drains: no request of
all those sent fails or loses a token. A fake multi-node Ray cluster runs the real Serve application (its
controller runs pdserve's autoscaling policy), registry and gRPC router on the engine test double
(tests/cluster/fake_cluster.py): only the engines' times are simulated."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from fake_cluster import Env, double_topology, running, serve_replicas, wait_until

from cluster.topology import Topology
from engine.double import DoubleTiming
from pdserve_client.sdk import PdserveClient, PdserveError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PROMPT_TOKENS = 1800  # x 20 us a token: a 36 ms prefill on the double; random, so never cached
MAX_TOKENS = 8  # x 20 ms a token
QUIET, BURST = 2, 10  # clients sending back to back
TTFT_SLO_MS = 1000.0


def autoscaled(dashboard_port: int) -> Topology:
    double = DoubleTiming()
    return double_topology(
        dashboard_port,
        prefill={"autoscaling": {"max_replicas": 3, "window_s": 2, "downscale_delay_s": 4}},
        decode={
            "engine": {"max_num_seqs": 8},
            "autoscaling": {"max_replicas": 3, "running_seqs": 2, "window_s": 2, "downscale_delay_s": 4},
        },
        router={
            "ttft_slo_ms": TTFT_SLO_MS,
            # The router's service times are the double's: its queue estimates are what the engines do.
            "service_time": {
                "measured": {
                    "prefill_fixed_s": 0.0,
                    "prefill_token_s": double.prefill_s_per_token,
                    "prefill_pair_s": 0.0,
                    "decode_step_s": double.decode_s_per_token,
                    "decode_seq_s": 0.0,
                    "decode_context_token_s": 0.0,
                    "transfer_fixed_s": 0.0,
                    "transfer_token_s": 0.0,
                }
            },
        },
    )


@dataclass
class Sent:
    started: float
    ended: float
    code: grpc.StatusCode
    tokens: int = 0
    ttft_ms: float = 0.0
    decode_replica: str = ""
    prefill_replica: str = ""


@dataclass
class Clients:
    """Clients sending long random prompts back to back; how many run changes with `set`."""

    target: str
    sent: list[Sent] = field(default_factory=list)
    _stops: list[threading.Event] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, n: int) -> None:
        while len(self._stops) > n:
            self._stops.pop().set()
        while len(self._stops) < n:
            stop = threading.Event()
            thread = threading.Thread(target=self._loop, args=(stop, len(self._stops)), daemon=True)
            self._stops.append(stop)
            self._threads.append(thread)
            thread.start()

    def _loop(self, stop: threading.Event, index: int) -> None:
        rng = random.Random(index)
        with PdserveClient(self.target, reconnect_s=0) as client:
            while not stop.is_set():
                prompt = [rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)]
                started = time.monotonic()
                try:
                    done = client.generate_text(
                        token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60
                    )
                    sent = Sent(
                        started,
                        time.monotonic(),
                        grpc.StatusCode.OK,
                        len(done.token_ids),
                        done.timings.ttft_ms,
                        done.served_by.decode_replica,
                        done.served_by.prefill_replica,
                    )
                except PdserveError as exc:
                    sent = Sent(started, time.monotonic(), exc.code)
                with self._lock:
                    self.sent.append(sent)

    def stop(self) -> list[Sent]:
        self.set(0)
        for thread in self._threads:
            thread.join(timeout=90)
        with self._lock:
            return list(self.sent)

    def since(self, t: float) -> list[Sent]:
        with self._lock:
            return [s for s in self.sent if s.started >= t]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with running(lambda cluster: autoscaled(cluster.dashboard_port), decode_nodes=2) as env:
        yield env


def counts(env: Env) -> tuple[int, int]:
    url = env.cluster.dashboard_url
    return len(serve_replicas(url, "prefill")), len(serve_replicas(url, "decode"))


async def test_a_burst_scales_both_pools_up_and_the_quiet_drains_them_without_a_lost_request(
    env: Env,
) -> None:
    clients = Clients(env.router.target)
    seen: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    try:
        clients.set(QUIET)
        quiet_at = time.monotonic()
        await wait_until(lambda: len(clients.since(quiet_at)) >= 20, 60, "the quiet load's first requests")
        assert counts(env) == (1, 1), "the quiet load needs one replica of each pool"

        burst_at = time.monotonic()
        clients.set(BURST)
        up = await wait_until(lambda: (c := counts(env))[0] > 1 and c[1] > 1 and c, 60, "both pools up")
        scaled_at = time.monotonic()
        # Once the new replicas serve, the burst's requests are back within the TTFT target.
        await wait_until(lambda: len(clients.since(scaled_at + 4)) >= 40, 60, "requests after scaling")
        settled = [s for s in clients.since(scaled_at + 4) if s.code == grpc.StatusCode.OK]
        for s in clients.since(burst_at):
            seen["prefill"].add(s.prefill_replica)
            seen["decode"].add(s.decode_replica)

        clients.set(QUIET)
        quiet_again = time.monotonic()
        await wait_until(lambda: counts(env) == (1, 1), 90, "both pools back to one replica")
        down_s = time.monotonic() - quiet_again
        drained_at = time.monotonic()
        # A router learns of a draining replica at its next poll of the registry (every second).
        await wait_until(lambda: len(clients.since(drained_at + 3)) >= 10, 30, "requests after the drain")
    finally:
        sent = clients.stop()
    kept = {s.decode_replica for s in clients.since(drained_at + 3)}
    ttft_p90 = statistics.quantiles([s.ttft_ms for s in settled], n=10)[-1]
    print(
        f"up to {up} in {scaled_at - burst_at:.1f} s; TTFT p90 after {ttft_p90:.0f} ms;"
        f" down in {down_s:.1f} s; replicas used {len(seen['prefill'] - {''})} prefill,"
        f" {len(seen['decode'])} decode; {len(sent)} sent"
    )
    assert [s for s in sent if s.code != grpc.StatusCode.OK] == []
    assert all(s.tokens == MAX_TOKENS for s in sent)
    assert ttft_p90 <= TTFT_SLO_MS
    # The new replicas served the burst, and the ones scaled away took no request after they drained.
    assert len(seen["decode"]) > 1 and len(seen["prefill"] - {""}) > 1
    assert len(kept) == 1
    # Streams in flight on a decode replica while it was being scaled away finished there, whole.
    removed = seen["decode"] - kept
    assert [s for s in sent if s.decode_replica in removed and s.ended > quiet_again]
