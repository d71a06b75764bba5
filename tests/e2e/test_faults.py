"""Failures on real engines (one prefill and two decode vLLM replicas on CPU), with 8 greedy streams in
flight: whatever dies, every stream completes, token for token the output of a run without the failure.
A stream whose decode replica dies mid-way goes on on the other one (the tokens so far appended to its
prompt), the dead replica leaves routing at once, and Serve replaces it.

Faults, in turn: a decode replica's vLLM worker process is killed, then its engine core, then the replica's
actor process; a decode engine is frozen (SIGSTOP: no error, no progress); the prefill engine is killed
while the streams' prefill legs and KV transfers are in flight. The times from the fault to the replica
leaving routing and to a replacement serving are printed."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import pytest
from e2e_support import RunningCluster, make_topology

from cluster.bootstrap import APP_NAME, RunState
from router.client import Completion, PdserveClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STREAMS = 8
MAX_TOKENS = 400  # streams long enough to be caught mid-way
# Distinct prompts (the module's router always disaggregates: see `cluster`).
PROMPTS = [
    f"Agent {i}: summarise the failure log of build {i * 7919} and list the flaky tests. " * 12
    for i in range(STREAMS)
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    topology = make_topology(
        tmp_path_factory.mktemp("faults"),
        pools__decode__replicas=2,
        pools__decode__cpu__threads_bind=["1", "0"],  # each decode engine a core of its own
        pools__decode__hang_timeout_s=3.0,  # the frozen engine: a step of the tiny model takes milliseconds
        # Every request (and every continuation) takes the prefill -> NIXL -> decode path, cached or not.
        router__local_prefill_max_tokens=0,
        router__long_local_prefill=False,
        router__prefill_overflow_queue_s=None,
    )
    running = RunningCluster(topology)
    try:
        running.wait_ready()
        yield running
    finally:
        running.down()


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> Iterator[PdserveClient]:
    c = PdserveClient(cluster.target, timeout=300)
    wait_for(lambda: len(ready(c, "decode")) == 2 or None, 120, "both decode replicas")
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(client: PdserveClient) -> list[list[int]]:
    """Each prompt's output with nothing failing."""
    return [generate(client, p).token_ids for p in PROMPTS]


def generate(client: PdserveClient, prompt: str) -> Completion:
    return client.generate_text(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def wait_for(probe: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := probe()) is not None:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Streams:
    """STREAMS greedy requests at once, each on its own thread."""

    def __init__(self, client: PdserveClient) -> None:
        self.results: list[Completion | BaseException | None] = [None] * STREAMS
        self.threads = [threading.Thread(target=self._run, args=(client, i)) for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, client: PdserveClient, i: int) -> None:
        try:
            self.results[i] = generate(client, PROMPTS[i])
        except BaseException as exc:
            self.results[i] = exc

    def join(self) -> list[Completion]:
        for t in self.threads:
            t.join(timeout=600)
        failed = [r for r in self.results if not isinstance(r, Completion)]
        assert failed == [], failed
        return [r for r in self.results if isinstance(r, Completion)]


def ready(client: PdserveClient, role: str) -> dict[str, int]:
    """Replicas of `role` the router can use, with their running requests."""
    return {
        r.replica_id: r.running_requests
        for r in client.cluster_status()
        if r.role == role and r.state == "READY"
    }


def busiest_decode(client: PdserveClient) -> str | None:
    """The decode replica with the most streams running on it, once one has two (engine stats, 2 s)."""
    running = ready(client, "decode")
    rid, n = max(running.items(), key=lambda kv: kv[1], default=("", 0))
    return rid if n >= 2 else None


def replica_pid(role: str, replica_id: str) -> int:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    state = RunState.load()
    assert state is not None
    details = ServeSubmissionClient(state.dashboard_url).get_serve_details()
    for r in details["applications"][APP_NAME]["deployments"][role]["replicas"]:
        if r["replica_id"] == replica_id:
            return int(r["pid"])
    raise AssertionError(f"no Serve replica {replica_id}")


def engine_process(role: str, replica_id: str, name: str) -> psutil.Process:
    """The replica's vLLM process called `name` (VLLM::EngineCore, or its VLLM::Worker: on CPU the engine
    core drives one worker process, which runs the model)."""
    children = psutil.Process(replica_pid(role, replica_id)).children(recursive=True)
    found = [p for p in children if p.name().startswith(name[:15])]  # the kernel keeps 15 characters
    assert len(found) == 1, [(p.pid, p.name()) for p in children]
    return found[0]


class Fault:
    """What to break, on which replica, and when: `victim(client)` returns the replica once the moment has
    come (None: not yet)."""

    def __init__(self, name: str, role: str, victim: Callable[[PdserveClient], str | None]) -> None:
        self.name, self.role, self.victim = name, role, victim
        self.stopped: psutil.Process | None = None

    def __repr__(self) -> str:
        return self.name

    def inject(self, replica_id: str) -> None:
        if self.name == "replica_actor":
            # The actor process dies at once (a crash, an OOM kill); its engine core follows it.
            psutil.Process(replica_pid(self.role, replica_id)).send_signal(signal.SIGKILL)
        elif self.name == "frozen_engine":
            self.stopped = engine_process(self.role, replica_id, "VLLM::EngineCore")
            self.stopped.send_signal(signal.SIGSTOP)
        else:
            process = "VLLM::Worker" if self.name.endswith("worker") else "VLLM::EngineCore"
            engine_process(self.role, replica_id, process).send_signal(signal.SIGKILL)

    def clean_up(self) -> None:
        if self.stopped is not None and self.stopped.is_running():
            self.stopped.send_signal(signal.SIGKILL)


def any_prefill(client: PdserveClient) -> str | None:
    # At once: the streams' prefill legs (and their KV transfers) are in flight.
    return next(iter(ready(client, "prefill")), None)


FAULTS = [
    Fault("decode_worker", "decode", busiest_decode),
    Fault("decode_engine_core", "decode", busiest_decode),
    Fault("replica_actor", "decode", busiest_decode),
    Fault("frozen_engine", "decode", busiest_decode),
    Fault("prefill_engine_core", "prefill", any_prefill),
]


@pytest.mark.parametrize("fault", FAULTS, ids=repr)
def test_every_stream_survives_a_failure_token_for_token(
    fault: Fault, client: PdserveClient, reference: list[list[int]]
) -> None:
    wait_for(
        lambda: True if len(ready(client, "decode")) == 2 and len(ready(client, "prefill")) == 1 else None,
        240,
        "the whole cluster ready",
    )
    streams = Streams(client)
    victim = wait_for(lambda: fault.victim(client), 120, f"the moment to break a {fault.role} replica")
    assert isinstance(victim, str)
    try:
        killed_at = time.monotonic()
        fault.inject(victim)
        wait_for(lambda: True if victim not in ready(client, fault.role) else None, 60, "the victim to go")
        out_of_routing_s = time.monotonic() - killed_at
        done = streams.join()
        assert [c.token_ids for c in done] == reference
        moved = [c for c in done if f"continued after {fault.role} replica" in c.served_by.note]
        if fault.role == "decode":
            assert moved, "no stream was running on the broken replica"
            assert all(c.served_by.decode_replica != victim for c in moved)
        wait_for(
            lambda: True if len(ready(client, fault.role)) == (2 if fault.role == "decode" else 1) else None,
            240,
            "Serve to replace the replica",
        )
        replaced_s = time.monotonic() - killed_at
    finally:
        fault.clean_up()
    print(
        f"{fault.name}: {len(moved)}/{STREAMS} streams moved; out of routing after "
        f"{out_of_routing_s:.2f} s, a replacement serving after {replaced_s:.1f} s"
    )
